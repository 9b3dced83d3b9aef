"""Multi-agent self-play as a Prefect flow: per step, the rollout phase (the matches played
jointly, then one rollout task per agent), then the update phase (one task per agent), each
phase's tasks submitted together and all awaited (the barrier), then evaluate/checkpoint.

Same contract as rl_train: the spec is the parameter, the job resumes from the newest step every
agent has checkpointed, deployment runs hold their pool's slots, and a step's metrics (prefixed
by agent) reach MLflow once the checkpoint covering it has committed.
"""

from __future__ import annotations

import time
from typing import Any

import ray
from prefect import flow, get_run_logger
from prefect_ray.context import remote_options

from flows.common import JobContext, ray_runner, register_final_checkpoint, scheduled_job
from opentinker.actors import create_multiagent_actor
from opentinker.agent.coordinator import collect_phase
from opentinker.spec import JobSpec
from tasks.multiagent import agent_rollout, agent_update, selfplay_checkpoint, selfplay_evaluate, selfplay_play


@flow(name="self-play", task_runner=ray_runner(), persist_result=False, log_prints=True)
def self_play(spec: JobSpec, job_id: str | None = None, tenant: str | None = None) -> dict[str, Any]:
    if spec.multiagent is None:
        raise ValueError("multiagent: a self-play job needs a multiagent section")
    with scheduled_job(spec, job_id, tenant) as job:
        return _train(spec, job, tenant)


def _register(spec: JobSpec, job: JobContext, tenant: str | None, url: str, tracker, agent: str) -> dict[str, Any]:
    """One learner's final checkpoint as a version of `<registry.model_name or default>-<agent>`,
    evaluated (by promotion) in the game's single-agent form when the match class names one
    (`evaluation_env(player, config)`, e.g. Gomoku: that side against the random opponent)."""
    from opentinker.env.environment import import_game
    from opentinker.registry import model_name_for

    data = spec.model_dump(mode="json")
    match_class = import_game(spec.env.game) if spec.env.game else None
    hook = getattr(match_class, "evaluation_env", None)
    eval_env = hook(agent, spec.env.config or {}) if hook else {}  # {}: no evaluation spec is registered
    return register_final_checkpoint(job, tenant, url, tracker, kind="rl", spec_data=data,
                                     model_name=f"{model_name_for(data, job.experiment, tenant)}-{agent.lower()}",
                                     base_model=spec.model.name, environment=spec.env.game or spec.env.label,
                                     agent=agent, eval_env=eval_env)


def _train(spec: JobSpec, job: JobContext, tenant: str | None = None) -> dict[str, Any]:
    logger = get_run_logger()
    job_id, timeout = job.job_id, spec.multiagent.phase_timeout_s
    actor = create_multiagent_actor(spec, job_id)
    tracker = job.tracker(spec)
    try:
        agents = ray.get(actor.learners.remote())
        start, covered = ray.get(actor.restore_latest.remote())
        total = spec.optimization.steps
        logger.info(f"self-play job {job_id}: agents {agents}, {'resuming at step ' + str(start) if start else 'starting'} of {total}")
        if late := tracker.log_missing_metrics(covered):
            logger.info(f"logged steps {late} that the checkpoint covered but MLflow missed")
        pending: list[tuple[int, dict[str, float]]] = []
        history: list[dict[str, float]] = []
        with remote_options(num_cpus=0, max_retries=0):
            if start == 0 and total > 0:
                pending.append((0, selfplay_evaluate.submit(actor=actor, job_id=job_id, step=0).result()))
            urls: dict[str, str] = {}
            for step in range(start, total):
                done, t0 = step + 1, time.perf_counter()
                metrics = collect_phase("rollout", step, {"matches": selfplay_play.submit(actor=actor, job_id=job_id, step=step)}, timeout)["matches"]
                for phase, work in (("rollout", agent_rollout), ("update", agent_update)):
                    for m in collect_phase(phase, step, {a: work.submit(actor=actor, job_id=job_id, agent=a, step=step) for a in agents}, timeout).values():
                        metrics |= m
                ray.get(actor.after_updates.remote(step))
                if spec.evaluates_at(done):
                    metrics |= selfplay_evaluate.submit(actor=actor, job_id=job_id, step=done).result()
                metrics["step/seconds"] = time.perf_counter() - t0
                pending.append((done, metrics))
                if spec.checkpoints_at(done):
                    urls = selfplay_checkpoint.submit(actor=actor, job_id=job_id, step=done, metrics=pending).result()
                    for s, m in pending:
                        tracker.log_metrics(s, m)
                        history.append({"step": s, **m})
                    pending.clear()
                logger.info(f"step {done}/{total}: " + ", ".join(f"{a} win {metrics.get(f'{a}/rollout/win_rate', 0):.2f}" for a in agents))
        for agent, url in urls.items():
            tracker.log_checkpoint(url, folder=f"final-{agent}", tag=f"opentinker.checkpoint.{agent}")
        registered = {a: _register(spec, job, tenant, url, tracker, a) for a, url in urls.items()} if spec.registry.register else {}
        tracker.finish("FINISHED")
        return {"job_id": job_id, "steps": total, "resumed_from": start, "checkpoints": urls, "agents": agents,
                "mlflow_run_id": tracker.run_id, "history": history, "registered_models": registered}
    except BaseException:
        tracker.finish("FAILED")
        raise
    finally:
        ray.kill(actor)
