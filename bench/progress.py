"""The progress lines the learning benches print for a step and an evaluation (one format for all)."""

from __future__ import annotations


def step_line(report) -> str:
    m = report.metrics
    return (f"step {report.step:>3}: sampled reward {m['rollout/reward_mean']:.3f} "
            f"format {m.get('rollout/format_ok', 0):.2f} ({m['step/seconds']:.1f}s)")


def eval_line(evaluation) -> str:
    m = evaluation.metrics
    return (f"eval {evaluation.step:>3}: accuracy {m['eval/accuracy']:.3f} format {m['eval/format_ok']:.3f} "
            f"distinct {m['eval/distinct_answer_share']:.3f}")
