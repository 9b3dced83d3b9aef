"""Promotion: the paired decision rule by hand, then challenger vs champion end to end on real
registered checkpoints, in-process and through the Prefect server (a completed rl-train run
triggers the evaluation deployment).

The better model is honest and deterministic: the tiny model after 8 RL steps on the uppercase
game answers every one of the 32 validation prompts with a capitalised word under greedy decoding
(measured: accuracy 0 after ≤ 4 steps, 1.0 after ≥ 5), while the untrained policy answers with
blank lines (accuracy 0).
"""

from __future__ import annotations

import time
from datetime import timezone

import pytest

from tests.test_registry import make_checkpoint, register, snapshot, toy_spec

# -- the decision rule, by hand -------------------------------------------------------------------


def test_sign_test_p_values_by_hand():
    from opentinker.eval.promotion import sign_test_p

    assert sign_test_p(8, 1) == pytest.approx((9 + 1) / 2**9)  # C(9,8)+C(9,9) of 512 = 0.01953
    assert sign_test_p(5, 0) == pytest.approx(1 / 32)
    assert sign_test_p(6, 3) == pytest.approx((84 + 36 + 9 + 1) / 512)  # 0.2539
    assert sign_test_p(0, 4) == 1.0  # all losses: P(X ≥ 0) = 1
    assert sign_test_p(0, 0) == 1.0  # only ties: no evidence


def test_decision_needs_samples_margin_and_significance():
    from opentinker.eval.promotion import decide

    champion = [0.0] * 10 + [1.0] * 30
    # 9 problems better, 1 worse, 30 ties: mean diff 8/40 = 0.2, p = C(10,9)+C(10,10) / 1024 = 11/1024
    challenger = [1.0] * 9 + [0.0] + [1.0] * 29 + [0.0]
    d = decide(challenger, champion, margin=0.1, alpha=0.05, min_samples=30)
    assert (d.wins, d.losses, d.ties, d.n) == (9, 1, 30, 40)
    assert d.mean_diff == pytest.approx(0.2) and d.p_value == pytest.approx(11 / 1024)
    assert d.promote and d.reason.startswith("wins by +0.2000")
    assert not decide(challenger, champion, margin=0.25).promote  # the margin gates a significant win
    assert "below margin" in decide(challenger, champion, margin=0.25).reason
    assert "too few samples: 40 < min_samples 50" == decide(challenger, champion, margin=0.1, min_samples=50).reason
    assert "not significant" in decide(challenger, champion, margin=0.1, alpha=0.01).reason  # 0.0107 > 0.01
    # non-binary rewards: only the sign of each difference counts for the test, the size for the margin
    small = decide([0.6] * 6 + [0.5] * 34, [0.5] * 40, margin=0.0, min_samples=30)
    assert (small.wins, small.losses) == (6, 0) and small.p_value == pytest.approx(1 / 64) and small.promote
    assert not decide([0.6] * 6 + [0.5] * 34, [0.5] * 40, margin=0.05).promote  # +0.015 is below 0.05
    with pytest.raises(ValueError, match="paired rewards needed"):
        decide([1.0], [1.0, 0.0])


# -- end to end -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """An untrained and a trained (8 steps) checkpoint of the tiny model on the uppercase game."""
    tmp = tmp_path_factory.mktemp("promotion")
    untrained = toy_spec(tmp, "promo-untrained", "unused")
    trained = toy_spec(tmp, "promo-trained", "unused", steps=8)
    return {"untrained": (untrained, make_checkpoint(untrained, trained=False)),
            "trained": (trained, make_checkpoint(trained, trained=True))}


def _as(spec, name: str, job_id: str):
    return spec.model_copy(update={"job_id": job_id, "registry": spec.registry.model_copy(update={"model_name": name})})


def test_champion_moves_only_when_the_margin_holds_and_a_loser_changes_nothing(stack_env, checkpoints):
    from mlflow.tracking import MlflowClient

    from opentinker.eval.promotion import evaluate_and_promote
    from opentinker.storage.registry import resolve_model_uri

    settings, _ = stack_env
    client = MlflowClient(tracking_uri=settings.mlflow_url)
    name = "promo-inprocess"
    (u_spec, u_url), (t_spec, t_url) = checkpoints["untrained"], checkpoints["trained"]
    assert register(settings, _as(u_spec, name, "promo-v1"), u_url)["aliases"] == ["challenger", "champion"]
    assert register(settings, _as(t_spec, name, "promo-v2"), t_url)["version"] == "2"

    # a real, unanimous win that still misses an (unreachable) margin: nothing moves
    kept = evaluate_and_promote(name, margin=1.5)
    assert kept["decision"] == "kept-champion" and "below margin" in kept["reason"]
    assert (kept["challenger_mean"], kept["champion_mean"], kept["n"], kept["wins"]) == (1.0, 0.0, 32, 32)
    assert client.get_registered_model(name).aliases["champion"] == "1"

    won = evaluate_and_promote(name, margin=0.1)
    assert won["decision"] == "promoted" and won["p_value"] == pytest.approx(0.5**32)
    assert client.get_registered_model(name).aliases == {"champion": "2", "challenger": "2"}
    assert resolve_model_uri(f"models:/{name}@champion") == t_url
    tags = client.get_model_version(name, "2").tags
    assert tags["promotion.decision"] == "promoted" and tags["promotion.vs_champion"] == "1"
    assert tags["promotion.eval_run_id"] == won["eval_run_id"]
    assert client.get_model_version(name, "1").tags["promotion.replaced_by"] == "2"
    audit = client.get_run(won["eval_run_id"])
    assert audit.data.metrics["challenger_mean"] == 1.0 and audit.data.metrics["champion_mean"] == 0.0
    assert audit.data.metrics["n"] == 32 and audit.data.metrics["mean_diff"] == 1.0
    assert audit.data.params["test"].startswith("one-sided exact sign test") and audit.data.params["margin"] == "0.1"
    assert audit.data.params["challenger_version"] == "2" and audit.data.params["champion_version"] == "1"
    assert audit.data.tags["decision"] == "promoted" and audit.info.end_time >= audit.info.start_time
    assert "per_problem.json" in {a.path for a in client.list_artifacts(won["eval_run_id"])}

    # a losing challenger (the untrained policy again) leaves the champion where it is
    assert register(settings, _as(u_spec, name, "promo-v3"), u_url)["aliases"] == ["challenger"]
    lost = evaluate_and_promote(name, margin=0.1)
    assert lost["decision"] == "kept-champion" and lost["losses"] == 32
    assert client.get_registered_model(name).aliases == {"champion": "2", "challenger": "3"}
    assert client.get_model_version(name, "3").tags["promotion.decision"] == "kept-champion"
    assert resolve_model_uri(f"models:/{name}@champion") == t_url


def test_evaluating_a_missing_model_fails_clearly_and_changes_nothing(stack_env, checkpoints):
    from mlflow.tracking import MlflowClient

    from opentinker.eval.promotion import evaluate_and_promote
    from opentinker.storage.registry import ModelNotFoundError

    settings, _ = stack_env
    client = MlflowClient(tracking_uri=settings.mlflow_url)
    with pytest.raises(ModelNotFoundError, match="no registered model 'promo-nothing'"):
        evaluate_and_promote("promo-nothing")
    name = "promo-no-challenger"
    spec, url = checkpoints["untrained"]
    register(settings, _as(spec, name, "promo-nc-1"), url)
    client.delete_registered_model_alias(name, "challenger")
    before = snapshot(client, name)
    with pytest.raises(ModelNotFoundError, match=f"'{name}' has no alias 'challenger'"):
        evaluate_and_promote(name)
    assert snapshot(client, name) == before


def _wait_for_run(flow_name: str, match, deadline_s: float = 420.0):
    """The first flow run of `flow_name` whose parameters satisfy `match`, once it has finished
    (a bounded wait so a trigger that never fires fails the test instead of hanging it)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowFilter, FlowFilterName

    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        with get_client(sync_client=True) as client:
            runs = client.read_flow_runs(flow_filter=FlowFilter(name=FlowFilterName(any_=[flow_name])))
        for run in runs:
            if match(run.parameters) and run.state and run.state.is_final():
                return run
        time.sleep(1)
    raise AssertionError(f"no finished {flow_name} run matching within {deadline_s} s")


@pytest.mark.slow  # a training job and the evaluation it triggers (100 s); the promotion rule runs in test_champion_moves_only_when_the_margin_holds_and_a_loser_changes_nothing
def test_a_completed_training_job_triggers_an_evaluation_that_promotes(stack_env, tmp_path, checkpoints):
    from mlflow.tracking import MlflowClient
    from prefect.client.orchestration import get_client

    from opentinker.control.follow import follow
    from opentinker.control.submit import deploy, submit_job

    settings, _ = stack_env
    client = MlflowClient(tracking_uri=settings.mlflow_url)
    assert "evaluate-promote/cpu" in deploy(settings)
    with get_client(sync_client=True) as prefect:
        deployment = prefect.read_deployment_by_name("evaluate-promote/cpu")
    assert [s.schedule.cron for s in deployment.schedules] == ["0 3 * * *"]  # the nightly sweep

    name = "promo-triggered"
    u_spec, u_url = checkpoints["untrained"]
    register(settings, _as(u_spec, name, "promo-t-1"), u_url)  # champion v1: the untrained policy
    spec = toy_spec(tmp_path, "promo-t-train", name, steps=8)
    flow_run_id = submit_job(spec.model_dump(mode="json"), spec.job_id, settings)
    final = follow(flow_run_id, spec.job_id, settings, lambda p: None, interval=1.0)
    assert final.state == "COMPLETED", final.message
    assert client.get_registered_model(name).aliases == {"champion": "1", "challenger": "2"}
    assert client.get_model_version(name, "2").tags["prefect_flow_run_id"] == flow_run_id

    run = _wait_for_run("evaluate-promote", lambda p: p.get("triggered_by") == f"prefect.flow-run.{flow_run_id}")
    assert run.state.type.value == "COMPLETED", run.state.message
    assert client.get_registered_model(name).aliases["champion"] == "2"
    tags = client.get_model_version(name, "2").tags
    assert tags["promotion.decision"] == "promoted" and tags["promotion.n"] == "32"
    audit = client.get_run(tags["promotion.eval_run_id"])
    assert audit.data.params["trigger"] == f"trigger:prefect.flow-run.{flow_run_id}"
    assert audit.data.tags["prefect.flow_run_id"] == str(run.id)

    # the cron schedule is live: Prefect's scheduler has queued the nightly sweeps (with
    # SQLAlchemy 2.1 it fails on every pass and queues none; pyproject pins 2.0)
    nightly = _wait_for_scheduled(deployment.id)
    utc = [r.expected_start_time.astimezone(timezone.utc) for r in nightly]
    assert utc and all((t.hour, t.minute) == (3, 0) for t in utc), utc
    assert all(r.parameters.get("triggered_by") is None for r in nightly)


def _wait_for_scheduled(deployment_id, deadline_s: float = 180.0) -> list:
    """The deployment's scheduled (future) runs, once the scheduler service has created some."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import (DeploymentFilter, DeploymentFilterId, FlowRunFilter, FlowRunFilterState,
                                                FlowRunFilterStateType)
    from prefect.client.schemas.objects import StateType

    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        with get_client(sync_client=True) as client:
            runs = client.read_flow_runs(
                deployment_filter=DeploymentFilter(id=DeploymentFilterId(any_=[deployment_id])),
                flow_run_filter=FlowRunFilter(state=FlowRunFilterState(type=FlowRunFilterStateType(any_=[StateType.SCHEDULED]))))
        if runs:
            return runs
        time.sleep(1)
    return []


def test_cli_lists_promotes_by_hand_and_names_what_is_missing(stack_env, checkpoints):
    from mlflow.tracking import MlflowClient

    from typer.testing import CliRunner

    from opentinker.cli.main import app

    def _cli(*args: str):
        result = CliRunner().invoke(app, list(args), env={"COLUMNS": "200"})
        result.returncode = result.exit_code
        return result

    settings, _ = stack_env
    client = MlflowClient(tracking_uri=settings.mlflow_url)
    name = "promo-cli"
    (u_spec, u_url), (t_spec, t_url) = checkpoints["untrained"], checkpoints["trained"]
    register(settings, _as(u_spec, name, "promo-cli-1"), u_url)
    register(settings, _as(t_spec, name, "promo-cli-2"), t_url)
    listed = _cli("models", "list", name)
    assert listed.returncode == 0 and "promo-cli-2" in listed.stdout and "challenger" in listed.stdout, listed
    moved = _cli("models", "promote", name, "2")
    assert moved.returncode == 0 and "champion v1 → v2" in moved.stdout, moved
    assert client.get_model_version(name, "2").tags["promotion.reason"] == "manual"
    before = snapshot(client, name)
    for args, message in ((("promote", name, "7"), f"'{name}' has no version 7"),
                          (("evaluate", "promo-nothing"), "no registered model 'promo-nothing'")):
        out = _cli("models", *args)
        assert out.returncode == 1 and message in out.stdout, out.stdout
        assert isinstance(out.exception, SystemExit), out.exception  # a clean exit, not a traceback
    assert snapshot(client, name) == before


def test_a_model_without_a_recorded_environment_needs_one_named(stack_env, checkpoints):
    """SFT versions carry no game: a triggered run skips them with the reason, an explicit
    evaluation fails until `env` names the game, and then it works as for RL versions."""
    from mlflow.tracking import MlflowClient

    from flows.evaluate import evaluate_promote
    from opentinker.eval.promotion import evaluate_and_promote
    from opentinker.storage.registry import register_job_checkpoint

    settings, _ = stack_env
    client = MlflowClient(tracking_uri=settings.mlflow_url)
    name = "promo-sft"
    for job, (_, url) in (("promo-sft-1", checkpoints["untrained"]), ("promo-sft-2", checkpoints["trained"])):
        register_job_checkpoint(checkpoint_url=url, model_name=name, job_id=job, kind="sft",
                                spec_data={"model": {"name": "tiny-random"}, "data": {"path": "chats.jsonl"}},
                                base_model="tiny-random", environment=None, flow_run_id=f"run-{job}",
                                mlflow_run_id=None, tracking_uri=settings.mlflow_url)
    before = snapshot(client, name)
    triggered = evaluate_promote(triggered_by="prefect.flow-run.run-promo-sft-2")
    assert triggered["evaluated"] == [] and "pass env= to say which game" in triggered["skipped"][0]["reason"]
    with pytest.raises(ValueError, match="records an environment"):
        evaluate_and_promote(name)
    assert snapshot(client, name) == before
    record = evaluate_and_promote(name, env={"game": "envs.toy:UppercaseGame", "config": {"val_size": 32}}, margin=0.1)
    assert record["decision"] == "promoted" and record["n"] == 32
    assert client.get_registered_model(name).aliases["champion"] == "2"
