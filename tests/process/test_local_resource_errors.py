"""A command that cannot be started for want of a local resource (EMFILE,
ENFILE, ENOMEM, EAGAIN at spawn) is no failed attempt: the row is released
(``dispatch.pending.released``, the reason in ``last_error``), its attempt is
not counted, and the worker pauses its claims before trying again. Real
child processes, under a really lowered RLIMIT_NOFILE."""

from __future__ import annotations

import contextlib
import logging
import os
import resource
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import anyio
import pytest

from trio_dispatch import deliver_due_dispatches, enqueue_dispatch, open_store
from trio_dispatch.store import SQLiteStore
from trio_dispatch.worker import DispatchWorker

from ..conftest import RawDB
from ..helpers import start_worker, wait_for, write_config


def lowest_free_fd() -> int:
    fd = os.dup(0)
    os.close(fd)
    return fd


@contextlib.contextmanager
def no_free_descriptor() -> Iterator[None]:
    """This process can open no new file descriptor until the block ends
    (its soft RLIMIT_NOFILE lowered to the descriptors it holds)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (lowest_free_fd(), hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


SELECT_ROW = "SELECT status, attempt, last_error FROM dispatch_outbox WHERE id = ?"


def paused(caplog: pytest.LogCaptureFixture) -> bool:
    """Whether the worker has logged its pause after a local resource error."""
    return any("claiming paused" in record.getMessage() for record in caplog.records)


async def descriptors_settled() -> None:
    """Wait until this process opens no more descriptors of its own accord
    (a PostgreSQL pool filling, a listener connecting): the test then takes
    away only what a spawn needs."""
    seen = -1
    with anyio.fail_after(10):
        while (count := len(os.listdir("/proc/self/fd"))) != seen:
            seen = count
            await anyio.sleep(0.3)


def idle_descriptors(pid: int) -> int:
    """The descriptors process ``pid`` holds once idle: the count read when it
    has stayed the same over four of the worker's 0.5 s ticks (its writer
    opens the WAL file at its first scan, after "worker started")."""
    readings: list[int] = []
    deadline = time.monotonic() + 15
    while len(readings) < 5 or len(set(readings[-5:])) != 1:
        assert time.monotonic() < deadline, readings
        readings.append(len(os.listdir(f"/proc/{pid}/fd")))
        time.sleep(0.5)
    return readings[-1]


def assert_released_not_counted(raw: RawDB, dispatch_id: str) -> None:
    released = [
        t for t in raw.transitions(dispatch_id) if t["reason_code"] == "dispatch.pending.released"
    ]
    assert released, raw.transitions(dispatch_id)
    assert "local resource error" in released[0]["reason_summary"]
    assert "Too many open files" in released[0]["reason_summary"]
    assert "not counted" in released[0]["reason_summary"]
    assert not [
        t for t in raw.transitions(dispatch_id) if t["reason_code"].startswith("dispatch.dead")
    ]


@pytest.mark.slow
@pytest.mark.anyio
async def test_a_spawn_short_of_descriptors_releases_the_row_without_counting_the_attempt(
    store: SQLiteStore, raw: RawDB, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="trio_dispatch")
    worker = DispatchWorker(
        store, notify_template=[sys.executable, "-c", "pass"], tick_seconds=3600
    )
    async with anyio.create_task_group() as tg:
        await tg.start(worker.run)
        await enqueue_dispatch(store, kind="k", deliver_to="warm-up")  # every connection open
        await wait_for(lambda: worker.counts["delivered"] == 1)
        await descriptors_settled()
        with no_free_descriptor():
            dispatch_id = await enqueue_dispatch(store, kind="k", deliver_to="seat")
            await wait_for(lambda: paused(caplog))
            # Read on the store's open connection: a new one needs a descriptor.
            # Polled: on a loaded machine the read may come before the
            # release's commit is visible to the reader.
            with anyio.fail_after(10):
                while True:
                    row = await store.read(lambda conn: conn.query_one(SELECT_ROW, (dispatch_id,)))
                    assert row is not None
                    if row["status"] != "delivering":
                        break
                    await anyio.sleep(0.05)
            # Released: pending, due at once, and no attempt spent on it.
            assert (row["status"], row["attempt"]) == ("pending", 0)
            assert "local resource error" in row["last_error"]
            assert "EMFILE" in row["last_error"]
        # Once descriptors are free again (after the worker's pause) it goes out.
        await wait_for(lambda: raw.row(dispatch_id)["status"] == "delivered", timeout=15)
        tg.cancel_scope.cancel()
    assert raw.row(dispatch_id)["attempt"] == 1
    assert_released_not_counted(raw, dispatch_id)
    assert worker.counts["retried"] == 0 and worker.counts["dead_letter"] == 0
    assert worker.counts["delivered"] == 2


@pytest.mark.anyio
async def test_a_single_pass_short_of_descriptors_releases_the_row_and_stops(
    store: SQLiteStore, raw: RawDB
) -> None:
    first = await enqueue_dispatch(store, kind="k", deliver_to="a")
    second = await enqueue_dispatch(store, kind="k", deliver_to="b")
    await store.read(lambda conn: conn.query_one(SELECT_ROW, (first,)))
    await descriptors_settled()
    with no_free_descriptor():
        counts = await deliver_due_dispatches(store, notify_template=[sys.executable, "-c", "pass"])
    assert counts["retried"] == 0 and counts["delivered"] == 0
    assert (raw.row(first)["status"], raw.row(first)["attempt"]) == ("pending", 0)
    assert raw.row(second)["attempt"] == 0  # left for the next pass
    counts = await deliver_due_dispatches(store, notify_template=[sys.executable, "-c", "pass"])
    assert counts["delivered"] == 2
    assert raw.row(first)["attempt"] == raw.row(second)["attempt"] == 1


@pytest.mark.slow
@pytest.mark.sqlite_only
def test_a_worker_process_short_of_descriptors_releases_and_delivers_once_they_return(
    tmp_path: Path,
) -> None:
    """A real worker process: its descriptor limit lowered (prlimit) to what
    it holds once idle, then lifted."""
    db = tmp_path / "o.db"
    # A short tick: the worker scans on it even if its wake-up poller could
    # not open its connection under the lowered limit.
    config = write_config(tmp_path, db, ["true"], tick_seconds=0.5)
    raw = RawDB(db)
    process = start_worker(config)
    try:
        assert process.stderr is not None
        while "worker started" not in process.stderr.readline():
            assert process.poll() is None
        soft, hard = resource.prlimit(process.pid, resource.RLIMIT_NOFILE)
        held = idle_descriptors(process.pid)
        resource.prlimit(process.pid, resource.RLIMIT_NOFILE, (held, hard))

        async def enqueue() -> str:
            async with open_store(str(db)) as store:
                return await enqueue_dispatch(store, kind="k", deliver_to="seat")

        dispatch_id = anyio.run(enqueue)
        # While the limit holds, the row is claimed again after each pause and
        # released again: wait for a released moment, never a counted attempt.
        anyio.run(wait_for, lambda: raw.row(dispatch_id)["last_error"] is not None)
        anyio.run(
            wait_for,
            lambda: (
                (raw.row(dispatch_id)["status"], raw.row(dispatch_id)["attempt"]) == ("pending", 0)
            ),
        )
        assert raw.row(dispatch_id)["attempt"] in (0, 1)  # never more than the one in flight
        resource.prlimit(process.pid, resource.RLIMIT_NOFILE, (soft, hard))
        anyio.run(wait_for, lambda: raw.row(dispatch_id)["status"] == "delivered", 15.0)
        assert raw.row(dispatch_id)["attempt"] == 1
        assert_released_not_counted(raw, dispatch_id)
    finally:
        process.terminate()
        process.communicate(timeout=20)
