"""Scheduled and triggered evaluation as a Prefect flow: challenger against champion, then promote.

The deployment `evaluate-promote/cpu` (deployments/prefect.yaml) runs it on a cron schedule (a
sweep over every registered model with a challenger not yet judged against its champion) and from
a deployment trigger when an `rl-train` or `sft` flow run completes (`triggered_by` is then the
event's resource, `prefect.flow-run.<id>`, and the flow evaluates the model that run registered).
Each model's evaluation is a task, so the UI shows both scores; the decision rule, audit record
and alias move are opentinker/eval/promotion.py's.

Run it by hand: `opentinker models evaluate <name>` (in-process), or
`prefect deployment run evaluate-promote/cpu -p model_name=<name>`.
"""

from __future__ import annotations

from typing import Any

from prefect import flow, get_run_logger, runtime, task
from prefect.cache_policies import NO_CACHE

from opentinker.eval import promotion
from opentinker.inference.evaluation import evaluate
from opentinker.orchestration.job import held_slots
from opentinker.storage.registry import ModelNotFoundError, registry_client
from opentinker.core.settings import get_settings

_COMMON = {"cache_policy": NO_CACHE, "persist_result": False}


@task(name="evaluate-version", task_run_name="evaluate-{name}-v{version}", retries=1, **_COMMON)
def evaluate_version(name: str, version: str, checkpoint_url: str, spec, engine: str = "auto") -> dict[str, Any]:
    """Per-problem rewards of one registered version on the validation set (safe to retry), on the
    engine opentinker.inference.evaluation chooses (vLLM where it runs and repays its start-up)."""
    return evaluate(checkpoint_url, spec, engine)


@task(name="decide-and-record", task_run_name="decide-{pair.name}-v{pair.challenger}", **_COMMON)
def decide_and_record(pair: promotion.Pair, spec, challenger: dict, champion: dict, margin: float, alpha: float,
                      min_samples: int, trigger: str) -> dict[str, Any]:
    """The paired test, the audit record and (on a win) the alias move."""
    client = registry_client(get_settings().mlflow_url)
    decision = promotion.decide(challenger["rewards"], champion["rewards"], margin, alpha, min_samples)
    return promotion.conclude(client, pair, spec, challenger, champion, decision,
                              flow_run_id=str(runtime.flow_run.id or ""), trigger=trigger)


@flow(name="evaluate-promote", persist_result=False, log_prints=True)
def evaluate_promote(model_name: str | None = None, triggered_by: str | None = None, n_samples: int | None = None,
                     margin: float = promotion.DEFAULTS["margin"], alpha: float = promotion.DEFAULTS["alpha"],
                     min_samples: int = promotion.DEFAULTS["min_samples"], env: dict[str, Any] | None = None,
                     force: bool = False, greedy: bool = True, engine: str = "auto") -> dict[str, Any]:
    """Evaluate `model_name`'s challenger against its champion (every model with a pending
    challenger when None; the model a finished job's flow run registered when `triggered_by` is
    `prefect.flow-run.<id>`), and move `champion` on a win. `env` (an EnvSpec dict) overrides the
    recorded environment; `force` re-evaluates a pair that was judged already; `engine`: auto | hf | vllm."""
    logger = get_run_logger()
    settings = get_settings()
    client = registry_client(settings.mlflow_url)
    trigger = "manual" if model_name else "schedule"
    asked_for = model_name is not None  # a run asked for one model fails when it cannot be evaluated
    if triggered_by:
        trigger = f"trigger:{triggered_by}"
        found = promotion.version_for_flow_run(client, triggered_by.rpartition(".")[2])
        if found is None:
            logger.info(f"{triggered_by} registered no model version: nothing to evaluate")
            return {"evaluated": [], "skipped": [{"reason": f"{triggered_by} registered no model version"}]}
        model_name = found[0]
    names = [model_name] if model_name else promotion.models_with_challengers(client)
    evaluated, skipped = [], []
    for name in names:
        try:
            pair = promotion.plan(client, name, force=force, env=env)
        except (ModelNotFoundError, ValueError) as err:
            if asked_for:
                raise
            logger.warning(f"{name}: not evaluated: {err}")
            skipped.append({"model": name, "reason": str(err)})
            continue
        if pair.skip:
            logger.info(f"{name}: {pair.skip}")
            skipped.append({"model": name, "reason": pair.skip})
            continue
        if pair.champion is None:
            evaluated.append(promotion.no_champion(client, pair))
            continue
        spec = promotion.evaluation_job_spec(pair, n_samples, greedy)
        # A deployment run holds one CPU slot while models are loaded and played, like any job, so
        # evaluations never overbook the machine the training jobs share; one with nothing to do takes none.
        with held_slots(0):
            champ = evaluate_version.submit(name, pair.champion, pair.champion_url, spec, engine).result()
            chall = evaluate_version.submit(name, pair.challenger, pair.challenger_url, spec, engine).result()
        logger.info(f"{name}: evaluated on the {champ['engine']} engine")
        record = decide_and_record(pair, spec, chall, champ, margin, alpha, min_samples, trigger)
        logger.info(f"{name}: v{pair.challenger} vs champion v{pair.champion}: {record['decision']} ({record['reason']}); "
                    f"means {record['challenger_mean']:.3f} vs {record['champion_mean']:.3f}, n={record['n']}")
        evaluated.append(record)
    return {"evaluated": evaluated, "skipped": skipped}
