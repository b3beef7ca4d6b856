"""Rows claimed ahead of the slots in a real worker process, on both engines,
the worker on each backend: SIGTERM gives the held rows back at once
(pending, their ``released`` transition, the attempt not counted) while the
running attempts have their grace; SIGKILL loses none of them, and no
(id, attempt) is sent twice."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import anyio
import pytest

from trio_dispatch import Delivery, enqueue_dispatch, open_store
from trio_dispatch.worker import DispatchWorker
from trio_dispatch.worker.finisher import STOPPED_AHEAD

from ..conftest import RawDB
from ..helpers import wait_for

pytestmark = [pytest.mark.anyio, pytest.mark.slow]

WORKER = """
import signal, sys, anyio
from trio_dispatch import DispatchWorker, open_store

async def main():
    async with open_store(sys.argv[1]) as db:
        async def send(delivery):
            with open(sys.argv[3], "a") as ledger:
                ledger.write(f"{delivery.dispatch_id} {delivery.attempt}\\n")
            await anyio.sleep(60)
        worker = DispatchWorker(db, transport=send, concurrency=2, tick_seconds=0.2,
                                timeout_seconds=float(sys.argv[4]), grace_seconds=1,
                                lease_margin_seconds=1.5)
        async with anyio.create_task_group() as tg:
            with anyio.open_signal_receiver(signal.SIGTERM) as signals:
                await tg.start(worker.run)
                async for _ in signals:
                    tg.cancel_scope.cancel()
                    break

anyio.run(main, backend=sys.argv[2])
"""
"""A worker process (concurrency 2) whose attempts note "id attempt" in a
ledger, then hang; SIGTERM stops it (grace 1 s)."""


def ledger_pairs(path: Path) -> list[tuple[str, int]]:
    if not path.exists():
        return []
    pairs = []
    for line in path.read_text().splitlines():
        dispatch_id, attempt = line.split()
        pairs.append((dispatch_id, int(attempt)))
    return pairs


def delivering(raw: RawDB) -> set[str]:
    rows = raw.rows("SELECT id FROM dispatch_outbox WHERE status = ?", ("delivering",))
    return {row["id"] for row in rows}


def spawn(raw: RawDB, backend: str, ledger: Path, timeout: float) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", WORKER, raw.target, backend, str(ledger), str(timeout)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


async def all_claimed(raw: RawDB, ledger: Path, worker: subprocess.Popen[str]) -> None:
    """Two attempts running (in the ledger) and the four other rows held ahead."""

    def ready() -> bool:
        assert worker.poll() is None, worker.communicate()
        return len(delivering(raw)) == 6 and len(ledger_pairs(ledger)) == 2

    await wait_for(ready, timeout=30)


async def test_sigterm_gives_the_held_rows_back_at_once_and_the_running_after_their_grace(
    raw: RawDB, tmp_path: Path, anyio_backend: str
) -> None:
    async with open_store(raw.target) as db:
        ids = [await enqueue_dispatch(db, kind="k", deliver_to=f"d{n}") for n in range(6)]
    ledger = tmp_path / "ledger"
    with spawn(raw, anyio_backend, ledger, timeout=60) as worker:
        try:
            await all_claimed(raw, ledger, worker)
            running = {dispatch_id for dispatch_id, _ in ledger_pairs(ledger)}
            held = delivering(raw) - running
            worker.send_signal(signal.SIGTERM)
            _, stderr = await anyio.to_thread.run_sync(lambda: worker.communicate(timeout=30))
        finally:
            worker.kill()
    assert worker.returncode == 0, stderr
    assert len(held) == 4 and {row["status"] for row in map(raw.row, ids)} == {"pending"}
    released_at: dict[str, float] = {}
    for dispatch_id in running | held:
        row = raw.row(dispatch_id)
        last = raw.transitions(dispatch_id)[-1]
        assert last["reason_code"] == "dispatch.pending.released"
        released_at[dispatch_id] = float(last["created_at"])
        if dispatch_id in held:  # never sent: the attempt taken back
            assert row["attempt"] == 0
            assert STOPPED_AHEAD in f"{last['reason_summary']} {row['last_error']}"
        else:
            assert row["attempt"] == 1
    # The held rows went back at once; the running ones after their 1 s grace.
    assert max(released_at[i] for i in held) < min(released_at[i] for i in running) - 0.5
    assert {dispatch_id for dispatch_id, _ in ledger_pairs(ledger)} == running


async def test_sigkill_with_rows_held_ahead_loses_nothing_and_sends_no_attempt_twice(
    raw: RawDB, tmp_path: Path, anyio_backend: str
) -> None:
    async with open_store(raw.target) as db:
        ids = [await enqueue_dispatch(db, kind="k", deliver_to=f"d{n}") for n in range(6)]
    ledger = tmp_path / "ledger"
    # A 0.5 s timeout and a 1.5 s margin: leases of 2 s, so the rows come back soon.
    with spawn(raw, anyio_backend, ledger, timeout=0.5) as worker:
        try:
            await all_claimed(raw, ledger, worker)
            os.kill(worker.pid, signal.SIGKILL)
            worker.wait(timeout=10)
        finally:
            worker.kill()
    sent = ledger_pairs(ledger)

    async def send(delivery: Delivery) -> None:
        sent.append((delivery.dispatch_id, delivery.attempt))

    options: dict[str, Any] = {"tick_seconds": 0.2}
    async with open_store(raw.target) as db, anyio.create_task_group() as tg:
        await tg.start(DispatchWorker(db, transport=send, **options).run)
        await wait_for(lambda: all(raw.row(i)["status"] == "delivered" for i in ids), timeout=30)
        tg.cancel_scope.cancel()
    assert {dispatch_id for dispatch_id, _ in sent} == set(ids)
    assert max(Counter(sent).values()) == 1, sent
