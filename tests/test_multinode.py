"""More than one machine, on one: host A (this network namespace: the stack, its Ray head, an S3
server) and host B (a network namespace of its own, tests/hosts.py) joined by
`opentinker worker --pool gpu --join <head>`, a Ray node with two declared GPUs and a resource of
its own (`node_b`) plus a Prefect worker for the `gpu` pool, all real processes that reach each
other only over the veth pair between the hosts.

A sharded job's ranks run on both hosts (gloo between them over the pair) and checkpoint to S3;
host B's link taken down mid-job fails it in one line naming the rank and its host, frees its
slot, and once B is back the same job id resumes. A job that needs the second node's resource runs its actors there (checked by the node id of the
process hosting them), checkpoints to S3, and when that node's processes are killed mid-job it
fails in one line; the node joins again by itself, and resubmitting the job id resumes from the last
complete checkpoint with each step in MLflow once. Bad input: a worker that cannot reach the head,
a remote worker with local storage, a job no node can place.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest

from opentinker.control.stack import Stack
from opentinker.core.settings import Settings, mlflow_env, prefect_env, settings_env
from opentinker.core.spec import ResourcesSpec
from opentinker.storage import checkpoint as ckpt
from tests.conftest import tiny_spec
from tests.hosts import Hosts, second_host
from tests.s3_fixtures import moto_server
from tests.stack_fixtures import free_ports, local_settings

ROOT = Path(__file__).resolve().parents[1]
# Pinning actors by a custom resource needs `resources.ray_resources` in the spec; until then the
# head offers one CPU (a rank of the sharded job's) and node B two, so a 2-CPU actor can only go to node B.
PINNED = "ray_resources" in ResourcesSpec.model_fields
NODE_B = {"ray_resources": {"node_b": 1}} if PINNED else {"num_cpus": 2}


@dataclass
class Cluster:
    settings: Settings
    node_state: Path
    log: Path
    worker: subprocess.Popen
    hosts: Hosts

    def node_pid(self) -> int:
        return int((self.node_state / "pids" / "ray-node-gpu.pid").read_text())

    def node_processes(self) -> list[psutil.Process]:
        root = psutil.Process(self.node_pid())
        return [root, *root.children(recursive=True)]


def _cli(*args: str, env: dict[str, str], timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "opentinker.cli", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)


def _machine_b_env(settings: Settings, state: Path) -> dict[str, str]:
    """Another machine's environment: the stack's address, ports, secret and storage, its own state folder."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OPENTINKER_", "PREFECT_", "MLFLOW_TRACKING", "RAY_"))}
    return env | {k: v for k, v in settings_env(settings).items() if k != "OPENTINKER_STATE_DIR"} | {
        "OPENTINKER_STATE_DIR": str(state), "OPENTINKER_SECRET": settings.stack_secret()}


def _wait_for_line(path: Path, text: str, count: int = 1, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while path.read_text(errors="replace").count(text) < count:
        assert time.monotonic() < deadline, f"{text!r} not in {path} after {timeout}s:\n{path.read_text()[-3000:]}"
        time.sleep(0.5)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    import s3fs
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from opentinker.control.submit import deploy

    base = tmp_path_factory.mktemp("multinode")
    saved = dict(os.environ)
    with second_host() as hosts, moto_server(hosts.a) as s3:
        settings = local_settings(base / "control", host=hosts.a, cpu_slots=1, gpu_slots=None, ray_num_cpus=1, ray_node_timeout_s=15,
                                  storage_url=f"s3://{s3.bucket}/multinode-{uuid.uuid4().hex[:8]}", game_allowlist="envs")
        stack = Stack(settings)
        os.environ.update(s3.env | settings_env(settings) | prefect_env(settings) | mlflow_env(settings))
        s3fs.S3FileSystem.clear_instance_cache()  # a cached client would still dial the session's loopback server
        log = base / "machine-b.log"
        worker = None
        try:
            stack.up(timeout=180)
            with temporary_settings({PREFECT_API_URL: settings.prefect_api_url}):
                deploy(settings)
                with open(log, "wb") as out:
                    worker = subprocess.Popen(hosts.on_b(
                        [sys.executable, "-m", "opentinker.cli", "worker", "--pool", "gpu", "--join", settings.ray_head_address,
                         "--num-gpus", "2", "--num-cpus", "2", "--resources", json.dumps({"node_b": 1}), "--name", "machine-b"]),
                        cwd=ROOT, env=_machine_b_env(settings, base / "machine-b"), stdout=out, stderr=subprocess.STDOUT,
                        start_new_session=True)
                cluster = Cluster(settings, base / "machine-b", log, worker, hosts)
                _wait_for_line(log, "ray node joined")
                _wait_for_worker(settings, "gpu", "machine-b")
                yield cluster
        finally:
            hosts.set_link(True)
            if worker is not None:
                worker.send_signal(signal.SIGTERM)
                try:
                    worker.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    os.killpg(worker.pid, signal.SIGKILL)
            stack.down()
            os.environ.clear()
            os.environ.update(saved)
            s3fs.S3FileSystem.clear_instance_cache()


def _gpu_workers(settings: Settings) -> dict[str, str]:
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from opentinker.control.scheduler import prefect_client

    with temporary_settings({PREFECT_API_URL: settings.prefect_api_url}), prefect_client() as client:
        return {w.name: w.status.value for w in client.read_workers_for_work_pool("gpu")}


def _wait_for_worker(settings: Settings, pool: str, name: str, timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    while _gpu_workers(settings).get(name) != "ONLINE":
        assert time.monotonic() < deadline, f"worker {name} of pool {pool} not online after {timeout}s"
        time.sleep(0.5)


def _as_driver(settings: Settings, ask):
    """`ask(ray)` as a driver of the cluster with the stack's token."""
    import ray

    from opentinker.core.settings import ray_env
    from opentinker.orchestration.task_runner import authenticate

    authenticate(ray_env(settings))
    ray.init(address=settings.ray_head_address, logging_level="ERROR", log_to_driver=False)
    try:
        return ask(ray)
    finally:
        ray.shutdown()


def _nodes(settings: Settings) -> list[dict]:
    return _as_driver(settings, lambda ray: [n for n in ray.nodes() if n["Alive"]])


def _actor_node(cluster: Cluster) -> str | None:
    """The node id of machine B's raylet if it hosts the job's actor (a `ray::RLJob` process)."""
    procs = cluster.node_processes()
    if not any(p.name().startswith("ray::RLJob") or " ".join(p.cmdline()).startswith("ray::RLJob") for p in procs):
        return None
    (raylet,) = [p for p in procs if p.name() == "raylet"]
    return re.search(r"--node_id=(\w+)", " ".join(raylet.cmdline())).group(1)


def _mlflow_steps(settings: Settings, job_id: str, key: str) -> list[int]:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=settings.mlflow_url)
    exp = client.get_experiment_by_name(settings.project)
    (run,) = client.search_runs([exp.experiment_id], filter_string=f"tags.`opentinker.job_id` = '{job_id}'")
    return sorted(m.step for m in client.get_metric_history(run.info.run_id, key))


def _end(run_id: str, settings: Settings, timeout: float = 300):
    """(state, reason) once the flow run ends."""
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from opentinker.control.scheduler import job_state, prefect_client

    deadline = time.monotonic() + timeout
    with temporary_settings({PREFECT_API_URL: settings.prefect_api_url}):
        while True:
            with prefect_client() as client:
                state, reason = job_state(client.read_flow_run(run_id))
            if state in ("COMPLETED", "FAILED", "CANCELLED"):
                return state, reason
            assert time.monotonic() < deadline, f"run {run_id} still {state} after {timeout}s"
            time.sleep(0.5)


def _submit(spec, job_id: str, settings: Settings) -> str:
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from opentinker.control.submit import submit_job

    with temporary_settings({PREFECT_API_URL: settings.prefect_api_url}):
        return submit_job(spec.model_dump(mode="json"), job_id, settings)


def test_a_joined_machine_is_a_ray_node_and_a_worker_of_its_pool(cluster):
    nodes = _nodes(cluster.settings)
    assert len(nodes) == 2
    (b,) = [n for n in nodes if n["Resources"].get("node_b")]
    assert b["Resources"]["GPU"] == 2 and b["Resources"]["CPU"] == 2 and not b["Resources"].get("node:__internal_head__")
    assert _gpu_workers(cluster.settings) == {"machine-b": "ONLINE"}
    # The control plane's machine has no GPU (gpu_slots unset): the GPU pool's slots are the devices
    # the joined node counted, and a 2-GPU job fits where a 3-GPU one is refused.
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from opentinker.control.scheduler import SchedulingError, check_fits, live_capacity

    with temporary_settings({PREFECT_API_URL: cluster.settings.prefect_api_url}):
        assert live_capacity(cluster.settings, "gpu") == 2
        assert check_fits(cluster.settings, 2) == "gpu"
        with pytest.raises(SchedulingError, match="pool 'gpu' has 2 slot"):
            check_fits(cluster.settings, 3)
    assert "gpu pool: 2 slot(s)" in cluster.log.read_text()
    # Machine B dials the stack for Prefect and MLflow, joins the head for Ray, and binds its own servers on its address.
    assert b["NodeManagerAddress"] == cluster.hosts.b
    env = psutil.Process(cluster.worker.pid).children()[-1].environ()
    assert env["OPENTINKER_RAY_ADDRESS"] == cluster.settings.ray_head_address == f"{cluster.hosts.a}:{cluster.settings.ray_port}"
    assert env["PREFECT_API_URL"] == cluster.settings.prefect_api_url and env["OPENTINKER_BIND_HOST"] == cluster.hosts.b


STEPS = 5  # killed within a poll (0.2 s) of step 2's checkpoint; tiny steps take about a second: room to kill mid-run


def _start_until_step_2(cluster: Cluster, tmp_path: Path, name: str):
    """Submit a job pinned to machine B's node and wait for its second S3 checkpoint."""
    job_id, base_url = f"{name}-{uuid.uuid4().hex[:6]}", f"{cluster.settings.storage_url}/jobs"
    spec = tiny_spec(tmp_path, optimization={"steps": STEPS}, evaluation={"every": 4, "n_samples": 8},  # at 0, 4 and the end
                     checkpoint={"every": 1, "base_url": base_url}, resources={"num_cpus": 1, **NODE_B})
    run_id = _submit(spec, job_id, cluster.settings)
    _wait_for_checkpoint(run_id, cluster.settings, base_url, job_id, step=2)
    return job_id, spec, run_id, base_url


def _wait_for_checkpoint(run_id: str, settings: Settings, base_url: str, job_id: str, step: int, timeout: float = 300) -> None:
    """Until the job's checkpoint of `step` is complete in S3; the run's reason if it ends first."""
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from opentinker.control.scheduler import job_state, prefect_client

    deadline = time.monotonic() + timeout
    while (latest := ckpt.latest_checkpoint(base_url, job_id)) is None or latest.step < step:
        with temporary_settings({PREFECT_API_URL: settings.prefect_api_url}), prefect_client() as client:
            state, reason = job_state(client.read_flow_run(run_id))
        assert state not in ("COMPLETED", "FAILED", "CANCELLED"), f"the job ended ({state}) before step {step}'s checkpoint: {reason}"
        assert time.monotonic() < deadline, f"no S3 checkpoint of step {step} within {timeout:g} s"
        time.sleep(0.2)


def _assert_failed_resumably(run_id: str, settings: Settings, job_id: str, base_url: str, driver_may_die: bool = False) -> None:
    """The job failed in one line that says to resubmit it. Its actors' errors reach the flow
    (`lost_cluster_line`); or, when the head dies, a flow attached to the head's own raylet dies
    with it (a Ray driver cannot outlive its node) and the run reads as crashed (`crash_line`)."""
    killed_at = ckpt.latest_checkpoint(base_url, job_id).step
    assert killed_at < STEPS, "the job ended before it could be killed"
    state, reason = _end(run_id, settings)
    assert state == "FAILED" and "\n" not in reason, reason
    lost = (rf"job {job_id}: \w+Error: (the Ray node running (its actors|the job's \w+ actor( \([0-9.]+\))?) left the cluster \(killed, or the head "
            rf"went away\)|(an actor of the job|the job's \w+ actor) became unreachable \(its process, its Ray node or the network to "
            rf"it went away\)); resubmit job {job_id} to resume from step \d+ \(s3://\S+\)")
    crashed = (r"the job's process died \(Process exited with status code: 1\. Process exited with a general error\): killed, "
               rf"out of memory, or its Ray node or head went away; resubmit job {job_id} to resume from its last complete checkpoint")
    assert re.fullmatch(f"{lost}|{crashed}" if driver_may_die else lost, reason), reason


def _complete_once(spec, job_id: str, settings: Settings, base_url: str) -> None:
    """Resubmit the job id: it completes, and MLflow holds each step once (a restart from scratch, or
    a resume from a later step than the last complete checkpoint, would not)."""
    state, reason = _end(_submit(spec, job_id, settings), settings)
    assert state == "COMPLETED", reason
    assert _mlflow_steps(settings, job_id, "rollout/reward_mean") == list(range(1, STEPS + 1))
    assert _mlflow_steps(settings, job_id, "eval/accuracy") == [0, 4, STEPS]
    assert ckpt.load_checkpoint(ckpt.latest_checkpoint(base_url, job_id).url).state["policy_version"] == STEPS


@pytest.mark.slow  # 47 s; the default run's head-death test places a job on node B the same way, fails it and resumes it
def test_job_runs_on_the_node_with_its_resource_and_resumes_after_that_node_is_killed(cluster, tmp_path):
    settings = cluster.settings
    (b,) = [n for n in _nodes(settings) if n["Resources"].get("node_b")]  # asked first: nothing between step 2 and the kill
    job_id, spec, run_id, base_url = _start_until_step_2(cluster, tmp_path, "node-b")
    assert _actor_node(cluster) == b["NodeID"]  # the job's actor lives in machine B's node
    for proc in cluster.node_processes():  # machine B's Ray: the node and everything it runs
        proc.kill()
    _assert_failed_resumably(run_id, settings, job_id, base_url)

    _wait_for_line(cluster.log, "again (pid", timeout=180)  # the worker joined again on its own
    _complete_once(spec, job_id, settings, base_url)


def test_a_job_no_node_can_place_fails_in_one_line(cluster, tmp_path):
    wants = {"ray_resources": {"node_c": 1}} if PINNED else {"num_cpus": 4}
    spec = tiny_spec(tmp_path, optimization={"steps": 1}, resources=wants,
                     checkpoint={"base_url": f"{cluster.settings.storage_url}/jobs"})
    state, reason = _end(_submit(spec, f"nowhere-{uuid.uuid4().hex[:6]}", cluster.settings), cluster.settings)
    assert state == "FAILED"
    assert re.search(r"resources\.(ray_resources|num_cpus).*the Ray cluster has", reason), reason


def test_a_worker_that_cannot_reach_the_head_or_keeps_local_storage_refuses_in_one_line(tmp_path):
    (port,) = free_ports(1)
    env = {k: v for k, v in os.environ.items() if not k.startswith("OPENTINKER_")} | {
        "OPENTINKER_STATE_DIR": str(tmp_path), "OPENTINKER_SECRET": "x"}
    out = _cli("worker", "--pool", "gpu", "--join", f"127.0.0.1:{port}", env=env)
    assert out.returncode == 2 and "Traceback" not in out.stdout + out.stderr
    assert out.stdout.startswith(f"worker: OPENTINKER_STORAGE_URL is file://{tmp_path}/storage: a worker on another machine")
    out = _cli("worker", "--pool", "gpu", "--join", f"127.0.0.1:{port}", env=env | {"OPENTINKER_STORAGE_URL": "s3://b/jobs"})
    assert out.returncode == 1 and "Traceback" not in out.stdout + out.stderr
    assert out.stdout.strip() == f"worker: Ray cluster at 127.0.0.1:{port} is not reachable: [Errno 111] Connection refused"
    assert not (tmp_path / "pids").exists()  # nothing was started


@pytest.mark.slow  # a head killed mid-job and restarted (three minutes); joining and placing stay in the default run
def test_a_head_that_dies_mid_job_fails_it_in_one_line_and_it_resumes_on_the_restarted_head(cluster, tmp_path):
    """The stack's head killed mid-job: the job fails in one line; `opentinker up` (Stack.up) starts
    a new head, machine B joins it by itself, and the resubmitted job resumes."""
    settings = cluster.settings
    (b,) = [n for n in _nodes(settings) if n["Resources"].get("node_b")]  # asked first: nothing between step 2 and the kill
    job_id, spec, run_id, base_url = _start_until_step_2(cluster, tmp_path, "head")
    assert _actor_node(cluster) == b["NodeID"]  # the job's actor lives in machine B's node, which has its resource
    rejoins = cluster.log.read_text().count("again (pid")
    head = psutil.Process(Stack(settings).pid("ray"))
    for proc in [head, *head.children(recursive=True)]:
        proc.kill()
    _assert_failed_resumably(run_id, settings, job_id, base_url, driver_may_die=True)

    assert Stack(settings).up(timeout=120)["ray"].healthy
    _wait_for_line(cluster.log, "again (pid", count=rejoins + 1, timeout=240)
    _complete_once(spec, job_id, settings, base_url)


def _held_slots(settings: Settings) -> dict[str, int]:
    """Active slots of each pool's limit (the scheduler's leases)."""
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from opentinker.control.scheduler import POOLS, prefect_client, slot_limit

    with temporary_settings({PREFECT_API_URL: settings.prefect_api_url}), prefect_client() as client:
        return {pool: client.read_global_concurrency_limit_by_name(slot_limit(pool)).active_slots for pool in POOLS}


def _live_placement_groups(settings: Settings) -> list[str]:
    return _as_driver(settings, lambda ray: [g for g, row in ray.util.placement_group_table().items() if row["state"] != "REMOVED"])


def _ranks() -> list[psutil.Process]:
    return [p for p in psutil.process_iter(["cmdline"]) if (p.info["cmdline"] or [""])[0].startswith("ray::Rank")]


def _host_of(proc: psutil.Process) -> int:
    """The network namespace (its inode: a host) a process lives in."""
    return os.stat(f"/proc/{proc.pid}/ns/net").st_ino


def test_a_sharded_job_spans_both_hosts_and_a_killed_rank_or_a_lost_host_fails_it_in_one_line_and_it_resumes(cluster, tmp_path):
    """resources.trainer_ranks 2, spread: one rank on each host, one gloo group (FSDP2) over the
    veth pair, checkpoints in the S3 server on host A.
    - SIGKILL to the rank on host B: the job fails in one line naming that rank, host B's address
      and where a resubmission resumes; no rank is left.
    - The same job id resumes from that checkpoint (whole weights and optimizer state, rank 0's),
      trains the whole batch on the resumed policy and checkpoints again.
    - Host B's link taken down mid-job: the job fails in one line naming what it lost on host B as
      soon as the head gives B's node up (ray_node_timeout_s, before the ranks' collective timeout),
      and holds no slot and no placement group."""
    settings, hosts = cluster.settings, cluster.hosts
    job_id, base_url = f"spread-{uuid.uuid4().hex[:6]}", f"{settings.storage_url}/jobs"
    spec = tiny_spec(tmp_path, optimization={"steps": STEPS}, evaluation={"every": 0, "n_samples": 8},
                     checkpoint={"every": 1, "base_url": base_url}, resources={"num_cpus": 1, "trainer_ranks": 2, "trainer_placement": "spread"})
    b = re.escape(hosts.b)
    resume = rf"; resubmit job {job_id} to resume from step \d \(s3://\S+\)"
    here, there = os.stat("/proc/self/ns/net").st_ino, os.stat(f"/proc/{cluster.node_pid()}/ns/net").st_ino

    run_id = _submit(spec, job_id, settings)
    _wait_for_checkpoint(run_id, settings, base_url, job_id, step=2)
    ranks = _ranks()
    assert sorted(map(_host_of, ranks)) == sorted([here, there])  # a rank on each host
    (on_b,) = [p for p in ranks if _host_of(p) == there]
    on_b.kill()
    state, reason = _end(run_id, settings, timeout=90)
    killed_at = ckpt.latest_checkpoint(base_url, job_id).step
    assert killed_at < STEPS - 1, "the job ended before its rank could be killed"
    assert state == "FAILED" and re.fullmatch(rf"job {job_id}: RankLost: trainer rank [01] of 2 on {b} died in \w+ \(its process was "
                                              rf"killed or ran out of memory, or its node left\){resume}", reason), reason
    assert not _ranks()

    run_id = _submit(spec, job_id, settings)
    _wait_for_checkpoint(run_id, settings, base_url, job_id, step=killed_at + 1)
    hosts.set_link(False)
    try:
        state, reason = _end(run_id, settings, timeout=90)
        assert ckpt.latest_checkpoint(base_url, job_id).step < STEPS, "the job ended before its host dropped off"
        lost = (rf"(RankLost: trainer rank [01] of 2 on {b} died in \w+ \(its process was killed or ran out of memory, or its node "
                rf"left\)|ActorDiedError: the Ray node running the job's Sampler actor \({b}\) left the cluster \(killed, or the head "
                rf"went away\))")  # what Ray reports first: the rank on B, or the sampler beside it
        assert state == "FAILED" and re.fullmatch(rf"job {job_id}: {lost}{resume}", reason), reason
        assert _held_slots(settings) == {"gpu": 0, "cpu": 0} and _live_placement_groups(settings) == []
        assert here not in map(_host_of, _ranks())  # the surviving rank was killed with its group, not left in a collective
    finally:
        hosts.set_link(True)
    steps = _mlflow_steps(settings, job_id, "rollout/reward_mean")  # the last step's may have been cut off with its host
    assert steps[:killed_at] == list(range(1, killed_at + 1)) and len(set(steps)) == len(steps), steps  # resumed: no step twice
    saved = ckpt.load_checkpoint(f"{ckpt.job_url(base_url, job_id)}/step-{killed_at + 1:08d}")  # written after the resume
    metrics = {step: values for step, values in saved.state["metrics"]}[killed_at + 1]
    assert metrics["update/sequences"] == 16 and metrics["update/grad_norm"] > 0  # both ranks' shares, summed
    assert metrics["rollout/policy_version"] == killed_at  # sampled from the resumed policy
    listed = ckpt.committed_manifest(f"{ckpt.job_url(base_url, job_id)}/step-{killed_at + 1:08d}")["files"]
    assert len([name for name in listed if name.startswith("optimizer/")]) == 2, sorted(listed)  # each rank's share of AdamW's state
    assert saved.state["policy_version"] == killed_at + 1 and any(".lora_B." in n and float(t.abs().max()) > 0 for n, t in saved.weights.items())
