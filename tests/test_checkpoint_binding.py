"""Checkpoints bound to their job: each attack on a job's step folders is really made (a folder
copied from another tenant's job, a manifest re-hashed over garbage, one written before signing,
a broken manifest, a folder moved to another step) and refused in one line naming the folder;
resume takes the newest intact checkpoint and names what it skipped; through the stack MLflow
holds each step once, and a tenant lists and deletes its own checkpoints (another's read as missing).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import shutil

import pytest
import torch

from opentinker.storage import checkpoint as ckpt
from tests.conftest import tiny_spec

ALICE = ckpt.Owner("job", "alice")


def _save(base: str, step: int, job: str = "job", tenant: str | None = "alice", **kw) -> ckpt.CheckpointRef:
    return ckpt.save_checkpoint(base, job, step, {"w": torch.ones(3) * step}, {"state": {}, "param_groups": []},
                                {"env": {}, "metrics": [[step, {"rollout/reward_mean": float(step)}]]}, tenant=tenant, **kw)


def _folder(tmp_path, step: int, job: str = "job"):
    return tmp_path / job / f"step-{step:08d}"


def test_the_manifest_names_job_tenant_and_step_and_is_signed_with_the_stacks_secret(tmp_path):
    import os

    ref = _save(f"file://{tmp_path}", 2)
    manifest = json.loads((_folder(tmp_path, 2) / "COMMIT.json").read_text())
    assert (manifest["job"], manifest["tenant"], manifest["step"]) == ("job", "alice", 2)
    assert set(manifest["sha256"]) == set(manifest["files"]) >= {"weights.safetensors", "optimizer.pt", "state.json"}
    body = json.dumps({k: v for k, v in manifest.items() if k != "signature"}, sort_keys=True, separators=(",", ":"))
    secret = os.environ["OPENTINKER_SECRET"]
    assert manifest["signature"] == hmac.new(secret.encode(), f"checkpoint:{body}".encode(), hashlib.sha256).hexdigest()
    assert ckpt.load_checkpoint(ref.url, ALICE).step == 2


def _foreign_tenant(tmp_path, base):  # the same job id under another tenant's storage, copied over the latest
    other = f"file://{tmp_path}/bob-storage"
    _save(other, 12, tenant="bob")
    shutil.rmtree(_folder(tmp_path, 2))
    shutil.copytree(tmp_path / "bob-storage" / "job" / "step-00000012", _folder(tmp_path, 2))


def _foreign_job(tmp_path, base):  # another job of the same tenant
    _save(base, 2, job="other")
    shutil.rmtree(_folder(tmp_path, 2))
    shutil.copytree(_folder(tmp_path, 2, "other"), _folder(tmp_path, 2))


def _rehashed(tmp_path, base):  # garbage weights, the manifest's size and sha256 rewritten to match
    folder = _folder(tmp_path, 2)
    garbage = b"\xff" * 4000
    (folder / "weights.safetensors").write_bytes(garbage)
    manifest = json.loads((folder / "COMMIT.json").read_text())
    manifest["files"]["weights.safetensors"] = len(garbage)
    manifest["sha256"]["weights.safetensors"] = hashlib.sha256(garbage).hexdigest()
    (folder / "COMMIT.json").write_text(json.dumps(manifest))


def _unsigned(tmp_path, base):  # as written before checkpoints were signed
    folder = _folder(tmp_path, 2)
    manifest = json.loads((folder / "COMMIT.json").read_text())
    (folder / "COMMIT.json").write_text(json.dumps({k: v for k, v in manifest.items() if k not in ("signature", "job", "tenant")}))


def _broken_manifest(tmp_path, base):
    (_folder(tmp_path, 2) / "COMMIT.json").write_text('{"step": 2, "files": {"weights.safet')


def _moved(tmp_path, base):  # the job's own step 1, renamed to look newer
    shutil.rmtree(_folder(tmp_path, 2))
    shutil.copytree(_folder(tmp_path, 1), _folder(tmp_path, 2))


def _corrupt_bytes(tmp_path, base):  # same size, other bytes, manifest untouched
    path = _folder(tmp_path, 2) / "weights.safetensors"
    path.write_bytes(b"\x00" * path.stat().st_size)


@pytest.mark.parametrize("attack,reason", [
    (_foreign_tenant, "refused: it belongs to another job or tenant, not to job job"),
    (_foreign_job, "refused: it belongs to another job or tenant, not to job job"),
    (_rehashed, "refused: its COMMIT.json does not match its signature"),
    (_unsigned, "refused: its COMMIT.json is not signed (written before checkpoints were signed"),
    (_broken_manifest, "is not a complete checkpoint (no valid COMMIT.json: unreadable (JSONDecodeError"),
    (_moved, "refused: it was written as step 1, not as this folder's step (moved or renamed)"),
    (_corrupt_bytes, "is not a complete checkpoint: weights.safetensors differs from the sha256 in COMMIT.json"),
])
def test_a_bad_latest_is_refused_in_one_line_and_resume_takes_the_intact_previous_one(tmp_path, attack, reason):
    base = f"file://{tmp_path}"
    _save(base, 1)
    _save(base, 2)
    attack(tmp_path, base)
    step2 = f"{base}/job/step-00000002"
    with pytest.raises(ckpt.CheckpointError) as refused:
        ckpt.load_checkpoint(step2, ALICE)
    line = str(refused.value)
    assert line.startswith(step2) and reason in line and "\n" not in line

    found = ckpt.newest_intact(base, "job", ALICE)
    assert found.ref.step == 1 and found.loaded.step == 1 and torch.equal(found.loaded.weights["w"], torch.ones(3))
    assert found.skipped == [line]
    if attack is not _corrupt_bytes:  # the cheap check (COMMIT.json alone) already tells, for choosing and pruning
        assert [c.step for c in ckpt.list_checkpoints(base, "job", ALICE)] == [1]


def test_every_folder_newer_than_the_intact_one_is_named_and_none_intact_starts_over(tmp_path):
    base = f"file://{tmp_path}"
    for step in (1, 2, 3):
        _save(base, step)
    _broken_manifest(tmp_path, base)
    _folder(tmp_path, 4).mkdir()  # a write killed before its commit
    (_folder(tmp_path, 4) / "weights.safetensors").write_bytes(b"partial")
    (_folder(tmp_path, 3) / "COMMIT.json").unlink()
    found = ckpt.newest_intact(base, "job", ALICE)
    assert found.ref.step == 1
    assert [line.split()[0].rstrip(":").rsplit("/", 1)[1] for line in found.skipped] == ["step-00000004", "step-00000003", "step-00000002"]
    assert found.skipped[0].endswith("is not a complete checkpoint (no valid COMMIT.json: none there: a write that never finished, "
                                     "or one still under way)")
    nobody = ckpt.newest_intact(base, "job", ckpt.Owner("job", "mallory"))
    assert nobody.ref is None and len(nobody.skipped) == 4


def test_pruning_counts_only_the_jobs_own_checkpoints(tmp_path):
    """A foreign folder at a high step does not push the job's real checkpoints out."""
    base = f"file://{tmp_path}"
    _save(f"file://{tmp_path}/bob-storage", 12, tenant="bob")
    shutil.copytree(tmp_path / "bob-storage" / "job" / "step-00000012", _folder(tmp_path, 12))
    for step in (1, 2, 3):
        _save(base, step, keep_last=2)
    assert [c.step for c in ckpt.list_checkpoints(base, "job", ALICE)] == [2, 3]
    assert _folder(tmp_path, 12).exists()  # not the job's to prune: the tenant deletes it (gateway)


def test_loaders_without_a_job_still_refuse_a_rehashed_job_checkpoint(tmp_path):
    """Inference, init_from and the registry load by URL: a signed job checkpoint must still verify."""
    from opentinker.storage.committed import update_manifest

    base = f"file://{tmp_path}"
    ref = _save(base, 1)
    assert ckpt.load_checkpoint(ref.url).step == 1
    with pytest.raises(ValueError, match="a signed COMMIT.json is written only with its files"):
        update_manifest(ref.url, {"expires_at": "2100-01-01"})
    _save(base, 2)
    _rehashed(tmp_path, base)
    with pytest.raises(ckpt.CheckpointError, match="does not match its signature"):
        ckpt.load_checkpoint(f"{base}/job/step-00000002")
    with pytest.raises(ckpt.CheckpointError, match="does not match its signature"):
        ckpt.read_file(f"{base}/job/step-00000002", "state.json")


def test_a_real_job_resumes_from_the_intact_checkpoint_saying_what_it_skipped(tmp_path, tiny_path):
    from opentinker.rl import RLJob

    spec = tiny_spec(tmp_path, optimization={"steps": 2}, checkpoint={"every": 1})
    RLJob(spec, job_id="real", tenant="alice").run()
    folder = tmp_path / "runs" / "real" / "step-00000002"
    manifest = json.loads((folder / "COMMIT.json").read_text())
    (folder / "COMMIT.json").write_text(json.dumps(manifest | {"tenant": "bob"}))  # claimed for another tenant
    result = RLJob(tiny_spec(tmp_path, optimization={"steps": 3}, checkpoint={"every": 1}), job_id="real", tenant="alice").run()
    base = spec.checkpoint.base_url
    assert result.resumed_from == 1 and result.steps_done == 3 and [h["step"] for h in result.history] == [2.0, 3.0]
    assert result.skipped == [f"{base}/real/step-00000002: refused: its COMMIT.json does not match its signature "
                              "(changed after the commit, or written by another stack)"]
    assert [c.step for c in ckpt.list_checkpoints(base, "real", ckpt.Owner("real", "alice"))] == [1, 2, 3]  # step 2 redone, signed
    assert ckpt.list_checkpoints(base, "real", ckpt.Owner("real", None)) == []  # none of them is the operator's job "real"



def test_self_play_resumes_at_the_newest_step_every_agent_has_intact(tmp_path, tiny_path):
    """One learner's folder swapped for the other's (same tenant, same step): that step is skipped
    for both, with the line naming the folder, and the job goes on from the step before."""
    from opentinker.rl.selfplay import SelfPlayJob
    from tests.test_multiagent import _gomoku_spec

    spec = _gomoku_spec(tmp_path, "agents").model_copy(update={"checkpoint": tiny_spec(tmp_path, checkpoint={"every": 1}).checkpoint})
    steps = lambda n: spec.model_copy(update={"optimization": spec.optimization.model_copy(update={"steps": n})})  # noqa: E731
    SelfPlayJob(steps(2), job_id="sp", tenant="alice").run()
    runs = tmp_path / "runs"
    shutil.rmtree(runs / "sp.O" / "step-00000002")
    shutil.copytree(runs / "sp.X" / "step-00000002", runs / "sp.O" / "step-00000002")
    result = SelfPlayJob(steps(3), job_id="sp", tenant="alice").run()
    assert result.resumed_from == 1 and [h["step"] for h in result.history] == [2.0, 3.0]
    assert result.skipped == [f"{spec.checkpoint.base_url}/sp.O/step-00000002: refused: it belongs to another job or tenant, "
                              "not to job sp.O (copied here from elsewhere)"]


# --- through the stack: a tenant's job, another tenant's folder, MLflow, the gateway --------------------

@pytest.fixture(scope="module")
def tenants(stack_env):
    from opentinker.control.gateway.tenants import TenantStore
    from opentinker.control.submit import deploy

    settings, _ = stack_env
    deploy(settings)
    store = TenantStore(settings.state_dir / "tenants.json")
    return settings, {name: store.create(name, rotate=True) for name in ("ckalice", "ckbob")}


def _client(tenants, name):
    from opentinker.client import SchedulerClient

    settings, keys = tenants
    return SchedulerClient(url=settings.gateway_url, api_key=keys[name])


def _gateway_spec(tmp_path, steps: int) -> dict:
    data = tiny_spec(tmp_path, optimization={"steps": steps}, checkpoint={"every": 1, "keep_last": 10},
                     registry={"register": False}).model_dump(mode="json")
    return {**data, "job_id": "bound"}


def _bobs_checkpoint(settings, tmp_path) -> str:
    """A real checkpoint of tenant ckbob's job at step 12, carrying its own metrics."""
    from opentinker.env import environment_from_spec
    from opentinker.rl import Policy

    spec = tiny_spec(tmp_path / "bob", job_id="ckbob-other", checkpoint={"base_url": f"{settings.storage_url}/tenants/ckbob"})
    policy = Policy(spec, job_id="ckbob-other", tenant="ckbob")
    return policy.save(12, environment_from_spec(spec).state(), [(12, {"rollout/reward_mean": 99.0, "update/policy_loss": 99.0})]).url


@pytest.mark.slow  # the same resume through the stack (100 s); this file's in-process tests check every refusal in the default run
def test_through_the_stack_resume_skips_each_tampered_folder_names_it_and_mlflow_holds_each_step_once(tenants, tmp_path):
    from opentinker.client.http import JobNotFound

    settings, _ = tenants
    alice, bob = _client(tenants, "ckalice"), _client(tenants, "ckbob")
    job_id = alice.submit_job(_gateway_spec(tmp_path, 5))["job_id"]
    bobs = _bobs_checkpoint(settings, tmp_path).removeprefix("file://")  # made while alice's job runs
    assert alice.wait(job_id, timeout=600, poll=1)["state"] == "COMPLETED"
    root = settings.state_dir / "storage" / "tenants" / "ckalice" / job_id
    url = f"{settings.storage_url}/tenants/ckalice/{job_id}"
    assert settings.storage_url == f"file://{settings.state_dir / 'storage'}"

    # the attacks, as a user with write access to the storage would make them
    shutil.rmtree(root / "step-00000005")
    shutil.copytree(bobs, root / "step-00000005")  # another tenant's step folder over this job's latest
    weights = root / "step-00000004" / "weights.safetensors"
    garbage = b"\xff" * weights.stat().st_size
    weights.write_bytes(garbage)
    manifest = json.loads((root / "step-00000004" / "COMMIT.json").read_text())
    manifest["sha256"]["weights.safetensors"] = hashlib.sha256(garbage).hexdigest()
    (root / "step-00000004" / "COMMIT.json").write_text(json.dumps(manifest))  # hashes rewritten over garbage
    (root / "step-00000003" / "COMMIT.json").write_text('{"step": 3, "fil')  # a broken manifest
    manifest = json.loads((root / "step-00000002" / "COMMIT.json").read_text())
    (root / "step-00000002" / "COMMIT.json").write_text(json.dumps({k: v for k, v in manifest.items() if k != "signature"}))

    listed = alice.list_checkpoints(job_id)
    assert [(c["step"], c["valid"]) for c in listed] == [(1, True), (2, False), (3, False), (4, False), (5, False)]
    assert [c["problem"].split()[0].rstrip(":") for c in listed[1:]] == [f"{url}/step-{s:08d}" for s in (2, 3, 4, 5)]
    # another tenant neither lists nor deletes them: the job reads like a missing one
    for attempt in (lambda job: bob.list_checkpoints(job), lambda job: bob.delete_checkpoint(job, 1)):
        with pytest.raises(JobNotFound) as hidden:
            attempt(job_id)
        with pytest.raises(JobNotFound) as missing:
            attempt("ckalice-nothing")
        assert str(hidden.value).replace(job_id, "X") == str(missing.value).replace("ckalice-nothing", "X") == "no job 'X'"
    assert (root / "step-00000001" / "COMMIT.json").exists()

    again = alice.submit_job(_gateway_spec(tmp_path, 6))["job_id"]
    assert again == job_id
    final = alice.wait(job_id, timeout=600, poll=1)
    assert final["state"] == "COMPLETED", final
    skipped = final["skipped_checkpoints"]
    assert [line.split()[0].rstrip(":") for line in skipped] == [f"{url}/step-{s:08d}" for s in (5, 4, 3, 2)]
    assert "belongs to another job or tenant" in skipped[0] and "does not match its signature" in skipped[1]
    assert "no valid COMMIT.json: unreadable" in skipped[2] and "is not signed" in skipped[3]

    metrics = alice.metrics(job_id)
    for key in ("rollout/reward_mean", "update/policy_loss", "step/seconds"):
        assert [s for s, _ in metrics[key]] == [1, 2, 3, 4, 5, 6], key  # each step once: the redone 2-5 not again, bob's 12 never
        assert 99.0 not in [v for _, v in metrics[key]]
    assert [(c["step"], c["valid"]) for c in alice.list_checkpoints(job_id)] == [(s, True) for s in range(1, 7)]  # redone, signed

    assert alice.delete_checkpoint(job_id, 1)["deleted"] == [f"{url}/step-00000001"]
    assert not (root / "step-00000001").exists()
    assert [c["step"] for c in alice.list_checkpoints(job_id)] == [2, 3, 4, 5, 6]
    with pytest.raises(JobNotFound, match=f"job {job_id} has no checkpoint folder of step 1"):
        alice.delete_checkpoint(job_id, 1)
