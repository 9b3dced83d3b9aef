"""The command line answers bad input with one clear line and a non-zero exit, never a traceback."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

from tests.stack_fixtures import free_ports

ROOT = Path(__file__).resolve().parents[1]


def _cli(*args: str, env: dict[str, str] | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "opentinker.cli", *args], cwd=ROOT, env=os.environ | (env or {}),
                          capture_output=True, text=True, timeout=timeout)


def test_invalid_spec_names_the_fields(tmp_path):
    spec = tmp_path / "bad.yaml"
    spec.write_text("model: {name: tiny-random}\nenv: {game: 'envs.math:MathGame'}\nrollout: {group_sise: 4}\noptimization: {lr: -1}\n")
    for command in ("validate", "run", "train"):
        out = _cli(command, str(spec))
        assert out.returncode == 2, out
        assert "rollout.group_sise: unknown key" in out.stdout and "optimization.lr: Input should be greater than 0" in out.stdout
        assert "Traceback" not in out.stdout + out.stderr


def test_valid_spec_validates():
    out = _cli("validate", "examples/math_grpo.yaml")
    assert out.returncode == 0 and "ok" in out.stdout


def test_unreachable_ray_address_is_one_line(tmp_path):
    (port,) = free_ports(1)
    out = _cli("train", "examples/toy_smoke.yaml", env={"OPENTINKER_RAY_ADDRESS": f"ray://127.0.0.1:{port}", "OPENTINKER_STATE_DIR": str(tmp_path)})
    assert out.returncode == 1
    assert f"Ray cluster at ray://127.0.0.1:{port} is not reachable" in out.stdout
    assert "Traceback" not in out.stdout + out.stderr


def test_port_in_use_is_one_line(tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        (mlflow_port,) = free_ports(1)
        out = _cli("up", env={"OPENTINKER_PREFECT_PORT": str(port), "OPENTINKER_MLFLOW_PORT": str(mlflow_port), "OPENTINKER_STATE_DIR": str(tmp_path)})
    assert out.returncode == 1
    assert f"prefect port {port} on 127.0.0.1 is in use by another program" in out.stdout
    assert "Traceback" not in out.stdout + out.stderr


def test_a_port_in_rays_worker_range_is_one_line_at_up(tmp_path):
    """`opentinker up` with the Ray client port inside Ray's worker ports fails at once in one line
    naming the setting (it used to fail after 42 s with Ray's traceback), nothing started."""
    ports = dict(zip(("OPENTINKER_PREFECT_PORT", "OPENTINKER_MLFLOW_PORT", "OPENTINKER_GATEWAY_PORT"), map(str, free_ports(3))))
    out = _cli("up", env={**ports, "OPENTINKER_RAY_CLIENT_PORT": "12000", "OPENTINKER_STATE_DIR": str(tmp_path), "COLUMNS": "200"})
    assert out.returncode == 1
    assert "stack: OPENTINKER_RAY_CLIENT_PORT=12000 is inside Ray's worker port range 10002-19999: choose a port outside it" in out.stdout
    assert "Traceback" not in out.stdout + out.stderr
    assert not (tmp_path / "pids").exists() or not list((tmp_path / "pids").iterdir())


def _gateway_line(tmp_path, data: dict) -> str:
    """What the gateway's submission check answers for `data` (its SpecError line, the 422's detail)."""
    import pytest

    from opentinker.control.gateway.jobs import TenantJobs
    from opentinker.core.settings import Settings
    from opentinker.core.spec import SpecError

    with pytest.raises(SpecError) as refused:
        TenantJobs(Settings(state_dir=tmp_path / "state"), "alice")._normalise(data, None)
    return str(refused.value)


TEXTARENA_REFUSED = [
    {"env": {"game": "envs.textarena:TextArenaGame", "config": {"env_id": "Wordle-v0"}}},  # downloads NLTK data
    {"env": {"game": "envs.textarena:TextArenaMatch", "config": {"env_id": "GuessTheNumber-v0"}}, "multiagent": {"players": ["P0", "P1"]}},
    {"env": {"game": "envs.textarena:TextArenaMatch", "config": {"env_id": "TicTacToe-v0"}}, "multiagent": {}},  # players X, O
]


def test_validate_and_run_say_what_the_gateway_says_of_a_game(tmp_path):
    """The gateway's game checks (allowlist, import, the class's check_config, players) run in
    `validate`, and in `run` before the model loads: the same line, exit 2."""
    import yaml

    for i, refused in enumerate(TEXTARENA_REFUSED):
        data = {"model": {"name": "tiny-random"}, **refused}
        line = _gateway_line(tmp_path, data)
        assert "\n" not in line and line.startswith(("env.config: ", "multiagent.players: "))
        spec = tmp_path / f"spec{i}.yaml"
        spec.write_text(yaml.safe_dump(data))
        for command in ("validate", "run"):
            out = _cli(command, str(spec), env={"COLUMNS": "1000", "OPENTINKER_STATE_DIR": str(tmp_path / "state")})
            assert out.returncode == 2, out
            assert out.stdout.strip() == f"invalid spec {spec}: {line}"
            assert "Traceback" not in out.stdout + out.stderr
    playable = tmp_path / "playable.yaml"
    playable.write_text(yaml.safe_dump({"model": {"name": "tiny-random"}, "multiagent": {"players": ["P0", "P1"]},
                                        "env": {"game": "envs.textarena:TextArenaMatch", "config": {"env_id": "TicTacToe-v0"}}}))
    out = _cli("validate", str(playable))
    assert out.returncode == 0 and out.stdout.startswith("ok "), out


def test_validate_refuses_reasoning_gym_prompts_that_cannot_fit(tmp_path):
    """chain_sum with 100,000 terms: 700,000-character questions, which no 1,024 tokens hold; the
    gateway's line, from `validate` as from the gateway."""
    import re

    import yaml

    data = {"model": {"name": "tiny-random"}, "env": {"source": "reasoning_gym", "dataset": "chain_sum",
                                                      "config": {"min_terms": 100_000, "max_terms": 100_000}}}
    line = _gateway_line(tmp_path, data)
    assert re.fullmatch(r"env\.config: a prompt of reasoning-gym chain_sum is at least [\d,]+ tokens \([1-7]00,4\d\d characters\) and "
                        r"rollout\.max_total_tokens is 1,024: no room is left for an answer; make its items smaller or "
                        r"rollout\.max_total_tokens larger", line), line
    spec = tmp_path / "chain_sum.yaml"
    spec.write_text(yaml.safe_dump(data))
    out = _cli("validate", str(spec), env={"COLUMNS": "1000"})
    assert out.returncode == 2 and out.stdout.strip() == f"invalid spec {spec}: {line}", out


def test_validate_and_submission_refuse_episodes_longer_than_the_models_context(tmp_path, tiny_path):
    """`rollout.max_total_tokens` over the model's max_position_embeddings (vLLM refused it 18 s into
    the job) is refused by `validate` and at submission, naming the field and both numbers; a known
    model's context is known unbuilt, a local folder's is its config.json's. Equal to it passes."""
    import json
    import shutil

    import pytest
    import yaml

    from opentinker.core.model_names import KNOWN_CONTEXTS, TINY
    from opentinker.core.spec import SpecError
    from tests.conftest import tiny_spec

    assert KNOWN_CONTEXTS[TINY] == json.loads((tiny_path / "config.json").read_text())["max_position_embeddings"]
    data = {"model": {"name": "tiny-random"}, "env": {"game": "envs.toy:UppercaseGame"}, "rollout": {"max_total_tokens": 1025}}
    line = _gateway_line(tmp_path, data)
    assert line == ("<spec>: rollout.max_total_tokens: 1025 is more than the 1024 tokens tiny-random takes "
                    "(its max_position_embeddings); make it at most 1024")
    spec = tmp_path / "long.yaml"
    spec.write_text(yaml.safe_dump(data))
    out = _cli("validate", str(spec), env={"COLUMNS": "1000"})
    assert out.returncode == 2 and out.stdout.strip() == f"invalid spec {spec}: {line}", out
    spec.write_text(yaml.safe_dump({**data, "rollout": {"max_total_tokens": 1024}}))
    out = _cli("validate", str(spec))
    assert out.returncode == 0 and out.stdout.startswith("ok "), out

    model = shutil.copytree(tiny_path, tmp_path / "model")
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 512}))
    with pytest.raises(SpecError, match=rf"rollout.max_total_tokens: 513 is more than the 512 tokens {model} takes"):
        tiny_spec(tmp_path, model={"name": str(model)}, rollout={"max_total_tokens": 513})
    assert tiny_spec(tmp_path, model={"name": str(model)}, rollout={"max_total_tokens": 512}).rollout.max_total_tokens == 512
