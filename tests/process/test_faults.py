"""Store faults under a running worker: the database made read-only, the disk
full, the database locked by another process past ``busy_timeout``.

In each, the worker logs the error, keeps running, resumes once the fault
clears; nothing committed is lost, no ``(id, attempt)`` is sent twice, an
enqueue during the fault fails cleanly (nothing partial), and
``PRAGMA integrity_check`` is ``ok`` after.

Mechanisms (we run as root, so chmod cannot make a file read-only for us):

- read-only: ``chattr +i`` on the database file and its ``-wal`` file (EPERM
  even through descriptors already open; SQLite says "disk I/O error" to the
  writer that has the file open, "attempt to write a readonly database" to
  one that opens it during the fault). Never on ``-shm``: SQLite writes the
  WAL index through a shared mapping, and a write to a mapping of an
  immutable file kills the process with SIGBUS -- no library can handle that.
- disk full: the database on a 4 MiB tmpfs, filled by a filler file after a
  ``wal_checkpoint(TRUNCATE)`` (so every commit must grow the WAL): SQLITE_FULL,
  "database or disk is full". Deleting the filler clears it.
- locked: a child process holds ``BEGIN EXCLUSIVE`` while the store's
  ``busy_timeout`` is 0.2 s: "database is locked". The child exiting clears it.

Each test skips, naming the reason, when its mechanism is unavailable.
The scale versions with figures are in ``scripts/fault_drill.py``.
"""

from __future__ import annotations

import logging
import os
import re
import signal
import sqlite3
import subprocess
import sys
import time
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from functools import partial
from pathlib import Path
from typing import Protocol

import anyio
import pytest
from anyio.abc import TaskStatus

from trio_dispatch import Delivery, TransportResult, enqueue_dispatch, enqueue_many, open_store
from trio_dispatch.store import Store
from trio_dispatch.worker import DispatchWorker

from ..conftest import RawDB
from ..helpers import chattr, immutable_unavailable, statuses, wait_for, write_config

pytestmark = pytest.mark.anyio

BUSY_TIMEOUT = 0.2
"""The stores' busy_timeout in these tests (the lock outlives it)."""
MIN_FAULT_SECONDS = 0.8
"""Each fault lasts at least this long: past the worker's first finish
retries (0.2 s, then 1 s later), so the retry that lands after clearing it
must record the outcome."""
DUE_DELAY = 0.5
"""Rows committed just before the fault fall due this long after: pending
rows the worker must try (and fail) to claim while the fault lasts."""
TICK = 0.2
TIMEOUT = 2.0  # transport timeout: lease 7 s, past every finish retry
BEFORE, HELD, DUE_IN_FAULT, AFTER = 12, 2, 8, 5
TOTAL = BEFORE + HELD + DUE_IN_FAULT + AFTER

FILLER_CHUNKS = (1 << 16, 1 << 12, 512)


# -- the fault mechanisms ------------------------------------------------------


def fill(directory: Path) -> Path:
    """Write a filler file until the filesystem of ``directory`` is full."""
    filler = directory / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        for size in FILLER_CHUNKS:
            block = bytes(size)
            try:
                while True:
                    os.write(fd, block)
            except OSError as exc:
                if exc.errno != 28:  # ENOSPC
                    raise
    finally:
        os.close(fd)
    return filler


LOCKER = """\
import sqlite3, sys
conn = sqlite3.connect(sys.argv[1], isolation_level=None, timeout=10)
print("ready", flush=True)
sys.stdin.readline()  # "lock"
conn.execute("BEGIN EXCLUSIVE")
print("locked", flush=True)
sys.stdin.read()  # hold the lock until the parent closes our stdin
conn.execute("ROLLBACK")
"""


class Fault(Protocol):
    name: str
    error_text: str
    """What SQLite says to the worker while the fault lasts."""

    def prepare(self) -> None:
        """Anything slow, done before the rows that fall due in the fault."""

    def start(self) -> None: ...

    def clear(self) -> None: ...

    def cleanup(self) -> None:
        """Clear whatever is left, whatever happened (idempotent)."""


class ReadOnly:
    name = "read-only"
    error_text = "disk I/O error"

    def __init__(self, db_path: Path) -> None:
        # Not -shm: see the module docstring (SIGBUS).
        self.files = [db_path, db_path.with_name(db_path.name + "-wal")]

    def prepare(self) -> None:
        pass

    def start(self) -> None:
        assert all(f.exists() for f in self.files), self.files
        done = chattr("+i", *self.files)
        assert done.returncode == 0, done.stderr

    def clear(self) -> None:
        done = chattr("-i", *self.files)
        assert done.returncode == 0, done.stderr

    def cleanup(self) -> None:
        chattr("-i", *[f for f in self.files if f.exists()])


class DiskFull:
    name = "disk full"
    error_text = "database or disk is full"

    def __init__(self, db_path: Path) -> None:
        self.db_path = db_path
        self.filler: Path | None = None

    def prepare(self) -> None:
        pass

    def start(self) -> None:
        # An empty WAL: every commit during the fault must allocate pages.
        conn = sqlite3.connect(self.db_path, timeout=5)
        try:
            conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        finally:
            conn.close()
        self.filler = fill(self.db_path.parent)

    def clear(self) -> None:
        assert self.filler is not None
        self.filler.unlink()
        self.filler = None

    def cleanup(self) -> None:
        (self.db_path.parent / "filler").unlink(missing_ok=True)


class Locked:
    name = "locked"
    error_text = "database is locked"

    def __init__(self, db_path: Path) -> None:
        self.db_path = db_path
        self.child: subprocess.Popen[str] | None = None

    def prepare(self) -> None:
        self.child = subprocess.Popen(
            [sys.executable, "-c", LOCKER, str(self.db_path)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.child.stdout is not None
        assert self.child.stdout.readline().strip() == "ready"

    def start(self) -> None:
        assert self.child is not None and self.child.stdin is not None
        assert self.child.stdout is not None
        self.child.stdin.write("lock\n")
        self.child.stdin.flush()
        assert self.child.stdout.readline().strip() == "locked"

    def clear(self) -> None:
        assert self.child is not None and self.child.stdin is not None
        self.child.stdin.close()
        assert self.child.wait(timeout=10) == 0

    def cleanup(self) -> None:
        if self.child is not None:
            if self.child.poll() is None:
                self.child.kill()
            with self.child:  # closes its pipes and reaps it
                pass


# -- fixtures -------------------------------------------------------------------


@pytest.fixture
def immutable_files(tmp_path: Path) -> None:
    reason = immutable_unavailable(tmp_path)
    if reason is not None:
        pytest.skip(f"read-only fault needs chattr +i: {reason}")


@pytest.fixture
def small_tmpfs(tmp_path: Path) -> Iterator[Path]:
    """A 4 MiB tmpfs mounted for the test, unmounted after it."""
    mount_point = tmp_path / "tmpfs"
    mount_point.mkdir()
    try:
        done = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mount_point)],
            capture_output=True,
            text=True,
            check=False,
        )
    except FileNotFoundError:
        pytest.skip("disk-full fault needs a small tmpfs: mount is not installed")
    if done.returncode != 0:
        pytest.skip(f"disk-full fault needs a small tmpfs: mount failed: {done.stderr.strip()}")
    try:
        yield mount_point
    finally:
        (mount_point / "filler").unlink(missing_ok=True)
        if subprocess.run(["umount", str(mount_point)], check=False).returncode != 0:
            subprocess.run(["umount", "-l", str(mount_point)], check=False)


@pytest.fixture
def fault_case(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[Fault, Path]]:
    """(fault, database path) for ``request.param``; skips when the fault's
    mechanism is unavailable."""
    db_path = tmp_path / "outbox.db"
    fault: Fault
    if request.param == "read-only":
        request.getfixturevalue("immutable_files")
        fault = ReadOnly(db_path)
    elif request.param == "disk full":
        db_path = request.getfixturevalue("small_tmpfs") / "outbox.db"
        fault = DiskFull(db_path)
    else:
        fault = Locked(db_path)
    try:
        yield fault, db_path
    finally:
        fault.cleanup()


# -- the scenario ---------------------------------------------------------------


class Destination:
    """A callable transport that records every send as (id, attempt); rows
    routed to ``hold-*`` wait until :attr:`release` is set, so their attempts
    end while the fault lasts."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, int]] = []
        self.holding = 0
        self.release = anyio.Event()

    async def __call__(self, delivery: Delivery) -> TransportResult:
        if delivery.deliver_to.startswith("hold"):
            self.holding += 1
            await self.release.wait()
        self.sent.append((delivery.dispatch_id, delivery.attempt))
        return TransportResult.success()


async def run_until_cancelled(
    worker: DispatchWorker,
    exits: list[BaseException | None],
    *,
    task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED,
) -> None:
    """``worker.run``, noting how it ended: a worker that stops by itself
    during a fault (crash or return) shows up in ``exits``."""
    try:
        await worker.run(task_status=task_status)
    except BaseException as exc:
        exits.append(exc)
        raise
    exits.append(None)


def messages(caplog: pytest.LogCaptureFixture, text: str) -> list[logging.LogRecord]:
    return [r for r in caplog.records if text in r.getMessage()]


def errors_with(caplog: pytest.LogCaptureFixture, text: str, error: str) -> list[str]:
    return [
        str(r.exc_info[1])
        for r in messages(caplog, text)
        if r.levelno >= logging.ERROR and r.exc_info and error in str(r.exc_info[1])
    ]


def unrecorded_ids(caplog: pytest.LogCaptureFixture) -> set[str]:
    """Dispatches whose attempt ended but whose finish could not be written
    (each is sent again once its lease ends: at least once, by design)."""
    found = set()
    for record in messages(caplog, "result=unrecorded"):
        match = re.match(r"dispatch (\w+) ", record.getMessage())
        assert match, record.getMessage()
        found.add(match.group(1))
    return found


def assert_store_consistent(
    raw: RawDB, committed: list[str], sent: list[tuple[str, int]], redelivery_allowed: set[str]
) -> None:
    """No loss, no (id, attempt) twice, each row's history ends where the row
    is, and the file is sound."""
    assert raw.scalar("PRAGMA integrity_check") == "ok"
    assert raw.rows("PRAGMA foreign_key_check") == []
    rows = {r["id"]: r for r in raw.rows("SELECT id, status, attempt FROM dispatch_outbox")}
    missing = [i for i in committed if i not in rows]
    assert missing == [], f"committed dispatches lost: {missing}"
    assert {rows[i]["status"] for i in committed} == {"delivered"}
    pairs = Counter(sent)
    assert [p for p, n in pairs.items() if n > 1] == [], "an (id, attempt) was sent twice"
    per_id = Counter(i for i, _ in sent)
    assert set(per_id) == set(committed)
    resent = {i for i, n in per_id.items() if n > 1}
    assert resent <= redelivery_allowed, f"sent again though its finish was recorded: {resent}"
    # Each row and its transition were written together (docs/guarantees.md): the last
    # transition names the row's status.
    assert (
        raw.scalar(
            "SELECT COUNT(*) FROM dispatch_outbox o WHERE o.status != (SELECT t.status FROM "
            "status_transitions t WHERE t.entity_id = o.id ORDER BY t.id DESC LIMIT 1)"
        )
        == 0
    )


@asynccontextmanager
async def stores(db_path: Path) -> AsyncIterator[tuple[Store, Store]]:
    """The worker's store, and a producer's: separate connections, so the
    producer's enqueues do not wake the worker (its tick finds them)."""
    async with (
        open_store(db_path, busy_timeout=BUSY_TIMEOUT) as db,
        open_store(db_path, busy_timeout=BUSY_TIMEOUT) as producer,
    ):
        yield db, producer


async def run_fault_scenario(fault: Fault, db_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The shared scenario: a worker delivering, the fault while rows are
    pending and attempts are ending, enqueues tried during it, then cleared."""
    caplog.set_level(logging.INFO, logger="trio_dispatch")
    raw = RawDB(db_path)
    destination = Destination()
    committed: list[str] = []
    exits: list[BaseException | None] = []
    try:
        async with stores(db_path) as (db, producer), anyio.create_task_group() as tg:
            worker = DispatchWorker(
                db,
                transport=destination,
                tick_seconds=TICK,
                concurrency=4,
                timeout_seconds=TIMEOUT,
                grace_seconds=1,
            )
            await tg.start(partial(run_until_cancelled, worker, exits))
            committed += [
                r.id
                for r in await enqueue_many(
                    producer, [{"kind": "hold", "deliver_to": f"hold-{i}"} for i in range(HELD)]
                )
            ]
            committed += [
                r.id
                for r in await enqueue_many(
                    producer, [{"kind": "before", "deliver_to": f"b{i}"} for i in range(BEFORE)]
                )
            ]
            await wait_for(
                lambda: (
                    statuses(raw) == {"delivered": BEFORE, "delivering": HELD}
                    and destination.holding == HELD
                )
            )
            await anyio.to_thread.run_sync(fault.prepare)
            # Pending rows that fall due during the fault, committed with
            # their due time in one transaction (nothing can claim them early).
            async with producer.transaction() as tx:
                due = [
                    r.id
                    for r in await enqueue_many(
                        tx, [{"kind": "due", "deliver_to": f"d{i}"} for i in range(DUE_IN_FAULT)]
                    )
                ]
                await tx.execute(
                    f"UPDATE dispatch_outbox SET next_attempt_at = ? "
                    f"WHERE id IN ({', '.join('?' * len(due))})",
                    (time.time() + DUE_DELAY, *due),
                )
            committed += due
            before = raw.counts()

            await anyio.to_thread.run_sync(fault.start)
            started = time.monotonic()
            destination.release.set()  # the held attempts end now: their finishes fail

            # Enqueues fail cleanly: sqlite3.OperationalError, nothing partial written.
            with pytest.raises(sqlite3.OperationalError, match=fault.error_text):
                await enqueue_dispatch(
                    producer, kind="during", deliver_to="x", dedup_key="during-1"
                )
            with pytest.raises(sqlite3.OperationalError, match=fault.error_text):
                await enqueue_many(
                    producer,
                    [
                        {"kind": "during", "deliver_to": "x", "dedup_key": f"during-{i}"}
                        for i in (2, 3)
                    ],
                )
            # The outbox's point (docs/usage.md): the caller's own write and the
            # dispatch fail together.
            with pytest.raises(sqlite3.OperationalError, match=fault.error_text):
                async with producer.transaction() as tx:
                    await tx.execute(
                        "INSERT INTO sessions (id, created_at) VALUES (?, ?)",
                        ("s-during", time.time()),
                    )
                    await enqueue_dispatch(
                        tx,
                        kind="during",
                        deliver_to="x",
                        session_id="s-during",
                        dedup_key="during-4",
                    )
            assert raw.counts() == before
            assert raw.scalar("SELECT COUNT(*) FROM sessions") == 0

            await wait_for(
                lambda: (
                    errors_with(caplog, "scan failed", fault.error_text)
                    and errors_with(caplog, "recording the outcome failed", fault.error_text)
                ),
                timeout=10,
            )
            await anyio.sleep(max(0.0, MIN_FAULT_SECONDS - (time.monotonic() - started)))
            assert exits == [], "the worker stopped during the fault"
            assert raw.counts() == before
            assert statuses(raw) == {
                "delivered": BEFORE,
                "delivering": HELD,
                "pending": DUE_IN_FAULT,
            }

            await anyio.to_thread.run_sync(fault.clear)
            # The keys tried during the fault were never written: no dedup hit.
            after = await enqueue_many(
                producer,
                [
                    {"kind": "after", "deliver_to": f"a{i}", "dedup_key": f"during-{i}"}
                    for i in range(1, AFTER + 1)
                ],
            )
            assert not any(r.dedup_hit for r in after)
            committed += [r.id for r in after]
            await wait_for(lambda: statuses(raw) == {"delivered": TOTAL}, timeout=15)
            assert exits == []
            tg.cancel_scope.cancel()
    finally:
        fault.cleanup()
    assert len(committed) == TOTAL
    assert worker.counts["delivered"] >= TOTAL
    assert_store_consistent(raw, committed, destination.sent, unrecorded_ids(caplog))


# -- in-process worker, both backends ---------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("fault_case", ["read-only"], indirect=True)
async def test_a_read_only_database_is_logged_survived_and_resumed_after(
    fault_case: tuple[Fault, Path], caplog: pytest.LogCaptureFixture
) -> None:
    await run_fault_scenario(*fault_case, caplog)


@pytest.mark.slow
@pytest.mark.parametrize("fault_case", ["disk full"], indirect=True)
async def test_a_full_disk_is_logged_survived_and_resumed_after(
    fault_case: tuple[Fault, Path], caplog: pytest.LogCaptureFixture
) -> None:
    await run_fault_scenario(*fault_case, caplog)


@pytest.mark.parametrize("fault_case", ["locked"], indirect=True)
async def test_a_lock_held_past_busy_timeout_is_logged_survived_and_resumed_after(
    fault_case: tuple[Fault, Path], caplog: pytest.LogCaptureFixture
) -> None:
    await run_fault_scenario(*fault_case, caplog)


OTHER_PROCESS = """\
import sys, anyio
from trio_dispatch import enqueue_dispatch, open_store

def report(step, exc):
    print(step, type(exc).__module__, type(exc).__name__, exc, sep="|", flush=True)

async def main():
    async with open_store(sys.argv[1], busy_timeout=0.2) as db:
        print("open", flush=True)
        await anyio.to_thread.run_sync(sys.stdin.readline)  # the fault is on
        try:
            await enqueue_dispatch(db, kind="k", deliver_to="other", dedup_key="other-1")
            print("enqueue|ok", flush=True)
        except Exception as exc:
            report("enqueue", exc)
    try:  # a process that opens the store during the fault
        async with open_store(sys.argv[1], busy_timeout=0.2) as db:
            await enqueue_dispatch(db, kind="k", deliver_to="other", dedup_key="other-2")
        print("fresh|ok", flush=True)
    except Exception as exc:
        report("fresh", exc)

anyio.run(main, backend="trio")
"""


@pytest.mark.parametrize("anyio_backend", ["trio"])
@pytest.mark.parametrize("fault_case", ["read-only", "disk full", "locked"], indirect=True)
async def test_an_enqueue_from_another_process_during_a_fault_fails_cleanly(
    fault_case: tuple[Fault, Path],
) -> None:
    fault, db_path = fault_case
    raw = RawDB(db_path)
    async with open_store(db_path) as db:
        await enqueue_dispatch(db, kind="k", deliver_to="seat")
        with subprocess.Popen(
            [sys.executable, "-c", OTHER_PROCESS, str(db_path)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        ) as child:
            try:
                assert child.stdout is not None and child.stdin is not None
                assert await anyio.to_thread.run_sync(child.stdout.readline) == "open\n"
                before = raw.counts()
                await anyio.to_thread.run_sync(fault.prepare)
                await anyio.to_thread.run_sync(fault.start)
                child.stdin.write("go\n")
                child.stdin.flush()
                out, _ = await anyio.to_thread.run_sync(partial(child.communicate, timeout=30))
                assert raw.counts() == before
                await anyio.to_thread.run_sync(fault.clear)
            finally:
                fault.cleanup()
                if child.poll() is None:
                    child.kill()
                    child.wait()
        reports = {line.split("|")[0]: line.split("|")[1:] for line in out.splitlines()}
        assert reports["enqueue"] == ["sqlite3", "OperationalError", fault.error_text]
        # Opened during the fault, a read-only file refuses the first write
        # (the schema check) with SQLITE_READONLY; the others as above. A store
        # that cannot be opened says so in one line (StoreError), quoting the
        # driver's reason.
        fresh = (
            "attempt to write a readonly database"
            if isinstance(fault, ReadOnly)
            else fault.error_text
        )
        module, name, message = reports["fresh"]
        assert fresh in message
        if name == "StoreError":  # failed while opening
            assert module == "trio_dispatch.errors"
            assert message.startswith("cannot open store ")
        else:  # opened (nothing to write), failed at the first write
            assert (module, name) == ("sqlite3", "OperationalError")
        assert (
            raw.scalar("SELECT COUNT(*) FROM dispatch_outbox WHERE dedup_key LIKE 'other-%'") == 0
        )
        await enqueue_dispatch(db, kind="k", deliver_to="seat")  # writable again
    assert raw.counts()[0] == 2
    assert raw.scalar("PRAGMA integrity_check") == "ok"


# -- the worker process (`python -m trio_dispatch worker`) --------------------------


RECORD = 'printf "%s %s\\n" "$TRIO_DISPATCH_ID" "$TRIO_DISPATCH_ATTEMPT" >> "$0"'


def start_worker_process(config: Path, log_file: Path) -> subprocess.Popen[bytes]:
    # stderr to a file: the fault makes it log a traceback every tick, which
    # would fill an unread pipe and stall the worker.
    with open(log_file, "wb") as log:
        return subprocess.Popen(
            [sys.executable, "-m", "trio_dispatch", "--config", str(config), "worker"],
            stdout=subprocess.DEVNULL,
            stderr=log,
        )


@pytest.mark.slow
@pytest.mark.parametrize("anyio_backend", ["trio"])
@pytest.mark.parametrize("fault_case", ["read-only", "disk full"], indirect=True)
async def test_the_worker_process_logs_a_fault_keeps_running_and_resumes(
    tmp_path: Path, fault_case: tuple[Fault, Path]
) -> None:
    fault, db_path = fault_case
    raw = RawDB(db_path)
    sent_file = tmp_path / "sent.txt"
    sent_file.touch()
    config = write_config(
        tmp_path,
        db_path,
        ["/bin/sh", "-c", RECORD, str(sent_file)],
        tick_seconds=TICK,
        timeout=TIMEOUT,
    )
    log_file = tmp_path / "worker.log"
    committed: list[str] = []
    async with open_store(db_path) as producer:
        committed += [
            r.id
            for r in await enqueue_many(
                producer, [{"kind": "before", "deliver_to": f"b{i}"} for i in range(5)]
            )
        ]
    worker = start_worker_process(config, log_file)
    try:
        await wait_for(lambda: statuses(raw) == {"delivered": 5}, timeout=20)
        async with open_store(db_path) as producer:
            async with producer.transaction() as tx:
                due = [
                    r.id
                    for r in await enqueue_many(
                        tx, [{"kind": "due", "deliver_to": f"d{i}"} for i in range(5)]
                    )
                ]
                await tx.execute(
                    f"UPDATE dispatch_outbox SET next_attempt_at = ? "
                    f"WHERE id IN ({', '.join('?' * len(due))})",
                    (time.time() + DUE_DELAY, *due),
                )
            committed += due
            before = raw.counts()
            try:
                await anyio.to_thread.run_sync(fault.start)
                with pytest.raises(sqlite3.OperationalError, match=fault.error_text):
                    await enqueue_dispatch(producer, kind="during", deliver_to="x")
                await wait_for(lambda: log_file.read_text().count("scan failed") >= 2, timeout=10)
                assert worker.poll() is None, "the worker process died during the fault"
                assert raw.counts() == before
                await anyio.to_thread.run_sync(fault.clear)
            finally:
                fault.cleanup()
            committed += [
                r.id
                for r in await enqueue_many(
                    producer, [{"kind": "after", "deliver_to": f"a{i}"} for i in range(5)]
                )
            ]
        await wait_for(lambda: statuses(raw) == {"delivered": 15}, timeout=15)
        assert worker.poll() is None
        worker.send_signal(signal.SIGTERM)
        assert await anyio.to_thread.run_sync(partial(worker.wait, timeout=15)) == 0
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.wait()
    log = log_file.read_text()
    assert "scan failed; retrying in" in log and fault.error_text in log, log[-2000:]
    assert "Traceback" in log  # logged with its exception, not swallowed
    sent = [
        (i, int(a)) for i, a in (line.split() for line in sent_file.read_text().split("\n") if line)
    ]
    assert_store_consistent(raw, committed, sent, redelivery_allowed=set())
