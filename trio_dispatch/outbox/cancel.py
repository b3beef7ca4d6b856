"""Cancel (docs/controls.md): an operator ends a dispatch that has not been
delivered, whether it waits or is being sent.

- A ``pending`` row becomes ``cancelled`` at once
  (``dispatch.cancelled.operator``, source ``operator``); a keyed row's
  next row goes, as when a head ends.
- A ``delivering`` row whose attempt runs is *marked*
  (``cancel_requested_at``, with who asked and why), fenced on that
  attempt, and in the same transaction the workers are told
  (PostgreSQL: a notice on :data:`~trio_dispatch.store.dialect.CANCEL_CHANNEL`
  carrying the id; SQLite: the commit itself, which every listening
  worker's commit watch sees; in this process: the store's cancel
  listeners). The worker running the attempt cuts it -- a command's
  process group killed, a callable's scope cancelled, an HTTP request
  dropped -- and its fenced finish records ``cancelled``, source
  ``scheduler``. The finish decides: an attempt that succeeded before the
  cancel reached it keeps its success, and the cancel is *too late*
  (:class:`~trio_dispatch.errors.CancelTooLate`); the transition of that
  success names the cancel.
- A ``delivering`` row whose lease has already run out has no worker
  sending it (its worker died, or is past the point where it may send): the
  operator's cancel records ``cancelled`` at once, fenced on that attempt.
  A mark whose worker dies before acting on it is carried out by lease
  recovery: the next claim that finds the row records ``cancelled``
  instead of attempting it again.
- Any other status is refused (:class:`~trio_dispatch.errors.InvalidTransition`
  naming it), and so is a second cancel of a cancelled row.

Cancels of every row a filter matches are :func:`.bulk.cancel_dispatches`.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from functools import partial
from typing import Any, Final, Literal, cast

import anyio

from ..errors import CancelTooLate, DispatchNotFound
from ..lifecycle import InvalidTransition, Reason, Source, Status
from ..store.base import Conn, Database, Row, Store
from ..validate import (
    clock_from,
    findable,
    require_dispatch_id,
    require_number,
    require_reason,
)
from . import sql
from .ends import cancel_attempt, is_attempt, marked
from .machine import Claim, cas_status
from .ordering import lock_keys
from .reads import get_row

CANCELLABLE: Final = (Status.PENDING, Status.DELIVERING)
"""The statuses a cancel applies to."""
DEFAULT_CANCEL_WAIT_SECONDS: Final = 10.0
"""How long :func:`cancel_dispatch` waits, by default, for the worker of a
running attempt to record the cancel (it cuts the attempt within a second;
a command's group gets its ``kill_grace_seconds`` after SIGTERM)."""
CANCEL_POLL_SECONDS: Final = 0.05
"""How often a waiting cancel reads its row again."""
_SELECT: Final = (
    "SELECT id, status, attempt, ordering_key, next_attempt_at FROM dispatch_outbox WHERE id = ?"
)

Applied = Literal["cancelled", "marked", "refused"]
"""What a cancel did to one row: ended it, marked its running attempt, or
nothing (its status has no cancel)."""


@dataclasses.dataclass(frozen=True)
class CancelResult:
    """What :func:`cancel_dispatch` did."""

    id: str
    status: Status
    """``cancelled``; or ``delivering``: the cancel is asked for and the
    worker running the attempt has not recorded it yet (no wait, or none
    long enough). It is carried out when that worker hears it, or by lease
    recovery once the attempt's lease ends -- unless the attempt succeeds
    first."""
    previous: Status
    """The row's status when the cancel came: ``pending`` or ``delivering``."""
    attempt: int
    """The row's attempt when the cancel came (0: never attempted)."""

    @property
    def cancelled(self) -> bool:
        return self.status == Status.CANCELLED

    @property
    def requested(self) -> bool:
        """Asked for and still to be recorded (see :attr:`status`)."""
        return self.status == Status.DELIVERING

    def to_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "status": str(self.status),
            "previous": str(self.previous),
            "attempt": self.attempt,
            "cancelled": self.cancelled,
            "requested": self.requested,
        }


def request_json(actor: str, reason: str | None, metadata: Mapping[str, Any] | None) -> str:
    """A cancel's request as stored on a marked row: who asked, why, and
    the caller's ``metadata`` (a dashboard's client address)."""
    note: dict[str, Any] = {"requested_by": actor, **(metadata or {})}
    if reason is not None:
        note["reason"] = reason
    return json.dumps(note)


def cancel_row(
    conn: Conn,
    dispatch_id: str,
    now: float,
    actor: str,
    reason: str | None = None,
    metadata: Mapping[str, Any] | None = None,
) -> tuple[Applied, Row] | None:
    """Cancel one row inside the caller's transaction (see the module's
    promises): None if there is no such row, else what was done and the
    row as the cancel found it. The row's key lock, then the row itself
    (PostgreSQL: ``FOR UPDATE``) are held while it decides, so a finish
    committing meanwhile is seen, never overwritten."""
    found = conn.query_one(_SELECT, (dispatch_id,))
    if found is None:
        return None
    lock_keys(conn, [found["ordering_key"]])  # keys before rows: one order everywhere
    row = conn.query_one(_SELECT + conn.dialect.row_lock, (dispatch_id,))
    if row is None:
        return None
    note = {"reason": reason} if reason is not None else {}
    note.update(metadata or {})
    status = row["status"]
    if status == Status.PENDING:
        summary = f"cancelled by an operator while pending (after {row['attempt']} attempts)"
        changed = cas_status(
            conn,
            row,
            Status.CANCELLED,
            Reason.CANCELLED_OPERATOR,
            summary if reason is None else f"{summary}: {reason}",
            source=Source.OPERATOR,
            actor=actor,
            now=now,
            metadata=note,
        )
        return _ended(conn, row, changed)
    if status != Status.DELIVERING:
        return "refused", row
    attempt, lease = int(row["attempt"]), float(row["next_attempt_at"])
    if lease <= now:
        # No worker may still be sending it: its own cut came before the
        # lease's end (less a margin), as for lease recovery.
        changed = cancel_attempt(
            conn,
            dispatch_id,
            attempt,
            lease,
            row["ordering_key"],
            now=now,
            actor=actor,
            source=Source.OPERATOR,
            summary=f"cancelled by an operator; the lease of attempt {attempt} had run out "
            "with no worker holding it",
            metadata={**note, "lease_until": lease},
        )
        return _ended(conn, row, changed)
    conn.execute(
        sql.MARK_CANCEL, (now, request_json(actor, reason, metadata), dispatch_id, attempt, lease)
    )
    if conn.dialect.cancel_notice:  # delivered to listeners when this commits
        conn.execute(conn.dialect.cancel_notice, (dispatch_id,))
    return "marked", row


def _ended(conn: Conn, row: Row, changed: bool) -> tuple[Applied, Row]:
    if changed and row["ordering_key"] is not None:
        # Its key's next row is due now: workers on other hosts look.
        conn.announce_enqueue()
    return ("cancelled" if changed else "refused"), row


def _refusal(dispatch_id: str, status: str) -> InvalidTransition:
    if status == Status.CANCELLED:
        why = "it is already cancelled"
    else:
        why = f"only {' or '.join(CANCELLABLE)} dispatches can be cancelled; it is {status}"
    return InvalidTransition(dispatch_id, status, Status.CANCELLED, why)


async def cancel_dispatch(
    db: Database,
    dispatch_id: str,
    reason: str | None = None,
    *,
    wait_seconds: float = DEFAULT_CANCEL_WAIT_SECONDS,
    now: float | None = None,
    actor: str = "cancel_dispatch",
    metadata: Mapping[str, Any] | None = None,
) -> CancelResult:
    """Cancel one dispatch (docs/controls.md) and say what came of it.

    A ``pending`` row (or a ``delivering`` one whose lease has run out) is
    ``cancelled`` at once. A running attempt is marked, its worker told,
    and this waits up to ``wait_seconds`` for that worker's finish: the
    result's status is then ``cancelled``, or still ``delivering`` if the
    worker has not answered yet (the cancel stays asked for; see
    :attr:`CancelResult.status`). ``reason`` (one line, at most 500
    characters) and ``metadata`` go into the transition; ``actor`` names
    who asked.

    Raises :class:`~trio_dispatch.errors.DispatchNotFound` (a
    ``LookupError``) for an unknown id,
    :class:`~trio_dispatch.errors.CancelTooLate` when the attempt succeeded
    before the cancel reached it (its status, e.g. ``delivered``, says
    what came of it), and :class:`~trio_dispatch.errors.InvalidTransition`
    for any other status (the message names it), before anything is
    written; a bad value raises ``ValueError``/``TypeError`` naming it.
    Given a transaction handle, the cancel commits with the caller's
    transaction and does not wait. Cancelled while it waits, the cancel it
    wrote stays written."""
    dispatch_id = require_dispatch_id(dispatch_id)
    why = require_reason(reason)
    wait = require_number("wait_seconds", wait_seconds, minimum=0.0)
    clock = clock_from(now)
    if not findable(dispatch_id):
        raise DispatchNotFound(dispatch_id)
    done = await db.write(
        partial(
            cancel_row,
            dispatch_id=dispatch_id,
            now=clock(),
            actor=actor,
            reason=why,
            metadata=metadata,
        )
    )
    if done is None:
        raise DispatchNotFound(dispatch_id)
    applied, row = done
    previous, attempt = Status(row["status"]), int(row["attempt"])
    if applied == "refused":
        raise _refusal(dispatch_id, previous)
    store = cast(Store, db) if hasattr(db, "transaction") else None
    if applied == "cancelled":
        if store is not None and row["ordering_key"] is not None:
            store.notify_enqueued()  # its key's next row is due: wake this process's worker
        return CancelResult(dispatch_id, Status.CANCELLED, previous, attempt)
    if store is None:  # a caller's transaction: nothing is committed before it is
        return CancelResult(dispatch_id, Status.DELIVERING, previous, attempt)
    store.notify_cancel(dispatch_id)  # a worker of this process hears at once
    after = await _decision(db, dispatch_id, attempt, float(row["next_attempt_at"]), wait)
    if after is None:
        raise DispatchNotFound(dispatch_id)  # purged once its attempt ended
    status = Status(after["status"])
    if status == Status.CANCELLED:
        return CancelResult(dispatch_id, status, previous, attempt)
    if status == Status.DELIVERING and int(after["attempt"]) == attempt:
        return CancelResult(dispatch_id, status, previous, attempt)
    raise CancelTooLate(
        dispatch_id,
        status,
        f"attempt {attempt} succeeded before the cancel reached it; it is {status} now",
    )


async def _decision(
    db: Database, dispatch_id: str, attempt: int, lease: float, wait: float
) -> Row | None:
    """The row once attempt ``attempt`` (leased until ``lease``) has ended,
    or as it is after ``wait`` seconds; None if it is gone."""
    deadline = anyio.current_time() + wait
    while True:
        row = await db.read(partial(get_row, dispatch_id=dispatch_id))
        if (
            row is None
            or row["status"] != Status.DELIVERING
            or int(row["attempt"]) != attempt
            or float(row["next_attempt_at"]) != lease
        ):
            return row
        left = deadline - anyio.current_time()
        if left <= 0:
            return row
        await anyio.sleep(min(CANCEL_POLL_SECONDS, left))


async def marked_attempts(db: Database, claims: list[Claim]) -> list[Claim]:
    """Which of ``claims`` (attempts a worker runs) an operator has
    cancelled: their rows are still at those attempts, marked. One read
    (a primary-key probe per claim)."""
    if not claims:
        return []
    ids = [claim.dispatch_id for claim in claims]
    found = await db.read(partial(marked, ids=ids))
    return [claim for claim in claims if is_attempt(found.get(claim.dispatch_id), claim)]


__all__ = [
    "CANCELLABLE",
    "DEFAULT_CANCEL_WAIT_SECONDS",
    "CancelResult",
    "cancel_dispatch",
    "cancel_row",
    "marked_attempts",
]
