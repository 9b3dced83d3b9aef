"""One command makes a machine part of the stack: a Ray node that joins the stack's head (with this
machine's GPUs and resources) and a Prefect worker for its pool (`opentinker worker --join`).

A worker on another machine than the stack writes checkpoints where the gateway and every other
worker must read them, so it refuses local (`file://`) storage before starting anything. The
Ray node is watched: when it leaves the cluster (the head died, the node was killed) the worker
says so on one line and joins again as soon as the head answers; the jobs that were running fail
with the reason and resume from their last checkpoint when resubmitted.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from opentinker.control.processes import group_members, reap, signal_group, tail
from opentinker.control.services import RAY_NODE_ENV, private_ray_dir, ray_dir, ray_node_ports, remove_stand_in, worker_prefect_env
from opentinker.control.submit import check_ray_address
from opentinker.core.env_hosts import OWN_SERVER_MARK
from opentinker.core.polling import wait_for
from opentinker.core.settings import Settings, address_toward, mlflow_env, prefect_env, ray_env, settings_env


class NodeError(RuntimeError):
    """The machine cannot join; the message is one line saying why and what to set."""


def is_this_machine(host: str) -> bool:
    """Does `host` name this machine (loopback, its name, or one of its addresses)?"""
    import socket

    import psutil

    try:
        address = socket.gethostbyname(host)
    except OSError:
        return False
    own = {a.address for addrs in psutil.net_if_addrs().values() for a in addrs}
    return address.startswith("127.") or address in own


def check_shared_storage(settings: Settings, remote: bool) -> None:
    """NodeError when a worker on another machine than the stack would keep jobs on its own disk."""
    if remote and settings.storage_is_local:
        raise NodeError(f"OPENTINKER_STORAGE_URL is {settings.storage_url}: a worker on another machine than the "
                        "stack would write checkpoints where the gateway and the other workers cannot read them; "
                        "set OPENTINKER_STORAGE_URL to shared storage (s3://bucket/prefix) on every machine")


@dataclass
class WorkerNode:
    """A Ray node joined to `join` (host:port of the head's GCS) plus a Prefect worker for `pool`."""

    settings: Settings
    pool: str
    join: str
    num_gpus: int | None = None
    num_cpus: int | None = None
    resources: dict[str, float] = field(default_factory=dict)
    name: str = ""
    say: Callable[[str], None] = print
    node: subprocess.Popen | None = None
    worker: subprocess.Popen | None = None

    @property
    def local_address(self) -> str:
        """This machine's address toward the head: what its node and its servers advertise."""
        return address_toward(self.join.rpartition(":")[0])

    @property
    def pid_file(self) -> Path:
        return self.settings.state_dir / "pids" / f"ray-node-{self.pool}.pid"

    @property
    def log_file(self) -> Path:
        return self.settings.state_dir / "logs" / f"ray-node-{self.pool}.log"

    def env(self) -> dict[str, str]:
        """Both processes: the settings (dialing the stack at `host`, binding servers here), the
        head to join as the cluster jobs use, the stack's Ray token, and the mark of the stack's processes
        (what they and their children listen on is no environment: core.env_hosts)."""
        s = self.settings
        base = {k: v for k, v in os.environ.items() if not k.startswith("OPENTINKER_")}
        here = {"OPENTINKER_RAY_ADDRESS": self.join, "OPENTINKER_WORK_POOL": self.pool,
                "OPENTINKER_BIND_HOST": s.bind_host or self.local_address,
                "OPENTINKER_ADVERTISED_HOST": s.advertised_host or self.local_address}
        return {**base, **settings_env(s), **prefect_env(s), **mlflow_env(s), **ray_env(s), **here, **OWN_SERVER_MARK}

    @property
    def temp_dir(self) -> Path:
        return ray_dir(self.settings.state_dir, f"node-{self.pool}")

    def node_command(self) -> list[str]:
        command = [str(Path(sys.executable).with_name("ray")), "start", "--address", self.join, "--block",
                   "--temp-dir", str(private_ray_dir(self.settings.state_dir, f"node-{self.pool}")), *ray_node_ports(), "--disable-usage-stats"]
        if not self.local_address.startswith("127."):
            command += ["--node-ip-address", self.local_address]
        if self.num_gpus is not None:
            command += ["--num-gpus", str(self.num_gpus)]
        if self.num_cpus is not None:
            command += ["--num-cpus", str(self.num_cpus)]
        if self.resources:
            command += ["--resources", json.dumps(self.resources)]
        return command

    def start_node(self, timeout: float = 120.0) -> int:
        """Join the head; the node's pid once Ray says it started. NodeError with the end of its log if not."""
        self.pid_file.parent.mkdir(parents=True, exist_ok=True)
        self.log_file.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_file, "ab") as log:
            log.write(f"\n=== opentinker: joining {self.join} at {time.ctime()} ===\n".encode())
            log.flush()
            self.node = subprocess.Popen(self.node_command(), env={**self.env(), **RAY_NODE_ENV}, stdin=subprocess.DEVNULL,
                                         stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        self.pid_file.write_text(f"{self.node.pid}\n")

        def started() -> bool | None:
            if self.node.poll() is not None:
                raise NodeError(f"the Ray node could not join {self.join} (exit {self.node.returncode}); "
                                f"last lines of {self.log_file}:\n{tail(self.log_file)}")
            text = self.log_file.read_text(errors="replace").rpartition("=== opentinker: joining")[2]
            return True if "Ray runtime started" in text else None

        try:
            wait_for(started, interval=0.25, timeout=timeout, what=f"the Ray node to join {self.join}")
        except TimeoutError as err:
            self.stop_node()
            raise NodeError(f"{err}; last lines of {self.log_file}:\n{tail(self.log_file)}") from None
        return self.node.pid

    def cluster_gpus(self, timeout: float = 120.0) -> int:
        """The GPUs of the whole Ray cluster, each node having counted its own, asked as a driver
        (in a child process, so this one never holds a Ray connection)."""
        code = ("import json, ray; ray.init(address=%r, logging_level='ERROR', log_to_driver=False); "
                "print(json.dumps(ray.cluster_resources().get('GPU', 0)))") % self.join
        done = subprocess.run([sys.executable, "-c", code], env=self.env(), capture_output=True, text=True, timeout=timeout)
        if done.returncode != 0:
            raise NodeError(f"could not ask the Ray cluster at {self.join} for its GPUs: {tail_text(done.stderr)}")
        return int(float(done.stdout.strip().splitlines()[-1]))

    def count_gpu_slots(self) -> None:
        """The GPU pool gets one slot per GPU of the cluster, as its nodes counted them (not what
        the control plane's machine has)."""
        if self.pool != "gpu":
            return
        from prefect.settings import PREFECT_API_URL, temporary_settings

        from opentinker.control.scheduler import resize_pool

        gpus = self.cluster_gpus()
        with temporary_settings({PREFECT_API_URL: self.settings.prefect_api_url}):
            resize_pool("gpu", gpus)
        self.say(f"gpu pool: {gpus} slot(s), one per GPU the cluster's nodes report")

    def start_worker(self) -> int:
        name = self.name or f"opentinker-{self.pool}-{os.uname().nodename}"
        command = [sys.executable, "-m", "prefect", "worker", "start", "--pool", self.pool, "--type", "process",
                   "--name", name, "--install-policy", "never"]
        self.worker = subprocess.Popen(command, env={**self.env(), **worker_prefect_env(self.settings)},
                                       stdin=subprocess.DEVNULL, start_new_session=True)
        return self.worker.pid

    def stop_node(self, timeout: float = 15.0) -> None:
        if self.node is None:
            return
        pgid = self.node.pid
        signal_group(pgid, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        while group_members(pgid) and time.monotonic() < deadline:
            time.sleep(0.25)
        signal_group(pgid, signal.SIGKILL)
        reap(pgid)
        self.pid_file.unlink(missing_ok=True)

    def stop(self) -> None:
        if self.worker is not None and self.worker.poll() is None:
            signal_group(self.worker.pid, signal.SIGTERM)
            try:
                self.worker.wait(timeout=15)
            except subprocess.TimeoutExpired:
                signal_group(self.worker.pid, signal.SIGKILL)
        self.stop_node()
        remove_stand_in(self.temp_dir)

    def rejoin(self) -> None:
        """After the node left: wait (saying so once) until the head answers, then join again."""
        self.say(f"ray node left the cluster ({_exit(self.node.returncode)}); its running jobs fail and resume when "
                 f"resubmitted; joining {self.join} again once it answers")
        self.stop_node(timeout=5.0)

        def rejoined() -> int | None:
            try:
                check_ray_address(self.join)
                return self.start_node()
            except (ConnectionError, NodeError):
                return None

        pid = wait_for(rejoined, interval=5.0, what=f"the Ray head at {self.join}")
        self.say(f"ray node joined {self.join} again (pid {pid})")
        self.count_gpu_slots()

    def run(self) -> int:
        """Start both, watch both: the worker's exit ends the command (with its code); the node's
        exit is answered by joining again."""
        check_ray_address(self.join)
        self.start_node()
        self.say(f"ray node joined {self.join} (pid {self.node.pid}, log {self.log_file})")
        self.count_gpu_slots()
        self.start_worker()
        try:
            while self.worker.poll() is None:
                if self.node.poll() is not None:
                    self.rejoin()
                time.sleep(1.0)
            return self.worker.returncode
        finally:
            self.stop()


def tail_text(text: str, lines: int = 3) -> str:
    return " | ".join(x.strip() for x in text.strip().splitlines()[-lines:])


def _exit(code: int | None) -> str:
    if code is not None and code < 0:
        return f"killed by {signal.Signals(-code).name}"
    return f"exit {code}"
