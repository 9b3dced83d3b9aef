"""Tokens the clients learned for servers, kept for this process: the reference design's
`run_inference(vllm_server_url=…)` then finds the token of the server that
`InferenceSchedulerClient.submit_inference_job` started, with no extra argument."""

from __future__ import annotations

_TOKENS: dict[str, str] = {}


def _key(url: str) -> str:
    return url.rstrip("/").removesuffix("/v1")


def remember(url: str, token: str) -> None:
    _TOKENS[_key(url)] = token


def token_for(url: str) -> str | None:
    return _TOKENS.get(_key(url))
