"""A destination's shared limits (docs/destinations.md) under real worker processes on
one PostgreSQL database: three workers, each free to run eight attempts,
never run more attempts to a destination at once than its concurrency,
nor start them faster than its rate; an unlimited destination beside it is
not held back. Each transport call writes its start and end to a log of its
process; the limits are checked on those."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ..conftest import RawDB

WORKER = r"""
import os, sys, time
import anyio
from trio_dispatch import DispatchWorker, open_store

target, log = sys.argv[1], sys.argv[2]

async def main():
    out = open(log, "a", buffering=1)

    async def send(delivery):
        out.write(f"S {time.time():.6f} {delivery.deliver_to} {delivery.dispatch_id}\n")
        await anyio.sleep(0.05)
        out.write(f"E {time.time():.6f} {delivery.deliver_to} {delivery.dispatch_id}\n")

    policies = {"api": {"concurrency": 2, "rate": "20/s", "burst": 2}}
    async with open_store(target) as db, anyio.create_task_group() as group:
        worker = DispatchWorker(
            db, transport=send, concurrency=8, tick_seconds=0.1, destinations=policies
        )
        await group.start(worker.run)
        print("ready", flush=True)
        with anyio.open_signal_receiver(15) as signals:
            async for _ in signals:
                group.cancel_scope.cancel()
                break

anyio.run(main, backend="trio")
"""


def _attempts(logs: list[Path], destination: str) -> list[tuple[float, float]]:
    starts: dict[str, float] = {}
    spans = []
    for log in logs:
        for line in log.read_text().splitlines():
            kind, at, where, dispatch_id = line.split()
            if where != destination:
                continue
            if kind == "S":
                starts[dispatch_id] = float(at)
            else:
                spans.append((starts.pop(dispatch_id), float(at)))
    assert not starts, starts  # every attempt ended
    return spans


@pytest.mark.slow
@pytest.mark.postgres_only
def test_worker_processes_keep_a_destinations_concurrency_and_rate(
    tmp_path: Path, db_target: str, raw: RawDB
) -> None:
    logs = [tmp_path / f"w{k}.log" for k in range(3)]
    workers = [
        subprocess.Popen(
            [sys.executable, "-c", WORKER, db_target, str(log)],
            stdout=subprocess.PIPE,
            text=True,
        )
        for log in logs
    ]
    try:
        for worker in workers:
            assert worker.stdout is not None and worker.stdout.readline().strip() == "ready"
        rows = [("api", 40), ("other", 40)]
        values = ", ".join(
            f"('{name}-{i}', 'k', '{name}', '{{}}', 'pending', 0, 0, {i}, 0)"
            for name, count in rows
            for i in range(count)
        )
        raw.execute(
            "INSERT INTO dispatch_outbox (id, kind, deliver_to, payload, status, attempt, "
            f"next_attempt_at, created_at, updated_at) VALUES {values}"
        )
        deadline = time.monotonic() + 120
        while raw.scalar("SELECT COUNT(*) FROM dispatch_outbox WHERE status = 'delivered'") < 80:
            assert time.monotonic() < deadline, "not delivered in time"
            time.sleep(0.1)
    finally:
        for worker in workers:
            worker.send_signal(signal.SIGTERM)
        for worker in workers:
            worker.communicate(timeout=30)  # and its pipe closed
    api = sorted(_attempts(logs, "api"))
    assert len(api) == 40
    # Concurrency: at no start were two others of the destination running.
    for start, _ in api:
        running = sum(1 for s, e in api if s <= start < e)
        assert running <= 2, (start, running)
    # Rate: each transport starts after its claim committed, so a window
    # may hold a start admitted just before it: 100 ms of slack.
    times = [start for start, _ in api]
    for i, first in enumerate(times):
        for j in range(i, len(times)):
            assert j - i + 1 <= 20 * (times[j] - first + 0.1) + 2, (i, j)
    # The unlimited destination was not held to the limited one's pace:
    # more of its attempts ran at once than the limit allows the other.
    other = sorted(_attempts(logs, "other"))
    assert max(sum(1 for s, e in other if s <= start < e) for start, _ in other) > 2
