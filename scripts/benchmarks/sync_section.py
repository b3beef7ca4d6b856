"""Section ``sync``: enqueue through the caller's own connection
(``trio_dispatch.sync``, and one unit of work on our store) beside the same transaction
without it, on SQLite and PostgreSQL, and the latency from another
process's commit to our worker's transport start.

Named so as not to read as ``trio_dispatch.sync``, the module it measures.
"""

from __future__ import annotations

import itertools
import json
import sqlite3
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Final, cast

import anyio

from trio_dispatch import (
    Delivery,
    DispatchWorker,
    open_store,
    sync,
)
from trio_dispatch.outbox.enqueue import EnqueueCall
from trio_dispatch.outbox.inserts import insert_new
from trio_dispatch.store.base import Conn
from trio_dispatch.store.dialect import POSTGRES
from trio_dispatch.store.pg_session import placeholders

from .harness import (
    BODY,
    BODY_JSON,
    ROOT,
    TURNS,
    WARMUP,
    Bench,
    Figure,
    Outcome,
    Pairs,
    Side,
    at_most,
    interleave,
    percentile,
    sync_side,
)
from .pgserver import fresh_postgres, postgres_database
from .workloads import APP_INSERT, APP_TABLE, raw_caller_tx


def sync_tx_rates(raw_path: Path, sync_path: Path, n: int, turns: int = TURNS) -> list[float]:
    """Transactions/s of the caller's own sqlite3 connection (WAL,
    synchronous=FULL), interleaved: one business INSERT and a commit, and the
    same with ``sync.enqueue_dispatch`` of the payload before the commit."""
    conns = []
    for path, install in ((raw_path, False), (sync_path, True)):
        conn = sqlite3.connect(path)
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("PRAGMA synchronous=FULL")
        conn.execute(APP_TABLE)
        if install:
            sync.install_schema(conn)
        conn.commit()
        conns.append(conn)
    plain, with_outbox = conns
    serial = itertools.count()

    def side(conn: sqlite3.Connection, enqueue: bool) -> Side:
        def run(count: int) -> None:
            for _ in range(count):
                with conn:
                    conn.execute(APP_INSERT, (f"order-{next(serial)}", BODY_JSON, time.time()))
                    if enqueue:
                        sync.enqueue_dispatch(
                            conn, kind="order.created", deliver_to="seat-1", body=BODY
                        )

        return sync_side(run)

    async def both() -> list[float]:
        return await interleave([side(plain, False), side(with_outbox, True)], n, turns)

    try:
        result: list[float] = anyio.run(both)
        return result
    finally:
        for conn in conns:
            conn.close()


async def unit_rates(raw_path: Path, unit_path: Path, n: int, turns: int = TURNS) -> list[float]:
    """Transactions/s, interleaved: raw sqlite3 (BEGIN IMMEDIATE; one INSERT;
    COMMIT) and one unit of work on a store holding the same INSERT and a
    ``sync.enqueue_dispatch`` (``await db.write(unit)``: one hop, one
    group commit)."""
    conn, raw = raw_caller_tx(raw_path)
    serial = itertools.count()  # order ids of our side (a file of its own)

    try:
        async with open_store(unit_path) as db:
            async with db.transaction() as tx:
                await tx.execute(APP_TABLE)

            def place(conn: Any) -> str:
                conn.execute(APP_INSERT, (f"order-{next(serial)}", BODY_JSON, time.time()))
                return sync.enqueue_dispatch(
                    conn, kind="order.created", deliver_to="seat-1", body=BODY
                )

            async def units(count: int) -> None:
                for _ in range(count):
                    await db.write(place)

            return await interleave([sync_side(raw), units], n, turns)
    finally:
        conn.close()


def pg_sync_tx_rates(url: str, n: int, turns: int = TURNS) -> list[float]:
    """Transactions/s of the caller's own psycopg connection, interleaved:
    one business INSERT and a commit; the same with
    ``sync.enqueue_dispatch`` before the commit; and the same with a bare
    ``SELECT 1`` instead -- one more round trip, the floor of any enqueue
    that goes to the server; and the same with the enqueue's own statements
    sent bare -- SAVEPOINT, the statement (row, history, NOTIFY) and RELEASE
    in one pipelined round trip, its parameters built beforehand -- the
    floor of an enqueue that keeps the caller's transaction usable after a
    failure (the server's work without ours)."""
    import psycopg

    table = APP_TABLE.replace("INTEGER PRIMARY KEY", "BIGSERIAL PRIMARY KEY")
    insert = APP_INSERT.replace("?", "%s")
    conn = psycopg.connect(url)
    conn.execute(table)
    sync.install_schema(conn)
    conn.commit()
    serial = itertools.count()

    def side(extra: str) -> Side:
        def run(count: int) -> None:
            for _ in range(count):
                with conn.transaction():
                    conn.execute(insert, (f"order-{next(serial)}", BODY_JSON, time.time()))
                    if extra == "enqueue":
                        sync.enqueue_dispatch(
                            conn, kind="order.created", deliver_to="seat-1", body=BODY
                        )
                    elif extra == "round trip":
                        conn.execute("SELECT 1")
                    elif extra == "statement":
                        statement, params = next(bare)
                        with conn.pipeline():
                            conn.execute("SAVEPOINT bare")
                            conn.execute(statement, params)
                            conn.execute("RELEASE SAVEPOINT bare")

        return sync_side(run)

    bare = iter([enqueue_statement() for _ in range(n + 2 * WARMUP)])

    async def both() -> list[float]:
        sides = [side(""), side("enqueue"), side("round trip"), side("statement")]
        return await interleave(sides, n, turns)

    try:
        result: list[float] = anyio.run(both)
        return result
    finally:
        conn.close()


class _Recorder:
    """A connection that keeps the one statement an enqueue sends unread."""

    dialect = POSTGRES

    def __init__(self) -> None:
        self.sent: tuple[str, tuple[Any, ...]] | None = None

    def send(self, sql: str, params: Sequence[Any] = ()) -> None:
        self.sent = (placeholders(sql), tuple(params))


def enqueue_statement() -> tuple[str, tuple[Any, ...]]:
    """The statement and parameters ``sync.enqueue_dispatch`` sends for the
    bench's row on PostgreSQL (a plain row: one statement, sent unread)."""
    recorder = _Recorder()
    with EnqueueCall() as call:
        new = call.new({"kind": "order.created", "deliver_to": "seat-1", "body": BODY})
        insert_new(cast(Conn, recorder), new, time.time())
    assert recorder.sent is not None
    return recorder.sent


CROSS_PRODUCER: Final = """
import json, sys, time
sys.path.insert(0, sys.argv[1])
from trio_dispatch import sync
target, n = sys.argv[2], int(sys.argv[3])
if target.startswith("postgresql"):
    import psycopg
    conn = psycopg.connect(target)
else:
    import sqlite3
    conn = sqlite3.connect(target)
print("ready", flush=True)
sys.stdin.readline()
for i in range(n):
    dispatch_id = sync.enqueue_dispatch(conn, kind="cross", deliver_to=f"seat-{i}")
    conn.commit()
    print(json.dumps([dispatch_id, time.time()]), flush=True)
    time.sleep(0.05)
"""


async def cross_process_latency(target: str, n: int, tick: float) -> list[float]:
    """Seconds from another process's commit (an enqueue through its own
    connection) to the start of our worker's transport, for ``n`` commits
    50 ms apart; the worker's tick is ``tick`` (it must not be what wakes
    it)."""
    started: dict[str, float] = {}

    async def send(delivery: Delivery) -> None:
        started[delivery.dispatch_id] = time.time()

    async with open_store(target):
        pass
    committed: dict[str, float] = {}
    async with open_store(target) as db, anyio.create_task_group() as tg:
        await tg.start(DispatchWorker(db, transport=send, tick_seconds=tick).run)
        producer = subprocess.Popen(
            [sys.executable, "-c", CROSS_PRODUCER, str(ROOT), target, str(n)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert producer.stdin is not None and producer.stdout is not None
        assert await anyio.to_thread.run_sync(producer.stdout.readline) == "ready\n"
        await anyio.sleep(0.3)  # the worker idles, listening
        producer.stdin.write("go\n")
        producer.stdin.flush()
        for line in await anyio.to_thread.run_sync(producer.stdout.readlines):
            dispatch_id, at = json.loads(line)
            committed[dispatch_id] = at
        producer.wait()
        with anyio.fail_after(30):
            while len(started) < len(committed):
                await anyio.sleep(0.01)
        tg.cancel_scope.cancel()
    return sorted(started[key] - at for key, at in committed.items())


def run_sync(bench: Bench) -> Outcome:
    """Enqueue through the caller's own connection (docs/usage.md#use-your-own-connection): its
    cost in the caller's transaction on both engines, a whole transaction as
    one unit of our group commit, and how soon a worker wakes for another
    process's commit."""
    scale, at, go = bench.scale, bench.at, bench.go
    n_tx = 400 * scale
    pairs = Pairs()
    notes: list[str] = []
    figures: list[Figure] = []
    pg = postgres_database()
    try:
        for _ in range(bench.rounds):
            raw, with_outbox = sync_tx_rates(at("sync-raw"), at("sync-enqueue"), n_tx)
            pairs.add("sync-sqlite", with_outbox, raw)
            raw, unit = go(unit_rates, at("unit-raw"), at("unit"), n_tx)
            pairs.add("unit", unit, raw)
            if pg is not None:
                raw, with_outbox, round_trip, bare = pg_sync_tx_rates(fresh_postgres(pg[0]), n_tx)
                pairs.add("sync-pg", with_outbox, raw)
                pairs.add("sync-pg-floor", round_trip, raw)
                pairs.add("sync-pg-statement", bare, raw)
                pairs.add("sync-pg-ours-vs-statement", with_outbox, bare)
        figures.append(
            pairs.figure(
                "sync-sqlite",
                "caller's sqlite3 tx + sync.enqueue_dispatch, vs without",
                "/s",
                f"the caller's own sqlite3 connection (WAL, synchronous=FULL): `with conn:` "
                f"one INSERT of a {len(BODY_JSON)}-byte row; ours adds "
                f"`sync.enqueue_dispatch(conn, ...)` of the same payload to each; "
                f"{n_tx // TURNS} transactions a turn, {TURNS} turns in rotation, the median",
                0.80,
                "same tx without enqueue",
                "sync",
            )
        )
        figures.append(
            pairs.figure(
                "unit",
                "one unit of work (INSERT + sync.enqueue), vs raw sqlite3 tx",
                "/s",
                "raw sqlite3 BEGIN IMMEDIATE; one INSERT; COMMIT (WAL, FULL); ours: `await "
                "db.write(unit)` where the unit runs the same INSERT and "
                "`sync.enqueue_dispatch(conn, ...)` on the store's connection (one hop to "
                "the writer's thread, one group commit)",
                0.65,
                "raw sqlite3 tx",
                "sync",
            )
        )
        if pg is not None:
            figures.append(
                pairs.figure(
                    "sync-pg",
                    "caller's psycopg tx + sync.enqueue_dispatch, vs without",
                    "/s",
                    "the caller's own psycopg connection: `with conn.transaction():` one "
                    "INSERT; ours adds `sync.enqueue_dispatch(conn, ...)` (one statement: "
                    "the row, its transition and the NOTIFY in a data-modifying WITH, "
                    "pipelined with its SAVEPOINT and RELEASE: one round trip) to each",
                    0.75,
                    "same tx without enqueue",
                    "sync",
                )
            )
            figures.append(
                pairs.figure(
                    "sync-pg-floor",
                    "the floor: the same psycopg tx + one `SELECT 1`, vs without",
                    "/s",
                    "the same transaction with one bare `SELECT 1` round trip added: what "
                    "any enqueue that waits on the server costs at least, measured in the "
                    "same turns",
                    0.0,
                    "same tx without it",
                    "sync",
                    target="(a floor)",
                )
            )
            figures.append(
                pairs.figure(
                    "sync-pg-statement",
                    "the floor: the same tx + the enqueue's statements sent bare, vs without",
                    "/s",
                    "the same transaction with the enqueue's SAVEPOINT, statement and "
                    "RELEASE in one pipelined round trip, parameters built beforehand: the "
                    "server's work for the row, its history, the NOTIFY and the savepoint",
                    0.0,
                    "same tx without it",
                    "sync",
                    target="(a floor)",
                )
            )
            figures.append(
                pairs.figure(
                    "sync-pg-ours-vs-statement",
                    "caller's psycopg tx + sync.enqueue_dispatch, vs the bare statements",
                    "/s",
                    "ours beside the floor above: what the library's own work (checks, "
                    "the envelope, the adapter) costs on top of the server's",
                    0.0,
                    "same tx + bare statements",
                    "sync",
                    target="(our share)",
                )
            )
        n_lat = 60 if bench.quick else 200
        targets = [("SQLite", str(at("cross")), 0.060)]
        if pg is not None:
            targets.append(("PostgreSQL", fresh_postgres(pg[0]), 0.010))
        for engine, target, limit in targets:
            samples = go(cross_process_latency, target, n_lat, 30.0)
            for label, fraction in (("p50", 0.5), ("p99", 0.99)):
                value = percentile(samples, fraction) * 1000
                figures.append(
                    Figure(
                        f"{engine}: another process's commit -> transport start {label}",
                        [value],
                        "ms",
                        [30_000.0],
                        "the worker's tick (30 s)",
                        f"<= {limit * 1000:g} ms",
                        at_most(limit * 1000),
                        "tick",
                        "sync",
                    )
                )
            notes.append(
                f"{engine} cross-process latency: {n_lat} commits 50 ms apart by another "
                f"process through its own connection (sync.enqueue_dispatch + commit); a "
                f"worker with a 30 s tick, woken by "
                + (
                    "PRAGMA data_version, polled every 25 ms"
                    if engine == "SQLite"
                    else "LISTEN/NOTIFY"
                )
            )
    finally:
        if pg is not None:
            pg[1]()
    if pg is None:
        notes.append("sync: no PostgreSQL server answered; its figures were skipped")
    return Outcome(figures, notes)
