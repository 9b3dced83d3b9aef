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

DNS rebinding: a name checked here could answer differently when the client connects. So the
clients (opentinker.env.confined_net) check again as each connection is made and connect to the
very address they checked (`address_to_connect`), never to a second answer. A name entry trusts
the name (the system resolves it), so list only names whose DNS the operator controls.
"""

from __future__ import annotations

import ipaddress
import re
import socket
from collections.abc import Iterable
from dataclasses import dataclass
from urllib.parse import urlsplit

SETTING = "OPENTINKER_ENV_URL_ALLOW"
SCHEMES = ("http", "https", "ws", "wss")
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
    """An IPv4-mapped IPv6 address (::ffff:10.0.0.5) as the IPv4 address it reaches."""
    mapped = getattr(address, "ipv4_mapped", None)
    return mapped or address


def addresses(host: str) -> list[Address]:
    """What a connection to `host` may reach: the literal itself, else every address it resolves
    to (OSError, e.g. socket.gaierror, when it resolves to none)."""
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


@dataclass(frozen=True)
class EnvHosts:
    """A parsed OPENTINKER_ENV_URL_ALLOW: the networks, names and name suffixes environments may be at."""

    networks: tuple[Network, ...] = ()
    names: frozenset[str] = frozenset()
    suffixes: tuple[str, ...] = ()  # ".example.internal": any name under example.internal
    anything: bool = False

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
        except ValueError as err:
            return f"{field}: {url}: not a URL ({err})"
        if parts.scheme.lower() not in SCHEMES:
            return f"{field}: {url}: only {', '.join(SCHEMES)} URLs name environments"
        if not host:
            return f"{field}: {url} names no host"
        if self.anything or host in self.names or host.endswith(self.suffixes):
            return None
        try:
            found = addresses(host)
        except OSError as err:
            return (f"{field}: {url} ({host}) does not resolve ({err}), so it is not among the addresses this "
                    f"service's operator allows for environments ({SETTING})")
        if (address := self._first_outside(found)) is not None:
            shown = host if host == str(address) else f"{host}: {address}"
            return (f"{field}: {url} ({shown}) is not among the addresses this service's operator allows "
                    f"for environments ({SETTING})")
        return None

    def _first_outside(self, found: list[Address]) -> Address | None:
        """The first of `found` no allowed network holds (None: all are allowed)."""
        return next((a for a in found if not any(a in network for network in self.networks)), None)

    def address_to_connect(self, host: str) -> str:
        """Where a connection to `host` goes, checked now: an address every answer of `host` lies in
        the allowed networks of (the first answer), or `host` itself for a name entry or `*`.
        OSError with one line when the rule refuses it (a DNS answer changed since the spec's check)."""
        name = host.lower().rstrip(".")
        if self.anything or name in self.names or name.endswith(self.suffixes):
            return host
        found = addresses(name)  # OSError: it resolves to nothing
        if (address := self._first_outside(found)) is not None:
            raise OSError(f"{host} resolves to {address} now, not among the addresses this service's operator allows "
                          f"for environments ({SETTING})")
        return str(found[0])

    def check(self, urls: str | Iterable[str], field: str = "env.url") -> None:
        """Raise ValueError with the refusal of the first URL the rule refuses."""
        for url in [urls] if isinstance(urls, str) else urls:
            if why := self.refusal(url, field):
                raise ValueError(why)
