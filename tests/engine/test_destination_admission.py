"""Destination admission in the claim (docs/destinations.md), on real SQLite
files and the real PostgreSQL, both anyio backends: destinations closed to
claims are neither claimed nor read; a breaker sends one probe among any
number of claimants; a shared concurrency holds across stores; a rate is
never exceeded over any window; one claim shares itself fairly between
destinations however large one's backlog. Asserted on committed rows; the
reads are counted in what the engine does, never timed."""

from __future__ import annotations

import sqlite3
import threading
from collections import Counter
from collections.abc import Mapping, Sequence
from pathlib import Path

import anyio
import pytest

from trio_dispatch import (
    Breaker,
    Destination,
    open_store,
    pause_destination,
    resume_destination,
)
from trio_dispatch.destinations.outcomes import DestinationBook
from trio_dispatch.destinations.state import State
from trio_dispatch.outbox import Claim, claim_due, finish_attempt, next_due_at
from trio_dispatch.outbox.claim import (
    ClaimRule,
    ClaimRules,
    DestinationAdmission,
    OrderingKeys,
    claim_rules,
)
from trio_dispatch.outbox.claim.rules import Claiming
from trio_dispatch.outbox.machine import claim_batch
from trio_dispatch.store import SQLiteStore
from trio_dispatch.store.base import Conn, Row
from trio_dispatch.store.schema import SCHEMA_VERSION, statements
from trio_dispatch.transports import TransportResult

from ..conftest import RawDB
from .test_capped_scan import Reads, analyzed, fill

pytestmark = pytest.mark.anyio

T0 = 1_000_000.0
NOW = T0 + 10_000
LEASE = 30.0

Policies = Mapping[str, Destination]


def set_state(raw: RawDB, name: str, **columns: object) -> None:
    """A destination's state row as the ends of attempts and operators
    write it (the claim only reads what is there)."""
    names = ", ".join(columns)
    marks = ", ".join("?" * len(columns))
    raw.execute(
        f"INSERT INTO dispatch_destinations (name, {names}) VALUES (?, {marks})",
        (name, *columns.values()),
    )


async def claim(
    store: SQLiteStore, at: float = NOW, limit: int = 100, policies: Policies | None = None
) -> list[Claim]:
    claims, _ = await claim_due(
        store, now=at, limit=limit, lease_seconds=LEASE, destinations=policies
    )
    return claims


def destinations_of(claims: Sequence[Claim]) -> list[str]:
    return [claim.deliver_to for claim in claims]


async def test_closed_destinations_are_neither_claimed_nor_read(
    store: SQLiteStore, raw: RawDB
) -> None:
    closed = ("paused", "throttled", "open", "disabled", "probing")
    fill(raw, "ok", 3, NOW - 1, step=0.1)
    await pause_destination(store, "paused", until=NOW + 100, reason="maintenance", now=NOW - 5)
    set_state(raw, "throttled", throttled_until=NOW + 50)
    set_state(raw, "open", state="open", state_until=NOW + 60, opened_at=NOW - 1)
    set_state(raw, "disabled", state="disabled")
    set_state(raw, "probing", state="half_open", probe_id="probing-0", probe_until=NOW + 20)
    reads = Reads(raw)

    def unit(conn: Conn) -> list[str]:
        claims, _ = claim_batch(conn, NOW, 10, LEASE, "test", rules=claim_rules())
        return destinations_of(claims)

    assert reads.counted(unit)[0] == ["ok"] * 3
    # Each closed destination gets a backlog that comes first in due order,
    # then twice that: what the claim reads does not grow with it.
    work: list[int] = []
    for _ in range(2):
        for name in closed:
            fill(raw, name, 10_000, T0, step=0.01, prefix=f"{name}-{len(work)}")
        if reads.postgres:
            raw.execute("ANALYZE dispatch_outbox")
        claimed, cost = reads.counted(unit)
        assert claimed == ["ok"] * 3
        work.append(cost)
    assert work[1] <= work[0] + 10, work
    claims = await claim(store)
    assert destinations_of(claims) == ["ok"] * 3
    for name in closed:  # nothing of theirs moved
        assert (
            raw.scalar(
                "SELECT COUNT(*) FROM dispatch_outbox WHERE deliver_to = ? AND status = 'pending'",
                (name,),
            )
            == 20_000
        )
    # The idle path sleeps until the first of them is lifted (the probe's
    # lease end), not for its tick.
    assert await next_due_at(store, rules=claim_rules(), now=NOW) == NOW + 20


async def test_each_closed_destination_opens_again_when_its_state_says(
    store: SQLiteStore, raw: RawDB
) -> None:
    for name in ("paused", "throttled", "open", "probing", "disabled"):
        fill(raw, name, 3, T0, step=1.0)
    await pause_destination(store, "paused", until=NOW + 100, now=NOW - 5)
    set_state(raw, "throttled", throttled_until=NOW + 50)
    set_state(raw, "open", state="open", state_until=NOW + 60, opened_at=NOW - 1)
    set_state(raw, "probing", state="half_open", probe_id="probing-0", probe_until=NOW + 20)
    set_state(raw, "disabled", state="disabled")

    async def taken(at: float) -> Counter[str]:
        return Counter(destinations_of(await claim(store, at)))

    assert await taken(NOW + 10) == Counter()
    # The running probe's lease ended: one more probe, its oldest due row.
    probe = await claim(store, NOW + 21)
    assert [c.dispatch_id for c in probe] == ["probing-0"]
    row = raw.rows("SELECT * FROM dispatch_destinations WHERE name = 'probing'")[0]
    assert (row["state"], row["probe_id"]) == ("half_open", "probing-0")
    assert row["probe_until"] == probe[0].lease_until
    # The throttle ends: all of its rows; the open breaker's cool-down ends:
    # one probe; the last probe's lease ended: another.
    assert await taken(NOW + 61) == Counter(throttled=3, open=1, probing=1)
    assert await taken(NOW + 62) == Counter()  # both probes run
    # The pause lifts itself (recorded as the claim meets it); the leases
    # of the probes and of the throttled rows' attempts end again.
    assert await taken(NOW + 101) == Counter(paused=3, open=1, probing=1, throttled=3)
    changes = [
        tuple(change.values())
        for change in raw.rows(
            "SELECT destination, previous_state, state, source "
            "FROM dispatch_destination_changes ORDER BY id"
        )
    ]
    assert ("paused", "paused", "active", "scheduler") in changes
    assert ("open", "open", "half_open", "scheduler") in changes
    pending = "SELECT COUNT(*) FROM dispatch_outbox WHERE deliver_to = ? AND status = 'pending'"
    assert raw.scalar(pending, ("disabled",)) == 3


async def _claimants(target: str, n: int, at: float, policies: Policies | None) -> list[Claim]:
    """``n`` stores on one database claiming at once."""
    found: list[Claim] = []
    async with anyio.create_task_group() as group:
        for _ in range(n):

            async def one() -> None:
                async with open_store(target) as db:
                    claims, _ = await claim_due(
                        db, now=at, limit=50, lease_seconds=LEASE, destinations=policies
                    )
                    found.extend(claims)

            group.start_soon(one)
    return found


async def test_a_breaker_whose_cool_down_ended_sends_one_probe_among_four_claimants(
    store: SQLiteStore, raw: RawDB, db_target: str
) -> None:
    fill(raw, "api", 40, T0, step=1.0)
    set_state(raw, "api", state="open", state_until=NOW - 1, opened_at=T0, cool_down=60.0)
    claims = await _claimants(db_target, 4, NOW, None)
    assert [c.dispatch_id for c in claims] == ["api-0"]  # its oldest due row
    row = raw.rows("SELECT * FROM dispatch_destinations WHERE name = 'api'")[0]
    probe = (row["state"], row["probe_id"], row["probe_until"])
    assert probe == ("half_open", "api-0", NOW + LEASE)
    assert await _claimants(db_target, 4, NOW + 1, None) == []
    # The probe's lease ends with no finish: another goes, the oldest due
    # row (the lost probe, due again at its lease end, comes after it).
    again = await _claimants(db_target, 4, NOW + LEASE + 1, None)
    assert [c.dispatch_id for c in again] == ["api-1"]


async def test_a_shared_concurrency_holds_across_every_claimant(
    store: SQLiteStore, raw: RawDB, db_target: str
) -> None:
    fill(raw, "api", 30, T0, step=1.0)
    fill(raw, "other", 5, T0, step=1.0)
    policies = {"api": Destination(concurrency=3), "*": Destination(concurrency=2)}
    claims = await _claimants(db_target, 4, NOW, policies)
    assert sorted(destinations_of(claims)) == ["api"] * 3 + ["other"] * 2
    assert await _claimants(db_target, 4, NOW, policies) == []
    # One ends: one more starts.
    ended = next(c for c in claims if c.deliver_to == "api")
    await finish_attempt(store, ended, TransportResult(ok=True), now=NOW + 1)
    assert destinations_of(await _claimants(db_target, 4, NOW + 1, policies)) == ["api"]
    # A dead worker's attempts count until their lease ends, then the rows
    # are recovered within the limit.
    later = await _claimants(db_target, 4, NOW + LEASE + 2, policies)
    assert sorted(destinations_of(later)) == ["api"] * 3 + ["other"] * 2
    live = raw.scalar(
        "SELECT COUNT(*) FROM dispatch_outbox WHERE deliver_to = 'api' AND status = 'delivering' "
        "AND next_attempt_at > ?",
        (NOW + LEASE + 2,),
    )
    assert live == 3


@pytest.mark.sqlite_only
async def test_a_rate_is_never_exceeded_over_any_window(store: SQLiteStore, raw: RawDB) -> None:
    fill(raw, "api", 400, T0, step=0.01)
    fill(raw, "free", 50, T0, step=0.01)
    policies = {"api": Destination(rate="10/s", burst=3)}
    started: list[float] = []
    # Claims every 30 ms of the store's clock for 12 s, each for all it can.
    for step in range(400):
        at = NOW + step * 0.03
        claims = await claim(store, at, limit=100, policies=policies)
        started += [at for c in claims if c.deliver_to == "api"]
    _assert_rate(started, rate=10.0, burst=3, slack=0.0)
    # And the rate is used, not merely respected: 3 at once, then 10 a second.
    assert len(started) >= 3 + 10 * 11.5
    assert started[:3] == [NOW] * 3 and started[3] > NOW


@pytest.mark.slow  # 4 claimants race 1.5 s (3 s of server CPU); test_rate_claims runs in the loop
@pytest.mark.postgres_only
async def test_a_rate_is_never_exceeded_by_claimants_on_the_servers_clock(
    store: SQLiteStore, raw: RawDB, db_target: str
) -> None:
    import time

    fill(raw, "api", 300, T0, step=0.01)
    policies = {"api": Destination(rate="20/s", burst=4)}

    def server_now() -> float:
        return float(raw.scalar("SELECT EXTRACT(EPOCH FROM clock_timestamp())::float8"))

    async def claimants(until: float) -> int:
        taken = 0

        async def one() -> None:
            nonlocal taken
            async with open_store(db_target) as db:
                while True:
                    claims, _ = await claim_due(
                        db, limit=50, lease_seconds=LEASE, destinations=policies
                    )
                    taken += len(claims)
                    if time.time() >= until:
                        return
                    await anyio.sleep(0.005)

        async with anyio.create_task_group() as group:
            for _ in range(4):
                group.start_soon(one)
        return taken

    # Every admission reads the server's clock between two readings of it
    # here: the rate bounds the starts between them exactly.
    began = server_now()
    at_once = await claimants(0)  # four claimants, one claim each
    first = server_now()
    assert 4 <= at_once <= 20 * (first - began) + 4
    more = await claimants(time.time() + 1.5)
    ended = server_now()
    assert at_once + more <= 20 * (ended - began) + 4
    assert at_once + more >= 4 + 20 * 1.0  # and the rate is used


def _assert_rate(started: list[float], *, rate: float, burst: int, slack: float) -> None:
    """Over every window [t_i, t_j] between two starts, the starts in it are
    at most ``rate * (t_j - t_i + slack) + burst``."""
    times = sorted(started)
    for i, first in enumerate(times):
        for j in range(i, len(times)):
            window = times[j] - first
            assert j - i + 1 <= rate * (window + slack) + burst + 1e-6, (i, j, window)


async def test_one_claim_shares_itself_fairly_behind_a_big_backlog(
    store: SQLiteStore, raw: RawDB
) -> None:
    fill(raw, "b", 1, NOW - 10)
    fill(raw, "c", 2, NOW - 5, step=1.0)
    reads = Reads(raw)

    def unit(conn: Conn) -> list[str]:
        claims, _ = claim_batch(conn, NOW, 10, LEASE, "test", rules=claim_rules())
        return [claim.dispatch_id for claim in claims]

    _, without = reads.counted(unit)
    fill(raw, "a", 50_000, T0, step=0.01)  # all due before the others
    if reads.postgres:
        analyzed(raw)
    taken, behind = reads.counted(unit)
    # Round-robin by destination, oldest destination first, each oldest first.
    assert taken == ["a-0", "b-0", "c-0", "a-1", "c-1", "a-2", "a-3", "a-4", "a-5", "a-6"]
    assert behind <= 4 * without + 200, (behind, without)
    claims = await claim(store, limit=4)
    assert [c.dispatch_id for c in claims] == ["a-0", "b-0", "c-0", "a-1"]


async def test_equal_backlogs_get_equal_shares(store: SQLiteStore, raw: RawDB) -> None:
    for i, name in enumerate("pqr"):
        fill(raw, name, 500, T0 + i, step=1.0)
    claims = await claim(store, limit=7)
    assert destinations_of(claims) == ["p", "q", "r", "p", "q", "r", "p"]
    # Within each destination's room: the rate's room of one leaves the
    # rest to the others.
    policies = {"q": Destination(rate="1/h")}
    claims = await claim(store, limit=7, policies=policies)
    assert destinations_of(claims) == ["p", "q", "r", "p", "r", "p", "r"]


@pytest.mark.sqlite_only
async def test_a_version_9_database_migrates_and_unlimited_destinations_claim_as_before(
    db_path: Path, raw: RawDB
) -> None:
    conn = sqlite3.connect(db_path, isolation_level=None)
    for statement in statements(*range(1, 10)):
        conn.execute(statement)
    conn.execute(
        "CREATE TABLE trio_dispatch_schema (version INTEGER NOT NULL, applied_at FLOAT NOT NULL)"
    )
    conn.executemany("INSERT INTO trio_dispatch_schema VALUES (?, 0)", [(v,) for v in range(1, 10)])
    conn.close()
    fill(raw, "x", 5, T0, step=1.0)
    async with open_store(db_path) as db:
        claims, _ = await claim_due(db, now=NOW, limit=10)
    assert raw.scalar("SELECT MAX(version) FROM trio_dispatch_schema") == SCHEMA_VERSION
    assert [c.dispatch_id for c in claims] == [f"x-{i}" for i in range(5)]
    # An unlimited destination leaves no state behind.
    assert raw.scalar("SELECT COUNT(*) FROM dispatch_destinations") == 0


async def test_resume_opens_a_paused_destination_at_once(store: SQLiteStore, raw: RawDB) -> None:
    fill(raw, "d", 2, T0, step=1.0)
    await pause_destination(store, "d", now=NOW - 1)
    assert await claim(store) == []
    assert await next_due_at(store, rules=claim_rules(), now=NOW) is None  # paused until resumed
    assert await resume_destination(store, "d", now=NOW)
    assert destinations_of(await claim(store)) == ["d", "d"]
    assert (
        State(raw.scalar("SELECT state FROM dispatch_destinations WHERE name = 'd'"))
        is State.ACTIVE
    )


class _Held(ClaimRule):
    """A rule of the test's own, before the admission: it holds the claim
    between its read and its admission until released."""

    def __init__(self) -> None:
        self.reached = threading.Event()
        self.release = threading.Event()

    def admit(self, conn: Conn, rows: list[Row], claiming: Claiming) -> list[Row]:
        self.reached.set()
        assert self.release.wait(30)
        return rows


@pytest.mark.postgres_only
@pytest.mark.parametrize(
    "policy", [Destination(concurrency=3), Destination(rate="3/h", burst=3)], ids=["conc", "rate"]
)
async def test_a_claim_decides_after_the_lock_from_what_others_committed_meanwhile(
    store: SQLiteStore, raw: RawDB, db_target: str, policy: Destination
) -> None:
    fill(raw, "api", 10, T0, step=1.0)
    held = _Held()
    first = ClaimRules((OrderingKeys(), held, DestinationAdmission({"api": policy})))
    found: list[Claim] = []
    async with open_store(db_target) as other, anyio.create_task_group() as group:

        async def slow() -> None:
            claims, _ = await claim_due(store, now=NOW, limit=3, lease_seconds=LEASE, rules=first)
            found.extend(claims)

        group.start_soon(slow)
        # The first claim has read (and locked) three candidates and its
        # bounds (room for 3) and waits; another claims 3 more and commits.
        await anyio.to_thread.run_sync(held.reached.wait, 30)
        claims, _ = await claim_due(
            other, now=NOW, limit=10, lease_seconds=LEASE, destinations={"api": policy}
        )
        assert len(claims) == 3
        held.release.set()
    assert found == []  # counted again under the lock: no room left
    assert raw.scalar("SELECT COUNT(*) FROM dispatch_outbox WHERE status = 'delivering'") == 3


async def test_a_breaker_opened_by_failures_probes_once_and_closes_on_its_success(
    store: SQLiteStore, raw: RawDB
) -> None:
    book = DestinationBook(
        {"api": Destination(breaker=Breaker(failures=2, min_span_seconds=0, cool_down_seconds=60))}
    )
    fill(raw, "api", 6, T0, step=1.0)

    async def claimed(at: float) -> list[Claim]:
        claims, _ = await claim_due(store, now=at, limit=10, lease_seconds=LEASE, destinations=book)
        return claims

    failing = await claimed(NOW)
    assert len(failing) == 6
    for claim in failing[:2]:  # two failures in a row open it
        await finish_attempt(
            store, claim, TransportResult.failure("HTTP 500"), now=NOW + 1, destinations=book
        )
    assert (
        State(raw.scalar("SELECT state FROM dispatch_destinations WHERE name = 'api'"))
        is State.OPEN
    )
    assert await claimed(NOW + 40) == []  # open: the failed rows wait, unread
    # Cool-down over: one probe, the oldest due row, among every claim.
    [probe] = await claimed(NOW + 62)
    assert await claimed(NOW + 63) == []
    row = raw.rows("SELECT * FROM dispatch_destinations WHERE name = 'api'")[0]
    assert (row["state"], row["probe_id"]) == ("half_open", probe.dispatch_id)
    # Its success closes the breaker (the finish's side): claims flow again.
    await finish_attempt(store, probe, TransportResult(ok=True), now=NOW + 64, destinations=book)
    assert (
        State(raw.scalar("SELECT state FROM dispatch_destinations WHERE name = 'api'"))
        is State.ACTIVE
    )
    assert len(await claimed(NOW + 200)) == 5


_SPREAD = (
    "WITH RECURSIVE n(i) AS (SELECT 0 UNION ALL SELECT i + 1 FROM n WHERE i + 1 < ?) "
    "INSERT INTO dispatch_outbox (id, kind, deliver_to, payload, status, attempt, "
    "next_attempt_at, created_at, updated_at) "
    "SELECT CAST(? AS TEXT) || i, 'k', CAST(? AS TEXT) || i, '{}', 'pending', 0, "
    "? + i * 0.001, ? + i * 0.001, ? FROM n"
)


async def test_a_claim_among_many_destinations_reads_no_more_than_among_few(
    store: SQLiteStore, raw: RawDB
) -> None:
    reads = Reads(raw)

    def unit(conn: Conn) -> list[str]:
        claims, _ = claim_batch(conn, NOW, 10, LEASE, "test", rules=claim_rules())
        return [claim.dispatch_id for claim in claims]

    # One row for each of 20 destinations, then for each of 4,000 more: the
    # oldest ten are ten destinations' heads, the whole fair share, read
    # without a scan of every destination's head.
    raw.execute(_SPREAD, (20, "a-", "a", T0, T0, T0))
    taken, few = reads.counted(unit)
    assert taken == [f"a-{i}" for i in range(10)]
    raw.execute(_SPREAD, (4000, "z-", "z", T0 + 1, T0 + 1, T0))
    if reads.postgres:
        raw.execute("ANALYZE dispatch_outbox")
    taken, many = reads.counted(unit)
    assert taken == [f"a-{i}" for i in range(10)]
    assert many <= few + 10, (many, few)
