"""SQLite: a store's writer beside another process that writes without pause."""

from __future__ import annotations

import statistics
import subprocess
import sys
import time
from pathlib import Path

import anyio
import pytest

from trio_dispatch import enqueue_dispatch, open_store
from trio_dispatch.store import SQLiteStore
from trio_dispatch.store.schema import SCHEMA_VERSION

pytestmark = [pytest.mark.anyio, pytest.mark.sqlite_only]

HOLD = 0.04
GAP = 0.008
BUSY_WRITER = f"""
import sqlite3, sys, time
conn = sqlite3.connect(sys.argv[1], isolation_level=None, timeout=30)
first = True
ends = time.monotonic() + 30
while time.monotonic() < ends:
    conn.execute("BEGIN IMMEDIATE")
    if first:
        print("holding", flush=True)
        first = False
    time.sleep({HOLD})
    conn.execute("COMMIT")
    time.sleep({GAP})
"""
"""Another process's writer: holds the write lock 40 ms, lets it go for 8 ms,
takes it again (as a busy worker's transactions follow each other)."""


async def test_a_write_gets_in_between_another_process_s_back_to_back_transactions(
    store: SQLiteStore, db_path: Path
) -> None:
    # SQLite's own busy handler sleeps 1, 2, 5, 10 ... 100 ms between
    # tries and keeps missing 8 ms gaps; the store tries every 0.5 ms.
    child = subprocess.Popen(
        [sys.executable, "-c", BUSY_WRITER, str(db_path)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert child.stdout is not None
        assert await anyio.to_thread.run_sync(child.stdout.readline) == "holding\n"
        waits = []
        for n in range(20):
            started = time.monotonic()
            await enqueue_dispatch(store, kind="k", deliver_to=f"d{n}")
            waits.append(time.monotonic() - started)
            await anyio.sleep(0.011)
    finally:
        child.kill()
        child.wait()
        assert child.stdout is not None
        child.stdout.close()
    # Each waits for the transaction it found running at most (40 ms, and
    # its own commit); SQLite's handler alone gave a median of about one
    # transaction and a worst wait of several.
    assert statistics.median(waits) < HOLD + GAP + 0.03, waits
    assert sorted(waits)[-2] < 2 * (HOLD + GAP) + 0.05, waits
    assert store.stats["batches"] >= 20


async def test_a_store_opens_on_a_current_file_while_another_process_holds_the_write_lock(
    store: SQLiteStore, db_path: Path
) -> None:
    # The file is current (the fixture's store made it): opening another
    # store for writes reads its version and takes no write lock, so it
    # does not wait for the other process's transaction to end.
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sqlite3, sys, time\n"
            "conn = sqlite3.connect(sys.argv[1], isolation_level=None)\n"
            "conn.execute('BEGIN IMMEDIATE')\n"
            "print('holding', flush=True)\n"
            "time.sleep(30)\n",
            str(db_path),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "holding"
        started = time.monotonic()
        async with open_store(str(db_path), busy_timeout=5) as other:
            assert isinstance(other, SQLiteStore)
            assert other.found_schema_version == SCHEMA_VERSION
        assert time.monotonic() - started < 2.5  # not the busy timeout's 5 s
    finally:
        holder.kill()
        holder.communicate()
