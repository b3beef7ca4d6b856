"""What operators see of destinations
(docs/destinations.md#what-operators-see): one :class:`Entry` per destination -- each one the
configuration names (``"*"`` excepted), each with live rows, each with a
state row -- with its state as it stands now, its policy, the starts its
rate admits now, its shared concurrency in use, its pending rows, how long
the oldest due one has waited, its last success and failure, its failures
in a row and, for one destination's page, its newest audit rows.

Everything here reads; nothing writes, not even a pause whose end passed
(it reads as ``active``; the next claim or operator change records it). The
cost is bounded whatever the backlog: the destinations with live rows come
from a loose scan of the destination index (one seek per destination), at
most :data:`LISTED_LIMIT` destinations are listed, a destination's pending
rows are counted up to :data:`PENDING_CAP`, and the rows running are read
from the due index's ``delivering`` range, which holds only the attempts
running (each worker's concurrency bounds it).

"Now" is the store's clock where the hosts that share the store share it
(PostgreSQL: the database server's, as the claim and the schedules use),
else the caller's (SQLite: one machine).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from functools import partial
from typing import Any, Final

from ..lifecycle import DUE_SQL, Status
from ..outbox.claim import gcra
from ..priority import earliest_due
from ..store.base import Conn, Database, Row
from ..store.schema import DESTINATION_INDEX, DUE_INDEX, HELD_BACK_DESTINATION_INDEX
from ..validate import clock_from
from .policy import ANY_DESTINATION, UNLIMITED, Destination
from .state import SELECT_ONE, TABLE, Seen, State, changes, effective

LISTED_LIMIT: Final = 500
"""The most destinations one listing shows (first by name); ``truncated``
says when there are more. One destination is always shown whole."""
PENDING_CAP: Final = 10_000
"""A destination's pending rows are counted up to this many (then shown as
``10000+``), so a listing costs the same at a million rows."""
RUNNING_CAP: Final = 10_000
"""Running attempts read at most (every worker's concurrency together is
far below it)."""
CHANGES_SHOWN: Final = 20
"""The audit rows one destination's page shows, newest first."""

STATUS_INDEX: Final = DUE_INDEX
"""The due index (status first)."""

OWN: Final = "own"
DEFAULTS: Final = "*"
NONE: Final = "default"
"""Where a destination's policy comes from: its own entry, ``"*"``, or no
configuration at all (no limit)."""


def _live_names(hint: str) -> str:
    # A loose scan of the destination index: one seek to each next name, at
    # most ``?`` of them (a counter, since neither engine lets a LIMIT stop
    # a recursion the same way).
    table = f"dispatch_outbox{hint}"
    return (
        "WITH RECURSIVE live(name, n) AS ("
        f"SELECT MIN(deliver_to), 1 FROM {table} WHERE {DUE_SQL} "
        "UNION ALL "
        f"SELECT (SELECT MIN(deliver_to) FROM {table} WHERE {DUE_SQL} "
        "AND deliver_to > live.name), live.n + 1 "
        "FROM live WHERE live.name IS NOT NULL AND live.n < ?) "
        "SELECT name FROM live WHERE name IS NOT NULL"
    )


_STATE_NAMES: Final = f"SELECT name FROM {TABLE} ORDER BY name LIMIT ?"
_STATE_ROWS_FROM: Final = SELECT_ONE.replace("WHERE name = ?", "WHERE name >= ? AND name <= ?")


def _running(hint: str) -> str:
    # The delivering range of the due index: only attempts running or
    # whose lease ended unrecovered, never the pending backlog.
    return (
        f"SELECT deliver_to, next_attempt_at FROM dispatch_outbox{hint} WHERE {DUE_SQL} "
        f"AND status = '{Status.DELIVERING}' LIMIT ?"
    )


def _pending(hint: str) -> str:
    return (
        "SELECT COUNT(*) AS n FROM (SELECT 1 FROM "
        f"dispatch_outbox{hint} WHERE {DUE_SQL} AND deliver_to = ? "
        f"AND status = '{Status.PENDING}' LIMIT ?) AS capped"
    )


def _oldest_pending(main: str, held: str, waiting: str) -> str:
    # When the destination's earliest pending row falls due (parameter: the
    # name, five times): a few seeks of its claim-order indexes; the few due
    # rows ``waiting`` still holds (right behind a blocked head) are
    # stepped over, and a row waiting behind a live head ranks past them all.
    rest = f" AND NOT {waiting}" if waiting else ""
    return earliest_due(f"deliver_to = ? AND status = '{Status.PENDING}'", main, held, rest)


def _has_live(hint: str) -> str:
    return (
        f"SELECT 1 AS found FROM dispatch_outbox{hint} WHERE {DUE_SQL} AND deliver_to = ? LIMIT 1"
    )


def store_now(conn: Conn, fallback: float) -> float:
    """The store's time where it has a clock every host shares
    (PostgreSQL), else ``fallback`` (the caller's clock)."""
    clock = conn.dialect.clock
    if not clock:
        return fallback
    row = conn.query_one(f"SELECT {clock} AS now")
    assert row is not None
    return float(row["now"])


def starts_available(
    policy: Destination, rate_tat: float | None, now: float, held: int = 0
) -> int | None:
    """How many attempt starts the rate admits at ``now`` (GCRA: ``floor((burst
    * interval - (max(tat, now) - now)) / interval)``, less the ``held``
    starts claimed ahead and not yet begun, from 0 to ``burst``); None
    without a rate."""
    rate = policy.gcra_rate
    if rate is None:
        return None
    return min(policy.burst, gcra.room(rate, policy.burst, rate_tat, now, held))


def policy_source(policies: Mapping[str, Destination], name: str) -> str:
    """:data:`OWN`, :data:`DEFAULTS` or :data:`NONE`."""
    if name in policies:
        return OWN
    return DEFAULTS if ANY_DESTINATION in policies else NONE


@dataclasses.dataclass(frozen=True)
class Change:
    """One audit row: a change of a destination's state."""

    id: int
    previous: str | None
    state: str
    reason: str | None
    source: str
    actor: str
    until: float | None
    at: float

    def to_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "from": self.previous,
            "to": self.state,
            "reason": self.reason,
            "source": self.source,
            "actor": self.actor,
            "until": self.until,
            "at": self.at,
        }


@dataclasses.dataclass(frozen=True)
class Entry:
    """One destination as it stands at the listing's ``now``."""

    name: str
    policy: Destination
    policy_from: str
    """:data:`OWN`, :data:`DEFAULTS` (``"*"``) or :data:`NONE`."""
    seen: Seen
    """Its state (``throttled``, ``half_open`` and an ended pause read as
    they stand now), until when and why."""
    throttled_until: float | None
    starts_available: int | None
    """Starts its rate admits now (None: no rate)."""
    starts_held: int
    """Starts claimed ahead of workers' free slots, not yet begun: the rate
    counts them as spent until each begins (docs/destinations.md)."""
    running: int
    """``delivering`` rows whose lease has not ended, across every worker:
    what its shared ``concurrency`` counts."""
    pending: int | None
    """Its ``pending`` rows, counted up to :data:`PENDING_CAP` (None: not
    counted, for a listing of states only)."""
    oldest_due_age: float | None
    """How long its oldest due pending row has waited (None: none due)."""
    failures: int
    last_success_at: float | None
    last_failure_at: float | None
    changes: tuple[Change, ...] = ()
    """Its newest audit rows, newest first (one destination's page)."""

    @property
    def state(self) -> State:
        return self.seen.state

    @property
    def pending_capped(self) -> bool:
        return self.pending is not None and self.pending >= PENDING_CAP

    @property
    def configured(self) -> bool:
        """Whether the configuration names it (its own policy)."""
        return self.policy_from == OWN

    def pending_text(self) -> str:
        """``1234``, ``10000+`` at the cap, ``-`` when not counted."""
        if self.pending is None:
            return "-"
        return f"{self.pending}+" if self.pending_capped else str(self.pending)

    def to_dict(self) -> dict[str, Any]:
        """The ``--json`` and dashboard JSON form: stable keys, times as
        Unix seconds."""
        document: dict[str, Any] = {
            "name": self.name,
            "state": str(self.seen.state),
            "until": self.seen.until,
            "reason": self.seen.reason,
            "configured": self.configured,
            "policy_from": self.policy_from,
            "policy": self.policy.to_dict(),
            "starts_available": self.starts_available,
            "starts_held": self.starts_held,
            "concurrency_used": self.running,
            "concurrency_limit": self.policy.concurrency,
            "pending": self.pending,
            "pending_capped": self.pending_capped,
            "oldest_due_age_seconds": self.oldest_due_age,
            "throttled_until": self.throttled_until,
            "failures_in_a_row": self.failures,
            "last_success_at": self.last_success_at,
            "last_failure_at": self.last_failure_at,
        }
        if self.changes:
            document["changes"] = [change.to_dict() for change in self.changes]
        return document


@dataclasses.dataclass(frozen=True)
class Listing:
    """Every destination listed, by name, at ``now`` (the store's clock
    where it has one); ``truncated``: more exist than :data:`LISTED_LIMIT`."""

    now: float
    entries: tuple[Entry, ...]
    truncated: bool = False


def _float(value: Any) -> float | None:
    return None if value is None else float(value)


def _names(conn: Conn, policies: Mapping[str, Destination], limit: int) -> tuple[list[str], bool]:
    hint = conn.dialect.use_index(DESTINATION_INDEX)
    found = {name for name in policies if name != ANY_DESTINATION}
    found.update(str(row["name"]) for row in conn.query(_live_names(hint), (limit + 1,)))
    found.update(str(row["name"]) for row in conn.query(_STATE_NAMES, (limit + 1,)))
    ordered = sorted(found)
    return ordered[:limit], len(ordered) > limit


def _running_by_destination(conn: Conn, now: float) -> dict[str, int]:
    running: dict[str, int] = {}
    hint = conn.dialect.use_index(STATUS_INDEX)
    for row in conn.query(_running(hint), (RUNNING_CAP,)):
        if float(row["next_attempt_at"]) > now:  # its lease has not ended
            name = str(row["deliver_to"])
            running[name] = running.get(name, 0) + 1
    return running


def _entry(
    conn: Conn,
    policies: Mapping[str, Destination],
    name: str,
    row: Mapping[str, Any] | None,
    running: int,
    now: float,
    *,
    counts: bool,
    waiting: str = "",
) -> Entry:
    policy = policies.get(name) or policies.get(ANY_DESTINATION) or UNLIMITED
    pending: int | None = None
    oldest: float | None = None
    if counts:
        hint = conn.dialect.use_index(DESTINATION_INDEX)
        counted = conn.query_one(_pending(hint), (name, PENDING_CAP))
        pending = int(counted["n"]) if counted is not None else 0
        held = conn.dialect.use_index(HELD_BACK_DESTINATION_INDEX)
        head = conn.query_one(_oldest_pending(hint, held, waiting), (name,) * 5)
        due = None if head is None else _float(head["due"])
        oldest = None if due is None or due > now else now - due
    return Entry(
        name=name,
        policy=policy,
        policy_from=policy_source(policies, name),
        seen=effective(row, now),
        throttled_until=None if row is None else _float(row["throttled_until"]),
        starts_available=starts_available(
            policy, None if row is None else _float(row["rate_tat"]), now, _held(row)
        ),
        starts_held=_held(row),
        running=running,
        pending=pending,
        oldest_due_age=oldest,
        failures=0 if row is None else int(row["failures"] or 0),
        last_success_at=None if row is None else _float(row["last_success_at"]),
        last_failure_at=None if row is None else _float(row["last_failure_at"]),
    )


def _held(row: Mapping[str, Any] | None) -> int:
    return 0 if row is None else int(row["rate_held"] or 0)


def listing(
    conn: Conn,
    policies: Mapping[str, Destination],
    now: float,
    *,
    counts: bool = True,
    limit: int = LISTED_LIMIT,
    waiting: str = "",
) -> Listing:
    """Every destination to list (a unit of reading): configured, with live
    rows, or with a state row, at most ``limit`` by name. Without
    ``counts``, no destination's rows are counted (``/metrics`` wants
    states only). ``waiting``: an SQL term on ``dispatch_outbox`` for the
    rows that wait whatever their due time says (the ordering keys':
    :data:`trio_dispatch.outbox.reads.WAITING`), left out of the oldest
    due."""
    at = store_now(conn, now)
    names, truncated = _names(conn, policies, limit)
    rows: dict[str, Row] = {}
    if names:
        for row in conn.query(_STATE_ROWS_FROM, (names[0], names[-1])):
            rows[str(row["name"])] = row
    running = _running_by_destination(conn, at)
    entries = tuple(
        _entry(
            conn,
            policies,
            name,
            rows.get(name),
            running.get(name, 0),
            at,
            counts=counts,
            waiting=waiting,
        )
        for name in names
    )
    return Listing(at, entries, truncated)


def known(conn: Conn, policies: Mapping[str, Destination], name: str) -> bool:
    """Whether ``name`` is a destination operators can see: configured,
    with live rows, or with a state row."""
    if name in policies and name != ANY_DESTINATION:
        return True
    if conn.query_one(SELECT_ONE, (name,)) is not None:
        return True
    hint = conn.dialect.use_index(DESTINATION_INDEX)
    return conn.query_one(_has_live(hint), (name,)) is not None


def describe(
    conn: Conn,
    policies: Mapping[str, Destination],
    name: str,
    now: float,
    *,
    changes_shown: int = CHANGES_SHOWN,
    waiting: str = "",
) -> tuple[float, Entry | None]:
    """One destination whole, with its newest audit rows (a unit of
    reading), and the time it was read at (the store's clock where it has
    one); None when it is not :func:`known`. ``waiting``: as
    :func:`listing`'s."""
    at = store_now(conn, now)
    if not known(conn, policies, name):
        return at, None
    running = _running_by_destination(conn, at).get(name, 0)
    row = conn.query_one(SELECT_ONE, (name,))
    entry = _entry(conn, policies, name, row, running, at, counts=True, waiting=waiting)
    audit = tuple(
        Change(
            id=int(change["id"]),
            previous=None if change["previous_state"] is None else str(change["previous_state"]),
            state=str(change["state"]),
            reason=None if change["reason"] is None else str(change["reason"]),
            source=str(change["source"]),
            actor=str(change["actor"]),
            until=_float(change["until_at"]),
            at=float(change["created_at"]),
        )
        for change in changes(conn, name, changes_shown)
    )
    return at, dataclasses.replace(entry, changes=audit)


async def list_destinations(
    db: Database,
    policies: Mapping[str, Destination],
    *,
    now: float | None = None,
    counts: bool = True,
    waiting: str = "",
) -> Listing:
    """:func:`listing` in one read of ``db``."""
    return await db.read(
        partial(listing, policies=policies, now=clock_from(now)(), counts=counts, waiting=waiting)
    )


async def show_destination(
    db: Database,
    policies: Mapping[str, Destination],
    name: str,
    *,
    now: float | None = None,
    waiting: str = "",
) -> tuple[float, Entry | None]:
    """:func:`describe` in one read of ``db``."""
    return await db.read(
        partial(describe, policies=policies, name=name, now=clock_from(now)(), waiting=waiting)
    )


def policy_text(policy: Destination) -> str:
    """A policy in one line, for people (``check-config``, ``show``, the
    dashboard)."""
    rate = policy.gcra_rate
    parts = [
        "rate none" if rate is None else f"rate {rate} burst {policy.burst}",
        f"concurrency {'none' if policy.concurrency is None else policy.concurrency}",
        f"throttle_max {policy.throttle_max_seconds:g}s",
    ]
    breaker = policy.gcra_breaker
    if breaker is None:
        parts.append("breaker off")
    else:
        disabled = (
            "never disabled"
            if breaker.disable_after_seconds is None
            else f"disabled after {breaker.disable_after_seconds:g}s open"
        )
        parts.append(
            f"breaker {breaker.failures} failures in a row over >= "
            f"{breaker.min_span_seconds:g}s, cool-down {breaker.cool_down_seconds:g}s "
            f"up to {breaker.max_cool_down_seconds:g}s, {disabled}"
        )
    return ", ".join(parts)


__all__: Sequence[str] = (
    "CHANGES_SHOWN",
    "LISTED_LIMIT",
    "PENDING_CAP",
    "Change",
    "Entry",
    "Listing",
    "describe",
    "known",
    "list_destinations",
    "listing",
    "policy_text",
    "show_destination",
    "starts_available",
    "store_now",
)
