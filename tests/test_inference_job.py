"""Inference jobs end to end on a real stack: the reference design's inference workflow as written.

An RL job trains on the stack's worker; its checkpoint is then served by an inference job (a
`serve-model` flow run on the cpu pool, holding a slot while it serves); `run_inference` with the
same game class replays the job's validation problems greedily against it and must reproduce the
job's own final evaluation; cancelling the job stops the server and frees the slot.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import time
from pathlib import Path

import httpx
import pytest

from tests.conftest import tiny_spec

N_VAL = 32


@pytest.fixture(scope="module")
def service(stack_env):
    from opentinker.control.gateway.tenants import TenantStore
    from opentinker.control.submit import deploy

    settings, _ = stack_env
    deploy(settings)
    yield settings, TenantStore(settings.state_dir / "tenants.json").create("inferco", rotate=True)


@pytest.fixture(autouse=True)
def no_server_left(service):
    """A failed test's inference job would keep serving and hold its slot for the tests after it."""
    from opentinker.client import SchedulerClient

    yield
    settings, key = service
    client = SchedulerClient(url=settings.gateway_url, api_key=key)
    for job in client.list_jobs():
        if job["state"] not in ("COMPLETED", "FAILED", "CANCELLED"):
            with contextlib.suppress(Exception):
                client.cancel_job(job["job_id"])


def _slots() -> int:
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        return client.read_global_concurrency_limit_by_name("slots-cpu").active_slots


def _slots_drop_to(at_most: int, timeout: float = 120) -> bool:
    """Wait until at most `at_most` slots are held (a killed run's lease may take a minute to expire)."""
    start = time.monotonic()
    while _slots() > at_most and time.monotonic() < start + timeout:
        time.sleep(1)
    return _slots() <= at_most


@pytest.fixture(scope="module")
def trained_job(service, tmp_path_factory):
    """An RL job trained through the gateway: (spec dict, final status)."""
    from envs.toy import UppercaseGame
    from opentinker.client import SchedulerClient, ServiceClient
    from opentinker.env import GameEnvironment

    settings, key = service
    tmp = tmp_path_factory.mktemp("rl-for-inference")
    args = tiny_spec(tmp, optimization={"steps": 2, "lr": 0.03}, evaluation={"every": 0, "n_samples": N_VAL},
                     checkpoint={"every": 2}, env={"game": "envs.toy:UppercaseGame", "config": {"val_size": N_VAL}}).model_dump(mode="json")
    job = SchedulerClient(url=settings.gateway_url, api_key=key).submit_job(config=args, num_gpus=0)
    env = GameEnvironment(game_class=UppercaseGame, config=args, job_id=job["job_id"])
    final = ServiceClient(server_url=job["server_url"], api_key=key).fit(env=env, num_steps=2, poll=1.0, progress=False)
    assert final["state"] == "COMPLETED" and final["checkpoint"]
    return args, final, env


def test_reference_inference_workflow_reproduces_the_jobs_evaluation(service, trained_job, tmp_path, s3_url):
    from mlflow.tracking import MlflowClient
    from openai import OpenAI

    from envs.toy import UppercaseGame
    from opentinker import run_inference
    from opentinker.client import InferenceSchedulerClient
    from opentinker.env.environment import save_dataset

    settings, key = service
    args, final, env = trained_job
    save_dataset(env.validation_tasks(N_VAL), tmp_path / "val.jsonl")
    job_accuracy = final["metrics"]["eval/accuracy"]

    before = _slots()
    # 1. Submit Inference Job (the reference design's code, with our key and a job id as model path)
    scheduler = InferenceSchedulerClient(url=settings.gateway_url, api_key=key)
    job_result = scheduler.submit_inference_job(model_path=final["job_id"], num_gpus=0)
    job_id, vllm_server_url = job_result["job_id"], job_result["vllm_server_url"]
    assert job_id.startswith("inferco-inf-") and job_result["state"] == "RUNNING"
    assert job_result["model_path"] == final["checkpoint"]  # the job folder resolved to its latest step
    assert _slots() == before + 1  # held while it serves

    # The OpenAI Python client talks to it unchanged, with the job's token as its key; without it, 401.
    assert httpx.get(f"{vllm_server_url}/v1/models", timeout=10).status_code == 401
    client = OpenAI(base_url=job_result["openai_base_url"], api_key=job_result["api_key"])
    assert [m.id for m in client.models.list()] == [job_id]
    reply = client.chat.completions.create(model=job_id, messages=[{"role": "user", "content": "Say something."}], max_tokens=4, temperature=0)
    assert reply.choices[0].message.content is not None

    # 2. Run Inference via Pipeline: outputs to S3, metrics to the stack's MLflow.
    output_path = f"{s3_url}/inference"
    summary = run_inference(vllm_server_url=vllm_server_url, data_path=str(tmp_path / "val.jsonl"),
                            game_class=UppercaseGame, job_id=job_id, output_path=output_path, config=args)
    print(f"job {final['job_id']} eval accuracy {job_accuracy:.4f}; run_inference accuracy {summary['accuracy']:.4f}")
    assert summary["accuracy"] == pytest.approx(job_accuracy, abs=1.5 / N_VAL)  # greedy: equal up to a near-tie
    assert summary["episodes"] == N_VAL and summary["metrics"]["inference/failed_episodes"] == 0

    import fsspec

    with fsspec.open(f"{output_path}/transcripts.jsonl", "rt") as f:
        assert len([json.loads(line) for line in f]) == N_VAL
    with fsspec.open(f"{output_path}/summary.json", "rt") as f:
        assert json.load(f)["accuracy"] == summary["accuracy"]
    ml = MlflowClient(tracking_uri=settings.mlflow_url)
    experiment = ml.get_experiment_by_name(f"inference/{job_id}")
    run = ml.get_run(summary["mlflow_run_id"])
    assert run.info.experiment_id == experiment.experiment_id and run.info.status == "FINISHED"
    assert run.data.metrics["inference/accuracy"] == summary["accuracy"]
    assert {a.path for a in ml.list_artifacts(run.info.run_id)} >= {"transcripts.jsonl", "summary.json", "transcripts.html"}

    # Cancelling stops the server and frees the slot.
    assert scheduler.cancel_job(job_id)["state"] in ("RUNNING", "CANCELLED")
    assert scheduler.wait(job_id, timeout=120, poll=1)["state"] == "CANCELLED"
    assert scheduler.job_status(job_id)["vllm_server_url"] is None
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"{vllm_server_url}/health", timeout=5)
    assert _slots_drop_to(before)


def test_bad_inference_requests_fail_clearly(service, trained_job, tmp_path):
    from opentinker.client import InferenceSchedulerClient, InvalidJob, JobFailed

    settings, key = service
    _, final, _ = trained_job
    scheduler = InferenceSchedulerClient(url=settings.gateway_url, api_key=key)
    with pytest.raises(InvalidJob, match=r"model_path: no-such-job: FileNotFoundError"):
        scheduler.submit_inference_job(model_path="no-such-job")
    with pytest.raises(InvalidJob, match=r"outside your storage"):
        scheduler.submit_inference_job(model_path=f"file://{tmp_path}")
    with pytest.raises(InvalidJob, match=r"models:/no-such-model@champion"):
        scheduler.submit_inference_job(model_path="models:/no-such-model@champion")
    with pytest.raises(InvalidJob, match=r"pool 'gpu' has 0 slot"):
        scheduler.submit_inference_job(model_path=final["job_id"], num_gpus=1)

    # A checkpoint that looks complete but holds garbage: the job fails with the loader's reason.
    before = _slots()
    source = final["checkpoint"].removeprefix("file://")
    corrupt_job = f"{final['job_id']}-corrupt"
    target = f"{source.rsplit('/', 2)[0]}/{corrupt_job}/{source.rsplit('/', 1)[1]}"
    shutil.copytree(source, target)
    weights = Path(target) / "weights.safetensors"
    weights.write_bytes(b"\x00" * weights.stat().st_size)  # same size: the commit manifest still matches
    with pytest.raises(JobFailed, match=r"cannot serve .*-corrupt/step-\d+: .*Error"):
        scheduler.submit_inference_job(model_path=corrupt_job, timeout=300)
    assert _slots_drop_to(before)


def test_serve_flow_publishes_its_endpoint_and_stops_after_its_ttl(stack_env, trained_job):
    """The flow called directly (no deployment: no slot): it serves, publishes, and ends at ttl_s."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    from flows.inference import serve_model
    from opentinker.inference.spec import InferenceSpec, endpoint_key

    _, final, _ = trained_job
    result = serve_model(InferenceSpec(model_path=final["checkpoint"], ttl_s=2), job_id="direct-ttl")
    assert result["checkpoint"] == final["checkpoint"] and result["seconds"] >= 2
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"{result['url']}/health", timeout=5)
    with get_client(sync_client=True) as client:
        found = client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[endpoint_key("direct-ttl")])))
    assert found and found[-1].metadata_["url"] == result["url"] and found[-1].metadata_["model"] == "direct-ttl"
