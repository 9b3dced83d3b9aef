import faulthandler
import logging
import os
import sys
import threading
import time

import pytest
import torch

# One embedded stack per test session (`stack`, `stack_env`), shared by every module;
# one local S3 server (`s3_server`, `s3_url`).
pytest_plugins = ["tests.stack_fixtures", "tests.s3_fixtures", "tests.vllm_fixtures", "tests.system_packages"]

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("TINKER_TELEMETRY", "0")  # the tinker SDK in tests sends no telemetry (its drain at exit waits on a stopped gateway)
# The secret that signs job tokens, for the whole session (the stack's services inherit it): no
# test writes a secret file into a developer's state folder.
os.environ.setdefault("OPENTINKER_SECRET", "opentinker-test-secret")
os.environ.setdefault("OPENTINKER_VLLM_CPU_KV_CACHE_GIB", "1")  # a vLLM server's key/value cache: the tests' need a fraction of it
os.environ.setdefault("OPENTINKER_CPU_AUTO_DTYPE", "float32")  # `model.dtype: auto` on the CPU: the same numbers on every CPU CI draws (bfloat16 where it has AMX otherwise)
torch.set_num_threads(min(2, os.cpu_count() or 1))

EXIT_GRACE_S = 60  # after the summary: a process still alive this long is stuck on a thread (CI once hung ~40 min here)
_exit_status: dict[str, int | None] = {"code": None}  # the session's, once it has finished


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session, exitstatus):
    _exit_status["code"] = int(exitstatus)


def _non_daemon_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if not t.daemon and t is not threading.main_thread()]


def pytest_unconfigure(config):
    """Arm a watchdog for the interpreter's exit: if a thread (an executor's, a client's) keeps the
    process alive after the session ended, print every thread's stack and exit with the session's
    own status, so the verdict stands and the culprit is named in the log instead of a silent hang."""

    def watchdog() -> None:
        time.sleep(EXIT_GRACE_S)
        os.write(2, (f"\npytest: still alive {EXIT_GRACE_S} s after the session ended (status {_exit_status['code']}); "
                     f"non-daemon threads: {_non_daemon_threads()}; every thread's stack follows\n").encode())
        faulthandler.dump_traceback(file=2, all_threads=True)
        os._exit(_exit_status["code"])

    if _exit_status["code"] is None:  # no session ran (a usage error): pytest's own exit
        return
    if alive := _non_daemon_threads():
        os.write(2, f"\npytest: threads the interpreter will wait for at exit: {alive}\n".encode())
    threading.Thread(target=watchdog, name="exit-watchdog", daemon=True).start()
    # Where Prefect registers its own exit (threading's, which runs before atexit's, newest first): ours first. Prefect's
    # drains its log and event workers into an API that the session's stacks took down with them: it waited out
    # the watchdog's 60 s after every session that ran a flow, then logged "Error logging to API".
    threading._register_atexit(_exit_before_teardown)  # noqa: SLF001 - the hook Prefect itself uses (prefect/_internal/concurrency/services.py)


def _exit_before_teardown() -> None:
    """As the interpreter begins its exit, end the process with the session's status instead of
    draining Prefect's workers into stopped servers and tearing the interpreter down: C++ libraries (Ray's core worker, torch) whose
    threads outlive their Python owners crashed CI there after a finished session ("pure virtual
    method called", a segfault that replaced the verdict). Ray's driver is shut down first, so the
    local Ray processes it started go with it, and so is Prefect's temporary server (else left running
    after the suite, found after a CI run)."""
    sys.stdout.flush()
    sys.stderr.flush()
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        ray.shutdown()
    prefect_server = sys.modules.get("prefect.server.api.server")
    if prefect_server is not None:  # Prefect's temporary server (a flow run with no API URL): its own atexit stop would not run
        logging.raiseExceptions = False  # its "stopping" line may meet a stream pytest closed: no traceback for that
        prefect_server.SubprocessASGIServer().stop()
    os._exit(_exit_status["code"])


@pytest.fixture
def base_worker():
    """Builds in-process base-model workers (as a Ray actor would host one) and closes them after the
    test: a worker's server, engines and tick must not run on into the interpreter's exit."""
    from opentinker.orchestration.base_worker import BaseModelWorker

    built: list[BaseModelWorker] = []

    def build(idle_s: float = 3600) -> BaseModelWorker:
        built.append(BaseModelWorker(num_gpus=0, idle_s=idle_s))
        return built[-1]

    yield build
    for worker in built:
        worker.close()


@pytest.fixture(scope="session")
def tiny_path():
    from opentinker.core.model_names import TINY
    from opentinker.model.loading import resolve_model

    return resolve_model(TINY)


@pytest.fixture
def tiny(tiny_path):
    """A fresh tiny random model and the real SmolLM2 tokenizer."""
    from opentinker.core.model_names import TINY
    from opentinker.model.policy import load_model

    return load_model(TINY)


def tiny_spec(tmp_path, **overrides):
    """A JobSpec for the tiny model on the uppercase toy game, with nested overrides."""
    from opentinker.core.spec import parse_spec

    data = {
        "model": {"name": "tiny-random"},
        "adapter": {"kind": "lora", "r": 8, "alpha": 16},
        "rollout": {"prompts_per_step": 4, "group_size": 4, "max_new_tokens": 4},
        "optimization": {"lr": 1e-2, "steps": 4, "micro_batch_size": 8},
        "evaluation": {"every": 0, "n_samples": 16},
        "checkpoint": {"every": 2, "keep_last": 3, "base_url": f"file://{tmp_path}/runs"},
        "env": {"game": "envs.toy:UppercaseGame", "config": {"val_size": 16}},
        "seed": 3,
    }
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(data.get(key), dict) and key != "adapter":
            data[key] = {**data[key], **value}
        else:
            data[key] = value
    return parse_spec(data)
