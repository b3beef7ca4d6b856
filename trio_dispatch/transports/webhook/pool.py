"""The one override of httpcore's internals: a connection pool whose
bookkeeping is linear in its connections. It reaches into
``httpcore.AsyncConnectionPool``'s private parts, so it lives alone, and
``tests`` check the shape it relies on for the pinned httpcore range."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Final

if TYPE_CHECKING:
    pass

REAP_SECONDS: Final = 1.0
"""How often the client's pool looks for idle connections the server closed."""


def linear_pool_class() -> type[Any]:
    import httpcore

    class LinearPool(httpcore.AsyncConnectionPool):
        """httpcore's pool with its bookkeeping made linear. The stock
        version re-scans every connection for each connection (and polls
        each idle socket) whenever a request starts or ends: with 64
        connections that is milliseconds of CPU per request, the whole
        budget of a local webhook. Here each pass touches each connection
        once, and only the connection about to be reused is checked for
        expiry (an expired one is closed and the next taken)."""

        _reaped_at = 0.0

        def _assign_requests_to_connections(self) -> list[Any]:
            closing: list[Any] = []
            kept = [c for c in self._connections if not c.is_closed()]
            now = time.monotonic()
            if now - self._reaped_at >= REAP_SECONDS:  # idle sockets the server closed
                self._reaped_at = now
                for connection in [c for c in kept if c.is_idle() and c.has_expired()]:
                    kept.remove(connection)
                    closing.append(connection)
            surplus = len(kept) - self._max_keepalive_connections
            if surplus > 0:
                for connection in [c for c in kept if c.is_idle()][:surplus]:
                    kept.remove(connection)
                    closing.append(connection)
            self._connections = kept
            queued = [request for request in self._requests if request.is_queued()]
            if not queued:
                return closing
            available = [c for c in kept if c.is_available()]
            for request in queued:
                origin = request.request.url.origin
                chosen = None
                elsewhere: list[Any] = []  # another origin's: kept for its requests
                while available:
                    candidate = available.pop()
                    if not candidate.can_handle_request(origin):
                        elsewhere.append(candidate)
                        continue
                    if candidate.has_expired():
                        self._connections.remove(candidate)
                        closing.append(candidate)
                        continue
                    chosen = candidate
                    break
                available.extend(elsewhere)
                if chosen is None:
                    if len(self._connections) >= self._max_connections:
                        idle = next((c for c in self._connections if c.is_idle()), None)
                        if idle is None:
                            continue  # stays queued until a connection frees
                        self._connections.remove(idle)
                        closing.append(idle)
                    chosen = self.create_connection(origin)
                    self._connections.append(chosen)
                request.assign_to_connection(chosen)
            return closing

    return LinearPool
