"""Destination admission (docs/destinations.md): the claim rule that keeps every
destination within its state and its shared limits, across every worker,
process and host on the store.

What it reads is the destinations' state rows (:mod:`trio_dispatch.destinations.state`,
written by operators and by the ends of attempts) and the policies of the
worker's configuration (:mod:`trio_dispatch.destinations.policy`). Before
the claim reads (:meth:`DestinationAdmission.bounds`), one statement finds
the state rows that restrict anything now, and -- only where a shared
concurrency is configured -- one counts the attempts running per
destination. From those, destinations are left out entirely (so their rows
cost the claim nothing):

- ``paused`` (until its end), ``throttled`` (until ``throttled_until``), an
  ``open`` breaker (until its cool-down ends), ``half_open`` with a probe
  whose lease has not ended, ``disabled``;
- a ``concurrency`` reached: ``delivering`` rows of the destination whose
  lease has not ended, of every worker, at the limit;
- a ``rate`` exhausted (GCRA, :mod:`.gcra`).

The others get a room: the rate's starts available, the concurrency left,
one for a breaker whose cool-down ended (its probe).

After the candidates are locked, in the same transaction
(:meth:`DestinationAdmission.admit`), a destination with a shared limit or
a probe to send has its state row created if absent and locked (``SELECT
... FOR UPDATE SKIP LOCKED`` where rows lock; SQLite's single writer
serializes the same), in name order, and then -- in statements that start
after the locks, so they see every claim committed before -- its state is
read again, its running attempts counted again and its rate's ``rate_tat``
read; at most what they allow is admitted, oldest first, and in the same
transaction the rate's ``rate_tat`` is advanced for the starts admitted and
a probe is marked (``half_open``, ``probe_id``, ``probe_until`` = the
claim's lease end, with its audit row). Two claims of one destination
therefore never decide at once, and each decides from what the other
committed: the limits hold however many claim at once. A claim that finds
the state row held by another claim's decision admits none of that
destination's rows and does not wait: waiting, it would hold the row in its
turn until its own commit, usually to admit nothing (the other took the
room), and behind a busy rate the claims of four processes queued up so on
the one row, each for a commit, while the rate's time fell behind the
clock -- starts lost for good. The destination's rows go to the next claim.
A destination whose one limit is a rate (no concurrency to count again, no
probe, no pause that ended) is decided in one statement instead
(:func:`.admission_sql.advance_if_room`: lock, read and advance at once, the same
arithmetic); the locked read decides whatever that statement leaves.
The rate's arithmetic is done at the store's time where hosts share a
clock (PostgreSQL: the server's), read by the claim's first statement, so a
host's clock skew may cost throughput, never exceed the rate; a claim
decides at the time it began, which can only leave it fewer starts.

For the ends of attempts (throttles, the breaker's counting, closing it
after a probe), only the state row needs writing: the next claim reads it.
A transaction that locks state rows of several destinations takes them in
name order, after the outbox rows it changes, as this rule does.
"""

from __future__ import annotations

import dataclasses
import sys
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Final

from ...destinations.policy import Destination, policy_for
from ...destinations.state import (
    SOURCE_DELIVERY,
    State,
    effective,
    record_change,
    settle,
)
from ...store.base import Conn, Row
from ...store.schema import DUE_INDEX
from . import admission_sql as sql
from . import gcra, statements
from .order import CLAIM_ORDER
from .pins import Pins
from .rules import Bounds, Claiming, ClaimRule

if TYPE_CHECKING:
    from ..transitions import Claim

PASSED_OVER: Final = 8
"""Claims in a row that find a destination's state row held before one
makes it again, in case it was removed (an ``INSERT ... ON CONFLICT DO
NOTHING``, nothing when it is there): behind a busy rate a held row is the
common case, and every claim would pay that statement."""

HELD_LOOK_AGAIN: Final = 0.05
"""Seconds before a claim looks again at a rate whose room is held by
workers' claims ahead (:mod:`.pins`): each worker's next write says which
of them began, within milliseconds while it runs."""
UNBOUNDED: Final = sys.maxsize
"""The room of a destination nothing limits."""

_CLOSED_TO_CLAIMS: Final = frozenset({State.PAUSED, State.THROTTLED, State.OPEN, State.DISABLED})
PROBE_LOCK_WAIT: Final = 0.2
"""Seconds a claim holding a half-open destination's oldest due row waits
for its state row, held by another claim, before passing it over."""


@dataclasses.dataclass(frozen=True)
class _Noted:
    """What the bounds saw, for the admission after the lock."""

    probes: frozenset[str]
    """Destinations whose breaker may send its probe now."""
    settled: frozenset[str]
    """Destinations whose pause ended by itself, not yet recorded."""
    now: float
    """The claim's rate clock: the store's time as the claim began (its
    first statement), or the claim's own time where the store has no
    clock. Every rate decision of the claim is made at this time, even one
    made after waiting for a lock: later decisions of others then see a
    time no later than theirs, which can only leave fewer starts, and the
    starts are stamped (their transitions' time) as they are decided."""


class DestinationAdmission(ClaimRule):
    """Destination admission under ``policies`` (a ``deliver_to`` value or
    ``"*"`` -> its :class:`~trio_dispatch.destinations.policy.Destination`).
    Every claim has it: without policies it still keeps paused, throttled,
    open and disabled destinations out. Equal when the policies are."""

    def __init__(
        self, policies: Mapping[str, Destination] | None = None, pins: Pins | None = None
    ) -> None:
        self.policies: dict[str, Destination] = dict(policies or {})
        self.pins = pins
        """Where the claimant holds rows ahead of its slots: its rated rows
        are admitted as held starts (:mod:`.pins`)."""
        self._holding: dict[str, int] = {}
        """Held starts the claim under way admitted, by destination (the
        store's writer thread makes one claim at a time)."""
        self._concurrency = any(p.concurrency is not None for p in self.policies.values())
        self._rated = any(p.gcra_rate is not None for p in self.policies.values())
        self._key = (tuple(sorted(self.policies.items())), id(pins))
        self._rows: set[str] = set()
        """Destinations this process saw with a state row: no row is ever
        removed, so the claim need not create theirs again (a lost update
        of this set only costs one more statement)."""
        self._passed: Counter[str] = Counter()
        """Claims in a row that found a destination's state row held (or
        gone): past :data:`PASSED_OVER`, it is made again if gone."""

    def __eq__(self, other: object) -> bool:
        return isinstance(other, DestinationAdmission) and other._key == self._key

    def __hash__(self) -> int:
        return hash(self._key)

    def __repr__(self) -> str:
        return f"DestinationAdmission({self.policies!r})"

    def policy(self, name: str) -> Destination:
        """The policy of ``name``."""
        return policy_for(self.policies, name)

    def sync(self, conn: Conn, at: float) -> None:
        """The starts this claimant held and began, or gave back (:mod:`.pins`)."""
        if self.pins is not None:
            self._holding = {}
            self.pins.sync(conn, at)

    def _limited(self, name: str) -> bool:
        policy = self.policy(name)
        return policy.concurrency is not None or policy.gcra_rate is not None

    def running(self, conn: Conn, at: float, names: Sequence[str] = ()) -> dict[str, int]:
        """Attempts running at ``at`` per destination (of ``names`` only,
        if given), whoever runs them: ``delivering`` rows whose lease has
        not ended."""
        arrays = conn.dialect.arrays
        statement = sql.running(conn.dialect.use_index(DUE_INDEX), arrays, len(names))
        found = conn.query(statement, (at, *(sql.values(arrays, names) if names else ())))
        return {str(row["deliver_to"]): int(row["n"]) for row in found}

    def bounds(self, conn: Conn, at: float) -> Bounds:
        """The destinations closed to claims now or at a shared limit, left
        out, with when each is lifted where that is known; the room of the
        rest."""
        clock = conn.dialect.clock
        found = conn.query(sql.restricting(clock), (at,) if clock else (at, at))
        now = float(found[0]["now"]) if clock and found else at
        rows = [row for row in found if row["name"] is not None]
        skip: set[str] = set()
        lifts: dict[str, float] = {}
        fixed: dict[str, int] = {}
        probes: set[str] = set()
        settled: set[str] = set()
        for row in rows:
            name = str(row["name"])
            seen = effective(row, at)
            if seen.state in _CLOSED_TO_CLAIMS:
                skip.add(name)
                if seen.until is not None:
                    lifts[name] = seen.until
                continue
            if seen.state is State.HALF_OPEN:
                if _probing(row, at):
                    skip.add(name)
                    lifts[name] = float(row["probe_until"])
                    continue
                probes.add(name)
                fixed[name] = 1
            elif row["state"] == State.PAUSED:
                settled.add(name)  # its pause ended: recorded when next locked
            rate = self.policy(name).gcra_rate
            if rate is not None:
                burst = self.policy(name).burst
                left = gcra.room(rate, burst, row["rate_tat"], now, _held(row))
                if left <= 0:
                    skip.add(name)
                    wait = gcra.next_start(rate, burst, row["rate_tat"], now) - now
                    if _held(row):  # until a worker's next write begins them
                        wait = max(wait, HELD_LOOK_AGAIN)
                    lifts[name] = at + wait
                    continue
                fixed[name] = min(left, fixed.get(name, UNBOUNDED))
        running = self.running(conn, at) if self._concurrency else {}
        for name, n in running.items():
            limit = self.policy(name).concurrency
            if limit is not None and n >= limit:
                skip.add(name)

        def room(destination: str) -> int:
            policy = self.policy(destination)
            left = fixed.get(destination)
            if left is None:
                left = policy.burst if policy.gcra_rate is not None else UNBOUNDED
            if policy.concurrency is not None:
                left = min(left, policy.concurrency - running.get(destination, 0))
            return max(0, left)

        noted = _Noted(frozenset(probes), frozenset(settled), now)
        # Without policies, only a probe bounds a destination's room.
        bounded = bool(self.policies or fixed)
        return Bounds(
            frozenset(skip),
            room if bounded else None,
            lifts,
            noted,
            # Where a rate decides at the store's clock, the claim's starts
            # are stamped at it (an injected clock stamps the others).
            clock=now if clock and self._rated else None,
        )

    def admit(self, conn: Conn, rows: list[Row], claiming: Claiming) -> list[Row]:
        """Lock the state rows of the destinations that have a shared limit
        or a probe to send (in name order), read them and count again, and
        admit at most what they allow of each, oldest first; advance their
        rates and mark the probe, in this transaction."""
        noted = claiming.bounds.of(self).note
        probes = noted.probes if isinstance(noted, _Noted) else frozenset()
        settled = noted.settled if isinstance(noted, _Noted) else frozenset()
        now = noted.now if isinstance(noted, _Noted) else claiming.at
        if not (self.policies or probes or settled):
            return rows  # nothing to decide under a lock: the bounds said it all
        names = {str(row["deliver_to"]) for row in rows}
        guarded = sorted(
            name for name in names if self._limited(name) or name in probes or name in settled
        )
        if not guarded:
            return rows
        at = claiming.at
        self._ensure_rows(conn, guarded)
        candidates = Counter(str(row["deliver_to"]) for row in rows)
        quick = [
            name
            for name in guarded
            if name not in probes and name not in settled and self._rate_only(name)
        ]
        allowed = (
            self._advance_if_room(conn, quick, candidates, now, at, claiming.lease_until)
            if quick
            else {}
        )
        # Held starts the quick statement recorded on the holder's rows already.
        recorded = set(allowed) if sql.records_holds(conn.dialect) else set()
        for name in allowed:
            self._passed.pop(name, None)
        slow = [name for name in guarded if name not in allowed]
        locked = self._lock_rows(conn, slow) if slow else {}
        for name in slow:
            if name in probes and name not in locked:
                waited = self._probe_row(conn, name, rows, claiming)
                if waited is not None:
                    locked[name] = waited
        counted = [name for name in slow if self.policy(name).concurrency is not None]
        running = self.running(conn, at, counted) if counted else {}
        probe: dict[str, str | None] = {}
        for name in slow:
            if name not in locked:  # another claim decides for it now: none of its rows here
                allowed[name] = 0
                continue
            state = locked[name]
            settle(conn, name, state, at)
            allowed[name] = self._allowed(name, state, running.get(name, 0), at, now)
            if allowed[name] and effective(state, at).state is State.HALF_OPEN:
                # The probe is the destination's oldest due row, read after
                # the lock: a claimant holding another row of it sends none
                # (the one holding the oldest will).
                probe[name] = _oldest(conn, name, claiming)
        admitted: list[Row] = []
        taken: Counter[str] = Counter()
        first: dict[str, Row] = {}
        for row in rows:
            name = str(row["deliver_to"])
            if name in allowed:
                if taken[name] >= allowed[name]:
                    continue
                if name in probe and row["id"] != probe[name]:
                    continue
                taken[name] += 1
                first.setdefault(name, row)
            admitted.append(row)
        # The quick decisions advanced their rates already.
        self._started(
            conn, locked, {n: k for n, k in taken.items() if n in locked}, first, claiming, now
        )
        if self.pins is not None:
            rated = {n: k for n, k in taken.items() if self.policy(n).gcra_rate is not None}
            self._holding = rated
            self.pins.admitted(
                conn, {n: k for n, k in rated.items() if n not in recorded}, claiming.lease_until
            )
        return admitted

    def claimed(self, conn: Conn, claims: Sequence[Claim], claiming: Claiming) -> None:
        """The held starts this claim admitted: those claimed noted for the
        worker, the others (rows dead-lettered instead) uncounted (:mod:`.pins`)."""
        if self.pins is not None and self._holding:
            self.pins.made(conn, claims, self._holding)
            self._holding = {}

    def _probe_row(
        self, conn: Conn, name: str, rows: Sequence[Row], claiming: Claiming
    ) -> Row | None:
        """The state row of a half-open destination whose probe is due,
        which another claim holds, where this claim holds the destination's
        oldest due row (the probe): waited for, at most
        :data:`PROBE_LOCK_WAIT` seconds, and returned locked. Passed over
        instead, the probe would go nowhere this round: the claim holding
        the state row does not hold the oldest row, so it sends none either.
        Never waited for where rows do not lock (SQLite's one writer holds
        them all), nor when this claim does not hold the oldest row; a wait
        that runs out passes the destination over, as before (a bounded
        wait, well under the server's deadlock check, so no lock order
        between state rows is needed)."""
        if not conn.dialect.lock_clause:
            return None
        oldest = _oldest(conn, name, claiming)
        if oldest is None or not any(
            str(row["id"]) == oldest and str(row["deliver_to"]) == name for row in rows
        ):
            return None
        conn.execute(f"SAVEPOINT {sql.PROBE_WAIT}")
        try:
            was = conn.query_one(sql.WAIT_SETTING, (f"{int(PROBE_LOCK_WAIT * 1000)}ms",))
            found = conn.query_one(sql.lock_one(conn.dialect), (name,))
        except Exception:
            # Still held after the wait (or gone): as if passed over.
            conn.execute(f"ROLLBACK TO SAVEPOINT {sql.PROBE_WAIT}")
            conn.execute(f"RELEASE SAVEPOINT {sql.PROBE_WAIT}")
            return None
        conn.execute(f"RELEASE SAVEPOINT {sql.PROBE_WAIT}")
        assert was is not None
        conn.query_one(sql.RESTORE_SETTING, (str(was["was"]),))
        if found is not None:
            self._passed.pop(name, None)
        return found

    def _rate_only(self, name: str) -> bool:
        policy = self.policy(name)
        return policy.gcra_rate is not None and policy.concurrency is None

    def _advance_if_room(
        self,
        conn: Conn,
        names: list[str],
        candidates: Mapping[str, int],
        now: float,
        at: float,
        until: float,
    ) -> dict[str, int]:
        """The starts admitted of the rate-only ``names`` (sorted) that
        :func:`.admission_sql.advance_if_room`'s one statement decided, their rates
        advanced; those it did not decide (held by another claim, not
        plainly active, or, on SQLite, short of room for every candidate)
        are left to the locked read."""
        dialect = conn.dialect
        columns = []
        for name in names:
            policy = self.policy(name)
            rate = policy.gcra_rate
            assert rate is not None
            columns.append((name, candidates[name], rate.interval, float(policy.burst)))
        if dialect.arrays is not None:
            head: tuple[Any, ...] = tuple(list(column) for column in zip(*columns, strict=True))
        else:
            head = tuple(value for column in columns for value in column)
        held = self.pins is not None
        statement = sql.advance_if_room(dialect, len(names), held)
        if dialect.lock_clause:
            record: tuple[Any, ...] = ()
            if held and sql.records_holds(dialect):
                assert self.pins is not None
                record = (self.pins.current, until)
                totals = [self.pins.totals(name) for name in names]
                head = (*head, [t[0] for t in totals], [t[1] for t in totals])
            found = conn.query(statement, (*head, now, now, at, now, *record, at))
            return {str(row["name"]): int(row["admitted"]) for row in found}
        tail = (at, at, now, now, now) if held else (now, now, at, at, now, now, now)
        found = conn.query(statement, (*head, *tail))
        return {str(row["name"]): candidates[str(row["name"])] for row in found}

    def _ensure_rows(self, conn: Conn, names: list[str]) -> None:
        """Create the state rows of ``names`` this process has not seen."""
        fresh = [name for name in names if name not in self._rows]
        if fresh:
            arrays = conn.dialect.arrays
            conn.execute(sql.ensure(arrays, len(fresh)), sql.values(arrays, fresh))
            self._remember(fresh)

    def _remember(self, names: Iterable[str]) -> None:
        if len(self._rows) > 10_000:
            self._rows.clear()
        self._rows.update(names)

    def _lock_rows(self, conn: Conn, names: list[str]) -> dict[str, Row]:
        """The state rows of ``names`` (sorted, created already), locked in
        name order until the transaction ends where rows lock -- passing
        over a row another claim holds (it is not in the answer)."""
        arrays = conn.dialect.arrays
        statement = sql.lock(conn.dialect, len(names))
        locked = {str(row["name"]): row for row in conn.query(statement, sql.values(arrays, names))}
        missing = [name for name in names if name not in locked]
        for name in locked:
            self._passed.pop(name, None)
        if missing and conn.dialect.lock_clause:
            # Held by another claim -- or gone (no row is removed but by
            # hand): after a few such claims in a row, forgotten, so that
            # the next claim of it makes it again if need be.
            self._passed.update(missing)
            over = [name for name in missing if self._passed[name] >= PASSED_OVER]
            self._rows.difference_update(over)
            if len(self._passed) > 10_000:
                self._passed.clear()
        elif missing:  # nothing holds rows here: gone, make it again
            conn.execute(sql.ensure(arrays, len(missing)), sql.values(arrays, missing))
            again = conn.query(sql.lock(conn.dialect, len(missing)), sql.values(arrays, missing))
            locked.update((str(row["name"]), row) for row in again)
        return locked

    def _allowed(self, name: str, state: Row, running: int, at: float, now: float) -> int:
        """How many attempts ``name`` may start at ``at`` (``now`` on the
        rate's clock), from its locked ``state`` row and the attempts
        ``running``."""
        seen = effective(state, at)
        if seen.state in _CLOSED_TO_CLAIMS:
            return 0
        policy = self.policy(name)
        left = UNBOUNDED
        if seen.state is State.HALF_OPEN:
            if _probing(state, at):
                return 0
            left = 1
        rate = policy.gcra_rate
        if rate is not None:
            left = min(left, gcra.room(rate, policy.burst, state["rate_tat"], now, _held(state)))
        if policy.concurrency is not None:
            left = min(left, policy.concurrency - running)
        return max(0, left)

    def _started(
        self,
        conn: Conn,
        locked: Mapping[str, Row],
        taken: Mapping[str, int],
        first: Mapping[str, Row],
        claiming: Claiming,
        now: float,
    ) -> None:
        """Write what the admitted starts change: each rate's ``rate_tat``
        and each probe."""
        at = claiming.at
        advances = []
        holds: list[tuple[int, float, str]] = []
        for name, starts in taken.items():
            state = locked[name]
            rate = self.policy(name).gcra_rate
            if rate is not None and starts and self.pins is not None:
                holds.append((starts, at, name))
            elif rate is not None and starts:
                advances.append((gcra.advanced(rate, state["rate_tat"], now, starts), at, name))
            if starts and effective(state, at).state is State.HALF_OPEN:
                probe = str(first[name]["id"])
                conn.execute(sql.PROBE, (probe, claiming.lease_until, at, name))
                record_change(
                    conn,
                    name,
                    State(state["state"]),
                    State.HALF_OPEN,
                    reason=f"probe {probe}",
                    source=SOURCE_DELIVERY,
                    actor=claiming.actor,
                    now=at,
                    until=claiming.lease_until,
                )
        if advances:
            conn.executemany(sql.ADVANCE, advances)
        if holds:
            conn.executemany(sql.HOLD, holds)


def _oldest(conn: Conn, name: str, claiming: Claiming) -> str | None:
    """The id of ``name``'s oldest row due at the claim (that the claim's
    term allows), or None."""
    statement = statements.oldest_of_destination(conn.dialect.index_hint, claiming.term)
    found = conn.query_one(statement, CLAIM_ORDER.bound(claiming.at, head=(name,)))
    return None if found is None else str(found["id"])


def _held(state: Row) -> int:
    """Starts held by workers (:mod:`.pins`), counted as spent."""
    return int(state["rate_held"] or 0)


def _probing(state: Row, at: float) -> bool:
    """Whether ``state`` is a half-open breaker whose probe still runs."""
    until = state["probe_until"]
    return state["state"] == State.HALF_OPEN and until is not None and float(until) > at
