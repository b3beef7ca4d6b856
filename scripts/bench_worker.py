"""Worker figures: enqueue-to-transport-start latency through the in-process
wake-up, and throughput with a transport that sleeps 0.5 s at concurrency 64.

Each figure is printed beside a baseline measured in the same run:
latency beside one plain sqlite3 INSERT + COMMIT (synchronous=FULL, WAL) on
the same disk; throughput beside the ideal concurrency / sleep rate.

    .venv/bin/python scripts/bench_worker.py [--backend trio|asyncio] [--quick]
"""

from __future__ import annotations

import argparse
import json
import sqlite3
import statistics
import tempfile
import time
from pathlib import Path

import anyio

from trio_dispatch import Delivery, enqueue_dispatch, enqueue_many, open_store
from trio_dispatch.worker import DispatchWorker


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def raw_commit_latencies(path: Path, n: int) -> list[float]:
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("PRAGMA synchronous=FULL")
    conn.execute("CREATE TABLE t (id INTEGER PRIMARY KEY, v TEXT)")
    out = []
    for i in range(n):
        start = time.perf_counter()
        conn.execute("BEGIN IMMEDIATE")
        conn.execute("INSERT INTO t (v) VALUES (?)", (f"row {i}",))
        conn.execute("COMMIT")
        out.append(time.perf_counter() - start)
    conn.close()
    return out


async def wake_latencies(path: Path, n: int) -> list[float]:
    started: dict[str, float] = {}
    enqueued: dict[str, float] = {}
    arrived = anyio.Event()

    async def send(delivery: Delivery) -> None:
        started[delivery.dispatch_id] = time.perf_counter()
        arrived.set()

    async with open_store(path) as db, anyio.create_task_group() as tg:
        worker = DispatchWorker(db, transport=send, tick_seconds=3600)
        await tg.start(worker.run)
        for i in range(n):
            arrived = anyio.Event()
            t0 = time.perf_counter()
            dispatch_id = await enqueue_dispatch(db, kind="bench", deliver_to=f"seat-{i}")
            enqueued[dispatch_id] = t0
            await arrived.wait()
            await anyio.sleep(0.002)  # let the finish commit before the next one
        tg.cancel_scope.cancel()
    return [started[i] - enqueued[i] for i in enqueued]


async def sleeping_throughput(path: Path, n: int, concurrency: int, sleep: float) -> float:
    done = 0
    finished = anyio.Event()

    async def send(delivery: Delivery) -> None:
        nonlocal done
        await anyio.sleep(sleep)
        done += 1
        if done == n:
            finished.set()

    async with open_store(path) as db:
        for start in range(0, n, 1000):
            await enqueue_many(db, [{"kind": "bench", "deliver_to": f"s{i}"}
                                    for i in range(start, min(n, start + 1000))])
        async with anyio.create_task_group() as tg:
            worker = DispatchWorker(db, transport=send, concurrency=concurrency,
                                    batch_size=concurrency, tick_seconds=3600)
            t0 = time.perf_counter()
            await tg.start(worker.run)
            await finished.wait()
            elapsed = time.perf_counter() - t0
            tg.cancel_scope.cancel()
    return n / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", choices=["trio", "asyncio"], default="trio")
    parser.add_argument("--quick", action="store_true", help="fewer samples")
    parser.add_argument("--json", metavar="FILE", help="also write the figures as JSON")
    args = parser.parse_args()
    n_latency = 200 if args.quick else 1000
    n_sleep = 640 if args.quick else 1920
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        raw = raw_commit_latencies(root / "raw.db", n_latency)
        lat = anyio.run(wake_latencies, root / "lat.db", n_latency, backend=args.backend)
        rate = anyio.run(sleeping_throughput, root / "tp.db", n_sleep, 64, 0.5,
                         backend=args.backend)
    ideal = 64 / 0.5
    figures = {
        "backend": args.backend,
        "latency_samples": len(lat),
        "wake_latency_p50_ms": statistics.median(lat) * 1000,
        "wake_latency_p99_ms": percentile(lat, 0.99) * 1000,
        "raw_commit_p50_ms": statistics.median(raw) * 1000,
        "raw_commit_p99_ms": percentile(raw, 0.99) * 1000,
        "sleep_0_5s_c64_deliveries_per_s": rate,
        "sleep_0_5s_c64_ideal_per_s": ideal,
    }
    print(f"backend: {args.backend}")
    print(f"{'figure':<44}{'value':>10}{'baseline':>12}{'ratio':>8}{'target':>16}")
    rows = [
        ("enqueue -> transport start p50 (ms)", figures["wake_latency_p50_ms"],
         figures["raw_commit_p50_ms"], "< 10 ms"),
        ("enqueue -> transport start p99 (ms)", figures["wake_latency_p99_ms"],
         figures["raw_commit_p99_ms"], "< 50 ms"),
        ("deliveries/s, 0.5 s transport, c=64", rate, ideal, ">= 80% of ideal"),
    ]
    for name, value, base, target in rows:
        print(f"{name:<44}{value:>10.2f}{base:>12.2f}{value / base:>8.2f}{target:>16}")
    print("(latency baseline: one raw sqlite3 INSERT+COMMIT, synchronous=FULL; "
          "throughput baseline: 64 / 0.5 s)")
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()
