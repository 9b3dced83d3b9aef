"""Spec input is bounded before it is parsed: each attack of the hostile-user review attempted at test
size on real files, through `opentinker validate` (a subprocess, as a user runs it), the client SDK's
`submit_job` and the functions both use.

- a spec file is measured on disk before a byte is read: a 2 GB sparse file and /dev/zero are refused
  at once, without the memory to hold them;
- its YAML is parsed once, with nesting and alias expansion bounded: a 342-byte alias bomb and a
  10,000-deep spec are refused in well under a second, in one line;
- one size limit holds end to end: what the checks let through fits Prefect's limit on a flow run's
  parameters (where the gateway puts the spec), and one byte more is refused, naming the field;
- the SDK's `submit_job` on a bad file raises the very line `validate` prints, before anything is sent.
The gateway's side (HTTP) is tests/security/test_gateway_input.py.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import tracemalloc
from pathlib import Path

import pytest
import yaml

from tests.conftest import tiny_spec

pytestmark = pytest.mark.timeout(300)
ROOT = Path(__file__).resolve().parents[2]
NOWHERE = "http://127.0.0.1:9"  # a gateway that would answer nothing: the SDK must refuse before sending


def _bomb() -> str:
    """The billion laughs in YAML: nine levels of nine aliases, 9**9 "lol"s once expanded."""
    lines = ['a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    for prev, name in zip("abcdefgh", "bcdefghi"):
        lines.append(f"{name}: &{name} [" + ",".join([f"*{prev}"] * 9) + "]")
    return "\n".join(lines) + "\n"


def _validate(path: Path, tmp_path: Path) -> tuple[subprocess.CompletedProcess, float]:
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, "-m", "opentinker.cli", "validate", str(path)], cwd=ROOT, capture_output=True, text=True,
                         timeout=120, env=os.environ | {"OPENTINKER_STATE_DIR": str(tmp_path / "state")})
    return out, time.monotonic() - t0


def _sdk_refusal(path: Path) -> str:
    from opentinker.client import InvalidJob, SchedulerClient

    client = SchedulerClient(url=NOWHERE, api_key="otk_x")
    with pytest.raises(InvalidJob) as refused:
        client.submit_job(config=str(path))
    client.close()
    assert refused.value.status == 422
    return str(refused.value)


def _bounded(fn, *args) -> tuple[float, int]:
    """(seconds, peak bytes allocated) of `fn(*args)`, which must raise SpecError."""
    from opentinker.core.spec import SpecError

    t0 = time.monotonic()
    with pytest.raises(SpecError):
        fn(*args)
    seconds = time.monotonic() - t0
    tracemalloc.start()
    try:
        with pytest.raises(SpecError):
            fn(*args)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    return seconds, peak


def _attack_files(tmp_path: Path) -> dict[str, tuple[Path, str]]:
    """name: (file, the reason its one line must give)."""
    bomb = tmp_path / "bomb.yaml"
    bomb.write_text(_bomb())
    deep = tmp_path / "deep.yaml"
    deep.write_text("model: {name: tiny-random}\nenv: {game: 'envs.toy:UppercaseGame', config: {x: " + "[" * 10_000 + "]" * 10_000 + "}}\n")
    sparse = tmp_path / "sparse.yaml"
    with sparse.open("wb") as f:
        f.truncate(2 * 1024**3)  # 2 GB on paper, no block on disk
    nul = tmp_path / "nul.yaml"
    nul.write_bytes(b"model: {name: tiny\x00random}\n")
    loop = tmp_path / "loop.yaml"
    loop.write_text("model: &m {name: tiny-random, again: *m}\n")
    return {"bomb": (bomb, "its YAML aliases expand it to more than the 256 KB a spec may hold"),
            "deep": (deep, "nested more than 64 levels deep (line 2)"),
            "sparse": (sparse, "2.0 GB, more than the 256 KB a spec may hold"),
            "nul": (nul, "not valid YAML: special characters are not allowed (character U+0000"),
            "loop": (loop, "a YAML alias refers to the node that holds it (line 1)")}


def test_an_alias_bomb_and_a_deep_spec_are_refused_in_well_under_a_second(tmp_path):
    from opentinker.core.spec import load_spec
    from opentinker.core.spec_limits import parse_spec_text

    files = _attack_files(tmp_path)
    assert len(_bomb()) < 700
    for name in ("bomb", "deep", "loop"):
        path, reason = files[name]
        seconds, peak = _bounded(load_spec, path)
        assert seconds < 0.5 and peak < 8 * 1024**2, (name, seconds, peak)
        seconds, peak = _bounded(parse_spec_text, path.read_text(), "x")
        assert seconds < 0.5 and peak < 8 * 1024**2, (name, seconds, peak)
    # the same shapes as plain data (a dict handed to the SDK, a JSON body): walked within the same bounds
    from opentinker.core.spec_limits import input_problem

    laughs: list = ["lol"] * 9
    for _ in range(8):
        laughs = [laughs] * 9
    deep: list = []
    for _ in range(900):
        deep = [deep]
    for data, reason in (({"env": {"config": {"x": laughs}}}, "more than the 256 KB a spec may hold"),
                         ({"env": {"config": {"x": deep}}}, "nested more than 64 levels deep")):
        t0 = time.monotonic()
        problem = input_problem(data)
        assert time.monotonic() - t0 < 1.0 and problem.startswith("env.config.x") and reason in problem, problem


def test_a_huge_or_endless_file_is_refused_by_its_size_before_it_is_read(tmp_path):
    from opentinker.core.spec import SpecError, load_spec
    from opentinker.core.spec_limits import MAX_SPEC_BYTES, read_spec_file

    path, _ = _attack_files(tmp_path)["sparse"]
    seconds, peak = _bounded(load_spec, path)
    assert seconds < 0.1 and peak < 1024**2, (seconds, peak)  # not a byte of the 2 GB read
    real = tmp_path / "real.yaml"
    real.write_text(yaml.safe_dump({**tiny_spec(tmp_path).model_dump(mode="json"), "pad": "x" * (MAX_SPEC_BYTES + 10)}))
    with pytest.raises(SpecError, match=rf"^{re.escape(str(real))}: 25\d KB, more than the 256 KB a spec may hold; give large data by path$"):
        read_spec_file(real)
    if os.path.exists("/dev/zero"):  # no size on disk, no end: read up to the limit and no further
        seconds, peak = _bounded(read_spec_file, "/dev/zero")
        assert seconds < 1.0 and peak < 2 * MAX_SPEC_BYTES + 1024**2, (seconds, peak)
    with pytest.raises(SpecError, match=rf"^{re.escape(str(tmp_path))}: a folder, not a spec file$"):
        read_spec_file(tmp_path)


def test_validate_and_the_sdk_refuse_each_attack_with_the_same_one_line(tmp_path):
    for name, (path, reason) in _attack_files(tmp_path).items():
        out, seconds = _validate(path, tmp_path)
        shown = out.stdout + out.stderr
        assert out.returncode == 2 and seconds < 60, (name, out)
        assert shown.count("\n") == 1 and "Traceback" not in shown and "Error:" not in shown, (name, shown)  # one line, no exception name
        line = shown.strip()
        assert line.startswith(f"invalid spec {path}: ") and reason in line, (name, line)
        assert f"invalid spec {_sdk_refusal(path)}" == line, name  # the SDK raises what validate prints, sending nothing


def test_a_spec_is_read_and_parsed_once(tmp_path, monkeypatch):
    from opentinker.cli.common import load_any_spec
    from opentinker.core import spec_limits

    parses = []
    real = spec_limits._BoundedLoader.get_single_node
    monkeypatch.setattr(spec_limits._BoundedLoader, "get_single_node", lambda self: parses.append(1) or real(self))
    monkeypatch.setattr(yaml, "safe_load", lambda *a, **k: pytest.fail("a spec parsed without the bounds"))
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(tiny_spec(tmp_path).model_dump(mode="json")))
    assert load_any_spec(path).model.name == "tiny-random"
    assert len(parses) == 1


def test_one_size_limit_holds_from_the_file_to_prefect(tmp_path):
    """What validate lets through, the gateway stores in a flow run's parameters within Prefect's limit
    (its own check, JSON escapes counted); one kilobyte more is refused naming the field, alike by the
    SDK (before sending) and by the spec's validation (which the gateway runs)."""
    from prefect._internal.schemas.validators import validate_parameter_size
    from prefect.settings import get_current_settings

    from opentinker.client import InvalidJob, SchedulerClient
    from opentinker.core.spec import SpecError, load_spec, parse_spec
    from opentinker.core.spec_limits import MAX_SPEC_BYTES, input_problem

    prefect_limit = get_current_settings().server.api.max_parameter_size
    assert 0 < MAX_SPEC_BYTES < prefect_limit
    for char, width in (("x", 1), ("\u00e9", 6), ("\x01", 6)):  # 'é' and U+0001 become 6 characters as JSON
        data = tiny_spec(tmp_path).model_dump(mode="json")
        data["env"]["config"]["note"] = ""
        room = MAX_SPEC_BYTES - len(json.dumps(data))
        data["env"]["config"]["note"] = char * (room // width)
        if char == "\x01":  # refused anywhere in a spec: NUL and the other control characters but tab, newline, CR
            assert input_problem(data) == "env.config.note: contains a control character (U+0001 at position 0)"
            continue
        assert input_problem(data) is None
        path = tmp_path / "edge.yaml"
        path.write_text(yaml.safe_dump(data, allow_unicode=False, width=2**20))
        if path.stat().st_size <= MAX_SPEC_BYTES:  # as a file too (with 'é' escaped, YAML holds more than JSON)
            load_spec(path)
        params = {"spec": parse_spec(data).model_dump(mode="json"), "job_id": "tenant-" + "j" * 64, "tenant": "tenant"}
        validate_parameter_size(params, prefect_limit)  # Prefect takes it
        data["env"]["config"]["note"] += char * (1024 // width)
        with pytest.raises(SpecError, match=r"^env\.config\.note: \d+ KB of a spec of 257 KB, more than the 256 KB a spec may hold"):
            parse_spec(data)
        with pytest.raises(InvalidJob, match=r"^env\.config\.note: .*more than the 256 KB a spec may hold"):
            SchedulerClient(url=NOWHERE, api_key="otk_x").submit_job(config=data)
