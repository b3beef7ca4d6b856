"""Section ``postgres``: PostgreSQL beside raw psycopg, pgqueuer and
Python's Oban (enqueue from one and from many producers; worker processes
draining a queue, ours at the default concurrency, 16, and at 64); the cost
account of each; the PostgreSQL row of the engines table. Skipped, with a
note, when no server answers.
"""

from __future__ import annotations

import functools
import itertools
import statistics
import sys
import time
from typing import Final

import anyio

from trio_dispatch import (
    open_store,
)
from trio_dispatch.signal import dispatch_envelope_json, uuid7_bytes

from .harness import (
    BODY,
    BODY_JSON,
    TURNS,
    WARMUP,
    Bench,
    Outcome,
    Pairs,
    interleave,
    median_of_turns,
    sync_side,
    version_of,
)
from .oban_side import oban_account_child, oban_processes, oban_python, oban_version
from .pgaccount import run_account
from .pgserver import fresh_postgres, postgres_database
from .processes import Drained, drain_with_processes, ours_processes
from .workloads import enqueue_side, ours_concurrent_enqueue

PGQ_CHILD = """
import asyncio, sys
import asyncpg
from pgqueuer import PgQueuer
from pgqueuer.types import QueueExecutionMode
async def main():
    conn = await asyncpg.connect(sys.argv[1])
    pgq = PgQueuer.from_asyncpg_connection(conn)
    @pgq.entrypoint("bench")
    async def bench(job):
        pass
    print("ready", flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
    await pgq.run(mode=QueueExecutionMode.drain)
    await conn.close()
asyncio.run(main())
"""
"""A pgqueuer worker: ``PgQueuer`` on one asyncpg connection, a no-op
entrypoint, ``run()`` with its defaults but ``mode=drain`` (it stops once
the queue is empty)."""


async def pg_raw_and_ours_single(url: str, n: int) -> list[float]:
    """Rows/s of one producer, interleaved: plain psycopg (an INSERT of an
    outbox-shaped row -- the envelope of the payload our enqueue stores --
    and a COMMIT per row) and our ``enqueue_dispatch``, on one database."""
    import psycopg

    serial = itertools.count()
    with psycopg.connect(url) as conn:
        conn.execute(
            "CREATE TABLE raw_t (id TEXT PRIMARY KEY, payload JSON NOT NULL, "
            "status TEXT NOT NULL, attempt INTEGER NOT NULL, next_at DOUBLE PRECISION NOT NULL)"
        )
        conn.commit()

        def raw(count: int) -> None:
            for _ in range(count):
                dispatch_id = uuid7_bytes().hex()
                payload = dispatch_envelope_json(
                    dispatch_id=dispatch_id,
                    kind="bench",
                    deliver_to=f"seat-{next(serial)}",
                    ack_token=None,
                    body_json=BODY_JSON,
                )
                conn.execute(
                    "INSERT INTO raw_t VALUES (%s, %s, 'pending', 0, %s)",
                    (dispatch_id, payload, time.time()),
                )
                conn.commit()

        async with open_store(url) as db:
            return await interleave([sync_side(raw), enqueue_side(db, BODY)], n)


async def pgq_install(url: str) -> None:
    """pgqueuer's schema, as ``pgq install`` makes it (``Queries.install``)."""
    import asyncpg
    from pgqueuer import Queries
    from pgqueuer.db import AsyncpgDriver

    conn = await asyncpg.connect(url)
    try:
        await Queries(AsyncpgDriver(conn)).install()
    finally:
        await conn.close()


async def pgq_concurrent_enqueue(url: str, n: int, producers: int) -> float:
    """Jobs/s of ``producers`` asyncio tasks each awaiting ``Queries.enqueue``
    of one job, over one asyncpg pool (asyncpg's default size, 10)."""
    import asyncpg
    from pgqueuer import Queries
    from pgqueuer.db import AsyncpgPoolDriver

    await pgq_install(url)
    payload = BODY_JSON.encode()
    async with asyncpg.create_pool(url) as pool:
        queries = Queries(AsyncpgPoolDriver(pool))
        for _ in range(WARMUP):
            await queries.enqueue("bench", payload)

        async def producer() -> None:
            for _ in range(n // producers):
                await queries.enqueue("bench", payload)

        start = time.perf_counter()
        async with anyio.create_task_group() as tg:
            for _ in range(producers):
                tg.start_soon(producer)
        return (n // producers * producers) / (time.perf_counter() - start)


async def pgq_fill(url: str, n: int) -> None:
    """pgqueuer's schema and ``n`` queued jobs of the payload
    (``Queries.enqueue`` of 1,000 at a time: untimed setup)."""
    import asyncpg
    from pgqueuer import Queries
    from pgqueuer.db import AsyncpgDriver

    await pgq_install(url)
    conn = await asyncpg.connect(url)
    try:
        queries = Queries(AsyncpgDriver(conn))
        payload = BODY_JSON.encode()
        for offset in range(0, n, 1000):
            size = min(1000, n - offset)
            await queries.enqueue(["bench"] * size, [payload] * size, [0] * size)
    finally:
        await conn.close()


def pgq_processes(url: str, n: int, workers: int) -> Drained:
    anyio.run(pgq_fill, url, n, backend="asyncio")
    return drain_with_processes(
        [sys.executable, "-c", PGQ_CHILD, url], workers, url, "SELECT COUNT(*) FROM pgqueuer", n
    )


CONCURRENCIES: Final = (16, 64)
"""Our workers' concurrency in the deliveries figures: the default, and 64."""
DEFAULT_SAYS: Final = {16: ", the default", 64: ""}


def run_postgres(bench: Bench) -> Outcome:
    """PostgreSQL beside raw psycopg and pgqueuer (asyncpg, its defaults);
    each measurement on an emptied database, the same server, the same
    payload, synchronous_commit on for both."""
    pg = postgres_database()
    if pg is None:
        return Outcome(notes=["postgres section skipped: no PostgreSQL server answered"])
    try:
        import asyncpg  # noqa: F401
        import pgqueuer  # noqa: F401
    except ImportError:
        pg[1]()
        return Outcome(
            notes=["postgres section skipped: pgqueuer/asyncpg are not installed (bench extra)"]
        )
    url, drop = pg
    scale, go = bench.scale, bench.go
    n1, n64, k = 400 * scale, 5120 * scale, 3000 * scale

    def fresh() -> str:
        return fresh_postgres(url)

    pgq_failed = 0

    def pgq_processes_fresh(workers: int) -> float:
        nonlocal pgq_failed
        drained = pgq_processes(fresh(), k, workers)
        pgq_failed += drained.failed
        return drained.rate

    def ours_processes_fresh(workers: int, concurrency: int) -> float:
        return ours_processes(fresh(), k, workers, BODY, concurrency)

    oban, oban_note = oban_python()
    oban_failed = 0

    def oban_processes_fresh(workers: int, limit: int) -> float:
        nonlocal oban_failed
        assert oban is not None
        drained = oban_processes(oban, fresh(), k, workers, limit)
        oban_failed += drained.failed
        return drained.rate

    pairs = Pairs()
    ours_by_workers: dict[int, list[float]] = {1: [], 2: [], 4: []}
    try:
        for i in range(bench.rounds):
            raw1, ours1 = go(pg_raw_and_ours_single, fresh(), n1)
            pairs.add("e1", ours1, raw1)
            got = median_of_turns(
                {
                    "pgqueuer": lambda: go(
                        pgq_concurrent_enqueue, fresh(), n64 // 4, 64, backend="asyncio"
                    ),
                    "ours": lambda: go(ours_concurrent_enqueue, fresh(), n64 // 4, 64, BODY, 5),
                },
                4,
                i,
            )
            pairs.add("e64", got["ours"], got["pgqueuer"])
            for concurrency in CONCURRENCIES:
                for workers in (1, 2):
                    sides = {
                        "pgqueuer": functools.partial(pgq_processes_fresh, workers),
                        "ours": functools.partial(ours_processes_fresh, workers, concurrency),
                    }
                    if oban is not None and workers == 1 and concurrency == 16:
                        sides["oban"] = functools.partial(oban_processes_fresh, 1, concurrency)
                    got = median_of_turns(sides, 1, i)
                    pairs.add(f"p{workers}c{concurrency}", got["ours"], got["pgqueuer"])
                    if "oban" in got:
                        pairs.add(f"o{workers}c{concurrency}", got["ours"], got["oban"])
                    if concurrency == 64:
                        ours_by_workers[workers].append(got["ours"])
            ours4 = ours_processes_fresh(4, 64)
            ours_by_workers[4].append(ours4)
            pairs.add("p4", ours4, ours_by_workers[1][-1])
        account = run_account(
            k,
            BODY,
            PGQ_CHILD + "import time; time.sleep(600)\n",
            (url.rsplit("/", 1)[0] + "/postgres", url),
            () if oban is None else (("oban at 16", oban_account_child(oban, 16)),),
        )
    finally:
        drop()
    version = f"pgqueuer {version_of('pgqueuer')} (asyncpg {version_of('asyncpg')})"
    figures = [
        pairs.figure(
            "e1",
            "PostgreSQL enqueue, 1 producer, vs raw psycopg",
            "/s",
            f"raw psycopg {version_of('psycopg')}: INSERT of an outbox-shaped row (the same "
            f"envelope of the {len(BODY_JSON)}-byte payload ours stores) + COMMIT per row; "
            f"ours: enqueue_dispatch on {bench.backend}, same database; {n1} each in "
            f"{TURNS} turns taken in rotation in one event loop, the median turn, after "
            f"{WARMUP} untimed",
            0.6,
            "raw psycopg",
            "postgres",
        ),
        pairs.figure(
            "e64",
            "PostgreSQL enqueue, 64 producer tasks, vs pgqueuer",
            "/s",
            f"{version}: 64 asyncio tasks awaiting Queries.enqueue of one job each over one "
            f"asyncpg pool (asyncpg's default size, 10); ours: 64 tasks on one store "
            f"({bench.backend}); the {len(BODY_JSON)}-byte payload; {n64 // 4} per turn on an "
            f"emptied database, 4 turns each taken in rotation, the median turn",
            4,
            "pgqueuer",
            "postgres",
        ),
        *[
            figure
            for concurrency in CONCURRENCIES
            for figure in (
                pairs.figure(
                    f"p1c{concurrency}",
                    f"PostgreSQL deliveries, no-op, 1 process at concurrency {concurrency}, "
                    "vs pgqueuer",
                    "/s",
                    f"{version}: one process, PgQueuer on one asyncpg connection with a no-op "
                    f"entrypoint, run() with its defaults (batch_size 10) but mode=drain; ours: "
                    f"one process, a DispatchWorker (trio, concurrency {concurrency}"
                    f"{DEFAULT_SAYS[concurrency]}); {k} jobs queued beforehand, started once "
                    f"set up, timed until a poll (every 10 ms) counts none left (a pgqueuer "
                    f"job leaves its queue table when its completion log is written, which "
                    f"pgqueuer batches: every 10 jobs or 0.1 s)",
                    1.2,
                    "pgqueuer, 1 process",
                    "postgres",
                ),
                pairs.figure(
                    f"p2c{concurrency}",
                    f"PostgreSQL deliveries, no-op, 2 processes at concurrency {concurrency}, "
                    "vs pgqueuer's 2",
                    "/s",
                    f"the same with 2 processes on each side ({k} jobs; one run each per "
                    f"round, the sides taking turns, which goes first rotating by round)",
                    1.2,
                    "pgqueuer, 2 processes",
                    "postgres",
                ),
            )
        ],
        pairs.figure(
            "p4",
            "PostgreSQL deliveries, 4 processes vs 1",
            "/s",
            f"ours with 1 process (the figure above), in the same round; {k} dispatches",
            1.8,
            "ours, 1 process",
            "postgres",
        ),
    ]
    if oban is not None:
        figures.insert(
            2,
            pairs.figure(
                "o1c16",
                "PostgreSQL deliveries, no-op, 1 process at concurrency 16, vs Oban",
                "/s",
                f"oban {oban_version(oban)} (Python's Oban, psycopg 3, in a virtualenv of "
                f"its own on Python 3.12): one process, Oban(pool=create_pool(url), "
                f"queues={{'bench': 16}}) with its other defaults, a no-op worker, started "
                f"on 'go' (its leader election and producer start inside the timing); ours "
                f"at concurrency 16; {k} jobs queued beforehand, timed until a poll counts "
                f"none left undone; taking turns with the pgqueuer figure's runs",
                1.5,
                "Oban, 1 process",
                "postgres",
            ),
        )
    engine = {
        "engine": "postgresql",
        "enqueue_1_producer_per_s": figures[0].value,
        "enqueue_64_producers_per_s": figures[1].value,
        "deliveries_1_worker_per_s": statistics.median(ours_by_workers[1]),
        "deliveries_4_workers_per_s": statistics.median(ours_by_workers[4]),
    }
    notes = [
        "postgresql engine row: medians of the postgres section's own measurements "
        "(payload of the side-by-side figures; deliveries by worker processes)"
    ]
    notes += account
    if oban is None:
        notes.append(f"Oban figures skipped: {oban_note}")
    elif oban_failed:
        notes.append(f"oban: {oban_failed} worker process(es) exited with an error")
    if pgq_failed:
        notes.append(f"pgqueuer: {pgq_failed} worker process(es) exited with an error")
    return Outcome(figures, notes, [engine])
