"""The state machine's vocabulary and its one gate: the rows a dispatch is
made of (:class:`NewDispatch`, :class:`Claim`), what an attempt can come to
(:class:`Outcome`), and :func:`transition_rows`, which checks every status
change against the closed graph of :mod:`trio_dispatch.lifecycle` before
its history row is written. An edge outside the graph raises
:class:`~trio_dispatch.lifecycle.InvalidTransition` and nothing is written.
"""

from __future__ import annotations

import dataclasses
import enum
import json
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Final, NamedTuple

from ..attempt import Delivery
from ..lifecycle import (
    ACTOR_ENQUEUE,
    ENTITY_TYPE,
    PURGED,
    REASON_CODES,
    Reason,
    Source,
    Status,
    check_edge,
)
from ..store.base import Conn
from . import sql

if TYPE_CHECKING:
    from .coalesce import Coalesce

MAX_RETRY_AFTER_SECONDS: Final = 86400.0
"""The longest a destination's ``Retry-After`` may delay the next attempt."""

COUNTER_KEYS: Final = ("attempted", "delivered", "dead_letter", "expired", "retried")
"""The counters of a delivery pass (docs/usage.md says what each counts)."""


class _IdAndHit(NamedTuple):
    id: str
    dedup_hit: bool


class EnqueueResult(_IdAndHit):
    """One enqueue's outcome: the row's id, and whether an existing row with
    the same dedup key answered instead of a new one. It unpacks and
    compares as that pair, ``(id, dedup_hit)``; :attr:`outcome` says what
    the enqueue did: ``"inserted"`` (a new row), ``"replaced"`` (a new row
    in place of its coalesce key's waiting row, now ``superseded``) or
    ``"kept"`` (an existing row answered -- a dedup hit, or a coalesce
    ``keep`` -- and nothing was written)."""

    outcome: str

    def __new__(cls, id: str, dedup_hit: bool, outcome: str | None = None) -> EnqueueResult:
        made = super().__new__(cls, id, dedup_hit)
        made.outcome = outcome or ("kept" if dedup_hit else "inserted")
        return made

    def __repr__(self) -> str:
        return (
            f"EnqueueResult(id={self.id!r}, dedup_hit={self.dedup_hit!r}, outcome={self.outcome!r})"
        )

    def __reduce__(self) -> tuple[object, tuple[str, bool, str]]:
        return (EnqueueResult, (self.id, self.dedup_hit, self.outcome))


class EnqueuedId(str):
    """The id :func:`~trio_dispatch.enqueue_dispatch` returns: a ``str``
    like any id, with the enqueue's :attr:`outcome` (see
    :class:`EnqueueResult`)."""

    outcome: str

    def __new__(cls, value: str, outcome: str = "inserted") -> EnqueuedId:
        made = super().__new__(cls, value)
        made.outcome = outcome
        return made

    def __reduce__(self) -> tuple[object, tuple[str, str]]:
        return (EnqueuedId, (str(self), self.outcome))


@dataclasses.dataclass(frozen=True)
class NewDispatch:
    """A validated enqueue: the row to insert, id, token and envelope made."""

    id: str
    kind: str
    deliver_to: str
    payload: str
    dedup_key: str | None
    max_attempts: int
    ack_required: bool
    ack_token: str | None
    session_id: str | None
    schedule_run_id: str | None
    expires_at: float | None
    ordering_key: str | None = None
    priority: int = 0
    """-10 to 10: its head start among due rows (docs/controls.md)."""
    source: Source = Source.SYSTEM
    """Who enqueued it, for its first transition: :attr:`Source.SYSTEM`, or
    :attr:`Source.SCHEDULES` (stored ``scheduler``) for a schedule's fire."""
    actor: str = ACTOR_ENQUEUE
    note: str = "{}"
    """The first transition's metadata (JSON text)."""
    coalesce: Coalesce | None = None
    """Its coalescing (docs/controls.md), if it has a ``coalesce_key``."""

    @property
    def plain(self) -> bool:
        """No dedup key, no provenance link and no coalesce key: nothing to
        look up first."""
        return (
            self.dedup_key is None
            and self.session_id is None
            and self.schedule_run_id is None
            and self.coalesce is None
        )


@dataclasses.dataclass(frozen=True)
class Claim:
    """One attempt of one dispatch, owned by this process until it finishes
    or its lease (``lease_until``, wall-clock seconds) runs out."""

    dispatch_id: str
    kind: str
    deliver_to: str
    payload: str
    attempt: int
    max_attempts: int
    ack_required: bool
    lease_until: float
    ack_token: str | None = dataclasses.field(default=None, repr=False)
    """Kept to mask it in failure texts: a destination that echoes its input
    must not put the token into ``last_error``, history or a log line."""
    recovered: bool = False
    """The row was ``delivering`` under an earlier claim whose lease ran out."""
    ordering_key: str | None = None
    """The row's ordering key (docs/ordering.md), if any."""
    throttles: int = 0
    """The row's throttled attempts before this one: they kept their
    numbers (the fence) but do not count toward ``max_attempts``."""

    @property
    def counted(self) -> int:
        """This attempt's place in the ``max_attempts`` budget: its number
        less the throttled attempts before it (docs/destinations.md)."""
        return self.attempt - self.throttles

    @property
    def attempts_left(self) -> bool:
        """Whether the budget allows another attempt after this one."""
        return self.counted < self.max_attempts

    def delivery(self) -> Delivery:
        return Delivery(
            dispatch_id=self.dispatch_id,
            kind=self.kind,
            deliver_to=self.deliver_to,
            attempt=self.attempt,
            payload=self.payload,
        )


class Outcome(enum.Enum):
    """What ending an attempt did to its row."""

    DELIVERED = "delivered"
    AWAITING_ACK = "awaiting_ack"
    RETRY = "retry"
    DEAD_LETTER = "dead_letter"
    ACK_TIMEOUT = "ack_timeout"
    THROTTLED = "throttled"
    """The destination asked to be left alone: back to pending, due when it
    allows, the attempt not counted toward ``max_attempts``."""
    RELEASED = "released"
    """Worker shutdown interrupted the attempt, or a local resource error
    kept it from being made: back to pending, due now."""
    CANCELLED = "cancelled"
    """An operator cancelled the dispatch while the attempt ran
    (docs/controls.md#cancel): the attempt, cut or failed, ended the row as
    ``cancelled``."""
    CONFLICT = "conflict"
    """The row was no longer (delivering, this attempt): nothing written."""


@dataclasses.dataclass(frozen=True)
class Change:
    """One status change and the transition row that records it."""

    dispatch_id: str
    previous: str | None
    """The status it had (None: the row is new)."""
    status: str
    """The status it gets, or :data:`~trio_dispatch.lifecycle.PURGED`."""
    reason: Reason
    summary: str
    source: Source
    actor: str
    now: float
    metadata: Mapping[str, Any] | str | None = None
    """A mapping, or already JSON text."""


def _check(change: Change) -> None:
    if change.reason not in REASON_CODES:  # a programming error, never user input
        raise AssertionError(f"unknown reason code {change.reason!r}")
    if change.previous is None:
        if (change.status, change.reason) != (Status.PENDING, Reason.ENQUEUED):
            raise AssertionError(f"a new row starts pending, not {change.status!r}")
    elif change.status == PURGED:
        if change.source is not Source.OPERATOR:
            raise AssertionError("only an operator (or retention) removes a row")
    else:
        check_edge(change.dispatch_id, change.previous, change.status, source=change.source)


def transition_rows(changes: Sequence[Change]) -> list[tuple[Any, ...]]:
    """The :data:`~.sql.INSERT_TRANSITION` parameters of ``changes``, each
    change's edge checked first (raises before anything is written)."""
    rows = []
    for change in changes:
        _check(change)
        metadata = change.metadata
        if not isinstance(metadata, str):
            metadata = json.dumps(dict(metadata or {}))
        rows.append(
            (
                ENTITY_TYPE,
                change.dispatch_id,
                change.previous,
                change.status,
                change.reason,
                change.summary,
                change.source,
                change.actor,
                "[]",
                metadata,
                change.now,
            )
        )
    return rows


def insert_rows(conn: Conn, rows: Sequence[tuple[Any, ...]]) -> None:
    """Insert transition rows built (and checked) by :func:`transition_rows`."""
    if len(rows) == 1:
        conn.execute(sql.INSERT_TRANSITION, rows[0])
    elif rows and conn.dialect.arrays is not None:  # one statement, an array per column
        *texts, created = (list(column) for column in zip(*rows, strict=True))
        # An array holds one type: a caller's clock may give ints among floats.
        conn.execute(conn.dialect.arrays.transitions, [*texts, [float(t) for t in created]])
    elif rows:
        conn.executemany(sql.INSERT_TRANSITION, rows)


def record(conn: Conn, changes: Sequence[Change]) -> None:
    """Check and insert the transition rows of changes being made."""
    insert_rows(conn, transition_rows(changes))
