"""What a worker runs beside its claim loop: the cross-process listener
where the store can tell, the expiry sweeper, the schedules, and whatever a
caller adds (:meth:`~.loop.DispatchWorker.add_service`).

Each runs in a cancel scope of its own inside the worker's task group. The
scopes that are not shielded end when the claim loop ends, before running
deliveries get their grace; the shielded ones (the listener, and the cancel
watch the worker starts with them) keep hearing cancels through the grace,
and end after the deliveries have stopped.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import anyio
from anyio.abc import TaskGroup

Service = Callable[[], Awaitable[None]]
"""An async callable that runs until cancelled."""

LISTENER = "listener"
"""The name of the service that hears other processes' commits."""


class Services:
    """The services of one worker, by name, in the order they were added."""

    def __init__(self) -> None:
        self._added: list[tuple[str, Service]] = []
        self._running: list[tuple[anyio.CancelScope, Service]] = []

    def add(self, name: str, service: Service) -> None:
        """Add ``service`` (see :meth:`~.loop.DispatchWorker.add_service`)."""
        if not callable(service):
            raise TypeError(f"service {name!r} must be an async callable, got {service!r}")
        self._added.append((name, service))

    def listed(self, listener: Service | None) -> list[tuple[str, Service]]:
        """Every service by name: the ``listener`` first, if any, then the
        ones added."""
        found = [] if listener is None else [(LISTENER, listener)]
        return found + self._added

    def start(self, group: TaskGroup, shielded: Service, listed: list[tuple[str, Service]]) -> None:
        """Start ``shielded`` (it hears cancels through a shutdown's grace)
        and each of ``listed`` (the listener shielded as well) in ``group``."""
        self._running = [(anyio.CancelScope(shield=True), shielded)] + [
            (anyio.CancelScope(shield=name == LISTENER), service) for name, service in listed
        ]
        for scope, service in self._running:
            group.start_soon(_serve, service, scope)

    def stop_unshielded(self) -> None:
        """End the services that need not outlive the claim loop."""
        for scope, _ in self._running:
            if not scope.shield:
                scope.cancel()

    def stop_all(self) -> None:
        """End every service (the deliveries have stopped)."""
        for scope, _ in self._running:
            scope.cancel()
        self._running = []


async def _serve(service: Service, scope: anyio.CancelScope) -> None:
    with scope:
        await service()
