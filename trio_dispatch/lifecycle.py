"""The dispatch lifecycle: statuses, reason codes, sources, and the closed
graph of edges between statuses (docs/lifecycle.md).

This module is the vocabulary; :mod:`trio_dispatch.outbox.machine` is the one
place that writes a status, and it checks every change against
:func:`check_edge` before anything is written, so an edge outside the graph
raises :class:`InvalidTransition` instead. The schema's ``CHECK`` constraint,
the partial-index terms and the scan queries are built from the same
members (:func:`status_in`), so SQL and Python cannot disagree.

Each member says who moves a row into that status and who moves it out.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from typing import Final

from .errors import InvalidTransition as InvalidTransition


class Status(enum.StrEnum):
    """A dispatch row's status: the column ``dispatch_outbox.status``."""

    PENDING = "pending"
    """Waiting for its next attempt at ``next_attempt_at``.
    In: enqueue (a schedule's tick too); the delivery loop after a failure
    with attempts left, after a send that awaits its ack, or when worker
    shutdown released the attempt; an operator retry from
    ``dead_letter``/``expired``.
    Out: a claim (``delivering``), its deadline (``expired``), a consumer's
    ack (``acked``), a newer enqueue with its coalesce key
    (``superseded``), an operator's cancel (``cancelled``)."""
    DELIVERING = "delivering"
    """Claimed: one attempt owns the row until its lease ends
    (``next_attempt_at``).
    In: a claim from ``pending``, or lease recovery from ``delivering``.
    Out: the attempt's end (``delivered``, ``pending``, ``dead_letter``), its
    deadline found at the next claim (``expired``), a consumer's ack
    (``acked``), lease recovery (``delivering``), a cancel the attempt's
    worker carries out (``cancelled``)."""
    DELIVERED = "delivered"
    """Sent, no ack required. Final. In: the delivery loop."""
    ACKED = "acked"
    """The consumer presented the token. Final. In: a consumer's ack."""
    DEAD_LETTER = "dead_letter"
    """Out of attempts (or failed for good). In: the delivery loop.
    Out: an operator retry (``pending``)."""
    EXPIRED = "expired"
    """``expires_at`` passed before a claim. In: the delivery loop.
    Out: an operator retry (``pending``)."""
    SUPERSEDED = "superseded"
    """A newer row with the same coalesce key took its place while it was
    waiting, never claimed (docs/controls.md); its transition names the new
    row. Final. In: enqueue (``replace``, ``debounce``)."""
    CANCELLED = "cancelled"
    """An operator cancelled it: at once while ``pending``; while
    ``delivering``, by the worker running the attempt, which cuts it and
    records this unless the attempt had already succeeded
    (docs/controls.md#cancel). Final. In: an operator (pending), the delivery loop (delivering),
    an operator (delivering, when no worker holds the attempt's lease)."""


PURGED: Final = "purged"
"""Not a row status: the ``status`` written on the transition that records a
purge, when the row itself is gone."""

STATUSES: Final = frozenset(Status)
DUE_STATUSES: Final = (Status.PENDING, Status.DELIVERING)
"""Statuses a scan claims from (the partial due index holds only these)."""
FINISHED_STATUSES: Final = (
    Status.DELIVERED,
    Status.ACKED,
    Status.DEAD_LETTER,
    Status.EXPIRED,
    Status.SUPERSEDED,
    Status.CANCELLED,
)
"""Statuses with no way forward but an operator's (the finished-age index);
retention prunes them."""
TERMINAL_STATUSES: Final = frozenset(FINISHED_STATUSES)


def status_in(statuses: Iterable[Status]) -> str:
    """The SQL term ``status IN ('a', 'b')`` for these statuses, in order. A
    query that wants a partial index must repeat the index's term verbatim,
    so both come from here."""
    return f"status IN ({', '.join(repr(str(status)) for status in statuses)})"


DUE_SQL: Final = status_in(DUE_STATUSES)
BLOCKING_STATUSES: Final = (Status.DEAD_LETTER, Status.EXPIRED)
"""Statuses in which the first row of a key blocks the rows behind it
(under the ``block`` policy): the heads of blocked keys."""
BLOCKING_SQL: Final = status_in(BLOCKING_STATUSES)
ORDERED_STATUSES: Final = (*DUE_STATUSES, *BLOCKING_STATUSES)
"""Statuses in which a keyed row still counts for its key's order: live, or
(under the ``block`` policy) holding the key (the ordering index)."""
ORDERED_SQL: Final = status_in(ORDERED_STATUSES)
WAITING_AT: Final = 1e15
"""The ``next_attempt_at`` of a keyed row waiting behind its key's head: past
every due time (year 31,690,000), so no scan of the due index reaches it
until the row ahead leaves and it is made due."""
FINISHED_SQL: Final = status_in(FINISHED_STATUSES)
STATUS_CHECK_SQL: Final = status_in(Status)
"""The column's CHECK constraint: every status."""


class Reason(enum.StrEnum):
    """The reason code of a transition row: the closed set of docs/lifecycle.md."""

    ENQUEUED = "dispatch.pending.enqueued"
    """Enqueue (source ``system``, actor ``enqueue_dispatch``)."""
    ATTEMPT = "dispatch.delivering.attempt"
    """A claim, lease recovery included."""
    TRANSPORT_OK = "dispatch.delivered.transport_ok"
    """The transport succeeded and no ack is required."""
    AWAITING_ACK = "dispatch.pending.awaiting_ack"
    """The transport succeeded, an ack is required, attempts remain."""
    RETRY_BACKOFF = "dispatch.pending.retry_backoff"
    """The transport failed, attempts remain."""
    THROTTLED = "dispatch.pending.throttled"
    """The destination asked to be left alone for a while (HTTP 429/503 with
    ``Retry-After``, a callable's ``Throttled``, a command's exit 75): the
    row waits for the destination; the attempt does not count toward
    ``max_attempts`` (up to 20 per row, docs/destinations.md)."""
    MAX_ATTEMPTS = "dispatch.dead_letter.max_attempts"
    """The transport failed with no attempt left, or for good (E2BIG), or the
    last attempt's lease ran out."""
    GONE = "dispatch.dead_letter.gone"
    """The destination said it no longer exists (HTTP 410): no further attempt."""
    ACK_TIMEOUT = "dispatch.dead_letter.ack_timeout"
    """An ack was required and every allowed send went unacknowledged."""
    DEADLINE = "dispatch.expired.deadline"
    """``expires_at`` passed before a claim."""
    CONSUMER_ACK = "dispatch.acked.consumer"
    """A valid token was presented."""
    OPERATOR_RETRY = "dispatch.pending.operator_retry"
    """An operator retried a ``dead_letter`` or ``expired`` dispatch."""
    RELEASED = "dispatch.pending.released"
    """Worker shutdown (or a KeyboardInterrupt) interrupted the attempt, or a
    local resource error at spawn kept it from being made (then the attempt
    is not counted); due at once."""
    COALESCED = "dispatch.superseded.coalesced"
    """A newer enqueue with the same coalesce key replaced the row while it
    waited unclaimed (``replace`` or ``debounce``); the transition's metadata
    names the new row (``superseded_by``)."""
    CANCELLED_OPERATOR = "dispatch.cancelled.operator"
    """An operator cancelled the dispatch: a pending row at once, a
    delivering row when its attempt was cut (or no worker held it)."""
    PURGED_OPERATOR = "dispatch.purged.operator"
    """An operator purged one dispatch (transition status ``purged``)."""
    PURGED_RETENTION = "dispatch.purged.retention"
    """Retention pruned the dispatch (transition status ``purged``)."""


REASON_CODES: Final = frozenset(Reason)
FAILURE_REASONS: Final = (
    Reason.RETRY_BACKOFF,
    Reason.MAX_ATTEMPTS,
    Reason.GONE,
    Reason.ACK_TIMEOUT,
)
"""The reason codes of an attempt that failed: retried, or dead-lettered
(the dashboard's recent failures, read through a partial index)."""
FAILURES_SQL: Final = (
    f"reason_code IN ({', '.join(repr(str(reason)) for reason in FAILURE_REASONS)})"
)
"""The partial term of the failures index; a query that wants the index
repeats it verbatim."""


class Source(enum.StrEnum):
    """Who took a transition (the ``source`` column)."""

    SYSTEM = "system"
    """Enqueue (and a coalescing enqueue's supersede)."""
    DELIVERY = "scheduler"
    """The delivery loop: claims, attempt ends, expiry, release (its stored
    value is ``scheduler``: docs/lifecycle.md)."""
    SCHEDULES = "scheduler"
    """A schedule's fire: the first transition of a tick's (or a manual
    run's) dispatch (docs/schedules.md). The same stored value as
    :attr:`DELIVERY`, which docs/lifecycle.md gives both: an alias, so
    ``Source.SCHEDULES is Source.DELIVERY``; the two names say which of the
    two writers the code means."""
    CONSUMER = "consumer"
    """The destination's acknowledgement."""
    OPERATOR = "operator"
    """A person or tool: retry, cancel, purge, prune."""


ENTITY_TYPE: Final = "dispatch"
ACTOR_ENQUEUE: Final = "enqueue_dispatch"
ACTOR_DELIVERY: Final = "dispatch_delivery_loop"

_DELIVERY: Final = frozenset({Source.DELIVERY})
_CONSUMER: Final = frozenset({Source.CONSUMER})
_OPERATOR: Final = frozenset({Source.OPERATOR})
_ENQUEUE: Final = frozenset({Source.SYSTEM, Source.SCHEDULES})
_CANCEL_RUNNING: Final = frozenset({Source.DELIVERY, Source.OPERATOR})

# (from, to) -> the sources that may take the edge. Delivery moves rows
# forward; only a consumer's ack reaches `acked`; only an operator revives a
# failed row or cancels one; only an enqueue (a schedule's too) supersedes a
# waiting row. A running attempt's cancel is recorded by the worker that
# cut it, or by the operator when no worker holds its lease. So an operator
# "retry" of a row still being delivered, say, is refused rather than
# resetting its attempt budget mid-flight.
_EDGES: Final[dict[tuple[str, str], frozenset[Source]]] = {
    (Status.PENDING, Status.DELIVERING): _DELIVERY,
    (Status.PENDING, Status.EXPIRED): _DELIVERY,
    (Status.PENDING, Status.ACKED): _CONSUMER,
    (Status.PENDING, Status.SUPERSEDED): _ENQUEUE,
    (Status.PENDING, Status.CANCELLED): _OPERATOR,
    (Status.DELIVERING, Status.DELIVERING): _DELIVERY,
    (Status.DELIVERING, Status.PENDING): _DELIVERY,
    (Status.DELIVERING, Status.DELIVERED): _DELIVERY,
    (Status.DELIVERING, Status.ACKED): _CONSUMER,
    (Status.DELIVERING, Status.DEAD_LETTER): _DELIVERY,
    (Status.DELIVERING, Status.EXPIRED): _DELIVERY,
    (Status.DELIVERING, Status.CANCELLED): _CANCEL_RUNNING,
    (Status.DEAD_LETTER, Status.PENDING): _OPERATOR,
    (Status.EXPIRED, Status.PENDING): _OPERATOR,
}

EDGES: Final = frozenset(_EDGES)


def check_edge(dispatch_id: str, from_status: str, to_status: str, *, source: str) -> None:
    """Raise :class:`InvalidTransition` unless ``from -> to`` is an edge of
    the graph that ``source`` may take: delivery edges are the delivery loop's,
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
            f"only {' or '.join(sorted(sources))} may take it, source was {str(source)!r}",
        )
