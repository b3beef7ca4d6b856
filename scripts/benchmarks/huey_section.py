"""Section ``huey``: one producer, 64 producers, one delivery worker and two
worker processes beside huey's ``SqliteHuey`` (WAL; ``fsync=True`` is
synchronous=FULL), same payload.

Named so as not to shadow the ``huey`` package it measures.
"""

from __future__ import annotations

import functools
import sqlite3
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from trio_dispatch import (
    open_store,
)

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
    take_turns,
    version_of,
)
from .processes import Drained, drain_with_processes, ours_processes
from .workloads import enqueue_side, noop, ours_concurrent_enqueue, ours_deliveries

HUEY_CHILD = """
import sqlite3, sys, time
from huey import SqliteHuey
storage = SqliteHuey("bench", filename=sys.argv[1], fsync=True).storage
storage.queue_size()  # opens the connection
print("ready", flush=True)
sys.stdin.readline()
errors = 0
while True:
    try:
        if storage.dequeue() is None:
            break
    except sqlite3.OperationalError:
        errors += 1
        time.sleep(0.1)
print("errors", errors, flush=True)
"""
"""huey's dequeue loop in a process of its own: ``storage.dequeue()`` until
the queue is empty, nothing done per task. A dequeue that fails (its
``BEGIN EXCLUSIVE`` waited out huey's 5 s busy timeout: "database is
locked") is counted and tried again after 0.1 s, as huey's consumer does
(it logs the error and sleeps its default delay)."""


def huey_queue(path: Path) -> tuple[Any, Any]:
    """A ``SqliteHuey`` on ``path`` (defaults but ``fsync=True``) and a
    registered no-op task taking the payload."""
    from huey import SqliteHuey

    huey = SqliteHuey("bench", filename=str(path), fsync=True)

    @huey.task()  # type: ignore[untyped-decorator]
    def bench_task(body: dict[str, Any]) -> None:
        return None

    return huey, bench_task


def huey_storage_note(path: Path) -> str:
    """What huey's storage does, with its pragmas read back from its own
    connection."""
    huey, _ = huey_queue(path)
    conn = huey.storage.conn
    journal = conn.execute("PRAGMA journal_mode").fetchone()[0]
    sync = conn.execute("PRAGMA synchronous").fetchone()[0]
    default_sync = sqlite3.connect(":memory:").execute("PRAGMA synchronous").fetchone()[0]
    huey.storage.close()
    return (
        f"huey {version_of('huey')} SqliteHuey storage: one sqlite3 connection per process, "
        "shared by its threads behind a threading.Lock; cache_size 8 MB; every enqueue "
        "and every dequeue its own BEGIN EXCLUSIVE transaction (dequeue: a SELECT 1 "
        "probe outside it, then SELECT + DELETE of the first row inside). Read back here: "
        f"journal_mode={journal}, synchronous={sync} (fsync=True sets 2 = FULL; huey's "
        f"default fsync=None leaves SQLite's own default, {default_sync} in this build)."
    )


async def huey_and_ours_single(huey_path: Path, ours_path: Path, n: int) -> list[float]:
    """Enqueues/s of one producer, interleaved: huey's ``task(body)`` (that
    is ``huey.enqueue``: pickle the message, then ``storage.enqueue``) and
    our ``enqueue_dispatch(db, body=...)``."""
    huey, task = huey_queue(huey_path)

    def huey_side(count: int) -> None:
        for _ in range(count):
            task(BODY)

    try:
        async with open_store(ours_path) as db:
            return await interleave([sync_side(huey_side), enqueue_side(db, BODY)], n)
    finally:
        huey.storage.close()


def huey_threads_enqueue(path: Path, n: int, threads: int) -> float:
    huey, task = huey_queue(path)
    for _ in range(WARMUP):
        task(BODY)
    ready = threading.Barrier(threads + 1)

    def producer() -> None:
        ready.wait()
        for _ in range(n // threads):
            task(BODY)

    pool = [threading.Thread(target=producer) for _ in range(threads)]
    for thread in pool:
        thread.start()
    ready.wait()
    start = time.perf_counter()
    for thread in pool:
        thread.join()
    rate = (n // threads * threads) / (time.perf_counter() - start)
    huey.storage.close()
    return rate


def huey_fill(path: Path, n: int) -> None:
    """Queue ``n`` tasks of the payload (huey's own serialised messages,
    its enqueue statement, one transaction: untimed setup)."""
    huey, task = huey_queue(path)
    storage = huey.storage
    rows = [(storage.name, huey.serialize_task(task.s(BODY)), 0) for _ in range(n)]
    with storage.db(commit=True) as cursor:
        cursor.executemany("INSERT INTO task (queue, data, priority) VALUES (?, ?, ?)", rows)
    storage.close()


def huey_dequeue_loop(path: Path, n: int) -> float:
    huey_fill(path, n)
    huey, _ = huey_queue(path)
    storage = huey.storage
    storage.queue_size()  # opens the connection
    done = 0
    start = time.perf_counter()
    while storage.dequeue() is not None:
        done += 1
    rate = done / (time.perf_counter() - start)
    storage.close()
    if done != n:
        raise RuntimeError(f"huey dequeued {done} of {n} tasks")
    return rate


def huey_processes(path: Path, n: int, workers: int) -> Drained:
    huey_fill(path, n)
    return drain_with_processes(
        [sys.executable, "-c", HUEY_CHILD, str(path)],
        workers,
        str(path),
        "SELECT COUNT(*) FROM task",
        n,
    )


def huey_processes_at(at: Callable[[str], Path], n: int, workers: int) -> Drained:
    return huey_processes(at("hueyp"), n, workers)


def ours_processes_at(at: Callable[[str], Path], n: int, workers: int) -> Drained:
    """Ours at the default concurrency, as a :class:`Drained`."""
    return Drained(ours_processes(str(at("oursp")), n, workers, BODY), [], 0)


def run_huey(bench: Bench) -> Outcome:
    """Side by side with huey's SqliteHuey: the same payload, both at
    synchronous=FULL in WAL mode, the same number of items, warm-up first."""
    try:
        import huey  # noqa: F401
    except ImportError:
        return Outcome(notes=["huey section skipped: huey is not installed (the bench extra)"])
    scale, at, go = bench.scale, bench.at, bench.go
    n1, n64, k = 1500 * scale, 6400 * scale, 5000 * scale
    pairs = Pairs()
    huey_errors = huey_failed = 0
    for i in range(bench.rounds):
        huey1, ours1 = go(huey_and_ours_single, at("huey1"), at("ours1"), n1)
        pairs.add("e1", ours1, huey1)
        got = median_of_turns(
            {
                "huey": lambda: huey_threads_enqueue(at("huey64"), n64 // 4, 64),
                "ours": lambda: go(ours_concurrent_enqueue, at("ours64"), n64 // 4, 64, BODY, 5),
            },
            4,
            i,
        )
        pairs.add("e64", got["ours"], got["huey"])
        got = median_of_turns(
            {
                "huey": lambda: huey_dequeue_loop(at("hueyw"), k // 4),
                "ours": lambda: go(ours_deliveries, at("oursw"), k // 4, noop, 64, 100, BODY),
            },
            4,
            i,
        )
        pairs.add("w1", got["ours"], got["huey"])
        rates: dict[int, float] = {}
        for workers in (1, 2):
            runs = take_turns(
                {
                    "huey": functools.partial(huey_processes_at, at, k, workers),
                    "ours": functools.partial(ours_processes_at, at, k, workers),
                },
                1,
                i,
            )
            rates[workers] = runs["ours"][0].rate
            pairs.add(f"p{workers}", rates[workers], runs["huey"][0].rate)
            huey_errors += runs["huey"][0].errors()
            huey_failed += runs["huey"][0].failed
        pairs.add("p2p1", rates[2], rates[1])
    payload = f"the same {len(BODY_JSON)}-byte JSON payload"
    figures = [
        pairs.figure(
            "e1",
            "enqueue, 1 producer, vs huey",
            "/s",
            f"huey enqueues/s, one thread: `task(body)` of a registered @huey.task, i.e. "
            f"huey.enqueue() (pickles the message, then storage.enqueue: BEGIN EXCLUSIVE; "
            f"INSERT; COMMIT); ours: enqueue_dispatch(db, body=...) on {bench.backend}; "
            f"{payload}; {n1} each in {TURNS} turns taken in rotation in one event loop "
            f"(huey's calls blocking it), the median turn, after {WARMUP} untimed",
            0.6,
            "huey, 1 thread",
            "huey",
        ),
        pairs.figure(
            "e64",
            "enqueue, 64 producer tasks, vs huey from 64 threads",
            "/s",
            f"huey enqueues/s from 64 threads (released together by a barrier) on one "
            f"SqliteHuey; ours: 64 tasks on one store ({bench.backend}); {payload}; "
            f"{n64 // 4} per turn, 4 turns each taken in rotation, fresh files each turn, "
            f"the median turn",
            4,
            "huey, 64 threads",
            "huey",
        ),
        pairs.figure(
            "w1",
            "deliveries, no-op callable, 1 worker, vs huey dequeue loop",
            "/s",
            f"huey's dequeue loop: storage.dequeue() until empty, nothing done per task "
            f"(not even unpickling it: a floor of huey's consumer); ours: one DispatchWorker "
            f"(concurrency 64, batch 100, no-op async callable), its startup inside the "
            f"timing; each over {k // 4} items queued beforehand on a fresh file, 4 turns "
            f"each taken in rotation, the median turn",
            1.6,
            "huey dequeue loop",
            "huey",
        ),
        pairs.figure(
            "p1",
            "deliveries, no-op callable, 1 worker process at the default concurrency, vs huey's",
            "/s",
            f"1 process running huey's dequeue loop on one file vs 1 process running a "
            f"DispatchWorker (trio, concurrency 16, the default) on one store; {k} items "
            f"queued beforehand, the process started once set up, timed until a poll "
            f"(every 10 ms) counts none left; one run each per round, which side goes first "
            f"alternating by round",
            1.6,
            "huey, 1 process",
            "huey",
        ),
        pairs.figure(
            "p2",
            "deliveries, no-op callable, 2 worker processes at the default concurrency, "
            "vs huey's 2",
            "/s",
            f"the same with 2 processes on each side, on one file ({k} items), all started "
            f"together",
            1.5,
            "huey, 2 processes",
            "huey",
        ),
        pairs.figure(
            "p2p1",
            "deliveries, no-op callable, 2 worker processes vs 1, at the default concurrency",
            "/s",
            "ours with 2 processes beside ours with 1 (the figures above), in the same round",
            1.0,
            "ours, 1 process",
            "huey",
        ),
    ]
    notes = [huey_storage_note(at("huey-note"))]
    if huey_errors or huey_failed:
        notes.append(
            f"huey, 2 processes: {huey_errors} dequeue(s) failed with 'database is locked' "
            f"(BEGIN EXCLUSIVE waited out huey's 5 s busy timeout) and were tried again after "
            f"0.1 s, as huey's consumer does; {huey_failed} process(es) exited with an error"
        )
    return Outcome(figures, notes)
