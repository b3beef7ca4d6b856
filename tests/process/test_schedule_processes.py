"""Schedules (docs/schedules.md) under real worker processes (scripts/schedule_soak.py):
three workers with the same ``every: 1s`` schedules on one store fire each
tick exactly once, left alone and with one of them SIGKILLed and restarted
every second or two; a rolling deploy that changes a schedule fires each
tick with one definition; on SQLite and on PostgreSQL."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import pytest

from ..conftest import RawDB
from ..helpers import load_script

schedule_soak = load_script("schedule_soak")


def _assert_each_tick_once(figures: dict[str, Any], seconds: float, engine: str) -> None:
    assert figures["engine"] == ("sqlite" if engine == "sqlite" else "postgresql")
    assert figures["doubled_runs"] == 0 and figures["doubled_ticks_by_metadata"] == 0, figures
    assert figures["runs_without_dispatch"] == 0, figures
    assert figures["runs_with_several_dispatches"] == 0, figures
    assert figures["dispatches_without_run"] == 0, figures
    assert figures["metadata_ticks_without_run"] == 0, figures
    assert figures["dispatches"] == figures["ticks"], figures
    assert figures["missing_ticks"] == 0, figures
    # A tick a loaded worker reaches late fires backfilled (missed: all), once.
    assert figures["backfilled"] <= figures["ticks"] // 4, figures
    # Fired throughout: every schedule has about one tick a second, to the end
    # (a little slack for a loaded machine, where a fire may come late).
    assert min(figures["ticks_by_schedule"].values()) >= seconds - 2, figures
    assert figures["newest_tick_age"] <= 5, figures
    assert figures["failed_fires_logged"] == 0, figures
    assert figures["workers_alive_at_end"] == 3 and figures["worker_exits"] == [0] * 3, figures
    assert figures["ok"], figures


@pytest.mark.slow
def test_three_worker_processes_fire_each_tick_exactly_once(
    tmp_path: Path, db_target: str, engine: str
) -> None:
    seconds = 6.0
    figures = schedule_soak.schedule_soak(
        tmp_path,
        seconds=seconds,
        workers=3,
        schedules=3,
        store=None if engine == "sqlite" else db_target,
    )
    _assert_each_tick_once(figures, seconds, engine)


@pytest.mark.slow
def test_a_worker_sigkilled_every_second_or_two_loses_no_tick_and_doubles_none(
    tmp_path: Path, db_target: str, engine: str
) -> None:
    seconds = 12.0  # kills stop 4 s before the end
    figures = schedule_soak.schedule_soak(
        tmp_path,
        seconds=seconds,
        workers=3,
        schedules=3,
        kill_every=(1.0, 2.0),
        store=None if engine == "sqlite" else db_target,
    )
    _assert_each_tick_once(figures, seconds, engine)
    assert figures["kills"] >= 4, figures


def test_the_check_sees_a_missing_tick_and_a_tick_with_two_dispatches(tmp_path: Path) -> None:
    import anyio

    from trio_dispatch import open_store
    from trio_dispatch.schedules import Schedule
    from trio_dispatch.schedules.runs import fire, see

    db = tmp_path / "check.db"
    names = schedule_soak.schedule_names(1)
    schedule = Schedule(name=names[0], kind="soak.tick", deliver_to="ticks", every="1s")

    async def fire_ticks() -> None:
        async with open_store(db) as store:
            await store.write(lambda conn: see(conn, names, 99.0))
            for tick in (100.0, 101.0, 102.0, 103.0):
                await store.write(partial(fire, work=[(schedule, [(tick, False)], tick)], now=tick))

    anyio.run(fire_ticks)
    figures = schedule_soak.tick_figures(db, names)
    assert (figures["ticks"], figures["missing_ticks"], figures["dispatches"]) == (4, 0, 4)
    runs = schedule_soak.common.query(db, "SELECT id FROM schedule_runs ORDER BY scheduled_for")
    # Tick 101 loses its run and dispatch; tick 103's dispatch moves to tick 100's run.
    schedule_soak.common.query(
        db, "DELETE FROM dispatch_outbox WHERE schedule_run_id = ?", (runs[1]["id"],)
    )
    schedule_soak.common.query(db, "DELETE FROM schedule_runs WHERE id = ?", (runs[1]["id"],))
    schedule_soak.common.query(
        db,
        "UPDATE dispatch_outbox SET schedule_run_id = ? WHERE schedule_run_id = ?",
        (runs[0]["id"], runs[3]["id"]),
    )
    figures = schedule_soak.tick_figures(db, names)
    assert figures["missing_ticks"] == 1 and figures["missing_examples"] == [(names[0], 101.0)]
    assert figures["runs_with_several_dispatches"] == 1, figures
    assert figures["runs_without_dispatch"] == 1, figures


def _deploy(tmp_path: Path, name: str, target: str, every: str, kind: str) -> Path:
    config = tmp_path / f"{name}.yaml"
    config.write_text(
        json.dumps(  # JSON is YAML
            {
                "store": target,
                "dispatch": {"notify_template": ["true"]},
                "worker": {"tick_seconds": 3600, "grace_seconds": 0.3},
                "schedules": {"beat": {"every": every, "kind": kind, "deliver_to": "d"}},
                "log_level": "INFO",
            }
        )
    )
    return config


def _until(predicate: Callable[[], bool], timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def _start_logged(config: Path, log: Path) -> tuple[subprocess.Popen[bytes], Path]:
    """A worker process whose log goes to ``log``, which the test reads while
    it runs (a pipe would be read only once it stops)."""
    with log.open("wb") as file:
        worker = subprocess.Popen(
            [sys.executable, "-m", "trio_dispatch", "--config", str(config), "worker"],
            stdout=subprocess.DEVNULL,
            stderr=file,
        )
    return worker, log


def _stop_logged(worker: subprocess.Popen[bytes], log: Path) -> str:
    worker.send_signal(signal.SIGTERM)
    worker.wait(timeout=30)
    said = log.read_text()
    assert worker.returncode == 0, said
    return said


@pytest.mark.slow
def test_a_rolling_deploy_that_changes_a_schedule_fires_each_tick_with_one_definition(
    tmp_path: Path, db_target: str, raw: RawDB
) -> None:
    def kinds() -> list[tuple[float, str]]:
        rows = raw.rows(
            "SELECT r.scheduled_for, d.kind FROM schedule_runs r "
            "JOIN dispatch_outbox d ON d.schedule_run_id = r.id ORDER BY r.scheduled_for"
        )
        return [(float(row["scheduled_for"]), str(row["kind"])) for row in rows]

    def count(kind: str) -> int:
        return [k for _, k in kinds()].count(kind)

    import anyio

    from trio_dispatch import open_store

    async def migrate() -> None:
        async with open_store(db_target):
            pass

    anyio.run(migrate)
    old = _deploy(tmp_path, "old", db_target, "1s", "old")
    new = _deploy(tmp_path, "new", db_target, "2s", "new")
    logs = tmp_path / "logs"
    logs.mkdir()
    running, old_log = _start_logged(old, logs / "old.log")
    try:
        _until(lambda: count("old") >= 2)
        # the deploy starts a worker with the new definition
        deployed, new_log = _start_logged(new, logs / "new.log")
        try:
            _until(lambda: count("new") >= 2)
            _until(lambda: "is not this worker's" in old_log.read_text())
            said_old = _stop_logged(running, old_log)  # ... and stops the old one
            # A straggler with the old definition restarts: it takes nothing back.
            running, again_log = _start_logged(old, logs / "again.log")
            _until(lambda: "is not this worker's" in again_log.read_text())
            seen = count("new")
            _until(lambda: count("new") >= seen + 2)
            said_again = _stop_logged(running, again_log)
        finally:
            if deployed.poll() is None:
                _until(lambda: "is now the one in force" in new_log.read_text())
                said_new = _stop_logged(deployed, new_log)
    finally:
        if running.poll() is None:
            running.kill()
            running.wait()
    fired = kinds()
    order = [kind for _, kind in fired]
    switch = order.index("new")
    assert order == ["old"] * switch + ["new"] * (len(order) - switch), fired
    assert all(tick % 2 == 0 for tick, kind in fired if kind == "new"), fired
    for said in (said_old, said_again):
        assert said.count("is not this worker's") == 1, said
    assert said_new.count("is now the one in force") == 1, said_new
