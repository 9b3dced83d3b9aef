"""The CPU serving engine: a trained checkpoint in transformers, batched across concurrent requests.

It reuses what training evaluation uses, so a served policy answers as it did in its job:
`load_policy` (the checkpoint's base model with its adapter merged), `ChatFormat` (messages
rendered by the model's own chat template, tokenized once, as the agent loop does) and
`HFRolloutEngine` (continuous batching, stopping at end-of-turn tokens). A request that arrives
while others run joins their batch at the next decode step.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future
from contextlib import nullcontext
from pathlib import Path
from typing import Any

from opentinker.agent import chat_format
from opentinker.agent.chat import Chunk
from opentinker.backend.device import Placement, cpu
from opentinker.backend.packed_linear import pack_linears, repack
from opentinker.backend.rollout import HFRolloutEngine, SamplingParams


class ModelLoadError(RuntimeError):
    """A checkpoint that cannot be served: missing, incomplete, corrupt, or for an unknown base."""


class ContextLengthError(ValueError):
    """A request whose prompt plus completion does not fit the model's context."""

    def __init__(self, context: int, prompt_tokens: int, max_tokens: int | None):
        asked = prompt_tokens + (max_tokens or 0)
        detail = f"{prompt_tokens} in the prompt" + (f", {max_tokens} for the completion" if max_tokens else "")
        super().__init__(f"This model's maximum context length is {context} tokens. However, you requested "
                         f"{asked} tokens ({detail}). Please reduce the length of the prompt or the completion.")


def gathered(futures: list[Future]) -> Future:
    """One future of every result of `futures`, in order (the first failure fails it)."""
    out: Future = Future()
    left = [len(futures)]
    lock = threading.Lock()

    def done(_: Future) -> None:
        with lock:
            left[0] -= 1
            last = left[0] == 0
        if out.done():
            return
        failure = next((f.exception() for f in futures if f.done() and f.exception() is not None), None)
        if failure is not None:
            out.set_exception(failure)
        elif last:
            out.set_result([f.result() for f in futures])

    for future in futures:
        future.add_done_callback(done)
    return out


class HFEngine:
    """Generation for the server: `generate` returns a Future at once; its rows join the engine's
    running batch at the next decode step (continuous batching: opentinker/backend/stream.py), so a
    request never waits for another's to end. One adapter at a time runs here (an engine made by
    `for_adapters` merges it into the weights): a request for another waits until the batch holds
    none of the current one's rows."""

    kind = "hf"

    def __init__(self, model, tokenizer, info: dict[str, Any] | None = None, checkpoint: str | None = None,
                 max_model_len: int | None = None, max_batch_size: int = 32, placement: Placement | None = None,
                 prefix_cache_tokens: int = 65536, run_step: Any = None):
        """`run_step(fn)`: where each decode step's arithmetic runs (a base-model worker's compute thread)."""
        self.rollout = HFRolloutEngine(model, tokenizer, max_batch_size=max_batch_size, placement=placement,
                                       prefix_cache_tokens=prefix_cache_tokens, run_step=run_step, row_scope=self._row_scope,
                                       admits=self._admits)
        if next(model.parameters()).device.type == "cpu":
            pack_linears(model)  # decode's few-row matmuls ~1.6x as fast on packed weights (opentinker.backend.packed_linear)
        self.chat = chat_format(tokenizer)
        self.tokenizer = tokenizer
        self.info = info or {}
        self.checkpoint = checkpoint
        limit = getattr(model.config.get_text_config(), "max_position_embeddings", None)  # a VLM keeps it on its language model
        lengths = [x for x in (max_model_len, limit) if x]
        if not lengths:
            raise ModelLoadError("the model states no context length: pass max_model_len")
        self.context_length = int(min(lengths))
        self.max_batch_size = max_batch_size

    @classmethod
    def for_adapters(cls, model_name: str, init_from: str | None = None, where: Placement | None = None,
                     max_model_len: int | None = None) -> HFEngine:
        """A base model that takes LoRA adapters by name (`load_adapter`), as vLLM with
        `--enable-lora` does: what a job's server-backed rollout engine samples through. The
        base is the job's (its pinned `init_from`), on the job's device in its precision."""
        import torch

        from opentinker.model import load_model

        where = where or cpu()
        try:
            model, tokenizer = load_model(model_name, init_from=init_from)
        except Exception as err:  # any cause: one clear message naming the model
            raise ModelLoadError(f"cannot serve {model_name}: {type(err).__name__}: {err}") from err
        model = model.to(dtype=where.weights_dtype(trained=False)).to(where.device)
        merges = model.dtype == torch.float32
        if merges and getattr(model.config, "tie_word_embeddings", False) and model.get_output_embeddings() is not None:
            # A LoRA on the unembedding, merged, must not change the (tied) input embedding: untie the copy here.
            head = model.get_output_embeddings()
            head.weight = torch.nn.Parameter(head.weight.detach().clone(), requires_grad=False)
        # No prefix cache: its entries would outlive a switch of adapter.
        engine = cls(model, tokenizer, {"base_model": model_name, "init_from": init_from}, max_model_len=max_model_len,
                     placement=where, prefix_cache_tokens=0)
        engine.adapters = {}
        engine.merges = merges
        return engine

    # --- LoRA adapters (engines made by for_adapters) ---------------------------------------
    adapters: dict[str, str] | None = None  # name -> the folder it was loaded from
    # float32 bases: the adapter of a batch is merged into the weights (W + s·BA) and stays merged
    # until another is needed, so decoding runs at the plain model's speed (per-layer LoRA matmuls
    # cost about as much as the model on a CPU). Not in bf16: the small delta would round away.
    merges: bool = False
    merged: str | None = None

    def load_adapter(self, name: str, path: str) -> None:
        """Load the peft adapter folder `path` (safetensors only: nothing is unpickled) as `name`.
        ValueError when this engine takes no adapters, the name is taken or the folder is not an
        adapter; the adapter must fit the base (peft's error otherwise)."""
        from peft import PeftModel

        if self.adapters is None:
            raise ValueError("this server serves one merged model: it takes no adapters")
        if name in self.adapters:
            raise ValueError(f"adapter {name!r} is loaded already")
        folder = Path(path)
        if not (folder.is_absolute() and (folder / "adapter_config.json").is_file() and (folder / "adapter_model.safetensors").is_file()):
            raise ValueError(f"{path}: not a LoRA adapter folder (an absolute path holding adapter_config.json and adapter_model.safetensors)")
        def load() -> None:
            model = self.rollout.stream.model
            if self.merged is not None:  # layers take a new adapter unmerged
                self._unmerge()
            if isinstance(model, PeftModel):
                model.load_adapter(str(folder), adapter_name=name)
            else:
                self.rollout.stream.model = PeftModel.from_pretrained(model, str(folder), adapter_name=name)
            self.rollout.stream.model.eval()

        self.rollout.stream.between_steps(load)  # never under a running batch
        self.adapters[name] = str(folder)

    def unload_adapter(self, name: str) -> None:
        """Drop adapter `name` (KeyError when it is not loaded)."""
        if not self.adapters or name not in self.adapters:
            raise KeyError(name)
        def unload() -> None:
            if self.merged == name:
                self._unmerge()
            self.rollout.stream.model.delete_adapter(name)

        self.rollout.stream.between_steps(unload)
        del self.adapters[name]

    def _unmerge(self) -> None:
        self.rollout.model.unmerge_adapter()
        repack(self.rollout.model)
        self.merged = None

    def _adapter(self, name: str | None) -> Any:
        """The context a batch for adapter `name` runs in (None: the base model alone)."""
        model = self.rollout.model
        if name is not None and (not self.adapters or name not in self.adapters):
            raise KeyError(name)
        if self.merged is not None and self.merged != name:
            self._unmerge()
        if name is not None:
            if self.merged == name:  # set_adapter would unmerge it
                return nullcontext()
            model.set_adapter(name)
            if self.merges:
                model.merge_adapter()
                repack(model)  # peft rewrote the weights through .data
                self.merged = name
            return nullcontext()
        return model.disable_adapter() if self.adapters else nullcontext()

    @classmethod
    def from_checkpoint(cls, uri: str, dtype: str | None = None, max_model_len: int | None = None) -> HFEngine:
        """Load a checkpoint (step folder, job folder or registry URI); every failure becomes one
        ModelLoadError naming the checkpoint and the cause."""
        from opentinker.model.policy import load_policy
        from opentinker.storage.resolve import resolve_checkpoint

        try:
            url = resolve_checkpoint(uri)
            model, tokenizer, info = load_policy(url, dtype)
        except Exception as err:  # any cause: one clear message naming the checkpoint
            raise ModelLoadError(f"cannot serve {uri}: {type(err).__name__}: {err}") from err
        return cls(model, tokenizer, info, checkpoint=url, max_model_len=max_model_len)

    @property
    def vocab_size(self) -> int:
        """Rows of the output layer: the token ids a prompt may hold."""
        return self.rollout.model.get_output_embeddings().weight.shape[0]

    @property
    def stop_ids(self) -> list[int]:
        """The end-of-sequence ids a sample stops at unless told otherwise."""
        return self.rollout.stop_ids

    # --- tokens ------------------------------------------------------------------------------
    def chat_prompt(self, messages: list[dict[str, Any]]) -> Chunk:
        """The prompt's tokens, and its images' pixel inputs for a VLM (images are content parts
        `{"type": "image", "image": <PIL image>}`; a language model refuses them, ValueError)."""
        return self.chat.encode_prompt(messages)

    @property
    def takes_images(self) -> bool:
        return getattr(self.tokenizer, "processor", None) is not None

    def text_prompt(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, list):
            return list(prompt)
        return self.tokenizer(prompt)["input_ids"]

    def decode(self, ids: list[int]) -> str:
        return self.chat.decode(ids)

    def budget(self, prompt_tokens: int, max_tokens: int | None) -> int:
        """New tokens allowed for this prompt: `max_tokens`, or the rest of the context when None."""
        room = self.context_length - prompt_tokens
        if room <= 0 or (max_tokens is not None and max_tokens > room):
            raise ContextLengthError(self.context_length, prompt_tokens, max_tokens)
        return max_tokens if max_tokens is not None else room

    # --- generation --------------------------------------------------------------------------
    def generate(self, prompts: list[list[int]], budgets: list[int], params: SamplingParams, seed: int | None = None,
                 adapter: str | None = None, images: list[list[Any]] | None = None, stop_rule: Any = None,
                 generator: Any = None, version: Any = None) -> Future:
        """Future of one Completion per prompt. The request's rows draw from `generator` (or one
        seeded with `seed`), together and never with another request's, so what it samples does not
        depend on what else runs; `adapter` names a loaded LoRA adapter; `images[i]`: prompt i's
        VisualInputs (a VLM); `stop_rule(tokens) -> bool` ends a completion in place of the
        end-of-turn tokens; `version()`: the policy version its tokens are drawn by (a hosted job's)."""
        if adapter is not None and (not self.adapters or adapter not in self.adapters):
            failed: Future = Future()
            failed.set_exception(KeyError(adapter))
            return failed
        return gathered(self.rollout.stream.submit(prompts, params, budgets, stop_rule=stop_rule, generator=generator, seed=seed,
                                                   adapters=[adapter] * len(prompts), images=images, version=version))

    def score_prompt(self, prompt: list[int], adapter: str | None = None, top_k: int = 0) -> tuple[list[float], list[list[tuple[int, float]]]]:
        """Each prompt token's logprob given the tokens before it (NaN for the first), and, with
        `top_k`, the k likeliest tokens at each position with their logprobs (none at the first)."""
        import torch

        def score() -> tuple[list[float], list[list[tuple[int, float]]]]:
            with self._adapter(adapter), torch.no_grad():
                model = self.rollout.model
                model.eval()
                ids = torch.tensor([prompt], device=self.rollout.placement.device)
                with self.rollout.placement.autocast():
                    logits = model(input_ids=ids).logits[0, :-1].float()
                logp = torch.log_softmax(logits, dim=-1)
                chosen = logp.gather(-1, ids[0, 1:, None]).squeeze(-1).tolist()
                top: list[list[tuple[int, float]]] = []
                if top_k > 0:
                    values, indices = logp.topk(min(top_k, logp.shape[-1]), dim=-1)
                    top = [[]] + [list(zip(i.tolist(), v.tolist())) for i, v in zip(indices, values)]
            return [float("nan")] + chosen, top

        # between decode steps (each forward of the batch sets its own adapter again)
        return self.rollout.stream.between_steps(score)

    # --- the batch's adapter ----------------------------------------------------------------------
    def _admits(self, seq: Any, running: list[Any]) -> bool:
        """A row joins a batch of its own adapter's rows only (one adapter is in the weights at a time)."""
        return not running or seq.adapter == running[0].adapter

    def _row_scope(self, names: list[str | None]) -> Any:
        """Every forward runs under its rows' (one) adapter, merged in when it changes."""
        return self._adapter(names[0])

    def close(self) -> None:
        self.rollout.close()
