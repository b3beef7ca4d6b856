"""Rows claimed ahead of a worker's slots (trio_dispatch.worker.finisher), on
both engines and both backends: a worker holds up to ``concurrency`` rows
more than it runs, each a claim like any other -- its lease and fence, the
claim rules (ordering keys, per-destination caps, a destination's shared
concurrency), an operator's cancel -- and a shutdown gives them back at once,
unsent and uncounted. A slot whose attempt ends starts a held row without
waiting for the end's commit."""

from __future__ import annotations

import json
import logging
from collections import Counter
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import pytest
import trio
from anyio.abc import TaskStatus

from trio_dispatch import Delivery, cancel_dispatch, enqueue_dispatch, open_store
from trio_dispatch.store import SQLiteStore
from trio_dispatch.web import WebApp
from trio_dispatch.worker import DispatchWorker
from trio_dispatch.worker.finisher import STOPPED_AHEAD

from ..conftest import RawDB
from ..helpers import row_is, wait_for
from .test_web import serving

pytestmark = pytest.mark.anyio


class Gate:
    """A transport whose attempts wait until the test opens the gate, and
    which notes how many run at once (overall and by destination)."""

    def __init__(self) -> None:
        self.open = anyio.Event()
        self.started: list[str] = []
        self.running: Counter[str] = Counter()
        self.most = 0
        self.most_by_destination: Counter[str] = Counter()

    async def send(self, delivery: Delivery) -> None:
        self.started.append(delivery.dispatch_id)
        self.running[delivery.deliver_to] += 1
        self.most = max(self.most, sum(self.running.values()))
        self.most_by_destination[delivery.deliver_to] = max(
            self.most_by_destination[delivery.deliver_to], self.running[delivery.deliver_to]
        )
        try:
            await self.open.wait()
        finally:
            self.running[delivery.deliver_to] -= 1


@asynccontextmanager
async def working(store: SQLiteStore, transport: Any, **settings: Any) -> AsyncIterator[None]:
    options: dict[str, Any] = {"tick_seconds": 0.2, "timeout_seconds": 60, **settings}
    async with anyio.create_task_group() as tg:
        await tg.start(DispatchWorker(store, transport=transport, **options).run)
        yield
        tg.cancel_scope.cancel()


def delivering(raw: RawDB) -> list[dict[str, Any]]:
    return raw.rows(
        "SELECT id, deliver_to, attempt FROM dispatch_outbox WHERE status = ?", ("delivering",)
    )


async def test_a_worker_holds_rows_ahead_of_its_slots_but_runs_no_more_than_its_concurrency(
    store: SQLiteStore, raw: RawDB
) -> None:
    ids = [await enqueue_dispatch(store, kind="k", deliver_to=f"d{n}") for n in range(8)]
    gate = Gate()
    async with anyio.create_task_group() as tg:
        worker = DispatchWorker(store, transport=gate.send, concurrency=2, tick_seconds=0.2)
        await tg.start(worker.run)
        await wait_for(lambda: len(delivering(raw)) == 8)  # 2 running, 6 held ahead
        await anyio.sleep(0.3)
        assert len(gate.started) == 2 and gate.most == 2
        statistics = worker.statistics()
        assert (statistics.in_flight, statistics.held_ahead) == (2, 6)
        async with serving(WebApp(store, worker=worker)) as client:
            metrics = (await client.get("/metrics")).text
            page = (await client.get("/")).text
        assert "trio_dispatch_held_ahead 6.0" in metrics
        assert "2 of 2 slots busy, 6 rows held ahead" in page
        gate.open.set()
        await wait_for(lambda: all(row_is(raw, i, status="delivered") for i in ids))
        assert worker.statistics().held_ahead == 0
        tg.cancel_scope.cancel()
    assert gate.most == 2
    assert sorted(gate.started) == sorted(ids)


async def test_a_worker_with_a_rate_holds_rows_ahead_as_held_starts_never_beyond_its_burst(
    store: SQLiteStore, raw: RawDB
) -> None:
    """A row held ahead begins later than its claim: the rate counts it as
    spent (``rate_held``) from its claim until the worker's next write
    records that it began, then at that time. So the rows held ahead never
    begin together beyond the burst, and the count ends at 0."""
    ids = [await enqueue_dispatch(store, kind="k", deliver_to="metered") for _ in range(12)]
    gate = Gate()
    started_at: list[float] = []

    async def send(delivery: Delivery) -> None:
        started_at.append(anyio.current_time())
        await gate.send(delivery)

    def held() -> int:
        return int(
            raw.scalar("SELECT rate_held FROM dispatch_destinations WHERE name = 'metered'") or 0
        )

    rate = {"metered": {"rate": "100/s", "burst": 2}}
    async with anyio.create_task_group() as tg:
        worker = DispatchWorker(
            store, transport=send, concurrency=2, tick_seconds=0.2, destinations=rate
        )
        await tg.start(worker.run)
        await wait_for(lambda: len(gate.started) == 2)
        await anyio.sleep(0.3)  # time enough for the rate to admit more rows
        # Two running, two held ahead: the burst, held until they begin.
        await wait_for(lambda: len(delivering(raw)) == 4 and held() == 2)
        assert worker.statistics().held_ahead == 2
        assert worker.statistics().held_starts == 2  # the running two began: recorded
        assert raw.scalar("SELECT SUM(held) FROM dispatch_destination_holds") == 2
        gate.open.set()
        await wait_for(lambda: all(row_is(raw, i, status="delivered") for i in ids))
        tg.cancel_scope.cancel()
    # The starts never run ahead of the rate beyond its burst.
    first = started_at[0]
    for n, at in enumerate(started_at, start=1):
        assert n <= 100 * (at - first) + 2 + 1, (n, at - first)
    # Every held start began and was recorded: nothing stays counted.
    assert held() == 0
    assert raw.scalar("SELECT SUM(held) FROM dispatch_destination_holds") == 0


async def test_shutdown_gives_the_rows_held_ahead_back_at_once_unsent_and_uncounted(
    store: SQLiteStore, raw: RawDB
) -> None:
    ids = [await enqueue_dispatch(store, kind="k", deliver_to=f"d{n}") for n in range(6)]
    gate = Gate()
    worker = DispatchWorker(
        store, transport=gate.send, concurrency=2, tick_seconds=0.2, grace_seconds=30
    )
    stop = anyio.CancelScope()

    async def run_worker(*, task_status: TaskStatus[None]) -> None:
        with stop:
            await worker.run(task_status=task_status)

    async with anyio.create_task_group() as tg:
        await tg.start(run_worker)
        await wait_for(lambda: len(delivering(raw)) == 6 and len(gate.started) == 2)
        running = set(gate.started)
        held = {row["id"] for row in delivering(raw)} - running
        assert len(held) == 4
        stop.cancel()
        # Given back while the running attempts still have their grace.
        await wait_for(lambda: all(row_is(raw, i, status="pending") for i in held), timeout=5)
        assert all(row_is(raw, i, status="delivering") for i in running)
        gate.open.set()
    for dispatch_id in held:
        row = raw.row(dispatch_id)
        assert (row["status"], row["attempt"]) == ("pending", 0)  # not counted
        last = raw.transitions(dispatch_id)[-1]
        assert last["reason_code"] == "dispatch.pending.released"
        assert STOPPED_AHEAD in str(last["reason_summary"]) or STOPPED_AHEAD in str(
            row["last_error"]
        )
    assert all(row_is(raw, i, status="delivered") for i in running)
    assert set(gate.started) == running  # a held row was never sent
    assert {i for i in ids if raw.row(i)["status"] == "pending"} == set(ids) - running


async def test_an_operators_cancel_of_a_row_held_ahead_cancels_it_unsent(
    store: SQLiteStore, raw: RawDB, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="trio_dispatch.worker")
    first = await enqueue_dispatch(store, kind="k", deliver_to="x")
    await anyio.sleep(0.01)
    second = await enqueue_dispatch(store, kind="k", deliver_to="x")
    gate = Gate()
    async with working(store, gate.send, concurrency=1):
        await wait_for(lambda: row_is(raw, second, status="delivering") and gate.started)
        assert gate.started == [first]
        async with open_store(raw.target) as other:  # as another process would
            # No wait: the held row's end is written when it reaches the
            # slot, which the gate holds (a wait would last all of it).
            asked = await cancel_dispatch(other, second, wait_seconds=0)
        assert asked.requested
        # The worker hears it and cuts the held row's scope before the slot frees.
        cut = f"dispatch {second} attempt 1: cancelled by an operator; cutting the attempt"
        await wait_for(lambda: cut in caplog.text)
        gate.open.set()
        await wait_for(lambda: row_is(raw, second, status="cancelled"))
        await wait_for(lambda: row_is(raw, first, status="delivered"))
    assert gate.started == [first]  # the held row never reached the transport
    last = raw.transitions(second)[-1]
    assert last["status"] == "cancelled"


async def test_caps_and_a_destinations_shared_limit_count_the_rows_held_ahead(
    store: SQLiteStore, raw: RawDB
) -> None:
    ids = [
        await enqueue_dispatch(store, kind="k", deliver_to=destination)
        for _ in range(4)
        for destination in ("capped", "limited", "free")
    ]
    gate = Gate()
    seen: Counter[str] = Counter()

    def look() -> bool:
        by_destination = Counter(row["deliver_to"] for row in delivering(raw))
        for destination, count in by_destination.items():
            seen[destination] = max(seen[destination], count)
        return all(row_is(raw, i, status="delivered") for i in ids)

    async with working(
        store,
        gate.send,
        concurrency=4,
        per_destination_concurrency=2,
        destinations={"limited": {"concurrency": 1}},
    ):
        await wait_for(lambda: len(delivering(raw)) == 5)  # 2 + 2 + 1 of the room's 8
        look()
        gate.open.set()
        await wait_for(look, timeout=20)
    # Held or running: never more claims of a destination than its cap (2)
    # or its shared limit (1), though the room ahead had space for more.
    assert seen["capped"] == seen["free"] == 2 and seen["limited"] == 1, seen
    assert gate.most_by_destination["limited"] == 1


async def test_an_ordering_key_has_one_claim_at_a_time_and_goes_in_order_with_rows_held_ahead(
    store: SQLiteStore, raw: RawDB
) -> None:
    keyed = []
    for n in range(5):
        keyed.append(await enqueue_dispatch(store, kind="k", deliver_to="x", ordering_key="key"))
        await enqueue_dispatch(store, kind="k", deliver_to=f"other{n}")
    sent: list[str] = []
    most = 0

    async def send(delivery: Delivery) -> None:
        nonlocal most
        sent.append(delivery.dispatch_id)
        claims = sum(1 for row in delivering(raw) if row["id"] in keyed)
        most = max(most, claims)
        await anyio.sleep(0.01)

    async with working(store, send, concurrency=4):
        await wait_for(lambda: all(row_is(raw, i, status="delivered") for i in keyed), timeout=20)
    assert [i for i in sent if i in keyed] == keyed
    assert most == 1


@pytest.mark.trio
@pytest.mark.sqlite_only  # the writer held by a caller's transaction is the point
async def test_a_slot_starts_the_row_held_ahead_while_its_last_end_waits_for_the_writer(
    db_path: Path,
) -> None:
    """The end of the first attempt cannot commit while the application
    holds the writer; the slot starts the row it holds ahead anyway."""
    started: dict[str, float] = {}

    async def send(delivery: Delivery) -> None:
        n = json.loads(delivery.payload)["body"]["n"]
        started[n] = trio.current_time()
        await trio.sleep(0.3 if n == "first" else 0.01)

    async with open_store(db_path) as db:
        for n in ("first", "second"):
            await enqueue_dispatch(db, kind="k", deliver_to="x", body={"n": n})
            await trio.sleep(0.01)
        async with trio.open_nursery() as nursery:
            worker = DispatchWorker(db, transport=send, concurrency=1, tick_seconds=0.2)
            await nursery.start(worker.run)  # its first claim takes both rows
            with trio.fail_after(10):
                while "first" not in started:
                    await trio.sleep(0.005)
            async with db.transaction() as tx:  # the application holds the writer 1 s
                await tx.query("SELECT 1")
                held_from = trio.current_time()
                await trio.sleep(1.0)
                held_until = trio.current_time()
            with trio.fail_after(10):
                while worker.statistics().delivered < 2:
                    await trio.sleep(0.01)
            nursery.cancel_scope.cancel()
    # "first" ended (0.3 s in) while its end could not commit: the slot
    # started "second" then, not once the writer was free.
    assert held_from < started["second"] < held_until - 0.3, (started, held_from, held_until)
