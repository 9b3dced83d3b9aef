"""Device placement and precision, on the CPU: the device a job gets, what `model.dtype` means,
where trained and frozen weights live, and the tolerance of recomputed log-probabilities."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import tiny_spec


def test_placement_follows_the_gpus_asked_for_and_the_dtype():
    from opentinker.backend.device import placement

    assert placement(0, "auto") == placement(0, "float32")
    assert placement(0, "auto").device.type == "cpu" and placement(0, "auto").compute_dtype == torch.float32
    assert placement(0, "bfloat16").compute_dtype == torch.bfloat16
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match=r"^resources.num_gpus: the job asks for 1 GPU\(s\); this process sees 0"):
            placement(1, "auto")


def _recompute_gap(job) -> float:
    batch = job.sampler.batch(0)
    trajs = [t for t in batch.trajectories if not t.failed and t.num_sampled]
    recomputed = job.policy.trainer.logprobs(trajs)
    sampled = [[lp for lp, m in zip(t.sampling_logprobs, t.loss_mask) if m] for t in trajs]
    return max(abs(a - b) for r, s in zip(recomputed, sampled) for a, b in zip(r, s))


@pytest.mark.parametrize("dtype,tolerance", [("float32", 1e-4), ("bfloat16", 3e-2)])
def test_trained_weights_stay_float32_and_logprobs_agree_within_the_stated_tolerance(tmp_path, dtype, tolerance):
    """LoRA on a base in the compute precision: the base stored in it, the adapter and its
    optimizer state in float32; sampling and training share the autocast, so the trainer's
    recomputed log-probabilities match sampling's to the precision's rounding."""
    from opentinker.rl import RLJob

    job = RLJob(tiny_spec(tmp_path, model={"name": "tiny-random", "dtype": dtype}, optimization={"steps": 1}), job_id=f"dtype-{dtype}")
    params = dict(job.policy.model.named_parameters())
    assert {p.dtype for n, p in params.items() if p.requires_grad} == {torch.float32}
    assert {p.dtype for n, p in params.items() if not p.requires_grad and p.dim() > 1} == {getattr(torch, dtype)}
    job.rollout(0)
    assert _recompute_gap(job) < tolerance
    job.update(0)
    assert all(s["exp_avg"].dtype == torch.float32 for s in job.policy.trainer.optimizer.state.values())
