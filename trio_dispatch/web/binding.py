"""Where the HTTP endpoints listen and who may read them (docs/dashboard.md).

An address is ``HOST:PORT``, ``[IPv6]:PORT`` or ``:PORT``/``PORT`` (then
``127.0.0.1``). Loopback is the default; any other address needs a bearer
token, or the program refuses to start. A token (given, or ``env:NAME``
read at start) is then required on every request, compared in constant
time. These checks need nothing beyond the standard library, so the
configuration file can be validated without the ``web`` extra.

A request must also name, in its ``Host`` header, a host the server answers
to (:class:`AllowedHosts`): otherwise a web page whose name an attacker
points at this machine (DNS rebinding) could read the dashboard through
the browser of anyone who can reach it. By default that is the listener's
own names on its port: ``localhost``, ``127.0.0.1`` and ``[::1]`` for a
loopback address, the address itself for any other, and for a wildcard
(``0.0.0.0``, ``::``) ``localhost`` or any IP address -- no name, since a
name can be anyone's. ``http.allowed_hosts`` replaces that list.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Final

from ..redact import MASK, register_secrets
from ..values import show

DEFAULT_HOST: Final = "127.0.0.1"
DEFAULT_PORT: Final = 9464
MIN_TOKEN_LENGTH: Final = 16
DEFAULT_MAX_CONNECTIONS: Final = 64
"""Connections the HTTP server keeps open at once; more are closed as they
arrive (the server shares the worker's file descriptors)."""
MAX_MAX_CONNECTIONS: Final = 10_000
_HOST_PORT: Final = re.compile(
    r"^(?:\[(?P<v6>[0-9A-Fa-f:.%]+)\]|(?P<host>[^:\[\]]*)):(?P<port>\d+)$"
)
_HOST_HEADER: Final = re.compile(
    r"^(?:\[(?P<v6>[0-9A-Fa-f:.]+)\]|(?P<name>[^:\[\]]+))(?::(?P<port>\d{1,5}))?$"
)
_LABEL: Final = r"[a-z0-9_](?:[a-z0-9_-]{0,61}[a-z0-9_])?"
_NAME: Final = re.compile(rf"^(?=.{{1,253}}$){_LABEL}(?:\.{_LABEL})*$")
LOOPBACK_NAMES: Final = ("localhost", "127.0.0.1", "[::1]")
"""The names a loopback listener answers to."""


@dataclass(frozen=True)
class Listen:
    """An address to serve on."""

    host: str
    port: int

    def __str__(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"

    @property
    def loopback(self) -> bool:
        """Whether only this machine can connect."""
        if self.host == "localhost":
            return True
        try:
            return ipaddress.ip_address(self.host.split("%", 1)[0]).is_loopback
        except ValueError:  # a host name: it may resolve anywhere
            return False


def parse_listen(name: str, value: object) -> Listen:
    """``HOST:PORT``, ``[::1]:PORT``, ``:PORT`` or ``PORT`` (host
    127.0.0.1); a ValueError naming ``name`` otherwise."""
    if isinstance(value, int) and not isinstance(value, bool):
        value = str(value)
    if not isinstance(value, str) or not value.strip():
        raise ValueError(
            f"{name} must be HOST:PORT (e.g. 127.0.0.1:{DEFAULT_PORT}), got {show(value)}"
        )
    text = value.strip()
    if text.isdigit():
        text = f":{text}"
    match = _HOST_PORT.match(text)
    if match is None:
        raise ValueError(
            f"{name} must be HOST:PORT (e.g. 127.0.0.1:{DEFAULT_PORT}), got {show(value)}"
        )
    host = match["v6"] or match["host"] or DEFAULT_HOST
    port = int(match["port"])
    if not 0 <= port <= 65535:
        raise ValueError(f"{name}: port {port} is out of range (0 to 65535)")
    if match["v6"] is not None:
        try:
            ipaddress.ip_address(host.split("%", 1)[0])
        except ValueError:
            raise ValueError(f"{name}: {show(host)} is not an IPv6 address") from None
    return Listen(host, port)


def parse_token(name: str, value: object, environ: Mapping[str, str] | None) -> str | None:
    """A bearer token (at least 16 characters), given or ``env:NAME``;
    errors name ``name`` and never the value. With ``environ`` None (a
    command that serves no dashboard, :mod:`~trio_dispatch.envsecrets`),
    an ``env:NAME`` reference is answered as it is, unread: no token."""
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        raise ValueError(f"{name} must be a string or env:NAME, got {show(type(value).__name__)}")
    label = MASK
    if value.startswith("env:"):
        variable = value[4:]
        if environ is None:
            return value
        if variable not in environ:
            raise ValueError(f"{name}: environment variable {variable!r} is not set")
        label, value = value, environ[variable]
    if len(value) < MIN_TOKEN_LENGTH or any(c.isspace() or not c.isprintable() for c in value):
        raise ValueError(
            f"{name} ({label}) must be at least {MIN_TOKEN_LENGTH} printable characters "
            "without spaces"
        )
    register_secrets([value])
    return value


def parse_max_connections(name: str, value: object) -> int:
    """A whole number of connections, 1 to :data:`MAX_MAX_CONNECTIONS`; a
    ValueError naming ``name`` otherwise."""
    if (
        not isinstance(value, int)
        or isinstance(value, bool)
        or not 1 <= value <= MAX_MAX_CONNECTIONS
    ):
        raise ValueError(
            f"{name} must be a whole number from 1 to {MAX_MAX_CONNECTIONS:,}, got {show(value)}"
        )
    return value


def check_binding(listen: Listen, token: str | None, name: str) -> None:
    """Refuse to serve beyond this machine without a token."""
    if not listen.loopback and token is None:
        raise ValueError(
            f"{name} {listen} is reachable from other machines: set http.token "
            "(or env:NAME) to require a bearer token, or listen on 127.0.0.1"
        )


def split_host(text: str) -> tuple[str, int | None] | None:
    """``NAME``, ``NAME:PORT``, ``[IPv6]`` or ``[IPv6]:PORT`` (a ``Host``
    header, or an entry of ``http.allowed_hosts``) as its host in one
    spelling -- lower case, an IPv6 address compressed in brackets -- and its
    port (None if not given); None if ``text`` is none of those."""
    match = _HOST_HEADER.match(text.strip())
    if match is None:
        return None
    port = None if match["port"] is None else int(match["port"])
    if port is not None and not 1 <= port <= 65535:
        return None
    if match["v6"] is not None:
        try:
            return f"[{ipaddress.IPv6Address(match['v6']).compressed}]", port
        except ValueError:
            return None
    name = match["name"].lower()
    try:
        return str(ipaddress.IPv4Address(name)), port
    except ValueError:
        pass
    return (name, port) if _NAME.match(name) else None


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host.removeprefix("[").removesuffix("]"))
    except ValueError:
        return False
    return True


@dataclass(frozen=True)
class AllowedHosts:
    """The ``Host`` values a server answers to."""

    entries: tuple[tuple[str, int | None], ...]
    """``(host, port)``: that host (as :func:`split_host` spells it) on that
    port, or on any port where it is None."""
    any_ip_on: int | None = None
    """A port on which any IP address is answered too (a wildcard listener)."""

    @classmethod
    def of_listener(cls, listen: Listen) -> AllowedHosts:
        """The names ``listen`` answers to, on its port."""
        port = listen.port
        try:
            address = ipaddress.ip_address(listen.host.split("%", 1)[0])
        except ValueError:  # a host name
            address = None
        if address is not None and address.is_unspecified:
            return cls((("localhost", port),), any_ip_on=port)
        spelled = split_host(
            f"[{listen.host}]" if address and address.version == 6 else listen.host
        )
        host = listen.host.lower() if spelled is None else spelled[0]
        names = (*LOOPBACK_NAMES, host) if listen.loopback else (host,)
        return cls(tuple((name, port) for name in dict.fromkeys(names)))

    @classmethod
    def configured(cls, entries: Iterable[str]) -> AllowedHosts:
        """``http.allowed_hosts`` (entries :func:`parse_allowed_hosts` checked)."""
        return cls(tuple(found for found in map(split_host, entries) if found is not None))

    def allows(self, host_header: str | None, scheme: str = "http") -> bool:
        """Whether a request with this ``Host`` header may be answered (one
        without a port is on the scheme's default port; one without the
        header at all is not)."""
        found = None if host_header is None else split_host(host_header)
        if found is None:
            return False
        host, port = found
        if port is None:
            port = 443 if scheme in ("https", "wss") else 80
        if any(host == h and p in (None, port) for h, p in self.entries):
            return True
        return port == self.any_ip_on and _is_ip(host)

    def __str__(self) -> str:
        shown = ", ".join(host if port is None else f"{host}:{port}" for host, port in self.entries)
        if self.any_ip_on is not None:
            shown += f", or any IP address on port {self.any_ip_on}"
        return shown


def parse_allowed_hosts(name: str, value: object) -> tuple[str, ...] | None:
    """A list of ``NAME``, ``NAME:PORT``, ``[IPv6]`` or ``[IPv6]:PORT``,
    each in one spelling (:func:`split_host`); None when ``value`` is None
    (the listener's own names). A ValueError naming ``name`` and the bad
    value otherwise."""
    if value is None:
        return None
    if not isinstance(value, list | tuple) or not value:
        raise ValueError(
            f"{name} must be a non-empty list of host names or HOST:PORT "
            f"(e.g. [dash.example.com, 10.0.0.5:{DEFAULT_PORT}]), got {show(value)}"
        )
    entries = []
    for item in value:
        found = split_host(item) if isinstance(item, str) else None
        if found is None:
            raise ValueError(
                f"{name}: {show(item)} is not a host name or HOST:PORT "
                f"(e.g. dash.example.com, 10.0.0.5:{DEFAULT_PORT} or [::1]:{DEFAULT_PORT})"
            )
        host, port = found
        entries.append(host if port is None else f"{host}:{port}")
    return tuple(dict.fromkeys(entries))
