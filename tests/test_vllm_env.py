"""Whether a worker can run vLLM (opentinker.backend.vllm_env): an environment counts only where its
Python imports vllm, asked once per interpreter path; where it does not, `rollout.engine: auto`
falls back to the local engine with that one line, and an explicit `vllm` is refused with it."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest

from tests.conftest import tiny_spec


@pytest.fixture(autouse=True)
def fresh_import_checks():
    from opentinker.backend.vllm_env import import_problem

    import_problem.cache_clear()
    yield
    import_problem.cache_clear()


def executable(path: Path, text: str) -> Path:
    path.write_text(text)
    path.chmod(0o755)
    return path


def refusal(monkeypatch, python: Path | str) -> str:
    from opentinker.backend.vllm_env import VLLMUnavailable, check_available, vllm_python

    monkeypatch.setenv("OPENTINKER_VLLM_PYTHON", str(python))
    assert vllm_python() is None
    with pytest.raises(VLLMUnavailable) as err:
        check_available(0)
    line = str(err.value)
    assert "\n" not in line and f"OPENTINKER_VLLM_PYTHON={python} cannot import vllm: " in line
    return line


def test_a_python_without_vllm_is_refused_with_its_import_error(monkeypatch):
    import importlib.util

    assert importlib.util.find_spec("vllm") is None  # this test's own Python is one without vllm
    assert "`import vllm` exited 1: ModuleNotFoundError: No module named 'vllm'" in refusal(monkeypatch, sys.executable)


def test_an_executable_that_is_no_python_with_vllm_is_refused(monkeypatch, tmp_path):
    script = executable(tmp_path / "python", "#!/bin/sh\necho 'warming up'\necho 'garbage' >&2\nexit 1\n")
    assert "`import vllm` exited 1: garbage" in refusal(monkeypatch, script)
    text = executable(tmp_path / "notes.txt", "not a program\n")  # executable, but no #! line: the kernel runs none
    assert "does not run (Exec format error)" in refusal(monkeypatch, text)


def test_the_import_is_asked_once_per_interpreter(monkeypatch, tmp_path):
    """A worker asks on every job and sampler: the answer is the first one (a subprocess of seconds)."""
    from opentinker.backend.vllm_env import VLLMUnavailable, check_available

    asked = tmp_path / "asked"
    script = executable(tmp_path / "python", f"#!/bin/sh\necho asked >> {asked}\nexit 3\n")
    line = refusal(monkeypatch, script)
    with pytest.raises(VLLMUnavailable):
        check_available(0)
    assert "exited 3" in line and asked.read_text() == "asked\n"
    other = executable(tmp_path / "other", f"#!/bin/sh\necho again >> {asked}\nexit 3\n")
    refusal(monkeypatch, other)
    assert asked.read_text() == "asked\nagain\n"


def test_auto_falls_back_and_vllm_is_refused_with_the_import_error(monkeypatch, tmp_path, tiny_path):
    """`auto` picks the local engine with the import's line where the model would suit vLLM (heads of
    64 here); an explicit `vllm` (an inference server's, a job's) is refused with the same line."""
    import json

    from opentinker.backend.vllm_env import VLLMUnavailable
    from opentinker.inference.launch import check_engine
    from opentinker.inference.spec import InferenceSpec
    from opentinker.rl.engine_choice import choose_engine

    model = shutil.copytree(tiny_path, tmp_path / "model")
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "head_dim": 64}))
    monkeypatch.setenv("OPENTINKER_VLLM_PYTHON", sys.executable)
    spec, line = choose_engine(tiny_spec(tmp_path, model={"name": str(model)}), starts_servers=True)
    assert spec.rollout.engine == "local"
    assert line.startswith(f"rollout.engine auto chose local: engine 'vllm' needs vLLM's own environment "
                           f"(OPENTINKER_VLLM_PYTHON={sys.executable} cannot import vllm: "
                           "`import vllm` exited 1: ModuleNotFoundError: No module named 'vllm'; ")
    with pytest.raises(VLLMUnavailable, match="No module named 'vllm'"):
        check_engine(InferenceSpec(model_path=str(model), engine="vllm"))
