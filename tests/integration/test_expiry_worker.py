"""A running worker expires the rows its claims never read at their own
``expires_at`` (docs/destinations.md#expiry-of-rows-held-back): a paused destination's, a
throttled one's, one at the worker's cap, a keyed row behind a slow head,
while the attempts holding them back still run; two workers on one store
write one transition per row; a sweep that fails is rolled back whole,
said once, and the next look expires the row. Real stores, real time, both
engines and both backends."""

from __future__ import annotations

import logging
import time
from collections import Counter

import anyio
import pytest

from trio_dispatch import (
    Delivery,
    Throttled,
    enqueue_dispatch,
    enqueue_many,
    open_store,
    pause_destination,
)
from trio_dispatch.store import SQLiteStore
from trio_dispatch.worker import DispatchWorker

from ..conftest import RawDB
from ..helpers import row_is, wait_for

pytestmark = pytest.mark.anyio

DEADLINE_REASON = "dispatch.expired.deadline"


def expired_at_or_after_deadline(raw: RawDB, dispatch_id: str) -> bool:
    """Expired by its deadline's transition, never before the deadline, and
    never claimed."""
    row = raw.row(dispatch_id)
    history = raw.transitions(dispatch_id)
    return (
        row["status"] == "expired"
        and row["attempt"] == 0
        and [t["reason_code"] for t in history] == ["dispatch.pending.enqueued", DEADLINE_REASON]
        and history[-1]["created_at"] >= row["expires_at"]
    )


async def test_rows_no_claim_reads_expire_at_their_deadline_while_the_worker_runs(
    store: SQLiteStore, raw: RawDB
) -> None:
    release = anyio.Event()
    started: list[str] = []

    async def send(delivery: Delivery) -> None:
        started.append(delivery.deliver_to)
        if delivery.deliver_to == "busy":
            raise Throttled(retry_after=3600)
        await release.wait()  # "capped" and "keyed": slow

    async def enqueue(deliver_to: str, expires_at: float | None, key: str | None = None) -> str:
        return await enqueue_dispatch(
            store, kind="k", deliver_to=deliver_to, expires_at=expires_at, ordering_key=key
        )

    await pause_destination(store, "paused")
    async with anyio.create_task_group() as tg:
        worker = DispatchWorker(
            store, transport=send, tick_seconds=0.2, per_destination_concurrency=1
        )
        await tg.start(worker.run)
        slow = [await enqueue("capped", None), await enqueue("keyed", None, key="order-1")]
        throttled = await enqueue("busy", None)
        await wait_for(lambda: sorted(started) == ["busy", "capped", "keyed"])
        await wait_for(lambda: row_is(raw, throttled, status="pending", attempt=1))
        deadline = time.time() + 0.5
        held = [
            await enqueue("paused", deadline),  # paused
            await enqueue("busy", deadline),  # throttled for an hour
            await enqueue("capped", deadline),  # at the worker's cap of 1
            await enqueue("keyed", deadline, key="order-1"),  # behind its slow head
        ]
        await wait_for(lambda: all(expired_at_or_after_deadline(raw, i) for i in held))
        # Expired while what held them back still runs: no claim read them.
        assert all(raw.row(i)["status"] == "delivering" for i in slow)
        # Counted once the sweeper hears its commit (a moment after it is seen).
        await wait_for(lambda: worker.statistics().expired == 4)
        release.set()
        await wait_for(lambda: all(raw.row(i)["status"] == "delivered" for i in slow))
        tg.cancel_scope.cancel()
    assert sorted(started) == ["busy", "capped", "keyed"]
    assert raw.row(throttled)["status"] == "pending"  # no deadline: it waits for the destination


async def test_two_workers_expire_a_paused_backlog_with_one_transition_per_row(
    store: SQLiteStore, raw: RawDB, db_target: str
) -> None:
    total = 1_200  # more than two sweep batches
    await pause_destination(store, "paused")
    deadline = time.time() + 0.5
    await enqueue_many(
        store,
        [{"kind": "k", "deliver_to": "paused", "expires_at": deadline} for _ in range(total)],
    )

    async def send(delivery: Delivery) -> None:
        raise AssertionError(f"{delivery.dispatch_id} was sent")

    async with open_store(db_target) as other, anyio.create_task_group() as tg:
        workers = [DispatchWorker(db, transport=send, tick_seconds=0.2) for db in (store, other)]
        for worker in workers:
            await tg.start(worker.run)
        await wait_for(
            lambda: (
                raw.scalar("SELECT COUNT(*) FROM dispatch_outbox WHERE status = 'expired'") == total
            ),
        )
        tg.cancel_scope.cancel()
    transitions = Counter(
        str(r["entity_id"])
        for r in raw.rows(
            "SELECT entity_id, created_at FROM status_transitions WHERE reason_code = ?",
            (DEADLINE_REASON,),
        )
    )
    assert len(transitions) == total and set(transitions.values()) == {1}
    assert sum(worker.statistics().expired for worker in workers) == total
    assert (
        raw.scalar(
            "SELECT MIN(created_at) FROM status_transitions WHERE reason_code = ?",
            (DEADLINE_REASON,),
        )
        >= deadline
    )


async def test_a_sweep_that_fails_is_logged_and_the_next_look_expires_the_row(
    store: SQLiteStore, raw: RawDB, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="trio_dispatch.worker")
    await pause_destination(store, "paused")
    raw.refuse_transitions("disk says no", reason_code=DEADLINE_REASON)
    row = await enqueue_dispatch(store, kind="k", deliver_to="paused", expires_at=time.time() + 0.2)

    async def send(delivery: Delivery) -> None:
        raise AssertionError(f"{delivery.dispatch_id} was sent")

    async with anyio.create_task_group() as tg:
        worker = DispatchWorker(store, transport=send, tick_seconds=0.2)
        await tg.start(worker.run)
        await wait_for(lambda: worker.expiry.failures >= 2)
        assert raw.row(row)["status"] == "pending"  # rolled back whole: no transition, no expiry
        failed = [r for r in caplog.records if r.getMessage().startswith("expiry sweep failed")]
        assert [r.levelno for r in failed] == [logging.WARNING]  # said once, then at DEBUG
        raw.allow_transitions()
        await wait_for(lambda: expired_at_or_after_deadline(raw, row))
        await wait_for(lambda: worker.expiry.failures == 0)
        tg.cancel_scope.cancel()
    assert any(
        r.getMessage() == "expired 1 dispatches past their expires_at" for r in caplog.records
    )
