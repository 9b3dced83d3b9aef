"""Continuous batching: a sequence joins the running batch at the next decode step and leaves it
the moment it ends, so no sequence waits for another's to end.

Sequences are submitted from any thread (`submit`: a prompt, its sampling parameters, budget and
stop rule, the generator its draws come from, the adapter its rows go through) and completed on
futures. One loop repeats a step (on this engine's thread, or through `run_step`: a base-model
worker's compute thread):

1. admit: the waiting sequences that fit (up to `max_batch_size` rows; `admits` may hold one back,
   as an engine whose adapter is merged into its weights does) are prefilled together: a prompt
   several of them share runs once, a prefix this engine ran before comes from the prefix cache;
   their first tokens are drawn and their key/values join the running batch's, left-padded to one
   width (positions come from the mask, so padding changes nothing a row computes);
2. decode: every running row gets its next token from one forward;
3. retire: a row that drew a stop token (or met its stop rule) or reached its budget leaves the
   batch, its key/values go to the prefix cache (its episode's next turn starts from them) and its
   future is completed.

What a sequence gets does not depend on what else runs: its draws come from its request's own
generator (opentinker/backend/sequences.py says how a token is chosen), so its tokens and
logprobs are those it gets alone, up to the float noise of a wider batch
(tests/test_stream_engine.py). Every token records the policy version of the weights that drew it.
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch

from opentinker.backend.batch_cache import cache_of, layers_of, pad_left, prompt_inputs
from opentinker.backend.device import Placement
from opentinker.backend.prefix_cache import LayerStates, PrefixCache
from opentinker.backend.sequences import Completion, Draws, Sequence, choose, end_of_sequence_ids
from opentinker.backend.slots import SlotDecoder, supports_slots
from opentinker.model.vision import pixel_batch


@dataclass
class _Call:
    """A function to run on the engine's thread (StreamEngine.on_thread)."""

    fn: Callable[[], Any]
    done: Future


@dataclass
class Batch:
    """The running rows: their key/values (left-padded to one width), mask and next positions."""

    rows: list[Sequence] = field(default_factory=list)
    cache: Any = None  # transformers DynamicCache
    mask: torch.Tensor | None = None  # [rows, width]: 1 where a column is the row's token
    positions: torch.Tensor | None = None  # [rows]: the position of each row's next token


class StreamEngine:
    """Continuous batching over a transformers causal LM (see the module's docstring)."""

    def __init__(self, model, tokenizer, placement: Placement, max_batch_size: int = 64, prefix_cache_tokens: int = 65536,
                 row_scope: Callable[[list[str | None]], Any] | None = None, run_step: Callable[..., Any] | None = None,
                 admits: Callable[[Sequence, list[Sequence]], bool] | None = None,
                 before_admit: Callable[[list[Sequence]], Any] | None = None, slots: bool | None = None):
        """`row_scope(names)`: a context under which row i runs through adapter names[i] (a shared
        base); `run_step(fn)`: where a step's arithmetic runs (default: this engine's thread);
        `admits(seq, running)`: whether `seq` may join `running` now (default: always);
        `before_admit(seqs)`: called before new rows are prefilled (an adapter to merge, say);
        `slots`: decode over fixed key/value slots, as CUDA graphs on a GPU (slots.py; default: on a
        GPU, for an engine of one policy: no row scope, step runner or adapter merging). Not by default
        on the CPU: the slots hold max_batch_size rows over the span of columns of the oldest running
        row, which multi-turn streams stretch (TextArena self-play's rollout took 5.1 GB over slots, 2.2 GB
        with the growing cache), for rollouts 0.91x the time (bench/stream_slots.py)."""
        self.model, self.tokenizer, self.placement = model, tokenizer, placement
        self.max_batch_size = max_batch_size
        if slots is None:
            slots = (placement.device.type == "cuda" and row_scope is None and run_step is None and before_admit is None
                     and supports_slots(model) is None)
        self.slots = SlotDecoder(max_batch_size, placement) if slots else None
        self.prefix_cache = PrefixCache(model, prefix_cache_tokens)
        self.row_scope, self.run_step, self.admits, self.before_admit = row_scope, run_step, admits, before_admit
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        eos = model.generation_config.eos_token_id if getattr(model, "generation_config", None) is not None else None
        self.stop_ids = end_of_sequence_ids(tokenizer, eos)
        self.policy_version = 0
        self.keep = logits_kwargs(model)
        self.waiting: queue.Queue[list[Sequence] | _Call | None] = queue.Queue()
        self.held: list[Sequence] = []  # taken from the queue, not admitted yet
        self.batch = Batch()
        self.lock = threading.Lock()  # held around each step: weights change only between steps (`between_steps`)
        # Decode cost: forwards, rows summed over them, and the tokens kept (a row leaves at its last one)
        self.decode_forwards = self.decode_positions = self.useful_positions = self.generated_tokens = 0
        self.mixed_forwards = 0  # forwards whose rows went through two adapters or more
        self.busy_seconds = 0.0
        self.closed = False
        self.died: BaseException | None = None  # what ended the engine's thread, if anything did
        self.changed = False  # weights changed since the last step
        self._thread = threading.Thread(target=self._run, name="stream-engine", daemon=True)
        self._thread.start()

    # -- requests ----------------------------------------------------------------------------
    def submit(self, prompts: list[list[int]], params: Any, budgets: list[int] | None = None, **request: Any) -> list[Future]:
        """One future per prompt, completed with its Completion (`request`: see `sequences`)."""
        seqs = self.sequences(prompts, params, budgets, **request)
        self.enqueue(seqs)
        return [seq.future for seq in seqs]

    def enqueue(self, seqs: list[Sequence]) -> None:
        """Queue sequences to join the batch together (at the same step, when they fit)."""
        if self.died is not None:
            raise RuntimeError(f"the engine's thread died: {type(self.died).__name__}: {self.died}") from self.died
        if self.closed:
            raise RuntimeError("the engine is closed")
        self.waiting.put(seqs)
        if self.died is not None:  # it died as we queued: its last look at the queue may have come first
            _fail_futures([seq.future for seq in seqs], self.died)

    def sequences(self, prompts: list[list[int]], params: Any, budgets: list[int] | None = None, *, stop_rule: Any = None,
                  generator: torch.Generator | None = None, adapters: list[str | None] | None = None,
                  images: list[list[Any]] | None = None, seed: int | None = None,
                  version: Callable[[], int] | None = None) -> list[Sequence]:
        """One request's sequences, one per prompt; `adapters[i]`: the adapter prompt i runs
        through (a shared base); `version()`: the policy version its tokens are drawn by (default:
        the engine's `policy_version`). Their rows draw together from `generator` (or one seeded with
        `seed`; neither: one seeded from torch's global generator now, so a seeded process replays)."""
        if generator is None:
            seed = seed if seed is not None else int(torch.randint(0, 2**62, (1,)).item())
            generator = torch.Generator(device=self.placement.device).manual_seed(seed)
        draws = Draws(generator)
        budgets = budgets or [params.max_new_tokens] * len(prompts)
        for i, prompt in enumerate(prompts):
            if not prompt:
                raise ValueError("a prompt needs at least one token")
            draws.members.append(Sequence(list(prompt), params, max(1, min(budgets[i], params.max_new_tokens)), Future(), draws,
                                          stop_rule, adapters[i] if adapters is not None else None,
                                          images[i] if images is not None and images[i] else None, frozenset(self.stop_ids),
                                          version))
        return draws.members

    def between_steps(self, fn: Callable[[], Any]) -> Any:
        """Run `fn` (a weight update, an adapter change) while no step runs; its result."""
        with self.lock:
            self.changed = True  # the next step casts the weights afresh (see _loop)
            return fn()

    def on_thread(self, fn: Callable[[], Any]) -> Future:
        """Run `fn` on the engine's thread between steps (thread-local state: a dispatch mode, say); its future."""
        done: Future = Future()
        self.waiting.put(_Call(fn, done))
        return done

    def close(self) -> None:
        self.closed = True
        self.waiting.put(None)
        self._thread.join(timeout=30)

    @property
    def in_flight(self) -> int:
        """Sequences running or held (not those still queued)."""
        return len(self.batch.rows) + len(self.held)

    # -- the loop ----------------------------------------------------------------------------
    def _run(self) -> None:
        """The loop, and if it ever ends by an error (a step's own errors fail only its sequences):
        every waiting and later request fails with it, never waits for ever."""
        try:
            self._loop()
        except BaseException as err:  # noqa: BLE001 - reported to every caller
            self.died = err
            self._fail_all(err)
            while True:  # what was queued meanwhile
                try:
                    item = self.waiting.get_nowait()
                except queue.Empty:
                    return
                _fail_futures([item.done] if isinstance(item, _Call) else [seq.future for seq in item or []], err)

    def _loop(self) -> None:
        """Steps while there is work. On this engine's thread the steps of a busy stretch share one
        autocast region, so each trained weight is cast to the compute precision once, not at every
        token (a region per step cost 37% of a decode step's GPU time in full fine-tuning, profiled);
        the region ends when the engine idles or the weights change (`between_steps`)."""
        region: contextlib.ExitStack | None = None  # the autocast region of this busy stretch
        while True:
            if not self.batch.rows and not self.held:
                region = _leave(region)
                seq = self.waiting.get()
                if seq is None:
                    return
                self._take(seq)
            while True:
                try:
                    seq = self.waiting.get_nowait()
                except queue.Empty:
                    break
                if seq is None:
                    self._fail_all(RuntimeError("the engine closed"))
                    return
                self._take(seq)
            if not self.batch.rows and not self.held:
                continue
            try:
                with self.lock:
                    t0 = time.perf_counter()
                    if self.run_step is not None:  # another thread's: a region of its own per step
                        self.run_step(self._step_in_region)
                    else:
                        if self.changed:
                            region, self.changed = _leave(region), False
                        if region is None:
                            region = contextlib.ExitStack()
                            region.enter_context(self.placement.autocast())
                            if self.slots is not None:  # the weights may have changed since the last stretch
                                self.slots.refresh(self.model)
                        self._step()
                    self.busy_seconds += time.perf_counter() - t0
            except Exception as err:  # noqa: BLE001 - the sequences of a failed step fail; the engine lives on
                self._fail_all(err)

    def _take(self, item: list[Sequence] | _Call) -> None:
        if isinstance(item, _Call):
            try:
                item.done.set_result(item.fn())
            except Exception as err:  # noqa: BLE001 - the caller gets it
                item.done.set_exception(err)
        else:
            self.held.extend(item)

    def _fail_all(self, err: BaseException) -> None:
        _fail_futures([seq.future for seq in [*self.batch.rows, *self.held]], err)
        self.batch, self.held = Batch(), []
        if self.slots is not None:
            self.slots.reset()

    def _step_in_region(self) -> None:
        with self.placement.autocast():
            self._step()

    @torch.no_grad()
    def _step(self) -> None:
        # over slots every forward runs the decode copy, always in eval mode (putting a 1.5B model in
        # eval mode and back walks its modules: 10 ms a step, profiled)
        was_training = self.slots is None and self.model.training
        if was_training:
            self.model.eval()
        try:
            admitted = self._take_admissible()
            if self.batch.rows:
                self._decode()
            if admitted:
                try:
                    self._admit(admitted)
                except BaseException:
                    self.held = admitted + self.held  # taken from the queue, not in the batch yet: they fail with the rest
                    raise
        finally:
            if was_training:
                self.model.train()

    def _take_admissible(self) -> list[Sequence]:
        room = self.max_batch_size - len(self.batch.rows)
        taken, kept = [], []
        for seq in self.held:
            if len(taken) < room and (self.admits is None or self.admits(seq, [*self.batch.rows, *taken])):
                taken.append(seq)
            else:
                kept.append(seq)
        self.held = kept
        return taken

    def _scope(self, rows: list[Sequence]) -> Any:
        """The context a forward of `rows` runs in (their adapters); counts forwards of several."""
        self.mixed_forwards += len({s.adapter for s in rows}) > 1
        return self.row_scope([s.adapter for s in rows]) if self.row_scope is not None else nullcontext()

    def _decode(self) -> None:
        """One token for every running row, then the rows that ended leave."""
        batch = self.batch
        self.decode_forwards += 1
        self.decode_positions += len(batch.rows)
        if self.slots is not None:
            logits = self.slots.decode([s.slot for s in batch.rows], [s.tokens[-1] for s in batch.rows]).float()
            tokens, logprobs = choose(logits, batch.rows)
            self._retire([seq.add(t, lp, self.policy_version) for seq, t, lp in zip(batch.rows, tokens, logprobs)])
            return
        last = torch.tensor([s.tokens[-1] for s in batch.rows], device=self.placement.device)[:, None]
        batch.mask = torch.cat([batch.mask, batch.mask.new_ones((len(batch.rows), 1))], dim=-1)
        with self._scope(batch.rows):
            out = self.model(input_ids=last, position_ids=batch.positions[:, None], attention_mask=batch.mask,
                             past_key_values=batch.cache, use_cache=True, **self.keep)
        batch.cache, batch.positions = out.past_key_values, batch.positions + 1
        tokens, logprobs = choose(out.logits[:, -1].float(), batch.rows)
        ended = [seq.add(t, lp, self.policy_version) for seq, t, lp in zip(batch.rows, tokens, logprobs)]
        self._retire(ended)

    def _admit(self, seqs: list[Sequence]) -> None:
        """Prefill the new rows together (a prompt several share, of one adapter, runs once), draw
        their first tokens, and join them to the batch."""
        if self.before_admit is not None:
            self.before_admit(seqs)
        device = self.placement.device
        prompts = [s.prompt for s in seqs]
        images = [s.images or [] for s in seqs] if any(s.images for s in seqs) else None
        hits = self.prefix_cache.lookup(prompts) if images is None else [(0, None)] * len(seqs)
        firsts: dict[tuple[Any, ...], int] = {}
        index = [firsts.setdefault((tuple(s.prompt), s.adapter, n), len(firsts)) for s, (n, _) in zip(seqs, hits)]
        unique = [index.index(u) for u in range(len(firsts))] if images is None else list(range(len(seqs)))
        ids, mask, cache = prompt_inputs([prompts[i] for i in unique], [hits[i] for i in unique], self.pad_id)
        ids, mask = ids.to(device), mask.to(device)
        past = cache.get_seq_length() if cache is not None else 0
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        extra = pixel_batch(images, device) if images is not None else {}
        model = self.slots.model if self.slots is not None else self.model
        with self._scope([seqs[i] for i in unique]):
            out = model(input_ids=ids[:, past:], position_ids=positions[:, past:], attention_mask=mask, past_key_values=cache,
                             use_cache=True, **self.keep, **extra)
        self.decode_forwards += 1
        self.decode_positions += len(unique)
        cache, logits = out.past_key_values, out.logits[:, -1].float()
        if len(unique) < len(seqs):  # every row a copy of its prompt's
            expand = torch.tensor(index, device=device)
            cache.reorder_cache(expand)
            logits, mask, positions = logits[expand], mask[expand], positions[expand]
        tokens, logprobs = choose(logits, seqs)
        ended = [seq.add(t, lp, self.policy_version) for seq, t, lp in zip(seqs, tokens, logprobs)]
        if self.slots is not None:
            for seq, slot in zip(seqs, self.slots.take(len(seqs))):
                seq.slot = slot
            self.slots.join([s.slot for s in seqs], layers_of(cache), mask, positions[:, -1] + 1)
            self.batch = Batch(self.batch.rows + seqs)
        else:
            self._join(Batch(seqs, cache, mask, positions[:, -1] + 1))
        self._retire([False] * (len(self.batch.rows) - len(seqs)) + ended)

    def _join(self, new: Batch) -> None:
        """The new rows' key/values beside the running ones', both left-padded to the wider width."""
        old = self.batch
        if not old.rows:
            self.batch = new
            return
        width = max(old.mask.shape[1], new.mask.shape[1])
        layers = []
        for (ko, vo), (kn, vn) in zip(layers_of(old.cache), layers_of(new.cache)):
            layers.append((torch.cat([pad_left(ko, width), pad_left(kn, width)]), torch.cat([pad_left(vo, width), pad_left(vn, width)])))
        mask = torch.cat([pad_left(old.mask, width, dim=1), pad_left(new.mask, width, dim=1)])
        self.batch = Batch(old.rows + new.rows, cache_of(layers), mask, torch.cat([old.positions, new.positions]))

    def _retire(self, ended: list[bool]) -> None:
        """Rows that ended leave: their key/values to the prefix cache, their futures completed."""
        if not any(ended):
            return
        batch, staying = self.batch, [at for at, gone in enumerate(ended) if not gone]
        layers = layers_of(batch.cache) if self.slots is None else []
        for at, gone in enumerate(ended):
            if not gone:
                continue
            seq = batch.rows[at]
            if self.prefix_cache.max_tokens and seq.images is None and len(seq.tokens) > 1:
                # the prompt's and the fed tokens' key/values (all but the last drawn)
                if self.slots is not None:
                    states: LayerStates = self.slots.states(seq.slot)
                else:
                    columns = batch.mask[at].nonzero().squeeze(-1)
                    states = [(k[at].index_select(1, columns), v[at].index_select(1, columns)) for k, v in layers]
                self.prefix_cache.store(seq.prompt + seq.tokens[:-1], states)
            self.generated_tokens += len(seq.tokens)
            self.useful_positions += len(seq.tokens)
            reason = "stop" if seq.stopped else "length"
            seq.future.set_result(Completion(seq.tokens, seq.logprobs, reason, seq.versions))
        if self.slots is not None:
            self.slots.release([batch.rows[at].slot for at, gone in enumerate(ended) if gone])
            self.batch = Batch([batch.rows[at] for at in staying])
            return
        if not staying:
            self.batch = Batch()
            return
        index = torch.tensor(staying, device=batch.mask.device)
        mask = batch.mask[index]
        first = int(mask.any(0).nonzero()[0])  # columns every remaining row pads: dropped
        layers = [(k[index][:, :, first:], v[index][:, :, first:]) for k, v in layers]
        self.batch = Batch([batch.rows[at] for at in staying], cache_of(layers), mask[:, first:], batch.positions[index])


def logits_kwargs(model) -> dict[str, Any]:
    """`logits_to_keep=1` where the model takes it (as `generate` passes it): only the last
    position's logits are computed."""
    import inspect

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(base.forward).parameters else {}


def _fail_futures(futures: list[Future], err: BaseException) -> None:
    """Fail each future not done yet (another thread may finish one meanwhile: that one stands)."""
    for future in futures:
        try:
            future.set_exception(err)
        except InvalidStateError:
            pass


def _leave(region: contextlib.ExitStack | None) -> None:
    """Close an autocast region (its cached casts go with it); None to say there is none now."""
    if region is not None:
        region.close()
    return None
