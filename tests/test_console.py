"""The gateway's web console (opentinker/control/console): sessions, CSRF and CSP without a stack,
then in headless Chromium on the test stack: sign in, one's own jobs only, a live curve, a
transcript, cancel, sign out, and tenant strings that stay text."""

from __future__ import annotations

import json
import time

import httpx
import pytest

from tests.cdp import Browser
from tests.conftest import tiny_spec

HOSTILE = "<img src=x onerror=alert(1)>"
SCRIPT = "<script>alert('transcript')</script>"


# --- without a stack ---------------------------------------------------------------------------
@pytest.fixture
def gateway(tmp_path):
    """(TestClient of a gateway app, settings, a tenant's key); no Prefect is reached."""
    from fastapi.testclient import TestClient

    from opentinker.control.gateway.app import create_app
    from opentinker.control.gateway.tenants import TenantStore
    from opentinker.core.settings import Settings

    settings = Settings(state_dir=tmp_path / "state")
    key = TenantStore(settings.state_dir / "tenants.json").create("acme")
    with TestClient(create_app(settings), base_url="http://127.0.0.1") as client:
        yield client, settings, key


def _signed_in(client, key):
    r = client.post("/console/signin", data={"key": key}, follow_redirects=False)
    assert r.status_code == 303 and r.headers["location"] == "/console/jobs"
    return r


def test_session_cookie_is_signed_checked_and_ends_with_its_key(tmp_path):
    from opentinker.control.console.session import Sessions, operator_key
    from opentinker.control.gateway.tenants import TenantStore
    from opentinker.core.settings import Settings

    settings = Settings(state_dir=tmp_path)
    store = TenantStore(tmp_path / "tenants.json")
    key = store.create("acme")
    sessions = Sessions(settings, store)
    assert sessions.sign_in("tml-wrong") is None and sessions.sign_in("") is None
    session, cookie = sessions.sign_in(key)
    assert session.tenant == "acme" and key not in cookie
    assert sessions.read(cookie).tenant == "acme"
    body, _, mac = cookie.rpartition(".")
    forged = json.dumps({"s": "*operator*"})
    assert sessions.read(f"{body}x.{mac}") is None and sessions.read(f"{forged}.{mac}") is None
    assert sessions.csrf_ok(session, sessions.csrf(session)) and not sessions.csrf_ok(session, "") \
        and not sessions.csrf_ok(session, sessions.csrf(sessions.sign_in(key)[0]))
    store.create("acme", rotate=True)  # a new key ends the sessions of the old one
    assert sessions.read(cookie) is None
    op = operator_key(settings, create=True)
    assert operator_key(settings) == op and (tmp_path / "console-operator-key").stat().st_mode & 0o077 == 0
    op_session, op_cookie = sessions.sign_in(op)
    assert op_session.operator and sessions.read(op_cookie).operator
    other = Sessions(Settings(state_dir=tmp_path / "other"), store)  # another stack's secret: not its cookie
    assert other.read(op_cookie) is None


def test_signin_cookie_csp_and_csrf(gateway):
    client, settings, key = gateway
    page = client.get("/console/signin")
    assert page.status_code == 200 and "script-src 'self'" in page.headers["content-security-policy"]
    assert "frame-ancestors 'none'" in page.headers["content-security-policy"] and "<script>" not in page.text
    assert client.get("/console/jobs", follow_redirects=False).headers["location"] == "/console/signin"
    assert client.post("/console/signin", data={"key": "tml-nope"}).status_code == 401
    assert client.post("/console/signin", data={"key": key}, headers={"Origin": "https://evil.example"}).status_code == 403
    r = _signed_in(client, key)
    cookie = r.headers["set-cookie"]
    assert "httponly" in cookie.lower() and "samesite=strict" in cookie.lower() and "Path=/console" in cookie
    assert key not in cookie and key not in r.headers["location"]
    # an action without the session's CSRF token, or from another origin, is refused
    assert client.post("/console/jobs/acme-x/cancel").status_code == 403
    assert client.post("/console/jobs/acme-x/cancel", data={"csrf": "0" * 64}).status_code == 403
    assert client.post("/console/signout", data={}).status_code == 403
    from opentinker.control.console.session import COOKIE, Sessions
    from opentinker.control.gateway.tenants import TenantStore

    sessions = Sessions(settings, TenantStore(settings.state_dir / "tenants.json"))
    copied = client.cookies[COOKIE]
    token = sessions.csrf(sessions.read(copied))
    assert client.post("/console/signout", data={"csrf": token}, headers={"Origin": "http://evil.example"}).status_code == 403
    out = client.post("/console/signout", data={"csrf": token}, follow_redirects=False)
    assert out.status_code == 303 and COOKIE not in client.cookies
    assert client.get("/console/api/jobs").status_code == 401
    # a copy of the signed-out cookie opens nothing either: the server ended the session
    client.cookies.set(COOKIE, copied, path="/console")
    assert client.get("/console/api/jobs").status_code == 401
    client.cookies.clear()
    # static files: fixed names only
    assert client.get("/console/static/console.js").status_code == 200
    assert client.get("/console/static/uPlot.iife.min.js").status_code == 200
    assert client.get("/console/static/..%2Fsession.py").status_code == 404


def test_transcript_turns_are_escaped_and_marked():
    from opentinker.control.console.routes import _templates
    from opentinker.control.console.views import episode

    e = episode({"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": SCRIPT},
                              {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "f", "arguments": HOSTILE}}]},
                              {"role": "tool", "content": [{"type": "text", "text": HOSTILE},
                                                           {"type": "image_url", "image_url": {"url": "javascript:alert(1)"}}]},
                              {"role": "assistant", "content": "42"}], "reward": 1.0})
    assert [t["trained"] for t in e["turns"]] == [False, False, True, False, True]
    html = _templates().get_template("transcripts.html").render(session=None, csrf="", job_id=HOSTILE, files=["step-1.json"],
                                                               chosen="step-1.json", episodes=[e])
    assert SCRIPT not in html and HOSTILE not in html and "javascript:" not in html
    assert "&lt;script&gt;" in html and "&lt;img src=x onerror=alert(1)&gt;" in html


def test_transcript_tokens_show_what_the_update_trains_and_masks(tiny_path):
    """A record's tokens by loss mask: runs of one mask value, each decoded; together the whole
    record; on the page, the trained runs marked and every string escaped."""
    from transformers import AutoTokenizer

    from opentinker.control.console.routes import _templates
    from opentinker.control.console.views import episode
    from opentinker.core.trajectory import Trajectory
    from opentinker.tracking.transcripts import token_spans, transcripts

    tokenizer = AutoTokenizer.from_pretrained(tiny_path)
    prompt, reply, result, answer = (tokenizer(text, add_special_tokens=False)["input_ids"]
                                     for text in ("<|im_start|>user\nWhat is 2+2?", SCRIPT, "\ntool says 4\n", "Answer: 4"))
    ids = prompt + reply + result + answer
    mask = [0] * len(prompt) + [1] * len(reply) + [0] * len(result) + [1] * len(answer)
    spans = token_spans(tokenizer, ids, mask)
    assert [s["trained"] for s in spans] == [False, True, False, True]
    assert [s["text"] for s in spans] == [tokenizer.decode(part) for part in (prompt, reply, result, answer)]
    assert "".join(s["text"] for s in spans) == tokenizer.decode(ids)
    record = transcripts([Trajectory(prompt_ids=prompt, token_ids=ids, loss_mask=mask, messages=[{"role": "user", "content": "2+2"}])],
                         tokenizer)[0]
    assert record["tokens"] == spans and json.loads(json.dumps(record))["tokens"] == spans
    e = episode(record)
    html = _templates().get_template("transcripts.html").render(session=None, csrf="", job_id="j", files=["step-1.json"],
                                                               chosen="step-1.json", episodes=[e])
    assert SCRIPT not in html and '<span class="trained">&lt;script&gt;' in html and '<span class="trained">Answer: 4</span>' in html
    assert episode({"tokens": [{"text": "x" * 300_000, "trained": "yes"}]})["tokens"] == [{"text": "x" * 200_000, "trained": False}]


# --- in a browser, on the test stack -------------------------------------------------------------
def _spec(tmp_path, steps, every=2, **overrides):
    return tiny_spec(tmp_path, optimization={"steps": steps}, checkpoint={"every": every}, **overrides).model_dump(mode="json")


@pytest.fixture(scope="module")
def console(stack_env, tmp_path_factory, chromium):
    from opentinker.client import SchedulerClient
    from opentinker.control.console.session import operator_key
    from tests.stack_fixtures import deployed_tenants

    settings, _ = stack_env
    key, rival_key = deployed_tenants(settings, "webacme", "webrival")
    tmp = tmp_path_factory.mktemp("console")
    mine, rival = SchedulerClient(url=settings.gateway_url, api_key=key), SchedulerClient(url=settings.gateway_url, api_key=rival_key)
    running = mine.submit_job(config=_spec(tmp, 5000, 20, evaluation={"every": 5, "n_samples": 4}), num_gpus=0)["job_id"]
    theirs = rival.submit_job(config={k: v for k, v in _spec(tmp, 2).items() if k != "env"}, num_gpus=0)["job_id"]  # parked
    hostile = mine.submit_job(config={k: v for k, v in _spec(tmp, 2).items() if k != "env"}, num_gpus=0)["job_id"]
    from prefect.states import Failed

    from opentinker.control.scheduler import prefect_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterTags

    with prefect_client() as client:  # a job whose reason is a tenant's string (a failure message)
        run = client.read_flow_runs(flow_run_filter=FlowRunFilter(tags=FlowRunFilterTags(all_=[f"job:{hostile}"])))[0]
        client.set_flow_run_state(run.id, Failed(message=HOSTILE), force=True)
    browser = Browser(tmp / "chromium")
    try:
        yield {"settings": settings, "key": key, "operator": operator_key(settings, create=True), "running": running,
               "theirs": theirs, "hostile": hostile, "browser": browser, "base": f"{settings.gateway_url}/console", "client": mine}
    finally:
        browser.close()


def _sign_in(b, base, key):
    b.navigate(f"{base}/signin")
    b.submit("form[action='/console/signin']", {"key": key})
    assert b.url().endswith("/console/jobs"), b.url()


def test_browser_signs_in_and_sees_only_its_own_jobs(console):
    b, base = console["browser"], console["base"]
    _sign_in(b, base, console["key"])
    text = b.wait_text(console["running"], console["hostile"])
    assert console["theirs"] not in text and "webrival" not in text
    # the key is nowhere the page's scripts or the address bar can read it
    assert b.js("document.cookie") == "" and console["key"] not in b.url()
    assert b.js("localStorage.length + sessionStorage.length") == 0
    # a tenant's string renders as text: no element made of it, no dialog
    assert HOSTILE in text and b.js("document.querySelectorAll('img').length") == 0
    b.wait("document.getElementById('live').dataset.refreshed", timeout=15, what="the list's live refresh")
    assert HOSTILE in b.text() and b.js("document.querySelectorAll('img').length") == 0
    # filters: by state, and by id
    b.navigate(f"{base}/jobs?state=FAILED")
    assert console["hostile"] in b.text() and console["running"] not in b.text()
    b.navigate(f"{base}/jobs?q={console['running']}")
    assert console["running"] in b.text() and console["hostile"] not in b.text()
    # another tenant's job by its URL: the not-found page
    b.navigate(f"{base}/jobs/{console['theirs']}")
    assert "There is no job" in b.text() and b.js("fetch(location.href).then(r => r.status)") == 404
    b.pump()
    assert b.dialogs == [], b.dialogs


def test_browser_watches_a_running_jobs_curve_gain_a_point(console):
    from mlflow.tracking import MlflowClient

    b, base, job = console["browser"], console["base"], console["running"]
    b.navigate(f"{base}/jobs/{job}")
    points = "(() => { const c = document.querySelector('#charts [data-curve=\"reward\"]'); return c ? +c.dataset.points : 0 })()"
    first = b.wait(points, timeout=240, what="the reward curve's first point")
    seen = b.wait(f"{points} > {first} && {points}", timeout=120, what="the reward curve's next point")
    seen_at = time.time()
    assert b.js("document.querySelector('#charts [data-curve=\"reward\"] canvas') !== null")  # uPlot drew it
    ml = MlflowClient(tracking_uri=console["settings"].mlflow_url)
    run = ml.search_runs([ml.get_experiment_by_name("webacme").experiment_id], filter_string=f"tags.`opentinker.job_id` = '{job}'")[0]
    logged = {m.step: m.timestamp / 1000 for m in ml.get_metric_history(run.info.run_id, "rollout/reward_mean")}
    step = sorted(logged)[seen - 1]
    assert seen_at - logged[step] < 5.0 + 0.5, f"step {step} shown {seen_at - logged[step]:.1f} s after it was logged"
    assert "RUNNING" in b.text() and b.wait("document.getElementById('logs').textContent.length > 0", timeout=30, what="log lines")
    assert "job_id:" in b.text() or "model:" in b.text()  # the spec, as YAML


def test_browser_opens_a_transcript_and_scripts_in_it_stay_text(console):
    from mlflow.tracking import MlflowClient

    b, base, job = console["browser"], console["base"], console["running"]
    ml = MlflowClient(tracking_uri=console["settings"].mlflow_url)
    run = ml.search_runs([ml.get_experiment_by_name("webacme").experiment_id], filter_string=f"tags.`opentinker.job_id` = '{job}'")[0]
    hostile = [{"task": SCRIPT, "reward": 0.5, "messages": [{"role": "system", "content": "sys"}, {"role": "user", "content": SCRIPT},
                                                            {"role": "assistant", "content": HOSTILE}]}]
    ml.log_text(run.info.run_id, json.dumps(hostile), "transcripts/step-999999.json")
    b.navigate(f"{base}/jobs/{job}/transcripts")
    text = b.wait_text("Episode 0", SCRIPT, HOSTILE)
    assert b.js("document.querySelectorAll('script').length") == 2  # uPlot and console.js, nothing of the transcript
    assert b.js("document.querySelectorAll('img').length") == 0
    assert b.js("document.querySelectorAll('.turn.trained').length") == 1 and "masked" in text
    options = b.js("[...document.querySelectorAll('#t-file option')].map(o => o.value)")
    assert len(options) >= 2, options  # the job's own evaluation transcripts too
    b.navigate(f"{base}/jobs/{job}/transcripts?file={options[-1]}")
    b.wait_text("Episode 0", "assistant")
    # the job's own record: its tokens, the policy's marked trained and the prompt's masked
    assert b.js("document.querySelectorAll('pre.tokens .trained').length") >= 1
    assert b.js("document.querySelectorAll('pre.tokens .masked').length") >= 1
    b.pump()
    assert b.dialogs == [], b.dialogs


def test_browser_shows_tinker_sessions(console):
    """The tenant's Tinker session and its checkpoint's tinker:// path on the Tinker page."""
    tinker = pytest.importorskip("tinker")
    b, base, key = console["browser"], console["base"], console["key"]
    mp = pytest.MonkeyPatch()
    mp.setenv("TINKER_TELEMETRY", "0")
    service = tinker.ServiceClient(base_url=console["settings"].gateway_url, api_key=key)
    try:
        trainer = service.create_lora_training_client(base_model="tiny-random", rank=4, seed=0).result()
        path = trainer.save_weights_for_sampler("console").result().path
        assert path.startswith("tinker://")
        _sign_in(b, base, key)
        b.navigate(f"{base}/tinker")
        text = b.wait_text(path, "RUNNING")
        assert "No Tinker sessions." not in text and trainer.model_id in text
    finally:
        service.close("success")
        mp.undo()
    b.navigate(f"{base}/jobs")
    b.submit("form.signout")
    b.pump()
    assert b.dialogs == [], b.dialogs


@pytest.mark.slow  # every page shot at the docs' size (~20 s); each page is opened and checked by the default tests above and below
def test_browser_takes_the_docs_pictures(console, tmp_path):
    """The docs' own script (docs/console_screenshots.py) takes every page the docs show, here."""
    import importlib.util
    import re
    from pathlib import Path

    from PIL import Image

    b, base, key = console["browser"], console["base"], console["key"]
    root = Path(__file__).resolve().parents[1]
    loaded = importlib.util.spec_from_file_location("console_screenshots", root / "docs" / "console_screenshots.py")
    script = importlib.util.module_from_spec(loaded)
    loaded.loader.exec_module(script)
    sizes = script.shoot_pages(b, base, key, console["operator"], console["running"], tmp_path, points=1)
    shown = set(re.findall(r"img/console-([a-z]+)\.png", (root / "docs" / "console.md").read_text()))
    assert set(sizes) == shown == set(script.PAGES), (sorted(sizes), sorted(shown))
    for page, height in script.PAGES.items():
        assert (root / "docs" / "img" / f"console-{page}.png").exists()
        with Image.open(tmp_path / f"console-{page}.png") as picture:
            assert picture.size == (b.width, height) and len(picture.getcolors(256) or range(256)) > 8, page
    b.pump()
    assert b.dialogs == [], b.dialogs


def test_browser_cancel_needs_the_csrf_token_and_then_cancels(console):
    b, base, job = console["browser"], console["base"], console["running"]
    _sign_in(b, base, console["key"])
    b.navigate(f"{base}/jobs/{job}")
    b.wait("!!document.getElementById('cancel')", what="the cancel button")
    status = b.js(f"fetch('/console/jobs/{job}/cancel', {{method: 'POST'}}).then(r => r.status)")
    assert status == 403  # the browser's own cookie, no token
    status = b.js(f"fetch('/console/jobs/{job}/cancel', {{method: 'POST', body: new URLSearchParams({{csrf: 'f'.repeat(64)}})}}).then(r => r.status)")
    assert status == 403
    assert console["client"].job_status(job)["state"] == "RUNNING"
    b.submit("form.cancel")
    assert b.url().endswith(f"/console/jobs/{job}")
    b.wait("['RUNNING', 'CANCELLED'].includes(document.getElementById('job-state').textContent)", what="the job's state after cancel")
    deadline = time.monotonic() + 120
    while console["client"].job_status(job)["state"] != "CANCELLED" and time.monotonic() < deadline:
        time.sleep(1)
    assert console["client"].job_status(job)["state"] == "CANCELLED"


def test_browser_operator_sees_every_tenant_and_the_slots(console):
    b, base = console["browser"], console["base"]
    b.navigate(f"{base}/jobs")
    b.submit("form.signout")
    assert b.url().endswith("/console/signin")
    b.navigate(f"{base}/jobs")
    assert b.url().endswith("/console/signin")  # signed out
    _sign_in(b, base, console["operator"])
    text = b.wait_text(console["theirs"], "webrival", "tenant")  # a parked job: first in the list
    # the suite's other modules leave many jobs on this stack: the operator finds one by its id
    b.navigate(f"{base}/jobs?q={console['running']}")
    assert "webacme" in b.wait_text(console["running"]) and console["theirs"] not in b.text()
    b.navigate(f"{base}/operator")
    assert "slots-cpu" in b.wait_text("Slots", "Queue")
    b.navigate(f"{base}/jobs/{console['theirs']}")
    assert console["theirs"] in b.text() and "There is no job" not in b.text()
    b.navigate(f"{base}/jobs")
    b.submit("form.signout")
    r = httpx.post(f"{base}/signin", data={"key": console["key"]})  # a tenant's key never opens the operator's page
    assert r.status_code in (200, 303)
    b.pump()
    assert b.dialogs == [], b.dialogs


def test_a_transcript_file_too_large_is_refused_before_it_is_downloaded(tmp_path):
    """A tenant's game writes the transcripts: one listed over the limit is refused without being read."""
    from opentinker.control.console import views

    downloaded = []

    class Listed:  # what TenantJobs answers: the artifact listing, and the download it must not make
        def artifacts(self, job_id, path):
            return [{"path": "transcripts/step-000001.json", "is_dir": False, "size": views.MAX_TRANSCRIPT_BYTES + 1}]

        def download_artifact(self, job_id, path, dst):
            downloaded.append(path)
            raise AssertionError("downloaded")

    with pytest.raises(ValueError, match=r"step-000001\.json is \d+ bytes, more than the console shows"):
        views.transcripts(Listed(), "acme-j", "step-000001.json")
    assert downloaded == [] and views.transcripts(Listed(), "acme-j", "../../etc/passwd") == []


# --- bounded under load ----------------------------------------------------------------------------
def test_read_bounds_queue_in_order_and_refuse_past_the_line():
    """A session's reads past its slots wait in line and get them in order; a request past its
    line is refused at once, and a read that waited its time is refused then; another session is
    not held up; a read waits in the shared line of reads until its request's time is up; past
    the console's pace a request whose turn would come too late is refused."""
    import asyncio
    import threading

    from opentinker.control.console.bounds import Busy, ReadBounds

    async def scenario() -> list[str]:
        bounds = ReadBounds(per_session=1, reads=2, in_flight=3, wait_s=30)
        order: list[str] = []
        release = asyncio.Event()

        async def read(session: str, name: str) -> None:
            async with bounds.request(session), bounds.reading():
                order.append(name)
                await release.wait()

        first = asyncio.create_task(read("a", "a1"))
        await asyncio.sleep(0)
        queued = [asyncio.create_task(read("a", f"a{i}")) for i in (2, 3)]
        while bounds.inside("a") < 3:
            await asyncio.sleep(0)
        with pytest.raises(Busy, match="3 console requests in flight"):
            async with bounds.request("a"):
                pass
        other = asyncio.create_task(read("b", "b1"))
        while "b1" not in order:
            await asyncio.sleep(0)
        release.set()
        await asyncio.gather(first, other, *queued)

        short = ReadBounds(per_session=1, reads=1, in_flight=2, rest=0, wait_s=0.05)
        async with short.request("a"), short.reading():  # the session's one read slot, then its line's wait: 429
            with pytest.raises(Busy, match="this session's reads") as refused:
                async with short.request("a"), short.reading():
                    pass
        assert refused.value.retry_after_s > 0 and short.inside("a") == 0
        started, blocked = threading.Event(), threading.Event()
        reading = asyncio.ensure_future(short.run(lambda: started.set() or blocked.wait(60)))  # holds the one shared read slot
        try:
            while not started.is_set():
                await asyncio.sleep(0.001)
            async with short.request("b"):
                with pytest.raises(Busy, match="busy with other sessions"):
                    await short.run(len, "x")
        finally:
            blocked.set()
        assert await reading is True and short.reads.taken == 0 and not short.reads.waiting
        paced = ReadBounds(per_s=1, wait_s=0.05)  # one request a second, all sessions: the next one's turn is too far
        async with paced.request("a"):
            pass
        with pytest.raises(Busy, match="busy with other sessions"):
            async with paced.request("b"):
                pass
        assert paced.inside("b") == 0
        return order

    order = asyncio.run(scenario())
    assert order == ["a1", "b1", "a2", "a3"]


def test_kept_answers_are_read_once_and_the_one_before_is_given_while_read_again():
    """Five asking at once make one read; another tenant makes its own; once an answer is no longer
    fresh, the first to ask reads it again while the others get the one before at once; a
    failure is never kept."""
    import asyncio

    from opentinker.control.console.recent import Recent

    async def scenario() -> None:
        recent, reads = Recent(), []

        async def read(n: int, gate: asyncio.Event | None = None) -> int:
            reads.append(n)
            if gate is not None:
                await gate.wait()
            if n < 0:
                raise LookupError("no such job")
            return n

        gate = asyncio.Event()
        many = [asyncio.ensure_future(recent.get("acme", ("k",), 0.01, lambda: read(1, gate))) for _ in range(5)]
        await asyncio.sleep(0)
        gate.set()
        assert await asyncio.gather(*many) == [1] * 5 and reads == [1]
        assert await recent.get("rival", ("k",), 60, lambda: read(2)) == 2 and reads == [1, 2]
        await asyncio.sleep(0.05)  # acme's answer is no longer fresh (kept 0.01 s)
        again = asyncio.Event()
        first = asyncio.ensure_future(recent.get("acme", ("k",), 0.01, lambda: read(3, again)))
        while len(reads) < 3:
            await asyncio.sleep(0)
        assert await recent.get("acme", ("k",), 0.01, lambda: read(4)) == 1 and reads == [1, 2, 3]
        again.set()
        assert await first == 3
        for _ in range(2):
            with pytest.raises(LookupError):
                await recent.get("acme", ("gone",), 60, lambda: read(-1))
        assert reads == [1, 2, 3, -1, -1]

    asyncio.run(scenario())


def test_health_answers_while_every_thread_of_the_gateways_pool_is_taken(gateway):
    """`/v1/health` runs on the event loop: with every thread of the pool the API's routes share
    taken (as a flood of slow reads takes them), it still answers."""
    import threading

    import anyio

    client, _, key = gateway
    blocked = threading.Event()
    total = client.portal.call(lambda: _tokens())
    held = [client.portal.start_task_soon(anyio.to_thread.run_sync, blocked.wait) for _ in range(total)]
    answers: dict[str, int] = {}
    try:
        asking = threading.Thread(target=lambda: answers.update(health=client.get("/v1/health").status_code), daemon=True)
        asking.start()
        asking.join(timeout=60)  # not a timing: a health that waits for a thread never answers
        assert answers == {"health": 200}
    finally:
        blocked.set()
        for future in held:
            future.result(timeout=60)
    assert client.get("/v1/whoami", headers={"Authorization": f"Bearer {key}"}).status_code == 200


async def _tokens() -> int:
    import anyio

    return int(anyio.to_thread.current_default_thread_limiter().total_tokens)


@pytest.fixture(scope="module")
def two_tenants(stack_env, tmp_path_factory):
    """Two tenants of the test stack, each with a job parked (waiting for its environment: it never runs)."""
    from opentinker.client import SchedulerClient
    from tests.stack_fixtures import deployed_tenants

    settings, _ = stack_env
    keys = deployed_tenants(settings, "loadco", "loadrival")
    tmp = tmp_path_factory.mktemp("console-load")
    parked = {k: v for k, v in _spec(tmp, 2).items() if k != "env"}
    jobs = [SchedulerClient(url=settings.gateway_url, api_key=key).submit_job(config=parked, num_gpus=0)["job_id"] for key in keys]
    return settings, keys, jobs


def _cookie(client, key) -> str:
    from opentinker.control.console.session import COOKIE

    _signed_in(client, key)
    value = client.cookies[COOKIE]
    client.cookies.clear()
    return f"{COOKIE}={value}"


def test_one_sessions_flood_waits_in_its_line_while_others_and_health_answer(two_tenants):
    """More reads from one session than its bound: they wait in its line, one past the line is 429
    with Retry-After; meanwhile another session's read, the tenant API and /v1/health answer.
    (The session's two slots are held here as two slow reads would hold them.)"""
    from concurrent.futures import ThreadPoolExecutor

    from fastapi.testclient import TestClient

    from opentinker.control.console.bounds import ReadBounds
    from opentinker.control.console.session import Sessions
    from opentinker.control.gateway.app import create_app
    from opentinker.control.gateway.tenants import TenantStore

    settings, (key, _), (job, _) = two_tenants
    bounds = ReadBounds(per_session=2, reads=3, in_flight=3, rest=0, wait_s=600)
    with TestClient(create_app(settings, console_bounds=bounds), base_url="http://127.0.0.1") as client, \
            ThreadPoolExecutor(2) as pool:
        flooding, other = _cookie(client, key), _cookie(client, key)
        nonce = Sessions(settings, TenantStore(settings.state_dir / "tenants.json")).read(flooding.partition("=")[2]).nonce
        release = client.portal.call(_event)

        async def slow_read() -> None:
            async with bounds.request(nonce), bounds.reading():
                await release.wait()

        held = [client.portal.start_task_soon(slow_read) for _ in range(2)]
        try:
            _until(lambda: bounds.inside(nonce) == 2)
            queued = pool.submit(client.get, f"/console/api/jobs/{job}", headers={"Cookie": flooding})
            _until(lambda: bounds.inside(nonce) == 3)
            refused = client.get("/console/api/jobs", headers={"Cookie": flooding})
            assert refused.status_code == 429 and int(refused.headers["retry-after"]) > 0 and "busy" in refused.json()["detail"]
            page = client.get(f"/console/jobs/{job}", headers={"Cookie": flooding})
            assert page.status_code == 429 and page.headers["retry-after"] and "busy" in page.text
            theirs = client.get("/console/api/jobs", headers={"Cookie": other})
            assert theirs.status_code == 200 and job in [r["job_id"] for r in theirs.json()["jobs"]]
            assert client.get("/v1/health").json() == {"ok": True}
            assert client.get(f"/v1/jobs/{job}", headers={"Authorization": f"Bearer {key}"}).status_code == 200
            assert not queued.done() and bounds.inside(nonce) == 3  # still in its line
        finally:
            client.portal.call(_set, release)
            for future in held:
                future.result(timeout=60)
        answered = queued.result(timeout=120)
        assert answered.status_code == 200 and answered.json()["job"]["job_id"] == job
        _until(lambda: bounds.inside(nonce) == 0)
        assert client.get("/console/api/jobs", headers={"Cookie": flooding}).status_code == 200


async def _event():
    import asyncio

    return asyncio.Event()


async def _set(event) -> None:
    event.set()


def _until(condition, timeout_s: float = 60.0) -> None:
    """Waits for a state the server reaches (not a timing: fails only if it never does)."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "the server never got there"
        time.sleep(0.01)


def test_kept_answers_are_never_another_tenants(two_tenants):
    """The console keeps answers a moment per tenant: right after one tenant's list, search, job
    JSON and job page were read (and kept), the other tenant asking the same URLs gets its own."""
    settings, (key, rival_key), (job, rival_job) = two_tenants
    with httpx.Client(base_url=settings.gateway_url, timeout=120) as mine, httpx.Client(base_url=settings.gateway_url, timeout=120) as theirs:
        for client, k in ((mine, key), (theirs, rival_key)):
            _signed_in(client, k)
        for url in ("/console/api/jobs", f"/console/api/jobs?q={job}"):
            assert job in mine.get(url).text, url
            other = theirs.get(url)  # the same URL at once: the first answer is kept, but only for its tenant
            assert other.status_code == 200 and job not in other.text, url
        assert mine.get(f"/console/api/jobs/{job}").json()["job"]["job_id"] == job
        assert theirs.get(f"/console/api/jobs/{job}").json() == {"detail": "no such job"}
        assert mine.get(f"/console/api/jobs/{job}/logs?offset=0").json()["job_id"] == job
        assert theirs.get(f"/console/api/jobs/{job}/logs?offset=0").json() == {"detail": "no such job"}
        assert "optimization:" in mine.get(f"/console/jobs/{job}").text  # its spec
        page = theirs.get(f"/console/jobs/{job}")
        assert page.status_code == 404 and "There is no job" in page.text and "optimization:" not in page.text
        assert [r["job_id"] for r in theirs.get("/console/api/jobs").json()["jobs"]] == [rival_job]
        assert [r["job_id"] for r in mine.get("/console/api/jobs").json()["jobs"]] == [job]
