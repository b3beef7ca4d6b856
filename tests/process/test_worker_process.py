"""The worker as a real process: `trio-dispatch worker` stops cleanly on
SIGINT/SIGTERM, and a SIGKILLed worker loses nothing."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import anyio
import pytest

from trio_dispatch import Delivery, enqueue_dispatch, open_store
from trio_dispatch.worker import DispatchWorker

from ..conftest import RawDB
from ..helpers import GRANDCHILD_SCRIPT, process_gone, start_worker, wait_for, write_config

pytestmark = [pytest.mark.anyio, pytest.mark.sqlite_only]


@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
async def test_a_signal_stops_the_worker_and_releases_its_running_attempt(
    db_path: Path, raw: RawDB, tmp_path: Path, signum: signal.Signals
) -> None:
    script = tmp_path / "hang.py"
    script.write_text(GRANDCHILD_SCRIPT)
    pid_file = tmp_path / "pid"
    config = write_config(tmp_path, db_path, [sys.executable, str(script), str(pid_file)])
    async with open_store(db_path) as db:
        dispatch_id = await enqueue_dispatch(db, kind="k", deliver_to="seat")
    with start_worker(config) as worker:
        try:
            await wait_for(lambda: pid_file.exists() and pid_file.read_text() != "", timeout=20)
            assert raw.row(dispatch_id)["status"] == "delivering"
            worker.send_signal(signum)
            _, stderr = await anyio.to_thread.run_sync(lambda: worker.communicate(timeout=15))
        finally:
            worker.kill()
    assert worker.returncode == 0, stderr
    assert f"{signum.name} received: stopping" in stderr
    row = raw.row(dispatch_id)
    assert (row["status"], row["attempt"]) == ("pending", 1)
    assert raw.transitions(dispatch_id)[-1]["reason_code"] == "dispatch.pending.released"
    await wait_for(lambda: process_gone(int(pid_file.read_text())), timeout=5)


KILLED_WORKER = """
import sys, trio
from trio_dispatch import DispatchWorker, open_store

async def main():
    async with open_store(sys.argv[1]) as db, trio.open_nursery() as nursery:
        worker = DispatchWorker(db, notify_template=sys.argv[2:], timeout_seconds=0.5,
                                tick_seconds=3600, lease_margin_seconds=1.5)
        await nursery.start(worker.run)

trio.run(main)
"""


@pytest.mark.slow
async def test_a_sigkilled_worker_loses_nothing_its_rows_come_back_after_the_lease(
    db_path: Path, raw: RawDB, tmp_path: Path
) -> None:
    script = tmp_path / "hang.py"
    script.write_text(GRANDCHILD_SCRIPT)
    pid_file = tmp_path / "pid"
    async with open_store(db_path) as db:
        dispatch_id = await enqueue_dispatch(db, kind="k", deliver_to="seat")
    # timeout 0.5 s + a 1.5 s lease margin (5 s by default) -> lease 2 s
    with subprocess.Popen(
        [
            sys.executable,
            "-c",
            KILLED_WORKER,
            str(db_path),
            sys.executable,
            str(script),
            str(pid_file),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    ) as worker:
        try:
            await wait_for(lambda: pid_file.exists() and pid_file.read_text() != "", timeout=20)
            os.kill(worker.pid, signal.SIGKILL)
            worker.wait(timeout=10)
        finally:
            worker.kill()
    claimed_at = float(raw.row(dispatch_id)["updated_at"])
    row = raw.row(dispatch_id)
    assert (row["status"], row["attempt"]) == ("delivering", 1)

    sent: list[tuple[str, int]] = []

    async def send(delivery: Delivery) -> None:
        sent.append((delivery.dispatch_id, delivery.attempt))

    async with open_store(db_path) as db, anyio.create_task_group() as tg:
        rescuer = DispatchWorker(db, transport=send, tick_seconds=0.2)
        await tg.start(rescuer.run)
        await wait_for(lambda: raw.row(dispatch_id)["status"] == "delivered", timeout=20)
        tg.cancel_scope.cancel()
    recovered_at = float(raw.row(dispatch_id)["updated_at"])
    assert sent == [(dispatch_id, 2)]
    assert recovered_at - claimed_at >= 2.0 - 0.1
    recovery = raw.transitions(dispatch_id)[2]
    assert (recovery["previous_status"], recovery["reason_code"]) == (
        "delivering",
        "dispatch.delivering.attempt",
    )
    assert "lease expired" in str(recovery["reason_summary"])


@pytest.mark.slow
@pytest.mark.parametrize("anyio_backend", ["trio"])
async def test_a_sigkilled_cli_worker_loses_nothing_its_row_comes_back_after_the_default_lease(
    db_path: Path, raw: RawDB, tmp_path: Path
) -> None:
    # The command and the configuration file, with the default 5 s margin.
    script = tmp_path / "hang.py"
    script.write_text(GRANDCHILD_SCRIPT)
    pid_file = tmp_path / "pid"
    config = write_config(
        tmp_path, db_path, [sys.executable, str(script), str(pid_file)], timeout=0.5
    )
    async with open_store(db_path) as db:
        dispatch_id = await enqueue_dispatch(db, kind="k", deliver_to="seat")
    with start_worker(config) as worker:  # timeout 0.5 s -> lease 5.5 s
        try:
            await wait_for(lambda: pid_file.exists() and pid_file.read_text() != "", timeout=20)
            os.kill(worker.pid, signal.SIGKILL)
            worker.wait(timeout=10)
        finally:
            worker.kill()
    claimed_at = float(raw.row(dispatch_id)["updated_at"])
    assert raw.row(dispatch_id)["status"] == "delivering"
    sent: list[int] = []

    async def send(delivery: Delivery) -> None:
        sent.append(delivery.attempt)

    async with open_store(db_path) as db, anyio.create_task_group() as tg:
        rescuer = DispatchWorker(db, transport=send, tick_seconds=0.2)
        await tg.start(rescuer.run)
        await wait_for(lambda: raw.row(dispatch_id)["status"] == "delivered", timeout=20)
        tg.cancel_scope.cancel()
    assert sent == [2]
    assert float(raw.row(dispatch_id)["updated_at"]) - claimed_at >= 5.5 - 0.1
