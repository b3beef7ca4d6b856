"""Fault drill: a worker delivering a steady stream of dispatches through
three store faults, with figures.

Scenarios (each on a fresh database, in-process DispatchWorker with a
callable transport that records every send as (id, attempt); a producer on
its own store connection enqueues before, during and after the fault, each
item under its own dedup key, retrying a failed enqueue until it commits):

- read-only: ``chattr +i`` on the database file and its ``-wal`` (not
  ``-shm``: a write to a shared mapping of an immutable file is SIGBUS);
- disk-full: the database on a small tmpfs, filled by a filler file after a
  ``wal_checkpoint(TRUNCATE)``; deleting the filler clears it;
- locked: a child process holds ``BEGIN EXCLUSIVE`` longer than the stores'
  ``busy_timeout`` (0.5 s here); its exit clears it.

Per scenario it prints: dispatches committed, delivered, lost, duplicate
(id, attempt) sends, ids sent again (their finish could not be recorded
during the fault, so the lease brought them back: at least once, by design),
errors logged by the worker, enqueues that failed (and were retried), how
long the fault lasted, seconds from clearing to the worker's first recorded
write, seconds from clearing until everything was delivered, and
``PRAGMA integrity_check``.

Exit status: 0 all clean; 1 something lost, an (id, attempt) sent twice,
integrity not ok, the worker stopped, or the fault never showed. A scenario
whose mechanism is unavailable (no chattr, no mount) is reported as skipped.

    .venv/bin/python scripts/fault_drill.py [--dispatches 2000] [--fault-seconds 5]
        [--backend trio|asyncio] [--only read-only,disk-full,locked]

Needs root (chattr, mount).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import random
import sqlite3
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio

from trio_dispatch import Delivery, TransportResult, enqueue_dispatch, open_store
from trio_dispatch.store import Store
from trio_dispatch.worker import DispatchWorker

ENOSPC = 28
LOCK_BUSY_TIMEOUT = 0.5
TMPFS_SIZE = "32m"
LOCKER = """\
import sqlite3, sys
conn = sqlite3.connect(sys.argv[1], isolation_level=None, timeout=30)
conn.execute("BEGIN EXCLUSIVE")
print("locked", flush=True)
sys.stdin.read()
conn.execute("ROLLBACK")
"""


class Unavailable(Exception):
    """The fault's mechanism cannot be used here."""


def run(argv: list[str]) -> subprocess.CompletedProcess[str]:
    """Run a tool; a missing one is a failed run (exit 127) saying so."""
    try:
        return subprocess.run(argv, capture_output=True, text=True, check=False)
    except FileNotFoundError:
        return subprocess.CompletedProcess(argv, 127, "", f"{argv[0]} is not installed")


# -- faults -------------------------------------------------------------------------


class ReadOnly:
    name = "read-only"
    error_text = "disk I/O error"
    busy_timeout = 10.0

    def __init__(self, workdir: Path) -> None:
        self.db_path = workdir / "outbox.db"
        self.files = [self.db_path, workdir / "outbox.db-wal"]

    def prepare(self) -> None:
        probe = self.db_path.with_name("probe")
        probe.write_bytes(b"x")
        try:
            done = run(["chattr", "+i", str(probe)])
            if done.returncode != 0:
                raise Unavailable(f"chattr +i failed: {done.stderr.strip()}")
            try:
                with open(probe, "ab") as handle:
                    handle.write(b"y")
            except PermissionError:
                return
            raise Unavailable("chattr +i does not block writes here")
        finally:
            run(["chattr", "-i", str(probe)])
            probe.unlink(missing_ok=True)

    def start(self) -> None:
        done = run(["chattr", "+i", *map(str, self.files)])
        if done.returncode != 0:
            raise RuntimeError(f"chattr +i failed: {done.stderr.strip()}")

    def clear(self) -> None:
        done = run(["chattr", "-i", *map(str, self.files)])
        if done.returncode != 0:
            raise RuntimeError(f"chattr -i failed: {done.stderr.strip()}")

    def cleanup(self) -> None:
        run(["chattr", "-i", *[str(f) for f in self.files if f.exists()]])

    def teardown(self) -> None:
        self.cleanup()


class DiskFull:
    name = "disk-full"
    error_text = "database or disk is full"
    busy_timeout = 10.0

    def __init__(self, workdir: Path) -> None:
        self.mount_point = workdir / "tmpfs"
        self.db_path = self.mount_point / "outbox.db"
        self.filler = self.mount_point / "filler"
        self.mounted = False

    def prepare(self) -> None:
        self.mount_point.mkdir()
        done = run(
            ["mount", "-t", "tmpfs", "-o", f"size={TMPFS_SIZE}", "tmpfs", str(self.mount_point)]
        )
        if done.returncode != 0:
            raise Unavailable(f"mount tmpfs failed: {done.stderr.strip()}")
        self.mounted = True

    def start(self) -> None:
        # Empty the WAL first: then every commit must allocate new pages (a
        # WAL restarting from its beginning would rewrite pages it owns).
        conn = sqlite3.connect(self.db_path, timeout=10)
        try:
            for _ in range(50):
                busy, _, _ = conn.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()
                if not busy:
                    break
                time.sleep(0.01)
        finally:
            conn.close()
        fd = os.open(self.filler, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        try:
            for size in (1 << 20, 1 << 16, 1 << 12, 512):
                block = bytes(size)
                try:
                    while True:
                        os.write(fd, block)
                except OSError as exc:
                    if exc.errno != ENOSPC:
                        raise
        finally:
            os.close(fd)

    def clear(self) -> None:
        self.filler.unlink()

    def cleanup(self) -> None:
        if self.mounted:
            self.filler.unlink(missing_ok=True)

    def teardown(self) -> None:
        self.cleanup()
        if self.mounted:
            if run(["umount", str(self.mount_point)]).returncode != 0:
                run(["umount", "-l", str(self.mount_point)])
            self.mounted = False


class Locked:
    name = "locked"
    error_text = "database is locked"
    busy_timeout = LOCK_BUSY_TIMEOUT

    def __init__(self, workdir: Path) -> None:
        self.db_path = workdir / "outbox.db"
        self.child: subprocess.Popen[str] | None = None

    def prepare(self) -> None:
        pass

    def start(self) -> None:
        self.child = subprocess.Popen(
            [sys.executable, "-c", LOCKER, str(self.db_path)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.child.stdout is not None
        line = self.child.stdout.readline().strip()
        if line != "locked":
            raise RuntimeError(f"lock holder did not lock: {line!r}")

    def clear(self) -> None:
        assert self.child is not None and self.child.stdin is not None
        self.child.stdin.close()
        self.child.wait(timeout=30)

    def cleanup(self) -> None:
        if self.child is not None and self.child.poll() is None:
            self.child.kill()
            self.child.wait()

    def teardown(self) -> None:
        self.cleanup()


Fault = ReadOnly | DiskFull | Locked
FAULTS: dict[str, Callable[[Path], Fault]] = {
    "read-only": ReadOnly,
    "disk-full": DiskFull,
    "locked": Locked,
}


# -- the run ------------------------------------------------------------------------


class Recorder(logging.Handler):
    """Keeps the worker's log records with their arrival time."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.records: list[tuple[float, logging.LogRecord]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append((time.monotonic(), record))


@dataclasses.dataclass
class Figures:
    scenario: str
    dispatches: int = 0
    delivered: int = 0
    lost: int = 0
    duplicate_pairs: int = 0
    resent_ids: int = 0
    unrecorded_finishes: int = 0
    errors_logged: int = 0
    fault_errors_logged: int = 0
    scan_errors: int = 0
    finish_errors: int = 0
    enqueue_failures: int = 0
    fault_seconds: float = 0.0
    resume_seconds: float | None = None
    drain_seconds: float | None = None
    integrity: str = "-"
    worker_stopped: bool = False
    skipped: str | None = None
    problems: list[str] = dataclasses.field(default_factory=list)


async def drill(fault: Fault, args: argparse.Namespace) -> Figures:
    figures = Figures(fault.name)
    recorder = Recorder()
    logger = logging.getLogger("trio_dispatch")
    logger.addHandler(recorder)
    logger.setLevel(logging.INFO)
    logger.propagate = False
    sent: list[tuple[str, int]] = []
    keys: dict[str, str] = {}  # dedup key -> id, once committed
    exits: list[str] = []
    total = args.dispatches
    upfront = round(total * args.backlog)  # enqueued before the worker starts

    async def transport(delivery: Delivery) -> TransportResult:
        await anyio.sleep(random.uniform(0.02, 0.08))
        sent.append((delivery.dispatch_id, delivery.attempt))
        return TransportResult.success()

    async def enqueue_until_committed(producer: Store, n: int) -> None:
        key = f"drill-{n}"
        while True:
            try:
                keys[key] = await enqueue_dispatch(
                    producer,
                    kind="drill",
                    deliver_to=f"seat-{n % 50}",
                    dedup_key=key,
                    body={"n": n, "pad": "x" * 200},
                )
                return
            except sqlite3.OperationalError:
                figures.enqueue_failures += 1
                await anyio.sleep(0.1)

    async def produce(producer: Store, span: float) -> None:
        interval = span / max(1, total - upfront)
        next_at = anyio.current_time()
        for n in range(upfront, total):
            await enqueue_until_committed(producer, n)
            next_at += interval
            await anyio.sleep(max(0.0, next_at - anyio.current_time()))

    async def keep_worker(worker: DispatchWorker, *, task_status: Any) -> None:
        try:
            await worker.run(task_status=task_status)
        except BaseException as exc:
            exits.append(type(exc).__name__)
            raise
        exits.append("returned")

    def delivered_count() -> int:
        conn = sqlite3.connect(fault.db_path, timeout=10)
        try:
            return int(
                conn.execute(
                    "SELECT COUNT(*) FROM dispatch_outbox WHERE status = 'delivered'"
                ).fetchone()[0]
            )
        finally:
            conn.close()

    try:
        async with (
            open_store(fault.db_path, busy_timeout=fault.busy_timeout) as db,
            open_store(fault.db_path, busy_timeout=fault.busy_timeout) as producer,
        ):
            for n in range(upfront):
                await enqueue_until_committed(producer, n)
            worker = DispatchWorker(
                db,
                transport=transport,
                concurrency=args.concurrency,
                tick_seconds=0.5,
                timeout_seconds=2.0,
                grace_seconds=2.0,
            )
            span = args.lead_seconds + args.fault_seconds + args.trail_seconds
            async with anyio.create_task_group() as tg:
                await tg.start(keep_worker, worker)
                tg.start_soon(produce, producer, span)
                await anyio.sleep(args.lead_seconds)
                await anyio.to_thread.run_sync(fault.start)
                fault_started = time.monotonic()
                await anyio.sleep(args.fault_seconds)
                if exits:
                    figures.worker_stopped = True
                await anyio.to_thread.run_sync(fault.clear)
                cleared = time.monotonic()
                figures.fault_seconds = cleared - fault_started
                with anyio.move_on_after(args.fault_seconds + 60):
                    while (
                        len(keys) < total or await anyio.to_thread.run_sync(delivered_count) < total
                    ):
                        await anyio.sleep(0.05)
                figures.drain_seconds = time.monotonic() - cleared
                if exits:
                    figures.worker_stopped = True
                tg.cancel_scope.cancel()
    finally:
        fault.cleanup()
        logger.removeHandler(recorder)

    conn = sqlite3.connect(fault.db_path)
    try:
        figures.integrity = str(conn.execute("PRAGMA integrity_check").fetchone()[0])
        status = dict(conn.execute("SELECT id, status FROM dispatch_outbox").fetchall())
    finally:
        conn.close()
    committed = set(keys.values())
    figures.dispatches = len(committed)
    figures.delivered = sum(1 for i in committed if status.get(i) == "delivered")
    figures.lost = len(committed) - figures.delivered
    figures.duplicate_pairs = sum(1 for n in Counter(sent).values() if n > 1)
    figures.resent_ids = sum(1 for n in Counter(i for i, _ in sent).values() if n > 1)
    after = [(t, r) for t, r in recorder.records if t >= cleared]
    figures.resume_seconds = next(
        (
            t - cleared
            for t, r in after
            if r.getMessage().startswith("scan: claimed") or "result=delivered" in r.getMessage()
        ),
        None,
    )
    errors = [r for _, r in recorder.records if r.levelno >= logging.ERROR]
    figures.errors_logged = len(errors)
    figures.fault_errors_logged = sum(
        1 for r in errors if r.exc_info and fault.error_text in str(r.exc_info[1])
    )
    figures.scan_errors = sum(1 for r in errors if "scan failed" in r.getMessage())
    figures.finish_errors = sum(
        1 for r in errors if "recording the outcome failed" in r.getMessage()
    )
    figures.unrecorded_finishes = sum(
        1 for _, r in recorder.records if "result=unrecorded" in r.getMessage()
    )
    if figures.lost:
        figures.problems.append(f"{figures.lost} dispatches not delivered")
    if figures.duplicate_pairs:
        figures.problems.append(f"{figures.duplicate_pairs} (id, attempt) sent twice")
    if figures.integrity != "ok":
        figures.problems.append(f"integrity_check: {figures.integrity}")
    if figures.worker_stopped:
        figures.problems.append(f"worker stopped: {exits}")
    if not figures.fault_errors_logged:
        figures.problems.append(f"the fault never showed: no {fault.error_text!r} logged")
    if figures.dispatches != total:
        figures.problems.append(f"only {figures.dispatches} of {total} enqueues committed")
    return figures


def print_table(rows: list[Figures]) -> None:
    """One column per scenario, one line per figure."""
    ran = [f for f in rows if f.skipped is None]

    def seconds(value: float | None) -> str:
        return "-" if value is None else f"{value:.2f}"

    lines: list[tuple[str, Callable[[Figures], str]]] = [
        ("dispatches (committed)", lambda f: str(f.dispatches)),
        ("delivered", lambda f: str(f.delivered)),
        ("lost", lambda f: str(f.lost)),
        ("duplicate (id, attempt) sends", lambda f: str(f.duplicate_pairs)),
        ("ids sent again (lease recovery)", lambda f: str(f.resent_ids)),
        ("finishes unrecorded", lambda f: str(f.unrecorded_finishes)),
        ("errors logged", lambda f: str(f.errors_logged)),
        ("  scan failed", lambda f: str(f.scan_errors)),
        ("  recording the outcome failed", lambda f: str(f.finish_errors)),
        ("  naming the fault", lambda f: str(f.fault_errors_logged)),
        ("enqueues failed (retried)", lambda f: str(f.enqueue_failures)),
        ("fault lasted s", lambda f: seconds(f.fault_seconds)),
        ("resumed after clearing s", lambda f: seconds(f.resume_seconds)),
        ("all delivered after clearing s", lambda f: seconds(f.drain_seconds)),
        ("worker kept running", lambda f: "no" if f.worker_stopped else "yes"),
        ("integrity_check", lambda f: f.integrity),
    ]
    label = max(len(name) for name, _ in lines)
    width = max([12, *(len(f.scenario) for f in ran)])
    print(" " * label + "".join(f.scenario.rjust(width + 2) for f in ran))
    for name, value in lines:
        print(name.ljust(label) + "".join(value(f).rjust(width + 2) for f in ran))
    for f in rows:
        if f.skipped is not None:
            print(f"{f.scenario}: skipped: {f.skipped}")
        for problem in f.problems:
            print(f"{f.scenario}: FAIL: {problem}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dispatches", type=int, default=2000)
    parser.add_argument(
        "--fault-seconds",
        type=float,
        default=5.0,
        help="past the worker's finish retries (0.2 + 1 + 3 s), so some "
        "finishes go unrecorded and come back with the lease",
    )
    parser.add_argument(
        "--lead-seconds", type=float, default=1.5, help="delivering before the fault starts"
    )
    parser.add_argument(
        "--trail-seconds",
        type=float,
        default=1.5,
        help="the producer keeps enqueueing this long after it clears",
    )
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument(
        "--backlog",
        type=float,
        default=0.25,
        help="fraction enqueued before the worker starts; the rest arrives steadily over the run",
    )
    parser.add_argument("--backend", choices=["trio", "asyncio"], default="trio")
    parser.add_argument(
        "--only", default="read-only,disk-full,locked", help="comma-separated scenarios"
    )
    args = parser.parse_args()
    chosen = [name.strip() for name in args.only.split(",") if name.strip()]
    unknown = [name for name in chosen if name not in FAULTS]
    if unknown:
        parser.error(f"unknown scenario {unknown[0]!r}: choose from {', '.join(FAULTS)}")
    print(
        f"fault drill: {args.dispatches} dispatches per scenario, faults of "
        f"{args.fault_seconds:g}s, backend {args.backend}, concurrency {args.concurrency}",
        flush=True,
    )
    results = []
    for name in chosen:
        with tempfile.TemporaryDirectory(prefix=f"fault-drill-{name}-") as workdir:
            fault = FAULTS[name](Path(workdir))
            try:
                fault.prepare()
            except Unavailable as exc:
                fault.teardown()
                results.append(Figures(name, skipped=str(exc)))
                continue
            try:
                results.append(anyio.run(drill, fault, args, backend=args.backend))
            finally:
                fault.teardown()
        print(f"  {name}: done", flush=True)
    print()
    print_table(results)
    return 1 if any(f.problems for f in results) else 0


if __name__ == "__main__":
    raise SystemExit(main())
