"""ServiceClient: attach an environment to a submitted job and train it synchronously, with
live metrics, as the reference design's `client.set_config(args, env); client.fit(env=…)`.

A game the service cannot import (the user's own class) stays in this process: `fit` opens the
client link to the gateway (a WebSocket; no port is opened here) and serves the job's episodes
while it follows the job. If this process stops, the job waits `env.link_timeout_s` for it:
`fit()` again, with the same environment, reconnects and the job goes on. If the gateway
restarts, the link reopens on its own and the job waits for it the same way. One client serves
a job: a second `fit()` while the first one's link is open is refused (LinkRefused), unless it
passes `takeover=True`; then the first `fit()` raises LinkLost saying so.
"""

from __future__ import annotations

import math
from typing import Any

from opentinker.client.environment import env_section, hosted_game
from opentinker.client.http import Gateway, GatewayError, GatewayUnreachable, JobFailed
from opentinker.client.link import EnvironmentLink
from opentinker.core.polling import through_blips, wait_for
from opentinker.core.spec_input import config_to_dict
from opentinker.core.states import TERMINAL
from opentinker.tracking.metrics import headline_key


class LinkLost(RuntimeError):
    """This fit() no longer serves the job's game (another client took it over, or the link could
    not be reopened); the job itself goes on, or waits for a client."""


class ServiceClient:
    """Talks to one job: `server_url` is what `SchedulerClient.submit_job` returned."""

    def __init__(self, server_url: str, api_key: str | None = None, reconnect_timeout_s: float = 900.0):
        self.reconnect_timeout_s = reconnect_timeout_s  # how long fit() keeps trying a gateway that does not answer
        base, sep, job_id = server_url.rstrip("/").rpartition("/v1/jobs/")
        if not sep or not job_id:
            raise ValueError(f"server_url {server_url!r} is not a job URL (…/v1/jobs/<job_id>)")
        self.job_id, self.api_key = job_id, api_key
        self._gateway = Gateway(base, api_key)
        self._config: dict[str, Any] = {}
        self._env: Any = None
        self.link: EnvironmentLink | None = None

    def set_config(self, args: Any, env: Any = None) -> None:
        """Remember the job config and its environment for `fit` (nothing is sent yet)."""
        self._config = config_to_dict(args)
        if env is not None:
            self._env = env

    def status(self) -> dict[str, Any]:
        return self._gateway.request("GET", f"/v1/jobs/{self.job_id}")

    def _section(self) -> dict[str, Any]:
        allowed = tuple(self._gateway.request("GET", "/v1/whoami").get("game_allowlist") or ("envs",))
        return env_section(self._env, self._config or None, allowed)

    def fit(self, env: Any = None, num_epochs: float | None = None, num_steps: int | None = None,
            poll: float = 2.0, progress: bool = True, takeover: bool = False) -> dict[str, Any]:
        """Start the job with its environment (if it waits for one), then follow it to the end.

        Returns the final status: state, metrics (the last value of each), checkpoint URI and
        links. Raises JobFailed when the job fails or is cancelled, LinkRefused when another
        client serves the job's game (`takeover=True` replaces it), LinkLost when this one stops.
        """
        status = self.status()
        if env is not None:
            self._env = env
        section = self._section() if self._env is not None else None
        waiting = status["state"] == "QUEUED" and "fit()" in (status.get("reason") or "")
        if waiting and section is None:
            raise ValueError("this job has no environment yet: fit(env=GameEnvironment(...)) or set_config(args, env)")
        self.link = None
        if section is not None and section.get("link") and status["state"] not in TERMINAL:
            self.link = EnvironmentLink(self._gateway.url, self.api_key or self._gateway.api_key, self.job_id,
                                        *hosted_game(self._env), takeover=takeover,
                                        reconnect_timeout_s=self.reconnect_timeout_s).open()
        try:
            if waiting:
                steps = num_steps if num_steps is not None else self._steps_for_epochs(self._env, num_epochs)
                try:
                    self._gateway.request("POST", f"/v1/jobs/{self.job_id}/start", json={"env": section, "steps": steps})
                except GatewayError as err:  # 409: another fit() started it first; one holding the link serves it
                    if err.status != 409 or self.link is None:
                        raise
            return self._follow(poll, progress)
        finally:
            if self.link is not None:
                self.link.close()

    def _steps_for_epochs(self, env: Any, num_epochs: float | None) -> int | None:
        """An epoch is the training set, or `epoch_size` episodes for a game without one."""
        if num_epochs is None:
            return None
        size = getattr(env, "epoch_size", None)
        if not size:
            raise ValueError("num_epochs needs a GameEnvironment (its epoch_size): pass num_steps")
        prompts = int((self._config.get("rollout") or {}).get("prompts_per_step", 8))
        return max(1, math.ceil(num_epochs * size / prompts))

    def _follow(self, poll: float, progress: bool) -> dict[str, Any]:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

        columns = [TextColumn("[bold]{task.fields[state]}"), BarColumn(), MofNCompleteColumn(),
                   TextColumn("{task.fields[summary]}"), TimeElapsedColumn(), TimeRemainingColumn()]
        with Progress(*columns, disable=not progress, transient=False) as bar:
            task = bar.add_task(self.job_id, total=None, state="QUEUED", summary="")

            def on_retry(attempt: int, err: BaseException) -> None:
                bar.console.print(f"the gateway does not answer ({err}); reconnecting (attempt {attempt})…", markup=False)

            def look() -> dict[str, Any] | None:
                """One look at the job, shown on the bar; the final status once it ended."""
                if self.link is not None and self.link.lost:
                    raise LinkLost(self.link.lost)
                try:
                    status = through_blips(self.status, give_up_after_s=self.reconnect_timeout_s, on_retry=on_retry)
                except GatewayUnreachable as err:
                    raise GatewayUnreachable(0, f"no answer from the gateway for {self.reconnect_timeout_s:g}s ({err}); job "
                                             f"{self.job_id} may still be running: ServiceClient(server_url).fit() re-attaches") from None
                metrics = status.get("metrics") or {}
                summary = " · ".join(f"{label} {metrics[key]:.3f}" for key, label in
                                     ((headline_key(metrics, "rollout/reward_mean"), "reward"), (headline_key(metrics, "eval/accuracy"), "val acc"))
                                     if key in metrics)
                if status.get("failure"):
                    summary += f" · failing: {status['failure']}"
                bar.update(task, total=status.get("total_steps"), completed=status.get("step") or 0,
                           state=status["state"], summary=summary)
                return status if status["state"] in TERMINAL else None

            status = wait_for(look, interval=poll, what=f"job {self.job_id} to end")
        if status["state"] != "COMPLETED":
            raise JobFailed(status)
        return status

    def close(self) -> None:
        self._gateway.close()

