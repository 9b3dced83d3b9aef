"""A tenant's copy of its job's log lines (opentinker/control/gateway/tenant_logs.py), on the text
real failures produce: Python's logging of a chained exception, Ray's error of a remote task, and
lines that name the operator's folders. The whole stack's version (a failing job read through the
gateway and the console) is tests/test_loud_failures.py."""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

import pytest
import yaml

from opentinker.control.gateway.tenant_logs import operator_folders, tenant_lines, tenant_message
from opentinker.core.settings import Settings

CHECKOUT = str(Path(__file__).resolve().parents[1])


@pytest.fixture
def folders(tmp_path):
    return operator_folders(Settings(state_dir=tmp_path / "state"))


def _logged_failure(record_message: str) -> str:
    """What Prefect's API handler sends for `logger.exception(record_message)` of a job whose game
    data is not JSON: the message, then the traceback of both exceptions."""
    def load() -> None:
        try:
            json.loads("[1, 2")
        except ValueError as err:
            raise RuntimeError("the game's data is not JSON") from err

    try:
        load()
    except RuntimeError:
        record = logging.LogRecord("prefect.flow_runs", logging.ERROR, __file__, 1, record_message, None, sys.exc_info())
    return logging.Formatter("%(message)s").format(record)


def test_a_logged_failure_keeps_its_line_and_its_error_not_its_traceback(folders):
    logged = _logged_failure("job j failed")
    assert "Traceback" in logged and CHECKOUT in logged and "json/decoder.py" in logged
    assert tenant_message(logged, folders) == "job j failed: RuntimeError: the game's data is not JSON"


def test_a_ray_tasks_error_loses_its_bare_frames_and_ray_names(folders):
    """Ray prints a remote task's frames without a "Traceback" header, after its own class's path."""
    from ray.exceptions import RayTaskError

    try:
        yaml.safe_load("a: [1")
    except yaml.YAMLError as cause:
        import traceback

        err = RayTaskError("RLJob.rollout", "".join(traceback.format_exception(cause)), cause)
    text = f"Encountered exception during execution: ray.exceptions.RayTaskError(MarkedYAMLError): {err}"
    assert 'File "' in text and "/site-packages/yaml/" in text
    shown = tenant_message(text, folders)
    assert shown.startswith("Encountered exception during execution: RayTaskError(MarkedYAMLError): "), shown
    assert shown.endswith(" (pid=%d, ip=%s): expected ',' or ']', but got '<stream end>'" % (err.pid, err.ip)), shown
    for leak in ('File "', "ray.", "site-packages", CHECKOUT, "\n", "\x1b["):
        assert leak not in shown, (leak, shown)


def test_the_operators_folders_are_named_and_the_jobs_own_lines_kept(tmp_path, folders):
    settings = Settings(state_dir=tmp_path / "state")
    lines = {f"checkpoint saved to file://{settings.state_dir}/storage/tenants/acme/j/step-1":
             "checkpoint saved to file://<state>/storage/tenants/acme/j/step-1",
             f"loading model {settings.models_folder}/tiny": "loading model <models>/tiny",
             f"{yaml.__file__}:12: UserWarning: slow": "<site-packages>/yaml/__init__.py:12: UserWarning: slow",
             "/opt/venv/lib/python3.10/site-packages/torch/nn.py:7: warning": "<site-packages>/torch/nn.py:7: warning",  # another node's
             f"reading {Path.home()}/.cache/huggingface and {CHECKOUT}/envs/math": "reading ~/.cache/huggingface and <checkout>/envs/math",
             f"python is {sys.prefix}/bin/python": "python is <python>/bin/python",
             "Downloading flow code from storage at '/tmp/tmpab12prefect'": "Downloading flow code from storage at '<tmp>/tmpab12prefect'",
             "step 2/2: reward 0.50 · val acc 75.0% (array.shape, x-ray, /srv/root/data)":
             "step 2/2: reward 0.50 · val acc 75.0% (array.shape, x-ray, /srv/root/data)"}
    for line, shown in lines.items():
        assert tenant_message(line, folders) == shown


def test_lines_stay_one_for_one_with_their_time_level_and_task(tmp_path):
    settings = Settings(state_dir=tmp_path / "state")
    lines = [{"time": "t0", "level": "INFO", "message": "step 1/2: reward 0.5", "task": "rollout-j-step-1"},
             {"time": "t1", "level": "ERROR", "message": _logged_failure("job j failed"), "task": None}]
    shown = tenant_lines(lines, settings)
    assert [{**line, "message": None} for line in shown] == [{**line, "message": None} for line in lines]
    assert [line["message"] for line in shown] == ["step 1/2: reward 0.5", "job j failed: RuntimeError: the game's data is not JSON"]
