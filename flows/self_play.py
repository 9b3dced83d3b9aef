"""Multi-agent self-play as a Prefect flow: per step, the rollout phase (the matches played
jointly, then one rollout task per agent), then the update phase (one task per agent), each
phase's tasks submitted together and all awaited (the barrier), then evaluate/checkpoint.

Same contract as rl_train and the same step loop (opentinker/rl/loop.py): the spec is the
parameter, the job resumes from the newest step every agent has checkpointed, deployment runs
hold their pool's slots, and a step's metrics (prefixed by agent) reach MLflow once the
checkpoint covering it has committed. Each learner's final checkpoint is registered on its own.
"""

from __future__ import annotations

from typing import Any

import ray
from prefect import flow, get_run_logger

from opentinker.core.spec import JobSpec
from opentinker.env.environment import import_game
from opentinker.orchestration.actors import create_selfplay_actor
from opentinker.orchestration.job import JobContext, ray_runner, register_final_checkpoint, scheduled_job
from opentinker.rl import LoopHooks, run_steps
from opentinker.rl.health import JobUnhealthy
from opentinker.rl.selfplay import learner_names
from opentinker.storage.registry import model_name_for
from tasks.selfplay import SelfPlayTaskSteps


@flow(name="self-play", task_runner=ray_runner(), persist_result=False, log_prints=True)
def self_play(spec: JobSpec, job_id: str | None = None, tenant: str | None = None) -> dict[str, Any]:
    if spec.multiagent is None:
        raise ValueError("multiagent: a self-play job needs a multiagent section")
    logger = get_run_logger()
    agents = learner_names(spec.multiagent)
    with scheduled_job(spec, job_id, tenant) as job, job.tracked(spec) as tracker:
        actor = create_selfplay_actor(spec, job.job_id, job.tenant)
        try:
            result = run_steps(spec, SelfPlayTaskSteps(actor, job.job_id, agents, spec.multiagent.phase_timeout_s), LoopHooks(
                on_restore=job.on_restore(tracker),
                on_commit=tracker.log_steps,
                on_step=lambda report: logger.info(f"step {report.step}/{report.total_steps}: " + ", ".join(
                    f"{a} win {report.metrics.get(f'{a}/rollout/win_rate', 0):.2f}" for a in agents)),
            ))
        finally:
            ray.kill(actor)
        urls = {agent: ref.url for agent, ref in (result.checkpoint or {}).items()}
        for agent, url in urls.items():
            tracker.log_checkpoint(url, folder=f"final-{agent}", tag=f"opentinker.checkpoint.{agent}")
        if spec.registry.register and urls and result.not_registrable:
            raise JobUnhealthy(result.not_registrable)
        registered = {a: _register(spec, job, tenant, url, tracker, a) for a, url in urls.items()} if spec.registry.register else {}
        return {"job_id": job.job_id, "steps": spec.optimization.steps, "resumed_from": result.resumed_from, "checkpoints": urls,
                "skipped_checkpoints": result.skipped, "agents": agents, "mlflow_run_id": tracker.run_id, "history": result.history,
                "registered_models": registered}


def _register(spec: JobSpec, job: JobContext, tenant: str | None, url: str, tracker, agent: str) -> dict[str, Any]:
    """One learner's final checkpoint as a version of `<registry.model_name or default>-<agent>`,
    evaluated (by promotion) in the game's single-agent form when the match class names one
    (`evaluation_env(player, config)`, e.g. Gomoku: that side against the random opponent)."""
    data = spec.model_dump(mode="json")
    match_class = import_game(spec.env.game) if spec.env.game else None
    hook = getattr(match_class, "evaluation_env", None)
    eval_env = hook(agent, spec.env.config or {}) if hook else {}  # {}: no evaluation spec is registered
    return register_final_checkpoint(job, tenant, url, tracker, kind="rl", spec_data=data,
                                     model_name=f"{model_name_for(data, job.experiment, tenant)}-{agent.lower()}",
                                     base_model=spec.model.name, environment=spec.env.game or spec.env.label,
                                     agent=agent, eval_env=eval_env)
