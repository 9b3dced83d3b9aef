"""A rollout engine that samples through an OpenAI-compatible inference server (vLLM, or ours).

Token ids go in (`prompt` as lists of ids) and come back as ids with each token's logprob
(`logprobs: 0`, `return_token_ids`, `return_tokens_as_token_ids`), so a trajectory's record is
the exact tokens the server sampled, as with the in-process engine. Prompts that share a token
budget go in one request; requests run concurrently, so the server batches them.

Weights reach the server as LoRA adapters (`sync_adapter`): after every update the adapter is written
to a folder and loaded under a new name per policy version (`policy-v<N>`, vLLM's `/v1/load_lora_adapter`);
or, on a vLLM server started with opentinker.inference.vllm_worker, in place (`sync_weights`): the
LoRA's factors that the server merges into its base weights (no LoRA path to pay at decode, 3.3x
slower on the CPU), or a full fine-tune's weights. Either
sync is verified, not trusted: the server must list the new name, answer a probe under
it, and the probe's logprobs must match what the trainer's own model computes for the same
tokens within `tolerance` (mean absolute difference). A load the server refuses, a name it does
not list, or weights that answer like an older version raise `SyncError`. The previous version
is unloaded once the new one is verified. Weights taken in place serve at once, so their probe's
verdict comes as a future, which whoever trains on their samples waits for.
"""

from __future__ import annotations

import logging
import secrets
import shutil
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from opentinker.backend.rollout import Completion, SamplingParams
from opentinker.core.own_servers import OwnServer, ServerGone, own_client

__all__ = ["Probe", "ServerGone", "ServerHandle", "ServerRolloutEngine", "SyncError"]


class SyncError(RuntimeError):
    """The policy's new weights did not verifiably reach the inference server."""


class ServerStalled(RuntimeError):
    """The inference server was paused or put to sleep under the job (by someone holding its key)."""


log = logging.getLogger(__name__)
STALL_NOTICE_S = 10.0  # requests in flight and none answered this long: the engine asks the server whether it is paused or asleep
STALL_LIMIT_S = 60.0  # paused or asleep this long under the job's requests: they are let go, and the job fails


@dataclass
class ServerHandle:
    """A server a job samples through: where it is, the key it wants, the base model's name on
    it, how to stop it (a no-op for a server the job did not start) and how its process ended
    (None while it runs, or for a server the job did not start)."""

    url: str
    model: str
    api_key: str | None = None
    stop: Callable[[], None] = lambda: None
    weights: str = "lora"  # how a policy version reaches it: "lora" (sync_adapter) or "merged" (sync_weights)
    ended: Callable[[], str | None] = lambda: None
    cause: Callable[[], str] = lambda: ""  # the last error its log names, for a server that lives but failed
    weights_dir: Path | None = None  # the only folder its worker loads weights from (merged weights; engine_vllm.merged_server_args)
    uds: str | None = None  # the Unix socket it listens on instead of a port (a job's own server: only its job opens the folder)

    @property
    def address(self) -> str:
        """Where it listens, for the lines that name it."""
        return f"unix:{self.uds}" if self.uds else self.url


@dataclass
class Probe:
    """A fixed prompt the server continues greedily after each sync; `recompute(prompt, tokens)`
    returns the trainer's logprobs of those tokens (at temperature 1)."""

    prompt: list[int]
    recompute: Callable[[list[int], list[int]], list[float]]
    tokens: int = 8


def _token_ids(choice: dict[str, Any]) -> list[int]:
    if choice.get("token_ids") is not None:
        return [int(t) for t in choice["token_ids"]]
    return [int(t.removeprefix("token_id:")) for t in choice["logprobs"]["tokens"]]


class ServerRolloutEngine:
    """`RolloutEngine` over a server; `sync_adapter` moves a policy version onto it."""

    def __init__(self, server: ServerHandle, tolerance: float, timeout_s: float = 600.0, max_concurrency: int = 128,
                 adapter_prefix: str = "policy", stall_notice_s: float = STALL_NOTICE_S, stall_limit_s: float = STALL_LIMIT_S,
                 label: str = "the inference server"):
        """`adapter_prefix`: the adapters' names on the server (`<prefix>-v<N>`): engines sharing a
        server name theirs apart. `stall_notice_s`, `stall_limit_s`: see `_watch`. `label`: what
        the lines about it call the server (one of a job's several: which one)."""
        self.server, self.what = server, f"{label} at {server.address}"
        self.tolerance, self.adapter_prefix = tolerance, adapter_prefix
        self.client = own_client(server.url, server.api_key, timeout_s, max_connections=max_concurrency, uds=server.uds)
        self.calls = OwnServer(self.client, self.what, server.ended, cause=server.cause, uds=server.uds)
        self.pool = ThreadPoolExecutor(max_concurrency, thread_name_prefix="rollout-request")
        self.served = server.model  # what requests name: the base, then the newest verified adapter
        # Requests in flight per adapter name: a version replaced while requests still name it (a
        # step's evaluation as the producer moves on) is unloaded when its last request ends.
        self._using: Counter[str] = Counter()
        self._retired: set[str] = set()
        self._names = threading.Lock()
        self._syncing = threading.Lock()
        self.policy_version = 0
        self.synced_version: int | None = None
        # prefix cache salts are this engine's own: another engine's version N on the same server (a
        # test's server shared by jobs) is other weights
        self._salt = secrets.token_hex(8)
        self._verdict: Future[float] | None = None  # the last in-place sync's probe (sync_weights)
        self.generated_tokens = 0
        # wall time with at least one request in flight: requests overlap, so their own times do not add up
        self._busy_seconds, self._busy_since, self._in_flight = 0.0, 0.0, 0
        self._folders = Path(tempfile.mkdtemp(prefix="opentinker-adapters-"))
        self._shared = server.weights_dir or Path(tempfile.mkdtemp(prefix="opentinker-weights-"))  # where sync_weights writes
        self._stamp = ""  # the secret of the last in-place sync, which the server must report (tampering)
        self.stall_notice_s, self.stall_limit_s = stall_notice_s, stall_limit_s
        self.stalled_seconds = 0.0  # time the job's requests waited on a paused or sleeping server (a metric)
        self._answered_at = time.monotonic()  # the last request answered (or the first sent after an idle spell)
        self._stalled: ServerStalled | None = None
        self.turns_cut = 0  # completions the server ended at a budget below the one asked (its cap, its context): a metric
        self._closed = threading.Event()
        threading.Thread(target=self._watch, name="server-stall-watch", daemon=True).start()

    # --- sampling ------------------------------------------------------------------------------
    def _request(self, prompts: list[list[int]], params: SamplingParams, budget: int, model: str,
                 generator: torch.Generator | None = None, version: int | None = None) -> list[Completion]:
        """`version`: the policy version on the server as the request starts, which its tokens
        record (a sync during the request lands between the server's steps, so later tokens may be
        newer: the record errs old, as the staleness bound needs). For weights reloaded in place it
        also salts the server's prefix cache: key/values computed by one version (of this engine's
        policy) serve no other."""
        body: dict[str, Any] = {
            "model": model, "prompt": prompts, "max_tokens": budget,
            "temperature": 0.0 if params.greedy else params.temperature, "top_p": 1.0 if params.greedy else params.top_p,
            "logprobs": 0, "return_token_ids": True, "return_tokens_as_token_ids": True,
        }
        if self.server.weights == "merged" and version is not None:
            body["cache_salt"] = f"{self._salt}-v{version}"
        if not params.greedy:  # reproducible from the job's seed (or the episode's generator), like the in-process engine
            body["seed"] = int(torch.randint(0, 2**31 - 1, (), generator=generator).item())
        reply = self._call("POST", "/v1/completions", json=body)
        self._answered_at = time.monotonic()
        if self._stalled is not None:
            raise self._stalled
        if not reply.is_success:
            self.calls.raise_if_dead(reply)
            raise RuntimeError(f"{self.what} answered {reply.status_code}: {reply.text[:300]}")
        data = reply.json()
        if data.get("model") != model:
            raise SyncError(f"asked the inference server for {model!r}, it answered as {data.get('model')!r}")
        out = []
        if any(choice["finish_reason"] == "abort" for choice in data["choices"]):  # not a cut answer: the server let it go
            raise ServerStalled(f"{self.what} aborted the job's requests (paused or put to sleep "
                                "by someone holding its key)")
        for choice in sorted(data["choices"], key=lambda c: c["index"]):
            ids, logprobs = _token_ids(choice), [float(x) for x in choice["logprobs"]["token_logprobs"]]
            if len(ids) != len(logprobs) or len(ids) > budget:
                raise RuntimeError(f"the inference server returned {len(ids)} tokens, {len(logprobs)} logprobs for a budget of {budget}")
            out.append(Completion(ids, logprobs, "stop" if choice["finish_reason"] == "stop" else "length",
                                  [version] * len(ids) if version is not None else []))
        return out

    def _note_cut(self, completions: list[Completion], budgets: list[int]) -> None:
        """Turns ended at a length nobody asked for: the server's own cap (vLLM's generation config,
        another server's max_tokens limit) or context is below the job's budget. Counted, and the
        first one is a warning in the job's log (the job goes on, training on turns cut short)."""
        cut = [(len(c.token_ids), b) for c, b in zip(completions, budgets) if c.finish_reason == "length" and len(c.token_ids) < b]
        if not cut:
            return
        with self._names:
            first, self.turns_cut = not self.turns_cut, self.turns_cut + len(cut)
        if first:
            log.warning("%s ended a turn at %d tokens, short of the %d asked (rollout.max_new_tokens, or what is "
                        "left of rollout.max_total_tokens): its own limit on a completion (a max_tokens cap, its context length) is lower, "
                        "so the job trains on turns cut short (rollout/turns_cut_by_server counts them)", self.what, *cut[0])

    def _call(self, method: str, path: str, **kwargs: Any) -> Any:
        """A request to the server (every one this engine makes can be repeated: a completion is
        greedy or seeded, a load names the same file): a transport fault on a live server is retried,
        a server gone is ServerGone, one line the job fails with (core/own_servers.py)."""
        return self.calls.call(method, path, repeatable=True, **kwargs)


    def generate(self, prompts: list[list[int]], params: SamplingParams, budgets: list[int] | None = None,
                 images: list[list[Any]] | None = None, generators: list[torch.Generator | None] | None = None) -> list[Completion]:
        """One completion per prompt, as `HFRolloutEngine.generate` (callable from many threads at
        once: the server batches concurrent requests); prompts that share a budget and a generator
        go in one request, seeded from that generator. Text only: records with images sample in-process."""
        if images is not None and any(images):
            raise ValueError("rollout.engine 'server' samples text only; a vision-language policy samples with engine 'local'")
        budgets = [min(b, params.max_new_tokens) for b in budgets or [params.max_new_tokens] * len(prompts)]
        gens = generators or [None] * len(prompts)
        requests: dict[tuple[int, int], list[int]] = {}
        for i, b in enumerate(budgets):
            requests.setdefault((max(1, b), id(gens[i])), []).append(i)
        with self._names:
            model, version = self.served, self.policy_version
            self._using[model] += 1
            self._in_flight += 1
            if self._in_flight == 1:
                self._busy_since, self._answered_at = time.perf_counter(), time.monotonic()
        try:
            futures = {key: self.pool.submit(self._request, [prompts[i] for i in rows], params, key[0], model, gens[rows[0]], version)
                       for key, rows in requests.items()}
            results: dict[int, Completion] = {}
            for key, rows in requests.items():
                results.update(zip(rows, futures[key].result()))
        finally:
            with self._names:
                self._using[model] -= 1
                self._in_flight -= 1
                if not self._in_flight:
                    self._busy_seconds += time.perf_counter() - self._busy_since
                done = model in self._retired and not self._using[model]
                if done:
                    self._retired.discard(model)
            if done:
                self._unload(model)
        completions = [results[i] for i in range(len(prompts))]
        with self._names:
            self.generated_tokens += sum(len(c.token_ids) for c in completions)
        self._note_cut(completions, [max(1, b) for b in budgets])
        return completions

    @property
    def generate_seconds(self) -> float:
        """Seconds with at least one request of this engine in flight (what tokens per second divides by)."""
        with self._names:
            return self._busy_seconds + (time.perf_counter() - self._busy_since if self._in_flight else 0.0)

    def _watch(self) -> None:
        """Requests in flight and none answered for `stall_notice_s`: is the server paused or asleep
        (vLLM's dev routes, on a server that takes weights in place)? Then a warning, and the time
        counts in `stalled_seconds`; past `stall_limit_s` the requests are let go (the server resumed
        and woken) and the job fails with ServerStalled as they return. A long generation on a
        working server is neither paused nor asleep, and waits as long as it takes."""
        noticed = False
        while not self._closed.wait(1.0):
            with self._names:
                waiting = time.monotonic() - self._answered_at if self._in_flight else 0.0
            state = self._server_state() if waiting >= self.stall_notice_s and self._stalled is None else None
            if state is None:
                noticed = False
                continue
            if not noticed:
                log.warning("%s is %s: the job's requests have had no answer for %.0f s",
                            self.what, state, waiting)
                noticed = True
            self.stalled_seconds += 1.0
            if waiting >= self.stall_limit_s:
                self._stalled = ServerStalled(f"{self.what} was {state} under the job's requests for "
                                              f"{waiting:.0f} s (over {self.stall_limit_s:g} s): someone holding its key stopped it")
                for path in ("/wake_up", "/resume"):  # let the requests go, so the job fails now rather than at their timeout
                    self._quietly("POST", path)

    def _server_state(self) -> str | None:
        """'paused', 'asleep' or None (working, or a server without vLLM's dev routes)."""
        for path, key, word in (("/is_paused", "is_paused", "paused"), ("/is_sleeping", "is_sleeping", "asleep")):
            reply = self._quietly("GET", path)
            if reply is not None and reply.is_success and reply.json().get(key) is True:
                return word
        return None

    def _quietly(self, method: str, path: str) -> Any:
        try:
            return self.calls.fresh.request(method, path, timeout=10.0)
        except Exception:  # noqa: BLE001 - a look at the server's state; the requests themselves say if it is gone
            return None

    def server_metrics(self) -> dict[str, float]:
        """What the job's metrics say of its server: time stalled under it, transport faults retried, turns it cut short."""
        return {"rollout/server_stalled_seconds": self.stalled_seconds, "rollout/transport_retries": float(self.calls.retried),
                "rollout/turns_cut_by_server": float(self.turns_cut)}

    def end_phase(self) -> None:
        """Nothing to free here: the server manages its own cache."""

    # --- weights -------------------------------------------------------------------------------
    def sync_adapter(self, version: int, files: dict[str, bytes] | Callable[[], dict[str, bytes]], probe: Probe) -> float | None:
        """Load the adapter (`adapter/…` files as `adapter_files` writes them) as `policy-v<version>`
        and verify it; returns the probe's mean absolute logprob difference. SyncError otherwise.
        One sync at a time (the producer and an evaluation may both ask for the same version): None
        when `version` is on the server already."""
        with self._syncing:
            if self.synced_version == version:
                return None
            return self._sync(version, files() if callable(files) else files, probe)

    def _sync(self, version: int, files: dict[str, bytes], probe: Probe) -> float:
        name = f"{self.adapter_prefix}-v{version}"
        folder = self._folders / name
        folder.mkdir(parents=True, exist_ok=True)
        for key, data in files.items():
            (folder / key.removeprefix("adapter/")).write_bytes(data)
        reply = self._call("POST", "/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(folder)})
        if not reply.is_success and not (reply.status_code == 400 and "already" in reply.text):  # a retried load that landed
            raise SyncError(f"{self.what} refused adapter {name} ({reply.status_code}): {reply.text[:300]}")
        listed = {m["id"] for m in self._call("GET", "/v1/models").json().get("data", [])}
        if name not in listed:
            raise SyncError(f"{self.what} loaded adapter {name} but does not list it (it lists {sorted(listed)})")
        (answer,) = self._request([probe.prompt], SamplingParams(max_new_tokens=probe.tokens, greedy=True), probe.tokens, name)
        expected = probe.recompute(probe.prompt, answer.token_ids)
        gap = sum(abs(a - b) for a, b in zip(answer.logprobs, expected)) / max(1, len(expected))
        if not gap <= self.tolerance:  # NaN fails too
            raise SyncError(f"adapter {name} answers the probe {gap:.3g} (mean |logprob difference|) away from the trainer's "
                            f"weights, over the tolerance {self.tolerance:g}: the server serves other (stale?) weights")
        with self._names:
            previous, self.served, self.synced_version = self.served, name, version
            in_use = bool(self._using[previous])
            if in_use and previous not in (self.server.model, name):
                self._retired.add(previous)
        self.policy_version = version
        if previous not in (self.server.model, name) and not in_use:
            self._unload(previous)
        return gap

    def sync_weights(self, version: int, weights: dict[str, torch.Tensor] | Callable[[], dict[str, torch.Tensor]],
                     probe: Probe) -> Future[float] | None:
        """Reload the server's weights in place as `version`, through the worker extension
        opentinker.inference.vllm_worker, between two of its steps (requests in flight go on: an
        in-flight update): `weights` are a LoRA's factors (opentinker.model.adapters.lora_factors),
        merged into the server's base, or a full fine-tune's weights (policy_weights), which replace
        its own. Returns the probe's verdict as a future (its mean |logprob difference|, or
        SyncError): the new weights serve at once, so the probe runs beside the requests that follow
        and the sync costs the reload alone (the probe was 0.3-0.45 s of a 0.9 s sync on the CPU);
        whoever trains on their tokens waits for the verdict first (`verified`), and so does the next
        sync, which a failed verdict fails too. One sync at a time; None when `version` is on the
        server already. `weights` may be a function,
        called only by the sync that moves them (the callers that find the version there already pay
        nothing)."""
        with self._syncing:
            if self.synced_version == version:
                return None
            if self._verdict is not None:  # the previous version's probe reads the weights this sync replaces; its failure stops syncs
                self._verdict.result()
            from safetensors.torch import save_file

            path = self._shared / f"policy-v{version}.safetensors"
            save_file(weights() if callable(weights) else weights, str(path))
            self._stamp = secrets.token_hex(16)  # the server reports it back only for a load this sync made
            try:
                reply = self._call("POST", "/collective_rpc", json={"method": "load_policy_from", "args": [str(path), version, self._stamp]})
            finally:
                path.unlink(missing_ok=True)
            if not reply.is_success:
                raise SyncError(f"{self.what} refused the weights of version {version} ({reply.status_code}): {reply.text[:300]}")
            # requests in flight go on, now drawing from the new weights (in-flight); the new version's requests
            # salt the prefix cache with it, so no key/values of the old weights serve them (no reset to wait for)
            self.synced_version = self.policy_version = version
            self._verdict = self.pool.submit(self._probe_weights, version, probe)
            return self._verdict

    def verified(self) -> float | None:
        """Wait for the last in-place sync's probe: its mean |logprob difference|, or its SyncError
        (raised again at every call); None before any sync in place. Then the server's weights must
        still be that sync's (`check_untouched`)."""
        if self._verdict is None:
            return None
        gap = self._verdict.result()
        self.check_untouched()
        return gap

    def check_untouched(self) -> None:
        """SyncError unless every worker of the server reports the last in-place load as this
        engine's (its version and secret stamp, opentinker.inference.vllm_worker): a reload the
        trainer did not ask for is tampering, named as such, not stale weights."""
        with self._syncing:  # not between a sync's load and its bookkeeping
            expected = [self.synced_version, self._stamp]
            reply = self._call("POST", "/collective_rpc", json={"method": "policy_stamp"})
        if not reply.is_success:
            raise SyncError(f"{self.what} did not say which weights it serves ({reply.status_code}): {reply.text[:300]}")
        stamps = [list(stamp or [None, None]) for stamp in reply.json().get("results") or [None]]
        if foreign := [stamp for stamp in stamps if stamp != expected]:
            raise SyncError(f"the inference server's weights changed under the job: it serves a load this job did not make "
                            f"(version {foreign[0][0]}, expected {expected[0]}); its rollouts are not trusted")

    def _probe_weights(self, version: int, probe: Probe) -> float:
        (answer,) = self._request([probe.prompt], SamplingParams(max_new_tokens=probe.tokens, greedy=True), probe.tokens,
                                  self.server.model, version=version)
        expected = probe.recompute(probe.prompt, answer.token_ids)
        gap = sum(abs(a - b) for a, b in zip(answer.logprobs, expected)) / max(1, len(expected))
        if not gap <= self.tolerance:
            raise SyncError(f"the server's weights answer the probe {gap:.3g} (mean |logprob difference|) away from the "
                            f"trainer's version {version}, over the tolerance {self.tolerance:g}")
        return gap

    def _unload(self, name: str) -> None:
        self._call("POST", "/v1/unload_lora_adapter", json={"lora_name": name})
        shutil.rmtree(self._folders / name, ignore_errors=True)

    def close(self) -> None:
        if self.served != self.server.model:  # a server shared with others keeps only its base
            try:
                self._unload(self.served)
            except Exception:  # noqa: BLE001 - best effort: the server may be gone already
                pass
        self._closed.set()
        self.pool.shutdown(wait=False)
        self.calls.close()
        shutil.rmtree(self._folders, ignore_errors=True)
        if self.server.weights_dir is None:  # a folder of its own (the server's goes with the server)
            shutil.rmtree(self._shared, ignore_errors=True)
        self.server.stop()
