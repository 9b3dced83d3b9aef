"""Where a job's environment servers may be: the operator's allowlist for `env.url`.

A tenant's spec names env.url and our workers connect there (with the job's token). Unchecked,
that is server-side request forgery: a spec could send our workers' requests into the operator's
private network (cloud metadata at 169.254.169.254, internal services). So the gateway (before
submission) and the worker (before its first request) check every URL against
OPENTINKER_ENV_URL_ALLOW. Its default, loopback only, keeps the one-machine stack working and
reaches nothing else until the operator says so.

The rule: an http, https, ws or wss URL with a host, whose host matches a name entry (exact, any
case; `*.domain`: any name under domain) or whose every address lies inside an allowed address or
network (an IP literal is itself; a name is resolved with getaddrinfo, and one that does not
resolve is refused). `*` allows any URL of those schemes.

The stack's own servers (`OwnServers`) are refused first, by address, never by spelling: its fixed
ports (Prefect, MLflow, the gateway, Ray, the sandbox service) and any port a process of the stack
listens on here (a job's vLLM server with its unauthenticated dev endpoints, Ray's agents, a rollout
server: random ports), known by the mark in the environment of each process the stack starts (OWN_SERVER_MARK)
or of an ancestor. The host is resolved as a connection would resolve it (inet_aton's hex,
octal, decimal and short IPv4 forms, IPv4-mapped and IPv4-compatible IPv6, a trailing dot, every
address of a name) and one of those ports on an address of this machine (loopback, 0.0.0.0 and
::, which reach it, any interface's: they may listen on a wildcard), or a fixed port on the
stack's host, is refused, whatever the allowlist says.

DNS rebinding: a name checked here could answer differently when the client connects. So the
clients (opentinker.env.confined_net) check again as each connection is made and connect to the
very address they checked (`address_to_connect`), never to a second answer. A name entry trusts
the name's answers for the allowlist (list only names whose DNS the operator controls), never
for the stack's own servers.
"""

from __future__ import annotations

import ipaddress
import re
import socket
from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import Any
from urllib.parse import urlsplit

SETTING = "OPENTINKER_ENV_URL_ALLOW"
OWN_SERVER_MARK = {"OPENTINKER_OWN_SERVER": "1"}  # in the environment of every process the stack starts
SCHEMES = ("http", "https", "ws", "wss")
DEFAULT_PORTS = {"http": 80, "ws": 80, "https": 443, "wss": 443}
Address = ipaddress.IPv4Address | ipaddress.IPv6Address
Network = ipaddress.IPv4Network | ipaddress.IPv6Network

_LABEL = r"(?!-)[a-z0-9_-]{1,63}(?<!-)"
_NAME = re.compile(rf"^{_LABEL}(\.{_LABEL})*$")
_MALFORMED = SETTING + ": {entry} is not an IP address, a network (CIDR), a host name, '*.domain' or '*'"


def _network(entry: str) -> Network | None:
    """The network an entry that looks like an address names (strict: `10.0.0.5/8` is refused, a
    typo or a wider network than meant); None for an entry that does not look like one."""
    if not ("/" in entry or ":" in entry or all(c.isdigit() or c == "." for c in entry)):
        return None
    try:
        return ipaddress.ip_network(entry)
    except ValueError as err:
        raise ValueError(f"{_MALFORMED.format(entry=repr(entry))} ({err})") from None


def _plain(address: Address) -> Address:
    """An IPv4-mapped (::ffff:10.0.0.5) or IPv4-compatible (::10.0.0.5) IPv6 address as the IPv4
    address it stands for (the clients connect to that one)."""
    if address.version == 6 and not address.scope_id:
        if address.ipv4_mapped:
            return address.ipv4_mapped
        if 1 < int(address) < 2**32:  # ::a.b.c.d, not :: or ::1
            return ipaddress.IPv4Address(int(address))
    return address


def addresses(host: str) -> list[Address]:
    """What a connection to `host` may reach: the literal itself, else every address it resolves
    to, as getaddrinfo reads it (0x7f000001, 127.1, 2130706433: 127.0.0.1); OSError (e.g.
    socket.gaierror) when it resolves to none."""
    try:
        return [_plain(ipaddress.ip_address(host))]
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    except UnicodeError as err:  # a name IDNA cannot encode (a label over 63 characters)
        raise OSError(str(err)) from None
    found = [_plain(ipaddress.ip_address(info[4][0])) for info in infos]
    if not found:
        raise OSError("no address")
    return found


def on_this_machine(address: Address) -> bool:
    """Whether a connection to `address` stays on this machine: loopback, the unspecified address
    (0.0.0.0 and :: reach it), or an address of one of its interfaces."""
    if address.is_loopback or address.is_unspecified:
        return True
    import psutil

    own = {ipaddress.ip_address(a.address.split("%")[0]) for nic in psutil.net_if_addrs().values() for a in nic
           if a.family in (socket.AF_INET, socket.AF_INET6)}
    return ipaddress.ip_address(str(address).split("%")[0]) in own


@dataclass(frozen=True)
class OwnServers:
    """The stack's own servers: their ports on this machine or on the stack's hosts, where no
    environment is (a job's requests there would carry its token into Prefect, MLflow, the gateway)."""

    ports: frozenset[int] = frozenset()
    hosts: tuple[str, ...] = ()  # the stack's host names as the settings give them, resolved when checked
    marked: bool = False  # also every port a marked process listens on on this machine

    @classmethod
    def of(cls, settings: Any) -> OwnServers:
        """Those of a Settings: Prefect, MLflow, the gateway, Ray's GCS and client server, the sandbox
        service (SandboxFusion's API: it runs code), and whatever the stack's processes listen on here."""
        ports = {settings.prefect_port, settings.mlflow_port, settings.gateway_port, settings.ray_port, settings.ray_client_port,
                 settings.sandbox_port}
        hosts = {settings.host, settings.listen_host, settings.gateway_listen_host, settings.advertised_host} - {None, ""}
        return cls(frozenset(ports), tuple(sorted(hosts)), marked=True)

    def first_held(self, found: list[Address], port: int | None) -> Address | None:
        """The first of `found` that is one of these servers at `port` (None: none is)."""
        if port in self.ports:
            stack = {a for host in self.hosts for a in _resolved(host)}
            return next((a for a in found if a in stack or on_this_machine(a)), None)
        if self.marked and port is not None and (here := [a for a in found if on_this_machine(a)]) and marked_listener(port):
            return here[0]
        return None


def marked_listener(port: int) -> bool:
    """Whether a process of the stack listens on `port` on this machine, on any address (a
    connection to loopback reaches a wildcard listener too): one with OWN_SERVER_MARK in its
    environment, or a descendant of one (Ray's agents and workers rename themselves, which
    overwrites what /proc shows of their environment; their raylet still shows it). A process of
    another user is never the stack's (its sockets' owners are not visible: not refused)."""
    import psutil

    (name, value), = OWN_SERVER_MARK.items()

    def marked(process: psutil.Process) -> bool:
        try:
            return process.environ().get(name) == value
        except psutil.Error:  # gone since, or not ours to read
            return False

    for conn in psutil.net_connections("tcp"):
        if conn.status == psutil.CONN_LISTEN and conn.laddr and conn.laddr.port == port and conn.pid:
            try:
                process = psutil.Process(conn.pid)
                if any(marked(p) for p in [process, *process.parents()]):
                    return True
            except psutil.Error:
                continue
    return False


def _resolved(host: str) -> list[Address]:
    try:
        return addresses(host.rstrip("."))
    except OSError:
        return []


def _shown(host: str, address: Address) -> str:
    return host if host == str(address) else f"{host}: {address}"


@dataclass(frozen=True)
class EnvHosts:
    """A parsed OPENTINKER_ENV_URL_ALLOW: the networks, names and name suffixes environments may be
    at; and the stack's own servers, which no environment is."""

    networks: tuple[Network, ...] = ()
    names: frozenset[str] = frozenset()
    suffixes: tuple[str, ...] = ()  # ".example.internal": any name under example.internal
    anything: bool = False
    own: OwnServers = OwnServers()

    @classmethod
    def of(cls, settings: Any) -> EnvHosts:
        """A Settings' allowlist (env_url_allow) and its stack's own servers."""
        return replace(cls.parse(settings.env_url_allow), own=OwnServers.of(settings))

    @classmethod
    def parse(cls, text: str) -> EnvHosts:
        """The entries of `text` (comma-separated); ValueError naming the setting and the entry when one is malformed."""
        networks, names, suffixes, anything = [], set(), [], False
        for entry in (e.strip() for e in text.split(",")):
            name = entry.lower().rstrip(".")
            if not entry:
                continue
            if entry == "*":
                anything = True
            elif name.startswith("*.") and _NAME.match(name[2:]):
                suffixes.append(name[1:])
            elif (network := _network(entry)) is not None:
                networks.append(network)
            elif _NAME.match(name):
                names.add(name)
            else:
                raise ValueError(_MALFORMED.format(entry=repr(entry)))
        return cls(tuple(networks), frozenset(names), tuple(suffixes), anything)

    def refusal(self, url: str, field: str = "env.url") -> str | None:
        """Why a request to `url` may not be sent (one line: the URL, its host, the address, the
        setting), or None when the rule allows it."""
        try:
            parts = urlsplit(url)
            host = (parts.hostname or "").rstrip(".")
            port = parts.port or DEFAULT_PORTS.get(parts.scheme.lower())
        except ValueError as err:
            return f"{field}: {url}: not a URL ({err})"
        if parts.scheme.lower() not in SCHEMES:
            return f"{field}: {url}: only {', '.join(SCHEMES)} URLs name environments"
        if not host:
            return f"{field}: {url} names no host"
        try:
            found, unresolved = addresses(host), None
        except OSError as err:
            found, unresolved = [], err
        if (address := self.own.first_held(found, port)) is not None:
            return f"{field}: {url} ({_shown(host, address)}) is one of this service's own servers, not an environment"
        if self._named(host):
            return None
        if unresolved is not None:
            return (f"{field}: {url} ({host}) does not resolve ({unresolved}), so it is not among the addresses this "
                    f"service's operator allows for environments ({SETTING})")
        if (address := self._first_outside(found)) is not None:
            return (f"{field}: {url} ({_shown(host, address)}) is not among the addresses this service's operator allows "
                    f"for environments ({SETTING})")
        return None

    def _named(self, host: str) -> bool:
        """Whether an entry allows `host` by its name (`*`, a name, a suffix)."""
        return self.anything or host in self.names or host.endswith(self.suffixes)

    def _first_outside(self, found: list[Address]) -> Address | None:
        """The first of `found` no allowed network holds (None: all are allowed)."""
        return next((a for a in found if not any(a in network for network in self.networks)), None)

    def address_to_connect(self, host: str, port: int | None = None) -> str:
        """Where a connection to `host`:`port` goes, checked now: the first address `host` resolves
        to, when none of its answers is one of the stack's own servers and (unless an entry allows
        the name) every answer lies in the allowed networks. OSError with one line otherwise (a DNS
        answer changed since the spec's check)."""
        name = host.lower().rstrip(".")
        found = addresses(name)  # OSError: it resolves to nothing
        if (address := self.own.first_held(found, port)) is not None:
            raise OSError(f"{host} is {address} now, one of this service's own servers (port {port}), not an environment")
        if not self._named(name) and (address := self._first_outside(found)) is not None:
            raise OSError(f"{host} resolves to {address} now, not among the addresses this service's operator allows "
                          f"for environments ({SETTING})")
        return str(found[0])

    def address_for(self, url: str) -> str:
        """`address_to_connect` for the host and port of `url` (its scheme's port if none is given)."""
        parts = urlsplit(url)
        return self.address_to_connect(parts.hostname or "", parts.port or DEFAULT_PORTS.get(parts.scheme.lower()))

    def check(self, urls: str | Iterable[str], field: str = "env.url") -> None:
        """Raise ValueError with the refusal of the first URL the rule refuses."""
        for url in [urls] if isinstance(urls, str) else urls:
            if why := self.refusal(url, field):
                raise ValueError(why)
