"""Destinations as entities (docs/destinations.md): a ``deliver_to`` value with a
policy from configuration (:mod:`.policy`) and a runtime state in the store
(:mod:`.state`) that every worker, process and host shares; what operators
see of them is :mod:`.listing` (read-only).

The operators' library calls are here: :func:`pause_destination`,
:func:`resume_destination`, :func:`enable_destination`. Each is one
transaction that writes the state change and its audit row.
"""

from __future__ import annotations

from typing import Final

from ..store.base import Conn, Database
from ..validate import clock_from, require_number, require_route
from ..values import show
from .policy import ANY_DESTINATION as ANY_DESTINATION
from .policy import Breaker as Breaker
from .policy import Destination as Destination
from .policy import Rate as Rate
from .policy import parse_destinations as parse_destinations
from .policy import policy_for as policy_for
from .state import Seen as Seen
from .state import State as State
from .state import enable, pause, resume

ACTOR: Final = "destinations"

MAX_REASON_LENGTH: Final = 500
"""Characters of an operator's reason kept (the rest is cut)."""


def _reason(value: object) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str):
        raise TypeError(f"reason must be a str, got {show(value)}")
    text = " ".join(value.split())[:MAX_REASON_LENGTH]
    return text or None


def _name(value: object) -> str:
    if value == ANY_DESTINATION:
        raise ValueError(
            "destination '*' names the defaults of every destination, not one: "
            "name a deliver_to value"
        )
    return require_route(value)


async def pause_destination(
    db: Database,
    name: str,
    *,
    for_seconds: float | None = None,
    until: float | None = None,
    reason: str | None = None,
    actor: str = ACTOR,
    now: float | None = None,
) -> Seen:
    """Pause destination ``name`` (a ``deliver_to`` value) for every worker:
    its rows stay ``pending``, consume no attempt and still expire on their
    own ``expires_at``; attempts already running finish normally. With
    ``for_seconds`` or ``until`` (Unix seconds) the pause lifts itself then;
    without, it lasts until :func:`resume_destination`. Returns the state
    it had. Bad input raises ``ValueError``/``TypeError`` naming it and
    writes nothing."""
    name = _name(name)
    reason = _reason(reason)
    clock = clock_from(now)
    if for_seconds is not None and until is not None:
        raise ValueError("give for_seconds or until, not both")
    if for_seconds is not None:
        require_number("for_seconds", for_seconds, minimum=0.001)
    if until is not None:
        require_number("until", until)
    if until is not None and until <= clock():
        raise ValueError(f"until must be in the future, got {show(until)}")

    def pause_unit(conn: Conn) -> Seen:
        at = clock()
        end = at + float(for_seconds) if for_seconds is not None else until
        return pause(conn, name, end, reason, actor, at)

    return await db.write(pause_unit)


async def resume_destination(
    db: Database,
    name: str,
    *,
    reason: str | None = None,
    actor: str = ACTOR,
    now: float | None = None,
) -> bool:
    """Lift destination ``name``'s pause for every worker. Returns False
    (writing nothing) when it was not paused."""
    name = _name(name)
    reason = _reason(reason)
    clock = clock_from(now)
    return await db.write(lambda conn: resume(conn, name, reason, actor, clock()) is not None)


async def enable_destination(
    db: Database,
    name: str,
    *,
    reason: str | None = None,
    actor: str = ACTOR,
    now: float | None = None,
) -> bool:
    """Close destination ``name``'s circuit breaker (disabled, open or
    half-open) for every worker, its failures counted afresh. Returns False
    (writing nothing) when its breaker was closed."""
    name = _name(name)
    reason = _reason(reason)
    clock = clock_from(now)
    return await db.write(lambda conn: enable(conn, name, reason, actor, clock()) is not None)


__all__ = [
    "ANY_DESTINATION",
    "Breaker",
    "Destination",
    "Rate",
    "Seen",
    "State",
    "enable_destination",
    "parse_destinations",
    "pause_destination",
    "policy_for",
    "resume_destination",
]
