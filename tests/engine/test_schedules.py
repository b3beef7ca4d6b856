"""Schedules on a real store (docs/schedules.md), both engines and both backends: one
dispatch per tick however many schedulers race, missed ticks by policy,
pause and resume, manual runs, the envelope and history, pruning."""

from __future__ import annotations

import json
import logging
import time
from collections import Counter
from functools import partial
from typing import Any

import anyio
import pytest

from trio_dispatch import DispatchWorker, deliver_due_dispatches, open_store, prune_dispatches
from trio_dispatch.attempt import Delivery, TransportResult
from trio_dispatch.schedules import Schedule, Scheduler
from trio_dispatch.schedules.runs import (
    fire,
    fire_manual,
    iso,
    reconcile,
    see,
    set_paused,
    states,
)
from trio_dispatch.schedules.service import MAX_FAILURE_BACKOFF_SECONDS, failure_backoff
from trio_dispatch.schedules.spec import MAX_BACKFILL_RUNS, plan
from trio_dispatch.store import SQLiteStore

from ..conftest import RawDB
from ..helpers import wait_for

pytestmark = pytest.mark.anyio
log = logging.getLogger("tests.schedules")
HOUR = 3600.0


def every(name: str = "s", period: str = "1s", **fields: Any) -> Schedule:
    return Schedule(name=name, every=period, kind="tick", deliver_to="d", **fields)


def runs(raw: RawDB) -> list[dict[str, Any]]:
    return raw.rows(
        "SELECT r.schedule, r.scheduled_for, r.origin, d.id AS dispatch_id, d.payload "
        "FROM schedule_runs r LEFT JOIN dispatch_outbox d ON d.schedule_run_id = r.id "
        "ORDER BY r.scheduled_for"
    )


def metadata(row: dict[str, Any]) -> dict[str, Any]:
    payload = row["payload"]
    return (
        dict(json.loads(payload)["metadata"]) if isinstance(payload, str) else payload["metadata"]
    )


async def run_for(seconds: float, *schedulers: Scheduler) -> None:
    async with anyio.create_task_group() as tg:
        for scheduler in schedulers:
            tg.start_soon(scheduler.run)
        await anyio.sleep(seconds)
        tg.cancel_scope.cancel()


@pytest.mark.slow  # real seconds of ticks; CI runs it
async def test_three_schedulers_on_one_store_fire_each_tick_once(
    store: SQLiteStore, raw: RawDB
) -> None:
    schedules = [every("a"), every("b", "2s")]
    racing = [Scheduler(store, schedules, clock=time.time, log=log) for _ in range(3)]
    await run_for(3.5, *racing)
    found = runs(raw)
    per_tick = Counter((row["schedule"], row["scheduled_for"]) for row in found)
    assert per_tick and set(per_tick.values()) == {1}
    assert all(row["dispatch_id"] is not None and row["origin"] == "tick" for row in found)
    a_ticks = sorted(t for name, t in per_tick if name == "a")
    assert len(a_ticks) >= 3 and a_ticks == [a_ticks[0] + n for n in range(len(a_ticks))]
    fired = sum((s.fired for s in racing), Counter())
    assert sum(fired.values()) == len(found) == raw.scalar("SELECT COUNT(*) FROM dispatch_outbox")


async def test_a_worker_that_loses_the_race_writes_nothing(store: SQLiteStore, raw: RawDB) -> None:
    s = every("a", "1h", missed="all", catch_up_seconds=10 * HOUR)
    now = time.time()
    await store.write(partial(see, names=["a"], now=now - 3 * HOUR))
    decided = plan(s, now - 3 * HOUR, now)
    assert len(decided.fire) == 3
    work = [(s, decided.fire, decided.handled)]
    first = await store.write(partial(fire, work=work, now=now))
    second = await store.write(partial(fire, work=work, now=now))
    assert len(first) == 3 and second == []
    assert raw.scalar("SELECT COUNT(*) FROM schedule_runs") == 3
    assert raw.scalar("SELECT COUNT(*) FROM dispatch_outbox") == 3
    assert raw.scalar("SELECT COUNT(*) FROM status_transitions") == 3


async def test_the_tick_index_refuses_a_second_run_of_one_tick(
    store: SQLiteStore, raw: RawDB
) -> None:
    insert = (
        "INSERT INTO schedule_runs (id, created_at, schedule, scheduled_for, origin) "
        "VALUES (?, 0, 'a', 60, ?)"
    )
    raw.execute(insert, ("r1", "tick"))
    with pytest.raises(Exception, match=r"(?i)unique"):
        raw.execute(insert, ("r2", "backfilled"))
    raw.execute(insert, ("r3", "manual"))  # a manual run is not a tick


@pytest.mark.parametrize(
    "missed, expected",
    [("skip", []), ("latest", [3]), ("all", [2, 3])],
)
async def test_ticks_missed_while_no_worker_ran_follow_missed(
    store: SQLiteStore, raw: RawDB, missed: str, expected: list[int]
) -> None:
    now = time.time()
    if str(raw.target).startswith("postgres"):
        # PostgreSQL's own clock decides what is due, which the test cannot
        # freeze: near an hour's start, wait until its tick is over a minute
        # old (and missed), as the test needs.
        into = now % HOUR
        if into <= 70 or into >= HOUR - 10:
            await anyio.sleep((71 - into) % HOUR)
            now = time.time()
    elif now % HOUR <= 60:  # the hour's tick would be on time: be before it
        now -= 120
    last = now - now % HOUR  # the newest whole hour: missed too (over a minute ago)
    # Seen 4 hours before the newest tick; ticks since: last-3h .. last.
    await store.write(partial(see, names=["s"], now=last - 4 * HOUR + 1))
    s = every("s", "1h", missed=missed, catch_up_seconds=now - last + 1.5 * HOUR)
    # A frozen clock: a run across the hour must not find the next tick due too.
    scheduler = Scheduler(store, [s], clock=lambda: now, log=log)
    async with anyio.create_task_group() as tg:
        tg.start_soon(scheduler.run)
        await wait_for(lambda: raw.scalar("SELECT last_tick FROM dispatch_schedules") == last)
        tg.cancel_scope.cancel()
    found = runs(raw)
    ticks = {last - 3 * HOUR + n * HOUR: n for n in range(4)}
    assert [ticks[row["scheduled_for"]] for row in found] == expected
    for row in found:
        assert row["origin"] == "backfilled"
        assert metadata(row)["backfilled"] is True
        assert metadata(row)["scheduled_for"] == iso(row["scheduled_for"])
    assert sum(scheduler.fired.values()) == len(expected)
    assert scheduler.next_fire["s"] == last + HOUR


@pytest.mark.slow  # real seconds of ticks; CI runs it
async def test_a_paused_schedule_fires_nothing_and_resumed_catches_up_by_missed(
    store: SQLiteStore, raw: RawDB
) -> None:
    s = every("s", "1s", missed="latest", catch_up_seconds=60)
    assert await store.write(partial(set_paused, name="s", paused=True, now=time.time()))
    assert not await store.write(partial(set_paused, name="s", paused=True, now=time.time()))
    scheduler = Scheduler(store, [s], clock=time.time, log=log)
    async with anyio.create_task_group() as tg:
        tg.start_soon(scheduler.run)
        await anyio.sleep(2.2)
        assert runs(raw) == [] and scheduler.next_fire["s"] is None
        tg.cancel_scope.cancel()
    # Resumed while no worker runs: the ticks missed since follow "latest".
    assert await store.write(partial(set_paused, name="s", paused=False, now=time.time()))
    state = (await store.read(partial(states, names=["s"])))["s"]
    assert not state.paused and state.last_tick is None
    await anyio.sleep(1.1)  # the newest missed tick is over a second old
    scheduler = Scheduler(store, [s], clock=time.time, log=log)
    async with anyio.create_task_group() as tg:
        tg.start_soon(scheduler.run)
        await wait_for(lambda: len(runs(raw)) >= 1)
        tg.cancel_scope.cancel()
    first = runs(raw)[0]
    assert first["scheduled_for"] > state.first_seen_at


async def test_a_manual_run_fires_now_flagged_and_leaves_the_ticks_alone(
    store: SQLiteStore, raw: RawDB
) -> None:
    s = Schedule(
        name="nightly",
        cron="30 2 * * *",
        timezone="Europe/Berlin",
        kind="report",
        deliver_to="reports",
        body={"format": "pdf"},
        max_attempts=3,
        ordering_key="reports",
    )
    now = time.time()
    run = await store.write(partial(fire_manual, schedule=s, now=now))
    row = raw.rows("SELECT * FROM dispatch_outbox")[0]
    assert row["id"] == run.dispatch_id and row["schedule_run_id"] == run.run_id
    assert (row["kind"], row["deliver_to"], row["max_attempts"], row["ordering_key"]) == (
        "report",
        "reports",
        3,
        "reports",
    )
    envelope = json.loads(row["payload"]) if isinstance(row["payload"], str) else row["payload"]
    assert envelope["body"] == {"format": "pdf"}
    assert envelope["metadata"]["manual"] is True and envelope["metadata"]["schedule"] == "nightly"
    history = raw.rows("SELECT source, actor, reason_code FROM status_transitions")
    assert history == [
        {
            "source": "scheduler",
            "actor": "schedule:nightly",
            "reason_code": "dispatch.pending.enqueued",
        }
    ]
    assert raw.scalar("SELECT origin FROM schedule_runs") == "manual"
    assert raw.scalar("SELECT last_tick FROM dispatch_schedules") is None


async def test_a_schedules_coalesce_key_replaces_its_waiting_dispatch_as_the_scheduler(
    store: SQLiteStore, raw: RawDB
) -> None:
    s = every("digest", "1h", coalesce_key="digest", coalesce="replace")
    kept = every("digest", "1h", coalesce_key="digest")
    assert s.fingerprint != kept.fingerprint != every("digest", "1h").fingerprint
    assert s.describe()["coalesce"] == "replace" and "coalesce" not in kept.describe()
    now = time.time()
    first = await store.write(partial(fire_manual, schedule=s, now=now))
    second = await store.write(partial(fire_manual, schedule=s, now=now + 1))
    assert (first.outcome, second.outcome) == ("inserted", "replaced")
    assert raw.row(first.dispatch_id)["status"] == "superseded"
    superseded = raw.transitions(first.dispatch_id)[-1]
    assert (superseded["source"], superseded["actor"], superseded["reason_code"]) == (
        "scheduler",
        "schedule:digest",
        "dispatch.superseded.coalesced",
    )
    assert superseded["reason_summary"] == f"superseded by {second.dispatch_id}"
    # Kept: the tick's dispatch is the one still waiting; nothing new is written.
    third = await store.write(partial(fire_manual, schedule=kept, now=now + 2))
    assert (third.outcome, third.dispatch_id) == ("kept", second.dispatch_id)
    assert raw.scalar("SELECT COUNT(*) FROM dispatch_outbox") == 2


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"coalesce": "replace"}, "schedule 'digest': coalesce='replace' needs a coalesce_key"),
        (
            {"coalesce_key": "d", "coalesce": "debounce"},
            "schedule 'digest': coalesce='debounce' needs coalesce_seconds",
        ),
    ],
)
def test_a_schedules_bad_coalescing_is_refused_naming_it(
    fields: dict[str, Any], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        every("digest", "1h", **fields)


async def test_a_worker_with_schedules_delivers_each_tick_with_its_metadata(
    store: SQLiteStore, raw: RawDB
) -> None:
    seen: list[Delivery] = []

    async def send(delivery: Delivery) -> TransportResult:
        seen.append(delivery)
        return TransportResult.success()

    # First seen 3.5 s ago with missed="all": the worker fires the missed
    # ticks (backfilled) and the on-time one at once instead of waiting.
    await store.write(partial(see, names=["beat"], now=time.time() - 3.5))
    beat = every("beat", missed="all", catch_up_seconds=10)
    worker = DispatchWorker(store, transport=send, schedules=[beat], tick_seconds=3600)
    async with anyio.create_task_group() as tg:
        await tg.start(worker.run)
        await wait_for(lambda: len(seen) >= 3)
        tg.cancel_scope.cancel()
    flags = []
    for delivery in seen:
        envelope = json.loads(delivery.payload)
        assert envelope["kind"] == "tick"
        meta = envelope["metadata"]
        assert meta["schedule"] == "beat" and meta["scheduled_for"].endswith("Z")
        flags.append(meta["backfilled"])
    assert True in flags and False in flags
    assert worker.scheduler is not None
    fired = worker.scheduler.fired
    assert fired[("beat", "tick")] >= 1 and fired[("beat", "backfilled")] == flags.count(True)


async def test_pruning_keeps_runs_a_dispatch_refers_to_and_each_schedules_newest(
    store: SQLiteStore, raw: RawDB
) -> None:
    a, b = every("a"), every("b")
    now = time.time()
    for offset in (3, 2, 1):
        await store.write(partial(fire_manual, schedule=a, now=now - offset))
    await store.write(partial(fire_manual, schedule=b, now=now - 1))

    async def ok(delivery: Delivery) -> TransportResult:
        return TransportResult.success()

    await deliver_due_dispatches(store, transport=ok, now=now)
    kept = await store.write(partial(fire_manual, schedule=a, now=now - 0.5))  # still pending
    assert await prune_dispatches(store, older_than=0, now=now + 1) == 4
    left = raw.rows("SELECT schedule, created_at FROM schedule_runs ORDER BY created_at")
    assert [(row["schedule"], row["created_at"]) for row in left] == [
        ("b", now - 1),
        ("a", now - 0.5),
    ]
    assert raw.scalar("SELECT schedule_run_id FROM dispatch_outbox") == kept.run_id


def _seen_paused(scheduler: Scheduler, paused: bool) -> bool:
    return (scheduler.next_fire["daily"] is None) == paused


async def test_pause_and_resume_cycles_leave_a_schedule_queued_once(
    store: SQLiteStore, raw: RawDB, monkeypatch: pytest.MonkeyPatch
) -> None:
    from trio_dispatch.schedules import service

    monkeypatch.setattr(service, "REFRESH_SECONDS", 0.02)
    scheduler = Scheduler(store, [every("daily", "1d")], clock=time.time, log=log)
    async with anyio.create_task_group() as tg:
        tg.start_soon(scheduler.run)
        for paused in (True, False) * 3:
            await store.write(partial(set_paused, name="daily", paused=paused, now=time.time()))
            await wait_for(partial(_seen_paused, scheduler, paused))
            await anyio.sleep(0.06)  # a refresh or two
        tg.cancel_scope.cancel()
    # One live place, however often it was resumed; lapsed ones do not pile up.
    live = [entry for entry in scheduler._heap if scheduler._place.get(entry[2]) == entry[1]]
    assert len(live) == 1 and len(scheduler._heap) <= 2


async def test_a_catch_up_of_30_days_every_second_fires_at_most_the_cap_and_says_so_once(
    store: SQLiteStore, raw: RawDB, caplog: pytest.LogCaptureFixture
) -> None:
    now = time.time()
    await store.write(partial(see, names=["beat"], now=now - 30 * 86400))
    beat = every("beat", "1s", missed="all", catch_up_seconds=30 * 86400)
    scheduler = Scheduler(store, [beat], clock=lambda: now, log=log)
    with caplog.at_level(logging.INFO, logger=log.name):
        async with anyio.create_task_group() as tg:
            tg.start_soon(scheduler.run)
            await wait_for(  # 1,001 runs: a loaded machine's PostgreSQL took over 10 s
                lambda: (raw.scalar("SELECT last_tick FROM dispatch_schedules") or 0) >= now // 1,
                timeout=60,
            )
            tg.cancel_scope.cancel()
    # On PostgreSQL the database's clock says which tick is the newest due
    # (it may have passed a second boundary since ``now`` was read).
    last = float(raw.scalar("SELECT last_tick FROM dispatch_schedules"))
    origins = Counter(row["origin"] for row in runs(raw))
    # 2,592,000 ticks missed: the newest MAX_BACKFILL_RUNS fire, and the on-time one.
    assert origins == {"backfilled": MAX_BACKFILL_RUNS, "tick": 1}
    assert raw.scalar("SELECT COUNT(*) FROM dispatch_outbox") == MAX_BACKFILL_RUNS + 1
    assert raw.scalar("SELECT MIN(scheduled_for) FROM schedule_runs") == last - MAX_BACKFILL_RUNS
    said = [r for r in caplog.records if "passed over" in r.getMessage()]
    assert len(said) == 1 and said[0].levelno == logging.WARNING
    assert "more than 1000 missed ticks" in said[0].getMessage()
    # The log says it in a few lines (one a write of 200 runs), not one a run.
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("schedule beat")]
    assert len(lines) <= MAX_BACKFILL_RUNS // 200 + 2, len(lines)


# -- one schedule that cannot fire ------------------------------------------------------


def failing_records(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.levelno >= logging.WARNING]


async def test_a_schedule_the_store_refuses_is_isolated_backed_off_and_reported_once(
    store: SQLiteStore, raw: RawDB, caplog: pytest.LogCaptureFixture
) -> None:
    from trio_dispatch.web.metrics import render, schedule_families

    raw.refuse_kind("refused", "no dispatches of this kind")
    # Named so they share a chunk (one transaction) when due together.
    bad = Schedule(name="a-bad", every="1s", kind="refused", deliver_to="d")
    good = [every(f"b-good-{n}") for n in range(3)]
    scheduler = Scheduler(store, [bad, *good], clock=time.time, log=log)
    with caplog.at_level(logging.INFO, logger=log.name):
        async with anyio.create_task_group() as tg:
            tg.start_soon(scheduler.run)
            await wait_for(lambda: scheduler.failures["a-bad"] >= 2, timeout=10)
            tg.cancel_scope.cancel()
    # The neighbours fired each second all along; the refused one wrote nothing.
    fired = Counter(row["schedule"] for row in runs(raw))
    assert set(fired) == {"b-good-0", "b-good-1", "b-good-2"} and min(fired.values()) >= 2
    states_now = {
        row["name"]: row["last_tick"] for row in raw.rows("SELECT * FROM dispatch_schedules")
    }
    assert states_now["a-bad"] is None and states_now["b-good-0"] is not None
    # Backed off: 1 s after the first failure, 2 s after the second.
    failing = scheduler.failing["a-bad"]
    assert failing.failures == scheduler.failures["a-bad"] == 2
    assert failing.retry_at - failing.last_at == failure_backoff(2) == 2.0
    assert failing.last_at - failing.since >= failure_backoff(1)
    assert "no dispatches of this kind" in failing.error
    # Reported once: one warning line, no traceback, nothing from the generic retry.
    said = failing_records(caplog)
    assert len(said) == 1 and said[0].exc_info is None, [r.getMessage() for r in said]
    assert said[0].getMessage().startswith("schedule a-bad failed to fire (")
    assert "the other schedules go on" in said[0].getMessage()
    text = render(schedule_families(scheduler)).decode()
    assert 'trio_dispatch_schedule_failures_total{schedule="a-bad"} 2.0' in text
    assert 'trio_dispatch_schedule_failures_total{schedule="b-good-0"} 0.0' in text


async def test_a_failing_schedule_that_fires_again_says_so_and_is_no_longer_failing(
    store: SQLiteStore, raw: RawDB, caplog: pytest.LogCaptureFixture
) -> None:
    raw.refuse_kind("refused", "not now")
    bad = Schedule(name="bad", every="1s", kind="refused", deliver_to="d")
    scheduler = Scheduler(store, [bad], clock=time.time, log=log)
    with caplog.at_level(logging.INFO, logger=log.name):
        async with anyio.create_task_group() as tg:
            tg.start_soon(scheduler.run)
            await wait_for(lambda: scheduler.failures["bad"] >= 1, timeout=10)
            raw.allow_kinds()
            await wait_for(lambda: "bad" not in scheduler.failing, timeout=10)
            tg.cancel_scope.cancel()
    assert len(runs(raw)) >= 1
    messages = [r.getMessage() for r in caplog.records if "bad" in r.getMessage()]
    assert any(m.startswith("schedule bad fires again, after 1 failed attempts") for m in messages)


def test_failure_backoff_doubles_and_is_bounded() -> None:
    waits = [failure_backoff(n) for n in range(1, 12)]
    assert waits == [1, 2, 4, 8, 16, 32, 64, 128, 256, 300, 300]
    assert failure_backoff(10**6) == MAX_FAILURE_BACKOFF_SECONDS == 300


async def test_a_schedule_whose_body_is_over_the_store_s_limit_is_refused_before_anything_runs(
    db_target: str, raw: RawDB
) -> None:
    big = Schedule(name="big", every="1s", kind="k", deliver_to="d", body={"x": "y" * 200})
    async with open_store(db_target, max_body_bytes=100) as small:
        for build in (
            partial(Scheduler, small, [every("ok"), big], clock=time.time, log=log),
            partial(DispatchWorker, small, schedules=[every("ok"), big]),
        ):
            with pytest.raises(ValueError) as caught:
                build()
            assert str(caught.value) == (
                "schedule 'big': body is 209 bytes of JSON, over the limit of 100 bytes "
                "(max_body_bytes)"
            )
    assert raw.scalar("SELECT COUNT(*) FROM dispatch_schedules") == 0
    # Under a limit above the default, a body above the default is fine.
    huge = Schedule(name="huge", every="1s", kind="k", deliver_to="d", body={"x": "y" * 2**21})
    async with open_store(db_target, max_body_bytes=2**22) as roomy:
        Scheduler(roomy, [huge], clock=time.time, log=log)


# -- the clock ----------------------------------------------------------------------------


async def test_a_wall_clock_stepped_back_and_put_right_delays_the_ticks_by_a_clock_check_at_most(
    store: SQLiteStore, raw: RawDB
) -> None:
    step = [0.0]
    stepped_reads = [0]

    def clock() -> float:
        stepped_reads[0] += step[0] != 0.0
        return time.time() + step[0]

    scheduler = Scheduler(store, [every("beat")], clock=clock, log=log, clock_check_seconds=0.1)
    async with anyio.create_task_group() as tg:
        tg.start_soon(scheduler.run)
        await wait_for(lambda: len(runs(raw)) >= 1, timeout=5)
        step[0] = -120.0  # NTP steps the clock back two minutes ...
        # ... while the service wakes, plans and sleeps again (a look reads
        # the clock twice: now, then the wake-up time; three looks here)
        await wait_for(lambda: stepped_reads[0] >= 6, timeout=5)
        before = len(runs(raw))
        step[0] = 0.0  # ... and puts it right
        await wait_for(lambda: len(runs(raw)) > before, timeout=3)  # not 120 s later
        tg.cancel_scope.cancel()
    ticks = [row["scheduled_for"] for row in runs(raw)]
    assert ticks == sorted(set(ticks)) and max(ticks) <= time.time()


@pytest.mark.slow  # real seconds of ticks; the next test holds a tick to the server's clock without
@pytest.mark.postgres_only  # on SQLite the process's clock is the store's clock
async def test_a_worker_whose_clock_runs_ahead_fires_no_tick_before_the_database_s_clock(
    store: SQLiteStore, raw: RawDB
) -> None:
    def ahead() -> float:  # a host whose clock is two hours fast
        return time.time() + 7200

    fast = Scheduler(store, [every("beat")], clock=ahead, log=log, clock_check_seconds=0.2)
    async with anyio.create_task_group() as tg:
        tg.start_soon(fast.run)
        # It fires by the database's clock: on time, and never ahead of it.
        await wait_for(lambda: len(runs(raw)) >= 2, timeout=5)
        tg.cancel_scope.cancel()
    server_now = float(raw.scalar("SELECT EXTRACT(EPOCH FROM clock_timestamp())::float8"))
    ticks = [row["scheduled_for"] for row in runs(raw)]
    assert max(ticks) <= server_now and server_now - max(ticks) < 5, (ticks, server_now)
    assert float(raw.scalar("SELECT last_tick FROM dispatch_schedules")) <= server_now
    assert fast.next_fire["beat"] is not None and fast.next_fire["beat"] < server_now + 5
    # A worker with a right clock is not made late by it: it fires the next tick.
    right = Scheduler(store, [every("beat")], clock=time.time, log=log)
    fired_before = len(ticks)
    async with anyio.create_task_group() as tg:
        tg.start_soon(right.run)
        await wait_for(lambda: len(runs(raw)) > fired_before, timeout=5)
        tg.cancel_scope.cancel()


async def test_a_tick_not_due_by_the_store_s_clock_is_never_written(
    store: SQLiteStore, raw: RawDB, engine: str
) -> None:
    beat = every("beat", "1h")
    now = time.time()
    await store.write(partial(see, names=["beat"], now=now - 7200))
    tick = (now // 3600 + 1) * 3600  # the next hour: not due yet
    work = [(beat, [(tick, False)], tick)]
    # Not due by the caller's clock: nothing, on every engine.
    assert await store.write(partial(fire, work=work, now=now)) == []
    assert raw.scalar("SELECT last_tick FROM dispatch_schedules") is None
    # A caller whose clock runs ahead: its clock is the store's on SQLite (one
    # machine), but PostgreSQL holds it to the database server's.
    written = await store.write(partial(fire, work=work, now=tick + 1))
    if engine == "postgres":
        assert written == [] and raw.scalar("SELECT COUNT(*) FROM schedule_runs") == 0
        assert raw.scalar("SELECT last_tick FROM dispatch_schedules") is None
    else:
        assert [run.scheduled_for for run in written] == [tick]


# -- two definitions of one name ------------------------------------------------------------


def kinds_by_tick(raw: RawDB) -> list[tuple[float, str]]:
    rows = raw.rows(
        "SELECT r.scheduled_for, d.kind FROM schedule_runs r "
        "JOIN dispatch_outbox d ON d.schedule_run_id = r.id ORDER BY r.scheduled_for"
    )
    return [(float(row["scheduled_for"]), str(row["kind"])) for row in rows]


@pytest.mark.slow  # real seconds of ticks; the rolling deploy test decides the same without
async def test_two_definitions_of_one_name_never_fire_the_union_of_their_ticks(
    store: SQLiteStore, raw: RawDB, caplog: pytest.LogCaptureFixture
) -> None:
    from trio_dispatch.web.metrics import render, schedule_families

    old = Schedule(name="beat", every="1s", kind="old", deliver_to="d")
    new = Schedule(name="beat", every="2s", kind="new", deliver_to="d")  # a deploy changes it
    running = Scheduler(store, [old], clock=time.time, log=log)
    deployed = Scheduler(store, [new], clock=time.time, log=log)
    with caplog.at_level(logging.INFO, logger=log.name):
        async with anyio.create_task_group() as tg:
            tg.start_soon(running.run)
            await wait_for(lambda: len(kinds_by_tick(raw)) >= 1, timeout=5)
            tg.start_soon(deployed.run)
            await wait_for(lambda: [k for _, k in kinds_by_tick(raw)].count("new") >= 2, timeout=10)
            tg.cancel_scope.cancel()
    fired = kinds_by_tick(raw)
    kinds = [kind for _, kind in fired]
    # One definition per tick, and one after the other: the old one's ticks
    # (every second) until the new one took over, then only the new one's.
    switch = kinds.index("new")
    assert kinds == ["old"] * switch + ["new"] * (len(kinds) - switch), fired
    assert all(tick % 2 == 0 for tick, kind in fired if kind == "new"), fired
    assert raw.scalar("SELECT definition FROM dispatch_schedules") == new.fingerprint
    assert json.loads(raw.scalar("SELECT superseded FROM dispatch_schedules")) == [old.fingerprint]
    # The worker with the replaced definition stands aside and says so, once.
    assert running.mismatched == {"beat": new.fingerprint} and deployed.mismatched == {}
    assert running.next_fire["beat"] is None
    said = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len([m for m in said if "is not this worker's" in m]) == 1, said
    assert len([m for m in said if "is now the one in force" in m]) == 1, said
    text = render(schedule_families(running)).decode()
    assert 'trio_dispatch_schedule_definition_mismatch{schedule="beat"} 1.0' in text
    text = render(schedule_families(deployed)).decode()
    assert 'trio_dispatch_schedule_definition_mismatch{schedule="beat"} 0.0' in text


def settle(
    definitions: dict[str, str], stale_after: float = 60.0, confirm_after: float = 10.0
) -> Any:
    return partial(
        reconcile,
        definitions=definitions,
        now=time.time(),
        stale_after=stale_after,
        confirm_after=confirm_after,
    )


async def test_in_a_rolling_deploy_the_newest_definition_wins_and_an_older_one_waits(
    store: SQLiteStore, raw: RawDB
) -> None:
    a, b, c = (every("beat", period) for period in ("1m", "2m", "3m"))
    first = await store.write(settle({"beat": a.fingerprint}))
    assert first.took_over == {"beat": None}  # first sight: recorded with its definition
    # A new definition takes over at once ...
    assert (await store.write(settle({"beat": b.fingerprint}))).took_over == {"beat": a.fingerprint}
    # ... and an old worker that restarts meanwhile does not take it back.
    kept = await store.write(settle({"beat": a.fingerprint}))
    assert kept.took_over == {} and kept.states["beat"].definition == b.fingerprint
    assert kept.states["beat"].superseded == (a.fingerprint,)
    # When no worker has confirmed the new one for a minute (its workers are
    # gone: a canary removed, a rollback), a worker with the old one takes over.
    raw.execute("UPDATE dispatch_schedules SET confirmed_at = confirmed_at - 61")
    back = await store.write(settle({"beat": a.fingerprint}))
    assert back.took_over == {"beat": b.fingerprint}
    assert back.states["beat"].superseded == (b.fingerprint,)
    # Confirmed, a definition in force stays; a third, new one still wins at once.
    raw.execute("UPDATE dispatch_schedules SET confirmed_at = confirmed_at - 30")
    before = float(raw.scalar("SELECT confirmed_at FROM dispatch_schedules"))
    await store.write(settle({"beat": a.fingerprint}))
    assert float(raw.scalar("SELECT confirmed_at FROM dispatch_schedules")) > before
    assert (await store.write(settle({"beat": b.fingerprint}))).took_over == {}
    newest = await store.write(settle({"beat": c.fingerprint}))
    assert newest.took_over == {"beat": a.fingerprint}
    assert newest.states["beat"].superseded == (a.fingerprint, b.fingerprint)


async def test_a_tick_fires_only_with_the_definition_in_force(
    store: SQLiteStore, raw: RawDB
) -> None:
    old, new = every("beat", "1h"), every("beat", "1h", missed="all")
    now = time.time()
    await store.write(settle({"beat": new.fingerprint}))
    tick = now // 3600 * 3600
    assert await store.write(partial(fire, work=[(old, [(tick, False)], tick)], now=now)) == []
    assert raw.scalar("SELECT COUNT(*) FROM schedule_runs") == 0
    assert raw.scalar("SELECT last_tick FROM dispatch_schedules") is None
    fired = await store.write(partial(fire, work=[(new, [(tick, False)], tick)], now=now))
    assert [run.scheduled_for for run in fired] == [tick]


@pytest.mark.sqlite_only
async def test_a_version_7_store_keeps_its_schedules_and_the_first_worker_records_its_definition(
    db_path: Any, raw: RawDB
) -> None:
    import sqlite3

    from trio_dispatch.store.schema import SCHEMA_VERSION, statements

    conn = sqlite3.connect(db_path, isolation_level=None)
    for statement in statements(*range(1, 8)):
        conn.execute(statement)
    conn.execute("CREATE TABLE trio_dispatch_schema (version INTEGER, applied_at FLOAT)")
    conn.executemany("INSERT INTO trio_dispatch_schema VALUES (?, 0)", [(n,) for n in range(1, 8)])
    conn.execute(
        "INSERT INTO dispatch_schedules (name, first_seen_at, paused, last_tick, updated_at) "
        "VALUES ('beat', 100, 1, 3600, 100)"
    )
    conn.close()
    beat = every("beat", "1h")
    async with open_store(db_path) as db:
        assert SCHEMA_VERSION >= 9
        (before,) = raw.rows("SELECT * FROM dispatch_schedules")
        assert (before["definition"], before["superseded"], before["confirmed_at"]) == (
            None,
            None,
            None,
        )
        settled = await db.write(settle({"beat": beat.fingerprint}))
    state = settled.states["beat"]
    assert (state.first_seen_at, state.paused, state.last_tick) == (100.0, True, 3600.0)
    assert state.definition == beat.fingerprint and settled.took_over == {"beat": None}
    assert raw.scalar("SELECT MAX(version) FROM trio_dispatch_schema") == SCHEMA_VERSION
