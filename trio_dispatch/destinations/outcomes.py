"""What the ends of attempts do to their destinations (docs/destinations.md):
the finish side of throttling and the circuit breaker's bookkeeping.

:func:`record_ends` runs inside the transaction that finishes the attempts
(:func:`trio_dispatch.outbox.ends.finish_many`), after the fenced finish
chose which ends applied: an end whose row moved on changes no destination
either. Per destination and batch it writes one row with a few statements,
never one per attempt:

- a throttle (429/503 with ``Retry-After``, ``Throttled``, exit 75) moves
  ``throttled_until`` forward to the end's own ``until`` (never back) on
  any destination, policy or not;
- with a ``breaker``: a success sets the failures in a row back and
  records ``last_success_at`` -- writing only when something changes or
  the last recorded success is a second old, so a busy healthy
  destination is not a hot row -- and closes the breaker when it is the
  half-open breaker's probe; a failure that counts (a transport failure
  or timeout: not a throttle, not 410, not a local not-sent, not a
  failure no retry can fix) adds one, opens the breaker once ``failures``
  of them span ``min_span_seconds``, and re-opens (or disables) it when it
  is the probe's;
- without a breaker, ``last_success_at``/``last_failure_at`` are kept only
  on a destination that already has a row (a pause, a throttle, a limit
  made it), at most once a second per destination and process: a
  destination with no policy pays no write per delivery, and no statement
  at all within that second.

Each change of state as operators see it is an audit row and a log line
(:func:`.state.record_change`); an extension of a running throttle is
not, so a 429 storm over many claimed rows leaves one audit row, not one
per row.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Final, NamedTuple

from ..attempt import TransportResult
from ..store.base import Conn, Row
from .policy import Breaker, Destination, policy_for
from .state import (
    _CLOSED,
    SOURCE_DELIVERY,
    TABLE,
    State,
    effective,
    lock_row,
    read,
    record_change,
    settle,
)

HEALTH_WRITE_SECONDS: Final = 1.0
"""How old a recorded ``last_success_at``/``last_failure_at`` may grow
before a finish writes it again."""
MEMO_LIMIT: Final = 10_000
"""Destinations a :class:`DestinationBook` remembers writes for (outside
input names them, so the memo is bounded: past it, it starts afresh)."""
NAMES_PER_READ: Final = 500
"""Destination names one read of which have a row asks about."""
REASON_LIMIT: Final = 200
"""Characters of an attempt's error kept in a destination's reason."""

_RETURNED: Final = "state, probe_id, probe_until"
SUCCESS_UPDATE: Final = (
    f"UPDATE {TABLE} SET failures = 0, first_failure_at = NULL, last_success_at = ?, "
    "updated_at = ? WHERE name = ? AND (state = 'half_open' OR failures <> 0 "
    "OR first_failure_at IS NOT NULL OR last_success_at IS NULL OR last_success_at < ?) "
    f"RETURNING {_RETURNED}"
)
"""A breaker destination's successes: its failures in a row set back and
its last success recorded, only when that changes something (or the last
success recorded is older than the last parameter); returns the row it
wrote, whose state says whether a probe may have ended."""
INSERT_HEALTHY: Final = (
    f"INSERT INTO {TABLE} (name, state, last_success_at, updated_at) "
    "VALUES (?, 'active', ?, ?) ON CONFLICT (name) DO NOTHING"
)
CLEAR_PROBE: Final = (
    f"UPDATE {TABLE} SET probe_id = NULL, probe_until = NULL, updated_at = ? "
    "WHERE name = ? AND state = 'half_open' AND probe_id = ? AND probe_until = ?"
)
"""A probe that ended neither way (410, not sent, a failure no retry can
fix): another may go."""


def note_health(column: str) -> str:
    """Record ``column`` (``last_success_at`` or ``last_failure_at``) of an
    existing row, unless what it holds is newer than the last parameter."""
    return f"UPDATE {TABLE} SET {column} = ? WHERE name = ? AND ({column} IS NULL OR {column} < ?)"


_NOTE_SUCCESS: Final = note_health("last_success_at")
_NOTE_FAILURE: Final = note_health("last_failure_at")


class Signal(enum.Enum):
    """What one attempt's end says about its destination."""

    SUCCESS = "success"
    FAILURE = "failure"
    """A failure that counts toward the breaker: the transport failed or
    timed out."""
    THROTTLE = "throttle"
    NEUTRAL = "neutral"
    """Says nothing of the destination's health: 410 gone, an attempt not
    sent for a local reason, a failure no retry can fix (E2BIG, an
    unreadable row)."""


def signal_of(result: TransportResult) -> Signal:
    """How ``result`` counts for its destination. A throttle is a throttle
    even when its row has used up its 20 (the row then counts it as an
    ordinary failure, the destination still waits and the breaker does
    not count it: the destination answered)."""
    if result.ok:
        return Signal.SUCCESS
    if result.throttled:
        return Signal.THROTTLE
    if result.local or result.gone or result.permanent:
        return Signal.NEUTRAL
    return Signal.FAILURE


class Effects:
    """What one attempt's end did to its destination's breaker, for the
    worker's metrics: ``(deliver_to, state it went to)`` per change. The
    unit of work that finishes the attempt may run again after a rollback
    (group commit), so each run clears it first; once the write returned,
    what it holds was committed."""

    __slots__ = ("too_late", "transitions")

    def __init__(self) -> None:
        self.transitions: list[tuple[str, State]] = []
        self.too_late = False
        """The end was a success an operator's cancel reached too late
        (docs/controls.md): recorded as a success, the cancel taken back."""

    def clear(self) -> None:
        self.transitions.clear()
        self.too_late = False


class Ended(NamedTuple):
    """One applied attempt end, as its destination sees it (a tuple: one
    is made per delivery)."""

    destination: str
    dispatch_id: str
    lease_until: float
    """The claim's lease end: with ``dispatch_id``, which probe it was."""
    signal: Signal
    now: float
    actor: str
    book: DestinationBook
    """The finishing worker's policies and memo."""
    until: float | None = None
    """THROTTLE: no attempt to the destination starts before this."""
    detail: str | None = None
    """The attempt's error text (the audit's reason for a throttle or an
    opened breaker)."""
    effects: Effects | None = None


class DestinationBook:
    """The destinations' policies as a worker has them, and what this
    process last wrote of each destination's health (to write it at most
    once a second). Thread-safe for its use: the memo is a plain mapping
    whose lost update only means one more write."""

    def __init__(self, policies: Mapping[str, Destination] | None = None) -> None:
        self.policies: dict[str, Destination] = dict(policies or {})
        self._written: dict[tuple[str, str], float] = {}
        self._ensured: set[str] = set()

    def policy(self, name: str) -> Destination:
        """The policy of ``deliver_to`` ``name`` (:func:`.policy.policy_for`)."""
        return policy_for(self.policies, name)

    def due(self, name: str, column: str, now: float) -> bool:
        """Whether ``column`` of ``name`` is to be written now (not written
        by this process in the last :data:`HEALTH_WRITE_SECONDS`); says so
        once per second."""
        key = (name, column)
        last = self._written.get(key)
        if last is not None and now - last < HEALTH_WRITE_SECONDS:
            return False
        if len(self._written) >= MEMO_LIMIT:
            self._written.clear()
        self._written[key] = now
        return True

    def ensured(self, name: str) -> bool:
        """Whether this process made sure ``name`` has a row; from now on,
        it has."""
        if name in self._ensured:
            return True
        if len(self._ensured) >= MEMO_LIMIT:
            self._ensured.clear()
        self._ensured.add(name)
        return False


DEFAULT_BOOK: Final = DestinationBook()
"""The book of a finish given none: no policies (every destination's
throttle capped at the default ``throttle_max_seconds``, no breaker)."""


def throttle_wait(retry_after: float | None, backoff: float, policy: Destination) -> float:
    """Seconds a throttled destination (and its row) waits: the delay it
    asked for -- its row's next backoff step when it gave none -- capped at
    the policy's ``throttle_max_seconds``."""
    wait = backoff if retry_after is None else retry_after
    return max(0.0, min(wait, float(policy.throttle_max_seconds)))


def record_ends(conn: Conn, ended: Sequence[Ended]) -> None:
    """Turn the applied ends into their destinations' state, in the
    caller's transaction (see the module docstring). Destinations are
    locked in name order, the same order for every finish, so two
    workers' finishes cannot deadlock on them."""
    by_name: dict[str, list[Ended]] = {}
    for end in ended:
        by_name.setdefault(end.destination, []).append(end)
    notes: list[tuple[str, str, float]] = []
    for name in sorted(by_name) if len(by_name) > 1 else by_name:
        events = by_name[name]
        book = events[0].book
        breaker = book.policy(name).gcra_breaker
        throttled = failed = False
        for event in events:
            throttled = throttled or event.signal is Signal.THROTTLE
            failed = failed or event.signal is Signal.FAILURE
        if throttled or (breaker is not None and failed):
            _settle_locked(conn, name, events, breaker)
        elif breaker is not None:
            _successes(conn, name, events, book)
        else:
            notes += _health_due(name, events, book)
    _note_health(conn, notes)


def _health_due(
    name: str, events: Iterable[Ended], book: DestinationBook
) -> list[tuple[str, str, float]]:
    """A destination without a breaker: its last success and last failure
    to note (``(name, statement, at)``), once a second at most."""
    succeeded = failed = None
    for event in events:
        if event.signal is Signal.SUCCESS:
            succeeded = event.now if succeeded is None else max(succeeded, event.now)
        elif event.signal is Signal.FAILURE:
            failed = event.now if failed is None else max(failed, event.now)
    return [
        (name, statement, at)
        for at, statement, column in (
            (succeeded, _NOTE_SUCCESS, "last_success_at"),
            (failed, _NOTE_FAILURE, "last_failure_at"),
        )
        if at is not None and book.due(name, column, at)
    ]


def _note_health(conn: Conn, notes: Sequence[tuple[str, str, float]]) -> None:
    """Write the notes of destinations that have a row (in name order): a
    finish of many destinations asks once which of them have one, instead
    of one statement each for rows that mostly do not exist (a row made
    meanwhile misses one note, written again within a second)."""
    if len(notes) > 1:
        names = sorted({name for name, _, _ in notes})
        present: set[str] = set()
        for start in range(0, len(names), NAMES_PER_READ):
            chunk = names[start : start + NAMES_PER_READ]
            marks = ", ".join("?" * len(chunk))
            read = f"SELECT name FROM {TABLE} WHERE name IN ({marks})"
            present.update(row["name"] for row in conn.query(read, chunk))
        notes = [note for note in notes if note[0] in present]
    for name, statement, at in notes:
        conn.execute(statement, (at, name, at - HEALTH_WRITE_SECONDS))


def _is_probe(row: Mapping[str, Any], event: Ended) -> bool:
    return bool(
        row["state"] == State.HALF_OPEN
        and row["probe_id"] == event.dispatch_id
        and row["probe_until"] is not None
        and float(row["probe_until"]) == event.lease_until
    )


def _successes(conn: Conn, name: str, events: Sequence[Ended], book: DestinationBook) -> None:
    """A breaker destination whose ends in this batch are successes (and
    neutral ends): a conditional update, which writes (and locks) nothing
    when nothing changes; the probe, if one of them is it, closes the
    breaker."""
    successes = [event for event in events if event.signal is Signal.SUCCESS]
    if successes:
        at = max(event.now for event in successes)
        written = conn.query(SUCCESS_UPDATE, (at, at, name, at - HEALTH_WRITE_SECONDS))
        if written:
            row = written[0]
            probe = next((event for event in successes if _is_probe(row, event)), None)
            if probe is not None:
                _close(conn, name, probe)
        elif not book.ensured(name):
            conn.execute(INSERT_HEALTHY, (name, at, at))
    for event in events:
        if event.signal is Signal.NEUTRAL:
            conn.execute(CLEAR_PROBE, (event.now, name, event.dispatch_id, event.lease_until))


def _close(conn: Conn, name: str, probe: Ended) -> None:
    conn.execute(
        f"UPDATE {TABLE} SET {', '.join(f'{column} = ?' for column in _CLOSED)}, "
        "last_success_at = ?, updated_at = ? WHERE name = ?",
        (*_CLOSED.values(), probe.now, probe.now, name),
    )
    _audit(conn, name, probe, State.HALF_OPEN, State.ACTIVE, "probe succeeded")


def _audit(
    conn: Conn,
    name: str,
    event: Ended,
    previous: State,
    state: State,
    reason: str,
    until: float | None = None,
) -> None:
    record_change(
        conn,
        name,
        previous,
        state,
        reason=reason,
        source=SOURCE_DELIVERY,
        actor=event.actor,
        now=event.now,
        until=until,
    )
    if state is not State.THROTTLED and event.effects is not None:
        event.effects.transitions.append((name, state))


def _detail(event: Ended) -> str:
    return (event.detail or "")[:REASON_LIMIT]


class _Working:
    """A destination's row as this batch changes it: the values read
    (locked), the assignments made."""

    def __init__(self, row: Row) -> None:
        self.row: dict[str, Any] = dict(row)
        self.changed: dict[str, Any] = {}

    def put(self, **values: Any) -> None:
        for column, value in values.items():
            if self.row.get(column) != value:
                self.row[column] = value
                self.changed[column] = value


def _settle_locked(conn: Conn, name: str, events: Sequence[Ended], breaker: Breaker | None) -> None:
    """A throttle, or a breaker destination's counted failure: read the
    row locked, apply the batch's ends in order, write what changed in one
    statement, with an audit row per change of state."""
    first = events[0].now
    row = lock_row(conn, name)
    if row["state"] == State.PAUSED:
        settle(conn, name, row, first)  # a pause whose end passed: recorded first
        row = read(conn, name) or row
    work = _Working(row)
    for event in events:
        probe = _is_probe(work.row, event)
        if event.signal is Signal.THROTTLE:
            _throttle(conn, name, work, event)
            if probe:  # the destination answered, busy: another probe may go after
                work.put(probe_id=None, probe_until=None)
        elif event.signal is Signal.SUCCESS:
            work.put(last_success_at=event.now)
            if breaker is not None:
                work.put(failures=0, first_failure_at=None)
                if probe:
                    work.put(**_CLOSED)
                    _audit(conn, name, event, State.HALF_OPEN, State.ACTIVE, "probe succeeded")
        elif event.signal is Signal.FAILURE:
            work.put(last_failure_at=event.now)
            if breaker is not None:
                _count_failure(conn, name, work, event, breaker, probe)
        elif probe:
            work.put(probe_id=None, probe_until=None)
    if work.changed:
        at = max(event.now for event in events)
        columns = ", ".join(f"{column} = ?" for column in work.changed)
        conn.execute(
            f"UPDATE {TABLE} SET {columns}, updated_at = ? WHERE name = ?",
            (*work.changed.values(), at, name),
        )


def _throttle(conn: Conn, name: str, work: _Working, event: Ended) -> None:
    """The destination waits until ``event.until`` at least. Only a
    destination that was not throttled (nor paused, open, half-open or
    disabled) gets an audit row: extensions of a running throttle -- the
    other rows claimed before it began coming back throttled, or the next
    429 after the wait -- write none, so the audit stays readable under a
    429 storm."""
    assert event.until is not None
    if event.until <= event.now:  # "Retry-After: 0": the row waits nothing, nor does it
        return
    before = effective(work.row, event.now)
    current = work.row["throttled_until"]
    if current is None or event.until > float(current):
        work.put(throttled_until=event.until)
    if before.state is State.ACTIVE:
        reason = _detail(event) or "throttled"
        work.put(reason=reason)
        _audit(conn, name, event, State.ACTIVE, State.THROTTLED, reason, until=event.until)


def _count_failure(
    conn: Conn, name: str, work: _Working, event: Ended, breaker: Breaker, probe: bool
) -> None:
    row = work.row
    failures = int(row["failures"] or 0) + 1
    first = event.now if row["first_failure_at"] is None else float(row["first_failure_at"])
    work.put(failures=failures, first_failure_at=first)
    now = event.now
    if probe:
        opened = float(row["opened_at"]) if row["opened_at"] is not None else now
        limit = breaker.disable_after_seconds
        if limit is not None and now - opened >= limit:
            reason = f"open for {now - opened:g}s (disable_after_seconds {limit:g})"
            work.put(state=str(State.DISABLED), state_until=None, reason=reason)
            work.put(probe_id=None, probe_until=None)
            _audit(conn, name, event, State.HALF_OPEN, State.DISABLED, reason)
            return
        cool_down = breaker.next_cool_down(
            None if row["cool_down"] is None else float(row["cool_down"])
        )
        reason = f"probe failed: {_detail(event)}".rstrip(": ")
        work.put(state=str(State.OPEN), state_until=now + cool_down, cool_down=cool_down)
        work.put(reason=reason, probe_id=None, probe_until=None)
        _audit(conn, name, event, State.HALF_OPEN, State.OPEN, reason, until=now + cool_down)
        return
    if (
        row["state"] == State.ACTIVE
        and failures >= breaker.failures
        and now - first >= breaker.min_span_seconds
    ):
        before = effective(row, now).state  # active, or throttled
        cool_down = float(breaker.cool_down_seconds)
        reason = f"{failures} failed attempts in a row over {now - first:g}s"
        if event.detail:
            reason += f"; last: {_detail(event)}"
        work.put(state=str(State.OPEN), state_until=now + cool_down, cool_down=cool_down)
        work.put(opened_at=now, reason=reason)
        _audit(conn, name, event, before, State.OPEN, reason, until=now + cool_down)
