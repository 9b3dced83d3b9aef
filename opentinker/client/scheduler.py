"""SchedulerClient: submit, list, inspect, cancel and wait for jobs through the gateway."""

from __future__ import annotations

from typing import Any

from opentinker.client.http import TIMEOUT_S, Gateway, InvalidJob, JobFailed
from opentinker.core.credentials import remember
from opentinker.core.polling import through_blips, wait_for
from opentinker.core.spec_input import config_to_dict
from opentinker.core.spec_limits import SpecError, input_problem
from opentinker.core.states import TERMINAL


class SchedulerClient:
    """`SchedulerClient(url=…).submit_job(config=…, num_gpus=…)` as in the reference design."""

    def __init__(self, url: str | None = None, api_key: str | None = None, timeout: float = TIMEOUT_S):
        self._gateway = Gateway(url, api_key, timeout=timeout)
        self.url = self._gateway.url

    def submit_job(self, config: Any, num_gpus: float | None = None) -> dict[str, Any]:
        """Validate and queue a job. Returns job_id, state, server_url (for ServiceClient) and
        links. Without an environment in `config` the job waits for `ServiceClient.fit(env=…)`."""
        try:
            data = config_to_dict(config)
        except SpecError as err:  # a YAML file too big, too deep or not YAML: the line `opentinker validate` prints
            raise InvalidJob(422, str(err)) from None
        if problem := input_problem(data):  # refused here, before megabytes travel to be refused there
            raise InvalidJob(422, problem)
        return self._gateway.request("POST", "/v1/jobs", json={"config": data, "num_gpus": num_gpus})

    def list_jobs(self) -> list[dict[str, Any]]:
        return self._gateway.request("GET", "/v1/jobs")

    def job_status(self, job_id: str) -> dict[str, Any]:
        return self._gateway.request("GET", f"/v1/jobs/{job_id}")

    def cancel_job(self, job_id: str) -> dict[str, Any]:
        return self._gateway.request("POST", f"/v1/jobs/{job_id}/cancel")

    def metrics(self, job_id: str) -> dict[str, list[list[float]]]:
        return self._gateway.request("GET", f"/v1/jobs/{job_id}/metrics")

    def logs(self, job_id: str, offset: int = 0, limit: int = 200) -> dict[str, Any]:
        """A page of the job's log lines, oldest first, from the `offset`-th (at most `limit`, 200):
        `lines` (time, level, message, task), `next_offset` (pass it back for the lines that follow),
        the job's `state`, and `complete` once it has ended and no line is still to come. A line
        shows once it is a few seconds old (opentinker.control.follow.LOG_SETTLE_S)."""
        return self._gateway.request("GET", f"/v1/jobs/{job_id}/logs", params={"offset": offset, "limit": limit})

    def list_checkpoints(self, job_id: str) -> list[dict[str, Any]]:
        """The job's checkpoint step folders, oldest first: step, url, `valid`, and otherwise the
        `problem` (the line resume skips it with)."""
        return self._gateway.request("GET", f"/v1/jobs/{job_id}/checkpoints")

    def delete_checkpoint(self, job_id: str, step: int) -> dict[str, Any]:
        """Delete the job's checkpoint of `step` (every agent's folder of it); JobNotFound when none."""
        return self._gateway.request("DELETE", f"/v1/jobs/{job_id}/checkpoints/{step}")

    def wait(self, job_id: str, timeout: float | None = None, poll: float = 2.0) -> dict[str, Any]:
        """Poll until the job ends; returns its last status (TimeoutError past `timeout`). A gateway
        that does not answer for a while (restarting) is tried again, for up to 15 minutes."""
        def ended() -> dict[str, Any] | None:
            status = through_blips(lambda: self.job_status(job_id), give_up_after_s=900.0)
            return status if status["state"] in TERMINAL else None

        return wait_for(ended, interval=poll, timeout=timeout, what=f"job {job_id} to end")

    def close(self) -> None:
        self._gateway.close()


class InferenceSchedulerClient(SchedulerClient):
    """`InferenceSchedulerClient(url=…).submit_inference_job(model_path=…, num_gpus=…)`; the
    inherited `job_status`, `cancel_job` and `wait` work on inference jobs too."""

    def submit_inference_job(self, model_path: str, num_gpus: float = 0, engine: str = "auto",
                             max_model_len: int | None = None, ttl_s: float | None = None,
                             wait: bool = True, timeout: float | None = 900.0, poll: float = 1.0) -> dict[str, Any]:
        """Start serving a checkpoint (a job id or path in your storage, or models:/<name>@<alias>).

        With `wait` (the default) returns once the server answers: the job's status with
        "job_id", "vllm_server_url" (hand it to `run_inference`) and "openai_base_url" (for an
        OpenAI client). Raises JobFailed when the job fails first (e.g. a corrupt checkpoint),
        TimeoutError past `timeout` (the job keeps its place; cancel it with `cancel_job`).
        """
        body = {"model_path": model_path, "num_gpus": num_gpus, "engine": engine, "max_model_len": max_model_len, "ttl_s": ttl_s}
        status = self._gateway.request("POST", "/v1/inference", json=body)
        if not wait:
            return status
        job_id = status["job_id"]

        def serving() -> dict[str, Any] | None:
            nonlocal status
            if status.get("vllm_server_url"):
                if status.get("api_key"):  # run_inference(vllm_server_url=...) finds it there
                    remember(status["vllm_server_url"], status["api_key"])
                return status
            if status["state"] in TERMINAL:
                raise JobFailed(status)
            status = through_blips(lambda: self.job_status(job_id), give_up_after_s=900.0)  # as wait()
            return None

        try:
            return wait_for(serving, interval=poll, timeout=timeout, what=f"inference job {job_id} to serve")
        except TimeoutError:
            raise TimeoutError(f"inference job {job_id} not serving after {timeout:g}s "
                               f"({status['state']}: {status.get('reason') or ''})") from None
