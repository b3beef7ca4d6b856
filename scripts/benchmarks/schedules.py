"""Section ``schedules``: how promptly and how cheaply workers fire schedules
(docs/schedules.md).

- Fire lag: 1,000 schedules ``every: 1m`` (``--quick``: 200), 4 worker
  processes (no-op transport) on one store, two ticks of each (``--quick``:
  one). A tick fires at ``scheduled_for + jitter_for(tick)``, which every
  worker computes alike; its lag is the dispatch's ``created_at`` (the
  moment the firing worker took for its write, just before it) minus that
  instant. With ``jitter_seconds: 60`` the ticks spread over the minute;
  beside it the same with no jitter, all of them at one instant. Doubles:
  ticks with more than one ``schedule_runs`` row or dispatch (by
  ``schedule_run_id`` and by the envelope's metadata). SQLite, and
  PostgreSQL when a server answers.
- Idle CPU: one worker process with 1,000 schedules ``every: 1m`` on a
  SQLite file of its own, its utime + stime from ``/proc/<pid>/stat`` as a
  percentage of one core; beside it a worker with no schedules, run at the
  same time. With no jitter, over the 56 s between two fire instants (and
  over a whole minute, the fire instant included); with ``jitter_seconds:
  60`` over a whole minute (there is no window without a fire).

Set ``SCHEDULES_BENCH_PROFILE=DIR`` to have each worker process write a
cProfile of its run to ``DIR/<pid>.prof``.
"""

from __future__ import annotations

import collections
import json
import math
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from datetime import datetime
from typing import Any, Final

from trio_dispatch.schedules import Schedule

from .harness import ROOT, Bench, Figure, Outcome, at_most, percentile
from .pgserver import postgres_database
from .processes import counter

SCHEDULES: Final = 1_000
SCHEDULES_QUICK: Final = 200
WORKERS: Final = 4
EVERY: Final = 60
"""The schedules' interval in seconds (``every: 1m``)."""
JITTER: Final = 60.0
KIND: Final = "bench.tick"
LAG_P50_MS: Final = 100.0
LAG_P99_MS: Final = 1000.0
CPU_PERCENT: Final = 2.0

WORKER_CHILD = """
import os, sys, signal, anyio
sys.path.insert(0, sys.argv[2])
from trio_dispatch import open_store, DispatchWorker
from trio_dispatch.schedules import Schedule
target, count, every, jitter = sys.argv[1], int(sys.argv[3]), int(sys.argv[4]), float(sys.argv[5])
schedules = [
    Schedule(name=f"s{i:05d}", kind="bench.tick", deliver_to="ticks", every=every,
             jitter_seconds=jitter)
    for i in range(count)
]
async def main():
    async with open_store(target) as db:
        async def send(d):
            pass
        async with anyio.create_task_group() as tg:
            w = DispatchWorker(db, transport=send, concurrency=64, schedules=schedules)
            with anyio.open_signal_receiver(signal.SIGTERM) as signals:
                await tg.start(w.run)
                print("ready", flush=True)
                async for _ in signals:
                    tg.cancel_scope.cancel()
                    break
where = os.environ.get("SCHEDULES_BENCH_PROFILE")
if where:
    import cProfile
    profile = cProfile.Profile()
    profile.enable()
try:
    anyio.run(main, backend="trio")
finally:
    if where:
        profile.disable()
        profile.dump_stats(os.path.join(where, f"{os.getpid()}.prof"))
"""
"""A worker process: ``argv[3]`` schedules ``every: argv[4]`` seconds with
``jitter_seconds: argv[5]``, a no-op transport, on the store ``argv[1]``;
prints "ready" once running; SIGTERM stops it."""


def _schedules(count: int, every: int, jitter: float) -> dict[str, Schedule]:
    """The children's schedules, as the parent computes their fire times."""
    return {
        f"s{i:05d}": Schedule(
            name=f"s{i:05d}", kind=KIND, deliver_to="ticks", every=every, jitter_seconds=jitter
        )
        for i in range(count)
    }


def _spawn(target: str, count: int, every: int, jitter: float) -> subprocess.Popen[str]:
    argv = [sys.executable, "-c", WORKER_CHILD, target, str(ROOT), str(count), str(every)]
    return subprocess.Popen(
        [*argv, str(jitter)], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, text=True
    )


def _started(procs: Sequence[subprocess.Popen[str]]) -> None:
    for proc in procs:
        assert proc.stdout is not None
        if proc.stdout.readline().strip() != "ready":
            raise RuntimeError("a schedules worker process did not start")


def _stop(procs: Sequence[subprocess.Popen[str]]) -> int:
    """Stop the processes; how many exited with an error."""
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    failed = 0
    for proc in procs:
        try:
            code = proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            code = proc.wait()
        failed += code != 0
    return failed


def _make(target: str) -> None:
    import anyio

    from trio_dispatch import open_store

    async def touch() -> None:
        async with open_store(target):
            pass

    anyio.run(touch)


def _rows(target: str, sql: str) -> list[tuple[Any, ...]]:
    if target.startswith("postgresql"):
        import psycopg

        with psycopg.connect(target, autocommit=True) as conn:
            return [tuple(row) for row in conn.execute(sql).fetchall()]
    import sqlite3

    conn = sqlite3.connect(target, timeout=30)
    try:
        return [tuple(row) for row in conn.execute(sql)]
    finally:
        conn.close()


def _stamp(text: str) -> float:
    return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()


def fire_lag(
    target: str, count: int, ticks: int, jitter: float, every: int = EVERY
) -> dict[str, Any]:
    """``WORKERS`` worker processes with ``count`` schedules on ``target``
    until ``ticks`` ticks of each fired: the lag of each (ms) and the doubles."""
    _make(target)
    schedules = _schedules(count, every, jitter)
    procs = [_spawn(target, count, every, jitter) for _ in range(WORKERS)]
    try:
        _started(procs)
        # The first tick: the next boundary after the schedules were first seen.
        deadline = time.time() + every * (ticks + 1) + jitter + 60
        with counter(target) as count_of:
            while count_of("SELECT COUNT(*) FROM schedule_runs") < count * ticks:
                if time.time() > deadline or any(p.poll() is not None for p in procs):
                    raise RuntimeError(f"{count * ticks} ticks did not fire in time")
                time.sleep(0.5)
    finally:
        failed = _stop(procs)
    runs = _rows(
        target,
        "SELECT r.schedule, r.scheduled_for, d.created_at, d.payload FROM schedule_runs r "
        "LEFT JOIN dispatch_outbox d ON d.schedule_run_id = r.id",
    )
    dispatches = _rows(target, f"SELECT payload FROM dispatch_outbox WHERE kind = '{KIND}'")
    lags, per_run = [], collections.Counter()
    for schedule, scheduled_for, created_at, _ in runs:
        per_run[(schedule, float(scheduled_for))] += 1
        if created_at is not None:
            fire_at = schedules[schedule].fire_time(float(scheduled_for))
            lags.append((float(created_at) - fire_at) * 1000)
    by_metadata: collections.Counter[tuple[str, float]] = collections.Counter()
    for (payload,) in dispatches:
        meta = (json.loads(payload) if isinstance(payload, str | bytes) else payload)["metadata"]
        by_metadata[(meta["schedule"], _stamp(meta["scheduled_for"]))] += 1
    doubles = sum(n - 1 for n in per_run.values() if n > 1)
    doubles += sum(n - 1 for n in by_metadata.values() if n > 1)
    return {
        "ticks": len(per_run),
        "lags": lags,
        "doubles": doubles,
        "dispatches": len(dispatches),
        "missing_dispatches": sum(1 for row in runs if row[2] is None),
        "failed_workers": failed,
    }


def _cpu_seconds(pid: int) -> float:
    """utime + stime of a process, in seconds."""
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def idle_cpu(scratch: Any, count: int, every: int = EVERY) -> dict[str, float]:
    """Three worker processes at once, each on a SQLite file of its own:
    ``count`` schedules with no jitter, the same with ``JITTER``, and none.
    CPU % of one core of each over windows after the first tick ``T``:
    ``between`` [T + 3, T + every - 1] (no fire instant), ``minute``
    [T + 5, T + every + 5] (one fire instant, or a minute of jittered fires)."""
    kinds = {"plain": (count, 0.0), "jittered": (count, JITTER), "none": (0, 0.0)}
    procs: dict[str, subprocess.Popen[str]] = {}
    for name, (n, jitter) in kinds.items():
        target = str(scratch / f"idle-{name}.db")
        _make(target)
        procs[name] = _spawn(target, n, every, jitter)
    samples: list[tuple[float, dict[str, float]]] = []
    try:
        _started(list(procs.values()))
        ready = time.time()
        first = math.ceil(ready / every) * every
        if first - ready < 3:
            first += every
        end = first + every + 5
        while time.time() < end:
            samples.append((time.time(), {k: _cpu_seconds(p.pid) for k, p in procs.items()}))
            time.sleep(0.25)
        samples.append((time.time(), {k: _cpu_seconds(p.pid) for k, p in procs.items()}))
    finally:
        failed = _stop(list(procs.values()))
    if failed:
        raise RuntimeError(f"{failed} idle schedules worker process(es) failed")

    def at(moment: float) -> tuple[float, dict[str, float]]:
        return min(samples, key=lambda sample: abs(sample[0] - moment))

    def percent(start: float, stop: float) -> dict[str, float]:
        (t0, before), (t1, after) = at(start), at(stop)
        return {k: 100 * (after[k] - before[k]) / (t1 - t0) for k in procs}

    between = percent(first + 3, first + every - 1)
    minute = percent(first + 5, first + every + 5)
    return {
        "plain_between": between["plain"],
        "none_between": between["none"],
        "plain_minute": minute["plain"],
        "jittered_minute": minute["jittered"],
        "none_minute": minute["none"],
    }


def _zero(figure: Figure) -> bool:
    return figure.value == 0


def run_schedules(bench: Bench) -> Outcome:
    """The fire lag, doubles and idle CPU figures (see the module's text)."""
    count = SCHEDULES_QUICK if bench.quick else SCHEDULES
    ticks = 1 if bench.quick else 2
    notes: list[str] = []
    targets: list[tuple[str, str, Any]] = [("SQLite", str(bench.at("schedules")), None)]
    database = postgres_database()
    if database is not None:
        targets.append(("PostgreSQL", database[0], database[1]))
    else:
        notes.append("schedules section: PostgreSQL skipped, no server answered")
    figures: list[Figure] = []
    try:
        for engine, target, _ in targets:
            spread = fire_lag(target, count, ticks, JITTER)
            if engine == "SQLite":
                plain_target = str(bench.at("schedules-plain"))
            else:
                from .pgserver import fresh_postgres

                plain_target = fresh_postgres(target)
            at_once = fire_lag(plain_target, count, ticks, 0.0)
            what = (
                f"{engine}: fire lag, {count:,} schedules every 1m, jitter 60 s, {WORKERS} workers"
            )
            for label, fraction, limit in (("p50", 0.50, LAG_P50_MS), ("p99", 0.99, LAG_P99_MS)):
                figures.append(
                    Figure(
                        f"{what}, {label}",
                        [percentile(spread["lags"], fraction)],
                        "ms",
                        [percentile(at_once["lags"], fraction)],
                        f"the same with jitter 0 (all {count:,} at one instant), {label}",
                        f"<= {limit:g} ms",
                        at_most(limit),
                        "jitter 0",
                        "schedules",
                    )
                )
            figures.append(
                Figure(
                    f"{engine}: ticks doubled, {WORKERS} workers, jitter 60 s and jitter 0",
                    [spread["doubles"] + at_once["doubles"]],
                    "",
                    [spread["ticks"] + at_once["ticks"]],
                    "ticks fired in the two runs",
                    "0",
                    _zero,
                    "ticks fired",
                    "schedules",
                )
            )
            for name, run in (("jitter 60", spread), ("jitter 0", at_once)):
                lags = run["lags"]
                notes.append(
                    f"schedules {engine} {name}: {run['ticks']:,} ticks, {run['dispatches']:,} "
                    f"dispatches, lag min {min(lags):.1f} / p50 {percentile(lags, 0.5):.1f} / "
                    f"p90 {percentile(lags, 0.9):.1f} / p99 {percentile(lags, 0.99):.1f} / "
                    f"max {max(lags):.1f} ms; doubles {run['doubles']}, runs without a "
                    f"dispatch {run['missing_dispatches']}, failed workers {run['failed_workers']}"
                )
    finally:
        for _, _, drop in targets:
            if drop is not None:
                drop()
    cpu = idle_cpu(bench.scratch, count)
    idle = f"CPU of an idle worker with {count:,} schedules every 1m"
    rows = (
        ("between fire instants (56 s)", "plain_between", "none_between"),
        ("whole minute, one fire instant", "plain_minute", "none_minute"),
        ("jitter 60 s, whole minute", "jittered_minute", "none_minute"),
    )
    for label, key, base in rows:
        figures.append(
            Figure(
                f"{idle}, {label}",
                [cpu[key]],
                "%",
                [cpu[base]],
                "the same worker with no schedules, same window",
                f"<= {CPU_PERCENT:g}%",
                at_most(CPU_PERCENT),
                "no schedules",
                "schedules",
            )
        )
    notes.append(
        "schedules section: fire lag is the dispatch's created_at (taken by the firing worker "
        "just before its write transaction) minus scheduled_for + jitter_for(tick); CPU is "
        "utime + stime from /proc/<pid>/stat as % of one core"
    )
    if bench.quick:
        notes.append(
            f"schedules section (--quick): {count:,} schedules (full: {SCHEDULES:,}), "
            f"{ticks} tick of each (full: 2)"
        )
    return Outcome(figures, notes)
