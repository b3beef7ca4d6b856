"""Revival heartbeats (docs/usage.md): one ``revival_ping`` per seat per reset."""

from __future__ import annotations

from typing import Final

from .outbox import DEFAULT_MAX_ATTEMPTS, enqueue_dispatch
from .store.base import Database
from .validate import require_number

REVIVAL_KIND: Final = "revival_ping"
DEFAULT_REVIVAL_TTL_SECONDS: Final = 3600.0


async def enqueue_revival_heartbeat(
    db: Database,
    seats: list[str],
    *,
    reset_epoch: float,
    ttl_seconds: float = DEFAULT_REVIVAL_TTL_SECONDS,
    max_attempts: int = DEFAULT_MAX_ATTEMPTS,
) -> list[str]:
    """Enqueue one ``revival_ping`` to each seat, in order; return the ids.

    Each has ``dedup_key="revival:<seat>:<reset_epoch>"`` (a repeated seat or
    a repeated call returns the first row's id), no acknowledgement, and
    expires at ``reset_epoch + ttl_seconds`` -- or never, when
    ``reset_epoch`` is falsy (0). A bad argument raises before the first
    enqueue.
    """
    if isinstance(seats, str) or not isinstance(seats, list | tuple):
        raise TypeError(f"seats must be a list of seat names, got {seats!r}")
    epoch = require_number("reset_epoch", reset_epoch)
    ttl = require_number("ttl_seconds", ttl_seconds, minimum=0.0)
    expires_at = epoch + ttl if reset_epoch else None
    for seat in seats:
        if not isinstance(seat, str) or not seat.strip():
            raise ValueError(f"each seat must be a non-empty string, got {seat!r}")
    return [
        await enqueue_dispatch(
            db,
            kind=REVIVAL_KIND,
            deliver_to=seat,
            body={"seat": seat, "reset_epoch": reset_epoch},
            dedup_key=f"revival:{seat}:{reset_epoch}",
            ack_required=False,
            max_attempts=max_attempts,
            expires_at=expires_at,
        )
        for seat in seats
    ]
