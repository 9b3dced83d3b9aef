"""Takes the pictures of docs/console.md: docs/img/console-*.png, the web console's pages.

Starts a stack on free ports in a fresh state folder, adds a tenant, trains a tiny job (the test
suite's tiny model on the uppercase game) through the gateway, serves a finished one, opens a
Tinker session and saves a checkpoint, opens the console in headless Chromium (tests/cdp.py) as
the tenant and as the operator, and saves each page (`shoot_pages`, which the test suite also
runs on its stack); stops the stack.

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


# (file, height in pixels): the pages docs/console.md shows, in the order they are taken
PAGES = {"signin": 520, "job": 1250, "jobs": 520, "transcripts": 800, "tinker": 620, "operator": 620}


def shoot_pages(browser, base: str, key: str, operator: str, job: str, out: Path, points: int = 12) -> dict[str, int]:
    """Each page of the console as `out`/console-<page>.png, the tenant's (`key`) with its running
    `job` once its reward curve has `points` points, then the operator's; {page: bytes}. The test
    suite runs this on its own stack (tests/test_console.py), so the pictures' script cannot rot."""
    sizes = {}
    curve = "(() => { const c = document.querySelector('#charts [data-curve=\"reward\"]'); return c ? +c.dataset.points : 0 })()"

    def shoot(page: str, settle_s: float = 1.0) -> None:
        sizes[page] = browser.shoot(out / f"console-{page}.png", height=PAGES[page], settle_s=settle_s)
        print(f"{page}: {sizes[page]} bytes", flush=True)

    browser.navigate(f"{base}/signin")
    shoot("signin")
    browser.submit("form[action='/console/signin']", {"key": key})
    browser.navigate(f"{base}/jobs/{job}")
    browser.wait(f"{curve} >= {points}", timeout=600, what=f"{points} steps of the job's curve")
    browser.wait("document.querySelectorAll('#charts canvas').length >= 4 && document.querySelectorAll('#times canvas').length >= 2",
                 timeout=60, what="the curves drawn")
    shoot("job", settle_s=2)
    browser.navigate(f"{base}/jobs")
    browser.wait_text(job)
    browser.wait("document.getElementById('live').dataset.refreshed", timeout=15, what="the list's live refresh")
    shoot("jobs")
    browser.navigate(f"{base}/jobs/{job}/transcripts")
    browser.wait_text("Episode 0")
    shoot("transcripts")
    browser.navigate(f"{base}/tinker")
    browser.wait_text("Tinker sessions", "Inference jobs")
    shoot("tinker")
    browser.navigate(f"{base}/jobs")
    browser.submit("form.signout")
    browser.submit("form[action='/console/signin']", {"key": operator})
    browser.navigate(f"{base}/operator")
    browser.wait_text("slots-cpu", job)
    shoot("operator")
    browser.navigate(f"{base}/jobs")
    browser.submit("form.signout")
    return sizes


def main() -> int:
    from tests.cdp import Browser, chromium

    if chromium() is None:
        sys.exit("needs Debian's chromium (apt-get install chromium)")
    from opentinker.client import InferenceSchedulerClient
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
        client = InferenceSchedulerClient(url=settings.gateway_url, api_key=key)
        spec = tiny_spec(work, optimization={"steps": 400}, evaluation={"every": 5, "n_samples": 4},
                         checkpoint={"every": 10}).model_dump(mode="json")
        warmup = client.submit_job(config={**spec, "job_id": "warmup", "optimization": {**spec["optimization"], "steps": 6}},
                                   num_gpus=0)["job_id"]
        job = client.submit_job(config={**spec, "job_id": "uppercase"}, num_gpus=0)["job_id"]
        parked = {k: v for k, v in spec.items() if k != "env"}
        client.submit_job(config={**parked, "job_id": "waits-for-fit"}, num_gpus=0)
        os.environ["TINKER_TELEMETRY"] = "0"
        import tinker

        service = tinker.ServiceClient(base_url=settings.gateway_url, api_key=key)  # a Tinker session for its page
        trainer = service.create_lora_training_client(base_model="tiny-random", rank=4, seed=0).result()
        trainer.save_weights_for_sampler("first").result()
        client.wait(warmup, timeout=600)
        served = client.submit_inference_job(model_path=warmup, engine="hf", timeout=600)["job_id"]  # for its URL
        browser = Browser(work / "chromium", width=1280, height=800)
        shoot_pages(browser, f"{settings.gateway_url}/console", key, operator_key(settings, create=True), job, IMG)
        service.close("success")
        client.cancel_job(served)
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
