"""A second host on this machine, for tests: a network namespace of its own joined to this one by a
veth pair, as two machines on a private network.

Why: a job across machines (Ray nodes, a torch.distributed group, S3) must be tested across two
network stacks, not over one loopback where every address is every process's. This namespace is
host A (the stack) and gets one end of the pair; host B is the new namespace with the other end.
Each side has one address of a /30 the test makes up, so the hosts reach each other only there,
and taking host A's end down is a machine that drops off the network. Needs root and iproute2
(infra/system-packages.sh installs it).
"""

from __future__ import annotations

import ipaddress
import random
import re
import shutil
import subprocess
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import pytest


@dataclass(frozen=True)
class Hosts:
    namespace: str  # host B's network namespace
    link: str  # host A's end of the pair
    a: str  # host A's address (this namespace)
    b: str  # host B's address

    def on_b(self, command: list[str]) -> list[str]:
        """`command` run on host B."""
        return ["ip", "netns", "exec", self.namespace, *command]

    def set_link(self, up: bool) -> None:
        _ip("link", "set", self.link, "up" if up else "down")


def _ip(*args: str) -> None:
    done = subprocess.run(["ip", *args], capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"ip {' '.join(args)}: {done.stderr.strip()}")


def _unused_subnet() -> ipaddress.IPv4Network:
    """A /30 in 10.0.0.0/8 that overlaps no network of this machine's interfaces."""
    listed = subprocess.run(["ip", "-4", "-o", "addr"], capture_output=True, text=True).stdout
    taken = [ipaddress.ip_interface(a).network for a in re.findall(r"inet (\S+)", listed)]
    while True:
        net = ipaddress.ip_network(f"10.{random.randint(64, 250)}.{random.randint(0, 255)}.{4 * random.randint(0, 63)}/30")
        if not any(net.overlaps(t) for t in taken):
            return net


@contextmanager
def second_host() -> Iterator[Hosts]:
    if shutil.which("ip") is None:
        pytest.fail("two-host tests need the Debian package iproute2 (infra/system-packages.sh installs it as root)")
    tag = uuid.uuid4().hex[:6]
    namespace, a_end, b_end = f"ot-{tag}", f"ota{tag}", f"otb{tag}"
    a, b = (str(h) for h in _unused_subnet().hosts())
    try:
        _ip("netns", "add", namespace)
    except RuntimeError as err:
        pytest.skip(f"network namespaces need root (CAP_NET_ADMIN): {err}")
    try:
        _ip("link", "add", a_end, "type", "veth", "peer", "name", b_end)
        _ip("link", "set", b_end, "netns", namespace)
        _ip("addr", "add", f"{a}/30", "dev", a_end)
        _ip("link", "set", a_end, "up")
        _ip("-n", namespace, "addr", "add", f"{b}/30", "dev", b_end)
        _ip("-n", namespace, "link", "set", b_end, "up")
        _ip("-n", namespace, "link", "set", "lo", "up")
        yield Hosts(namespace, a_end, a, b)
    finally:
        for pid in subprocess.run(["ip", "netns", "pids", namespace], capture_output=True, text=True).stdout.split():
            subprocess.run(["kill", "-9", pid], capture_output=True)
        subprocess.run(["ip", "netns", "del", namespace], capture_output=True)  # takes both ends of the pair with it
        subprocess.run(["ip", "link", "del", a_end], capture_output=True)
