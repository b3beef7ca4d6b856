"""Worker processes draining a queue: each set up (imports, connections)
before the clock starts, all started together on one "go" line, timed until
a count of the undone items reads 0. Ours here; the peers' child programs
live in their sections.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sqlite3
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Final

import anyio

from trio_dispatch.lifecycle import DUE_SQL

from .harness import ROOT
from .workloads import fill_ours

POLL_SECONDS: Final = 0.01
"""How often the parent checks whether worker processes have drained a queue."""


WORKER_CHILD = """
import sys, anyio, signal
sys.path.insert(0, sys.argv[2])
from trio_dispatch import open_store, DispatchWorker
async def main():
    async with open_store(sys.argv[1]) as db:
        async def send(d):
            pass
        async with anyio.create_task_group() as tg:
            w = DispatchWorker(db, transport=send, tick_seconds=0.2, concurrency=int(sys.argv[3]))
            with anyio.open_signal_receiver(signal.SIGTERM) as signals:
                print("ready", flush=True)
                await anyio.to_thread.run_sync(sys.stdin.readline)
                await tg.start(w.run)
                async for _ in signals:
                    tg.cancel_scope.cancel()
                    break
anyio.run(main, backend="trio")
"""
"""Our worker process: a ``DispatchWorker`` (no-op callable, concurrency
``argv[3]``) on the store ``argv[1]``, started on "go"; SIGTERM stops it."""


@contextlib.contextmanager
def counter(target: str) -> Iterator[Callable[[str], int]]:
    """A function running a ``SELECT COUNT(*)`` on ``target`` (one
    connection, kept open while the caller polls)."""
    if target.startswith("postgresql"):
        import psycopg

        with psycopg.connect(target, autocommit=True) as pg:

            def count_pg(sql: str) -> int:
                row = pg.execute(sql).fetchone()
                return int(row[0]) if row else 0

            yield count_pg
        return
    conn = sqlite3.connect(target, timeout=30, isolation_level=None)
    try:
        yield lambda sql: int(conn.execute(sql).fetchone()[0])
    finally:
        conn.close()


@dataclass
class Drained:
    """A drain by worker processes: the items/s, what the processes printed
    after "ready", and how many exited with an error."""

    rate: float
    said: list[str]
    failed: int
    cpu_seconds: float = float("nan")
    """CPU time (user + system) the processes spent from "go" until drained."""
    polls: int = 0
    """The counts run on the polling connection (each its own transaction)."""
    server_cpu_seconds: float = float("nan")
    """With ``server_cpu``: the CPU time the server spent meanwhile."""

    def errors(self) -> int:
        """The errors the processes reported ("errors N" lines)."""
        return sum(
            int(line.split()[1])
            for text in self.said
            for line in text.splitlines()
            if line.startswith("errors ")
        )


def drain_with_processes(
    argv: Sequence[str],
    workers: int,
    target: str,
    remaining_sql: str,
    n: int,
    server_cpu: Callable[[], float] | None = None,
) -> Drained:
    """``workers`` processes running ``argv`` over ``n`` items queued
    beforehand. Each process sets up (imports, connects), prints "ready" and
    waits; the time runs from the "go" line sent to all of them until
    ``remaining_sql`` (a count of the items not yet done, polled every 10 ms
    on one connection) reads 0. Startup is outside the timing. A process
    that exits with an error before then is counted in ``failed``."""
    procs = [
        subprocess.Popen(list(argv), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        for _ in range(workers)
    ]
    failed = 0
    cpu_at_go = 0.0
    polls = 0
    try:
        for proc in procs:
            assert proc.stdout is not None
            if proc.stdout.readline().strip() != "ready":
                raise RuntimeError(f"a worker process did not start: {' '.join(argv[:3])}")
        with counter(target) as count:
            deadline = time.monotonic() + 600
            cpu_at_go = sum(_cpu_seconds(proc.pid) for proc in procs)
            server_at_go = server_cpu() if server_cpu else float("nan")
            start = time.perf_counter()
            for proc in procs:
                assert proc.stdin is not None
                proc.stdin.write("go\n")
                proc.stdin.flush()
            while count(remaining_sql) > 0:
                polls += 1
                # All gone with items left (checked again: the last may have
                # finished them just before it exited): they will not drain.
                gone = all(proc.poll() is not None for proc in procs)
                if time.monotonic() > deadline or (gone and count(remaining_sql) > 0):
                    raise RuntimeError(f"{workers} worker process(es) did not drain {n} items")
                time.sleep(POLL_SECONDS)
            elapsed = time.perf_counter() - start
            polls += 1
            cpu = sum(_cpu_seconds(proc.pid) for proc in procs) - cpu_at_go
            server = (server_cpu() if server_cpu else float("nan")) - server_at_go
        failed = sum(1 for proc in procs if proc.poll() not in (None, 0))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in procs:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    said = [proc.stdout.read() if proc.stdout else "" for proc in procs]
    return Drained(n / elapsed, said, failed, cpu, polls, server)


def server_cpu_of(postmaster: int) -> Callable[[], float]:
    """The CPU time so far of a local server's processes: the postmaster,
    its children (backends, WAL writer, checkpointer, autovacuum) that are
    alive when it is read, and those that have exited (the postmaster reaped
    them: their time is in its children's counters) -- a backend whose
    client disconnected before the reading still counts."""

    def total() -> float:
        seconds = _cpu_seconds(postmaster, reaped=True)
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                try:
                    with open(f"/proc/{entry}/stat") as stat:
                        if int(stat.read().rsplit(")", 1)[1].split()[1]) != postmaster:
                            continue
                except (OSError, ValueError, IndexError):
                    continue
                child = _cpu_seconds(int(entry))
                if child == child:  # not NaN: it may have exited since it was listed
                    seconds += child
        return seconds

    return total


def _cpu_seconds(pid: int, reaped: bool = False) -> float:
    """utime + stime of a live process, from ``/proc`` (NaN elsewhere, or
    once it has exited); with ``reaped``, plus those of its children it has
    waited for (cutime + cstime)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
    except OSError:
        return float("nan")
    ticks = int(fields[11]) + int(fields[12])
    if reaped:
        ticks += int(fields[13]) + int(fields[14])
    return ticks / os.sysconf("SC_CLK_TCK")


DEFAULT_CONCURRENCY: Final = 16
"""The worker's own default ``concurrency``: what a user who sets none gets."""


def ours_processes(
    target: str,
    n: int,
    workers: int,
    body: dict[str, Any] | None = None,
    concurrency: int = DEFAULT_CONCURRENCY,
) -> float:
    """Deliveries/s of ``workers`` worker processes (no-op callable,
    ``concurrency`` slots each) draining ``n`` dispatches enqueued beforehand."""
    anyio.run(fill_ours, target, n, body)
    drained = drain_with_processes(
        [sys.executable, "-c", WORKER_CHILD, target, str(ROOT), str(concurrency)],
        workers,
        target,
        f"SELECT COUNT(*) FROM dispatch_outbox WHERE {DUE_SQL}",
        n,
    )
    if drained.failed:
        raise RuntimeError(f"{drained.failed} of our {workers} worker processes failed")
    return drained.rate


def deliveries_with_processes(
    target: str, n: int, workers: int, concurrency: int = DEFAULT_CONCURRENCY
) -> float:
    """Deliveries/s of ``workers`` worker processes (no-op transport)
    draining n dispatches enqueued beforehand; their startup is outside the
    timing."""
    return ours_processes(target, n, workers, concurrency=concurrency)
