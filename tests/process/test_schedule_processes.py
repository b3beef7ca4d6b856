"""Schedules (SPEC 14) under real worker processes (scripts/schedule_soak.py):
three workers with the same ``every: 1s`` schedules on one store fire each
tick exactly once, left alone and with one of them SIGKILLed and restarted
every second or two; on SQLite and on PostgreSQL."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest


def _driver() -> ModuleType:
    path = Path(__file__).resolve().parents[2] / "scripts" / "schedule_soak.py"
    spec = importlib.util.spec_from_file_location("schedule_soak_driver", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["schedule_soak_driver"] = module
    spec.loader.exec_module(module)
    return module


schedule_soak = _driver()


def _assert_each_tick_once(figures: dict[str, Any], seconds: float, engine: str) -> None:
    assert figures["engine"] == ("sqlite" if engine == "sqlite" else "postgresql")
    assert figures["doubled_runs"] == 0 and figures["doubled_ticks_by_metadata"] == 0, figures
    assert figures["runs_without_dispatch"] == 0, figures
    assert figures["runs_with_several_dispatches"] == 0, figures
    assert figures["dispatches_without_run"] == 0, figures
    assert figures["metadata_ticks_without_run"] == 0, figures
    assert figures["dispatches"] == figures["ticks"], figures
    assert figures["missing_ticks"] == 0, figures
    assert figures["backfilled"] == 0, figures
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
    seconds = 10.0
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
