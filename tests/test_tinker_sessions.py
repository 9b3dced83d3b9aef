"""A tenant's live Tinker sessions are limited (OPENTINKER_TINKER_MAX_SESSIONS; 429 with one line
past it). A script that ends without ServiceClient.close() (most of tinker-cookbook's recipes)
leaves its session behind: it gives its place to the tenant's next session once its client has
sent nothing for `tinker_absent_after_s`, while a live client, idle but heartbeating, keeps its
own. Through the unmodified SDK and the gateway, sessions in this process (the stack's path:
tests/test_tinker_stack.py)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time

import pytest

tinker = pytest.importorskip("tinker")

ABSENT_S = 12.0  # more than the SDK's 10 s between heartbeats

FINISHED_SCRIPT = """
import sys, tinker
service = tinker.ServiceClient(base_url=sys.argv[1], api_key=sys.argv[2])
trainer = service.create_lora_training_client(base_model="tiny-random", rank=4, seed=0).result()
print(trainer.model_id.split(":")[0], flush=True)
"""  # and it ends, as a recipe does, without close()


@pytest.fixture(scope="module")
def gateway(tmp_path_factory):
    from opentinker.control.gateway.tinker_local import local_gateway

    url, keys, sessions, server = local_gateway(tmp_path_factory.mktemp("sessions"), tenants=("alice", "bob"), tinker_max_sessions=1,
                                                tinker_absent_after_s=ABSENT_S)
    yield url, keys, sessions
    server.stop()
    sessions.close()


def _open(url: str, key: str):
    """(service, trainer) of a new session; close the service (its heartbeats outlive the gateway otherwise)."""
    service = tinker.ServiceClient(base_url=url, api_key=key)
    return service, service.create_lora_training_client(base_model="tiny-random", rank=4, seed=0).result()


def test_a_live_idle_client_keeps_its_session(gateway):
    url, keys, _ = gateway
    key = keys["alice"]
    service = tinker.ServiceClient(base_url=url, api_key=key)
    service.create_lora_training_client(base_model="tiny-random", rank=4, seed=0).result()
    time.sleep(ABSENT_S + 4)  # idle: no call, only the SDK's heartbeats
    with pytest.raises(Exception, match=r"tenant alice has 1 live Tinker sessions, the limit is 1 \(OPENTINKER_TINKER_MAX_SESSIONS\)"):
        _open(url, key)
    service.close("success")


def test_a_finished_scripts_session_gives_its_place_once_its_client_is_gone(gateway):
    """Only the tenant's own gone sessions give places: Bob's, as gone as Alice's, stays."""
    url, keys, sessions = gateway
    key = keys["alice"]
    left = {}
    for name in ("bob", "alice"):
        script = subprocess.run([sys.executable, "-c", FINISHED_SCRIPT, url, keys[name]], capture_output=True, text=True, timeout=120,
                                env=os.environ | {"TINKER_TELEMETRY": "0"})
        # it reached its end and printed its session; how its interpreter then exits is the SDK's (its threads, never
        # closed, aborted that exit once in CI: SIGABRT, nothing on stderr; 0 of 12 runs here): either way its client is gone
        assert script.stdout.split(), (script.returncode, script.stderr[-2000:])
        left[name] = script.stdout.split()[0]
    left_behind = left["alice"]
    ended = time.monotonic()
    assert left_behind in sessions.live  # nothing closed it
    with pytest.raises(Exception, match=r"a session whose client is gone gives its place 12 s after its last heartbeat"):
        _open(url, key)  # too soon: it may be a live client between two heartbeats
    time.sleep(max(0.0, ABSENT_S + 1 - (time.monotonic() - ended)))
    service, trainer = _open(url, key)  # the place is given at once, seconds (not minutes) after the script ended
    assert left_behind not in sessions.live and trainer.model_id.split(":")[0] in sessions.live
    assert left["bob"] in sessions.live  # another tenant's session is not Alice's to end
    assert re.fullmatch(r"expired: no call or heartbeat for 1\d s, and a new session of its tenant needed its place "
                        r"\(OPENTINKER_TINKER_ABSENT_AFTER_S: 12 s\)", sessions.ended[left_behind]), sessions.ended[left_behind]
    service.close("success")
