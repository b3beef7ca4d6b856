"""Schedules (docs/schedules.md) under real worker processes: several workers with the
same ``every: 1s`` schedules on one store, left alone or with one of them
SIGKILLed and restarted every second or two.

The checks (:func:`tick_figures`), from the store alone: per tick
``(schedule, scheduled_for)`` one ``schedule_runs`` row and one dispatch
(counted both through ``schedule_run_id`` and through the envelope's
``schedule``/``scheduled_for`` metadata, so a dispatch written without its
run would show), and no tick missing between a schedule's first and last
fired tick: some worker lived throughout, so none may be lost (the schedules
say ``missed: all``: a tick a loaded worker reaches after the next one is due
fires late, backfilled, instead of being passed over as ``latest`` would).

    .venv/bin/python scripts/schedule_soak.py workers [--seconds 8] [--store URL]
    .venv/bin/python scripts/schedule_soak.py kills   [--seconds 10] [--store URL]
"""

from __future__ import annotations

import argparse
import collections
import json
import random
import signal
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from soaks import common

EVERY_SECONDS = 1
"""The schedules' interval (``every: 1s``)."""


FAILED = "schedules: reading or firing failed"
"""What a worker logs when a read or fire of its schedules raised."""


RESTART_SETTLE_SECONDS = 4.0
"""No worker is killed (and restarted) this close to the run's end."""


def schedule_names(count: int) -> list[str]:
    return [f"tick-{i}" for i in range(count)]


def role_schedule_worker(db: str, count: int) -> None:
    """A worker process with ``count`` schedules ``every: 1s`` and a no-op
    transport; SIGTERM stops it."""
    import anyio

    from trio_dispatch import Delivery, DispatchWorker, open_store
    from trio_dispatch.schedules import Schedule

    schedules = [
        # missed: all -- a tick a loaded worker reaches after the next one is
        # due is fired late (backfilled), not passed over: each tick counts.
        Schedule(
            name=name,
            kind="soak.tick",
            deliver_to="ticks",
            every=f"{EVERY_SECONDS}s",
            missed="all",
        )
        for name in schedule_names(count)
    ]

    async def send(delivery: Delivery) -> None:
        pass

    async def main() -> None:
        async with open_store(db) as store:
            worker = DispatchWorker(
                store, transport=send, tick_seconds=0.2, concurrency=8, schedules=schedules
            )
            await common.run_until_signalled(worker)

    anyio.run(main, backend="trio")


def _stamp(text: str) -> float:
    return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()


def tick_figures(db: Path | str, names: list[str]) -> dict[str, Any]:
    """What the store shows: ticks fired, ticks with more than one run or
    dispatch, ticks with none, and ticks missing between each schedule's
    first and last."""
    runs = common.query(
        db,
        "SELECT id, schedule, scheduled_for, origin FROM schedule_runs "
        "WHERE schedule IS NOT NULL ORDER BY schedule, scheduled_for",
    )
    dispatches = common.query(
        db, "SELECT id, schedule_run_id, payload FROM dispatch_outbox WHERE kind = 'soak.tick'"
    )
    runs_per_tick = collections.Counter((r["schedule"], float(r["scheduled_for"])) for r in runs)
    by_run = collections.Counter(d["schedule_run_id"] for d in dispatches)
    by_metadata: collections.Counter[tuple[str, float]] = collections.Counter()
    for row in dispatches:
        payload = row["payload"]
        envelope = json.loads(payload) if isinstance(payload, str | bytes) else payload
        meta = envelope["metadata"]
        by_metadata[(meta["schedule"], _stamp(meta["scheduled_for"]))] += 1
    missing: list[tuple[str, float]] = []
    spans: dict[str, int] = {}
    for name in names:
        ticks = sorted(t for s, t in runs_per_tick if s == name)
        spans[name] = len(ticks)
        if ticks:
            expected = range(int(ticks[0]), int(ticks[-1]) + 1, EVERY_SECONDS)
            missing += [(name, float(t)) for t in expected if float(t) not in set(ticks)]
    return {
        "ticks": len(runs_per_tick),
        "ticks_by_schedule": spans,
        "doubled_runs": sum(1 for n in runs_per_tick.values() if n > 1),
        "runs_without_dispatch": sum(1 for r in runs if by_run[r["id"]] == 0),
        "runs_with_several_dispatches": sum(1 for r in runs if by_run[r["id"]] > 1),
        "dispatches": len(dispatches),
        "dispatches_without_run": sum(1 for d in dispatches if d["schedule_run_id"] is None),
        "doubled_ticks_by_metadata": sum(1 for n in by_metadata.values() if n > 1),
        "metadata_ticks_without_run": len(set(by_metadata) - set(runs_per_tick)),
        "backfilled": sum(1 for r in runs if r["origin"] != "tick"),
        "missing_ticks": len(missing),
        "missing_examples": missing[:5],
        "newest_tick": max((t for _, t in runs_per_tick), default=0.0),
    }


def schedule_soak(
    workdir: Path,
    seconds: float = 8.0,
    workers: int = 3,
    schedules: int = 3,
    kill_every: tuple[float, float] | None = None,
    store: str | None = None,
    seed: int = 5,
) -> dict[str, Any]:
    """``workers`` worker processes with the same ``schedules`` (``every:
    1s``) on one store (a SQLite file in workdir, or the PostgreSQL URL
    given) for ``seconds`` once the first tick fired. With ``kill_every``
    (a range of seconds), one worker at a time, round robin, is SIGKILLed
    at random intervals in that range and a new one started at once."""
    rng = random.Random(seed)
    db: Path | str = store or workdir / "schedules.db"
    errors = workdir / "schedules.log"
    common.make_schema(db)  # type: ignore[arg-type]
    names = schedule_names(schedules)

    def spawn() -> subprocess.Popen[bytes]:
        return common.spawn("schedule-worker", str(db), str(schedules), log=errors, script=__file__)

    started = time.monotonic()
    running = [spawn() for _ in range(workers)]
    kills = 0
    codes: list[int] = []
    try:
        deadline = time.monotonic() + 30
        while not common.query(db, "SELECT 1 FROM schedule_runs LIMIT 1"):
            if time.monotonic() > deadline:
                raise RuntimeError("no tick fired within 30 s of starting the workers")
            time.sleep(0.1)
        end = time.monotonic() + seconds
        next_kill = None if kill_every is None else time.monotonic() + rng.uniform(*kill_every)
        while time.monotonic() < end:
            # No kill in the last seconds: the worker started after it must be
            # up (its SIGTERM handler installed) when the run stops them all.
            late = time.monotonic() > end - RESTART_SETTLE_SECONDS
            if (
                next_kill is not None
                and kill_every is not None
                and not late
                and (time.monotonic() >= next_kill)
            ):
                victim = running.pop(0)
                victim.send_signal(signal.SIGKILL)
                victim.wait()
                kills += 1
                running.append(spawn())
                next_kill = time.monotonic() + rng.uniform(*kill_every)
            time.sleep(0.02)
        alive_at_end = sum(1 for process in running if process.poll() is None)
        stopped_at = time.time()
    finally:
        codes = [common.stop(process) for process in running]
    said = errors.read_text() if errors.exists() else ""
    ticks = tick_figures(db, names)
    figures: dict[str, Any] = {
        "driver": "schedules",
        "engine": "postgresql" if common.is_postgres(db) else "sqlite",
        "workers": workers,
        "schedules": schedules,
        "kills": kills,
        **ticks,
        "newest_tick_age": round(stopped_at - ticks["newest_tick"], 2),
        "failed_fires_logged": said.count(FAILED),
        "workers_alive_at_end": alive_at_end,
        "worker_exits": codes,
        "seconds": round(time.monotonic() - started, 1),
    }
    figures["ok"] = (
        figures["doubled_runs"] == 0
        and figures["runs_without_dispatch"] == 0
        and figures["runs_with_several_dispatches"] == 0
        and figures["dispatches_without_run"] == 0
        and figures["doubled_ticks_by_metadata"] == 0
        and figures["metadata_ticks_without_run"] == 0
        and figures["missing_ticks"] == 0
        and figures["newest_tick_age"] <= 5 * EVERY_SECONDS
        and figures["failed_fires_logged"] == 0
        and alive_at_end == workers
        and codes == [0] * workers
    )
    if not figures["ok"] and said:
        figures["worker_log_tail"] = said[-2000:]
    return figures


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--role":
        role, args = sys.argv[2], sys.argv[3:]
        if role == "schedule-worker":
            role_schedule_worker(args[0], int(args[1]))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("driver", choices=["workers", "kills"])
    parser.add_argument("--seconds", type=float)
    parser.add_argument("--schedules", type=int, default=3)
    parser.add_argument("--store", help="a postgresql:// URL (its tables empty) instead of SQLite")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(dir=common.ROOT) as tmp:
        if args.driver == "workers":
            figures = schedule_soak(
                Path(tmp), args.seconds or 8, schedules=args.schedules, store=args.store
            )
        else:
            figures = schedule_soak(
                Path(tmp),
                args.seconds or 10,
                schedules=args.schedules,
                kill_every=(1.0, 2.0),
                store=args.store,
            )
    print(json.dumps(figures))
    sys.exit(0 if figures["ok"] else 1)


if __name__ == "__main__":
    main()
