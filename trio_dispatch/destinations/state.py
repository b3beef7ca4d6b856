"""A destination's runtime state, shared by every worker on the store: the
``dispatch_destinations`` row of each destination that has ever had state,
and the ``dispatch_destination_changes`` audit of every change of it.

A destination without a row is ``active``. The columns (schema version 10):

- ``state``: the stored state, one of ``active``, ``paused``, ``open``,
  ``half_open``, ``disabled`` (``throttled`` is not stored: it is an
  ``active`` destination whose ``throttled_until`` is still ahead).
- ``state_until``: ``paused``: when the pause lifts itself (NULL: when an
  operator resumes it); ``open``: when its cool-down ends and one probe may
  go.
- ``reason``: why the stored state is what it is (operator text or a code).
- ``throttled_until``: no attempt starts before this (a 429, a
  ``Throttled``, exit 75); kept whatever ``state`` is.
- ``rate_tat``: the rate limit's theoretical arrival time (GCRA): the rate
  admits ``n`` more starts at time ``t`` while ``max(rate_tat, t) + n *
  interval - t <= burst * interval``.
- ``rate_held`` (version 16): starts the rate counts as spent now, claimed
  ahead by workers and not yet begun (:mod:`trio_dispatch.outbox.claim.pins`):
  ``n`` more are admitted while ``max(rate_tat, t) + (n + rate_held) *
  interval - t <= burst * interval``.
- ``failures``, ``first_failure_at``: failed attempts in a row and when the
  first of them ended (the breaker); a success sets both back.
- ``cool_down``: the last cool-down of an opened breaker (doubles per failed
  probe); ``opened_at``: when it first opened (``disable_after_seconds``).
- ``probe_id``, ``probe_until``: the one probe of a ``half_open`` breaker
  and its lease end (past it, the probe is lost and another may go).
- ``last_success_at``, ``last_failure_at``, ``updated_at``.

Every function here that writes is a unit of work (or part of one): it runs
in the caller's write transaction and writes the state change together with
its audit row, so both commit or neither does. On PostgreSQL a change locks
the destination's row (``SELECT ... FOR UPDATE`` through :func:`lock_row`),
so the claim's admission and an operator's change are serialized.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
from collections.abc import Mapping
from typing import Any, Final

from ..redact import scrubbed_logger, visible
from ..store.base import Conn, Row

log = scrubbed_logger("trio_dispatch.destinations")

TABLE: Final = "dispatch_destinations"
CHANGES_TABLE: Final = "dispatch_destination_changes"


class State(enum.StrEnum):
    """What a destination is doing now, as operators see it."""

    ACTIVE = "active"
    """Claims take its rows within its limits."""
    PAUSED = "paused"
    """An operator paused it: its rows wait, consuming no attempt."""
    THROTTLED = "throttled"
    """It asked to be left alone (429/503 ``Retry-After``, ``Throttled``,
    exit 75) until ``throttled_until``."""
    OPEN = "open"
    """Its breaker opened: no claims until the cool-down ends."""
    HALF_OPEN = "half_open"
    """Its breaker's cool-down ended: one probe may go (or is going)."""
    DISABLED = "disabled"
    """Its breaker stayed open too long: no claims until an operator
    enables it."""


STORED_STATES: Final = (State.ACTIVE, State.PAUSED, State.OPEN, State.HALF_OPEN, State.DISABLED)
"""The values the ``state`` column holds (``throttled`` is derived)."""
STATE_CHECK_SQL: Final = f"state IN ({', '.join(repr(str(state)) for state in STORED_STATES)})"

SOURCE_OPERATOR: Final = "operator"
SOURCE_DELIVERY: Final = "scheduler"
"""The ``source`` of a change the delivery loop makes (breaker, throttle),
spelled as on the dispatches' own transitions."""

COLUMNS: Final = (
    "name, state, state_until, reason, throttled_until, rate_tat, rate_held, failures, "
    "first_failure_at, cool_down, opened_at, probe_id, probe_until, last_success_at, "
    "last_failure_at, updated_at"
)

SELECT_ONE: Final = f"SELECT {COLUMNS} FROM {TABLE} WHERE name = ?"
SELECT_ALL: Final = f"SELECT {COLUMNS} FROM {TABLE} ORDER BY name"
ENSURE: Final = (
    f"INSERT INTO {TABLE} (name, state) VALUES (?, 'active') ON CONFLICT (name) DO NOTHING"
)
INSERT_CHANGE: Final = (
    f"INSERT INTO {CHANGES_TABLE} (destination, previous_state, state, reason, source, actor, "
    "until_at, created_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?)"
)
SELECT_CHANGES: Final = (
    "SELECT id, destination, previous_state, state, reason, source, actor, until_at, created_at "
    f"FROM {CHANGES_TABLE} WHERE destination = ? ORDER BY id DESC LIMIT ?"
)


@dataclasses.dataclass(frozen=True)
class Seen:
    """A destination's state as it stands at a moment: the state, until when
    (None: until something changes it) and why."""

    state: State
    until: float | None
    reason: str | None


def effective(row: Mapping[str, Any] | None, now: float) -> Seen:
    """What the stored ``row`` (None: no row) means at ``now``: a pause whose
    end passed and a throttle that ran out read as ``active``; an open
    breaker whose cool-down ended reads as ``half_open`` (a probe may go).
    Reads only."""
    if row is None:
        return Seen(State.ACTIVE, None, None)
    stored = State(row["state"])
    until = row["state_until"]
    reason = row["reason"]
    if stored is State.PAUSED and (until is None or until > now):
        return Seen(State.PAUSED, until, reason)
    if stored is State.DISABLED:
        return Seen(State.DISABLED, None, reason)
    if stored is State.OPEN:
        if until is not None and until > now:
            return Seen(State.OPEN, until, reason)
        return Seen(State.HALF_OPEN, None, reason)
    if stored is State.HALF_OPEN:
        return Seen(State.HALF_OPEN, row["probe_until"], reason)
    throttled = row["throttled_until"]
    if throttled is not None and throttled > now:
        return Seen(State.THROTTLED, throttled, row["reason"] if stored is State.ACTIVE else None)
    return Seen(State.ACTIVE, None, None)


def read(conn: Conn, name: str) -> Row | None:
    """The stored row of ``name`` (None: never had state)."""
    return conn.query_one(SELECT_ONE, (name,))


def lock_row(conn: Conn, name: str) -> Row:
    """The row of ``name``, created ``active`` if absent, locked until the
    transaction ends where rows lock (PostgreSQL); SQLite's single writer
    serializes without it. Read in a statement that starts after the lock,
    so it sees every change committed before."""
    conn.execute(ENSURE, (name,))
    row = conn.query_one(SELECT_ONE + conn.dialect.row_lock, (name,))
    assert row is not None  # ensured above, in this transaction
    return row


def record_change(
    conn: Conn,
    name: str,
    previous: State,
    state: State,
    *,
    reason: str | None,
    source: str,
    actor: str,
    now: float,
    until: float | None = None,
) -> None:
    """The audit row of one change of ``name`` from ``previous`` to
    ``state`` (in the caller's transaction) and its log line: WARNING when a
    breaker opens or a destination is disabled, INFO otherwise."""
    conn.execute(
        INSERT_CHANGE, (name, str(previous), str(state), reason, source, actor, until, now)
    )
    level = logging.WARNING if state in (State.OPEN, State.DISABLED) else logging.INFO
    log.log(
        level,
        "destination %s: %s -> %s%s%s (%s %s)",
        visible(name),
        previous,
        state,
        "" if until is None else f" until {until:.3f}",
        "" if not reason else f": {visible(reason)}",
        source,
        visible(actor),
    )


def _set(conn: Conn, name: str, assignments: Mapping[str, Any], now: float) -> None:
    columns = ", ".join(f"{column} = ?" for column in assignments)
    conn.execute(
        f"UPDATE {TABLE} SET {columns}, updated_at = ? WHERE name = ?",
        (*assignments.values(), now, name),
    )


_CLOSED: Final[Mapping[str, Any]] = {
    "state": str(State.ACTIVE),
    "state_until": None,
    "reason": None,
    "failures": 0,
    "first_failure_at": None,
    "cool_down": None,
    "opened_at": None,
    "probe_id": None,
    "probe_until": None,
}
"""The assignments that leave a destination ``active`` with its breaker
closed and counting afresh."""


def _move(
    conn: Conn,
    name: str,
    previous: State,
    assignments: Mapping[str, Any],
    *,
    reason: str | None,
    actor: str,
    now: float,
    source: str = SOURCE_OPERATOR,
) -> None:
    """Write ``assignments`` to ``name``'s row and the audit row of its
    change from ``previous`` to the state they set."""
    _set(conn, name, assignments, now)
    until = assignments.get("state_until")
    record_change(
        conn,
        name,
        previous,
        State(assignments["state"]),
        reason=reason,
        source=source,
        actor=actor,
        now=now,
        until=until,
    )


def pause(
    conn: Conn, name: str, until: float | None, reason: str | None, actor: str, now: float
) -> Seen:
    """Pause ``name`` until ``until`` (None: until resumed). Returns the
    state it had. A pause replaces whatever the breaker was doing; resume
    starts it afresh."""
    before = effective(lock_row(conn, name), now)
    paused = {**_CLOSED, "state": str(State.PAUSED), "state_until": until, "reason": reason}
    _move(conn, name, before.state, paused, reason=reason, actor=actor, now=now)
    return before


def resume(conn: Conn, name: str, reason: str | None, actor: str, now: float) -> Seen | None:
    """Lift ``name``'s pause. Returns the state it had, or None (nothing
    written) when it was not paused -- a pause whose end passed included,
    which :func:`settle` records."""
    row = lock_row(conn, name)
    before = effective(row, now)
    if before.state is not State.PAUSED:
        settle(conn, name, row, now)
        return None
    _move(conn, name, State.PAUSED, _CLOSED, reason=reason, actor=actor, now=now)
    return before


def enable(conn: Conn, name: str, reason: str | None, actor: str, now: float) -> Seen | None:
    """Close ``name``'s breaker -- disabled, open or half-open -- so claims
    take its rows again, counting failures afresh. Returns the state it
    had, or None (nothing written) when its breaker was closed."""
    row = lock_row(conn, name)
    before = effective(row, now)
    if State(row["state"]) not in (State.DISABLED, State.OPEN, State.HALF_OPEN):
        return None
    _move(conn, name, before.state, _CLOSED, reason=reason, actor=actor, now=now)
    return before


def settle(conn: Conn, name: str, row: Mapping[str, Any] | None, now: float) -> None:
    """Record what time alone changed in ``row`` (``name``'s, read in this
    transaction, locked where rows lock): a pause whose end passed becomes
    ``active`` with its audit row. Idempotent; writes nothing otherwise."""
    if row is None or State(row["state"]) is not State.PAUSED:
        return
    until = row["state_until"]
    if until is None or until > now:
        return
    _move(
        conn,
        name,
        State.PAUSED,
        _CLOSED,
        reason="pause ended",
        actor="pause",
        now=now,
        source=SOURCE_DELIVERY,
    )


def changes(conn: Conn, name: str, limit: int = 50) -> list[Row]:
    """The newest ``limit`` audit rows of ``name``, newest first."""
    return conn.query(SELECT_CHANGES, (name, limit))
