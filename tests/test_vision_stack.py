"""A geometry job on a vision-language model through the stack (Prefect flow on Ray, MLflow), then
its checkpoint served by the OpenAI-compatible server and played by `run_inference` with the
messages training builds (pictures as image_url data: parts). The model is tiny-vlm-random, so no
learning is claimed; what is checked is that pictures go everywhere the text goes."""

from __future__ import annotations

import json

import pytest

from tests.conftest import tiny_spec

N_VAL = 8


@pytest.fixture(scope="module")
def geometry_job(stack_env, tmp_path_factory):
    """(spec, flow result, MLflow client, run) of a two-step GeometryGame job run as a flow."""
    from flows.rl_train import rl_train
    from tests.test_flow import _mlflow_run

    settings, _ = stack_env
    tmp = tmp_path_factory.mktemp("geometry-job")
    spec = tiny_spec(tmp, model={"name": "tiny-vlm-random"}, rollout={"prompts_per_step": 2, "group_size": 2, "max_new_tokens": 6},
                     optimization={"steps": 2, "micro_batch_size": 4}, evaluation={"every": 2, "n_samples": N_VAL},
                     checkpoint={"every": 1}, env={"game": "envs.geometry:GeometryGame", "config": {"val_size": N_VAL}})
    result = rl_train(spec, job_id="geometry-flow")
    client, run = _mlflow_run(settings, "geometry-flow")
    return spec, result, client, run


def _artifact(client, run_id: str, path: str, tmp_path) -> str:
    return open(client.download_artifacts(run_id, path, str(tmp_path)), encoding="utf-8").read()


def test_a_geometry_job_runs_through_the_stack_with_its_pictures_in_mlflow(geometry_job, tmp_path):
    spec, result, client, run = geometry_job
    assert result["steps"] == 2 and run.info.status == "FINISHED"
    rewards = client.get_metric_history(run.info.run_id, "rollout/reward_mean")
    assert sorted(m.step for m in rewards) == [1, 2] and all(0.0 <= m.value <= 1.0 for m in rewards)
    assert sorted(m.step for m in client.get_metric_history(run.info.run_id, "eval/accuracy")) == [0, 2]
    assert {m.value for m in client.get_metric_history(run.info.run_id, "rollout/failed_episodes")} == {0.0}

    page = _artifact(client, run.info.run_id, "transcripts/step-000002.html", tmp_path)
    assert page.count("<img src='data:image/png;base64,") == N_VAL  # one diagram per episode, inline
    episodes = json.loads(_artifact(client, run.info.run_id, "transcripts/step-000002.json", tmp_path))
    first_user = next(m for m in episodes[0]["messages"] if m["role"] == "user" and not isinstance(m["content"], str))
    assert [p["type"] for p in first_user["content"]] == ["image_url", "text"]
    assert "find" in first_user["content"][1]["text"].lower()


def test_run_inference_plays_geometry_against_the_served_vlm_as_the_job_evaluated(geometry_job, tmp_path):
    """Greedy, same validation problems: the served checkpoint answers every episode as the job's
    final evaluation did, which it can only do if it saw the same pictures."""
    from envs.geometry import GeometryGame
    from opentinker.env import GameEnvironment
    from opentinker.env.environment import save_dataset
    from opentinker.inference import run_inference
    from opentinker.inference.launch import launch
    from opentinker.inference.spec import InferenceSpec

    spec, result, client, run = geometry_job
    tasks = GameEnvironment(GeometryGame, config=spec).validation_tasks(N_VAL)
    save_dataset(tasks, tmp_path / "val.jsonl")
    evaluated = json.loads(_artifact(client, run.info.run_id, "transcripts/step-000002.json", tmp_path))
    server = launch(result["checkpoint"], InferenceSpec(model_path=result["checkpoint"]), "127.0.0.1", 0, name="policy")
    try:
        summary = run_inference(vllm_server_url=server.url, data_path=str(tmp_path / "val.jsonl"), game_class=GeometryGame,
                                job_id="geometry-served", output_path=f"file://{tmp_path}/out", config=spec, log_to_mlflow=False)
    finally:
        server.stop()
    assert summary["episodes"] == N_VAL and summary["metrics"]["inference/failed_episodes"] == 0
    records = [json.loads(line) for line in (tmp_path / "out" / "transcripts.jsonl").read_text().splitlines()]
    assert [r["task"] for r in records] == [t["task"] for t in evaluated]
    for record, seen in zip(records, evaluated):
        # what was sent: the conversation training built, the diagram as an image_url data: part
        assert record["messages"][:-1] == seen["messages"][:-1]
        assert any(p["type"] == "image_url" and p["image_url"]["url"].startswith("data:image/png;base64,")
                   for m in record["messages"] if not isinstance(m["content"], str) for p in m["content"])
        assert record["messages"][-1] == seen["messages"][-1]  # and the model's greedy answer
        assert record["info"] == seen["info"]
