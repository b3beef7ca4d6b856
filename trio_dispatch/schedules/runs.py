"""A schedule's writes and reads in the store (SPEC section 14): firing a
tick, firing a manual run, pausing, and what the operators see.

A tick fires in one transaction: the schedule's cursor moves past it (only
if no one moved it there already, the schedule is not paused and the tick
is due by the store's clock: the database server's on PostgreSQL), its
``schedule_runs`` row goes in (unique on ``(schedule, scheduled_for)``) and
its dispatch with ``schedule_run_id`` pointing at the run. A worker that
loses the race changes nothing, so any number of workers, processes or
hosts give one dispatch per tick. Every function here takes a connection
inside a transaction (a unit of work of ``Database.write``/``read``).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable, Mapping, Sequence
from datetime import UTC, datetime
from typing import Any, Final

from .. import tracing
from ..lifecycle import Source
from ..outbox.enqueue import prepare
from ..outbox.inserts import insert_new
from ..signal import uuid7_bytes
from ..store.base import DEFAULT_MAX_BODY_BYTES, Conn
from .spec import Schedule

_SEE: Final = (
    "INSERT INTO dispatch_schedules (name, first_seen_at, paused, last_tick, updated_at) "
    "VALUES (?, ?, 0, NULL, ?) ON CONFLICT (name) DO NOTHING"
)
_STATES: Final = "SELECT name, first_seen_at, paused, last_tick FROM dispatch_schedules"
_ADVANCE: Final = (
    "UPDATE dispatch_schedules SET last_tick = ?, updated_at = ? "
    "WHERE name = ? AND paused = 0 AND (last_tick IS NULL OR last_tick < ?)"
)
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
    found = {
        str(row["name"]): State(
            str(row["name"]),
            float(row["first_seen_at"]),
            bool(row["paused"]),
            None if row["last_tick"] is None else float(row["last_tick"]),
        )
        for row in rows
    }
    return found if wanted is None else {name: found[name] for name in wanted if name in found}


def _dispatch(
    schedule: Schedule,
    run_id: str,
    scheduled_for: float,
    origin: str,
    max_body: int,
    spans: tracing.Creations | None = None,
) -> Any:
    args: dict[str, Any] = {
        "kind": schedule.kind,
        "deliver_to": schedule.deliver_to,
        "body": None if schedule.body is None else dict(schedule.body),
        "ack_required": schedule.ack_required,
        "ordering_key": schedule.ordering_key,
        "schedule_run_id": run_id,
    }
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
    # The trace context first: it is read back from the envelope's head.
    traced = metadata if spans is None else {**spans.start(schedule.kind), **metadata}
    new = prepare(args, max_body, traced)
    return dataclasses.replace(
        new,
        source=Source.SCHEDULER,
        actor=f"schedule:{schedule.name}",
        note=json.dumps({**metadata, "schedule_run_id": run_id}),
    )


def _write_run(
    conn: Conn,
    schedule: Schedule,
    scheduled_for: float,
    origin: str,
    now: float,
    max_body: int,
    spans: tracing.Creations | None = None,
) -> Fired | None:
    run_id = uuid7_bytes().hex()
    if conn.query_one(_INSERT_RUN, (run_id, now, schedule.name, scheduled_for, origin)) is None:
        return None  # the tick has its run already
    new = _dispatch(schedule, run_id, scheduled_for, origin, max_body, spans)
    result = insert_new(conn, new, now)
    return Fired(schedule.name, scheduled_for, origin, run_id, result.id)


def fire(
    conn: Conn,
    work: Sequence[tuple[Schedule, Sequence[tuple[float, bool]], float | None]],
    now: float,
    max_body: int = DEFAULT_MAX_BODY_BYTES,
    spans: tracing.Creations | None = None,
    failed: dict[str, Exception] | None = None,
) -> list[Fired]:
    """Fire planned ticks: for each schedule, its ``(tick, backfilled)``
    pairs oldest first, then its cursor moved to the newest tick handled.
    A tick fires only if the cursor is still behind it, the schedule is
    not paused and the tick is due by the store's clock (``now`` on SQLite,
    the database server's on PostgreSQL; the cursor moves in the same
    statement); otherwise it was fired elsewhere or is not due, and nothing
    of it is written. With ``spans``, each
    dispatch written gets a ``create`` span, in the order of the result
    (the caller ends them after the commit).

    An error propagates, and the caller's unit of work rolls back whole;
    with ``failed``, each schedule's writes are instead made inside a
    savepoint of their own, and a schedule whose writes fail (a body its
    store refuses, a trigger) is rolled back alone, its error kept in
    ``failed`` by name, while the others are written. An error that
    leaves no transaction to go on in (a lost connection) still
    propagates."""
    if spans is not None:
        spans.restart()  # a unit of work run again drops its earlier spans
    if failed is not None:
        failed.clear()
    fired: list[Fired] = []
    for schedule, ticks, handled in work:
        if failed is None:
            fired += _fire_schedule(conn, schedule, ticks, handled, now, max_body, spans)
            continue
        started = 0 if spans is None else len(spans.spans)
        conn.execute("SAVEPOINT schedule")
        try:
            runs = _fire_schedule(conn, schedule, ticks, handled, now, max_body, spans)
        except Exception as exc:  # this schedule's own failure: the others go on
            conn.execute("ROLLBACK TO SAVEPOINT schedule")
            conn.execute("RELEASE SAVEPOINT schedule")
            if spans is not None:
                spans.forget(started)
            failed[schedule.name] = exc
            continue
        conn.execute("RELEASE SAVEPOINT schedule")
        fired += runs
    return fired


def _fire_schedule(
    conn: Conn,
    schedule: Schedule,
    ticks: Sequence[tuple[float, bool]],
    handled: float | None,
    now: float,
    max_body: int,
    spans: tracing.Creations | None,
) -> list[Fired]:
    fired: list[Fired] = []
    for tick, backfilled in ticks:
        if not _advance(conn, schedule, tick, now):
            continue  # fired by another worker, paused, or not due yet
        origin = "backfilled" if backfilled else "tick"
        run = _write_run(conn, schedule, tick, origin, now, max_body, spans)
        if run is not None:
            fired.append(run)
    if handled is not None:
        _advance(conn, schedule, handled, now)
    return fired


def _advance(conn: Conn, schedule: Schedule, tick: float, now: float) -> bool:
    """Move ``schedule``'s cursor to ``tick``, if it is behind it, the
    schedule is not paused and the tick is due (its jitter included) by the
    store's clock: ``now`` on SQLite, the database server's on PostgreSQL
    (whatever ``now`` says); whether it moved."""
    due = schedule.fire_time(tick)
    if due > now:
        return False
    clock = conn.dialect.clock
    if not clock:
        return conn.execute(_ADVANCE, (tick, now, schedule.name, tick)) == 1
    guarded = f"{_ADVANCE} AND ? <= {clock}"
    return conn.execute(guarded, (tick, now, schedule.name, tick, due)) == 1


def fire_manual(
    conn: Conn, schedule: Schedule, now: float, max_body: int = DEFAULT_MAX_BODY_BYTES
) -> Fired:
    """One extra run of ``schedule`` now (``schedules run NAME``): not a
    tick, so the schedule's cursor and its ticks are left as they are."""
    see(conn, [schedule.name], now)
    run = _write_run(conn, schedule, now, "manual", now, max_body)
    assert run is not None  # manual runs are outside the tick index
    return run


def set_paused(conn: Conn, name: str, paused: bool, now: float) -> bool:
    """Pause or resume a schedule; return whether its state changed. A
    schedule no worker has seen yet is recorded first (paused from its
    start). Resumed, its ticks missed meanwhile follow its ``missed``."""
    see(conn, [name], now)
    before = states(conn, [name])[name]
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
    """When its next tick is due (None while paused or never)."""

    def to_dict(self) -> dict[str, Any]:
        """The JSON form of ``schedules --json``."""
        schedule, last = self.schedule, self.last_run
        return {
            **schedule.describe(),
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
        paused = state is not None and state.paused
        next_fire = None if paused else schedule.next_fire(now)
        found.append(Listing(schedule, state, newest.get(schedule.name), next_fire))
    return found
