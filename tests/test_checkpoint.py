"""Checkpoints commit atomically and resume reproduces training exactly."""

import json

import fsspec
import pytest
import torch

from opentinker.storage import checkpoint as ckpt
from opentinker.rl import RLJob
from tests.conftest import tiny_spec


def _weights(job):
    return job.policy.trainer.trainable_state()


# LoRA exact resume also runs on S3 in the default suite (test_storage_s3), so here it is the slow variant
@pytest.mark.parametrize("adapter", [pytest.param({"kind": "lora", "r": 8, "alpha": 16}, marks=pytest.mark.slow), {"kind": "full"}])
def test_resume_reproduces_straight_training(tmp_path, tiny_path, adapter):
    lr = 1e-2 if adapter["kind"] == "lora" else 1e-3
    spec4 = tiny_spec(tmp_path, adapter=adapter, optimization={"steps": 4, "lr": lr})
    straight = RLJob(spec4, job_id="straight")
    straight.run()

    spec2 = tiny_spec(tmp_path, adapter=adapter, optimization={"steps": 2, "lr": lr})
    first = RLJob(spec2, job_id="resumed")
    assert first.run().steps_done == 2
    del first
    second = RLJob(spec4, job_id="resumed")  # a fresh process would do the same: nothing shared
    result = second.run()
    assert result.resumed_from == 2 and result.steps_done == 4 and len(result.history) == 2

    a, b = _weights(straight), _weights(second)
    assert a.keys() == b.keys()
    # the same episodes (each draws from its own generator, seeded by its number), their logprobs within the
    # float noise of decode batches they joined at their own moments: weights within 1e-5
    assert max(float((a[k] - b[k]).abs().max()) for k in a) <= 1e-5
    assert straight.sampler.env.state() == second.sampler.env.state()
    assert straight.policy.version == second.policy.version == 4


def test_rerun_of_a_finished_job_does_nothing(tmp_path, tiny_path):
    spec = tiny_spec(tmp_path, optimization={"steps": 2})
    RLJob(spec, job_id="j").run()
    again = RLJob(spec, job_id="j").run()
    assert again.resumed_from == 2 and again.history == []


def _save(base, step, **kw):
    return ckpt.save_checkpoint(base, "job", step, {"w": torch.ones(3) * step}, {"state": {}, "param_groups": []}, {"env": {}}, **kw)


def test_uncommitted_or_truncated_checkpoints_are_ignored(tmp_path):
    base = f"file://{tmp_path}"
    _save(base, 1)
    _save(base, 2)
    assert ckpt.latest_checkpoint(base, "job").step == 2
    # a write killed before its commit: step 3 has files but no COMMIT.json
    fs = fsspec.filesystem("file")
    step3 = tmp_path / "job" / "step-00000003"
    fs.makedirs(str(step3), exist_ok=True)
    (step3 / "weights.safetensors").write_bytes(b"partial")
    assert ckpt.latest_checkpoint(base, "job").step == 2
    # a committed checkpoint whose file was truncated afterwards is not trusted either
    step2 = tmp_path / "job" / "step-00000002"
    (step2 / "weights.safetensors").write_bytes(b"cut")
    assert ckpt.latest_checkpoint(base, "job").step == 1
    with pytest.raises(FileNotFoundError, match="not a complete checkpoint"):
        ckpt.load_checkpoint(f"{base}/job/step-00000002")


def test_crash_during_write_leaves_previous_checkpoint_latest(tmp_path, monkeypatch):
    base = f"file://{tmp_path}"
    _save(base, 1)
    real_dumps = json.dumps

    def crash_on_manifest(obj, *a, **k):
        if isinstance(obj, dict) and "files" in obj:
            raise KeyboardInterrupt("killed")
        return real_dumps(obj, *a, **k)

    monkeypatch.setattr(ckpt.json, "dumps", crash_on_manifest)
    with pytest.raises(KeyboardInterrupt):
        _save(base, 2)
    monkeypatch.undo()
    assert ckpt.latest_checkpoint(base, "job").step == 1
    assert torch.equal(ckpt.load_checkpoint(ckpt.latest_checkpoint(base, "job").url).weights["w"], torch.ones(3))
    _save(base, 2)  # the retry replaces the half-written folder
    assert ckpt.latest_checkpoint(base, "job").step == 2


def test_keep_last_prunes_old_checkpoints(tmp_path):
    base = f"file://{tmp_path}"
    for step in range(1, 6):
        _save(base, step, keep_last=2)
    assert [c.step for c in ckpt.list_checkpoints(base, "job")] == [4, 5]


def test_lora_checkpoint_holds_a_loadable_peft_adapter(tmp_path, tiny_path):
    from peft import PeftModel

    from opentinker.core.model_names import TINY
    from opentinker.model.policy import load_model

    spec = tiny_spec(tmp_path, optimization={"steps": 1})
    result = RLJob(spec, job_id="adapter").run()
    local = result.checkpoint.url.removeprefix("file://")
    base, _ = load_model(TINY)
    restored = PeftModel.from_pretrained(base, f"{local}/adapter")
    assert any("lora_" in n for n, _ in restored.named_parameters())


class _Payload:
    """What a hostile checkpoint would carry: unpickling it runs a command."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        import os

        return (os.system, (f"touch {self.marker}",))


def test_a_checkpoint_carrying_a_pickle_payload_is_refused_and_runs_nothing(tmp_path):
    import hashlib
    import io
    import json

    import torch

    ref = ckpt.save_checkpoint(f"file://{tmp_path}", "evil", 1, weights={"w": torch.zeros(2)}, optimizer_state={"state": {}},
                               state={"policy_version": 1, "env": {}})
    folder = tmp_path / "evil" / "step-00000001"
    marker = tmp_path / "pwned"
    buffer = io.BytesIO()
    torch.save({"state": {}, "x": _Payload(marker)}, buffer)
    (folder / "optimizer.pt").write_bytes(buffer.getvalue())
    manifest = json.loads((folder / "COMMIT.json").read_text())  # re-committed, as an attacker with write access would
    manifest["files"]["optimizer.pt"] = len(buffer.getvalue())
    manifest["sha256"]["optimizer.pt"] = hashlib.sha256(buffer.getvalue()).hexdigest()
    (folder / "COMMIT.json").write_text(json.dumps(manifest))
    with pytest.raises(ckpt.CheckpointError, match="refused: its COMMIT.json does not match its signature"):
        ckpt.load_checkpoint(ref.url)
    # even re-signed with the stack's own secret (an insider), the payload is refused, not run
    (folder / "COMMIT.json").write_text(json.dumps(ckpt.signed({k: v for k, v in manifest.items() if k != "signature"})))
    with pytest.raises(ckpt.CheckpointError, match="refused: optimizer.pt holds more than tensors and numbers"):
        ckpt.load_checkpoint(ref.url)
    assert not marker.exists()
    assert not list(folder.glob("*.pt")) or all(p.name == "optimizer.pt" for p in folder.glob("*.pt"))  # RNG state is JSON
