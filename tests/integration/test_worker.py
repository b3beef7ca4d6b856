"""DispatchWorker (docs/usage.md): embedding, wake-up, bounded concurrency,
timeouts with kill semantics, store faults, and graceful shutdown."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import sqlite3
import sys
import time
from pathlib import Path

import anyio
import pytest
import trio

from trio_dispatch import Delivery, deliver_due_dispatches, enqueue_dispatch, open_store
from trio_dispatch.config import parse_config
from trio_dispatch.settings import WorkerSettings
from trio_dispatch.store import SQLiteStore
from trio_dispatch.transports import CallableTransport, TransportResult, asyncio_transport
from trio_dispatch.worker import DispatchWorker, WorkerStatistics

from ..conftest import RawDB
from ..helpers import (
    GRANDCHILD_SCRIPT,
    HeldWriter,
    listening_backends,
    process_gone,
    row_is,
    statuses,
    wait_for,
)

# -- embedding -------------------------------------------------------------


@pytest.mark.trio
async def test_nursery_start_returns_ready_and_an_enqueue_wakes_the_worker(
    db_target: str, raw: RawDB
) -> None:
    sent: list[str] = []

    async def send(delivery: Delivery) -> None:
        sent.append(delivery.dispatch_id)

    async with open_store(db_target) as db, trio.open_nursery() as nursery:
        worker = DispatchWorker(db, transport=send, tick_seconds=3600)
        await nursery.start(worker.run)
        started = time.monotonic()
        dispatch_id = await enqueue_dispatch(db, kind="k", deliver_to="seat")
        await wait_for(lambda: raw.row(dispatch_id)["status"] == "delivered", timeout=5)
        assert time.monotonic() - started < 1.0  # not the hour-long tick
        assert sent == [dispatch_id]
        nursery.cancel_scope.cancel()


@pytest.mark.anyio
async def test_worker_runs_the_same_code_on_both_backends(store: SQLiteStore, raw: RawDB) -> None:
    async def send(delivery: Delivery) -> None:
        await anyio.sleep(0)

    async with anyio.create_task_group() as tg:
        worker = DispatchWorker(store, transport=send, tick_seconds=3600)
        await tg.start(worker.run)
        ids = [await enqueue_dispatch(store, kind="k", deliver_to=f"s{i}") for i in range(20)]
        await wait_for(lambda: statuses(raw) == {"delivered": 20})
        tg.cancel_scope.cancel()
    assert worker.counts["delivered"] == 20
    assert all(raw.row(i)["attempt"] == 1 for i in ids)


@pytest.mark.anyio
async def test_wake_scans_rows_written_by_another_process(store: SQLiteStore, raw: RawDB) -> None:
    async def send(delivery: Delivery) -> None:
        pass

    async with anyio.create_task_group() as tg:
        worker = DispatchWorker(store, transport=send, tick_seconds=3600, listen=False)
        await tg.start(worker.run)
        await wait_for(lambda: worker.statistics().scans == 1)  # found nothing; now idle
        async with open_store(raw.target) as other:  # another process's enqueue
            dispatch_id = await enqueue_dispatch(other, kind="k", deliver_to="seat")
        await anyio.sleep(0.3)  # a window in which nothing may happen
        assert raw.row(dispatch_id)["status"] == "pending"  # polling only: waits
        assert worker.statistics().scans == 1
        worker.wake()
        await wait_for(lambda: raw.row(dispatch_id)["status"] == "delivered")
        tg.cancel_scope.cancel()


@pytest.mark.anyio
@pytest.mark.postgres_only  # SQLite has no cross-process notification: workers poll
async def test_another_process_enqueue_wakes_a_listening_worker(
    store: SQLiteStore, raw: RawDB
) -> None:
    sent: list[float] = []

    async def send(delivery: Delivery) -> None:
        sent.append(time.monotonic())

    async with anyio.create_task_group() as tg:
        worker = DispatchWorker(store, transport=send, tick_seconds=3600)
        await tg.start(worker.run)
        await wait_for(lambda: worker.statistics().scans >= 1 and listening_backends(raw) == 1)
        async with open_store(raw.target) as other:  # LISTEN/NOTIFY wakes it
            started = time.monotonic()
            dispatch_id = await enqueue_dispatch(other, kind="k", deliver_to="seat")
        await wait_for(lambda: raw.row(dispatch_id)["status"] == "delivered", timeout=5)
        tg.cancel_scope.cancel()
    assert sent and sent[0] - started < 1.0  # not the hour-long tick


@pytest.mark.anyio
async def test_a_retry_is_picked_up_when_due_without_waiting_for_the_tick(
    store: SQLiteStore, raw: RawDB
) -> None:
    attempts: list[int] = []

    async def send(delivery: Delivery) -> bool:
        attempts.append(delivery.attempt)
        return delivery.attempt > 1

    dispatch_id = await enqueue_dispatch(store, kind="k", deliver_to="seat")
    async with anyio.create_task_group() as tg:
        worker = DispatchWorker(store, transport=send, tick_seconds=3600)
        await tg.start(worker.run)
        await wait_for(lambda: row_is(raw, dispatch_id, status="pending", attempt=1))
        # Bring the 60 s backoff forward, as time passing would.
        raw.execute(
            "UPDATE dispatch_outbox SET next_attempt_at = ? WHERE id = ?",
            (time.time() + 0.3, dispatch_id),
        )
        worker.wake()  # re-read the earliest due time
        await wait_for(lambda: raw.row(dispatch_id)["status"] == "delivered", timeout=5)
        tg.cancel_scope.cancel()
    assert attempts == [1, 2]


@pytest.mark.trio
async def test_the_backoff_and_the_next_attempt_run_on_a_mock_clock(
    db_path: Path, mock_clock: trio.testing.MockClock
) -> None:
    # The worker's wall clock tied to trio's virtual time, running 100 times
    # faster than real time: the 60 s backoff after attempt 1 passes in 0.6 s, and
    # the retry starts when it is due. (Not autojump: while the store's
    # thread works the loop is idle, and autojump would race virtual time
    # from deadline to deadline until the thread answered.)
    mock_clock.rate = 100
    t0 = 1_000_000.0

    def wall() -> float:  # read on the store's thread too: the clock object, not trio's API
        return t0 + mock_clock.current_time()

    sends: list[tuple[int, float]] = []

    async def send(delivery: Delivery) -> bool:
        sends.append((delivery.attempt, trio.current_time()))
        return delivery.attempt > 1

    async with open_store(db_path) as store:
        await enqueue_dispatch(store, kind="k", deliver_to="seat", now=t0)
        async with trio.open_nursery() as nursery:
            worker = DispatchWorker(store, transport=send, tick_seconds=3600, clock=wall)
            await nursery.start(worker.run)
            with trio.fail_after(600):
                while worker.counts["delivered"] < 1:
                    await trio.sleep(0.05)
            nursery.cancel_scope.cancel()
    assert [attempt for attempt, _ in sends] == [1, 2]
    # Due after the 60 s backoff, and taken then -- not at the 3,600 s tick.
    waited = sends[1][1] - sends[0][1]
    assert 60 <= waited < 90, waited
    assert worker.statistics().retried == 1


def test_statistics_are_a_frozen_snapshot(db_path: Path) -> None:
    async def send(delivery: Delivery) -> None:
        pass

    async def main() -> tuple[WorkerStatistics, WorkerStatistics]:
        async with open_store(db_path) as store:
            worker = DispatchWorker(store, transport=send, concurrency=3)
            before = worker.statistics()
            await enqueue_dispatch(store, kind="k", deliver_to="seat")
            async with anyio.create_task_group() as tg:
                await tg.start(worker.run)
                await wait_for(lambda: worker.counts["delivered"] == 1)
                tg.cancel_scope.cancel()
            return before, worker.statistics()

    before, after = anyio.run(main)
    assert (before.delivered, before.scans, before.running) == (0, 0, False)
    assert (after.delivered, after.attempted, after.concurrency) == (1, 1, 3)
    assert after.scans >= 1 and after.last_scan_at is not None and after.scan_errors == 0
    assert after.counts == {
        "attempted": 1,
        "delivered": 1,
        "dead_letter": 0,
        "expired": 0,
        "retried": 0,
    }
    with pytest.raises(dataclasses.FrozenInstanceError):
        after.delivered = 5  # type: ignore[misc]


# -- concurrency -----------------------------------------------------------


@pytest.mark.anyio
async def test_never_more_than_concurrency_transports_run_at_once(
    store: SQLiteStore, raw: RawDB
) -> None:
    running = peak = 0

    async def send(delivery: Delivery) -> None:
        nonlocal running, peak
        running += 1
        peak = max(peak, running)
        await anyio.sleep(0.05)
        running -= 1

    for i in range(40):
        await enqueue_dispatch(store, kind="k", deliver_to=f"s{i}")
    async with anyio.create_task_group() as tg:
        worker = DispatchWorker(store, transport=send, concurrency=5, tick_seconds=3600)
        await tg.start(worker.run)
        await wait_for(lambda: statuses(raw) == {"delivered": 40})
        tg.cancel_scope.cancel()
    assert peak == 5


@pytest.mark.anyio
async def test_each_scan_claims_at_most_batch_size_rows(
    store: SQLiteStore, raw: RawDB, caplog: pytest.LogCaptureFixture
) -> None:
    async def send(delivery: Delivery) -> None:
        await anyio.sleep(0.01)

    for i in range(25):
        await enqueue_dispatch(store, kind="k", deliver_to=f"s{i}")
    caplog.set_level(logging.INFO, logger="trio_dispatch.worker")
    async with anyio.create_task_group() as tg:
        worker = DispatchWorker(
            store, transport=send, batch_size=4, concurrency=50, tick_seconds=3600
        )
        await tg.start(worker.run)
        await wait_for(lambda: statuses(raw) == {"delivered": 25})
        tg.cancel_scope.cancel()
    claimed = [
        int(r.getMessage().split("claimed=")[1].split()[0])
        for r in caplog.records
        if r.getMessage().startswith("scan:")
    ]
    # Scans claim at most batch_size; a finishing delivery may also take the
    # next due row for its slot in its finish transaction.
    assert max(claimed) == 4 and sum(claimed) <= 25
    assert worker.counts["delivered"] == 25


@pytest.mark.anyio
async def test_a_slow_transport_does_not_delay_other_deliveries(
    store: SQLiteStore, raw: RawDB
) -> None:
    release = anyio.Event()

    async def send(delivery: Delivery) -> None:
        if delivery.deliver_to == "slow":
            await release.wait()

    slow = await enqueue_dispatch(store, kind="k", deliver_to="slow")
    async with anyio.create_task_group() as tg:
        worker = DispatchWorker(store, transport=send, tick_seconds=3600)
        await tg.start(worker.run)
        fast = [await enqueue_dispatch(store, kind="k", deliver_to=f"f{i}") for i in range(5)]
        await wait_for(lambda: all(raw.row(i)["status"] == "delivered" for i in fast))
        assert raw.row(slow)["status"] == "delivering"
        release.set()
        await wait_for(lambda: raw.row(slow)["status"] == "delivered")
        tg.cancel_scope.cancel()


# -- timeouts and faults ---------------------------------------------------


@pytest.mark.slow
@pytest.mark.anyio
async def test_a_timeout_kills_the_process_group_and_records_the_attempt(
    store: SQLiteStore, raw: RawDB, tmp_path: Path
) -> None:
    script = tmp_path / "hang.py"
    script.write_text(GRANDCHILD_SCRIPT)
    pid_file = tmp_path / "pid"
    dispatch_id = await enqueue_dispatch(store, kind="k", deliver_to="seat")
    async with anyio.create_task_group() as tg:
        worker = DispatchWorker(
            store,
            notify_template=[sys.executable, str(script), str(pid_file)],
            # Long enough for a loaded machine to start Python and write the
            # grandchild's pid before the cut.
            timeout_seconds=3,
            kill_grace_seconds=0.2,
            tick_seconds=3600,
        )
        await tg.start(worker.run)
        await wait_for(lambda: row_is(raw, dispatch_id, status="pending", attempt=1))
        tg.cancel_scope.cancel()
    assert "timeout after 3.0s" in str(raw.row(dispatch_id)["last_error"])
    assert raw.transitions(dispatch_id)[-1]["reason_code"] == "dispatch.pending.retry_backoff"
    grandchild = int(pid_file.read_text())
    await wait_for(lambda: process_gone(grandchild), timeout=5)


@pytest.mark.anyio
@pytest.mark.sqlite_only
async def test_a_locked_database_is_logged_and_the_worker_resumes_after(
    db_path: Path, raw: RawDB, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="trio_dispatch.worker")

    async def send(delivery: Delivery) -> None:
        pass

    async with open_store(db_path, busy_timeout=0.1) as db:
        dispatch_id = await enqueue_dispatch(db, kind="k", deliver_to="seat")
        blocker = sqlite3.connect(db_path, isolation_level=None)
        blocker.execute("BEGIN EXCLUSIVE")  # another process holding the write lock
        try:
            async with anyio.create_task_group() as tg:
                worker = DispatchWorker(db, transport=send, tick_seconds=0.2)
                await tg.start(worker.run)
                await wait_for(lambda: any("scan failed" in r.getMessage() for r in caplog.records))
                assert raw.row(dispatch_id)["status"] == "pending"
                blocker.execute("ROLLBACK")
                await wait_for(lambda: raw.row(dispatch_id)["status"] == "delivered")
                tg.cancel_scope.cancel()
        finally:
            blocker.close()
    assert raw.scalar("PRAGMA integrity_check") == "ok"
    failure = next(r for r in caplog.records if "scan failed" in r.getMessage())
    assert failure.exc_info is not None and "locked" in str(failure.exc_info[1])


# -- callable transports (docs/usage.md) ----------------------------------


async def asyncio_only_send(delivery: Delivery) -> None:
    """Needs a running asyncio loop: fails under plain trio."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[str] = asyncio.Queue()
    loop.call_later(0.01, queue.put_nowait, delivery.dispatch_id)
    got = await asyncio.wait_for(queue.get(), timeout=2)
    await asyncio.sleep(0.01)
    if delivery.deliver_to == "refuse":
        raise ConnectionRefusedError(f"{got} refused")


@pytest.mark.trio
async def test_an_asyncio_only_callable_runs_from_a_trio_worker(db_target: str, raw: RawDB) -> None:
    async with open_store(db_target) as db, trio.open_nursery() as nursery:
        worker = DispatchWorker(
            db, transport=asyncio_transport(asyncio_only_send), tick_seconds=3600
        )
        await nursery.start(worker.run)
        ok = await enqueue_dispatch(db, kind="k", deliver_to="seat")
        refused = await enqueue_dispatch(db, kind="k", deliver_to="refuse")
        await wait_for(
            lambda: (
                raw.row(ok)["status"] == "delivered"
                and row_is(raw, refused, status="pending", attempt=1)
            )
        )
        nursery.cancel_scope.cancel()
    assert raw.row(refused)["last_error"] == f"ConnectionRefusedError: {refused} refused"


@pytest.mark.anyio
async def test_an_asyncio_only_callable_also_runs_on_either_backend(
    store: SQLiteStore, raw: RawDB
) -> None:
    async with anyio.create_task_group() as tg:
        worker = DispatchWorker(
            store, transport=asyncio_transport(asyncio_only_send), tick_seconds=3600
        )
        await tg.start(worker.run)
        dispatch_id = await enqueue_dispatch(store, kind="k", deliver_to="seat")
        await wait_for(lambda: raw.row(dispatch_id)["status"] == "delivered")
        tg.cancel_scope.cancel()


@pytest.mark.trio
async def test_a_trio_callable_that_times_out_is_cancelled_and_recorded(
    db_target: str, raw: RawDB
) -> None:
    cancelled = trio.Event()

    async def send(delivery: Delivery) -> None:
        try:
            await trio.sleep(30)
        finally:
            cancelled.set()

    async with open_store(db_target) as db, trio.open_nursery() as nursery:
        worker = DispatchWorker(db, transport=send, timeout_seconds=0.3, tick_seconds=3600)
        await nursery.start(worker.run)
        dispatch_id = await enqueue_dispatch(db, kind="k", deliver_to="seat")
        await wait_for(lambda: row_is(raw, dispatch_id, status="pending", attempt=1))
        nursery.cancel_scope.cancel()
    assert cancelled.is_set()
    assert raw.row(dispatch_id)["last_error"] == "timeout after 0.3s"


@pytest.mark.anyio
async def test_a_callables_timeout_cuts_each_chained_attempt_within_the_lease(
    store: SQLiteStore, raw: RawDB
) -> None:
    # One slot: the second row is claimed with the first's finish and runs
    # in the same task; each attempt is cut at the callable's own timeout
    # (the worker's one scope an attempt stands for it), not at the lease.
    started: list[float] = []

    async def hang(delivery: Delivery) -> None:
        started.append(time.monotonic())
        await anyio.sleep(30)

    ids = [await enqueue_dispatch(store, kind="k", deliver_to=f"seat-{i}") for i in range(2)]
    worker = DispatchWorker(
        store, transport=hang, timeout_seconds=0.3, concurrency=1, tick_seconds=3600
    )
    async with anyio.create_task_group() as tg:
        await tg.start(worker.run)
        await wait_for(lambda: all(row_is(raw, i, status="pending", attempt=1) for i in ids))
        tg.cancel_scope.cancel()
    for dispatch_id in ids:
        assert raw.row(dispatch_id)["last_error"] == "timeout after 0.3s"
    assert started[1] - started[0] < 5  # cut at the timeout, far from the 15 s lease


@pytest.mark.anyio
async def test_a_callable_that_times_out_inside_the_shutdown_grace_records_its_timeout(
    store: SQLiteStore, raw: RawDB
) -> None:
    # Shutdown waits up to the grace (5 s) for the attempt; the callable's
    # own 0.5 s timeout cuts it first: a failed attempt with its backoff,
    # not a release.
    started = anyio.Event()

    async def hang(delivery: Delivery) -> None:
        started.set()
        await anyio.sleep(30)

    dispatch_id = await enqueue_dispatch(store, kind="k", deliver_to="seat")
    worker = DispatchWorker(
        store, transport=hang, timeout_seconds=0.5, grace_seconds=5, tick_seconds=3600
    )
    async with anyio.create_task_group() as tg:
        await tg.start(worker.run)
        await started.wait()
        tg.cancel_scope.cancel()
    row = raw.row(dispatch_id)
    assert (row["status"], row["attempt"], row["last_error"]) == (
        "pending",
        1,
        "timeout after 0.5s",
    )
    assert raw.transitions(dispatch_id)[-1]["reason_code"] == "dispatch.pending.retry_backoff"
    assert row["next_attempt_at"] > time.time() + 30  # its backoff, not due at once


@pytest.mark.anyio
async def test_a_shutdown_cut_before_the_callables_timeout_releases_however_late_it_ends(
    store: SQLiteStore, raw: RawDB
) -> None:
    # The grace (0.3 s) ends before the callable's timeout (0.8 s): the
    # shutdown cuts it. Its shielded cleanup runs past the timeout's time;
    # the row is still released (due now, no backoff), not failed.
    started = anyio.Event()

    async def slow_to_stop(delivery: Delivery) -> None:
        started.set()
        try:
            await anyio.sleep(30)
        except anyio.get_cancelled_exc_class():
            with anyio.CancelScope(shield=True):
                await anyio.sleep(0.7)
            raise

    dispatch_id = await enqueue_dispatch(store, kind="k", deliver_to="seat")
    worker = DispatchWorker(
        store, transport=slow_to_stop, timeout_seconds=0.8, grace_seconds=0.3, tick_seconds=3600
    )
    async with anyio.create_task_group() as tg:
        await tg.start(worker.run)
        await started.wait()
        tg.cancel_scope.cancel()
    row = raw.row(dispatch_id)
    assert (row["status"], row["attempt"], row["last_error"]) == ("pending", 1, None)
    assert raw.transitions(dispatch_id)[-1]["reason_code"] == "dispatch.pending.released"


@pytest.mark.anyio
async def test_a_callable_transport_subclass_with_its_own_call_is_called(
    store: SQLiteStore, raw: RawDB
) -> None:
    seen: list[str] = []

    class Audited(CallableTransport):
        async def __call__(self, delivery: Delivery) -> TransportResult:
            seen.append(delivery.dispatch_id)
            return await super().__call__(delivery)

    async def send(delivery: Delivery) -> None:
        pass

    dispatch_id = await enqueue_dispatch(store, kind="k", deliver_to="seat")
    async with anyio.create_task_group() as tg:
        await tg.start(DispatchWorker(store, transport=Audited(send), tick_seconds=3600).run)
        await wait_for(lambda: raw.row(dispatch_id)["status"] == "delivered")
        tg.cancel_scope.cancel()
    assert seen == [dispatch_id]


# -- shutdown --------------------------------------------------------------


@pytest.mark.anyio
async def test_shutdown_lets_deliveries_finish_within_the_grace(
    store: SQLiteStore, raw: RawDB
) -> None:
    async def send(delivery: Delivery) -> None:
        await anyio.sleep(0.3)

    dispatch_id = await enqueue_dispatch(store, kind="k", deliver_to="seat")
    async with anyio.create_task_group() as tg:
        worker = DispatchWorker(store, transport=send, grace_seconds=5, tick_seconds=3600)
        await tg.start(worker.run)
        await wait_for(lambda: worker.in_flight == 1)
        tg.cancel_scope.cancel()
    row = raw.row(dispatch_id)
    assert (row["status"], row["attempt"]) == ("delivered", 1)
    assert "dispatch.pending.released" not in [
        t["reason_code"] for t in raw.transitions(dispatch_id)
    ]


@pytest.mark.anyio
async def test_shutdown_kills_what_outlives_the_grace_and_releases_its_row(
    store: SQLiteStore, raw: RawDB, tmp_path: Path
) -> None:
    script = tmp_path / "hang.py"
    script.write_text(GRANDCHILD_SCRIPT)
    pid_file = tmp_path / "pid"
    dispatch_id = await enqueue_dispatch(store, kind="k", deliver_to="seat")
    before = time.time()
    async with anyio.create_task_group() as tg:
        worker = DispatchWorker(
            store,
            notify_template=[sys.executable, str(script), str(pid_file)],
            grace_seconds=0.3,
            kill_grace_seconds=0.2,
            tick_seconds=3600,
        )
        await tg.start(worker.run)
        await wait_for(lambda: pid_file.exists() and pid_file.read_text() != "")
        stop_at = time.monotonic()
        tg.cancel_scope.cancel()
    assert time.monotonic() - stop_at < 4
    row = raw.row(dispatch_id)
    assert (row["status"], row["attempt"]) == ("pending", 1)
    assert before <= row["next_attempt_at"] <= time.time()
    last = raw.transitions(dispatch_id)[-1]
    assert (last["previous_status"], last["reason_code"], last["source"]) == (
        "delivering",
        "dispatch.pending.released",
        "scheduler",
    )
    await wait_for(lambda: process_gone(int(pid_file.read_text())), timeout=5)


@pytest.mark.anyio
async def test_shutdown_during_the_last_allowed_attempt_dead_letters_the_row(
    store: SQLiteStore, raw: RawDB
) -> None:
    async def send(delivery: Delivery) -> None:
        await anyio.sleep(30)

    dispatch_id = await enqueue_dispatch(store, kind="k", deliver_to="seat", max_attempts=1)
    async with anyio.create_task_group() as tg:
        worker = DispatchWorker(store, transport=send, grace_seconds=0.1, tick_seconds=3600)
        await tg.start(worker.run)
        await wait_for(lambda: worker.in_flight == 1)
        tg.cancel_scope.cancel()
    assert raw.row(dispatch_id)["status"] == "dead_letter"
    assert raw.transitions(dispatch_id)[-1]["reason_code"] == "dispatch.dead_letter.max_attempts"
    assert worker.counts["dead_letter"] == 1


@pytest.mark.anyio
async def test_worker_arguments_are_checked_naming_the_value(
    store: SQLiteStore, raw: RawDB
) -> None:
    for bad, match in [
        ({"concurrency": 0}, "concurrency"),
        ({"batch_size": "9"}, "batch_size"),
        ({"tick_seconds": -1}, "tick_seconds"),
        ({"retry_jitter": 2.0}, "retry_jitter"),
        ({"transport": "echo"}, "transport"),
    ]:
        with pytest.raises((ValueError, TypeError), match=match):
            DispatchWorker(store, **bad)  # type: ignore[arg-type]
    async with store.transaction() as tx:
        with pytest.raises(TypeError, match="not a transaction handle"):
            DispatchWorker(tx)  # type: ignore[arg-type]
    assert raw.counts() == (0, 0)


@pytest.mark.anyio
async def test_a_worker_cannot_run_twice_at_once(store: SQLiteStore) -> None:
    async def send(delivery: Delivery) -> None:
        pass

    worker = DispatchWorker(store, transport=send, tick_seconds=3600)
    async with anyio.create_task_group() as tg:
        await tg.start(worker.run)
        with pytest.raises(RuntimeError, match="already running"):
            await worker.run()
        tg.cancel_scope.cancel()


@pytest.mark.anyio
async def test_claims_committed_while_the_worker_is_cancelled_are_released_not_lost(
    store: SQLiteStore, raw: RawDB
) -> None:
    sent: list[str] = []

    async def send(delivery: Delivery) -> None:
        sent.append(delivery.dispatch_id)

    ids = [
        await enqueue_dispatch(store, kind="k", deliver_to=f"s{i}", max_attempts=1)
        for i in range(3)
    ]

    first, second = HeldWriter(), HeldWriter()

    async def other_writer() -> None:
        # Holds the writer so the worker's first scan queues, then leads the
        # batch that runs the scan: the claims commit in another task's batch.
        await store.write(first.unit)
        await store.write(second.unit)

    worker = DispatchWorker(store, transport=send, tick_seconds=3600, grace_seconds=1)
    worker_scope = anyio.CancelScope()

    async def run_worker() -> None:
        with worker_scope:
            await worker.run()

    async with anyio.create_task_group() as tg:
        tg.start_soon(other_writer)
        await first.running()
        tg.start_soon(run_worker)
        await wait_for(lambda: store.queued_writes == 1)  # the scan waits for the writer
        first.release()
        await second.running()  # the scan's unit has run in this batch; not committed yet
        worker_scope.cancel()
        second.release()
    assert worker_scope.cancelled_caught
    rows = [raw.row(i) for i in ids]
    # Each claimed row was either delivered or released: never left delivering.
    assert all(r["status"] in ("delivered", "pending") for r in rows), rows
    assert all(r["status"] == "delivered" for r in rows if r["id"] in sent)


@pytest.mark.anyio
async def test_a_graceful_stop_leaves_no_row_delivering(store: SQLiteStore, raw: RawDB) -> None:
    sent: list[tuple[str, int]] = []

    async def send(delivery: Delivery) -> None:
        await anyio.sleep(0.03)
        sent.append((delivery.dispatch_id, delivery.attempt))

    for i in range(60):
        await enqueue_dispatch(store, kind="k", deliver_to=f"s{i}")
    async with anyio.create_task_group() as tg:
        worker = DispatchWorker(
            store, transport=send, concurrency=4, tick_seconds=3600, grace_seconds=2
        )
        await tg.start(worker.run)
        await wait_for(lambda: len(sent) >= 8)  # mid-stream: slots are passing claims along
        tg.cancel_scope.cancel()
    by_status = statuses(raw)
    assert "delivering" not in by_status
    assert by_status.get("delivered", 0) == len(sent) == len(set(sent))
    assert by_status.get("delivered", 0) + by_status.get("pending", 0) == 60


@pytest.mark.slow
@pytest.mark.trio
@pytest.mark.sqlite_only  # the writer held by a caller transaction is the point
async def test_a_chained_claim_that_waited_for_the_writer_still_gets_a_whole_lease(
    db_path: Path,
) -> None:
    """A finish+claim that waited for the writer longer than the lease margin
    must not hand out a lease partly spent: no second worker may send the row
    while the first is still sending it."""
    log: list[tuple[float, str, str, str]] = []

    def transport_for(name: str):  # type: ignore[no-untyped-def]
        async def send(delivery: Delivery) -> None:
            log.append((time.monotonic(), name, "start", delivery.dispatch_id))
            try:
                await trio.sleep(0.5 if '"first"' in delivery.payload else 30)
            finally:
                log.append((time.monotonic(), name, "end", delivery.dispatch_id))

        return send

    async with open_store(db_path) as db1, open_store(db_path) as db2:
        await enqueue_dispatch(db1, kind="k", deliver_to="x", body={"n": "first"})
        # A 1.5 s lease margin (5 s by default): the same race, a third the wait.
        w1 = DispatchWorker(
            db1,
            transport=transport_for("w1"),
            concurrency=1,
            timeout_seconds=1,
            tick_seconds=0.2,
            listen=False,
            lease_margin_seconds=1.5,
        )
        w2 = DispatchWorker(
            db2,
            transport=transport_for("w2"),
            concurrency=1,
            timeout_seconds=1,
            tick_seconds=0.2,
            listen=False,
            lease_margin_seconds=1.5,
        )
        async with trio.open_nursery() as nursery:
            await nursery.start(w1.run)
            await trio.sleep(0.1)  # w1 is sending "first"; its finish+claim will queue
            async with db1.transaction() as tx:  # the app holds the writer 2.8 s
                # "second" commits with it (not before: w1 would claim it
                # ahead of its slot at once, under a lease of its own).
                second = await enqueue_dispatch(tx, kind="k", deliver_to="x", body={"n": "second"})
                await trio.sleep(2.8)  # longer than the lease (1 s + 1.5 s margin)
            released = time.time()
            nursery.start_soon(w2.run)  # a second worker on the same file
            await wait_for(lambda: RawDB(db_path).row(second)["status"] == "pending", 10)
            nursery.cancel_scope.cancel()
    # "second" was sent by w1 (chained, attempt 1, cut at its 1 s timeout) and
    # possibly retried later; never by two workers at once.
    # One row is never sent by both workers at once.
    spans: dict[tuple[str, str], list[tuple[float, float]]] = {}
    starts: dict[tuple[str, str], float] = {}
    for at, name, what, dispatch_id in log:
        if what == "start":
            starts[name, dispatch_id] = at
        else:
            spans.setdefault((name, dispatch_id), []).append((starts.pop((name, dispatch_id)), at))
    for dispatch_id in {key[1] for key in spans}:
        for a_start, a_end in spans.get(("w1", dispatch_id), []):
            for b_start, b_end in spans.get(("w2", dispatch_id), []):
                assert a_end <= b_start or b_end <= a_start, (spans, log)
    # The claim of "second" could commit only once the writer was free, and
    # its lease runs from then: a whole lease, not one spent while waiting.
    claim = next(
        t
        for t in RawDB(db_path).transitions(second)
        if t["reason_code"] == "dispatch.delivering.attempt"
    )
    assert claim["created_at"] >= released - 0.05
    assert json.loads(claim["metadata"])["lease_until"] == claim["created_at"] + 2.5


# -- a KeyboardInterrupt out of a transport ----------------------------------


@pytest.mark.anyio
async def test_keyboard_interrupt_in_a_transport_releases_its_row_and_stops_the_worker_gracefully(
    store: SQLiteStore, raw: RawDB
) -> None:
    other_started = anyio.Event()

    async def send(delivery: Delivery) -> None:
        if delivery.deliver_to == "ctrl-c":
            await other_started.wait()
            raise KeyboardInterrupt
        other_started.set()
        await anyio.sleep(0.3)  # still running when the interrupt comes

    other = await enqueue_dispatch(store, kind="k", deliver_to="slow")
    interrupted = await enqueue_dispatch(store, kind="k", deliver_to="ctrl-c", max_attempts=5)
    # listen=False: no wake-up from the listener's start races the release
    # with a scan that would claim the released row again.
    worker = DispatchWorker(store, transport=send, grace_seconds=5, tick_seconds=3600, listen=False)
    before = time.time()
    # The interrupt reaches the caller as itself (a Ctrl-C still stops the
    # process), and only after the worker stopped.
    with pytest.raises(KeyboardInterrupt):
        await worker.run()
    row = raw.row(interrupted)
    assert (row["status"], row["attempt"]) == ("pending", 1)
    assert before <= row["next_attempt_at"] <= time.time()  # due at once, no lease to wait
    last = raw.transitions(interrupted)[-1]
    assert (last["previous_status"], last["reason_code"]) == (
        "delivering",
        "dispatch.pending.released",
    )
    assert "KeyboardInterrupt" in last["reason_summary"]
    # Graceful: the delivery running beside it had its grace and finished.
    assert raw.row(other)["status"] == "delivered"
    assert statuses(raw) == {"pending": 1, "delivered": 1}
    assert not worker.statistics().running and worker.in_flight == 0


@pytest.mark.anyio
async def test_keyboard_interrupt_in_a_transport_releases_its_row_in_a_single_pass(
    store: SQLiteStore, raw: RawDB
) -> None:
    async def send(delivery: Delivery) -> None:
        raise KeyboardInterrupt

    dispatch_id = await enqueue_dispatch(store, kind="k", deliver_to="seat")
    with pytest.raises(KeyboardInterrupt):
        await deliver_due_dispatches(store, transport=send)
    row = raw.row(dispatch_id)
    assert (row["status"], row["attempt"]) == ("pending", 1)
    assert raw.transitions(dispatch_id)[-1]["reason_code"] == "dispatch.pending.released"


@pytest.mark.anyio
async def test_a_worker_runs_with_a_settings_object_and_keywords_win(
    store: SQLiteStore, raw: RawDB
) -> None:
    sent: list[str] = []

    async def send(delivery: Delivery) -> None:
        sent.append(delivery.deliver_to)

    settings = WorkerSettings(concurrency=3, tick_seconds=3600, batch_size=7)
    worker = DispatchWorker(store, send, settings, batch_size=2)
    assert (worker.settings.concurrency, worker.settings.batch_size) == (3, 2)
    assert settings.batch_size == 7  # the caller's object is left as it was
    for i in range(5):
        await enqueue_dispatch(store, kind="k", deliver_to=f"s{i}")
    async with anyio.create_task_group() as tg:
        await tg.start(worker.run)
        await wait_for(lambda: statuses(raw) == {"delivered": 5})
        tg.cancel_scope.cancel()
    assert sorted(sent) == [f"s{i}" for i in range(5)]


@pytest.mark.anyio
async def test_a_worker_from_a_configuration_runs_with_the_files_settings_object(
    store: SQLiteStore, raw: RawDB
) -> None:
    config = parse_config(
        {
            "dispatch": {"notify_template": ["true"], "timeout_seconds": 3},
            "worker": {"concurrency": 2, "tick_seconds": 3600},
        }
    )
    worker = DispatchWorker.from_config(store, config)
    assert worker.settings is config.worker  # read, never copied
    assert worker.settings.lease_seconds == 3 + worker.settings.lease_margin_seconds
    overridden = DispatchWorker.from_config(store, config, concurrency=5)
    assert overridden.settings == dataclasses.replace(config.worker, concurrency=5)
    assert config.worker.concurrency == 2  # the file's object is left as it was
    dispatch_id = await enqueue_dispatch(store, kind="k", deliver_to="seat")
    async with anyio.create_task_group() as tg:
        await tg.start(worker.run)
        await wait_for(lambda: statuses(raw) == {"delivered": 1})
        tg.cancel_scope.cancel()
    assert worker.statistics().concurrency == 2
    claimed = raw.transitions(dispatch_id)[1]
    assert claimed["reason_code"] == "dispatch.delivering.attempt"
    lease_until = json.loads(claimed["metadata"])["lease_until"]
    assert lease_until - claimed["created_at"] == pytest.approx(3 + 5, abs=0.5)  # timeout + margin


@pytest.mark.anyio
async def test_an_unknown_or_bad_worker_setting_is_refused_naming_it(store: SQLiteStore) -> None:
    with pytest.raises(TypeError, match="unexpected keyword argument 'concurency'"):
        DispatchWorker(store, concurency=4)
    with pytest.raises(ValueError, match="batch_size"):
        DispatchWorker(store, settings=WorkerSettings(), batch_size=0)


@pytest.mark.anyio
async def test_a_service_runs_beside_the_claim_loop_and_stops_with_the_worker(
    store: SQLiteStore, raw: RawDB
) -> None:
    events: list[str] = []
    started = anyio.Event()

    async def heartbeat() -> None:
        events.append("started")
        started.set()
        try:
            await anyio.sleep_forever()
        finally:
            events.append("stopped")

    async def send(delivery: Delivery) -> None:
        events.append(f"sent {delivery.deliver_to}")

    worker = DispatchWorker(store, send, tick_seconds=3600)
    worker.add_service("heartbeat", heartbeat)
    assert [name for name, _ in worker.services()][-1] == "heartbeat"
    with pytest.raises(TypeError, match="'broken' must be an async callable"):
        worker.add_service("broken", None)  # type: ignore[arg-type]
    async with anyio.create_task_group() as tg:
        await tg.start(worker.run)
        await started.wait()
        await enqueue_dispatch(store, kind="k", deliver_to="seat")
        await wait_for(lambda: statuses(raw) == {"delivered": 1})
        tg.cancel_scope.cancel()
    assert events == ["started", "sent seat", "stopped"]
