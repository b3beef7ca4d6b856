"""``trio-dispatch schedules`` (docs/schedules.md): the listing (read-only,
like every read command), pause and resume kept in the store, manual runs,
and names the configuration does not hold -- on both engines; and a worker
running in this process that obeys a pause made from the command line."""

from __future__ import annotations

import hashlib
import json
import math
import sqlite3
import time
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest

from trio_dispatch import open_store
from trio_dispatch.config import load_config
from trio_dispatch.schedules import Schedule
from trio_dispatch.schedules import service as schedule_service
from trio_dispatch.store import SQLiteStore
from trio_dispatch.worker import DispatchWorker

from ..conftest import RawDB
from ..helpers import arun_cli, assert_one_line_error, run_cli, wait_for
from .test_web import running

SCHEDULES = """\
schedules:
  nightly-report:
    cron: "30 2 * * *"
    timezone: Europe/Berlin
    kind: report.nightly
    deliver_to: reports
    body: {format: pdf}
  hourly:
    every: 1h
    kind: tick.hourly
    deliver_to: ticks
"""


def write_config(tmp_path: Path, target: str, schedules: str = SCHEDULES) -> Path:
    config = tmp_path / "trio-dispatch.yaml"
    config.write_text(f"store: {json.dumps(target)}\n{schedules}", encoding="utf-8")
    return config


def migrate(target: str) -> None:
    async def create() -> None:
        async with open_store(target):
            pass

    anyio.run(create)


def file_state(path: Path) -> tuple[str, list[str]]:
    return (
        hashlib.sha256(path.read_bytes()).hexdigest(),
        sorted(p.name for p in path.parent.iterdir()),
    )


def listed(config: Path) -> dict[str, dict[str, Any]]:
    done = run_cli("--config", str(config), "schedules", "--json")
    assert done.returncode == 0, done.stderr
    return {entry["name"]: entry for entry in json.loads(done.stdout)["schedules"]}


def test_schedules_lists_each_configured_schedule_with_its_cadence_and_next_fire(
    tmp_path: Path, db_target: str
) -> None:
    migrate(db_target)
    config = write_config(tmp_path, db_target)
    done = run_cli("--config", str(config), "schedules")
    assert done.returncode == 0, done.stderr
    header, *rows = done.stdout.splitlines()
    assert header.split() == [
        "NAME", "SCHEDULE", "TIMEZONE", "PAUSED", "LAST_TICK", "FIRED_AT", "ORIGIN", "NEXT",
        "DEFINITION",
    ]  # fmt: skip
    assert [row.split()[0] for row in rows] == ["nightly-report", "hourly"]
    assert "cron 30 2 * * *  Europe/Berlin  no" in rows[0]
    assert "every 1h" in rows[1] and " UTC " in rows[1]
    entries = listed(config)
    nightly, hourly = entries["nightly-report"], entries["hourly"]
    assert (nightly["cron"], nightly["every"], nightly["timezone"]) == (
        "30 2 * * *",
        None,
        "Europe/Berlin",
    )
    assert (hourly["cron"], hourly["every"], hourly["timezone"]) == (None, "1h", "UTC")
    assert nightly["paused"] is False and nightly["last_fire"] is None
    assert nightly["first_seen_at"] is None  # no worker has seen it
    assert nightly["next_fire"].endswith(("01:30:00Z", "00:30:00Z"))  # 02:30 in Berlin
    after = (math.floor(time.time() / 3600) + 1) * 3600  # the next hour, or the one after
    hours = {time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(after + n * 3600)) for n in (0, 1)}
    assert hourly["next_fire"] in hours


def test_the_listing_writes_nothing(
    tmp_path: Path, db_target: str, raw: RawDB, engine: str
) -> None:
    migrate(db_target)
    config = write_config(tmp_path, db_target)
    assert run_cli("--config", str(config), "schedules", "run", "hourly").returncode == 0
    assert run_cli("--config", str(config), "schedules", "pause", "hourly").returncode == 0
    before = raw.rows("SELECT * FROM dispatch_schedules ORDER BY name")
    state = file_state(Path(db_target)) if engine == "sqlite" else None
    for argv in (["schedules"], ["schedules", "--json"], ["schedules", "--wide"]):
        done = run_cli("--config", str(config), *argv)
        assert done.returncode == 0, done.stderr
    # nightly-report was never seen by a worker: the listing does not record it
    assert raw.rows("SELECT * FROM dispatch_schedules ORDER BY name") == before
    assert [row["name"] for row in before] == ["hourly"]
    if state is not None:
        assert file_state(Path(db_target)) == state  # not a byte, no -wal/-shm


@pytest.mark.sqlite_only
def test_the_listing_on_a_store_no_one_migrated_names_migrate_and_changes_nothing(
    tmp_path: Path, db_path: Path
) -> None:
    config = write_config(tmp_path, str(db_path))
    missing = run_cli("--config", str(config), "schedules")
    assert_one_line_error(missing, 2, "does not exist")
    assert not db_path.exists()
    db_path.touch()
    empty = run_cli("--config", str(config), "schedules")
    assert_one_line_error(empty, 2, "trio-dispatch migrate")
    assert db_path.stat().st_size == 0
    migrate(str(db_path))

    conn = sqlite3.connect(db_path)
    conn.execute("DELETE FROM trio_dispatch_schema WHERE version > 6")
    conn.commit()
    conn.close()
    before = file_state(db_path)
    for argv in (["schedules"], ["schedules", "pause", "hourly"], ["schedules", "run", "hourly"]):
        older = run_cli("--config", str(config), *argv)
        assert_one_line_error(older, 2, "schema version 6", "trio-dispatch migrate")
    assert file_state(db_path) == before


@pytest.mark.postgres_only
def test_the_listing_on_a_database_no_one_migrated_names_migrate_and_creates_nothing(
    tmp_path: Path, fresh_target: str
) -> None:
    import psycopg

    config = write_config(tmp_path, fresh_target)
    for argv in (["schedules"], ["schedules", "pause", "hourly"]):
        done = run_cli("--config", str(config), *argv)
        assert_one_line_error(done, 2, "no trio_dispatch schema", "trio-dispatch migrate")
    with psycopg.connect(fresh_target) as conn:
        tables = conn.execute("SELECT count(*) FROM pg_tables WHERE schemaname = 'public'")
        assert tables.fetchone() == (0,)


def test_pause_and_resume_are_kept_in_the_store(tmp_path: Path, db_target: str, raw: RawDB) -> None:
    migrate(db_target)
    config = write_config(tmp_path, db_target)
    paused = run_cli("--config", str(config), "schedules", "pause", "nightly-report")
    assert paused.returncode == 0, paused.stderr
    assert paused.stdout.strip() == "paused schedule nightly-report"
    rows = raw.rows("SELECT name, paused, last_tick FROM dispatch_schedules")
    assert [(r["name"], int(r["paused"]), r["last_tick"]) for r in rows] == [
        ("nightly-report", 1, None)
    ]
    entry = listed(config)["nightly-report"]
    assert entry["paused"] is True and entry["next_fire"] is None
    text = run_cli("--config", str(config), "schedules").stdout
    assert text.splitlines()[1].split()[-2:] == ["paused", "-"]  # no worker recorded one
    again = run_cli("--config", str(config), "schedules", "pause", "nightly-report", "--json")
    assert again.returncode == 0
    assert json.loads(again.stdout) == {
        "schedule": "nightly-report",
        "paused": True,
        "changed": False,
    }
    resumed = run_cli("--config", str(config), "schedules", "--json", "resume", "nightly-report")
    assert json.loads(resumed.stdout)["changed"] is True
    paused_again = run_cli("--config", str(config), "schedules", "pause", "nightly-report")
    assert paused_again.returncode == 0
    text_resume = run_cli("--config", str(config), "schedules", "resume", "nightly-report")
    assert text_resume.stdout.strip() == (
        "resumed schedule nightly-report (running workers take it up within 10s; "
        "its missed ticks follow missed: latest)"
    )
    assert int(raw.scalar("SELECT paused FROM dispatch_schedules")) == 0
    assert listed(config)["nightly-report"]["paused"] is False
    plain = run_cli("--config", str(config), "schedules", "resume", "nightly-report")
    assert plain.stdout.strip() == "schedule nightly-report was already not paused: nothing to do"


def test_run_fires_one_manual_run_and_prints_its_dispatch_id(
    tmp_path: Path, db_target: str, raw: RawDB
) -> None:
    migrate(db_target)
    config = write_config(tmp_path, db_target)
    done = run_cli("--config", str(config), "schedules", "run", "nightly-report")
    assert done.returncode == 0, done.stderr
    prefix = "ran schedule nightly-report (manual): dispatch "
    assert done.stdout.startswith(prefix)
    dispatch_id = done.stdout.strip().removeprefix(prefix)
    row = raw.row(dispatch_id)
    assert (row["kind"], row["deliver_to"], row["status"]) == (
        "report.nightly",
        "reports",
        "pending",
    )
    payload = json.loads(str(row["payload"]))
    assert payload["metadata"]["manual"] is True and payload["metadata"]["backfilled"] is False
    assert payload["metadata"]["schedule"] == "nightly-report"
    runs = raw.rows("SELECT id, schedule, origin FROM schedule_runs")
    assert [(r["schedule"], r["origin"]) for r in runs] == [("nightly-report", "manual")]
    assert row["schedule_run_id"] == runs[0]["id"]
    # not a tick: the schedule's cursor is where it was
    assert raw.scalar("SELECT last_tick FROM dispatch_schedules") is None
    last = listed(config)["nightly-report"]["last_fire"]
    assert last["origin"] == "manual"
    second = run_cli("--config", str(config), "schedules", "run", "nightly-report", "--json")
    document = json.loads(second.stdout)
    assert document["origin"] == "manual" and document["dispatch_id"] != dispatch_id
    assert raw.scalar("SELECT COUNT(*) FROM schedule_runs") == 2


@pytest.mark.parametrize("action", ["pause", "resume", "run"])
def test_a_name_not_in_the_configuration_exits_1_naming_it(
    tmp_path: Path, db_target: str, raw: RawDB, action: str
) -> None:
    migrate(db_target)
    config = write_config(tmp_path, db_target)
    done = run_cli("--config", str(config), "schedules", action, "nightly")
    assert_one_line_error(done, 1, "'nightly'", "configured: nightly-report, hourly")
    assert raw.scalar("SELECT COUNT(*) FROM dispatch_schedules") == 0
    assert raw.scalar("SELECT COUNT(*) FROM schedule_runs") == 0
    hostile = run_cli("--config", str(config), "schedules", action, "a\x1b[31mb")
    assert "\x1b" not in assert_one_line_error(hostile, 1, "schedule named")


def test_without_a_configuration_nothing_is_configured(db_target: str) -> None:
    migrate(db_target)
    done = run_cli("--db", db_target, "schedules")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "no schedules configured (the configuration's schedules: section)"
    assert json.loads(run_cli("--db", db_target, "schedules", "--json").stdout) == {"schedules": []}
    assert_one_line_error(
        run_cli("--db", db_target, "schedules", "run", "hourly"), 1, "'hourly'", "configured: none"
    )


# -- a running worker obeys the store's flag -------------------------------------------


@pytest.mark.anyio
@pytest.mark.slow  # real seconds of ticks; CI runs it
# The worker's clock jumps hours ahead: SQLite takes the process's clock as
# the store's; on PostgreSQL the database's clock decides (the test below).
@pytest.mark.sqlite_only
async def test_a_running_worker_stops_firing_a_paused_schedule_and_catches_up_when_resumed(
    tmp_path: Path,
    store: SQLiteStore,
    db_target: str,
    raw: RawDB,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The worker's clock runs ahead of the wall clock by ``shift``: it starts
    # a second before an hour's tick, and jumps hours on while paused.
    monkeypatch.setattr(schedule_service, "REFRESH_SECONDS", 0.2)
    config = write_config(tmp_path, db_target)
    _, hourly = _schedules(config)
    start = time.time()
    tick = (math.floor(start / 3600) + 2) * 3600.0
    shift = [tick - 1.0 - start]

    def clock() -> float:
        return time.time() + shift[0]

    async def nothing(delivery: Any) -> None:
        pass

    def runs() -> list[tuple[float, str]]:
        rows = raw.rows("SELECT scheduled_for, origin FROM schedule_runs ORDER BY created_at")
        return [(float(r["scheduled_for"]), str(r["origin"])) for r in rows]

    worker = DispatchWorker(store, transport=nothing, schedules=[hourly], clock=clock)
    scheduler = worker.scheduler
    assert scheduler is not None
    async with anyio.create_task_group() as tg:
        await tg.start(worker.run)
        await wait_for(lambda: runs() == [(tick, "tick")], timeout=10)
        paused = await arun_cli("--config", str(config), "schedules", "pause", "hourly")
        assert paused.returncode == 0, paused.stderr
        await wait_for(lambda: scheduler.next_fire["hourly"] is None, timeout=5)
        shift[0] += 2 * 3600 + 1800  # two ticks pass while paused, the newest 30 min ago
        await anyio.sleep(1.0)
        assert runs() == [(tick, "tick")]  # paused: nothing fired
        resumed = await arun_cli("--config", str(config), "schedules", "resume", "hourly")
        assert resumed.returncode == 0, resumed.stderr
        # missed: latest -- the newest missed tick once, flagged backfilled
        await wait_for(lambda: len(runs()) == 2, timeout=5)
        await anyio.sleep(0.5)
        tg.cancel_scope.cancel()
    assert runs() == [(tick, "tick"), (tick + 2 * 3600, "backfilled")]
    assert scheduler.fired == {("hourly", "tick"): 1, ("hourly", "backfilled"): 1}
    assert float(raw.scalar("SELECT last_tick FROM dispatch_schedules")) == tick + 2 * 3600
    entry = json.loads((await arun_cli("--config", str(config), "schedules", "--json")).stdout)[
        "schedules"
    ][1]
    assert entry["last_fire"]["origin"] == "backfilled" and entry["paused"] is False


@pytest.mark.anyio
@pytest.mark.slow  # real seconds of ticks; CI runs it
@pytest.mark.postgres_only
async def test_a_running_worker_on_postgres_stops_firing_a_paused_schedule_until_resumed(
    tmp_path: Path,
    store: SQLiteStore,
    db_target: str,
    raw: RawDB,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(schedule_service, "REFRESH_SECONDS", 0.2)
    config = write_config(tmp_path, db_target, SCHEDULES + "  beat:\n    every: 1s\n"
                          "    kind: tick.beat\n    deliver_to: ticks\n")  # fmt: skip
    beat = _schedules(config)[2]

    async def nothing(delivery: Any) -> None:
        pass

    def ticks() -> list[float]:
        rows = raw.rows("SELECT scheduled_for FROM schedule_runs ORDER BY scheduled_for")
        return [float(r["scheduled_for"]) for r in rows]

    worker = DispatchWorker(store, transport=nothing, schedules=[beat])
    scheduler = worker.scheduler
    assert scheduler is not None
    async with anyio.create_task_group() as tg:
        await tg.start(worker.run)
        await wait_for(lambda: len(ticks()) >= 1, timeout=10)
        paused = await arun_cli("--config", str(config), "schedules", "pause", "beat")
        assert paused.returncode == 0, paused.stderr
        await wait_for(lambda: scheduler.next_fire["beat"] is None, timeout=5)
        held = ticks()
        await anyio.sleep(2.5)
        assert ticks() == held  # paused: nothing fired
        resumed = await arun_cli("--config", str(config), "schedules", "resume", "beat")
        assert resumed.returncode == 0, resumed.stderr
        resumed_at = time.time()
        await wait_for(lambda: len(ticks()) > len(held), timeout=5)
        tg.cancel_scope.cancel()
    # missed: latest, with an on-time tick: the ticks missed while paused pass.
    after = ticks()[len(held) :]
    assert after[0] >= resumed_at - 1.5 and after[0] >= held[-1] + 2


def _schedules(config: Path) -> list[Schedule]:
    return list(load_config(config).schedules)


# -- the web command ---------------------------------------------------------------------


@pytest.mark.sqlite_only
def test_the_web_command_shows_the_configuration_s_schedules_and_writes_nothing(
    tmp_path: Path, db_path: Path
) -> None:

    migrate(str(db_path))
    config = write_config(tmp_path, str(db_path))
    assert run_cli("--config", str(config), "schedules", "pause", "hourly").returncode == 0
    before = file_state(db_path)
    argv = ["--config", str(config), "web", "--listen", "127.0.0.1:0"]
    with running(argv, tmp_path, r"dashboard \(read-only\) at (http://\S+)/") as (url, web):
        page = httpx.get(url + "/schedules", timeout=30)
        home = httpx.get(url + "/", timeout=30).text
        assert page.status_code == 200
        assert "nightly-report" in page.text and 'badge paused">paused<' in page.text
        assert ">2</div><div class=l>schedules, 1 paused" in home
        assert file_state(db_path) == before
    assert web.returncode == 0


# -- definitions the store holds -------------------------------------------------------


def record_definition(target: str, name: str, fingerprint: str) -> None:
    """What a worker with this definition of ``name`` records at its start."""
    from trio_dispatch.schedules.runs import reconcile

    async def settle() -> None:
        async with open_store(target) as db:
            await db.write(
                lambda conn: reconcile(conn, {name: fingerprint}, time.time(), 60.0, 10.0)
            )

    anyio.run(settle)


def test_the_listing_shows_when_another_definition_is_in_force(
    tmp_path: Path, db_target: str
) -> None:
    migrate(db_target)
    config = write_config(tmp_path, db_target)
    nightly, hourly = _schedules(config)
    record_definition(db_target, "hourly", hourly.fingerprint)
    record_definition(db_target, "nightly-report", "0123456789abcdef")  # another deploy's
    rows = run_cli("--config", str(config), "schedules").stdout.splitlines()[1:]
    # NEXT is "-" where another definition's ticks fire, then the DEFINITION column
    assert rows[0].split()[-5:] == ["-", "differs:", "0123456789abcdef", "in", "force"], rows
    assert rows[1].split()[-2:] == ["in", "force"] and "differs" not in rows[1], rows
    entries = listed(config)
    assert entries["nightly-report"]["fingerprint"] == nightly.fingerprint
    assert entries["nightly-report"]["definition_in_force"] == "0123456789abcdef"
    assert entries["nightly-report"]["definition_differs"] is True
    assert entries["nightly-report"]["next_fire"] is None  # this definition's ticks do not fire
    assert entries["hourly"]["definition_in_force"] == hourly.fingerprint
    assert entries["hourly"]["definition_differs"] is False
    assert entries["hourly"]["next_fire"] is not None
    document = json.loads(run_cli("check-config", str(config), "--json").stdout)
    assert [s["fingerprint"] for s in document["schedules"]] == [
        nightly.fingerprint,
        hourly.fingerprint,
    ]


def test_pause_and_resume_take_a_name_the_store_knows_and_this_configuration_lacks(
    tmp_path: Path, db_target: str, raw: RawDB
) -> None:
    migrate(db_target)
    config = write_config(tmp_path, db_target)
    record_definition(db_target, "retired", "0123456789abcdef")  # another deploy's schedule
    paused = run_cli("--config", str(config), "schedules", "pause", "retired")
    assert paused.returncode == 0, paused.stderr
    assert paused.stdout.strip() == "paused schedule retired (not in this configuration)"
    assert int(raw.scalar("SELECT paused FROM dispatch_schedules WHERE name = 'retired'")) == 1
    resumed = run_cli("--config", str(config), "schedules", "resume", "retired", "--json")
    assert resumed.returncode == 0, resumed.stderr
    assert json.loads(resumed.stdout) == {"schedule": "retired", "paused": False, "changed": True}
    assert int(raw.scalar("SELECT paused FROM dispatch_schedules WHERE name = 'retired'")) == 0
    # A name neither holds is still exit 1, and nothing is written.
    before = raw.rows("SELECT * FROM dispatch_schedules ORDER BY name")
    for action in ("pause", "resume", "run"):
        done = run_cli("--config", str(config), "schedules", action, "nowhere")
        assert_one_line_error(done, 1, "'nowhere'", "configured: nightly-report, hourly")
    assert raw.rows("SELECT * FROM dispatch_schedules ORDER BY name") == before
    # run needs the definition: a name only the store knows cannot be run from here.
    ran = run_cli("--config", str(config), "schedules", "run", "retired")
    assert_one_line_error(ran, 1, "'retired'", "in the configuration")
    assert raw.scalar("SELECT COUNT(*) FROM schedule_runs") == 0
