"""Slowing down guesses at the dashboard's login form.

A client's first wrong token starts a burst of :data:`LOGIN_WINDOW_SECONDS`.
After :data:`LOGIN_FAILURES` wrong tokens in one burst, that client's logins
are refused unheard (429 and ``Retry-After``; no token is compared, so a
right guess gains nothing) until the burst ends. A right token does not end
a burst: one viewer token must not buy an endless series of guesses at the
operator's. The caller logs one line per burst, at its start, not one per
wrong token.

A client is its address, or for IPv6 its /64 (one host usually holds a
whole /64). At most :data:`MAX_CLIENTS` bursts are kept: past that, ended
bursts go first, then the oldest. Behind a reverse proxy every client has
the proxy's address, so one client's burst slows everyone's form logins
(never a bearer request's).
"""

from __future__ import annotations

import dataclasses
import ipaddress
import math
from collections.abc import Callable
from typing import Final

LOGIN_FAILURES: Final = 5
"""Wrong tokens a client may send in one burst before its logins wait."""
LOGIN_WINDOW_SECONDS: Final = 60.0
"""How long a burst lasts, from its first wrong token."""
MAX_CLIENTS: Final = 4096
"""Bursts kept at once."""


def client_key(address: str) -> str:
    """Whose burst a login from ``address`` counts in: the address itself,
    or for IPv6 its /64 (an IPv4-mapped address as its IPv4 address)."""
    try:
        parsed = ipaddress.ip_address(address.split("%", 1)[0])
    except ValueError:  # not an IP address (a Unix socket, "unknown"): as given
        return address
    if isinstance(parsed, ipaddress.IPv6Address):
        if parsed.ipv4_mapped is not None:
            return str(parsed.ipv4_mapped)
        return str(ipaddress.IPv6Network((parsed, 64), strict=False))
    return str(parsed)


@dataclasses.dataclass
class _Burst:
    started: float
    failures: int = 0


class LoginThrottle:
    """The bursts of wrong tokens of the clients that sent some lately."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self.clock = clock
        self._bursts: dict[str, _Burst] = {}

    def __len__(self) -> int:
        """Bursts kept now (ended ones included until they make room)."""
        return len(self._bursts)

    def _live(self, key: str, now: float) -> _Burst | None:
        burst = self._bursts.get(key)
        if burst is None or now >= burst.started + LOGIN_WINDOW_SECONDS:
            return None
        return burst

    def retry_after(self, address: str) -> int | None:
        """Whole seconds before a login from ``address`` is heard again, or
        None: it is heard now."""
        now = self.clock()
        burst = self._live(client_key(address), now)
        if burst is None or burst.failures < LOGIN_FAILURES:
            return None
        return max(1, math.ceil(burst.started + LOGIN_WINDOW_SECONDS - now))

    def failed(self, address: str) -> bool:
        """Count a wrong token from ``address``; True when it starts a
        burst (the one to log)."""
        now = self.clock()
        key = client_key(address)
        burst = self._live(key, now)
        started = burst is None
        if burst is None:
            self._bursts.pop(key, None)  # an ended burst: the new one goes last
            self._make_room(now)
            burst = self._bursts[key] = _Burst(now)
        burst.failures += 1
        return started

    def _make_room(self, now: float) -> None:
        if len(self._bursts) < MAX_CLIENTS:
            return
        for key in [k for k, b in self._bursts.items() if now >= b.started + LOGIN_WINDOW_SECONDS]:
            del self._bursts[key]
        while len(self._bursts) >= MAX_CLIENTS:  # insertion order is start order
            del self._bursts[next(iter(self._bursts))]
