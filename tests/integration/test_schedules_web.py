"""What ``/metrics`` and the dashboard show of schedules (docs/schedules.md):
``trio_dispatch_schedule_runs_total`` and
``trio_dispatch_schedule_next_fire_timestamp_seconds`` scraped from a real
worker firing an ``every: 1s`` schedule, and the ``/schedules`` page and
the index page's card -- served over real sockets, on both engines and
both backends."""

from __future__ import annotations

import json
import math
import re
import signal
import sys
import time
from functools import partial
from pathlib import Path

import anyio
import httpx
import pytest

from trio_dispatch.schedules import Schedule
from trio_dispatch.schedules.runs import fire_manual, see, set_paused
from trio_dispatch.store import SQLiteStore
from trio_dispatch.web import WebApp
from trio_dispatch.worker import DispatchWorker

from ..conftest import RawDB
from ..helpers import start_worker, wait_for
from .test_web import metrics_of, nothing, samples, serving

pytestmark = pytest.mark.anyio

HOSTILE_KIND = "<script>alert(1)</script>"


def runs_by_origin(raw: RawDB, name: str) -> dict[str, int]:
    rows = raw.rows(
        "SELECT origin, COUNT(*) AS n FROM schedule_runs WHERE schedule = ? GROUP BY origin",
        (name,),
    )
    return {str(row["origin"]): int(row["n"]) for row in rows}


@pytest.mark.slow  # real seconds of ticks; CI runs it
async def test_metrics_count_a_worker_s_runs_by_outcome_and_give_each_next_fire(
    store: SQLiteStore, raw: RawDB
) -> None:
    # The hourly schedule fires half an hour from the minute the test starts,
    # so, first seen two hours before, it has a missed tick about half an
    # hour old to catch up (backfilled) while the every-1s one fires on
    # time. (The clock is the real one: on PostgreSQL the database's clock
    # decides when a tick is due.)
    clock = time.time
    minute = (time.gmtime(clock()).tm_min + 30) % 60
    fast = Schedule(name="fast", every="1s", kind="tick", deliver_to="ticks")
    hourly = Schedule(name="hourly", cron=f"{minute} * * * *", kind="tick", deliver_to="ticks")
    held = Schedule(name="held", every="1h", kind="tick", deliver_to="ticks")
    await store.write(partial(see, names=["hourly"], now=clock() - 7200))
    await store.write(partial(set_paused, name="held", paused=True, now=clock()))
    worker = DispatchWorker(
        store, transport=nothing, schedules=[fast, hourly, held], clock=clock, tick_seconds=60
    )
    assert worker.scheduler is not None
    scheduler = worker.scheduler
    async with anyio.create_task_group() as tg:
        await tg.start(worker.run)
        await wait_for(lambda: scheduler.fired[("fast", "tick")] >= 2, timeout=10)
        await wait_for(lambda: scheduler.fired[("hourly", "backfilled")] == 1, timeout=10)
        async with serving(WebApp(store, worker=worker)) as client:
            live = metrics_of((await client.get("/metrics")).text)
            scraped_at = clock()
            # Paused, fast fires no more (its next fire goes): then every run
            # it fired is counted, and the counters can be held to the store.
            await store.write(partial(set_paused, name="fast", paused=True, now=clock()))
            await wait_for(lambda: scheduler.next_fire["fast"] is None, timeout=10)
            settled = metrics_of((await client.get("/metrics")).text)
        tg.cancel_scope.cancel()
    runs = live["trio_dispatch_schedule_runs"]
    assert runs.type == "counter"
    live_runs = samples(runs)
    assert (
        live_runs[("trio_dispatch_schedule_runs_total", ("outcome", "fired"), ("schedule", "fast"))]
        >= 2
    )
    next_fire = samples(live["trio_dispatch_schedule_next_fire_timestamp_seconds"])
    assert set(next_fire) == {
        ("trio_dispatch_schedule_next_fire_timestamp_seconds", ("schedule", name))
        for name in ("fast", "hourly")
    }  # held is paused: no next fire
    fast_next = next_fire[
        ("trio_dispatch_schedule_next_fire_timestamp_seconds", ("schedule", "fast"))
    ]
    # a tick a second; one the scheduler is about to fire may lie a little behind
    assert scraped_at - 5 <= fast_next <= scraped_at + 1 and fast_next == math.floor(fast_next)
    hourly_next = next_fire[
        ("trio_dispatch_schedule_next_fire_timestamp_seconds", ("schedule", "hourly"))
    ]
    expected_next = math.floor(scraped_at / 3600) * 3600 + minute * 60
    assert hourly_next == expected_next + (3600 if expected_next <= scraped_at else 0)
    after_pause = samples(settled["trio_dispatch_schedule_next_fire_timestamp_seconds"])
    assert [key[1] for key in after_pause] == [("schedule", "hourly")]
    final = samples(settled["trio_dispatch_schedule_runs"])
    stored = {name: runs_by_origin(raw, name) for name in ("fast", "hourly", "held")}
    assert stored["hourly"] == {"backfilled": 1} and stored["held"] == {}
    outcomes = {"tick": "fired", "backfilled": "backfilled", "manual": "manual"}
    expected = {
        (
            "trio_dispatch_schedule_runs_total",
            ("outcome", outcome),
            ("schedule", name),
        ): float(stored[name].get(origin, 0))
        for name in ("fast", "hourly", "held")
        for origin, outcome in outcomes.items()
    }
    assert {key: value for key, value in final.items() if key[0].endswith("_total")} == expected


async def test_schedule_metrics_appear_only_for_a_worker_with_schedules(
    store: SQLiteStore, raw: RawDB
) -> None:
    plain = DispatchWorker(store, transport=nothing)
    for app in (WebApp(store), WebApp(store, worker=plain)):
        async with serving(app) as client:
            text = (await client.get("/metrics")).text
        assert "trio_dispatch_schedule" not in text
        assert "trio_dispatch_dispatches" in text


# -- the dashboard --------------------------------------------------------------------


def schedule_rows(page: str) -> dict[str, str]:
    table = re.search(r"<table id=schedules>.*?</table>", page, re.S)
    assert table is not None, page
    rows = re.findall(r"<tr>(.*?)</tr>", table.group(0), re.S)[1:]  # after the heading
    return {re.search(r">([^<]*)</td>", row).group(1): row for row in rows}  # type: ignore[union-attr]


async def test_the_schedules_page_lists_each_schedule_with_its_state_escaped(
    store: SQLiteStore, raw: RawDB
) -> None:
    nightly = Schedule(
        name="nightly-report",
        cron="30 2 * * *",
        timezone="Europe/Berlin",
        kind=HOSTILE_KIND,
        deliver_to="<b>reports</b>",
    )
    hourly = Schedule(name="hourly", every="1h", kind="tick", deliver_to="ticks")
    never = Schedule(name="never-seen", every="5m", kind="tick", deliver_to="ticks")
    now = time.time()
    run = await store.write(partial(fire_manual, schedule=nightly, now=now))
    await store.write(partial(set_paused, name="hourly", paused=True, now=now))
    # Another deploy's definition of hourly is in force.
    raw.execute(
        "UPDATE dispatch_schedules SET definition = 'ffffffffffffffff' WHERE name = 'hourly'"
    )
    before = raw.rows("SELECT * FROM dispatch_schedules ORDER BY name")
    app = WebApp(store, schedules=[nightly, hourly, never])
    async with serving(app) as client:
        response = await client.get("/schedules")
        home = (await client.get("/")).text
    assert response.status_code == 200
    assert "default-src 'none'" in response.headers["content-security-policy"]
    page = response.text
    rows = schedule_rows(page)
    assert list(rows) == ["nightly-report", "hourly", "never-seen"]
    first = rows["nightly-report"]
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in first and "<script>" not in page
    assert "&lt;b&gt;reports&lt;/b&gt;" in first and "<b>reports" not in page
    assert "cron 30 2 * * *" in first and "Europe/Berlin" in first
    assert 'badge active">active<' in first and "<td>manual</td>" in first
    assert time.strftime("%Y-%m-%dT", time.gmtime(run.scheduled_for)) in first
    assert re.search(r"T<wbr>0[01]:30:00Z", first)  # next fire: 02:30 in Berlin, in UTC
    paused = rows["hourly"]
    assert 'badge paused">paused<' in paused and "every 1h" in paused
    assert 'badge other_definition">other definition<' in paused
    assert "other definition" not in first
    assert paused.endswith("<td class=when>-</td>")  # paused: no next fire
    fresh = rows["never-seen"]
    assert "<td>-</td>" in fresh and 'badge active">active<' in fresh
    tick = (math.floor(time.time() / 300) + 1) * 300
    assert any(time.strftime("%H:%M:%SZ", time.gmtime(t)) in fresh for t in (tick, tick + 300))
    card = re.search(
        r'id=schedules-card><a href="/schedules"><div class=n>([^<]*)</div>'
        r"<div class=l>schedules, ([^<]*) paused</div>",
        home,
    )
    assert card is not None and card.groups() == ("3", "1")
    # reading the page records nothing (never-seen stays unseen)
    assert raw.rows("SELECT * FROM dispatch_schedules ORDER BY name") == before


async def test_the_dashboard_takes_a_worker_s_schedules_and_shows_none_without(
    store: SQLiteStore, raw: RawDB
) -> None:
    fast = Schedule(name="fast", every="1s", kind="tick", deliver_to="ticks")
    worker = DispatchWorker(store, transport=nothing, schedules=[fast])
    async with serving(WebApp(store, worker=worker)) as client:
        assert list(schedule_rows((await client.get("/schedules")).text)) == ["fast"]
        home = (await client.get("/")).text
    assert "id=schedules-card" in home and ">1</div><div class=l>schedules, 0 paused" in home
    async with serving(WebApp(store)) as client:
        page = (await client.get("/schedules")).text
        bare = (await client.get("/")).text
    assert "No schedules configured" in page and "<table id=schedules>" not in page
    assert "id=schedules-card" not in bare


@pytest.mark.sqlite_only
def test_the_worker_command_serves_its_schedules_metrics_and_page(
    tmp_path: Path, db_path: Path
) -> None:
    config = tmp_path / "trio-dispatch.yaml"
    config.write_text(
        f"store: {db_path}\n"
        f"dispatch:\n  notify_template: [{json.dumps(sys.executable)}, -c, pass]\n"
        "http:\n  listen: 127.0.0.1:0\n"
        "schedules:\n  fast:\n    every: 1s\n    kind: tick\n    deliver_to: ticks\n",
        encoding="utf-8",
    )
    key = ("trio_dispatch_schedule_runs_total", ("outcome", "fired"), ("schedule", "fast"))
    with start_worker(config) as worker:
        try:
            assert worker.stderr is not None
            line = ""
            deadline = time.monotonic() + 60
            while "dashboard at " not in line and time.monotonic() < deadline:
                line = worker.stderr.readline()
                assert line, f"the worker ended (exit {worker.poll()})"
            base = line.split("dashboard at ", 1)[1].split()[0].rstrip("/")
            fired = 0.0
            deadline = time.monotonic() + 20
            while fired < 2 and time.monotonic() < deadline:
                time.sleep(0.2)
                text = httpx.get(base + "/metrics", timeout=10).text
                fired = samples(metrics_of(text)["trio_dispatch_schedule_runs"]).get(key, 0.0)
            assert fired >= 2
            page = httpx.get(base + "/schedules", timeout=10).text
            assert list(schedule_rows(page)) == ["fast"] and "<td>tick</td>" in page
        finally:
            worker.send_signal(signal.SIGINT)
            try:
                worker.wait(timeout=30)
            finally:
                worker.kill()
    assert worker.returncode == 0
