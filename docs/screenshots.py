"""Takes the pictures of the docs' "Watch it" part: docs/img/prefect-run.png and
docs/img/mlflow-run.png, the Prefect and MLflow run pages of a short demo job.

Pictures of a UI drift from the UI unless they can be made again by one command, so this script
does what a reader does: `opentinker up`, `opentinker train examples/math_grpo.yaml --steps 3`,
open the two links the run ends with. It uses a fresh state folder and free ports (a stack the
reader runs on the default ports is not touched), takes the pages with headless Chromium
(Debian's `chromium`) over the DevTools protocol, waiting until each page shows the job's data
(the single-page apps render well after the load event), and stops the stack in the end.

    .venv/bin/python docs/screenshots.py            # about two minutes on 2 cores
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from opentinker.control.services import free_ports  # noqa: E402
IMG = ROOT / "docs" / "img"
CLI = Path(sys.executable).parent / "opentinker"
PORTS = ("PREFECT_PORT", "MLFLOW_PORT", "GATEWAY_PORT", "RAY_PORT", "RAY_CLIENT_PORT")
WIDTH, HEIGHT = 1400, 900
JOB = "docs-demo"


def opentinker(env: dict[str, str], *args: str, timeout: float = 900) -> str:
    """Run the CLI as a reader would; its output (echoed), or exit with it when the command fails."""
    proc = subprocess.run([str(CLI), *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    print(proc.stdout[-4000:], proc.stderr[-2000:] if proc.returncode else "", sep="\n", flush=True)
    if proc.returncode != 0:
        sys.exit(f"opentinker {' '.join(args)} failed ({proc.returncode})")
    return proc.stdout


class Browser:
    """Headless Chromium driven over the DevTools protocol: one page, a fixed width."""

    def __init__(self, profile: Path):
        port_file = profile / "DevToolsActivePort"
        port_file.unlink(missing_ok=True)  # a profile used before: wait for this browser's port
        self.process = subprocess.Popen(
            ["chromium", "--headless=new", "--no-sandbox", "--hide-scrollbars", "--disable-gpu-sandbox", "--enable-unsafe-swiftshader",
             f"--window-size={WIDTH},{HEIGHT}", "--remote-debugging-port=0", "--remote-allow-origins=*", f"--user-data-dir={profile}",
             "about:blank"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            deadline = time.monotonic() + 30
            while not (port_file.exists() and port_file.read_text().count("\n") >= 1):
                if time.monotonic() > deadline:
                    raise RuntimeError("chromium did not open its DevTools port")
                time.sleep(0.2)
            port = port_file.read_text().split()[0]
            targets = json.load(urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=10))
            page = next(t for t in targets if t["type"] == "page")
            from websockets.sync.client import connect

            self.ws = connect(page["webSocketDebuggerUrl"], max_size=64 * 2**20)
        except BaseException:
            self.process.kill()
            self.process.wait()
            raise
        self.next_id = 0

    def call(self, method: str, **params):
        self.next_id += 1
        self.ws.send(json.dumps({"id": self.next_id, "method": method, "params": params}))
        while True:
            message = json.loads(self.ws.recv(timeout=60))
            if message.get("id") == self.next_id:
                if "error" in message:
                    raise RuntimeError(f"{method}: {message['error']}")
                return message.get("result", {})

    def js(self, expression: str):
        return self.call("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True).get("result", {}).get("value")

    def open(self, url: str, shows: list[str], hides: tuple[str, ...] = (), height: int = HEIGHT, timeout: float = 90) -> None:
        """Open `url` in a window `height` tall and wait until its text holds every string of
        `shows` and none of `hides`: the job's data, not a loading page."""
        self.call("Emulation.setDeviceMetricsOverride", width=WIDTH, height=height, deviceScaleFactor=1, mobile=False)
        self.call("Page.navigate", url=url)
        deadline = time.monotonic() + timeout
        while True:
            text = self.js("document.body ? document.body.innerText : ''") or ""
            if all(s in text for s in shows) and not any(s in text for s in hides):
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"{url} never showed {shows} without {hides}; it shows:\n{text[:2000]}")
            time.sleep(0.5)

    def shoot(self, out: Path, settle_s: float = 3.0) -> None:
        """Let charts finish drawing, then save the window as a palette PNG (UI colours fit in 256)."""
        time.sleep(settle_s)
        png = base64.b64decode(self.call("Page.captureScreenshot", format="png")["data"])
        from PIL import Image

        image = Image.open(io.BytesIO(png)).convert("RGB").quantize(colors=256, method=Image.Quantize.MEDIANCUT)
        out.parent.mkdir(parents=True, exist_ok=True)
        image.save(out, optimize=True)
        print(f"{out.relative_to(ROOT)}: {image.width}x{image.height}, {out.stat().st_size // 1024} KB", flush=True)

    def close(self) -> None:
        try:
            self.ws.close()
        finally:
            self.process.terminate()
            try:
                self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3, help="steps of the demo job")
    args = parser.parse_args()
    if not shutil.which("chromium"):
        sys.exit("needs Debian's chromium (apt-get install chromium)")
    work = Path(tempfile.mkdtemp(prefix="ot-shots-"))
    env = {**os.environ, "OPENTINKER_STATE_DIR": str(work / "state"),
           **{f"OPENTINKER_{name}": str(port) for name, port in zip(PORTS, free_ports(len(PORTS)))}}
    checkpoints = ROOT / "runs" / JOB  # the spec's checkpoint.base_url is ./runs: a new job, not a resume of the last one
    shutil.rmtree(checkpoints, ignore_errors=True)
    try:
        opentinker(env, "up", timeout=300)
        out = opentinker(env, "train", "examples/math_grpo.yaml", "--steps", str(args.steps), "--job-id", JOB)
        links = dict(re.findall(r"^\s*(Prefect run|MLflow run): (http\S+)", out, re.M))
        browser = Browser(work / "chromium")
        try:
            browser.open(links["Prefect run"], [JOB, "Completed"])
            browser.shoot(IMG / "prefect-run.png")
            # MLflow's UI as a reader leaves it after one visit: the "Model training" view (this is
            # not a GenAI run) and the assistant panel closed; both live in the page's localStorage.
            browser.open(links["MLflow run"], [JOB, "eval/accuracy"])
            browser.js("localStorage.setItem('mlflow.workflowType_v1', '\"machine_learning\"');"
                       "localStorage.setItem('mlflow.assistant.panelOpen_v1', 'false')")
            browser.call("Page.reload")
            browser.open(links["MLflow run"], [JOB, "eval/accuracy", "model.name", "Model training"], hides=("Ask questions about",),
                         height=1300)
            browser.shoot(IMG / "mlflow-run.png")
        finally:
            browser.close()
    finally:
        opentinker(env, "down", timeout=120)
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(checkpoints, ignore_errors=True)


if __name__ == "__main__":
    main()
