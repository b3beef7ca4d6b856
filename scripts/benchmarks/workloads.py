"""Measurements more than one section takes: our enqueue (one by one,
concurrent, ``enqueue_many``), in-process deliveries (a worker draining a
store), one claim timed, two stores measured taking turns, a caller's own
table and its raw sqlite3 transaction, the fresh stores of each engine, and
the file helpers of the sections that build big stores.
"""

from __future__ import annotations

import itertools
import os
import sqlite3
import statistics
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from pathlib import Path
from typing import Any, Final

import anyio

from trio_dispatch import (
    Delivery,
    DispatchWorker,
    enqueue_dispatch,
    enqueue_many,
    open_store,
)
from trio_dispatch.outbox import claim_due
from trio_dispatch.store import Store

from .harness import BODY_JSON, Bench, Side
from .pgserver import fresh_postgres, postgres_database

APP_TABLE: Final = (
    "CREATE TABLE IF NOT EXISTS app_orders (id INTEGER PRIMARY KEY, ref TEXT NOT NULL, "
    "body TEXT NOT NULL, created_at FLOAT NOT NULL)"
)
APP_INSERT: Final = "INSERT INTO app_orders (ref, body, created_at) VALUES (?, ?, ?)"
"""A caller's own table and the one row its transaction writes."""


def raw_caller_tx(raw_path: str) -> tuple[sqlite3.Connection, Callable[[int], None]]:
    """The raw baseline of a caller's transaction: a sqlite3 connection (WAL,
    FULL) on its own file, and ``raw(count)`` running that many BEGIN
    IMMEDIATE; one INSERT of the 500-byte row; COMMIT."""
    conn = sqlite3.connect(raw_path, isolation_level=None)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("PRAGMA synchronous=FULL")
    conn.execute(APP_TABLE)
    serial = itertools.count()

    def raw(count: int) -> None:
        for _ in range(count):
            conn.execute("BEGIN IMMEDIATE")
            conn.execute(APP_INSERT, (f"order-{next(serial)}", BODY_JSON, time.time()))
            conn.execute("COMMIT")

    return conn, raw


def enqueue_side(db: Store, body: dict[str, Any] | None, per_call: int = 1) -> Side:
    """Our enqueues on ``db``: ``enqueue_dispatch`` one by one, or
    ``enqueue_many`` of ``per_call`` items (a side's count is then rows)."""
    serial = itertools.count()

    async def side(count: int) -> None:
        if per_call == 1:
            for _ in range(count):
                await enqueue_dispatch(
                    db, kind="bench", deliver_to=f"seat-{next(serial)}", body=body
                )
            return
        for offset in range(0, count, per_call):
            await enqueue_many(
                db,
                [
                    {"kind": "bench", "deliver_to": f"seat-{next(serial)}", "body": body}
                    for _ in range(min(per_call, count - offset))
                ],
            )

    return side


async def ours_single_enqueue(
    path: Path | str, n: int, body: dict[str, Any] | None = None, warmup: int = 0
) -> float:
    async with open_store(path) as db:
        start = time.perf_counter()
        for i in range(warmup + n):
            if i == warmup:
                start = time.perf_counter()
            await enqueue_dispatch(db, kind="bench", deliver_to=f"seat-{i}", body=body)
        return n / (time.perf_counter() - start)


async def ours_concurrent_enqueue(
    path: Path | str,
    n: int,
    producers: int,
    body: dict[str, Any] | None = None,
    warmup: int = 0,
) -> float:
    async with open_store(path) as db:
        for i in range(warmup):
            await enqueue_dispatch(db, kind="bench", deliver_to=f"warm-{i}", body=body)

        async def producer(k: int) -> None:
            for i in range(n // producers):
                await enqueue_dispatch(db, kind="bench", deliver_to=f"seat-{k}-{i}", body=body)

        start = time.perf_counter()
        async with anyio.create_task_group() as tg:
            for k in range(producers):
                tg.start_soon(producer, k)
        return (n // producers * producers) / (time.perf_counter() - start)


async def ours_enqueue_many(path: Path | str, n: int, body: dict[str, Any] | None = None) -> float:
    async with open_store(path) as db:
        start = time.perf_counter()
        for offset in range(0, n, 1000):
            await enqueue_many(
                db,
                [
                    {"kind": "bench", "deliver_to": f"seat-{offset + i}", "body": body}
                    for i in range(min(1000, n - offset))
                ],
            )
        return n / (time.perf_counter() - start)


async def fill_ours(target: Path | str, n: int, body: dict[str, Any] | None = None) -> None:
    """Enqueue ``n`` dispatches, 1,000 per ``enqueue_many`` (untimed setup)."""
    async with open_store(target) as db:
        for offset in range(0, n, 1000):
            await enqueue_many(
                db,
                [
                    {"kind": "bench", "deliver_to": f"s{offset + i}", "body": body}
                    for i in range(min(1000, n - offset))
                ],
            )


async def ours_deliveries(
    path: Path | str,
    n: int,
    transport: Any,
    concurrency: int,
    batch_size: int = 100,
    body: dict[str, Any] | None = None,
) -> float:
    """Deliveries/s of a worker draining ``n`` rows :func:`fill_ours` wrote."""
    await fill_ours(path, n, body)
    return await drain_rate(path, n, concurrency, transport=transport, batch_size=batch_size)


async def drain_rate(
    target: Path | str,
    n: int,
    concurrency: int,
    *,
    transport: Any = None,
    batch_size: int = 100,
    **options: Any,
) -> float:
    """Deliveries/s of a worker (its ``options`` beside these) taking ``n``
    rows out of the store as it is; each delivery awaits ``transport``
    (None: nothing) and is counted, the clock stopping at the ``n``-th."""
    done = 0
    finished = anyio.Event()

    async def counting(delivery: Delivery) -> None:
        nonlocal done
        if transport is not None:
            await transport(delivery)
        done += 1
        if done == n:
            finished.set()

    async with open_store(target) as db:
        worker = DispatchWorker(
            db,
            transport=counting,
            concurrency=concurrency,
            batch_size=batch_size,
            tick_seconds=3600,
            **options,
        )
        return n / await seconds_until(worker, finished.wait)


async def seconds_until(worker: DispatchWorker, done: Callable[[], Awaitable[object]]) -> float:
    """Seconds from ``worker``'s start until ``done()`` returns; then the
    worker stops."""
    async with anyio.create_task_group() as tg:
        start = time.perf_counter()
        await tg.start(worker.run)
        await done()
        elapsed = time.perf_counter() - start
        tg.cancel_scope.cancel()
    return elapsed


async def claim_ms(db: Store, limit: int, **options: Any) -> float:
    """One ``claim_due`` of ``limit`` rows (its ``options`` beside), in
    milliseconds; then (untimed) its rows go back to pending as they were
    (their head starts kept). A claim of fewer rows is a RuntimeError."""
    started = time.perf_counter()
    claims, _ = await claim_due(db, limit=limit, **options)
    elapsed = time.perf_counter() - started
    if len(claims) != limit:
        raise RuntimeError(f"the claim took {len(claims)} rows, not {limit}")
    ids = [(claim.dispatch_id,) for claim in claims]
    await db.write(
        lambda conn: conn.executemany(
            "UPDATE dispatch_outbox SET status = 'pending', attempt = 0, "
            "next_attempt_at = created_at WHERE id = ?",
            ids,
        )
    )
    return elapsed * 1000


async def taking_turns(
    first: str, second: str, measure: Callable[[Store], Awaitable[float]], turns: int
) -> tuple[float, float]:
    """The median of ``measure`` on each of two stores open side by side,
    the two taking turns (each measured once, untimed, first)."""
    times: dict[str, list[float]] = {first: [], second: []}
    async with open_store(first) as one, open_store(second) as other:
        stores = [(first, one), (second, other)]
        for _, db in stores:
            await measure(db)  # warm
        for turn in range(turns):
            for name, db in stores if turn % 2 else stores[::-1]:
                times[name].append(await measure(db))
    return statistics.median(times[first]), statistics.median(times[second])


async def noop(delivery: Delivery) -> None:
    pass


def flush_file(path: Path) -> None:
    """fsync a file built without fsync, so the kernel's writeback of it
    does not run into the timed part (a page being written back stalls
    SQLite's checkpoint into it)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


async def make_schema(path: Path | str) -> None:
    async with open_store(path):
        pass


class Engine:
    """Fresh stores of one engine, their tables made: SQLite files in the
    run's scratch directory, or the PostgreSQL databases ``urls`` emptied
    before each use."""

    def __init__(self, bench: Bench, name: str, section: str, urls: list[str]) -> None:
        self.bench, self.name, self.section, self.urls = bench, name, section, urls

    @classmethod
    def available(
        cls, bench: Bench, section: str, databases: int
    ) -> tuple[list[Engine], list[Callable[[], None]], list[str]]:
        """SQLite, and PostgreSQL when ``databases`` throwaway databases could
        be made: the engines, what drops each database made (call them when
        done) and the section's note when PostgreSQL is skipped."""
        made = [db for db in (postgres_database() for _ in range(databases)) if db is not None]
        found = [cls(bench, "SQLite", section, [])]
        notes = []
        if len(made) == databases:
            found.append(cls(bench, "PostgreSQL", section, [url for url, _ in made]))
        else:
            notes.append(f"{section} section: PostgreSQL skipped, no server answered")
        return found, [drop for _, drop in made], notes

    def fresh(self, which: int = 0) -> str:
        """A fresh store: of the ``which``-th database on PostgreSQL."""
        if self.urls:
            target = fresh_postgres(self.urls[which])
        else:
            target = str(self.bench.at(f"{self.section}{which}"))
        self.bench.go(make_schema, target)
        return target


ROW_COLUMNS: Final = ("id", "kind", "deliver_to", "payload", "status", "attempt")
"""The columns the rows of every section's :func:`load_rows` begin with."""


def load_rows(
    target: str, columns: Sequence[str], rows: Iterable[Sequence[Any]], *, analyze: bool
) -> None:
    """Write ``rows`` (values of ``columns``) straight into ``dispatch_outbox``
    with the engine's own driver (COPY on PostgreSQL, then VACUUM ANALYZE;
    one transaction on SQLite, then ANALYZE if ``analyze``: SQLite never
    gathers statistics by itself)."""
    names = ", ".join(columns)
    if target.startswith("postgres"):
        import psycopg

        with psycopg.connect(target, autocommit=True) as conn:
            with (
                conn.cursor() as cursor,
                cursor.copy(f"COPY dispatch_outbox ({names}) FROM STDIN") as copy,
            ):
                for row in rows:
                    copy.write_row(row)
            conn.execute("VACUUM ANALYZE dispatch_outbox")
        return
    marks = ", ".join("?" * len(columns))
    conn = sqlite3.connect(target, isolation_level=None)
    try:
        conn.execute("BEGIN")
        conn.executemany(f"INSERT INTO dispatch_outbox ({names}) VALUES ({marks})", rows)
        conn.execute("COMMIT")
        if analyze:
            conn.execute("ANALYZE")
    finally:
        conn.close()
