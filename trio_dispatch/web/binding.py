"""Where the HTTP endpoints listen and who may read them (SPEC section 11).

An address is ``HOST:PORT``, ``[IPv6]:PORT`` or ``:PORT``/``PORT`` (then
``127.0.0.1``). Loopback is the default; any other address needs a bearer
token, or the program refuses to start. A token (given, or ``env:NAME``
read at start) is then required on every request, compared in constant
time. These checks need nothing beyond the standard library, so the
configuration file can be validated without the ``web`` extra.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Mapping
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


def parse_token(name: str, value: object, environ: Mapping[str, str]) -> str | None:
    """A bearer token (at least 16 characters), given or ``env:NAME``;
    errors name ``name`` and never the value."""
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        raise ValueError(f"{name} must be a string or env:NAME, got {show(type(value).__name__)}")
    label = MASK
    if value.startswith("env:"):
        variable = value[4:]
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
