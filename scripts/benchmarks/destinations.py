"""Section ``destinations``: what destination policies (docs/destinations.md) promise and
cost, on SQLite and on PostgreSQL in one run.

- Accuracy: 4 worker processes (default concurrency 16, no-op callable)
  share one destination at ``rate: 200/s`` (burst 10) for 20 s (``--quick``:
  10 s). The starts are the claims' transition times: their total beside
  ``200 * t``, and the most starts in any window of ``t`` seconds beyond
  ``200 * t`` beside the burst (the rate is never exceeded when that is at
  most the burst).
- Isolation: a paused destination holding 200,000 pending rows; the other
  destinations' deliveries/s beside the same run without that backlog, and
  one claim of 100 rows (the worker's policies; the median of many) beside
  the same claim without it.
- Fair share: destination A with a 100,000-row backlog, B enqueuing one row
  every 10 ms while a worker (concurrency 16) drains: B's enqueue ->
  transport start p99 beside B alone.
- Cost: deliveries/s (no-op, concurrency 16) with a rate configured for
  every destination that never binds, beside no policy at all.
- Expiry: the other destinations' deliveries/s while every worker's sweep
  expires a paused destination's 100,000 rows whose deadlines have passed,
  beside the same rows with their deadlines an hour ahead (the sweep's
  pace, :data:`trio_dispatch.worker.expiry.PACE`, decides this ratio). (No policy
  against this section's base commit is the ``core`` section run at both
  commits.)
"""

from __future__ import annotations

import json
import signal
import statistics
import subprocess
import sys
import time
import uuid
from typing import Any, Final

import anyio

from trio_dispatch import (
    Delivery,
    DispatchWorker,
    enqueue_dispatch,
    enqueue_many,
    open_store,
    pause_destination,
)

from .harness import ROOT, Bench, Figure, Outcome, at_least, percentile, ratio_at_most
from .pgserver import fresh_postgres, postgres_database
from .workloads import claim_ms, load_rows

RATE: Final = 200
BURST: Final = 10
PROCESSES: Final = 4
SECONDS: Final = 20.0
SECONDS_QUICK: Final = 10.0
CONCURRENCY: Final = 16
BACKLOG: Final = 200_000
OTHERS: Final = 20_000
OTHERS_QUICK: Final = 5_000
FAIR_BACKLOG: Final = 100_000
FAIR_SECONDS: Final = 8.0
FAIR_SECONDS_QUICK: Final = 4.0
FAIR_EVERY: Final = 0.010
CLAIM_LIMIT: Final = 100
CLAIMS: Final = 40
COST_ROWS: Final = 20_000
COST_ROWS_QUICK: Final = 5_000
EXPIRING: Final = 100_000

WORKER_CHILD: Final = """
import sys, anyio, signal
sys.path.insert(0, sys.argv[2])
from trio_dispatch import open_store, DispatchWorker
async def main():
    async with open_store(sys.argv[1]) as db:
        async def send(d):
            pass
        async with anyio.create_task_group() as tg:
            w = DispatchWorker(db, transport=send, tick_seconds=0.2,
                               destinations={"metered": {"rate": sys.argv[3],
                                                         "burst": int(sys.argv[4])}})
            with anyio.open_signal_receiver(signal.SIGTERM) as signals:
                print("ready", flush=True)
                await anyio.to_thread.run_sync(sys.stdin.readline)
                await tg.start(w.run)
                async for _ in signals:
                    tg.cancel_scope.cancel()
                    break
anyio.run(main, backend="trio")
"""
"""A worker process (default concurrency, no-op callable) with one metered
destination, started on "go"; SIGTERM stops it."""

_COLUMNS: Final = (
    "id",
    "kind",
    "deliver_to",
    "payload",
    "status",
    "attempt",
    "next_attempt_at",
    "created_at",
    "updated_at",
)


def _load(target: str, destination: str, n: int, due_from: float) -> None:
    """``n`` due rows of ``destination`` written with the engine's own
    driver (due from ``due_from`` on, a microsecond apart)."""
    load_rows(
        target,
        _COLUMNS,
        (
            (uuid.uuid4().hex, "bench", destination, "{}", "pending", 0, due, due, due)
            for due in (due_from + i * 1e-6 for i in range(n))
        ),
        analyze=True,
    )


def _load_deadlines(target: str, n: int, expires_at: float) -> None:
    """``n`` pending rows of the destination ``paused``, due an hour ago,
    with deadlines from ``expires_at`` on (a microsecond apart)."""
    due = time.time() - 3600
    load_rows(
        target,
        (*_COLUMNS, "expires_at"),
        (
            (uuid.uuid4().hex, "bench", "paused", "{}", "pending", 0, due, due, due, deadline)
            for deadline in (expires_at + i * 1e-6 for i in range(n))
        ),
        analyze=True,
    )


async def _fill(target: str, destinations: list[str], n: int) -> None:
    async with open_store(target) as db:
        for offset in range(0, n, 1000):
            await enqueue_many(
                db,
                [
                    {"kind": "bench", "deliver_to": destinations[(offset + i) % len(destinations)]}
                    for i in range(min(1000, n - offset))
                ],
            )


# -- accuracy ------------------------------------------------------------------


def most_beyond_rate(starts: list[float], rate: float) -> float:
    """The most starts in any window ``[t_i, t_j]`` beyond ``rate * (t_j -
    t_i)``: ``max over i <= j of (j - i + 1) - rate * (t_j - t_i)``, in one
    pass (the best ``j`` for each ``i`` is a suffix maximum)."""
    if not starts:
        return 0.0
    best_after = -float("inf")
    worst = 0.0
    for i in range(len(starts) - 1, -1, -1):
        best_after = max(best_after, i - rate * starts[i])
        worst = max(worst, best_after - i + 1 + rate * starts[i])
    return worst


def accuracy(target: str, seconds: float) -> tuple[int, float]:
    """The starts ``PROCESSES`` workers made in ``seconds`` to one
    destination at ``RATE``/s, and the most of them in any window beyond
    the rate."""
    anyio.run(_fill, target, ["metered"], int(RATE * seconds * 1.5) + 1000)
    argv = [sys.executable, "-c", WORKER_CHILD, target, str(ROOT), f"{RATE}/s", str(BURST)]
    procs = [
        subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        for _ in range(PROCESSES)
    ]
    try:
        for proc in procs:
            assert proc.stdout is not None
            if proc.stdout.readline().strip() != "ready":
                raise RuntimeError("a worker process did not start")
        for proc in procs:
            assert proc.stdin is not None
            proc.stdin.write("go\n")
            proc.stdin.flush()
        time.sleep(seconds)
    finally:
        for proc in procs:
            proc.send_signal(signal.SIGTERM)
        for proc in procs:
            proc.wait(30)
    starts = _attempt_times(target)
    if not starts:
        return 0, 0.0
    first = starts[0]
    within = [t for t in starts if t <= first + seconds]
    return len(within), most_beyond_rate(within, RATE)


def _attempt_times(target: str) -> list[float]:
    sql = (
        "SELECT created_at FROM status_transitions "
        "WHERE reason_code = 'dispatch.delivering.attempt' ORDER BY created_at"
    )
    if target.startswith("postgres"):
        import psycopg

        with psycopg.connect(target) as conn:
            return [float(row[0]) for row in conn.execute(sql)]
    import sqlite3

    conn = sqlite3.connect(target)
    try:
        return [float(row[0]) for row in conn.execute(sql)]
    finally:
        conn.close()


# -- isolation -----------------------------------------------------------------


async def deliveries(target: str, n: int, destinations: dict[str, Any] | None = None) -> float:
    """Deliveries/s of a worker (no-op, concurrency 16) taking ``n`` rows of
    the store as it is."""
    done = 0
    finished = anyio.Event()

    async def counting(delivery: Delivery) -> None:
        nonlocal done
        done += 1
        if done == n:
            finished.set()

    async with open_store(target) as db:
        worker = DispatchWorker(
            db,
            transport=counting,
            concurrency=CONCURRENCY,
            tick_seconds=3600,
            destinations=destinations,
        )
        async with anyio.create_task_group() as tg:
            start = time.perf_counter()
            await tg.start(worker.run)
            await finished.wait()
            elapsed = time.perf_counter() - start
            tg.cancel_scope.cancel()
    return n / elapsed


async def claim_times(big: str, empty: str) -> tuple[float, float]:
    """Median claim milliseconds with the paused backlog and without, the
    two stores taking turns."""
    times: dict[str, list[float]] = {"big": [], "empty": []}
    async with open_store(big) as big_db, open_store(empty) as empty_db:
        stores = [("big", big_db), ("empty", empty_db)]
        for _, db in stores:
            await claim_ms(db, CLAIM_LIMIT)
        for turn in range(CLAIMS):
            for name, db in stores if turn % 2 else stores[::-1]:
                times[name].append(await claim_ms(db, CLAIM_LIMIT))
    return statistics.median(times["big"]), statistics.median(times["empty"])


async def _pause(target: str) -> None:
    async with open_store(target) as db:
        await pause_destination(db, "paused", reason="bench")


# -- fair share ----------------------------------------------------------------


async def b_latencies(target: str, seconds: float) -> list[float]:
    """Enqueue -> transport start of B's rows (one every 10 ms for
    ``seconds``) while a worker drains whatever else the store holds."""
    latencies: list[float] = []

    async def timing(delivery: Delivery) -> None:
        if delivery.deliver_to == "b":
            sent = json.loads(delivery.payload)["body"]["t"]
            latencies.append(time.time() - sent)

    async with open_store(target) as db:
        worker = DispatchWorker(db, transport=timing, concurrency=CONCURRENCY, tick_seconds=0.2)
        async with anyio.create_task_group() as tg:
            await tg.start(worker.run)
            ends = time.monotonic() + seconds
            while time.monotonic() < ends:
                await enqueue_dispatch(db, kind="bench", deliver_to="b", body={"t": time.time()})
                await anyio.sleep(FAIR_EVERY)
            await anyio.sleep(1.0)  # the last ones' starts
            tg.cancel_scope.cancel()
    return latencies


# -- the section ---------------------------------------------------------------


class _Engine:
    def __init__(self, bench: Bench, name: str, urls: list[str]) -> None:
        self.bench, self.name, self.urls = bench, name, urls
        self.made = 0

    def fresh(self, which: int = 0) -> str:
        if self.urls:
            target = fresh_postgres(self.urls[which])
        else:
            self.made += 1
            target = str(self.bench.at(f"destinations{self.made}"))
        self.bench.go(_fill, target, ["x"], 0)
        return target


def run_destinations(bench: Bench) -> Outcome:
    """The destinations figures on each engine (see the module's text)."""
    seconds = SECONDS_QUICK if bench.quick else SECONDS
    others = OTHERS_QUICK if bench.quick else OTHERS
    fair_seconds = FAIR_SECONDS_QUICK if bench.quick else FAIR_SECONDS
    cost_rows = COST_ROWS_QUICK if bench.quick else COST_ROWS
    notes: list[str] = []
    databases = [db for db in (postgres_database(), postgres_database()) if db is not None]
    engines = [_Engine(bench, "SQLite", [])]
    if len(databases) == 2:
        engines.append(_Engine(bench, "PostgreSQL", [url for url, _ in databases]))
    else:
        notes.append("destinations section: PostgreSQL skipped, no server answered")
    measured: dict[str, tuple[list[float], list[float]]] = {}

    def add(key: str, ours: float, baseline: float) -> None:
        values, baselines = measured.setdefault(key, ([], []))
        values.append(ours)
        baselines.append(baseline)

    go = bench.go
    names = [f"ok-{i}" for i in range(4)]
    never_binding = {"*": {"rate": "1000000/s", "burst": 1000}}
    try:
        for _ in range(bench.rounds):
            for engine in engines:
                starts, beyond = accuracy(engine.fresh(), seconds)
                add(f"{engine.name}/total", starts, RATE * seconds)
                add(f"{engine.name}/beyond", beyond, BURST)

                big, empty = engine.fresh(0), engine.fresh(1)
                _load(big, "paused", BACKLOG, time.time() - 3600)
                go(_pause, big)
                for target in (big, empty):
                    go(_fill, target, names, CLAIM_LIMIT)
                add(f"{engine.name}/claim", *go(claim_times, big, empty))
                for target in (big, empty):
                    go(_fill, target, names, others)
                with_backlog = go(deliveries, big, others + CLAIM_LIMIT)
                add(
                    f"{engine.name}/isolation",
                    with_backlog,
                    go(deliveries, empty, others + CLAIM_LIMIT),
                )

                loaded, alone = engine.fresh(0), engine.fresh(1)
                _load(loaded, "a", FAIR_BACKLOG, time.time() - 3600)
                with_a = percentile(go(b_latencies, loaded, fair_seconds), 0.99)
                add(
                    f"{engine.name}/fair",
                    with_a * 1000,
                    percentile(go(b_latencies, alone, fair_seconds), 0.99) * 1000,
                )

                expiring, ahead = engine.fresh(0), engine.fresh(1)
                _load_deadlines(expiring, EXPIRING, time.time() - 60)
                _load_deadlines(ahead, EXPIRING, time.time() + 3600)
                for target in (expiring, ahead):
                    go(_pause, target)
                    go(_fill, target, names, others)
                add(
                    f"{engine.name}/expiry",
                    go(deliveries, expiring, others),
                    go(deliveries, ahead, others),
                )

                plain, metered = engine.fresh(0), engine.fresh(1)
                go(_fill, plain, names * 2, cost_rows)
                go(_fill, metered, names * 2, cost_rows)
                add(
                    f"{engine.name}/cost",
                    go(deliveries, metered, cost_rows, never_binding),
                    go(deliveries, plain, cost_rows),
                )
    finally:
        for _, drop in databases:
            drop()
    figures = []
    for engine in engines:
        name = engine.name
        rows = [
            (
                "total",
                f"{name}: starts by {PROCESSES} processes in {seconds:g} s at rate {RATE}/s",
                "starts",
                f"{RATE} x {seconds:g} s",
                ">= 0.95x",
                at_least(0.95),
            ),
            (
                "beyond",
                f"{name}: most starts in any window t beyond {RATE} x t (burst {BURST})",
                "starts",
                "the burst",
                "<= 1.0x",
                ratio_at_most(1.0),
            ),
            (
                "isolation",
                f"{name}: others' deliveries/s ({others:,}) beside a paused "
                f"destination's {BACKLOG:,} pending rows",
                "deliveries/s",
                "the same run without that backlog",
                ">= 0.90x",
                at_least(0.90),
            ),
            (
                "claim",
                f"{name}: one claim of {CLAIM_LIMIT} rows, paused {BACKLOG:,}-row backlog "
                f"/ none (median of {CLAIMS})",
                "ms",
                "the same claim without that backlog",
                "<= 1.2x",
                ratio_at_most(1.2),
            ),
            (
                "fair",
                f"{name}: B's enqueue -> start p99 beside A's {FAIR_BACKLOG:,}-row backlog",
                "ms",
                "B alone",
                "<= 2.0x",
                ratio_at_most(2.0),
            ),
            (
                "cost",
                f"{name}: deliveries/s ({cost_rows:,}), a rate on every destination that "
                "never binds",
                "deliveries/s",
                "no policy",
                ">= 0.90x",
                at_least(0.90),
            ),
            (
                "expiry",
                f"{name}: others' deliveries/s ({others:,}) while a paused destination's "
                f"{EXPIRING:,} past-due rows expire",
                "deliveries/s",
                "the same rows with deadlines ahead",
                ">= 0.70x",
                at_least(0.70),
            ),
        ]
        for key, what, unit, baseline, target, meets in rows:
            values, baselines = measured[f"{name}/{key}"]
            figures.append(
                Figure(
                    what, values, unit, baselines, baseline, target, meets, baseline, "destinations"
                )
            )
    if bench.quick:
        notes.append(
            f"destinations section (--quick): accuracy over {seconds:g} s (full: {SECONDS:g}), "
            f"{others:,} rows beside the paused backlog (full: {OTHERS:,}), B for "
            f"{fair_seconds:g} s (full: {FAIR_SECONDS:g}); the backlogs are full size"
        )
    notes.append(
        "destinations section: no policy against the issue's base commit is the core "
        "section at both commits"
    )
    return Outcome(figures, notes)
