"""Priority (docs/controls.md) on real stores, both engines and both anyio
backends: among due rows a row of priority p goes as if it had become due
p * step sooner, it is never claimed before it is due, a row of the lowest
priority behind a flood still goes within 20 steps of a row of priority 0,
a row keeps its place through retries, throttles, releases and an
operator's retry, and an ordering key stays first in, first out. Time is
the caller's: every call is given its ``now``."""

from __future__ import annotations

import contextlib
import logging
import re
import sqlite3
from collections.abc import Iterator
from functools import partial
from typing import Any

import anyio
import pytest

from trio_dispatch import (
    enqueue_dispatch,
    enqueue_many,
    get_dispatch,
    list_dispatches,
    open_store,
    retry_dispatch,
)
from trio_dispatch.outbox import Claim, claim_due, finish_attempt, next_due_at, release_attempt
from trio_dispatch.outbox.claim import claim_rules
from trio_dispatch.outbox.claim.scan import next_due, select_due
from trio_dispatch.outbox.priority_step import priority_step, record_priority_step
from trio_dispatch.outbox.reads import dispatch_stats
from trio_dispatch.schedules import Schedule
from trio_dispatch.schedules.runs import fire_manual
from trio_dispatch.store import SQLiteStore
from trio_dispatch.store.base import Conn, Database
from trio_dispatch.store.schema import (
    DESTINATION_INDEX,
    DUE_INDEX,
    HELD_BACK_DESTINATION_INDEX,
    HELD_BACK_INDEX,
    MIGRATIONS,
)
from trio_dispatch.transports import TransportResult
from trio_dispatch.worker import DispatchWorker

from ..conftest import RawDB
from ..helpers import size
from .test_capped_scan import Reads, fill

pytestmark = pytest.mark.anyio

T0 = 1_000_000.0
STEP = 300.0
"""The store's step until a test records another."""


async def claim_ids(store: Database, at: float, limit: int = 100) -> list[str]:
    claims, _ = await claim_due(store, now=at, limit=limit)
    return [claim.dispatch_id for claim in claims]


async def claim_one(store: SQLiteStore, at: float) -> Claim:
    claims, _ = await claim_due(store, now=at, limit=1)
    assert len(claims) == 1, claims
    return claims[0]


async def test_higher_priority_goes_first_among_rows_due_together(store: SQLiteStore) -> None:
    priorities = [0, 5, -5, 10, 3, -10, -1]
    results = await enqueue_many(
        store, [{"kind": f"p{p}", "deliver_to": "d", "priority": p} for p in priorities], now=T0
    )
    by_id = {result.id: p for result, p in zip(results, priorities, strict=True)}
    # Every row is due at T0; the ones below 0 come from the claim's second
    # lane (ranked after now), still in the same claim.
    claimed = await claim_ids(store, T0)
    assert [by_id[i] for i in claimed] == sorted(priorities, reverse=True)


async def test_a_head_start_reorders_rows_due_about_the_same_time_only(
    store: SQLiteStore,
) -> None:
    plain = await enqueue_dispatch(store, kind="k", deliver_to="d", now=T0)
    soon = await enqueue_dispatch(store, kind="k", deliver_to="d", priority=1, now=T0 + 200)
    later = await enqueue_dispatch(store, kind="k", deliver_to="d", priority=1, now=T0 + 400)
    # One step ahead: before a row due 200 s sooner, behind one due 400 s sooner.
    assert await claim_ids(store, T0 + 500) == [soon, plain, later]


async def test_a_row_is_never_claimed_before_it_is_due(store: SQLiteStore, raw: RawDB) -> None:
    urgent = await enqueue_dispatch(store, kind="k", deliver_to="d", priority=10, now=T0)
    first = await claim_one(store, T0)
    await finish_attempt(store, first, TransportResult.failure("boom"), now=T0)
    due = float(raw.row(urgent)["next_attempt_at"])
    assert due == T0 + 60  # the backoff after attempt 1
    # Its rank (due less 10 steps) is long past: it is read and passed over.
    assert await claim_ids(store, due - 1) == []
    assert await next_due_at(store, now=due - 1) == due
    assert await claim_ids(store, due) == [urgent]


async def test_an_idle_queue_sends_a_low_priority_row_at_once(store: SQLiteStore) -> None:
    low = await enqueue_dispatch(store, kind="k", deliver_to="d", priority=-10, now=T0)
    # Held back only behind other due rows: with none, it goes when due.
    assert await next_due_at(store, now=T0) == T0
    assert await claim_ids(store, T0) == [low]


async def test_a_lowest_priority_row_behind_a_flood_goes_within_twenty_steps(
    store: SQLiteStore,
) -> None:
    step = 60.0
    assert await record_priority_step(store, step) == STEP
    low = await enqueue_dispatch(store, kind="low", deliver_to="d", priority=-10, now=T0)
    plain = await enqueue_dispatch(store, kind="plain", deliver_to="d", now=T0)
    claimed_at: dict[str, float] = {}
    at = T0
    # Every 10 s four new rows of priority 0 come and four rows are claimed
    # and delivered: the queue is never empty of rows of priority 0.
    while low not in claimed_at:
        assert at < T0 + 40 * step, "the lowest priority starved"
        await enqueue_many(store, [{"kind": "flood", "deliver_to": "d"}] * 4, now=at)
        claims, _ = await claim_due(store, now=at, limit=4)
        for claim in claims:
            claimed_at[claim.dispatch_id] = at
            await finish_attempt(store, claim, TransportResult.success(), now=at)
        at += 10.0
    waited = claimed_at[low] - claimed_at[plain]
    # Held back its ten steps (as if due 600 s later, behind every row of
    # priority 0 due before that), and never more than twenty.
    assert 10 * step - 10 <= waited <= 20 * step, waited


async def test_retries_throttles_releases_and_operator_retries_keep_the_head_start(
    store: SQLiteStore, raw: RawDB
) -> None:
    # Retried jobs falling back to the default priority (bull#1755) would
    # put every other row ahead of the urgent one at each of these points.
    urgent = await enqueue_dispatch(
        store, kind="k", deliver_to="a", priority=5, max_attempts=3, now=T0
    )
    await enqueue_dispatch(store, kind="k", deliver_to="b", now=T0 + 10)
    kept = (5, 5 * STEP)

    def place() -> tuple[int, float]:
        row = raw.row(urgent)
        return int(row["priority"]), float(row["head_start"])

    claim = await claim_one(store, T0)
    await finish_attempt(store, claim, TransportResult.failure("boom"), now=T0)  # due T0 + 60
    assert place() == kept
    claim = await claim_one(store, T0 + 60)  # before the row due at T0 + 10
    assert claim.dispatch_id == urgent
    throttled = TransportResult.throttle("HTTP 429", retry_after=30)
    await finish_attempt(store, claim, throttled, now=T0 + 60)  # due T0 + 90
    assert place() == kept
    claim = await claim_one(store, T0 + 91)
    assert claim.dispatch_id == urgent
    await release_attempt(store, claim, now=T0 + 92)
    assert place() == kept
    claim = await claim_one(store, T0 + 93)
    assert claim.dispatch_id == urgent
    await finish_attempt(store, claim, TransportResult.failure("boom"), now=T0 + 93)
    assert raw.row(urgent)["status"] == "dead_letter"
    assert await retry_dispatch(store, urgent, now=T0 + 100)
    assert place() == kept
    assert (await claim_one(store, T0 + 101)).dispatch_id == urgent


async def test_a_recovered_lease_keeps_the_head_start(store: SQLiteStore) -> None:
    urgent = await enqueue_dispatch(store, kind="k", deliver_to="a", priority=5, now=T0)
    claims, _ = await claim_due(store, now=T0, limit=1, lease_seconds=15)
    assert [claim.dispatch_id for claim in claims] == [urgent]
    await enqueue_dispatch(store, kind="k", deliver_to="b", now=T0 + 5)
    # Its worker died: at the lease's end it is due again, ahead of the
    # row due since T0 + 5, and its recovery is claimed first.
    recovered = await claim_one(store, T0 + 20)
    assert (recovered.dispatch_id, recovered.recovered) == (urgent, True)


async def test_an_ordering_key_stays_first_in_first_out_whatever_the_priorities(
    store: SQLiteStore,
) -> None:
    keyed = [
        await enqueue_dispatch(
            store, kind="k", deliver_to="d", ordering_key="acct", priority=p, now=T0 + n
        )
        for n, p in enumerate((-10, 10, 0))
    ]
    other = await enqueue_dispatch(store, kind="k", deliver_to="d", priority=10, now=T0 + 5)
    order: list[str] = []
    at = T0 + 10
    while len(order) < 4:
        claims, _ = await claim_due(store, now=at, limit=10)
        assert claims, order
        for claim in claims:
            order.append(claim.dispatch_id)
            await finish_attempt(store, claim, TransportResult.success(), now=at)
        at += 1
    # The unkeyed urgent row does not wait for the key; the key's rows go in
    # their enqueue order, its head of priority -10 first.
    assert [i for i in order if i in keyed] == keyed
    assert order[0] == other


async def test_the_next_due_time_and_the_oldest_due_age_are_exact_with_head_starts(
    store: SQLiteStore,
) -> None:
    urgent = await enqueue_dispatch(store, kind="k", deliver_to="a", priority=10, now=T0)
    await finish_attempt(
        store, await claim_one(store, T0), TransportResult.failure("boom"), now=T0 + 1140
    )  # due T0 + 1200; ranked 1800 s before that
    await enqueue_dispatch(store, kind="k", deliver_to="b", now=T0 + 300)
    await enqueue_dispatch(store, kind="k", deliver_to="c", priority=-3, now=T0 + 200)
    # First in claim order is the urgent row; the earliest due is the held one.
    assert (await claim_ids(store, T0 + 1200, limit=1)) == [urgent]
    stats = await dispatch_stats(store, now=T0 + 1250)
    assert stats["oldest_due_pending_age_seconds"] == 1050
    assert await next_due_at(store, now=T0 + 100) == T0 + 200
    # The same under a worker's rules (the ordering keys' term read with it).
    assert await next_due_at(store, rules=claim_rules(), now=T0 + 100) == T0 + 200


@pytest.mark.parametrize(
    ("value", "error"),
    [
        (True, TypeError),
        (None, TypeError),
        (1.5, TypeError),
        ("3", TypeError),
        (11, ValueError),
        (-11, ValueError),
    ],
)
async def test_a_bad_priority_is_refused_naming_it_and_nothing_is_written(
    store: SQLiteStore, raw: RawDB, value: Any, error: type[Exception]
) -> None:
    message = f"^priority must be an integer from -10 to 10, got {re.escape(repr(value))}$"
    with pytest.raises(error, match=message):
        await enqueue_dispatch(store, kind="k", deliver_to="d", priority=value)
    with pytest.raises(error, match=r"^item 1: priority must be an integer from -10 to 10"):
        await enqueue_many(
            store,
            [
                {"kind": "k", "deliver_to": "d", "priority": 10},
                {"kind": "k", "deliver_to": "d", "priority": value},
            ],
        )
    assert raw.counts() == (0, 0)


async def test_the_store_s_step_makes_the_head_start_of_rows_enqueued_after(
    store: SQLiteStore, raw: RawDB
) -> None:
    before = await enqueue_dispatch(store, kind="k", deliver_to="d", priority=-2, now=T0)
    assert await priority_step(store) == STEP
    assert await record_priority_step(store, 90) == STEP
    assert await record_priority_step(store, 90) is None  # already the store's: no write
    after = await enqueue_dispatch(store, kind="k", deliver_to="d", priority=-2, now=T0)
    plain = await enqueue_dispatch(store, kind="k", deliver_to="d", now=T0)
    assert [float(raw.row(i)["head_start"]) for i in (before, after, plain)] == [-600, -180, 0]
    listed = await list_dispatches(store)
    assert sorted(row["priority"] for row in listed) == [-2, -2, 0]
    assert (await get_dispatch(store, after) or {})["priority"] == -2
    for bad in (0, 86401, True, float("nan")):
        with pytest.raises((TypeError, ValueError), match=r"^priority_step_seconds must be"):
            await record_priority_step(store, bad)
    assert await priority_step(store) == 90


async def test_a_worker_records_its_configured_step_when_it_starts(
    store: SQLiteStore, caplog: pytest.LogCaptureFixture
) -> None:
    async def transport(delivery: Any) -> None:
        pass

    caplog.set_level(logging.WARNING, logger="trio_dispatch")
    worker = DispatchWorker(store, transport=transport, priority_step_seconds=45)
    async with anyio.create_task_group() as group:
        await group.start(worker.run)
        assert await priority_step(store) == 45
        group.cancel_scope.cancel()
    assert "priority_step_seconds: the store's was 300s, now 45s" in caplog.text
    # A worker that sets none leaves the store's alone.
    async with anyio.create_task_group() as group:
        await group.start(DispatchWorker(store, transport=transport).run)
        group.cancel_scope.cancel()
    assert await priority_step(store) == 45


class PagesRead(Reads):
    """:class:`Reads`, counting on PostgreSQL the pages the claim's reads
    fetch from the outbox table and the indexes of the claim order (an
    index entry passed over by the index's own condition counts no tuple,
    but its page is read). The planner reads an empty index's first page
    each time it plans (a filled one's is kept), so each index holds a row
    in both counts."""

    def _postgres(self, unit: Any) -> tuple[Any, int]:
        import psycopg

        from trio_dispatch.store.pg_session import PostgresConn

        names = ", ".join(
            f"'{name}'"
            for name in (
                "dispatch_outbox",
                DUE_INDEX,
                DESTINATION_INDEX,
                HELD_BACK_INDEX,
                HELD_BACK_DESTINATION_INDEX,
            )
        )
        read = (
            "SELECT COALESCE(SUM(pg_stat_get_xact_blocks_fetched(oid)), 0) AS n "
            f"FROM pg_class WHERE relname IN ({names})"
        )
        with psycopg.connect(str(self.target)) as pg:
            before = int(pg.execute(read).fetchone()[0])  # type: ignore[index]
            result = unit(PostgresConn(pg))
            after = int(pg.execute(read).fetchone()[0])  # type: ignore[index]
            pg.rollback()
        return result, after - before


async def test_an_idle_claim_reads_none_of_the_rows_that_fall_due_later(
    store: SQLiteStore, raw: RawDB
) -> None:
    """Counted in what the engine reads (SQLite's virtual machine steps,
    PostgreSQL's tuples), never timed: one range of the due index up to
    now + 10 steps would read every row due in the next 50 minutes; the
    claim's lanes read none of them, of priority 0 or of the lowest."""
    now = T0 + 10_000
    fill(raw, "a", 3, now - 5)
    fill(raw, "tomorrow", 1, now + 86400)
    raw.execute(
        "UPDATE dispatch_outbox SET priority = -1, head_start = -300 WHERE id = 'tomorrow-0'"
    )
    columns = "id, status, deliver_to, next_attempt_at, created_at, ordering_key"

    def unit(conn: Conn) -> tuple[int, float | None]:
        rules = claim_rules()
        found = select_due(conn, now, 8, columns, lock=True, rules=rules)
        return len(found), next_due(conn, rules, at=now)

    reads = PagesRead(raw)
    if reads.postgres:  # no dead entries of an earlier test's rows to step over
        raw.execute("VACUUM ANALYZE dispatch_outbox")
    before, cost = reads.counted(unit)
    assert before == (3, now - 5)
    # Due within the next 3,000 s (the loop's 10,000 each: one range up to
    # now + 10 steps would still read several times the bound below).
    later = size(20_000, 10_000)
    fill(raw, "later", later, now + 1, step=3_000 / later)
    fill(raw, "held", later, now + 1, step=3_000 / later)
    raw.execute(
        "UPDATE dispatch_outbox SET priority = -10, head_start = -3000 WHERE deliver_to = 'held'"
    )
    if reads.postgres:
        raw.execute("ANALYZE dispatch_outbox")
    after, cost_after = reads.counted(unit)
    assert after == before
    assert cost_after <= 2 * cost + 10, (cost, cost_after)
    # One range up to now + 10 steps: 1,200 hundreds of SQLite's steps, 130
    # pages of PostgreSQL's, against about 10 of either.


@contextlib.contextmanager
def _connection(target: str) -> Iterator[Conn]:
    """An autocommit connection of the test's own to ``target``."""
    if target.startswith("postgres"):
        import psycopg

        from trio_dispatch.store.pg_session import PostgresConn

        with psycopg.connect(target, autocommit=True) as pg:
            yield PostgresConn(pg)
        return
    from trio_dispatch.store.sqlite import SQLiteConn

    lite = sqlite3.connect(target, isolation_level=None)
    try:
        yield SQLiteConn(lite)
    finally:
        lite.close()


async def test_a_database_from_before_priorities_keeps_its_rows_and_their_order(
    fresh_target: str,
) -> None:
    # The migration that brings priorities, looked up (its number is the
    # next free one wherever it lands).
    before = next(
        version
        for version, steps in enumerate(MIGRATIONS)
        if any(isinstance(step, str) and "ADD COLUMN head_start" in step for step in steps)
    )
    with _connection(fresh_target) as conn:
        for step in (step for version in MIGRATIONS[:before] for step in version):
            if callable(step):  # a step of each engine's own
                step(conn)
            else:
                conn.execute(conn.dialect.ddl(step))
        conn.execute(
            "CREATE TABLE trio_dispatch_schema "
            "(version INTEGER NOT NULL, applied_at FLOAT NOT NULL)"
        )
        for version in range(1, before + 1):
            conn.execute("INSERT INTO trio_dispatch_schema VALUES (?, 0)", (version,))
        for n, due in enumerate((T0 + 3, T0 + 1, T0 + 2)):
            conn.execute(
                "INSERT INTO dispatch_outbox (id, kind, deliver_to, payload, next_attempt_at, "
                "created_at) VALUES (?, 'k', 'd', '{}', ?, ?)",
                (f"old-{n}", due, T0),
            )
    async with open_store(fresh_target) as db:
        assert await priority_step(db) == STEP
        assert [row["priority"] for row in await list_dispatches(db)] == [0, 0, 0]
        assert await claim_ids(db, T0 + 10) == ["old-1", "old-2", "old-0"]
        fresh = await enqueue_dispatch(db, kind="k", deliver_to="d", priority=1, now=T0 + 20)
        assert await claim_ids(db, T0 + 20) == [fresh]


async def test_a_schedule_s_dispatches_get_its_priority(store: SQLiteStore, raw: RawDB) -> None:
    schedule = Schedule(name="digest", every="1h", kind="k", deliver_to="d", priority=7)
    run = await store.write(partial(fire_manual, schedule=schedule, now=T0))
    row = raw.row(run.dispatch_id)
    assert (row["priority"], row["head_start"]) == (7, 7 * STEP)
