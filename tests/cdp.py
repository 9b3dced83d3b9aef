"""Headless Chromium over the DevTools protocol, for the console's browser tests and pictures
(the approach of docs/screenshots.py, plus what tests need: events such as JavaScript dialogs
recorded and dismissed, waiting on a condition, typing into forms)."""

from __future__ import annotations

import base64
import io
import json
import shutil
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import Any


def chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


class Browser:
    """One headless page. `dialogs` lists every JavaScript dialog a page opened (each dismissed)."""

    def __init__(self, profile: Path, width: int = 1400, height: int = 900):
        self.width, self.height = width, height
        port_file = profile / "DevToolsActivePort"
        port_file.unlink(missing_ok=True)
        self.process = subprocess.Popen(
            [chromium() or "chromium", "--headless=new", "--no-sandbox", "--hide-scrollbars", "--disable-gpu", "--no-first-run",
             f"--window-size={width},{height}", "--remote-debugging-port=0", "--remote-allow-origins=*", f"--user-data-dir={profile}",
             "about:blank"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            deadline = time.monotonic() + 60
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
        self.dialogs: list[dict[str, Any]] = []
        self.console_errors: list[str] = []
        self.call("Page.enable")
        self.call("Runtime.enable")
        self.call("Emulation.setDeviceMetricsOverride", width=width, height=height, deviceScaleFactor=1, mobile=False)

    def _event(self, message: dict[str, Any]) -> None:
        method = message.get("method")
        if method == "Page.javascriptDialogOpening":
            self.dialogs.append(message["params"])
            self.ws.send(json.dumps({"id": 10**9 + len(self.dialogs), "method": "Page.handleJavaScriptDialog",
                                     "params": {"accept": False}}))
        elif method == "Runtime.exceptionThrown":
            self.console_errors.append(json.dumps(message["params"].get("exceptionDetails", {}))[:500])

    def call(self, method: str, **params: Any) -> dict[str, Any]:
        self.next_id += 1
        self.ws.send(json.dumps({"id": self.next_id, "method": method, "params": params}))
        while True:
            message = json.loads(self.ws.recv(timeout=60))
            if "method" in message:
                self._event(message)
            elif message.get("id") == self.next_id:
                if "error" in message:
                    raise RuntimeError(f"{method}: {message['error']}")
                return message.get("result", {})

    def pump(self) -> None:
        """Read the events that arrived while nothing was asked (a dialog opened by a timer)."""
        self.js("0")

    def js(self, expression: str) -> Any:
        result = self.call("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression[:200]}: {result['exceptionDetails'].get('text')} "
                               f"{result['exceptionDetails'].get('exception', {}).get('description', '')[:300]}")
        return result.get("result", {}).get("value")

    def navigate(self, url: str) -> None:
        before = self.js("performance.timeOrigin")
        self.call("Page.navigate", url=url)
        self.wait(f"performance.timeOrigin !== {before} && document.readyState === 'complete'", timeout=30, what=f"{url} loaded")

    def text(self) -> str:
        return self.js("document.body ? document.body.innerText : ''") or ""

    def url(self) -> str:
        return self.js("location.href")

    def wait(self, expression: str, timeout: float = 60, interval: float = 0.25, what: str | None = None) -> Any:
        """Wait until `expression` is truthy in the page; its value."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                value = self.js(expression)
            except RuntimeError:
                value = None  # the page navigating away under us
            if value:
                return value
            if time.monotonic() > deadline:
                raise TimeoutError(f"{what or expression} not true within {timeout} s; the page shows:\n{self.text()[:1500]}")
            time.sleep(interval)

    def wait_text(self, *shows: str, timeout: float = 60) -> str:
        self.wait(" && ".join(f"document.body && document.body.innerText.includes({json.dumps(s)})" for s in shows),
                  timeout=timeout, what=f"the page showing {shows}")
        return self.text()

    def submit(self, form_selector: str, fields: dict[str, str] | None = None) -> None:
        """Fill a form's fields and submit it as a click would; waits for the next page."""
        before = self.js("performance.timeOrigin")
        if not self.js(f"!!document.querySelector({json.dumps(form_selector)})"):
            raise RuntimeError(f"no {form_selector} on {self.url()}; the page shows:\n{self.text()[:1500]}")
        sets = "".join(f"f.querySelector({json.dumps(f'[name={name}]')}).value = {json.dumps(value)};" for name, value in (fields or {}).items())
        self.js(f"(() => {{ const f = document.querySelector({json.dumps(form_selector)}); {sets} f.requestSubmit(); }})()")
        self.wait(f"performance.timeOrigin !== {before} && document.readyState === 'complete'", timeout=60, what="the next page")

    def shoot(self, out: Path, height: int | None = None, settle_s: float = 1.0) -> int:
        """Save the window as a palette PNG; its size in bytes."""
        if height:
            self.call("Emulation.setDeviceMetricsOverride", width=self.width, height=height, deviceScaleFactor=1, mobile=False)
        time.sleep(settle_s)
        png = base64.b64decode(self.call("Page.captureScreenshot", format="png")["data"])
        if height:
            self.call("Emulation.setDeviceMetricsOverride", width=self.width, height=self.height, deviceScaleFactor=1, mobile=False)
        from PIL import Image

        image = Image.open(io.BytesIO(png)).convert("RGB").quantize(colors=128, method=Image.Quantize.MEDIANCUT)
        out.parent.mkdir(parents=True, exist_ok=True)
        image.save(out, optimize=True)
        return out.stat().st_size

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
