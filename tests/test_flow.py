"""Jobs as Prefect flows on Ray, tracked in MLflow, against a real local stack (no mocks)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import tiny_spec

ROOT = Path(__file__).resolve().parents[1]


def _mlflow_run(settings, job_id):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=settings.mlflow_url)
    exp = client.get_experiment_by_name(settings.project)
    (run,) = client.search_runs([exp.experiment_id], filter_string=f"tags.`opentinker.job_id` = '{job_id}'")
    return client, run


def _steps(client, run_id, key):
    return sorted(m.step for m in client.get_metric_history(run_id, key))


def test_flow_trains_on_ray_and_mlflow_holds_what_it_produced(stack_env, tmp_path):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    from flows.rl_train import rl_train

    settings, _ = stack_env
    spec = tiny_spec(tmp_path, optimization={"steps": 3}, evaluation={"every": 2, "n_samples": 8}, checkpoint={"every": 1})
    result = rl_train(spec, job_id="flow-basic")
    assert result["steps"] == 3 and result["resumed_from"] == 0
    assert result["checkpoint"].endswith("flow-basic/step-00000003")

    client, run = _mlflow_run(settings, "flow-basic")
    assert run.info.status == "FINISHED"
    assert run.data.params["rollout.group_size"] == "4" and run.data.params["model.name"] == "tiny-random"
    assert run.data.tags["opentinker.trainer"].startswith("model.dtype ")  # where it ran: its layout's lines (orchestration.layout)
    produced = {h["step"]: h for h in result["history"]}
    for key in ("rollout/reward_mean", "rollout/reward_std", "rollout/reward_min", "rollout/reward_max", "rollout/failed_episodes",
                "update/policy_loss", "update/kl", "update/entropy", "update/clip_fraction", "update/grad_norm",
                "rollout/tokens_per_s", "rollout/seconds", "update/seconds", "step/seconds"):
        history = client.get_metric_history(run.info.run_id, key)
        assert sorted(m.step for m in history) == [1, 2, 3], key
        for m in history:
            assert m.value == pytest.approx(produced[m.step][key]), key
    assert _steps(client, run.info.run_id, "eval/accuracy") == [0, 2, 3]

    artifacts = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {"spec.yaml", "transcripts", "final"} <= artifacts
    transcripts = {a.path for a in client.list_artifacts(run.info.run_id, "transcripts")}
    assert {"transcripts/step-000000.json", "transcripts/step-000000.html", "transcripts/step-000003.json"} <= transcripts
    assert "final/adapter_config.json" in {a.path for a in client.list_artifacts(run.info.run_id, "final")}

    # the MLflow run and the Prefect flow run point at each other; tasks carry job id and step
    flow_run_id = run.data.tags["prefect.flow_run_id"]
    with get_client(sync_client=True) as prefect:
        task_runs = prefect.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))
        names = {t.name: t.state.type.value for t in task_runs}
        links = prefect.read_artifacts()
    assert {"rollout-flow-basic-step0", "update-flow-basic-step2", "evaluate-flow-basic-step0", "checkpoint-flow-basic-step3"} <= set(names)
    assert set(names.values()) == {"COMPLETED"}
    assert any(a.type == "markdown" and run.info.run_id in (a.data or "") for a in links)


@pytest.mark.slow  # the default suite kills and resumes a flow on S3 (test_storage_s3), with the same checks
def test_killed_flow_resumes_and_mlflow_shows_each_step_once(stack_env, tmp_path):
    from flows.rl_train import rl_train
    from opentinker.storage import checkpoint as ckpt

    settings, env = stack_env
    spec = tiny_spec(tmp_path, optimization={"steps": 5}, evaluation={"every": 2, "n_samples": 8}, checkpoint={"every": 1})
    script = (
        "import sys; from opentinker.core.spec import parse_spec; from flows.rl_train import rl_train; "
        "import json; rl_train(parse_spec(json.loads(sys.argv[1])), job_id='flow-killed')"
    )
    proc = subprocess.Popen([sys.executable, "-c", script, spec.model_dump_json()], cwd=ROOT, env=os.environ | env,
                            start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            latest = ckpt.latest_checkpoint(spec.checkpoint.base_url, "flow-killed")
            if latest and latest.step >= 2:
                break
            assert proc.poll() is None, "the flow ended before it could be killed"
            time.sleep(0.5)
        else:
            pytest.fail("no checkpoint within 300 s")
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    killed_at = ckpt.latest_checkpoint(spec.checkpoint.base_url, "flow-killed").step
    assert 2 <= killed_at < 5

    result = rl_train(spec, job_id="flow-killed")
    assert result["resumed_from"] >= killed_at and result["steps"] == 5
    client, run = _mlflow_run(settings, "flow-killed")
    assert _steps(client, run.info.run_id, "rollout/reward_mean") == [1, 2, 3, 4, 5]
    assert _steps(client, run.info.run_id, "update/policy_loss") == [1, 2, 3, 4, 5]
    assert _steps(client, run.info.run_id, "eval/accuracy") == [0, 2, 4, 5]
    assert run.info.status == "FINISHED"


def test_resume_logs_the_steps_its_checkpoint_covers_that_mlflow_missed(stack_env, tmp_path):
    """A process killed after committing step 2 but before logging it: the checkpoint carries
    steps 1-2, so the resume logs step 2 (and not step 1 a second time)."""
    from opentinker.env import environment_from_spec
    from opentinker.rl import Policy
    from opentinker.tracking.runs import JobTracker

    settings, _ = stack_env
    job_id = "late-metrics"
    spec = tiny_spec(tmp_path)
    first = JobTracker(settings.mlflow_url, settings.project, job_id, spec)
    first.log_metrics(1, {"rollout/reward_mean": 0.5, "update/policy_loss": 0.1})
    covered = [(1, {"rollout/reward_mean": 0.5, "update/policy_loss": 0.1}), (2, {"rollout/reward_mean": 0.25, "update/policy_loss": 0.2})]
    Policy(spec, job_id=job_id).save(2, environment_from_spec(spec).state(), covered)
    # ... killed here; the resumed job finds its run and the checkpoint again
    restored = Policy(spec, job_id).restore_latest()
    assert restored.step == 2 and restored.metrics == [[1, covered[0][1]], [2, covered[1][1]]]
    again = JobTracker(settings.mlflow_url, settings.project, job_id, spec)
    assert again.run_id == first.run_id
    assert again.log_missing_metrics(restored.metrics) == [2]
    assert again.log_missing_metrics(restored.metrics) == []  # idempotent
    client, run = _mlflow_run(settings, job_id)
    assert spec.job_id is None and run.data.params["job_id"] == job_id  # the id given outside the spec is the run's parameter
    history = sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, "rollout/reward_mean"))
    assert history == [(1, 0.5), (2, 0.25)]
    assert _steps(client, run.info.run_id, "update/policy_loss") == [1, 2]


@pytest.mark.slow  # the S3 kill-and-resume test submits through the deployment and follows it the same way
def test_job_submitted_to_the_deployment_runs_on_the_worker(stack_env, tmp_path):
    from opentinker.control.follow import follow
    from opentinker.control.submit import deploy, submit_job

    settings, _ = stack_env
    from opentinker.control.scheduler import deployment_names

    assert deploy(settings) == deployment_names()
    assert {"rl-train/gpu", "rl-train/cpu", "self-play/gpu", "self-play/cpu", "sft/gpu", "sft/cpu"} <= set(deployment_names())
    spec = tiny_spec(tmp_path, optimization={"steps": 2}, evaluation={"every": 0, "n_samples": 8})
    flow_run_id = submit_job(spec.model_dump(mode="json"), "flow-deployed", settings)
    seen = []
    final = follow(flow_run_id, "flow-deployed", settings, lambda p: seen.append(p.state), interval=1.0)
    assert final.state == "COMPLETED", final.message
    assert final.step == 2 and final.result["checkpoint"].endswith("step-00000002")
    assert "RUNNING" in seen


def test_a_failed_job_reads_as_one_line_with_its_cause_and_where_it_arose(stack_env, tmp_path):
    """The actor cannot import the job's game: users see the exception's message and where it
    arose, not Ray's colour-coded wrapper with pid, ip and actor id; the traceback is in the logs."""
    from opentinker.control.follow import follow
    from opentinker.control.submit import deploy, submit_job

    settings, _ = stack_env
    deploy(settings)
    spec = tiny_spec(tmp_path, env={"game": "envs.no_such_module:Game"}).model_dump(mode="json")
    final = follow(submit_job(spec, "flow-bad-game", settings), "flow-bad-game", settings, lambda p: None, interval=1.0)
    assert final.state == "FAILED"
    assert re.fullmatch(r"job flow-bad-game: ValueError: env\.game: cannot import module 'envs\.no_such_module': "
                        r"No module named 'envs\.no_such_module' \(at environment\.import_game:\d+\)", final.message), final.message


def test_job_runs_open_in_mlflows_model_training_view(stack_env, tmp_path):
    from mlflow.tracking import MlflowClient

    from opentinker.tracking.runs import JobTracker

    settings, _ = stack_env
    JobTracker(settings.mlflow_url, "kind-check", "kind-job", tiny_spec(tmp_path))
    experiment = MlflowClient(tracking_uri=settings.mlflow_url).get_experiment_by_name("kind-check")
    assert experiment.tags["mlflow.experimentKind"] == "custom_model_development"  # not the GenAI "Evaluation runs" view


def test_missing_mlflow_server_fails_the_flow_in_one_clear_line(stack_env, tmp_path, monkeypatch):
    from flows.rl_train import rl_train
    from tests.stack_fixtures import free_ports

    (port,) = free_ports(1)
    monkeypatch.setenv("OPENTINKER_MLFLOW_PORT", str(port))
    with pytest.raises(ConnectionError, match=f"MLflow server at http://127.0.0.1:{port} is not reachable"):
        rl_train(tiny_spec(tmp_path), job_id="flow-no-mlflow")


def test_separate_trainer_and_rollout_actors_sync_weights_by_version(stack_env, tmp_path):
    from flows.rl_train import rl_train

    spec = tiny_spec(tmp_path, optimization={"steps": 3}, evaluation={"every": 0, "n_samples": 8},
                     resources={"colocate": False, "num_cpus": 0.5})
    result = rl_train(spec, job_id="flow-separate")
    versions = {h["step"]: h["rollout/policy_version"] for h in result["history"] if "rollout/policy_version" in h}
    assert versions == {1: 0.0, 2: 1.0, 3: 2.0}  # every rollout sampled from the newest policy


def test_a_job_the_cluster_cannot_place_fails_before_starting(stack_env, tmp_path):
    from flows.rl_train import rl_train

    with pytest.raises(RuntimeError, match=r"resources.num_gpus: the job needs 1 GPU\(s\), the Ray cluster has 0"):
        rl_train(tiny_spec(tmp_path, resources={"num_gpus": 1}), job_id="flow-gpu")


@pytest.mark.slow  # self-play as a flow, then a resume (100 s); tests/test_multiagent.py checks the phases and barriers in process
def test_self_play_flow_runs_phases_per_agent_and_resumes(stack_env, tmp_path):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowFilter, FlowFilterName, FlowRunFilter, FlowRunFilterId

    from flows.self_play import self_play
    from tests.test_multiagent import _gomoku_spec

    settings, _ = stack_env
    spec = _gomoku_spec(tmp_path, "agents").model_copy(update={"checkpoint": tiny_spec(tmp_path, checkpoint={"every": 1}).checkpoint})
    spec = spec.model_copy(update={"optimization": spec.optimization.model_copy(update={"steps": 2})})
    first = self_play(spec, job_id="sp-flow")
    assert first["agents"] == ["X", "O"] and set(first["checkpoints"]) == {"X", "O"}
    keys = set(first["history"][-1])
    assert {"X/rollout/win_rate", "O/rollout/win_rate", "X/update/sequences", "O/update/sequences", "X/eval/win_rate"} <= keys
    # the matches, then a rollout and an update task per agent and step, visible in Prefect
    with get_client(sync_client=True) as client:
        # only self-play runs: a registry-triggered evaluation may start after this one in the shared stack
        runs = client.read_flow_runs(flow_filter=FlowFilter(name=FlowFilterName(any_=["self-play"])), sort="START_TIME_DESC")
        run = next(r for r in runs if r.name and r.flow_id and r.parameters.get("job_id") == "sp-flow")
        tasks = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[run.id])))
    names = sorted(t.name for t in tasks)
    assert {"play-sp-flow-step0", "rollout-sp-flow-X-step0", "rollout-sp-flow-O-step0", "update-sp-flow-X-step0",
            "update-sp-flow-O-step0", "rollout-sp-flow-X-step1", "update-sp-flow-X-step1", "play-sp-flow-step1"} <= set(names)
    # the barriers, as Prefect recorded them: no update before every rollout of its step ended,
    # no match of step 1 before every update of step 0 ended
    by_name = {t.name: t for t in tasks}
    ends = lambda *ns: max(by_name[n].end_time for n in ns)  # noqa: E731
    starts = lambda *ns: min(by_name[n].start_time for n in ns)  # noqa: E731
    rollouts0 = ["play-sp-flow-step0", "rollout-sp-flow-X-step0", "rollout-sp-flow-O-step0"]
    updates0 = ["update-sp-flow-X-step0", "update-sp-flow-O-step0"]
    assert ends("play-sp-flow-step0") <= starts(*rollouts0[1:]) and ends(*rollouts0) <= starts(*updates0)
    assert ends(*updates0) <= starts("play-sp-flow-step1")
    # more steps with the same job id resume after the last common checkpoint
    longer = spec.model_copy(update={"optimization": spec.optimization.model_copy(update={"steps": 3})})
    second = self_play(longer, job_id="sp-flow")
    assert second["resumed_from"] == 2 and [h["step"] for h in second["history"]] == [3]
    client_ml, ml_run = _mlflow_run(settings, "sp-flow")
    assert _steps(client_ml, ml_run.info.run_id, "X/rollout/win_rate") == [1, 2, 3]
    _check_self_play_registration(client_ml, ml_run.info.run_id, first, second)


def _check_self_play_registration(client, run_id, first, second):
    """Each learner's final checkpoint is a version of its own registered model, exported under
    final-<agent> in the job's run, with an evaluation spec in the game's single-agent form that
    the promotion evaluation can replay."""
    from opentinker.eval.promotion import evaluate_checkpoint, evaluation_job_spec, plan

    run = client.get_run(run_id)
    artifacts = {a.path for a in client.list_artifacts(run_id)}
    for agent in ("X", "O"):
        name = first["registered_models"][agent]["name"]
        assert name.endswith(f"gomokuselfplay-{agent.lower()}") and first["registered_models"][agent]["version"] == "1"
        assert (second["registered_models"][agent]["name"], second["registered_models"][agent]["version"]) == (name, "2")
        assert run.data.tags[f"opentinker.checkpoint.{agent}"] == second["checkpoints"][agent]
        assert run.data.tags[f"opentinker.registered_version.{agent}"] == "2" and f"final-{agent}" in artifacts
        v2 = client.get_model_version(name, "2")
        assert v2.source == f"runs:/{run_id}/final-{agent}" and v2.tags["checkpoint_url"] == second["checkpoints"][agent]
        assert client.get_registered_model(name).aliases == {"champion": "1", "challenger": "2"}
        pair = plan(client, name)
        assert pair.eval_spec["env"]["game"] == "envs.gomoku:GomokuGame"
        assert pair.eval_spec["env"]["config"]["model_plays"] == agent
        result = evaluate_checkpoint(pair.challenger_url, evaluation_job_spec(pair))
        assert len(result["rewards"]) == 2 and "eval/accuracy" in result["metrics"]  # the win rate vs random
