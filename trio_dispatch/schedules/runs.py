"""A schedule's writes and reads in the store (docs/schedules.md): firing a
tick, firing a manual run, pausing, and what the operators see.

A tick fires in one transaction: the schedule's cursor moves past it (only
if no one moved it there already, the schedule is not paused and the tick
is due by the store's clock: the database server's on PostgreSQL), its
``schedule_runs`` row goes in (unique on ``(schedule, scheduled_for)``) and
its dispatch with ``schedule_run_id`` pointing at the run, made by the
outbox's one entry point (:class:`~trio_dispatch.outbox.enqueue.EnqueueCall`:
its checks, the store's body limit, the ``create`` span) and written by the
outbox's insert, source :attr:`~trio_dispatch.lifecycle.Source.SCHEDULES`
and actor ``schedule:NAME``. A worker that
loses the race changes nothing, so any number of workers, processes or
hosts give one dispatch per tick. Every function here takes a connection
inside a transaction (a unit of work of ``Database.write``/``read``).

Definitions: workers may hold different definitions of one schedule name (a
rolling deploy that changes its cron). The store records the one in force
(its :attr:`~.spec.Schedule.fingerprint`), and a tick fires only with it:
the cursor's UPDATE requires it, so the ticks of two definitions never mix.
The rule (:func:`reconcile`, at each worker's start and refresh): a
definition the store has never had in force takes over at once, so the
newest deploy wins as soon as one of its workers runs; a definition it
replaced waits, and takes over again only when the one in force has gone
unconfirmed for ``stale_after`` seconds (its workers are gone: a rollback,
a canary removed). Workers holding the definition in force confirm it.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable, Mapping, Sequence
from datetime import UTC, datetime
from typing import Any, Final

from ..lifecycle import Source
from ..outbox.enqueue import EnqueueCall
from ..outbox.inserts import insert_new
from ..outbox.ordering import lock_keys
from ..outbox.transitions import NewDispatch
from ..signal import uuid7_bytes
from ..store.base import Conn, KeyOrderConflict
from .spec import Schedule

_SEE: Final = (
    "INSERT INTO dispatch_schedules (name, first_seen_at, paused, last_tick, updated_at) "
    "VALUES (?, ?, 0, NULL, ?) ON CONFLICT (name) DO NOTHING"
)
_STATES: Final = (
    "SELECT name, first_seen_at, paused, last_tick, definition, superseded, confirmed_at "
    "FROM dispatch_schedules"
)
_ADVANCE: Final = (
    # A row no worker recorded a definition for (made by an operator's
    # pause) takes the firing worker's.
    "UPDATE dispatch_schedules SET last_tick = ?, updated_at = ?, "
    "definition = COALESCE(definition, ?) "
    "WHERE name = ? AND paused = 0 AND (last_tick IS NULL OR last_tick < ?) "
    "AND (definition IS NULL OR definition = ?)"
)
_TAKE_OVER: Final = (
    "UPDATE dispatch_schedules SET definition = ?, superseded = ?, confirmed_at = ?, "
    "updated_at = ? WHERE name = ? AND COALESCE(definition, '') = ?"
)
_CONFIRM: Final = (
    "UPDATE dispatch_schedules SET confirmed_at = ? WHERE name = ? AND definition = ? "
    "AND (confirmed_at IS NULL OR confirmed_at < ?)"
)
MAX_SUPERSEDED: Final = 16
"""Replaced definitions the store remembers per schedule."""
_INSERT_RUN: Final = (
    "INSERT INTO schedule_runs (id, created_at, schedule, scheduled_for, origin) "
    "VALUES (?, ?, ?, ?, ?) ON CONFLICT DO NOTHING RETURNING id"
)
_SET_PAUSED: Final = "UPDATE dispatch_schedules SET paused = ?, updated_at = ? WHERE name = ?"
_NEWEST_RUNS: Final = (
    "SELECT r.schedule, r.scheduled_for, r.created_at, r.origin FROM schedule_runs r "
    "WHERE r.schedule IS NOT NULL AND r.created_at = "
    "(SELECT MAX(n.created_at) FROM schedule_runs n WHERE n.schedule = r.schedule)"
)

ORIGINS: Final = ("tick", "backfilled", "manual")
"""What made a run: its tick on time, a missed tick caught up, an operator."""


@dataclasses.dataclass(frozen=True)
class State:
    """A schedule's runtime state, shared by every worker."""

    name: str
    first_seen_at: float
    paused: bool
    last_tick: float | None
    definition: str | None = None
    """The fingerprint of the definition in force (None: none recorded)."""
    superseded: tuple[str, ...] = ()
    """The fingerprints it replaced, newest first."""
    confirmed_at: float | None = None
    """When a worker holding the definition in force last said so."""

    @property
    def cursor(self) -> float:
        """The newest tick handled, else when the schedule was first seen:
        the next tick to fire comes after it."""
        return self.first_seen_at if self.last_tick is None else self.last_tick


@dataclasses.dataclass(frozen=True)
class Fired:
    """One run written: its dispatch, and what made it."""

    schedule: str
    scheduled_for: float
    origin: str
    run_id: str
    dispatch_id: str
    outcome: str = "inserted"
    """What the tick's enqueue did (docs/controls.md): ``inserted``,
    ``replaced`` (its coalesce key's waiting dispatch superseded) or
    ``kept`` (that dispatch answered; ``dispatch_id`` is its id)."""


def iso(stamp: float) -> str:
    """Unix seconds as ISO 8601 in UTC (``2026-12-02T02:30:00Z``)."""
    moment = datetime.fromtimestamp(stamp, UTC)
    text = moment.isoformat(timespec="milliseconds" if moment.microsecond else "seconds")
    return text.replace("+00:00", "Z")


def see(conn: Conn, names: Iterable[str], now: float) -> None:
    """Record the schedules a worker has (first sight starts their history);
    those already known are left as they are."""
    conn.executemany(_SEE, [(name, now, now) for name in names])


def store_time(conn: Conn) -> float | None:
    """The store's own time in Unix seconds where the hosts that share the
    store share its clock (PostgreSQL: the database server's), else None
    (SQLite: the one machine's clock, the caller's, is the store's)."""
    clock = conn.dialect.clock
    if not clock:
        return None
    row = conn.query_one(f"SELECT {clock} AS now")
    assert row is not None
    return float(row["now"])


def states_at(conn: Conn, names: Iterable[str]) -> tuple[dict[str, State], float | None]:
    """:func:`states` of ``names`` and :func:`store_time`, in one read."""
    return states(conn, names), store_time(conn)


def states(conn: Conn, names: Iterable[str] | None = None) -> dict[str, State]:
    """The state of every known schedule, or of ``names`` only."""
    wanted = None if names is None else list(names)
    if wanted is not None and len(wanted) <= 500:
        marks = ", ".join("?" * len(wanted))
        rows = conn.query(f"{_STATES} WHERE name IN ({marks})", wanted) if wanted else []
    else:
        rows = conn.query(_STATES)
    found = {str(row["name"]): _state(row) for row in rows}
    return found if wanted is None else {name: found[name] for name in wanted if name in found}


def _state(row: Mapping[str, Any]) -> State:
    superseded: tuple[str, ...] = ()
    if row["superseded"]:
        try:
            found = json.loads(row["superseded"])
        except ValueError:  # damaged by hand: as if none were remembered
            found = []
        superseded = tuple(str(item) for item in found) if isinstance(found, list) else ()
    return State(
        str(row["name"]),
        float(row["first_seen_at"]),
        bool(row["paused"]),
        None if row["last_tick"] is None else float(row["last_tick"]),
        None if row["definition"] is None else str(row["definition"]),
        superseded,
        None if row["confirmed_at"] is None else float(row["confirmed_at"]),
    )


@dataclasses.dataclass(frozen=True)
class Reconciled:
    """What :func:`reconcile` found and did."""

    states: dict[str, State]
    """Each schedule's state afterwards."""
    took_over: dict[str, str | None]
    """The schedules whose definition in force became the caller's, each
    with the fingerprint it replaced (None: none was recorded)."""


def reconcile(
    conn: Conn, definitions: Mapping[str, str], now: float, stale_after: float, confirm_after: float
) -> Reconciled:
    """Record the schedules a worker has (``definitions``: name ->
    fingerprint; first sight starts their history with this definition in
    force) and settle, for each, which definition is in force:

    - the worker's, if the store has never had it in force: it takes over
      at once (the newest deploy wins), the one it replaces going to the
      front of ``superseded``;
    - else, if the worker's is one the store replaced, the one in force
      stays, unless no worker has confirmed it for ``stale_after`` seconds
      (its workers are gone): then the worker's takes over again;
    - if the worker's is in force, it confirms it (at most once in
      ``confirm_after`` seconds).

    ``now`` is the caller's clock; the store's own is used where it has one
    (PostgreSQL), since workers on several hosts compare these times. Each
    change is a compare-and-set on the definition read: of two workers
    racing, one wins and the other sees its result."""
    stamp = store_time(conn)
    now = now if stamp is None else stamp
    names = sorted(definitions)
    conn.executemany(_SEE, [(name, now, now) for name in names])
    found = states(conn, names)
    took_over: dict[str, str | None] = {}
    # One pass in name order: rows are locked in the order every writer
    # of schedules takes them.
    for name in names:
        state, mine = found[name], definitions[name]
        if state.definition == mine:
            # Only where due: of the workers holding it, about one a period writes.
            if state.confirmed_at is None or state.confirmed_at < now - confirm_after:
                conn.execute(_CONFIRM, (now, name, mine, now - confirm_after))
            continue
        stale = state.confirmed_at is None or state.confirmed_at < now - stale_after
        if state.definition is not None and mine in state.superseded and not stale:
            continue  # an older definition: the one in force stays
        before = [] if state.definition is None else [state.definition]
        superseded = tuple([*before, *(f for f in state.superseded if f != mine)][:MAX_SUPERSEDED])
        record = json.dumps(list(superseded))
        if conn.execute(_TAKE_OVER, (mine, record, now, now, name, state.definition or "")):
            found[name] = dataclasses.replace(
                state, definition=mine, superseded=superseded, confirmed_at=now
            )
            took_over[name] = state.definition
        else:  # changed by another worker since it was read
            found[name] = states(conn, [name])[name]
    return Reconciled(found, took_over)


def _dispatch(
    call: EnqueueCall, schedule: Schedule, run_id: str, scheduled_for: float, origin: str
) -> NewDispatch:
    """The run's dispatch, made by the outbox's one entry point (its checks,
    the body limit, the ``create`` span): the schedule's enqueue arguments,
    its envelope metadata and its provenance for the first transition."""
    args: dict[str, Any] = {
        "kind": schedule.kind,
        "deliver_to": schedule.deliver_to,
        "body": None if schedule.body is None else dict(schedule.body),
        "ack_required": schedule.ack_required,
        "ordering_key": schedule.ordering_key,
        "priority": schedule.priority,
        "schedule_run_id": run_id,
    }
    for field in ("coalesce_key", "coalesce", "coalesce_seconds", "coalesce_max_wait_seconds"):
        if getattr(schedule, field) is not None:
            args[field] = getattr(schedule, field)
    if schedule.max_attempts is not None:
        args["max_attempts"] = schedule.max_attempts
    if schedule.expires_after_seconds is not None:
        args["expires_at"] = scheduled_for + schedule.expires_after_seconds
    metadata: dict[str, Any] = {
        "schedule": schedule.name,
        "scheduled_for": iso(scheduled_for),
        "backfilled": origin == "backfilled",
    }
    if origin == "manual":
        metadata["manual"] = True
    return call.new(
        args,
        metadata,
        source=Source.SCHEDULES,
        actor=f"schedule:{schedule.name}",
        note=json.dumps({**metadata, "schedule_run_id": run_id}),
    )


def _write_run(
    conn: Conn,
    call: EnqueueCall,
    schedule: Schedule,
    scheduled_for: float,
    origin: str,
    now: float,
) -> Fired | None:
    run_id = uuid7_bytes().hex()
    if conn.query_one(_INSERT_RUN, (run_id, now, schedule.name, scheduled_for, origin)) is None:
        return None  # the tick has its run already
    new = _dispatch(call, schedule, run_id, scheduled_for, origin)
    result = insert_new(conn, new, now)
    return Fired(schedule.name, scheduled_for, origin, run_id, result.id, result.outcome)


def fire(
    conn: Conn,
    work: Sequence[tuple[Schedule, Sequence[tuple[float, bool]], float | None]],
    now: float,
    call: EnqueueCall | None = None,
    failed: dict[str, Exception] | None = None,
) -> list[Fired]:
    """Fire planned ticks: for each schedule, its ``(tick, backfilled)``
    pairs oldest first, then its cursor moved to the newest tick handled.
    A tick fires only if the cursor is still behind it, the schedule is
    not paused and the tick is due by the store's clock (``now`` on SQLite,
    the database server's on PostgreSQL; the cursor moves in the same
    statement); otherwise it was fired elsewhere or is not due, and nothing
    of it is written. Each dispatch is made by ``call`` (the store's body
    limit, a ``create`` span each, in the order of the result, which the
    caller ends after the commit); without one, by an untraced call held to
    the default limit.

    An error propagates, and the caller's unit of work rolls back whole;
    with ``failed``, each schedule's writes are instead made inside a
    savepoint of their own, and a schedule whose writes fail (a body its
    store refuses, a trigger) is rolled back alone, its error kept in
    ``failed`` by name, while the others are written. An error that
    leaves no transaction to go on in (a lost connection) still
    propagates."""
    call = EnqueueCall(traced=False) if call is None else call
    call.restart()  # a unit of work run again drops its earlier spans
    if failed is not None:
        failed.clear()
    fired: list[Fired] = []
    # Every key this unit may write, locked at once in the one order and
    # before any savepoint below (whose rollback would let go of locks taken
    # after it).
    lock_keys(conn, [schedule.ordering_key for schedule, _, _ in work])
    for schedule, ticks, handled in work:
        if failed is None:
            fired += _fire_schedule(conn, call, schedule, ticks, handled, now)
            continue
        started = call.started
        conn.execute("SAVEPOINT schedule")
        try:
            runs = _fire_schedule(conn, call, schedule, ticks, handled, now)
        except KeyOrderConflict:
            raise  # not this schedule's fault: the group commit runs the unit again
        except Exception as exc:  # this schedule's own failure: the others go on
            conn.execute("ROLLBACK TO SAVEPOINT schedule")
            conn.execute("RELEASE SAVEPOINT schedule")
            call.forget(started)
            failed[schedule.name] = exc
            continue
        conn.execute("RELEASE SAVEPOINT schedule")
        fired += runs
    return fired


def _fire_schedule(
    conn: Conn,
    call: EnqueueCall,
    schedule: Schedule,
    ticks: Sequence[tuple[float, bool]],
    handled: float | None,
    now: float,
) -> list[Fired]:
    fired: list[Fired] = []
    for tick, backfilled in ticks:
        if not _advance(conn, schedule, tick, now):
            continue  # fired by another worker, paused, or not due yet
        origin = "backfilled" if backfilled else "tick"
        run = _write_run(conn, call, schedule, tick, origin, now)
        if run is not None:
            fired.append(run)
    if handled is not None:
        _advance(conn, schedule, handled, now)
    return fired


def _advance(conn: Conn, schedule: Schedule, tick: float, now: float) -> bool:
    """Move ``schedule``'s cursor to ``tick``, if it is behind it, the
    schedule is not paused, ``schedule``'s definition is the one in force
    and the tick is due (its jitter included) by the store's clock: ``now``
    on SQLite, the database server's on PostgreSQL (whatever ``now`` says);
    whether it moved."""
    due = schedule.fire_time(tick)
    if due > now:
        return False
    mine = schedule.fingerprint
    values = (tick, now, mine, schedule.name, tick, mine)
    clock = conn.dialect.clock
    if not clock:
        return conn.execute(_ADVANCE, values) == 1
    return conn.execute(f"{_ADVANCE} AND ? <= {clock}", (*values, due)) == 1


def fire_manual(
    conn: Conn, schedule: Schedule, now: float, call: EnqueueCall | None = None
) -> Fired:
    """One extra run of ``schedule`` now (``schedules run NAME``): not a
    tick, so the schedule's cursor and its ticks are left as they are. Its
    dispatch is made by ``call`` as in :func:`fire`."""
    call = EnqueueCall(traced=False) if call is None else call
    call.restart()  # a unit of work run again drops its earlier span
    see(conn, [schedule.name], now)
    run = _write_run(conn, call, schedule, now, "manual", now)
    assert run is not None  # manual runs are outside the tick index
    return run


def set_paused(
    conn: Conn, name: str, paused: bool, now: float, known_only: bool = False
) -> bool | None:
    """Pause or resume a schedule; return whether its state changed. A
    schedule no worker has seen yet is recorded first (paused from its
    start); with ``known_only`` it is not, and the answer is None (an
    operator naming a schedule their configuration lacks: it must be one
    the store knows). Resumed, its ticks missed meanwhile follow its
    ``missed``."""
    if not known_only:
        see(conn, [name], now)
    before = states(conn, [name]).get(name)
    if before is None:
        return None
    if before.paused == paused:
        return False
    conn.execute(_SET_PAUSED, (int(paused), now, name))
    return True


@dataclasses.dataclass(frozen=True)
class Listing:
    """One schedule as the operators see it."""

    schedule: Schedule
    state: State | None
    last_run: Mapping[str, Any] | None
    """The newest run: ``scheduled_for``, ``created_at``, ``origin``."""
    next_fire: float | None
    """When its next tick is due (None while paused, while another
    definition is in force, or never)."""

    @property
    def in_force(self) -> str | None:
        """The fingerprint of the definition in force (None: none recorded)."""
        return None if self.state is None else self.state.definition

    @property
    def differs(self) -> bool:
        """Whether another definition than this one is in force: its ticks,
        not this one's, fire."""
        return self.in_force is not None and self.in_force != self.schedule.fingerprint

    def to_dict(self) -> dict[str, Any]:
        """The JSON form of ``schedules --json``."""
        schedule, last = self.schedule, self.last_run
        return {
            **schedule.describe(),
            "definition_in_force": self.in_force,
            "definition_differs": self.differs,
            "paused": bool(self.state and self.state.paused),
            "first_seen_at": None if self.state is None else iso(self.state.first_seen_at),
            "last_fire": None
            if last is None
            else {
                "scheduled_for": iso(last["scheduled_for"]),
                "created_at": iso(last["created_at"]),
                "origin": last["origin"],
            },
            "next_fire": None if self.next_fire is None else iso(self.next_fire),
        }


def listing(conn: Conn, schedules: Sequence[Schedule], now: float) -> list[Listing]:
    """Each configured schedule with its state, newest run and next fire."""
    known = states(conn)
    newest = {
        str(row["schedule"]): {
            "scheduled_for": float(row["scheduled_for"]),
            "created_at": float(row["created_at"]),
            "origin": str(row["origin"]),
        }
        for row in conn.query(_NEWEST_RUNS)
        if row["scheduled_for"] is not None
    }
    found: list[Listing] = []
    for schedule in schedules:
        state = known.get(schedule.name)
        entry = Listing(schedule, state, newest.get(schedule.name), None)
        if not (state is not None and state.paused) and not entry.differs:
            entry = dataclasses.replace(entry, next_fire=schedule.next_fire(now))
        found.append(entry)
    return found
