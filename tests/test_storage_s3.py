"""storage.base_url: s3://… against a real local S3 server (moto's, on 127.0.0.1): checkpoints,
resume after a kill, preflight failures in one line, corrupt checkpoints, MLflow artifacts.
Every failure case also proves that nothing already saved changed."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from opentinker.storage import checkpoint as ckpt
from opentinker.core.spec import JobSpec, parse_spec
from opentinker.storage.preflight import StorageError, check_storage
from tests.conftest import tiny_spec

ROOT = Path(__file__).resolve().parents[1]


def _on(url: str, tmp_path, **overrides) -> JobSpec:
    """tiny_spec with `storage.base_url: url` and checkpoints following it (no checkpoint.base_url)."""
    data = tiny_spec(tmp_path, **overrides).model_dump(mode="json")
    del data["checkpoint"]["base_url"]
    return parse_spec(data | {"storage": {"base_url": url}})


def _save(base: str, step: int, **kw) -> ckpt.CheckpointRef:
    weights = {"w": torch.arange(4.0) * step}
    return ckpt.save_checkpoint(base, "job", step, weights, {"state": {}, "param_groups": []}, {"env": {"seen": step}}, **kw)


# --- checkpoints on S3 --------------------------------------------------------------------------


def test_checkpoints_save_list_prune_and_load_on_s3(s3_server, s3_url):
    for step in (1, 2, 3, 4):
        _save(s3_url, step, keep_last=2)
    assert [c.step for c in ckpt.list_checkpoints(s3_url, "job")] == [3, 4]
    loaded = ckpt.load_checkpoint(ckpt.latest_checkpoint(s3_url, "job").url)
    assert loaded.step == 4 and torch.equal(loaded.weights["w"], torch.arange(4.0) * 4) and loaded.state["env"] == {"seen": 4}
    keys = s3_server.objects(s3_url)
    assert not [k for k in keys if "/step-00000001/" in k or "/step-00000002/" in k]  # pruned, not just uncommitted
    assert not [k for k in keys if ".opentinker-probe-" in k]
    assert ckpt.list_checkpoints(s3_url, "no-such-job") == []


def test_partial_writes_on_s3_are_ignored_by_resume(s3_server, s3_url):
    """Objects changed behind s3fs's back (as a killed writer or another process leaves them):
    listings are not trusted from its cache, and only complete checkpoints count."""
    _save(s3_url, 1)
    _save(s3_url, 2)
    assert ckpt.latest_checkpoint(s3_url, "job").step == 2  # s3fs now holds listings of the job
    bucket, prefix = s3_url.removeprefix("s3://").split("/", 1)
    client = s3_server.client()
    # a write killed before its commit: step 3 has a weights file but no COMMIT.json
    client.put_object(Bucket=bucket, Key=f"{prefix}/job/step-00000003/weights.safetensors", Body=b"partial")
    assert ckpt.latest_checkpoint(s3_url, "job").step == 2
    # a committed checkpoint whose file was then cut short (size differs from COMMIT.json)
    client.put_object(Bucket=bucket, Key=f"{prefix}/job/step-00000002/weights.safetensors", Body=b"cut")
    assert ckpt.latest_checkpoint(s3_url, "job").step == 1
    with pytest.raises(FileNotFoundError, match=f"{s3_url}/job/step-00000002 is not a complete checkpoint"):
        ckpt.load_checkpoint(f"{s3_url}/job/step-00000002")
    # saving step 3 again replaces the partial attempt; resume then trusts it
    _save(s3_url, 3)
    assert ckpt.latest_checkpoint(s3_url, "job").step == 3
    assert ckpt.load_checkpoint(f"{s3_url}/job/step-00000003").state["env"] == {"seen": 3}


def test_a_checkpoint_never_creates_a_missing_bucket(s3_server, s3_url):
    """s3fs's makedirs creates buckets: a typo in the bucket name must fail, not make a new one."""
    missing = "s3://no-such-bucket-here/prefix"
    with pytest.raises(ckpt.CheckpointWriteError, match=f"cannot write checkpoint {missing}/job/step-00000001 .*bucket does not exist"):
        _save(missing, 1)
    assert "no-such-bucket-here" not in {b["Name"] for b in s3_server.client().list_buckets()["Buckets"]}


def test_resume_from_s3_reproduces_straight_training(s3_url, tmp_path, tiny_path):
    from opentinker.rl import RLJob

    straight = RLJob(_on(s3_url, tmp_path, optimization={"steps": 3}), job_id="straight")
    straight.run()
    first = RLJob(_on(s3_url, tmp_path, optimization={"steps": 2}), job_id="resumed")
    assert first.run().steps_done == 2
    del first
    second = RLJob(_on(s3_url, tmp_path, optimization={"steps": 3}), job_id="resumed")
    result = second.run()
    assert result.resumed_from == 2 and result.steps_done == 3
    assert result.checkpoint.url == f"{s3_url}/resumed/step-00000003"
    a, b = straight.policy.trainer.trainable_state(), second.policy.trainer.trainable_state()
    # the same tokens either way; their logprobs carry the float noise of how the streaming engine's batches
    # happened to form (a run's decode steps join rows as they come), so the weights agree to 1e-5 (a step
    # lost or run twice would move them by about the learning rate, 1e-2); a full run once measured 1.09e-6
    assert max(float((a[k] - b[k]).abs().max()) for k in a) <= 1e-5
    assert straight.sampler.env.state() == second.sampler.env.state()


# --- a job killed mid-run resumes from S3 --------------------------------------------------------


def _mlflow_steps(settings, job_id: str, key: str) -> list[int]:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=settings.mlflow_url)
    exp = client.get_experiment_by_name(settings.project)
    (run,) = client.search_runs([exp.experiment_id], filter_string=f"tags.`opentinker.job_id` = '{job_id}'")
    return sorted(m.step for m in client.get_metric_history(run.info.run_id, key))


@pytest.mark.slow  # 44 s; in the default run test_multinode's head death kills a job that checkpoints to S3 and resumes it
def test_killed_job_resumes_from_s3_on_the_stack_worker(stack_env, s3_server, s3_url, tmp_path):
    """SIGKILL the process running the flow once an S3 checkpoint exists; the same job id, run
    again by the stack's worker (which got the S3 variables when the stack started), resumes from
    the newest complete S3 checkpoint: MLflow holds every step once and the final policy loads."""
    from opentinker.model.policy import load_policy
    from opentinker.control.scheduler import deployment_names
    from opentinker.control.follow import follow
    from opentinker.control.submit import deploy, submit_job

    settings, env = stack_env
    job_id = "s3-killed"
    steps = 6  # killed within a poll (0.2 s) of step 2's checkpoint; tiny steps take about a second: room to kill mid-run,
    # and the resumed run still evaluates twice (steps 4 and 6) and prunes to keep_last=3
    spec = _on(s3_url, tmp_path, optimization={"steps": steps}, evaluation={"every": 2, "n_samples": 8}, checkpoint={"every": 1})
    script = ("import sys, json; from opentinker.core.spec import parse_spec; from flows.rl_train import rl_train; "
              f"rl_train(parse_spec(json.loads(sys.argv[1])), job_id={job_id!r})")
    proc = subprocess.Popen([sys.executable, "-c", script, spec.model_dump_json()], cwd=ROOT, env=os.environ | env,
                            start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 300
        while (latest := ckpt.latest_checkpoint(s3_url, job_id)) is None or latest.step < 2:
            assert proc.poll() is None, "the flow ended before it could be killed"
            assert time.monotonic() < deadline, "no S3 checkpoint within 300 s"
            time.sleep(0.2)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    killed_at = ckpt.latest_checkpoint(s3_url, job_id).step
    assert 2 <= killed_at < steps, f"killed after step {killed_at} of {steps}: nothing left to resume"

    assert deploy(settings) == deployment_names()  # every deployment of deployments/prefect.yaml
    assert {"rl-train/gpu", "rl-train/cpu", "self-play/gpu", "self-play/cpu", "sft/gpu", "sft/cpu"} <= set(deployment_names())
    flow_run_id = submit_job(spec.model_dump(mode="json"), job_id, settings)
    final = follow(flow_run_id, job_id, settings, lambda p: None, interval=1.0)
    assert final.state == "COMPLETED", final.message
    assert final.result["checkpoint"] == f"{s3_url}/{job_id}/step-{steps:08d}"
    # a restart from scratch would have logged steps 1..killed_at twice
    assert _mlflow_steps(settings, job_id, "rollout/reward_mean") == list(range(1, steps + 1))
    assert _mlflow_steps(settings, job_id, "eval/accuracy") == list(range(0, steps + 1, 2))
    assert [c.step for c in ckpt.list_checkpoints(s3_url, job_id)] == [steps - 2, steps - 1, steps]  # keep_last=3, on S3
    last = ckpt.load_checkpoint(final.result["checkpoint"])
    assert last.state["policy_version"] == steps
    model, _, info = load_policy(final.result["checkpoint"])
    assert info["base_model"] == "tiny-random" and not model.training


# --- preflight: bad storage fails in one line, before any training --------------------------------


def test_unreachable_endpoint_missing_bucket_or_credentials_fail_in_one_line(s3_server, s3_url, monkeypatch, tmp_path):
    from opentinker.rl import RLJob
    from tests.stack_fixtures import free_ports

    check_storage(s3_url)  # the good case passes and leaves no probe behind
    assert s3_server.objects(s3_url) == {}
    missing = f"s3://no-such-bucket/{tmp_path.name}"
    with pytest.raises(StorageError, match=f"^storage.base_url {missing}: bucket or folder does not exist") as err:
        RLJob(_on(missing, tmp_path))  # fails before the model loads
    assert "\n" not in str(err.value)

    with monkeypatch.context() as m:
        (port,) = free_ports(1)
        m.setenv("AWS_ENDPOINT_URL_S3", f"http://127.0.0.1:{port}")
        with pytest.raises(StorageError, match=f"^storage.base_url {s3_url}: storage endpoint not reachable .*127.0.0.1:{port}"):
            check_storage(s3_url)

    with monkeypatch.context() as m:
        for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
            m.delenv(key, raising=False)
        m.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
        m.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
        m.setenv("AWS_EC2_METADATA_DISABLED", "true")
        with pytest.raises(StorageError, match=f"^checkpoint.base_url {s3_url}: no S3 credentials: set AWS_ACCESS_KEY_ID"):
            check_storage(s3_url, "checkpoint.base_url")


def test_flow_with_a_missing_bucket_fails_before_training(stack_env, s3_url, tmp_path):
    from flows.rl_train import rl_train

    settings, _ = stack_env
    missing = "s3://no-such-bucket/jobs"
    with pytest.raises(StorageError, match=f"storage.base_url {missing}: bucket or folder does not exist"):
        rl_train(_on(missing, tmp_path), job_id="s3-no-bucket")
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=settings.mlflow_url)
    exp = client.get_experiment_by_name(settings.project)
    runs = client.search_runs([exp.experiment_id], filter_string="tags.`opentinker.job_id` = 's3-no-bucket'") if exp else []
    assert runs == []  # no MLflow run: it failed before the job started


# --- corrupt checkpoints fail clearly and change nothing -----------------------------------------


def test_corrupt_checkpoint_on_s3_fails_clearly_and_resume_goes_on_from_the_intact_one(s3_server, s3_url, tmp_path, tiny_path):
    from opentinker.model.policy import load_policy
    from opentinker.rl import RLJob

    spec = _on(s3_url, tmp_path, optimization={"steps": 2}, checkpoint={"every": 1})
    RLJob(spec, job_id="corrupt").run()
    step2 = f"{s3_url}/corrupt/step-00000002"
    bucket, prefix = step2.removeprefix("s3://").split("/", 1)
    client = s3_server.client()
    size = len(client.get_object(Bucket=bucket, Key=f"{prefix}/weights.safetensors")["Body"].read())
    client.put_object(Bucket=bucket, Key=f"{prefix}/weights.safetensors", Body=b"\xff" * size)  # same size, garbage
    before = s3_server.objects(s3_url)

    match = f"{step2} is not a complete checkpoint: weights.safetensors differs from the sha256 in COMMIT.json"
    with pytest.raises(FileNotFoundError, match=match):
        ckpt.load_checkpoint(step2)
    with pytest.raises(FileNotFoundError, match=match):
        load_policy(step2)
    assert s3_server.objects(s3_url) == before
    # resume refuses it rather than training on garbage, says so, and goes on from the intact step 1
    result = RLJob(_on(s3_url, tmp_path, optimization={"steps": 3}, checkpoint={"every": 1}), job_id="corrupt").run()
    assert result.resumed_from == 1 and result.steps_done == 3
    assert len(result.skipped) == 1 and result.skipped[0].startswith(match)
    assert ckpt.load_checkpoint(step2).step == 2  # redone


def test_checkpoint_without_policy_or_spec_fails_clearly_and_changes_nothing(s3_server, s3_url, tmp_path, tiny_path):
    """The weights alone do not say which base model they belong to: loading names the URL and stops."""
    from opentinker.model.policy import load_policy
    from opentinker.rl import RLJob

    RLJob(_on(s3_url, tmp_path, optimization={"steps": 1}), job_id="bare").run()
    step1 = f"{s3_url}/bare/step-00000001"
    bucket, prefix = step1.removeprefix("s3://").split("/", 1)
    client = s3_server.client()
    manifest = json.loads(client.get_object(Bucket=bucket, Key=f"{prefix}/COMMIT.json")["Body"].read())
    for name in ("policy.json", "spec.yaml"):  # as if an older writer had never written them
        client.delete_object(Bucket=bucket, Key=f"{prefix}/{name}")
        del manifest["files"][name], manifest["sha256"][name]
    for name in ("signature", "job", "tenant"):  # nor signed its checkpoints (loading by URL still accepts those)
        del manifest[name]
    client.put_object(Bucket=bucket, Key=f"{prefix}/COMMIT.json", Body=json.dumps(manifest).encode())
    before = s3_server.objects(s3_url)
    with pytest.raises((ValueError, FileNotFoundError), match=f"{step1}.*policy.json"):
        load_policy(step1)
    assert s3_server.objects(s3_url) == before


# --- MLflow artifacts on S3 -----------------------------------------------------------------------


def test_settings_keep_local_artifacts_unless_storage_is_remote(tmp_path):
    from opentinker.core.settings import Settings

    assert Settings(state_dir=tmp_path).mlflow_artifacts_destination == str(tmp_path / "mlflow" / "artifacts")
    assert Settings(state_dir=tmp_path, storage_url="s3://b/p").mlflow_artifacts_destination == "s3://b/p/mlflow"
    assert Settings(state_dir=tmp_path, storage_url="s3://b/p", artifacts_url="s3://c/a/").mlflow_artifacts_destination == "s3://c/a"


def test_stack_refuses_to_start_with_an_unusable_artifact_bucket(s3_url, tmp_path):
    from opentinker.control.stack import Stack, StackError
    from tests.stack_fixtures import local_settings

    settings = local_settings(tmp_path / "state", storage_url="s3://no-such-bucket/stack")
    with pytest.raises(StackError, match="OPENTINKER_STORAGE_URL s3://no-such-bucket/stack: bucket or folder does not exist"):
        Stack(settings).up(timeout=30)
    assert not any(s.running for s in Stack(settings).status().values())  # nothing was started


def test_mlflow_server_stores_artifacts_in_s3(s3_server, s3_url, tmp_path):
    """The stack's own MLflow command with storage_url on S3: an artifact logged through the server
    (clients need no S3 access) lands in the bucket under <storage_url>/mlflow/."""
    from mlflow.tracking import MlflowClient

    from opentinker.control.stack import Stack
    from tests.stack_fixtures import local_settings

    settings = local_settings(tmp_path / "state", storage_url=s3_url)
    services = Stack(settings)
    try:
        assert services.start("mlflow", timeout=90).healthy
        client = MlflowClient(tracking_uri=settings.mlflow_url)
        run = client.create_run(client.create_experiment("s3-artifacts"))
        (tmp_path / "step-000001.json").write_text('[{"reward": 1.0}]')
        client.log_artifact(run.info.run_id, str(tmp_path / "step-000001.json"), "transcripts")
        assert [a.path for a in client.list_artifacts(run.info.run_id, "transcripts")] == ["transcripts/step-000001.json"]
    finally:
        services.down()
    keys = [k for k in s3_server.objects(f"{s3_url}/mlflow") if k.endswith("/transcripts/step-000001.json")]
    assert len(keys) == 1 and run.info.run_id in keys[0]
    bucket = s3_url.removeprefix("s3://").split("/", 1)[0]
    assert s3_server.client().get_object(Bucket=bucket, Key=keys[0])["Body"].read() == b'[{"reward": 1.0}]'
    assert not (tmp_path / "state" / "mlflow" / "artifacts" / "1").exists()


def test_tinker_checkpoints_live_on_s3_through_the_sdk(s3_server, s3_url, tmp_path, monkeypatch):
    """The Tinker door with tenants' storage on S3: save_state, a sampler checkpoint, the REST
    listing, a resumed client whose next step equals the uninterrupted one's, sampling from the
    saved sampler path, delete (a run emptied after its session ended leaves S3); every object under
    the tenant's own prefix."""
    import numpy as np

    tinker = pytest.importorskip("tinker")
    from tinker import types

    from opentinker.control.gateway.tinker_local import local_gateway

    monkeypatch.setenv("TINKER_TELEMETRY", "0")
    url, keys, sessions, server = local_gateway(tmp_path, storage_url=s3_url)
    service = tinker.ServiceClient(base_url=url, api_key=keys["alice"])
    try:
        trainer = service.create_lora_training_client(base_model="tiny-random", rank=4, seed=0).result()
        tokens = [(7 * i) % 3000 + 100 for i in range(12)]
        data = [types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                            loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * 11})]
        adam = types.AdamParams(learning_rate=5e-3)
        trainer.forward_backward(data, "cross_entropy").result()
        trainer.optim_step(adam).result()
        state = trainer.save_state("on-s3").result().path
        sampler_path = trainer.save_weights_for_sampler("sampler-on-s3").result().path
        rest = tinker.RestClient(base_url=url, api_key=keys["alice"])
        listed = [c.tinker_path for c in rest.list_checkpoints(trainer.model_id).result().checkpoints]
        assert state in listed and sampler_path in listed

        resumed = service.create_training_client_from_state_with_optimizer(state).result()
        for client in (trainer, resumed):
            client.forward_backward(data, "cross_entropy").result()
            client.optim_step(adam).result()
        a, b = (np.asarray(c.forward(data, "cross_entropy").result().loss_fn_outputs[0]["logprobs"].tolist()) for c in (trainer, resumed))
        np.testing.assert_allclose(b, a, atol=1e-5)

        sampled = service.create_sampling_client(model_path=sampler_path).sample(
            types.ModelInput.from_ints(tokens[:4]), 2, types.SamplingParams(max_tokens=4, seed=1, stop=[])).result()
        assert [len(s.tokens) for s in sampled.sequences] == [4, 4]

        keys_on_s3 = [o["Key"] for o in s3_server.client().list_objects_v2(Bucket=s3_server.bucket, Prefix=s3_url.split("/", 3)[3])["Contents"]]
        prefix = s3_url.split("/", 3)[3] + "/tenants/alice/tinker/"
        assert keys_on_s3 and all(k.startswith(prefix) for k in keys_on_s3), keys_on_s3[:3]
        assert any(k.endswith("/weights/on-s3/COMMIT.json") for k in keys_on_s3)
        rest.delete_checkpoint_from_tinker_path(state).result()
        assert state not in [c.tinker_path for c in rest.list_checkpoints(trainer.model_id).result().checkpoints]
        service.close("success").result()  # the session ends: its run, once empty, goes, run.json and all
        rest.delete_checkpoint_from_tinker_path(sampler_path).result()
        assert trainer.model_id not in [r.training_run_id for r in rest.list_training_runs().result().training_runs]
        assert not [k for k in s3_server.objects(s3_url) if f"/tinker/{trainer.model_id}/" in k]
    finally:
        service.close("success")
        server.stop()
        sessions.close()
