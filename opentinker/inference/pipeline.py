"""`run_inference`: play a game against any OpenAI-compatible server, as training's evaluation plays it.

Each episode: `reset(**task)`, then the messages training builds (`initial_messages`: the game's
system prompt, its few-shot turns, the first user message), then the assistant's reply from
`/v1/chat/completions`, `game.step(reply)`, and the observation as the next user message, until
the game says done, `max_turns` is reached, or the conversation has used `max_total_tokens`
(the server's own token counts, checked between turns). The served model therefore sees the
prompt the job's evaluation saw, rendered by the same chat template; greedy (`temperature=0`)
by default, as evaluation is.

Metrics are training's own (`opentinker.tracking.metrics.episode_stats`, prefix `inference/`): reward,
accuracy (episodes whose game reported `correct`; a failed episode counts as wrong), turns and
completion tokens per episode. Results go to `<output_path>/transcripts.jsonl` (one episode per
line) and `<output_path>/summary.json` (default folder `./runs/inference/<job_id>`) through
fsspec (`file://`, `s3://`), each written under a temporary name and then moved into place, and
to an MLflow run in the experiment `inference/<job_id>` (one experiment per inference job, one
run per call).

Client side: imports no torch, so it runs wherever the data and the game code are.
"""

from __future__ import annotations

import json
import logging
import os
import posixpath
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import httpx

from opentinker.core.credentials import token_for
from opentinker.core.json_text import JsonTextError, loads_bounded
from opentinker.env.base import AbstractGame, StepResult
from opentinker.env.hosting import checked_observation, start_episode
from opentinker.env.messages import initial_messages, user_content
from opentinker.tracking.transcripts import readable

log = logging.getLogger(__name__)


class InferenceError(RuntimeError):
    """The server could not be used at all (unreachable, no model, refused every request)."""


@dataclass
class Turn:
    action: str
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int
    reward: float = 0.0
    observation: str | None = None


@dataclass
class EpisodeRecord:
    """One episode as text. Has what `episode_stats` reads (failed, reward, num_sampled, turns, info),
    so inference is measured with training's metric definitions."""

    index: int
    task: dict[str, Any]
    messages: list[dict[str, str]] = field(default_factory=list)
    turns: list[Turn] = field(default_factory=list)
    info: dict[str, Any] = field(default_factory=dict)
    failed: bool = False
    failure: str | None = None
    stop_reason: str | None = None

    @property
    def reward(self) -> float:
        return 0.0 if self.failed else float(sum(t.reward for t in self.turns))

    @property
    def num_sampled(self) -> int:
        return sum(t.completion_tokens for t in self.turns)

    def to_json(self) -> dict[str, Any]:
        return {"index": self.index, "task": self.task, "messages": self.messages, "reward": self.reward,
                "failed": self.failed, "failure": self.failure, "stop_reason": self.stop_reason, "info": self.info,
                "turns": [t.__dict__ for t in self.turns]}


class ChatServer:
    """The OpenAI-compatible server: `/v1/models` to pick the model, `/v1/chat/completions` per turn."""

    def __init__(self, url: str, api_key: str | None = None, model: str | None = None, timeout_s: float = 300.0):
        root = url.rstrip("/")
        self.base = root if root.endswith("/v1") else f"{root}/v1"
        key = api_key or token_for(url) or os.environ.get("OPENAI_API_KEY")
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        self._http = httpx.Client(base_url=self.base, headers=headers, timeout=timeout_s, trust_env=False)
        self.model = model or self._pick_model()

    def _pick_model(self) -> str:
        """The served model; on a vLLM server with a LoRA adapter, the adapter (it has a parent)."""
        try:
            response = self._http.get("/models")
        except httpx.HTTPError as err:
            raise InferenceError(f"inference server {self.base} unreachable ({type(err).__name__}: {err})") from None
        if response.is_error:
            raise InferenceError(f"GET {self.base}/models: HTTP {response.status_code}: {_error_text(response)}")
        body = _answer(response)
        models = (body.get("data") if isinstance(body, dict) else None) or []
        if not models:
            raise InferenceError(f"{self.base}/models lists no model")
        adapters = [m for m in models if m.get("parent")]
        return (adapters or models)[0]["id"]

    def chat(self, messages: list[dict[str, str]], sampling: dict[str, Any]) -> dict[str, Any]:
        response = self._http.post("/chat/completions", json={"model": self.model, "messages": messages, **sampling})
        if response.is_error:
            raise InferenceError(f"HTTP {response.status_code}: {_error_text(response)}")
        return _answer(response)

    def close(self) -> None:
        self._http.close()


def _answer(response: httpx.Response) -> Any:
    """A server's JSON answer, read bounded: an answer nested past any reply's need (a broken or
    hostile server's) is an InferenceError, that episode's failure, not a RecursionError."""
    try:
        return loads_bounded(response.content, max_chars=max(len(response.content), 1))
    except JsonTextError as err:
        raise InferenceError(f"{response.request.method} {response.request.url}: the answer is not JSON this client reads: {err}") from None


def _error_text(response: httpx.Response) -> str:
    try:
        body = loads_bounded(response.content, max_chars=max(len(response.content), 1))
    except JsonTextError:
        return response.text[:500]
    error = body.get("error") if isinstance(body, dict) else None
    if isinstance(error, dict) and error.get("message"):
        return str(error["message"])[:500]
    return str(body.get("detail", body) if isinstance(body, dict) else body)[:500]


@dataclass(frozen=True)
class _Limits:
    max_tokens: int
    max_turns: int
    max_total_tokens: int | None
    sampling: dict[str, Any]


def _play(index: int, task: dict[str, Any], game: AbstractGame, server: ChatServer, limits: _Limits) -> EpisodeRecord:
    record = EpisodeRecord(index=index, task=task)
    try:
        # OpenAI's form: a picture goes as an image_url part with a data: URL
        record.messages = [readable(m) for m in initial_messages(game, start_episode(game, task))]
        while True:
            answer = server.chat(record.messages, {"max_tokens": limits.max_tokens, **limits.sampling})
            choice, usage = answer["choices"][0], answer.get("usage") or {}
            action = choice["message"].get("content") or ""
            turn = Turn(action, choice.get("finish_reason"), int(usage.get("prompt_tokens", 0)), int(usage.get("completion_tokens", 0)))
            record.turns.append(turn)
            record.messages.append({"role": "assistant", "content": action})
            result = game.step(action)
            if not isinstance(result, StepResult):
                raise TypeError(f"step returned {type(result).__name__}, expected StepResult")
            observation = checked_observation(result.observation)
            text, images = (observation, []) if isinstance(observation, str) else (observation.text, observation.images)
            turn.reward, turn.observation = float(result.reward), text
            record.info.update(result.info)
            if result.done:
                record.stop_reason = "done"
            elif len(record.turns) >= limits.max_turns:
                record.stop_reason = "max_turns"
            elif limits.max_total_tokens and turn.prompt_tokens + turn.completion_tokens >= limits.max_total_tokens:
                record.stop_reason = "max_total_tokens"
            else:
                record.messages.append(readable({"role": "user", "content": user_content(text, images)}))
                continue
            return record
    except Exception as err:  # noqa: BLE001 - one failed episode, counted, never the whole run
        record.failed, record.failure, record.stop_reason = True, f"{type(err).__name__}: {err}", "failed"
        return record
    finally:
        try:
            game.close()
        except Exception as err:  # noqa: BLE001 - closing is best effort
            log.debug("episode %d: close failed: %s", index, err)


# --- inputs ------------------------------------------------------------------------------------


def _config(config: Any) -> dict[str, Any]:
    if config is None:
        return {}
    from opentinker.core.spec_input import config_to_dict

    return config_to_dict(config)


def _game_class(game_class: Any) -> Any:
    if isinstance(game_class, str):
        from opentinker.env.environment import import_game

        return import_game(game_class)
    return getattr(game_class, "game_class", game_class)  # a GameEnvironment stands for its game


def read_tasks(data_path: str, limit: int | None = None) -> list[dict[str, Any]]:
    """Tasks (keyword arguments of `reset`), one JSON object per line, from any fsspec URL."""
    import fsspec

    with fsspec.open(data_path, "rt") as f:
        tasks = [json.loads(line) for line in f if line.strip()]
    if not tasks:
        raise ValueError(f"{data_path}: no tasks")
    return tasks[:limit] if limit else tasks


# --- outputs -----------------------------------------------------------------------------------


def _output_urls(output_path: str | None, job_id: str | None) -> tuple[str, str]:
    """(transcripts, summary) URLs: `<folder>/transcripts.jsonl` and `<folder>/summary.json`, or
    `<name>.jsonl` and `<name>.summary.json` when output_path names a .jsonl file."""
    if not output_path:
        # beside the default checkpoint storage (file://./runs)
        output_path = os.path.abspath(os.path.join("runs", "inference", job_id or time.strftime("run-%Y%m%d-%H%M%S")))
    output_path = output_path.rstrip("/")
    if output_path.endswith(".jsonl"):
        return output_path, output_path[: -len(".jsonl")] + ".summary.json"
    return f"{output_path}/transcripts.jsonl", f"{output_path}/summary.json"


def _write(url: str, data: bytes) -> None:
    """Write under a temporary name, then move into place: a reader never sees half a file."""
    import fsspec

    fs, path = fsspec.core.url_to_fs(url)
    fs.makedirs(posixpath.dirname(path), exist_ok=True)
    tmp = f"{path}.tmp-{uuid.uuid4().hex[:8]}"
    fs.pipe_file(tmp, data)
    fs.mv(tmp, path)


def _tracking_uri(explicit: str | None) -> str:
    if explicit:
        return explicit
    if os.environ.get("MLFLOW_TRACKING_URI"):
        return os.environ["MLFLOW_TRACKING_URI"]
    from opentinker.core.settings import get_settings

    return get_settings().mlflow_url


# --- the entry point ---------------------------------------------------------------------------


def run_inference(
    vllm_server_url: str,
    data_path: str,
    game_class: Any,
    job_id: str | None = None,
    output_path: str | None = None,
    *,
    config: Any = None,
    model: str | None = None,
    max_tokens: int | None = None,
    temperature: float = 0.0,
    top_p: float = 1.0,
    max_turns: int | None = None,
    max_total_tokens: int | None = None,
    game_kwargs: dict[str, Any] | None = None,
    limit: int | None = None,
    concurrency: int = 8,
    api_key: str | None = None,
    request_timeout_s: float = 300.0,
    log_to_mlflow: bool = True,
    mlflow_tracking_uri: str | None = None,
) -> dict[str, Any]:
    """Play one episode per task of `data_path` (JSONL) against the server; returns the summary.

    `vllm_server_url`: any OpenAI-compatible server (with or without the trailing `/v1`).
    `game_class`: the AbstractGame subclass training used (or 'module:Class').
    `config`: the training job's config (JobSpec, dict, YAML path or args), whose rollout section
    (max_new_tokens, max_turns, max_total_tokens) and env.config.game_kwargs become the defaults
    here, so the evaluation is the job's own; explicit arguments win.
    """
    if job_id is not None:  # it names the default output folder and the MLflow experiment
        from opentinker.core.ids import check_job_id

        check_job_id(job_id, "job_id")
    cfg = _config(config)
    rollout = cfg.get("rollout") or {}
    env_cfg = ((cfg.get("env") or {}).get("config") or cfg.get("env_config") or {})
    limits = _Limits(
        max_tokens=int(max_tokens or rollout.get("max_new_tokens") or 512),
        max_turns=int(max_turns or rollout.get("max_turns") or 16),
        max_total_tokens=max_total_tokens or rollout.get("max_total_tokens"),
        sampling={"temperature": temperature, "top_p": top_p},
    )
    kwargs = dict(game_kwargs if game_kwargs is not None else env_cfg.get("game_kwargs") or getattr(game_class, "game_kwargs", None) or {})
    game_cls = _game_class(game_class)
    tasks = read_tasks(data_path, limit)
    transcripts_url, summary_url = _output_urls(output_path, job_id)
    tracking_uri = _tracking_uri(mlflow_tracking_uri) if log_to_mlflow else None
    if tracking_uri:
        from opentinker.tracking.runs import check_mlflow

        check_mlflow(tracking_uri)  # fail before the work, not after it

    server = ChatServer(vllm_server_url, api_key=api_key, model=model, timeout_s=request_timeout_s)
    t0 = time.perf_counter()
    try:
        # Games are made here, in order, so a game class that fails to construct fails the run.
        games = [game_cls(**kwargs) for _ in tasks]
        with ThreadPoolExecutor(max_workers=max(1, concurrency), thread_name_prefix="episode") as pool:
            records = list(pool.map(lambda i: _play(i, tasks[i], games[i], server, limits), range(len(tasks))))
    finally:
        server.close()
    seconds = time.perf_counter() - t0
    if all(r.failed for r in records) and all(r.failure and r.failure.startswith("InferenceError") for r in records):
        raise InferenceError(f"every request to {server.base} failed, e.g. {records[0].failure}")

    from opentinker.tracking.metrics import episode_stats
    from opentinker.tracking.transcripts import transcripts_html

    metrics = episode_stats(records, "inference") | {"inference/seconds": seconds}  # type: ignore[arg-type]
    lines = "".join(json.dumps(r.to_json(), default=str) + "\n" for r in records).encode()
    game_name = f"{getattr(game_cls, '__module__', '?')}:{getattr(game_cls, '__qualname__', game_cls)}"
    summary: dict[str, Any] = {
        "job_id": job_id, "server_url": server.base, "model": server.model, "game": game_name, "data_path": data_path,
        "episodes": len(records), "metrics": metrics, "reward_mean": metrics["inference/reward_mean"],
        "accuracy": metrics.get("inference/accuracy"), "turns_mean": metrics["inference/turns_mean"],
        "sampling": {"max_tokens": limits.max_tokens, "max_turns": limits.max_turns,
                     "max_total_tokens": limits.max_total_tokens, **limits.sampling},
        "transcripts": transcripts_url, "mlflow_run_id": None, "mlflow_run_url": None,
    }
    _write(transcripts_url, lines)
    if tracking_uri:
        experiment = f"inference/{job_id or 'adhoc'}"
        params = {"server_url": server.base, "model": server.model, "game": game_name, "data_path": data_path,
                  "game_kwargs": json.dumps(kwargs), **{f"sampling.{k}": v for k, v in summary["sampling"].items()}}
        from opentinker.tracking.runs import Run

        run = Run.start(experiment, f"run_inference-{time.strftime('%Y%m%d-%H%M%S')}", tracking_uri=tracking_uri,
                        tags={"opentinker.job_id": job_id or "", "opentinker.kind": "inference"})
        summary["mlflow_run_id"], summary["mlflow_run_url"] = run.run_id, run.run_url
        try:
            run.log_params(params)
            run.log_metrics(0, metrics)
            run.log_files({"transcripts.jsonl": lines, "summary.json": json.dumps(summary, indent=1),
                           "transcripts.html": transcripts_html(0, [r.to_json() for r in records])})
        except BaseException:
            run.finish("FAILED")
            raise
        run.finish()
    _write(summary_url, json.dumps(summary, indent=1).encode())
    log.info("run_inference: %d episodes, reward %.3f, accuracy %s -> %s", len(records), summary["reward_mean"], summary["accuracy"], summary_url)
    return summary
