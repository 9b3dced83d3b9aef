"""Takes the pictures of docs/console.md: docs/img/console-*.png, the web console's pages.

Starts a stack on free ports in a fresh state folder, adds a tenant, trains a tiny job (the test
suite's tiny model on the uppercase game) through the gateway, opens the console in headless
Chromium (tests/cdp.py) as the tenant and as the operator, and saves each page; stops the stack.

    .venv/bin/python docs/console_screenshots.py        # about two minutes on 2 cores
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
IMG = ROOT / "docs" / "img"


def main() -> int:
    from tests.cdp import Browser, chromium

    if chromium() is None:
        sys.exit("needs Debian's chromium (apt-get install chromium)")
    from opentinker.client import SchedulerClient
    from opentinker.control.console.session import operator_key
    from opentinker.control.gateway.tenants import TenantStore
    from opentinker.control.stack import Stack
    from opentinker.control.submit import deploy
    from opentinker.core.settings import mlflow_env, prefect_env, settings_env
    from tests.conftest import tiny_spec
    from tests.stack_fixtures import local_settings

    work = Path(tempfile.mkdtemp(prefix="ot-console-shots-"))
    settings = local_settings(work / "state", cpu_slots=2, gpu_slots=0)
    os.environ.update(settings_env(settings) | prefect_env(settings) | mlflow_env(settings))
    stack = Stack(settings)
    stack.up(timeout=240)
    browser = None
    try:
        deploy(settings)
        key = TenantStore(settings.state_dir / "tenants.json").create("acme")
        client = SchedulerClient(url=settings.gateway_url, api_key=key)
        spec = tiny_spec(work, optimization={"steps": 400}, evaluation={"every": 5, "n_samples": 4},
                         checkpoint={"every": 10}).model_dump(mode="json")
        done = client.submit_job(config={**spec, "job_id": "warmup", "optimization": {**spec["optimization"], "steps": 6}}, num_gpus=0)
        job = client.submit_job(config={**spec, "job_id": "uppercase"}, num_gpus=0)["job_id"]
        parked = {k: v for k, v in spec.items() if k != "env"}
        client.submit_job(config={**parked, "job_id": "waits-for-fit"}, num_gpus=0)
        browser = Browser(work / "chromium", width=1280, height=800)
        base = f"{settings.gateway_url}/console"
        browser.navigate(f"{base}/signin")
        browser.shoot(IMG / "console-signin.png", height=520)
        browser.submit("form[action='/console/signin']", {"key": key})
        browser.navigate(f"{base}/jobs/{job}")
        browser.wait("(() => { const c = document.querySelector('#charts [data-curve=\"reward\"]'); return c && +c.dataset.points >= 12 })()",
                     timeout=600, what="a dozen steps of the job's curve")
        browser.wait("document.querySelectorAll('#charts canvas').length >= 4 && document.querySelectorAll('#times canvas').length >= 2",
                     timeout=60, what="the curves drawn")
        print("job page:", browser.shoot(IMG / "console-job.png", height=1250, settle_s=2), "bytes", flush=True)
        browser.navigate(f"{base}/jobs")
        browser.wait_text(job, done["job_id"])
        browser.wait("document.getElementById('live').dataset.refreshed", timeout=15)
        print("jobs page:", browser.shoot(IMG / "console-jobs.png", height=520), "bytes", flush=True)
        browser.navigate(f"{base}/jobs/{job}/transcripts")
        browser.wait_text("Episode 0")
        print("transcripts:", browser.shoot(IMG / "console-transcripts.png", height=800), "bytes", flush=True)
        browser.navigate(f"{base}/jobs")
        browser.submit("form.signout")
        browser.submit("form[action='/console/signin']", {"key": operator_key(settings, create=True)})
        browser.navigate(f"{base}/operator")
        browser.wait_text("slots-cpu", job)
        print("operator:", browser.shoot(IMG / "console-operator.png", height=620), "bytes", flush=True)
        client.cancel_job(job)
    finally:
        if browser is not None:
            browser.close()
        stack.down()
        time.sleep(1)
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
