"""Many tenants' LoRA training on one frozen base model, their calls batched together.

Why: a LoRA tenant needs its adapter and its optimizer state, not a copy of the base. A
`SharedBase` holds the base once (opentinker.backend.multi_lora) and attaches any number of
`SharedAdapter`s, each a drop-in for a training client's `PrimitiveModel` (same calls, same
checkpoint files), with its own weights, AdamW state, step count and seed.

Passes, fairly: a tenant's call runs in pieces of at most `pass_tokens` tokens (its rows shortest
first; a row longer than that runs alone), and the runner's passes take turns between the tenants
that have work queued (round-robin; a tenant's own calls run in the order they came), each of them
getting an equal share of a pass's tokens. So a tenant waits for at most one piece of a
neighbour's work before its own next piece, however large the neighbour's calls
(bench/tinker_fairness.py measures a step beside maximal calls). Where passes are joint
(`joint_updates`, a GPU by default) the pass also takes a piece of every other tenant whose first
call is of the same kind: their rows form one batch
in which each row goes through its own adapter (segmented LoRA matmuls, the unembedding's LoRA
included), each call's loss is its own loss function on its own rows, and one backward of their
sum gives every adapter exactly the gradient of its own loss (an adapter only touches its own
rows). A fresh call waits up to GATHER_S for others to join, a window kept only while several
tenants are attached. On a CPU joining saves no arithmetic (bench/shared_base.py measured a
forward-backward beside three others 3.99 s shared against 3.92 s apart), so tenants take turns
there. One runner thread owns the model, so passes never overlap. A call whose adapter leaves
(its session closed or expired: its client is gone) is abandoned at its next pass boundary.

Hosted native jobs' updates (opentinker.orchestration.base_worker) join the same way where
`joint_updates` is on (a GPU, by default): each micro-batch of a job's per-sequence update is a
`JobPass` (opentinker.backend.shared_calls), its rows and its loss from their logits; micro-batches of different jobs that arrive
together run as one forward and one backward (the runner waits up to GATHER_S for every job in an
update to send its next one). On a CPU a pass already fills every core and jobs keep their
shared-prefix saving, so they take turns there (bench/joint_updates.py measures both).

Isolation: a call's input is checked in the caller's thread (a bad datum fails that call alone,
before it joins a batch); if a shared pass raises, every adapter's gradient is put back as it
was and each piece of the pass runs alone, so only the call that fails alone fails (and the
gradient its earlier pieces added is taken back).
"""

from __future__ import annotations

import logging
import queue
import secrets
import threading
import time
from contextlib import contextmanager
from typing import Any, Callable, Iterator

import numpy as np
import torch
import torch.nn.functional as F

from opentinker.algo.primitive_losses import loss_config, primitive_loss
from opentinker.backend.adapter_model import AdapterModel
from opentinker.backend.device import Placement, cpu
from opentinker.backend.multi_lora import MultiLora
from opentinker.backend.packed_linear import available as packed_available
from opentinker.backend.pass_memory import PASS_SHARE, PassMemory
from opentinker.backend.shared_calls import JOINT_PASS_TOKENS, JobPass, PassStats, Piece, TinkerCall, Turns, overfills
from opentinker.backend.primitives import (ATTENTION, HEAD_CHUNK_POSITIONS, LORA_ALPHA, MLP, UNEMBED, BadRequest, LoraShape, LoraTrainer,
                                            add_metrics, averaged, checked_rows, graded_positions, micro_batches, padded, row_logprobs, target_logprobs)
from opentinker.core.spec_limits import SHARED_PASS_TOKENS
from opentinker.model.vision import hidden_states

log = logging.getLogger(__name__)
ADAPTER_BYTES_PER_PARAMETER = 20  # float32 weights, gradients, two AdamW moments, the stacked copy while sampling
GATHER_S = 0.05  # after the first call of a pass, how long other tenants' calls may join it (only while there are others)


class SharedBase:
    """A frozen base (`base`, a causal LM) that LoRA adapters of many tenants train on."""

    def __init__(self, base: Any, tokenizer: Any, base_name: str, placement: Placement | None = None, gather_s: float = GATHER_S,
                 memory_bytes: float | None = None, joint: bool | None = None):
        """`memory_bytes`: what the base and its adapters' training state may fill (None: no bound);
        an adapter that would not fit is refused, with the numbers, before anything is allocated.
        `joint`: several tenants' pieces share a pass (None: on a GPU; a CPU takes turns, see the module)."""
        self.placement, self.memory_bytes = placement or cpu(), memory_bytes
        self.base_name, self.tokenizer, self.gather_s = base_name, tokenizer, gather_s
        self.lm = base.to(dtype=self.placement.weights_dtype(trained=False)).to(self.placement.device)
        self.lm.eval()
        self.multi = MultiLora(self.lm, targets=ATTENTION + MLP + UNEMBED)
        config = self.lm.config.get_text_config()
        self.vocab_size = int(self.lm.get_output_embeddings().weight.shape[0])
        self.context_length = int(getattr(config, "max_position_embeddings", 0) or 0) or None
        self.stats = PassStats()
        # One training pass at a time (a Tinker pass here, a hosted job's update in its caller's thread):
        # each takes every core; two at once would only fight over them (sampling runs beside, as ever).
        self.training = threading.Lock()
        self.tenants: set[str] = set()  # the training adapters attached
        # Pieces of several adapters share passes (hosted jobs' micro-batches too) where that saves
        # arithmetic: a GPU. On a CPU a pass already fills every core: tenants take turns.
        self.joint_updates = self.placement.device.type != "cpu" if joint is None else joint
        # The most tokens of one pass, every tenant's pieces together (a row longer than that runs alone)
        self.pass_tokens = JOINT_PASS_TOKENS if self.placement.device.type != "cpu" else SHARED_PASS_TOKENS
        activation_bytes = torch.empty((), dtype=self.placement.compute_dtype).element_size()
        self.pass_memory = PassMemory.of(self.lm.config, activation_bytes, HEAD_CHUNK_POSITIONS)
        self.updating: set[str] = set()  # hosted jobs in the middle of a joint update
        self.turns = Turns(base_name)  # per tenant its calls in order, the tenants in turn
        self._calls: queue.Queue[Any] = queue.Queue()
        self._runner = threading.Thread(target=self._serve, name=f"shared-base-{base_name}", daemon=True)
        self._runner.start()

    # -- tenants ----------------------------------------------------------------------------
    def attach(self, name: str, shape: LoraShape, tenant: str | None = None) -> SharedAdapter:
        """A new adapter `name` (a training client's model, of `tenant`) on this base; BadRequest
        when the memory bound cannot hold its training state beside what is there."""
        self._check_room(shape.rank, shape.spec().target_modules, "lora_config.rank", "this client's", "another session")
        adapter = SharedAdapter(self, name, shape, tenant)
        self.tenants.add(name)
        return adapter

    def add_job(self, name: str, rank: int, alpha: float, targets: list[str], dropout: float, seed: int) -> AdapterModel:
        """A native LoRA job's adapter `name` on this base, as the job's own peft-like model
        (opentinker.backend.adapter_model; its optimizer is the job's trainer's); BadRequest when
        the memory bound cannot hold it."""
        self._check_room(rank, targets, "adapter.r", "this job's", "another job")
        self.multi.add(name, r=rank, alpha=alpha, target_modules=targets, dropout=dropout, seed=seed)
        return AdapterModel(self.multi, name, self.base_name)

    def _check_room(self, rank: int, targets: list[str], field: str, whose: str, other: str) -> None:
        if self.memory_bytes is None:
            return
        need, base, held = self.training_bytes(rank, targets), self.base_bytes(), self.held_bytes()
        if base + held + need > self.memory_bytes:
            mib = 2**20
            raise BadRequest(f"{field} {rank}: {whose} adapter needs {need / mib:.0f} MiB (weights, gradients, "
                             f"AdamW moments, sampling copy); the worker of {self.base_name} has {(self.memory_bytes - base - held) / mib:.0f} MiB "
                             f"left of {self.memory_bytes / mib:.0f} MiB (the base with its packed copy {base / mib:.0f} MiB, "
                             f"{len(self.multi.adapters)} adapter(s) {held / mib:.0f} MiB): a smaller rank, or when {other} has ended")

    def training_bytes(self, rank: int, targets: list[str]) -> int:
        """An adapter's weights, gradients, two AdamW moments and the copy its samplers stack with
        other adapters' (multi_lora keeps it while sampling), float32: r (in + out) per target linear, five times."""
        paths = self.multi.target_paths(tuple(targets))
        return ADAPTER_BYTES_PER_PARAMETER * sum(rank * (self.multi.linears[p].in_features + self.multi.linears[p].out_features)
                                                 for p in paths)

    def held_bytes(self) -> int:
        """The training state of the adapters attached now."""
        return sum(ADAPTER_BYTES_PER_PARAMETER * a.num_parameters() for a in self.multi.adapters.values())

    def pass_room(self) -> float | None:
        """Bytes a pass may fill: PASS_SHARE of what the base and the adapters leave (None: no bound)."""
        return None if self.memory_bytes is None else PASS_SHARE * (self.memory_bytes - self.base_bytes() - self.held_bytes())

    def pass_budget(self) -> int:
        """Padded tokens of one pass: `pass_tokens`, or fewer where the memory left holds fewer."""
        room = self.pass_room()
        return self.pass_tokens if room is None else max(1, min(self.pass_tokens, self.pass_memory.tokens_within(room)))

    def check_pass(self, rows: list[dict[str, torch.Tensor]]) -> None:
        """BadRequest, in one line, for a datum that no pass on this worker can hold (it runs alone at best)."""
        if line := self.pass_memory.refusal([len(r["tokens"]) for r in rows], self.pass_room(), self.base_name):
            raise BadRequest(line)

    def base_bytes(self) -> int:
        """The base's parameters, and on a CPU the packed copy of its linears the sampling engine makes (packed_linear)."""
        params = sum(p.numel() * p.element_size() for p in self.lm.parameters())
        packs = self.placement.device.type == "cpu" and packed_available()
        return params + (sum(lin.weight.numel() * lin.weight.element_size() for lin in self.multi.linears.values()) if packs else 0)

    def detach(self, name: str) -> None:
        """The adapter leaves: a call of it still queued or running fails at its next pass boundary."""
        self.tenants.discard(name)
        if name in self.multi:
            self.multi.remove(name)

    def close(self) -> None:
        """Calls queued fail; the runner ends after the piece it is running (a process may exit then)."""
        self._calls.put(None)
        if threading.current_thread() is not self._runner:
            self._runner.join(timeout=120)

    # -- passes -----------------------------------------------------------------------------
    def submit(self, call: Any) -> Any:
        """Queue a call for the runner and wait for its (outputs, metrics)."""
        self._calls.put(call)
        return call.future.result()

    # -- hosted jobs' joint updates ----------------------------------------------------------------
    @contextmanager
    def joint_update(self, name: str) -> Iterator[Callable[..., tuple[int, dict[str, float]]]]:
        """Within the block adapter `name` is in an update: other jobs' passes wait (up to GATHER_S)
        for its next micro-batch. Yields `run(input_ids, attention_mask, loss_mask, loss)`: that
        micro-batch's forward and backward, in a pass with other jobs' when they come together;
        returns (how many adapters the pass held, the statistics `loss` gave)."""
        def run(input_ids: torch.Tensor, attention_mask: torch.Tensor, loss_mask: torch.Tensor, loss: Callable) -> tuple[int, dict[str, float]]:
            return self.submit(JobPass(name, input_ids, attention_mask, loss_mask, loss))

        self.updating.add(name)
        try:
            yield run
        finally:
            self.updating.discard(name)

    # -- the runner: passes in turn between tenants ---------------------------------------------------
    def _serve(self) -> None:
        while (leader := self.turns.next(self._calls)) is not None:
            try:
                self._run(self._job_batch(leader) if leader.kind == "job" else self._piece_batch(leader))
            except Exception as err:  # noqa: BLE001 - the runner outlives anything a pass does
                log.exception("the runner of %s failed a pass", self.base_name)
                self._fail(leader, err)

    def _piece_batch(self, leader: TinkerCall) -> list[Piece]:
        """The leader's next piece and, where passes are joint, a piece of every other tenant whose
        first call is of the same kind (a fresh call first waits up to `gather_s` for others to come,
        while several tenants are attached). A pass's tokens go in equal shares to the tenants with
        work queued, so a tenant waits for at most its share of a neighbour's work."""
        members, sharing = [leader], len(self.turns.heads())
        if self.joint_updates:
            if not leader.started and self.gather_s and len(self.tenants) > 1:  # tenants fall into step: their calls then share passes
                time.sleep(self.gather_s)
                self.turns.admit(self._calls)
            for head in self.turns.heads():
                if head is not leader and head.kind == leader.kind and head.adapter not in {m.adapter for m in members}:
                    members.append(head)
        share = max(1, self.pass_budget() // max(sharing, len(members)))
        return [(call, call.take(share)) for call in members]

    def _job_batch(self, leader: JobPass) -> list[Piece]:
        """Hosted jobs' micro-batches of one joint pass: every job in an update gets up to `gather_s`
        to send its next one; at most JOINT_PASS_TOKENS padded positions."""
        deadline = time.monotonic() + self.gather_s
        while (self.updating - {h.adapter for h in self.turns.heads() if h.kind == "job"}) and (left := deadline - time.monotonic()) > 0:
            if not self.turns.admit(self._calls, timeout=left):
                return []
        batch: list[Any] = [leader]
        for head in self.turns.heads():
            if head is not leader and head.kind == "job" and head.adapter not in {c.adapter for c in batch} and not overfills(batch, head):
                batch.append(head)
        return [(call, []) for call in batch]

    def _fail(self, call: Any, err: BaseException) -> None:
        """The call fails; whatever gradient its earlier pieces added is taken back."""
        if getattr(call, "before", None) is not None and call.adapter in self.multi:
            self._restore({call.adapter: call.before})
        if not call.future.done():
            call.future.set_exception(err)
        self.turns.done(call)

    def _closed(self, call: Any, rows: list[int]) -> None:
        ran = call.kind != "job" and len(call.todo) + len(rows) < len(call.rows)  # pieces of it ran before this one
        self._fail(call, BadRequest(f"model {call.adapter!r} was closed while its call {'ran' if ran else 'waited'}"))

    def _run(self, pieces: list[Piece]) -> None:
        live = []
        for call, rows in pieces:
            if call.adapter in self.multi:
                live.append((call, rows))
            else:  # its model was closed (its session ended or expired) while it waited or ran: abandoned here
                self._closed(call, rows)
        if not live:
            return
        self.stats.passes += 1
        self.stats.calls += len(live)
        self.stats.shared += len(live) > 1
        saved = {c.adapter: [None if p.grad is None else p.grad.clone() for p in self.multi[c.adapter].parameters()]
                 for c, _ in live if not c.forward_only}
        for call, _ in live:
            if call.kind == "train" and call.before is None:
                call.before = saved[call.adapter]
        try:
            with self.training:  # in this runner's thread, beside the engine's decoding (compute_thread says why)
                results = self._job_pass([c for c, _ in live]) if live[0][0].kind == "job" else self._pass(live)
        except Exception as err:  # noqa: BLE001 - one piece of the pass failed it: each runs alone, so only that call fails
            if len(live) == 1 and live[0][0].adapter not in self.multi:  # it closed mid-pass
                self._closed(*live[0])
                return
            if len(live) == 1:
                self._fail(live[0][0], err)
                return
            log.warning("a shared pass of %d calls failed (%s); running each alone", len(live), err, exc_info=True)
            self.stats.shared -= 1
            self.stats.split += 1
            self._restore(saved)
            for piece in live:
                self._run([piece])
            return
        for (call, rows), result in zip(live, results):
            if call.kind == "job":
                call.future.set_result(result)
                self.turns.done(call)
                continue
            outputs, sums, tokens = result
            for i in rows:
                call.outputs[i] = outputs[i]
            for key, value in sums.items():
                call.sums[key] = call.sums.get(key, 0.0) + value
            call.tokens += tokens
            if not call.todo:
                call.future.set_result((call.outputs, averaged(call.sums, call.tokens)))
                self.turns.done(call)

    def _restore(self, saved: dict[str, list[torch.Tensor | None]]) -> None:
        for name, grads in saved.items():
            for p, g in zip(self.multi[name].parameters(), grads):
                p.grad = None if g is None else g.clone()

    @contextmanager
    def _per_position(self, names: list[str], where: torch.Tensor) -> Iterator[None]:
        rows = where.nonzero()[:, 0].tolist()
        with self.multi.rows([names[r] for r in rows]):
            yield

    def _pass(self, pieces: list[Piece]) -> list[tuple[dict[int, dict[str, np.ndarray]], dict[str, float], float]]:
        """One pass over the pieces' rows, each row through its call's adapter. The model stays in
        eval mode (no dropout: LoRA dropout 0, as Tinker's), so sampling may run beside a pass.
        Per piece: (its rows' outputs, its metric sums, its tokens); the caller adds them to its call."""
        forward_only = pieces[0][0].forward_only
        calls = [call for call, _ in pieces]
        items = [(c, i) for c, (_, rows) in enumerate(pieces) for i in rows]
        outputs: list[dict[int, dict[str, np.ndarray]]] = [{} for _ in pieces]
        sums: list[dict[str, float]] = [{} for _ in pieces]
        tokens = [0.0] * len(pieces)
        for batch in micro_batches([len(calls[c].rows[i]["tokens"]) for c, i in items], self.pass_budget()):
            members = [items[k] for k in batch]
            names = [calls[c].adapter for c, _ in members]
            inputs, mask = padded([calls[c].rows[i] for c, i in members], self.placement.device)
            owner = torch.tensor([c for c, _ in members], device=mask.device)
            active = torch.zeros_like(mask, dtype=torch.bool)
            for c, call in enumerate(calls):
                mine = owner == c
                if bool(mine.any()):
                    active[mine] = graded_positions({k: v[mine] for k, v in inputs.items()}, mask[mine], call.loss_fn,
                                                    call.config, forward_only)
            with self.multi.rows(names), torch.set_grad_enabled(not forward_only), self.placement.autocast():
                hidden = hidden_states(self.lm, inputs["tokens"], None if bool(mask.all()) else mask.long())
            lp = target_logprobs(self.lm.get_output_embeddings(), hidden, inputs["target_tokens"], mask, active, forward_only,
                                 self.placement, head_rows=lambda where: self._per_position(names, where))
            losses = []
            for c, call in enumerate(calls):
                mine = (owner == c).nonzero()[:, 0]
                if len(mine) == 0:
                    continue
                part = {k: v[mine] for k, v in inputs.items()}
                with torch.set_grad_enabled(not forward_only):
                    out = primitive_loss(call.loss_fn, lp[mine], part, mask[mine], call.config)
                if not forward_only and out.loss.requires_grad:
                    losses.append(out.loss)
                n_tokens = float(mask[mine].sum())
                tokens[c] += n_tokens
                add_metrics(sums[c], out.metrics, n_tokens)
            if losses:
                torch.stack(losses).sum().backward()
            values = lp.detach().cpu().numpy()
            for r, (c, i) in enumerate(members):
                outputs[c][i] = {"logprobs": row_logprobs(values, r, calls[c].rows[i])}
        return [(outputs[c], sums[c], tokens[c]) for c in range(len(pieces))]

    def _job_pass(self, calls: list[JobPass]) -> list[tuple[int, dict[str, float]]]:
        """Hosted jobs' micro-batches as one batch, each row through its job's adapter (the head
        too), each job's loss from its own rows' logits, one backward of their sum: every adapter
        gets the gradient of its own loss. Per call: (adapters in the pass, its loss's statistics)."""
        width = max(c.input_ids.shape[1] for c in calls)
        ids = torch.cat([F.pad(c.input_ids, (0, width - c.input_ids.shape[1])) for c in calls])
        attention = torch.cat([F.pad(c.attention_mask, (0, width - c.attention_mask.shape[1])) for c in calls])
        graded = torch.cat([F.pad(c.loss_mask, (0, width - 1 - c.loss_mask.shape[1])) for c in calls]).bool()
        names = [c.adapter for c in calls for _ in range(c.input_ids.shape[0])]
        with self.multi.rows(names), torch.enable_grad(), self.placement.autocast():
            hidden = hidden_states(self.lm, ids, attention)
            selected = hidden[:, :-1][graded]
        with self._per_position(names, graded), torch.enable_grad(), self.placement.autocast():
            logits = self.lm.get_output_embeddings()(selected)
        losses, results = [], []
        for call, part in zip(calls, logits.split([int(c.loss_mask.bool().sum()) for c in calls])):
            loss, stats = call.loss(part)
            losses.append(loss)
            results.append((len(calls), stats))
        torch.stack(losses).sum().backward()
        return results


class SharedAdapter(LoraTrainer):
    """One training client's LoRA on a SharedBase: the calls and checkpoint files of a PrimitiveModel."""

    def __init__(self, shared: SharedBase, name: str, shape: LoraShape, tenant: str | None = None):
        self.shared, self.name, self.shape, self.tenant = shared, name, shape, tenant or name
        self.base_name, self.tokenizer = shared.base_name, shared.tokenizer
        self.vocab_size, self.context_length = shared.vocab_size, shared.context_length
        self.arch = type(shared.lm).__name__
        self.lora = shape.spec()
        seed = shape.seed if shape.seed is not None else secrets.randbelow(2**31)
        self.adapter = shared.multi.add(name, r=shape.rank, alpha=LORA_ALPHA, target_modules=self.lora.target_modules, seed=seed)
        self.params = self.adapter.parameters()
        self.optimizer = self._fresh_optimizer()
        self.steps = 0
        self.pending_tokens = 0

    def close(self) -> None:
        self.shared.detach(self.name)

    def forward_backward(self, data: list[Any], loss_fn: str, config: dict[str, float], forward_only: bool = False
                         ) -> tuple[list[dict[str, np.ndarray]], dict[str, float]]:
        config = loss_config(loss_fn, config)
        rows = checked_rows(data, loss_fn, self.vocab_size, self.context_length, self.base_name)
        self.shared.check_pass(rows)
        outputs, metrics = self.shared.submit(TinkerCall(self.name, rows, loss_fn, config, forward_only, tenant=self.tenant))
        if not forward_only:
            self.pending_tokens += sum(len(r["tokens"]) for r in rows)
        return outputs, metrics

    # -- state: the files a PrimitiveModel writes and reads -----------------------------------
    def trainable_state(self) -> dict[str, torch.Tensor]:
        return self.shared.multi.peft_state(self.name, adapter_name="default")

    def adapter_files(self) -> dict[str, bytes]:
        return self.shared.multi.adapter_files(self.name)
