"""Challenger against champion on a fixed validation set; `champion` moves only on a real win.

Both models play the same validation problems (the environment's held-out split, rebuilt from the
champion's registered `eval_spec`: same game, config and seed, so the same tasks), greedy, with the
RNG reseeded identically before each, giving paired per-problem rewards.

The decision rule (`decide`): promote iff all three hold
- n ≥ `min_samples` paired problems;
- mean(challenger − champion) ≥ `margin` (the improvement is large enough to matter);
- p ≤ `alpha` in a one-sided exact sign test on the per-problem differences: under H0 a
  non-tied problem is equally likely to favour either model, so with w wins and l losses
  p = P(Binomial(w + l, ½) ≥ w). For 0/1 rewards this is the exact one-sided McNemar test
  on the discordant pairs. Ties carry no evidence and are left out; it assumes nothing about
  the reward scale, which differs from game to game.

Every evaluation leaves an audit record: an MLflow run in experiment `evaluation-<model>` (both
means, difference, p-value, n, wins/losses/ties as metrics; versions, checkpoints, test, margin,
alpha, validation-set hash as params; per-problem rewards as an artifact), and tags on the
challenger's version (`promotion.decision`, `promotion.reason`, `promotion.eval_run_id`,
`promotion.time`, `promotion.vs_champion`, …). A losing challenger keeps its `challenger` alias and
is tagged `kept-champion`; the champion is untouched.

Runs in-process (the CLI, a notebook) or as the Prefect flow `evaluate-promote` (flows/evaluate.py),
which calls the same functions as tasks.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import asdict, dataclass, field
from collections.abc import Callable
from typing import Any

from opentinker.storage.registry import (CHALLENGER, CHAMPION, EVAL_SPEC_TAG, ModelNotFoundError, registry_client,
                                 get_version, now_iso, resolve_model_uri)
from opentinker.tracking.runs import Run

TEST = "one-sided exact sign test on paired per-problem reward differences (exact McNemar for 0/1 rewards)"
DEFAULTS = {"margin": 0.05, "alpha": 0.05, "min_samples": 30, "max_failure_rate": 0.5}


# -- the decision rule --------------------------------------------------------------------------


def sign_test_p(wins: int, losses: int) -> float:
    """One-sided exact sign test: P(X ≥ wins) for X ~ Binomial(wins + losses, ½); 1.0 with no
    discordant pair (no evidence either way)."""
    n = wins + losses
    if n == 0:
        return 1.0
    return sum(math.comb(n, k) for k in range(wins, n + 1)) / 2**n


@dataclass(frozen=True)
class Decision:
    promote: bool
    reason: str
    n: int
    challenger_mean: float
    champion_mean: float
    mean_diff: float
    wins: int
    losses: int
    ties: int
    p_value: float
    margin: float
    alpha: float
    min_samples: int
    test: str = TEST


def decide(challenger: list[float], champion: list[float], margin: float = DEFAULTS["margin"],
           alpha: float = DEFAULTS["alpha"], min_samples: int = DEFAULTS["min_samples"]) -> Decision:
    """Apply the rule of the module docstring to paired per-problem rewards (same order)."""
    if len(challenger) != len(champion):
        raise ValueError(f"paired rewards needed: {len(challenger)} challenger vs {len(champion)} champion problems")
    n = len(challenger)
    diffs = [a - b for a, b in zip(challenger, champion)]
    wins, losses = sum(d > 0 for d in diffs), sum(d < 0 for d in diffs)
    mean_c = sum(challenger) / n if n else 0.0
    mean_h = sum(champion) / n if n else 0.0
    diff = sum(diffs) / n if n else 0.0
    p = sign_test_p(wins, losses)
    if n < min_samples:
        reason = f"too few samples: {n} < min_samples {min_samples}"
    elif diff < margin:
        reason = f"below margin: mean difference {diff:+.4f} < {margin}"
    elif p > alpha:
        reason = f"not significant: p = {p:.4g} > alpha {alpha} ({wins} wins, {losses} losses)"
    else:
        reason = f"wins by {diff:+.4f} ≥ {margin}, p = {p:.4g} ≤ {alpha} ({wins} wins, {losses} losses, n = {n})"
    return Decision(promote=reason.startswith("wins"), reason=reason, n=n, challenger_mean=mean_c, champion_mean=mean_h,
                    mean_diff=diff, wins=wins, losses=losses, ties=n - wins - losses, p_value=p,
                    margin=margin, alpha=alpha, min_samples=min_samples)


# -- what to evaluate -----------------------------------------------------------------------------


@dataclass
class Pair:
    """A challenger and the champion it is measured against, pinned to versions at planning
    time (aliases may move while the evaluation runs)."""

    name: str
    challenger: str
    champion: str | None
    challenger_url: str
    champion_url: str | None
    eval_spec: dict[str, Any]
    base_model: str
    skip: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)


def _eval_spec(mv) -> dict[str, Any] | None:
    raw = mv.tags.get(EVAL_SPEC_TAG)
    return json.loads(raw) if raw else None


def plan(client, name: str, force: bool = False, env: dict[str, Any] | None = None) -> Pair:
    """The pair to evaluate for `name` (ModelNotFoundError when it has no challenger). `skip`
    says why nothing needs doing: the challenger is the champion, or it was already judged
    against this champion (unless `force`). The champion's environment defines the validation
    set (the incumbent sets the benchmark); `env` (an EnvSpec dict) overrides it, e.g. for SFT
    models registered without one."""
    challenger = get_version(client, name, alias=CHALLENGER)
    try:
        champion = get_version(client, name, alias=CHAMPION)
    except ModelNotFoundError:
        champion = None
    base = challenger.tags.get("base_model", "")
    skip = None
    if champion is not None and champion.version == challenger.version:
        skip = f"challenger v{challenger.version} is the champion"
    elif champion is not None and not force and challenger.tags.get("promotion.vs_champion") == str(champion.version):
        skip = f"challenger v{challenger.version} was already evaluated against champion v{champion.version}"
    if skip:
        return Pair(name, str(challenger.version), str(champion.version), "", None, {}, base, skip=skip)
    chall_spec = _eval_spec(challenger)
    challenger_url = resolve_model_uri(f"models:/{name}/{challenger.version}", client.tracking_uri)
    if champion is None:  # nothing to measure against: see no_champion()
        return Pair(name, str(challenger.version), None, challenger_url, None, chall_spec or {}, base)
    spec = _eval_spec(champion) or chall_spec
    if env is not None:
        spec = {**(spec or {"seed": 0, "rollout": {}, "evaluation": {}}), "env": env}
    elif spec is None:
        raise ValueError(f"{name}: neither version {challenger.version} nor the champion records an environment "
                         f"({EVAL_SPEC_TAG} tag); pass env= to say which game to evaluate on")
    elif chall_spec and chall_spec["env"].get("game") != spec["env"].get("game"):
        raise ValueError(f"{name}: challenger v{challenger.version} plays {chall_spec['env'].get('game')!r}, champion "
                         f"v{champion.version} plays {spec['env'].get('game')!r}; pass env= to compare them on one game")
    return Pair(name=name, challenger=str(challenger.version), champion=str(champion.version), challenger_url=challenger_url,
                champion_url=resolve_model_uri(f"models:/{name}/{champion.version}", client.tracking_uri),
                eval_spec=spec, base_model=base)


def models_with_challengers(client) -> list[str]:
    """Registered OpenTinker models that have a challenger alias (what a scheduled sweep looks at)."""
    return sorted(m.name for m in client.search_registered_models(max_results=1000)
                  if CHALLENGER in m.aliases and m.tags.get("opentinker") == "true")


def version_for_flow_run(client, flow_run_id: str) -> tuple[str, str] | None:
    """(model, version) a job's flow run registered, found by its lineage tag; None if it registered none."""
    found = client.search_model_versions(f"tags.prefect_flow_run_id = '{flow_run_id}'")
    return (found[0].name, str(found[0].version)) if found else None


# -- evaluation -----------------------------------------------------------------------------------


def evaluation_job_spec(pair: Pair, n_samples: int | None = None, greedy: bool = True):
    """A JobSpec that replays the recorded environment, limits and seed for evaluation."""
    from opentinker.core.spec import parse_spec

    s = pair.eval_spec
    n = n_samples or (s.get("evaluation") or {}).get("n_samples") or 64
    return parse_spec({"model": {"name": pair.base_model}, "env": s["env"], "seed": s.get("seed", 0),
                       "rollout": s.get("rollout") or {}, "evaluation": {"greedy": greedy, "n_samples": n, "every": 0}})


def evaluate_checkpoint(checkpoint_url: str, spec, engine: Any = None) -> dict[str, Any]:
    """Per-problem rewards of a checkpoint on the spec's validation set (in the set's order),
    the set's sha256, and the usual evaluation metrics. The RNG is reseeded first, so every
    model meets identical conditions. `engine`: a rollout engine serving the checkpoint already
    (opentinker.inference.evaluation starts vLLM where it pays); None: the HF engine here."""
    from opentinker.core.seeding import seed_everything
    from opentinker.model import load_policy, read_policy_info
    from opentinker.model.loading import load_tokenizer
    from opentinker.rl import Sampler

    if engine is None:
        model, tokenizer, _ = load_policy(checkpoint_url)
    else:  # the server holds the checkpoint's weights: nothing here but its tokenizer
        model, tokenizer = None, load_tokenizer(read_policy_info(checkpoint_url)["base_model"])
    seed_everything(spec.seed)
    result = Sampler(spec, model, tokenizer, engine=engine).evaluate(0)
    tasks = [t["task"] for t in result.transcripts]
    return {"rewards": [float(t["reward"]) for t in result.transcripts],
            "failed": sum(bool(t["failed"]) for t in result.transcripts),
            "tasks_sha256": hashlib.sha256(json.dumps(tasks, sort_keys=True, default=str).encode()).hexdigest(),
            "metrics": result.metrics,
            "replies": [t["messages"][-1]["content"] if t["messages"] else "" for t in result.transcripts]}


# -- the verdict ----------------------------------------------------------------------------------


def conclude(client, pair: Pair, spec, challenger: dict[str, Any], champion: dict[str, Any], decision: Decision,
             flow_run_id: str | None = None, trigger: str = "manual") -> dict[str, Any]:
    """Write the audit record, then move `champion` if the decision says so and the champion is
    still the version evaluated against (else `stale`: nothing moves). Returns the record."""
    if challenger["tasks_sha256"] != champion["tasks_sha256"]:
        raise RuntimeError("the two models were not evaluated on the same validation problems")
    when = now_iso()
    run = Run.start(f"evaluation-{pair.name}", f"v{pair.challenger} vs v{pair.champion}", tracking_uri=client.tracking_uri,
                    tags={"registered_model": pair.name, "prefect.flow_run_id": flow_run_id or "", "trigger": trigger})
    params = {"model_name": pair.name, "challenger_version": pair.challenger, "champion_version": pair.champion,
              "challenger_checkpoint": pair.challenger_url, "champion_checkpoint": pair.champion_url, "test": TEST,
              "margin": decision.margin, "alpha": decision.alpha, "min_samples": decision.min_samples,
              "n_samples": spec.evaluation.n_samples, "greedy": spec.evaluation.greedy, "environment": spec.env.label,
              "env_config": json.dumps(spec.env.config, sort_keys=True), "seed": spec.seed,
              "validation_set_sha256": challenger["tasks_sha256"], "trigger": trigger}
    run.log_params(params)
    metrics = {"challenger_mean": decision.challenger_mean, "champion_mean": decision.champion_mean,
               "mean_diff": decision.mean_diff, "p_value": decision.p_value, "n": decision.n, "wins": decision.wins,
               "losses": decision.losses, "ties": decision.ties, "challenger_failed": challenger["failed"],
               "champion_failed": champion["failed"]}
    run.log_metrics(0, metrics)
    rows = [{"problem": i, "challenger": a, "champion": b, "challenger_reply": ra, "champion_reply": rb}
            for i, (a, b, ra, rb) in enumerate(zip(challenger["rewards"], champion["rewards"], challenger["replies"], champion["replies"]))]
    run.log_files({"per_problem.json": json.dumps({"decision": asdict(decision), "problems": rows}, indent=1)})

    outcome, reason = ("promoted", decision.reason) if decision.promote else ("kept-champion", decision.reason)
    if unhealthy := _unhealthy(challenger, "challenger") or _unhealthy(champion, "champion"):
        outcome, reason = "kept-champion", unhealthy  # failed episodes score 0: the comparison says nothing
    elif decision.promote:
        current = client.get_registered_model(pair.name).aliases.get(CHAMPION)
        if str(current) != str(pair.champion):
            outcome, reason = "stale", f"champion moved to v{current} during the evaluation; nothing changed"
        else:
            client.set_registered_model_alias(pair.name, CHAMPION, pair.challenger)
            client.set_model_version_tag(pair.name, pair.champion, "promotion.replaced_by", pair.challenger)
    tags = {"promotion.decision": outcome, "promotion.reason": reason, "promotion.eval_run_id": run.run_id,
            "promotion.time": when, "promotion.vs_champion": pair.champion, "promotion.mean_diff": f"{decision.mean_diff:.6g}",
            "promotion.p_value": f"{decision.p_value:.6g}", "promotion.n": str(decision.n)}
    for k, v in tags.items():
        client.set_model_version_tag(pair.name, pair.challenger, k, v)
    run.set_tags({"decision": outcome, "reason": reason})
    run.finish()
    return {"model": pair.name, "challenger": pair.challenger, "champion_before": pair.champion,
            "champion_after": pair.challenger if outcome == "promoted" else pair.champion,
            "decision": outcome, "reason": reason, "eval_run_id": run.run_id, "experiment_id": run.experiment_id, "time": when, **metrics}


def _unhealthy(evaluation: dict[str, Any], who: str) -> str | None:
    n = len(evaluation["rewards"])
    if n and evaluation["failed"] / n > DEFAULTS["max_failure_rate"]:
        return f"the {who}'s evaluation is unhealthy: {evaluation['failed']} of {n} episodes failed"
    return None


def no_champion(client, pair: Pair) -> dict[str, Any]:
    """A model whose champion alias was removed: its challenger becomes champion, recorded as such."""
    client.set_registered_model_alias(pair.name, CHAMPION, pair.challenger)
    when = now_iso()
    for k, v in {"promotion.decision": "promoted", "promotion.reason": "no champion to compare with", "promotion.time": when}.items():
        client.set_model_version_tag(pair.name, pair.challenger, k, v)
    return {"model": pair.name, "challenger": pair.challenger, "champion_before": None, "champion_after": pair.challenger,
            "decision": "promoted", "reason": "no champion to compare with", "time": when}


def evaluate_and_promote(name: str, n_samples: int | None = None, margin: float = DEFAULTS["margin"],
                         alpha: float = DEFAULTS["alpha"], min_samples: int = DEFAULTS["min_samples"],
                         env: dict[str, Any] | None = None, force: bool = True, greedy: bool = True,
                         tracking_uri: str | None = None, evaluate: Callable[[str, Any], dict[str, Any]] = evaluate_checkpoint) -> dict[str, Any]:
    """The whole evaluation in this process (what the flow runs as tasks): plan, evaluate both
    (with `evaluate`: opentinker.inference.evaluation's picks the engine), decide, record, promote."""
    client = registry_client(tracking_uri)
    pair = plan(client, name, force=force, env=env)
    if pair.skip:
        return {"model": name, "decision": "skipped", "reason": pair.skip}
    if pair.champion is None:
        return no_champion(client, pair)
    spec = evaluation_job_spec(pair, n_samples, greedy)
    champ = evaluate(pair.champion_url, spec)
    chall = evaluate(pair.challenger_url, spec)
    return conclude(client, pair, spec, chall, champ, decide(chall["rewards"], champ["rewards"], margin, alpha, min_samples))


def promote_manually(name: str, version: str, tracking_uri: str | None = None) -> dict[str, Any]:
    """Move `champion` to a version by hand (an operator's decision), recorded on the version."""
    client = registry_client(tracking_uri)
    mv = get_version(client, name, version=version)
    before = client.get_registered_model(name).aliases.get(CHAMPION)
    client.set_registered_model_alias(name, CHAMPION, mv.version)
    when = now_iso()
    for k, v in {"promotion.decision": "promoted", "promotion.reason": "manual", "promotion.time": when,
                 "promotion.vs_champion": str(before or "")}.items():
        client.set_model_version_tag(name, mv.version, k, v)
    return {"model": name, "champion_before": before, "champion_after": str(mv.version), "decision": "promoted", "reason": "manual", "time": when}
