"""A rate's starts claimed ahead of a worker's free slots (docs/destinations.md).

A worker holds rows claimed ahead of its slots so that no slot waits on a
commit (:mod:`trio_dispatch.worker.finisher`). A rate counts a start when
the attempt begins, though, and a row held ahead begins later than its
claim: counted at the claim, rows held by several workers could begin
together as slots free up, beyond the burst. So a worker that holds rows
ahead (one with a :class:`Pins`) has the claim admit its rated rows as
*held*: the destination's ``rate_held`` (read by every claim's admission
under the state row's lock) counts each as spent, without draining, until
the worker records that it began -- then it moves into ``rate_tat`` at the
time it began -- or that it never will (given back unsent). The bucket's
level plus the held starts never exceeds the burst, and the level alone is
the one of the starts as they began, so the rate is kept in every window.

What the worker owes the store is written by the next claim's transaction
(:meth:`Pins.sync`), before its read: per destination, its running totals
of held starts *resolved* (begun or given back) and *begun*, against the
totals its row in ``dispatch_destination_holds`` recorded. The write is
absolute, so a transaction that rolls back loses nothing (the next one
sends the same totals), and a state row another claim holds is passed
over, not waited for (the totals go with the next write). Each holder's
row keeps its held starts and the lease end of its latest claim: a worker
that dies leaves its row, and once that lease is well past
(:data:`REAP_MARGIN`), any worker charges its held starts in full (as
begun then) and removes it (:meth:`Pins.reap`).
"""

from __future__ import annotations

import dataclasses
import functools
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Final

from ...destinations.policy import Destination, policy_for
from ...store.base import Conn
from ...store.dialect import ArrayForms
from ...store.schema import DESTINATION_HOLDS_TABLE, DESTINATIONS_TABLE

if TYPE_CHECKING:
    from ..transitions import Claim

HOLDS: Final = DESTINATION_HOLDS_TABLE
SEND_EVERY: Final = 0.05
"""Seconds at most between the sends of a destination's resolved held
starts, while fewer than a quarter of its burst wait to be sent."""
REAP_EVERY: Final = 5.0
"""Seconds between a worker's looks for the rows of dead holders."""
REAP_MARGIN: Final = 1.0
"""Seconds past a holder's last lease end before its row is reaped: a host
whose clock runs ahead by less than this never charges a live holder's
starts early."""

_UPSERT_HOLD: Final = (
    f"INSERT INTO {HOLDS} (name, holder, held, resolved, started, until_at) "
    "VALUES (?, ?, ?, ?, ?, ?) ON CONFLICT (name, holder) DO UPDATE SET "
    f"held = {HOLDS}.held + excluded.held, until_at = CASE WHEN excluded.until_at > "
    f"{HOLDS}.until_at THEN excluded.until_at ELSE {HOLDS}.until_at END"
)
_HOLDS_OF: Final = (
    f"SELECT name, held, resolved, started FROM {HOLDS} WHERE holder = ? AND name IN ({{}})"
)
_SET_HOLD: Final = (
    f"UPDATE {HOLDS} SET held = ?, resolved = ?, started = ? WHERE name = ? AND holder = ?"
)
_EXPIRED: Final = (
    f"SELECT name, holder, held, until_at FROM {HOLDS} WHERE until_at <= ? ORDER BY name"
)
_DROP_HOLD: Final = (
    f"DELETE FROM {HOLDS} WHERE name = ? AND holder = ? AND held = ? AND until_at = ?"
)
_UNHOLD_STATE: Final = (
    f"UPDATE {DESTINATIONS_TABLE} SET rate_held = CASE WHEN rate_held > ? THEN rate_held - ? "
    "ELSE 0 END WHERE name = ?"
)
_UNHOLD: Final = (
    f"UPDATE {HOLDS} SET held = CASE WHEN held > ? THEN held - ? ELSE 0 END "
    "WHERE name = ? AND holder = ?"
)


def _charge(now: str) -> str:
    # Held starts resolved (parameters: dr twice), begun ones charged at
    # their time (ds, when, when, when, ds, step; ``when`` is ``now - ago``).
    return (
        f"UPDATE {DESTINATIONS_TABLE} SET "
        "rate_held = CASE WHEN rate_held > ? THEN rate_held - ? ELSE 0 END, "
        "rate_tat = CASE WHEN ? > 0 THEN (CASE WHEN rate_tat IS NULL OR rate_tat < "
        f"{now} - ? THEN {now} - ? ELSE rate_tat END) + ? * ? ELSE rate_tat END "
        "WHERE name = ?"
    )


@functools.cache
def _sync_at_once(arrays: ArrayForms, clock: str, lock: str) -> str:
    """The sync of one holder in one statement, where ``WITH`` may write
    (PostgreSQL): the state rows of the destinations sent (arrays of name,
    resolved, started, ago, step) locked in name order, passing over those
    another claim holds; the holder's rows and the state rows moved as
    :meth:`Pins.sync` does (``lock``: the dialect's skipping lock clause).
    The state rows move by what the holder's rows did (a row a reaper
    removed meanwhile moves nothing). Answers the names it locked.
    Parameters: the five arrays, then the holder."""
    sent = arrays.rows(("text", "int8", "int8", "float8", "float8"))
    return (
        f"WITH s(name, resolved, started, ago, step) AS ({sent}), "
        f"d AS MATERIALIZED (SELECT name FROM {DESTINATIONS_TABLE} "
        f"WHERE name IN (SELECT name FROM s) ORDER BY name{lock}), "
        "h AS (SELECT h.name, LEAST(h.held, GREATEST(0, s.resolved - h.resolved)) AS dr, "
        "GREATEST(0, s.started - h.started) AS ds, s.resolved, s.started, s.ago, s.step, "
        "h.holder "
        f"FROM {HOLDS} h JOIN s ON s.name = h.name "
        "WHERE h.holder = ? AND h.name IN (SELECT name FROM d)), "
        f"u AS (UPDATE {HOLDS} t SET held = t.held - h.dr, resolved = h.resolved, "
        "started = h.started FROM h WHERE t.name = h.name AND t.holder = h.holder "
        "RETURNING h.name, h.dr, h.ds, h.ago, h.step), "
        f"v AS (UPDATE {DESTINATIONS_TABLE} t SET rate_held = GREATEST(0, t.rate_held - u.dr), "
        "rate_tat = CASE WHEN u.ds > 0 THEN GREATEST(COALESCE(t.rate_tat, 0), "
        f"{clock} - u.ago) + u.ds * u.step ELSE t.rate_tat END FROM u WHERE t.name = u.name) "
        "SELECT name FROM d"
    )


def _lock(dialect_lock: str, count: int) -> str:
    return (
        f"SELECT name FROM {DESTINATIONS_TABLE} WHERE name IN ({', '.join('?' * count)}) "
        f"ORDER BY name{dialect_lock}"
    )


@dataclasses.dataclass
class _Totals:
    """One destination's held starts, as one holder resolved them."""

    resolved: int = 0
    started: int = 0
    began_at: float = 0.0
    """When the latest of them began (``time.monotonic``)."""


def held_starts(policies: Mapping[str, Destination]) -> Pins | None:
    """The :class:`Pins` of a worker that holds rows ahead under
    ``policies``; None where no destination has a rate."""
    if not any(policy.gcra_rate is not None for policy in policies.values()):
        return None

    def rate(name: str) -> tuple[float, int] | None:
        policy = policy_for(policies, name)
        rate = policy.gcra_rate
        return None if rate is None else (rate.interval, policy.burst)

    return Pins(rate)


class Pins:
    """The held starts of one worker (one holder): which of its claims are
    held, and what it owes the store. ``rate(name)`` is the interval and
    the burst of destination ``name``'s rate (None: no rate, nothing held).

    The event loop (claims received, attempts begun, give-backs) and the
    store's writer thread (the claim's transaction) both use it: every
    change of its state holds :attr:`_lock`, never across a statement."""

    def __init__(self, rate: Callable[[str], tuple[float, int] | None]) -> None:
        self.rate = rate
        self.holder = uuid.uuid4().hex
        """The holder new claims are admitted for (replaced after a failed
        write: a claim whose outcome it hid holds starts on the old row
        only, which its lease ends)."""
        self.current = self.holder
        """The holder of the claim being made (read as its transaction
        began: writes run one at a time on the store's writer thread)."""
        self._lock = threading.Lock()
        self._made: dict[tuple[str, int], tuple[str, str]] = {}
        """Claims a transaction made as held starts, until the worker
        receives them: (dispatch id, attempt) -> (holder, destination)."""
        self._held: dict[tuple[str, int], tuple[str, str]] = {}
        """Held claims the worker holds: (dispatch id, attempt) -> (holder,
        destination)."""
        self._totals: dict[tuple[str, str], _Totals] = {}
        self._dirty: dict[tuple[str, str], int] = {}
        """(holder, destination) whose totals the store may not have yet ->
        how many held starts were resolved since they were last sent."""
        self._urgent = False
        """Send every total at the next sync (a failed write, a give-back)."""
        self._sent_at: dict[tuple[str, str], float] = {}
        self.send_every = SEND_EVERY
        self._reaped_at = float("-inf")

    def __len__(self) -> int:
        """Held claims not yet resolved."""
        with self._lock:
            return len(self._held)

    # -- the worker's side (event loop) ------------------------------------

    def claimed(self, claims: Iterable[Claim]) -> None:
        """Claims the worker received: those the claim made as held starts
        are held (for the holder they were admitted for)."""
        with self._lock:
            for claim in claims:
                key = (claim.dispatch_id, claim.attempt)
                found = self._made.pop(key, None)
                if found is not None:
                    self._held[key] = found

    def began(self, claim: Claim) -> None:
        """``claim``'s attempt begins now."""
        with self._lock:
            self._resolve(claim, began=True)

    def starting(self, claim: Claim, *, sent: bool) -> None:
        """``claim``'s slot takes it now: its attempt begins if it is to be
        ``sent``, else (its lease ran out while held) it never will."""
        with self._lock:
            self._resolve(claim, began=sent)

    def dropped(self, claims: Iterable[Claim]) -> None:
        """``claims`` are given back, never begun."""
        with self._lock:
            for claim in claims:
                self._resolve(claim, began=False)
            self._urgent = True

    def failed(self) -> None:
        """A write failed: its outcome may be unknown (a claim committed
        whose claims never came back would hold starts no one resolves).
        Every total is sent again, and new claims go to a new holder, so
        the old row ends with its lease (then it is reaped, charged in
        full)."""
        with self._lock:
            for key in self._totals:
                self._dirty.setdefault(key, 0)
            self._urgent = True
            self.holder = uuid.uuid4().hex
            if len(self._made) > 100_000:  # claims that never came back
                self._made.clear()

    def _resolve(self, claim: Claim, *, began: bool) -> None:
        found = self._held.pop((claim.dispatch_id, claim.attempt), None)
        if found is None:
            return
        totals = self._totals.setdefault(found, _Totals())
        totals.resolved += 1
        if began:
            totals.started += 1
            totals.began_at = time.monotonic()
        self._dirty[found] = self._dirty.get(found, 0) + 1

    # -- the store's side (inside a claim's write transaction) -------------

    def totals(self, name: str) -> tuple[int, int]:
        """The current holder's held starts of ``name`` resolved and begun
        so far: where a claim makes its row, what it starts from."""
        with self._lock:
            found = self._totals.get((self.current, name))
            return (0, 0) if found is None else (found.resolved, found.started)

    def admitted(self, conn: Conn, taken: dict[str, int], until: float) -> None:
        """Record ``taken`` held starts per destination, admitted by this
        transaction's claim (the state rows' ``rate_held`` moved already),
        on the current holder's rows, with the claim's lease end ``until``."""
        rows = []
        for name in sorted(taken):
            if taken[name]:
                rows.append((name, self.current, taken[name], *self.totals(name), until))
        if rows:
            conn.executemany(_UPSERT_HOLD, rows)

    def made(self, conn: Conn, claims: Iterable[Claim], taken: Mapping[str, int]) -> None:
        """The claims this transaction made of the ``taken`` held starts
        per destination it admitted: each noted for the worker, and the
        held starts admitted but not claimed (a row the claim
        dead-lettered instead) taken out of the counts at once."""
        made: dict[str, int] = {}
        with self._lock:
            for claim in claims:
                if claim.deliver_to in taken:
                    made[claim.deliver_to] = made.get(claim.deliver_to, 0) + 1
                    key = (claim.dispatch_id, claim.attempt)
                    self._made[key] = (self.current, claim.deliver_to)
        for name in sorted(taken):
            unclaimed = taken[name] - made.get(name, 0)
            if unclaimed > 0:
                conn.execute(_UNHOLD_STATE, (unclaimed, unclaimed, name))
                conn.execute(_UNHOLD, (unclaimed, unclaimed, name, self.current))

    def sync(self, conn: Conn, at: float) -> None:
        """Write what this worker owes the store (see the module docstring),
        and every :data:`REAP_EVERY` seconds reap dead holders' rows; ``at``
        is the claim's time (the worker's clock)."""
        with self._lock:
            self.current = self.holder
            due = self._due()
            sent = {
                key: (totals.resolved, totals.started, totals.began_at)
                for key in due
                for totals in (self._totals[key],)
            }
        for holder in sorted({holder for holder, _ in due}):
            names = sorted(name for owner, name in due if owner == holder)
            self._sync_holder(conn, holder, names, at, sent)
        if at - self._reaped_at >= REAP_EVERY:
            self._reaped_at = at
            self.reap(conn, at)

    def _due(self) -> list[tuple[str, str]]:
        """The totals to send now: all after a failed write or a give-back;
        else each destination's once a quarter of its burst (at least one)
        was resolved since it was last sent, or :data:`SEND_EVERY` seconds
        after that. Until sent, the resolved starts stay counted as held:
        other claims see at most that much less room, never more."""
        if self._urgent:
            self._urgent = False
            return [key for key in self._dirty if key in self._totals]
        moment = time.monotonic()
        due = []
        for key, resolved in self._dirty.items():
            if key not in self._totals:
                continue
            rate = self.rate(key[1])
            enough = max(1, (rate[1] if rate is not None else 1) // 4)
            last = self._sent_at.get(key)
            if resolved >= enough or last is None or moment - last >= self.send_every:
                due.append(key)
        return due

    def _sync_holder(
        self,
        conn: Conn,
        holder: str,
        names: list[str],
        at: float,
        sent: Mapping[tuple[str, str], tuple[int, int, float]],
    ) -> None:
        dialect = conn.dialect
        moment = time.monotonic()
        if dialect.arrays is not None and dialect.clock:
            columns: list[list[object]] = [[], [], [], [], []]
            for name in names:
                resolved, started, began_at = sent[(holder, name)]
                values = (
                    name,
                    resolved,
                    started,
                    max(0.0, moment - began_at),
                    self._interval(name),
                )
                for column, value in zip(columns, values, strict=True):
                    column.append(value)
            statement = _sync_at_once(dialect.arrays, dialect.clock, dialect.lock_clause)
            locked = conn.query(statement, (*columns, holder))
            self._sent(holder, [str(row["name"]) for row in locked], sent)
            return
        if dialect.lock_clause:
            # Passed over where another claim holds the state row: sent again.
            locking = _lock(dialect.lock_clause, len(names))
            names = [str(row["name"]) for row in conn.query(locking, names)]
            if not names:
                return
        found = conn.query(_HOLDS_OF.format(", ".join("?" * len(names))), (holder, *names))
        now = dialect.clock or "?"
        holds: list[tuple[object, ...]] = []
        charges: list[tuple[object, ...]] = []
        for row in found:
            name = str(row["name"])
            total_resolved, total_started, began_at = sent[(holder, name)]
            held = int(row["held"])
            resolved = min(held, max(0, total_resolved - int(row["resolved"])))
            started = max(0, total_started - int(row["started"]))
            holds.append((held - resolved, total_resolved, total_started, name, holder))
            step = self._interval(name)
            ago = max(0.0, moment - began_at)
            times = (ago, ago) if dialect.clock else (at, ago, at, ago)
            charges.append((resolved, resolved, started, *times, started, step, name))
        if holds:
            conn.executemany(_SET_HOLD, holds)
            conn.executemany(_charge(now), charges)
        self._sent(holder, names, sent)

    def _interval(self, name: str) -> float:
        rate = self.rate(name)
        return 0.0 if rate is None else rate[0]

    def _sent(
        self,
        holder: str,
        names: Iterable[str],
        sent: Mapping[tuple[str, str], tuple[int, int, float]],
    ) -> None:
        # Sent (a rollback re-marks them through failed()); a row that is
        # gone was reaped: its starts were charged in full already. What
        # was resolved while the statement ran is sent next time.
        moment = time.monotonic()
        with self._lock:
            for name in names:
                key = (holder, name)
                later = self._totals[key].resolved - sent[key][0]
                if later > 0:
                    self._dirty[key] = later
                else:
                    self._dirty.pop(key, None)
                self._sent_at[key] = moment
            if holder != self.holder:
                self._forget(holder)

    def _forget(self, holder: str) -> None:
        """Drop a replaced holder's totals once none of its claims is held."""
        owners = [owner for owner, _ in (*self._held.values(), *self._made.values())]
        if holder not in owners and not any(owner == holder for owner, _ in self._dirty):
            for key in [key for key in self._totals if key[0] == holder]:
                del self._totals[key]
                self._sent_at.pop(key, None)

    def reap(self, conn: Conn, at: float) -> int:
        """Charge and remove the rows of holders whose last lease ended more
        than :data:`REAP_MARGIN` ago (a dead worker's): their held starts
        count as begun now. A destination without a rate here is left to a
        worker that knows its rate. Returns the rows reaped."""
        expired = [
            row
            for row in conn.query(_EXPIRED, (at - REAP_MARGIN,))
            if self.rate(str(row["name"])) is not None
        ]
        if not expired:
            return 0
        dialect = conn.dialect
        names = sorted({str(row["name"]) for row in expired})
        if dialect.lock_clause:
            locking = _lock(dialect.lock_clause, len(names))
            locked = {str(row["name"]) for row in conn.query(locking, names)}
        else:
            locked = set(names)
        now = dialect.clock or "?"
        reaped = 0
        for row in expired:
            name, holder, held = str(row["name"]), str(row["holder"]), int(row["held"])
            if name not in locked:
                continue
            if conn.execute(_DROP_HOLD, (name, holder, held, row["until_at"])) != 1:
                continue  # its holder wrote meanwhile: alive after all
            reaped += 1
            step = self._interval(name)
            times = (0.0, 0.0) if dialect.clock else (at, 0.0, at, 0.0)
            charge = (held, held, held, *times, held, step, name)
            conn.execute(_charge(now), charge)
        return reaped
