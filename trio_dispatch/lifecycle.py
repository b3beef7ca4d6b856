"""The dispatch lifecycle: statuses, the closed edge graph and reason codes.

This module is the single owner of what a status change may be. Every write
of ``dispatch_outbox.status`` goes through :func:`check_edge` first, so an
edge outside the graph raises :class:`InvalidTransition` before anything is
written.
"""

from __future__ import annotations

from typing import Final

PENDING: Final = "pending"
DELIVERING: Final = "delivering"
DELIVERED: Final = "delivered"
ACKED: Final = "acked"
DEAD_LETTER: Final = "dead_letter"
EXPIRED: Final = "expired"
PURGED: Final = "purged"
"""Not a row status: the ``status`` written on the transition that records a
purge, when the row itself is gone."""

STATUSES: Final = frozenset({PENDING, DELIVERING, DELIVERED, ACKED, DEAD_LETTER, EXPIRED})
TERMINAL_STATUSES: Final = frozenset({DELIVERED, ACKED, DEAD_LETTER, EXPIRED})
DUE_STATUSES: Final = (PENDING, DELIVERING)

ENTITY_TYPE: Final = "dispatch"

SOURCE_SYSTEM: Final = "system"
SOURCE_SCHEDULER: Final = "scheduler"
SOURCE_OPERATOR: Final = "operator"
ACTOR_ENQUEUE: Final = "enqueue_dispatch"
ACTOR_DELIVERY: Final = "dispatch_delivery_loop"

# Reason codes: the closed set of SPEC section 7.
ENQUEUED: Final = "dispatch.pending.enqueued"
ATTEMPT: Final = "dispatch.delivering.attempt"
TRANSPORT_OK: Final = "dispatch.delivered.transport_ok"
AWAITING_ACK: Final = "dispatch.pending.awaiting_ack"
RETRY_BACKOFF: Final = "dispatch.pending.retry_backoff"
MAX_ATTEMPTS: Final = "dispatch.dead_letter.max_attempts"
ACK_TIMEOUT: Final = "dispatch.dead_letter.ack_timeout"
DEADLINE: Final = "dispatch.expired.deadline"
CONSUMER_ACK: Final = "dispatch.acked.consumer"
OPERATOR_RETRY: Final = "dispatch.pending.operator_retry"
RELEASED: Final = "dispatch.pending.released"
PURGED_OPERATOR: Final = "dispatch.purged.operator"
PURGED_RETENTION: Final = "dispatch.purged.retention"

REASON_CODES: Final = frozenset(
    {
        ENQUEUED,
        ATTEMPT,
        TRANSPORT_OK,
        AWAITING_ACK,
        RETRY_BACKOFF,
        MAX_ATTEMPTS,
        ACK_TIMEOUT,
        DEADLINE,
        CONSUMER_ACK,
        OPERATOR_RETRY,
        RELEASED,
        PURGED_OPERATOR,
        PURGED_RETENTION,
    }
)

SOURCE_CONSUMER: Final = "consumer"

_SCHEDULER: Final = frozenset({SOURCE_SCHEDULER})
_CONSUMER: Final = frozenset({SOURCE_CONSUMER})
_OPERATOR: Final = frozenset({SOURCE_OPERATOR})

# (from, to) -> the sources that may take the edge. Delivery moves rows
# forward; only a consumer's ack reaches `acked`; only an operator revives a
# failed row. So an operator "retry" of a row still being delivered, say, is
# refused rather than resetting its attempt budget mid-flight.
_EDGES: Final[dict[tuple[str, str], frozenset[str]]] = {
    (PENDING, DELIVERING): _SCHEDULER,
    (PENDING, EXPIRED): _SCHEDULER,
    (PENDING, ACKED): _CONSUMER,
    (DELIVERING, DELIVERING): _SCHEDULER,
    (DELIVERING, PENDING): _SCHEDULER,
    (DELIVERING, DELIVERED): _SCHEDULER,
    (DELIVERING, ACKED): _CONSUMER,
    (DELIVERING, DEAD_LETTER): _SCHEDULER,
    (DELIVERING, EXPIRED): _SCHEDULER,
    (DEAD_LETTER, PENDING): _OPERATOR,
    (EXPIRED, PENDING): _OPERATOR,
}

EDGES: Final = frozenset(_EDGES)


class InvalidTransition(ValueError):
    """A status change that the closed lifecycle graph does not allow."""

    def __init__(self, dispatch_id: str, from_status: str, to_status: str, why: str = "") -> None:
        self.dispatch_id = dispatch_id
        self.from_status = from_status
        self.to_status = to_status
        detail = f": {why}" if why else ""
        super().__init__(
            f"dispatch {dispatch_id}: transition {from_status!r} -> {to_status!r} "
            f"is not allowed{detail}"
        )


def check_edge(dispatch_id: str, from_status: str, to_status: str, *, source: str) -> None:
    """Raise :class:`InvalidTransition` unless ``from -> to`` is an edge of
    the graph that ``source`` may take: delivery edges are the scheduler's,
    edges to ``acked`` the consumer's, revival of a failed row the
    operator's."""
    sources = _EDGES.get((from_status, to_status))
    if sources is None:
        raise InvalidTransition(dispatch_id, from_status, to_status)
    if source not in sources:
        raise InvalidTransition(
            dispatch_id,
            from_status,
            to_status,
            f"only {' or '.join(sorted(sources))} may take it, source was {source!r}",
        )
