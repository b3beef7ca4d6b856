"""Fair share across consecutive claims (docs/destinations.md), on real SQLite files and
the real PostgreSQL, both anyio backends: a claimant's one-row claims take
turns between the destinations with due rows, least recently served first,
however large the backlog whose rows are the oldest; a worker whose slots
each claim their next row alone starts a newcomer's rows between the
backlog's, also when the newcomer is enqueued while the backlog drains
alone. Asserted on what was claimed and started, never timed."""

from __future__ import annotations

import anyio
import pytest

from trio_dispatch import Delivery, DispatchWorker, enqueue_dispatch, enqueue_many
from trio_dispatch.outbox import claim_due
from trio_dispatch.outbox.claim import ClaimRules, claim_rules
from trio_dispatch.outbox.claim.fair import RELOOK_TURNS
from trio_dispatch.store import SQLiteStore
from trio_dispatch.worker.finisher import MOST_AHEAD, MOST_AHEAD_ONE_WRITER

from ..conftest import RawDB
from .test_capped_scan import fill

pytestmark = pytest.mark.anyio

T0 = 1_000_000.0
NOW = T0 + 10_000
LEASE = 30.0


async def one_at_a_time(store: SQLiteStore, rules: ClaimRules, claims: int) -> list[str]:
    """The destinations of ``claims`` consecutive one-row claims with the
    same ``rules`` (each committed before the next)."""
    taken = []
    for _ in range(claims):
        claimed, _ = await claim_due(store, now=NOW, limit=1, lease_seconds=LEASE, rules=rules)
        taken += [claim.deliver_to for claim in claimed]
    return taken


async def test_consecutive_one_row_claims_take_turns_behind_a_backlog(
    store: SQLiteStore, raw: RawDB
) -> None:
    fill(raw, "a", 2_000, T0, step=0.01)  # every row older than b's
    fill(raw, "b", 3, NOW - 10)
    if str(raw.target).startswith("postgres"):
        raw.execute("ANALYZE dispatch_outbox")
    taken = await one_at_a_time(store, claim_rules(), 9)
    # b's three rows go between a's, not after its 2,000; then a alone.
    assert taken == ["a", "b", "a", "b", "a", "b", "a", "a", "a"]
    # Each destination's rows oldest first all the same.
    ids = raw.rows("SELECT id FROM dispatch_outbox WHERE status = 'delivering' ORDER BY id")
    assert sorted(row["id"] for row in ids) == sorted(
        [f"a-{i}" for i in range(6)] + [f"b-{i}" for i in range(3)]
    )


async def test_one_row_claims_serve_three_backlogs_least_recently_served_first(
    store: SQLiteStore, raw: RawDB
) -> None:
    for i, name in enumerate("pqr"):
        fill(raw, name, 300, T0 + i * 1000, step=0.01)  # p's rows all before q's, q's before r's
    taken = await one_at_a_time(store, claim_rules(), 9)
    assert taken == ["p", "q", "r"] * 3


async def test_claims_without_kept_turns_take_the_oldest_head(
    store: SQLiteStore, raw: RawDB
) -> None:
    # Rules without turns (a one-off claim) keep the plain claim order.
    fill(raw, "a", 50, T0, step=0.01)
    fill(raw, "b", 3, NOW - 10)
    taken = await one_at_a_time(store, ClaimRules(claim_rules().rules), 4)
    assert taken == ["a", "a", "a", "a"]


async def test_a_turn_is_a_row_claimed_so_a_wider_claim_counts_each(
    store: SQLiteStore, raw: RawDB
) -> None:
    fill(raw, "a", 100, T0, step=0.01)
    fill(raw, "b", 10, NOW - 10)
    rules = claim_rules()
    wide, _ = await claim_due(store, now=NOW, limit=4, lease_seconds=LEASE, rules=rules)
    assert [claim.deliver_to for claim in wide] == ["a", "b", "a", "b"]
    # b's row was the last turn: the next one-row claim is a's, then b's.
    assert await one_at_a_time(store, rules, 4) == ["a", "b", "a", "b"]


async def test_a_worker_whose_slots_claim_alone_starts_a_newcomer_between_the_backlog(
    store: SQLiteStore, raw: RawDB
) -> None:
    # Concurrency 1: every claim after the first is the one-row claim a
    # finishing attempt makes for its slot, in its own transaction.
    fill(raw, "a", 400, T0, step=0.01)
    fill(raw, "b", 4, NOW - 10)
    started: list[str] = []
    done = anyio.Event()

    async def send(delivery: Delivery) -> None:
        started.append(delivery.deliver_to)
        if len(started) == 12:
            done.set()

    worker = DispatchWorker(store, transport=send, concurrency=1, tick_seconds=0.05)
    async with anyio.create_task_group() as tg:
        await tg.start(worker.run)
        with anyio.fail_after(30):
            await done.wait()
        tg.cancel_scope.cancel()
    assert started[:12] == ["a", "b"] * 4 + ["a"] * 4


async def test_a_backlog_found_alone_is_looked_past_again_on_news_or_after_a_while(
    store: SQLiteStore, raw: RawDB
) -> None:
    fill(raw, "a", 400, T0, step=0.01)
    rules = claim_rules()
    turns = rules.turns
    assert turns is not None
    assert await one_at_a_time(store, rules, 3) == ["a"] * 3  # a alone, found so
    fill(raw, "b", 3, NOW - 10)  # written behind the claimant's back: no notice
    assert await one_at_a_time(store, rules, 3) == ["a"] * 3
    wide, _ = await claim_due(store, now=NOW, limit=3, lease_seconds=LEASE, rules=rules)
    assert [claim.deliver_to for claim in wide] == ["a"] * 3  # no look for a wider one either
    turns.news()  # an enqueue notice
    assert await one_at_a_time(store, rules, 4) == ["b", "a", "b", "a"]
    fill(raw, "c", 2, NOW - 10)  # no notice, but b's rows are live: a is not alone
    assert await one_at_a_time(store, rules, 4) == ["c", "b", "a", "c"]
    raw.execute("UPDATE dispatch_outbox SET status = 'delivered' WHERE deliver_to <> 'a'")
    assert await one_at_a_time(store, rules, 1) == ["a"]  # and found alone again
    # d comes with no notice: seen within RELOOK_TURNS all the same.
    fill(raw, "d", 1, NOW - 10)
    taken = await one_at_a_time(store, rules, RELOOK_TURNS + 2)
    assert taken.count("d") == 1
    assert RELOOK_TURNS - 5 <= taken.index("d") <= RELOOK_TURNS + 1, taken.index("d")


async def test_a_worker_starts_a_newcomer_enqueued_while_a_backlog_drains_alone(
    store: SQLiteStore, raw: RawDB
) -> None:
    fill(raw, "a", 400, T0, step=0.01)
    started: list[str] = []
    done = anyio.Event()

    async def send(delivery: Delivery) -> None:
        started.append(delivery.deliver_to)
        if len(started) == 5:  # a has been draining alone: b comes now
            for _ in range(2):
                await enqueue_dispatch(store, kind="k", deliver_to="b")
        if started.count("b") == 2:
            done.set()

    worker = DispatchWorker(store, transport=send, concurrency=1, tick_seconds=0.05)
    async with anyio.create_task_group() as tg:
        await tg.start(worker.run)
        with anyio.fail_after(30):
            await done.wait()
        tg.cancel_scope.cancel()
    # Its enqueue notice makes the next claim look past a's 400-row backlog:
    # b waits only for the rows of a already held ahead of the slot when it
    # came (at most MOST_AHEAD; the slot runs them while the claim that
    # takes b commits).
    first = started.index("b")
    assert first < 5 + 2 * MOST_AHEAD < 400, first
    assert started[:first] == ["a"] * first
    # b's second row, claimed with the first or by a claim soon after, goes
    # before the rows of a held meanwhile too.
    assert started.index("b", first + 1) < first + 2 * MOST_AHEAD, started[first:]


async def test_an_enqueue_is_heard_before_its_write_and_a_transactions_only_at_its_commit(
    store: SQLiteStore, raw: RawDB
) -> None:
    # A worker's claim that the store writes after an enqueue in one group
    # commit looks for the new row's destination only if the worker heard
    # of it before the write: so the early notice comes before the row is.
    seen: list[int] = []
    remove = store.on_enqueuing(lambda: seen.append(raw.counts()[0]))
    try:
        await enqueue_dispatch(store, kind="k", deliver_to="b")
        assert seen == [0] and raw.counts()[0] == 1
        await enqueue_many(store, [{"kind": "k", "deliver_to": "b"}] * 2)
        await enqueue_dispatch(
            store, kind="k", deliver_to="b", coalesce_key="digest", coalesce="replace"
        )
        assert seen == [0, 1, 3] and raw.counts()[0] == 4
        # A caller's transaction: its rows are seen after its commit (the
        # enqueue notice), never before.
        async with store.transaction() as tx:
            await enqueue_dispatch(tx, kind="k", deliver_to="b")
        assert seen == [0, 1, 3] and raw.counts()[0] == 5
    finally:
        remove()
    await enqueue_dispatch(store, kind="k", deliver_to="b")
    assert seen == [0, 1, 3]


async def test_a_worker_holds_128_rows_ahead_where_writers_run_side_by_side_64_on_one_writer(
    store: SQLiteStore, raw: RawDB
) -> None:
    """PostgreSQL's writers run side by side, and a deeper write costs a
    newcomer nothing there; SQLite's take turns on one writer, where a
    newcomer's enqueue waits for the write under way (docs/performance.md)."""
    await enqueue_many(store, [{"kind": "k", "deliver_to": "a"} for _ in range(300)])
    gate = anyio.Event()

    async def send(delivery: Delivery) -> None:
        await gate.wait()

    worker = DispatchWorker(store, transport=send, concurrency=1, tick_seconds=0.05)
    expected = MOST_AHEAD if str(raw.target).startswith("postgres") else MOST_AHEAD_ONE_WRITER
    async with anyio.create_task_group() as tg:
        await tg.start(worker.run)
        with anyio.fail_after(30):
            while worker.statistics().held_ahead < expected:
                await anyio.sleep(0.02)
        await anyio.sleep(0.2)  # no more than that, however long it waits
        assert worker.statistics().held_ahead == expected
        assert raw.scalar("SELECT COUNT(*) FROM dispatch_outbox WHERE status = 'delivering'") == (
            expected + 1
        )
        gate.set()
        tg.cancel_scope.cancel()
