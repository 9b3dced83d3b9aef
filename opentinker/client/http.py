"""HTTP to the gateway: the API key in one header, errors turned into exceptions that say why."""

from __future__ import annotations

import os
from typing import Any

import httpx


class GatewayError(RuntimeError):
    """The gateway refused or failed a request; `status` is the HTTP status."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


class AuthenticationError(GatewayError):
    pass


class GatewayUnreachable(GatewayError, ConnectionError):
    """No answer from the gateway (down, restarting, the network): worth trying again."""


class JobNotFound(GatewayError):
    pass


class InvalidJob(GatewayError):
    pass


class JobFailed(RuntimeError):
    """The job ended FAILED or CANCELLED; `status` holds the gateway's last answer."""

    def __init__(self, status: dict[str, Any]):
        super().__init__(f"job {status['job_id']} {status['state']}: {status.get('reason') or 'no reason given'}")
        self.status = status


_ERRORS = {401: AuthenticationError, 404: JobNotFound, 422: InvalidJob}


def default_url() -> str:
    from opentinker.core.settings import get_settings

    return os.environ.get("OPENTINKER_GATEWAY_URL") or get_settings().gateway_url


# How long a call waits for the gateway's answer. The gateway answers after its calls to Prefect
# and MLflow, and a busy stack's Prefect on SQLite can hold its database for up to a minute (its
# busy timeout is 60 s): at 30 s a cancel and a status read failed in CI while the job was fine.
# A gateway that is down still fails at once (connecting takes at most CONNECT_TIMEOUT_S).
TIMEOUT_S = 180.0
CONNECT_TIMEOUT_S = 10.0


class Gateway:
    def __init__(self, url: str | None = None, api_key: str | None = None, timeout: float = TIMEOUT_S):
        self.url = (url or default_url()).rstrip("/")
        key = self.api_key = api_key or os.environ.get("OPENTINKER_API_KEY")
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        self._http = httpx.Client(base_url=self.url, headers=headers, timeout=httpx.Timeout(timeout, connect=min(timeout, CONNECT_TIMEOUT_S)),
                                  trust_env=False)

    def request(self, method: str, path: str, **kwargs: Any) -> Any:
        try:
            response = self._http.request(method, path, **kwargs)
        except httpx.HTTPError as err:
            raise GatewayUnreachable(0, f"gateway {self.url} unreachable ({type(err).__name__}); is the stack up (`opentinker up`)?") from None
        if response.is_success:
            return response.json() if response.content else None
        if response.status_code in (502, 503, 504):  # a proxy in front of a gateway coming back up
            raise GatewayUnreachable(response.status_code, f"gateway {self.url}: HTTP {response.status_code}")
        try:
            detail = response.json().get("detail", response.text)
        except ValueError:
            detail = response.text
        if response.status_code == 401:
            detail = f"{detail} (pass api_key= or set OPENTINKER_API_KEY; `opentinker tenant add NAME` makes one)"
        raise _ERRORS.get(response.status_code, GatewayError)(response.status_code, str(detail))

    def close(self) -> None:
        self._http.close()
