"""The worker as a real process: `trio-dispatch worker` stops cleanly on
SIGINT/SIGTERM, and a SIGKILLed worker loses nothing."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import anyio
import pytest

from trio_dispatch import Delivery, enqueue_dispatch, open_store
from trio_dispatch.worker import DispatchWorker

from .conftest import RawDB
from .test_worker import GRANDCHILD_SCRIPT, process_gone, wait_for

pytestmark = [pytest.mark.anyio, pytest.mark.sqlite_only]


def write_config(tmp_path: Path, db_path: Path, template: list[str], **worker: float) -> Path:
    config = tmp_path / "worker.yaml"
    settings = {"tick_seconds": 3600, "grace_seconds": 0.3, **worker}
    config.write_text(json.dumps({  # JSON is YAML
        "store": str(db_path),
        "dispatch": {"notify_template": template, "timeout_seconds": worker.get("timeout", 30)},
        "worker": {k: v for k, v in settings.items() if k != "timeout"},
        "log_level": "INFO",
    }))
    return config


def start_worker(config: Path) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "trio_dispatch", "--config", str(config), "worker"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )


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
    worker = start_worker(config)
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


async def test_a_sigkilled_worker_loses_nothing_its_rows_come_back_after_the_lease(
    db_path: Path, raw: RawDB, tmp_path: Path
) -> None:
    script = tmp_path / "hang.py"
    script.write_text(GRANDCHILD_SCRIPT)
    pid_file = tmp_path / "pid"
    # timeout 0.5 s -> lease 5.5 s
    config = write_config(tmp_path, db_path, [sys.executable, str(script), str(pid_file)],
                          timeout=0.5)
    async with open_store(db_path) as db:
        dispatch_id = await enqueue_dispatch(db, kind="k", deliver_to="seat")
    worker = start_worker(config)
    try:
        await wait_for(lambda: pid_file.exists() and pid_file.read_text() != "", timeout=20)
        os.kill(worker.pid, signal.SIGKILL)
        worker.wait(timeout=10)
    finally:
        worker.kill()
    claimed_at = float(raw.row(dispatch_id)["updated_at"])  # type: ignore[arg-type]
    # The dead worker's transport (its own process group) is orphaned; end
    # it as its timeout would have.
    for pid in subprocess.run(["pgrep", "-f", str(script)], capture_output=True,
                              text=True).stdout.split():
        os.killpg(os.getpgid(int(pid)), signal.SIGKILL)
    row = raw.row(dispatch_id)
    assert (row["status"], row["attempt"]) == ("delivering", 1)

    sent: list[tuple[str, int]] = []

    async def send(delivery: Delivery) -> None:
        sent.append((delivery.dispatch_id, delivery.attempt))

    async with open_store(db_path) as db, anyio.create_task_group() as tg:
        rescuer = DispatchWorker(db, transport=send, tick_seconds=0.5)
        await tg.start(rescuer.run)
        await wait_for(lambda: raw.row(dispatch_id)["status"] == "delivered", timeout=20)
        tg.cancel_scope.cancel()
    recovered_at = float(raw.row(dispatch_id)["updated_at"])  # type: ignore[arg-type]
    assert sent == [(dispatch_id, 2)]
    assert recovered_at - claimed_at >= 5.5 - 0.1
    recovery = raw.transitions(dispatch_id)[2]
    assert (recovery["previous_status"], recovery["reason_code"]) == (
        "delivering", "dispatch.delivering.attempt")
