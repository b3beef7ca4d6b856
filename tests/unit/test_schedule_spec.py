"""Schedules without a store (docs/schedules.md): checks, ticks across DST, the plan
for missed ticks, the configuration section."""

from __future__ import annotations

import itertools
from collections import Counter
from datetime import UTC, date, datetime, timedelta
from zoneinfo import ZoneInfo

import pytest
from hypothesis import given
from hypothesis import strategies as st

from trio_dispatch.config import ConfigError, parse_config
from trio_dispatch.schedules import Schedule, schedules_from_config
from trio_dispatch.schedules.spec import (
    MAX_BACKFILL_RUNS,
    MAX_CATCH_UP_SECONDS,
    ON_TIME_SECONDS,
    WALK_STEP,
    Plan,
    plan,
    planning,
)


def schedule(**fields: object) -> Schedule:
    fields.setdefault("kind", "report")
    fields.setdefault("deliver_to", "reports")
    fields.setdefault("name", "s")
    return Schedule(**fields)  # type: ignore[arg-type]


def ticks(s: Schedule, start: datetime, end: datetime) -> list[float]:
    found, at = [], start.timestamp()
    while (at := s.next_tick(at)) < end.timestamp():
        found.append(at)
    return found


def local_days(s: Schedule, stamps: list[float], zone: str) -> Counter[date]:
    return Counter(datetime.fromtimestamp(t, ZoneInfo(zone)).date() for t in stamps)


@pytest.mark.parametrize(
    "zone, cron, day, fires_at_utc",
    [
        # Spring forward: 02:30 does not exist; it fires once, at the change.
        ("Europe/Berlin", "30 2 * * *", date(2026, 3, 29), "2026-03-29T01:00:00"),
        ("America/New_York", "30 2 * * *", date(2026, 3, 8), "2026-03-08T07:00:00"),
        # Fall back: the wall time happens twice; it fires once, the first time.
        ("Europe/Berlin", "30 2 * * *", date(2026, 10, 25), "2026-10-25T00:30:00"),
        ("America/New_York", "30 1 * * *", date(2026, 11, 1), "2026-11-01T05:30:00"),
    ],
)
def test_a_daily_cron_fires_once_on_a_dst_change_day(
    zone: str, cron: str, day: date, fires_at_utc: str
) -> None:
    s = schedule(cron=cron, timezone=zone)
    start = datetime(day.year, day.month, day.day, tzinfo=ZoneInfo(zone)) - timedelta(days=3)
    found = ticks(s, start, start + timedelta(days=7))
    per_day = local_days(s, found, zone)
    assert set(per_day.values()) == {1} and len(per_day) == 7, per_day
    on_the_day = [t for t in found if datetime.fromtimestamp(t, ZoneInfo(zone)).date() == day]
    assert [
        datetime.fromtimestamp(t, UTC).replace(tzinfo=None).isoformat() for t in on_the_day
    ] == [fires_at_utc]


def test_an_interval_cron_keeps_real_time_spacing_across_a_change_and_fires_each_instant_once() -> (
    None
):
    s = schedule(cron="*/30 * * * *", timezone="Europe/Berlin")
    for day in (date(2026, 3, 29), date(2026, 10, 25)):
        start = datetime(day.year, day.month, day.day, tzinfo=UTC) - timedelta(hours=2)
        found = ticks(s, start, start + timedelta(hours=8))
        assert len(found) == len(set(found)) == 15  # 8 hours, both ends excluded
        assert {b - a for a, b in itertools.pairwise(found)} == {1800.0}


def test_every_is_aligned_to_the_epoch_and_accepts_units_or_seconds() -> None:
    assert schedule(every="5m").next_tick(1_000_000.0) == 1_000_200.0
    assert schedule(every="5m").next_tick(1_000_200.0) == 1_000_500.0
    assert schedule(every=30).next_tick(59.9) == 60.0
    assert schedule(every="1h").interval_seconds == 3600
    assert schedule(every="2d").interval_seconds == 172_800


def test_cron_is_read_in_the_schedules_time_zone() -> None:
    s = schedule(cron="0 9 * * 1", timezone="America/New_York")  # Mondays 09:00
    at = s.next_tick(datetime(2026, 12, 2, tzinfo=UTC).timestamp())
    assert datetime.fromtimestamp(at, UTC) == datetime(2026, 12, 7, 14, 0, tzinfo=UTC)


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"cron": "* * *"}, "cron must have five fields"),
        ({"cron": "0 0 * * * *"}, "cron must have five fields"),
        ({"cron": "61 * * * *"}, "not a valid cron expression"),
        ({"every": "5x"}, "every must be a duration"),
        ({"every": 0}, "every must be between 1s and 366d"),
        ({"every": True}, "every must be a duration"),
        ({}, "set exactly one of cron or every"),
        ({"cron": "* * * * *", "every": "1m"}, "set exactly one of cron or every"),
        ({"every": "1m", "timezone": "Mars/Base"}, "timezone is not a known IANA time zone"),
        ({"every": "1m", "missed": "some"}, "missed must be one of skip, latest, all"),
        ({"every": "1m", "catch_up_seconds": -1}, "catch_up_seconds"),
        ({"every": "1m", "jitter_seconds": "soon"}, "jitter_seconds"),
        ({"every": "1m", "max_attempts": 0}, "max_attempts"),
        ({"every": "1m", "kind": ""}, "kind must be a non-empty string"),
        ({"every": "1m", "body": [1]}, "body must be a mapping"),
        ({"every": "1m", "ordering_key": "a\nb"}, "ordering_key"),
        ({"every": "1m", "priority": 11}, "priority must be an integer from -10 to 10, got 11"),
        ({"every": "1m", "priority": True}, "priority must be an integer from -10 to 10, got True"),
        ({"every": "1m", "name": "bad name"}, "name must be 1-128 letters"),
    ],
)
def test_a_bad_field_raises_naming_the_schedule_and_the_field(
    fields: dict[str, object], message: str
) -> None:
    with pytest.raises((TypeError, ValueError), match=message) as caught:
        schedule(**fields)
    if "name" not in fields:
        assert str(caught.value).startswith("schedule 's': ")


def test_a_priority_of_0_keeps_the_fingerprint_a_definition_had_before_priorities() -> None:
    # The digest of this definition as workers without priorities wrote it:
    # a rolling upgrade must not read as a change of definition.
    plain = Schedule(name="n", every="5m", kind="k", deliver_to="d", max_attempts=3)
    assert plain.fingerprint == "9b1fcdd3eec14816"
    urgent = Schedule(name="n", every="5m", kind="k", deliver_to="d", max_attempts=3, priority=2)
    assert urgent.fingerprint != plain.fingerprint
    assert urgent.describe()["priority"] == 2


def test_jitter_is_the_same_for_every_worker_and_stays_inside_its_bound() -> None:
    s = schedule(every="1m", jitter_seconds=60)
    spread = [s.jitter_for(60.0 * n) for n in range(500)]
    assert spread == [
        schedule(every="1m", jitter_seconds=60).jitter_for(60.0 * n) for n in range(500)
    ]
    assert all(0 <= value < 60 for value in spread)
    assert max(spread) - min(spread) > 50  # spread over the minute, not bunched
    assert schedule(every="1m").jitter_for(60.0) == 0.0


HOUR = 3600.0


@pytest.mark.parametrize(
    "missed, fired",
    [
        ("skip", []),
        ("latest", [(10 * HOUR, True)]),
        ("all", [(8 * HOUR, True), (9 * HOUR, True), (10 * HOUR, True)]),
    ],
)
def test_ticks_missed_while_no_worker_ran_follow_the_policy_inside_the_window(
    missed: str, fired: list[tuple[float, bool]]
) -> None:
    s = schedule(every="1h", missed=missed, catch_up_seconds=2.5 * HOUR)
    # Last handled 05:00; now 10:30: 06:00..10:00 are due, 08:00.. inside the window.
    decided = plan(s, 5 * HOUR, 10.5 * HOUR)
    assert list(decided.fire) == fired
    assert decided.handled == 10 * HOUR  # the cursor passes over what was not fired
    assert decided.wake_at == 11 * HOUR


@pytest.mark.parametrize("missed", ["skip", "latest", "all"])
def test_an_on_time_tick_fires_unflagged_under_every_policy(missed: str) -> None:
    s = schedule(every="1h", missed=missed)
    decided = plan(s, 9 * HOUR, 10 * HOUR + ON_TIME_SECONDS - 1)
    assert list(decided.fire) == [(10 * HOUR, False)]
    assert plan(s, 9 * HOUR, 10 * HOUR + ON_TIME_SECONDS + 1).fire != ((10 * HOUR, False),)


def test_nothing_fires_before_the_first_tick_after_the_cursor() -> None:
    s = schedule(every="1h")
    decided = plan(s, 10 * HOUR, 10.9 * HOUR)
    assert decided.fire == () and decided.handled is None and decided.wake_at == 11 * HOUR


def test_a_tick_waits_for_its_jitter() -> None:
    s = schedule(every="1h", jitter_seconds=600)
    offset = s.jitter_for(11 * HOUR)
    assert plan(s, 10 * HOUR, 11 * HOUR + offset - 0.01).fire == ()
    assert plan(s, 10 * HOUR, 11 * HOUR + offset).fire == ((11 * HOUR, False),)


def test_the_configuration_section_builds_schedules_and_names_each_bad_key() -> None:
    config = parse_config(
        {
            "dispatch": {"notify_template": ["true"]},
            "schedules": {
                "nightly": {
                    "cron": "30 2 * * *",
                    "timezone": "Europe/Berlin",
                    "kind": "r",
                    "deliver_to": "d",
                },
                "often": {"every": "30s", "kind": "r", "deliver_to": "d", "missed": "skip"},
            },
        }
    )
    assert [s.name for s in config.schedules] == ["nightly", "often"]
    assert config.worker_options()["schedules"] == config.schedules
    for section, message in [
        (
            {"n": {"every": "1m", "kind": "r", "deliver_to": "d", "cronn": "x"}},
            "unknown key 'schedules.n.cronn'",
        ),
        ({"n": {"every": "1m", "deliver_to": "d"}}, "schedules.n.kind is required"),
        (
            {"n": {"cron": "bad", "kind": "r", "deliver_to": "d"}},
            "schedules.n.cron must have five fields",
        ),
        (
            {"n": {"every": "1m", "kind": "r", "deliver_to": "d", "timezone": "X/Y"}},
            "schedules.n.timezone",
        ),
        ({"n": {"every": "1m", "kind": "", "deliver_to": "d"}}, "schedules.n.kind must be"),
        ({"n": "every minute"}, "schedules.n must be a mapping"),
        ({"bad name": {"every": "1m", "kind": "r", "deliver_to": "d"}}, "schedule name must be"),
        ([1], "schedules must be a mapping"),
    ]:
        with pytest.raises(ConfigError, match=message):
            parse_config({"schedules": section})
    assert schedules_from_config("schedules", None) == ()


def test_a_jitter_longer_than_the_interval_keeps_every_tick_in_order() -> None:
    s = schedule(every="1s", jitter_seconds=5, missed="skip")
    fires = [s.fire_time(float(t)) for t in range(1000, 1100)]
    assert fires == sorted(fires) and all(
        f < t + 1 for f, t in zip(fires, range(1000, 1100), strict=True)
    )
    # Looked at every 0.1 s, each of the 100 ticks fires once, on time.
    cursor, fired = 999.0, []
    for step in range(10_000, 11_010):
        decided = plan(s, cursor, step / 10)
        fired += [tick for tick, backfilled in decided.fire if not backfilled]
        cursor = decided.handled if decided.handled is not None else cursor
    assert fired[:100] == [float(t) for t in range(1000, 1100)]


# -- long catch-ups: bounded work, bounded backfill ----------------------------------

DAY = 86400.0


def planned(s: Schedule, cursor: float, now: float) -> tuple[Plan, int]:
    """The plan, and how many times it yielded on the way (a count of its work)."""
    steps, yields = planning(s, cursor, now), 0
    while True:
        try:
            next(steps)
        except StopIteration as done:
            result: Plan = done.value
            return result, yields
        yields += 1


def reference_plan(s: Schedule, cursor: float, now: float) -> list[tuple[float, bool]]:
    """What fires, found the slow way: every tick of the window walked."""
    horizon = now - max(s.catch_up_seconds, ON_TIME_SECONDS) - s.jitter_seconds
    tick = s.next_tick(cursor if cursor >= horizon else horizon - 0.001)
    due = []
    while s.fire_time(tick) <= now:
        due.append(tick)
        tick = s.next_tick(tick)
    if not due:
        return []
    on_time = due[-1] if now - s.fire_time(due[-1]) <= ON_TIME_SECONDS else None
    missed = [
        t for t in (due[:-1] if on_time is not None else due) if t >= now - s.catch_up_seconds
    ]
    chosen = {"skip": [], "latest": missed[-1:] if on_time is None else [], "all": missed}
    return [(t, True) for t in chosen[s.missed][-MAX_BACKFILL_RUNS:]] + (
        [(on_time, False)] if on_time is not None else []
    )


@pytest.mark.parametrize("missed", ["skip", "latest", "all"])
def test_a_30_day_window_of_every_second_is_planned_without_walking_it(missed: str) -> None:
    # First seen 30 days ago, every second: 2,592,000 ticks since.
    s = schedule(every="1s", missed=missed, catch_up_seconds=30 * DAY)
    now = 2_000_000_000.25
    decided, yields = planned(s, now - 30 * DAY, now)
    assert decided.handled == 2_000_000_000.0 and decided.wake_at == 2_000_000_001.0
    on_time = [(2_000_000_000.0, False)]  # the newest tick is a quarter second old
    if missed == "all":
        assert len(decided.fire) == MAX_BACKFILL_RUNS + 1 and decided.capped
        first = 2_000_000_000.0 - MAX_BACKFILL_RUNS
        assert list(decided.fire[:2]) == [(first, True), (first + 1, True)]
        assert list(decided.fire[-1:]) == on_time
    else:
        assert list(decided.fire) == on_time and not decided.capped
    assert yields == 0  # arithmetic: no tick walked


@pytest.mark.parametrize("missed", ["skip", "latest", "all"])
def test_a_30_day_window_of_a_minutely_cron_walks_about_the_runs_it_fires(missed: str) -> None:
    s = schedule(
        cron="* * * * *", timezone="Europe/Berlin", missed=missed, catch_up_seconds=30 * DAY
    )
    now = datetime(2026, 3, 29, 12, 0, 30, tzinfo=UTC).timestamp()  # a DST day behind it
    decided, yields = planned(s, now - 30 * DAY, now)
    assert decided.handled == now - 30
    if missed == "all":
        ticks = [tick for tick, _ in decided.fire]
        assert len(ticks) == MAX_BACKFILL_RUNS + 1 and decided.capped
        assert ticks == [now - 30 - 60 * n for n in range(MAX_BACKFILL_RUNS, -1, -1)]
        # 43,200 ticks in the window; the walk covers about twice those kept.
        assert yields <= 2 * MAX_BACKFILL_RUNS // WALK_STEP + 2
    else:
        assert list(decided.fire) == [(now - 30, False)] and yields == 0


def test_a_daily_cron_after_a_long_downtime_fires_its_newest_missed_tick_once() -> None:
    s = schedule(cron="30 2 * * *", timezone="Europe/Berlin", catch_up_seconds=2 * DAY)
    now = datetime(2026, 3, 30, 12, 0, tzinfo=UTC).timestamp()
    decided, yields = planned(s, now - 300 * DAY, now)
    newest = datetime(2026, 3, 30, 0, 30, tzinfo=UTC).timestamp()  # 02:30 CEST
    assert list(decided.fire) == [(newest, True)] and decided.handled == newest
    assert yields == 0


def test_all_below_the_cap_fires_every_missed_tick_and_says_nothing_was_passed_over() -> None:
    s = schedule(every="1h", missed="all", catch_up_seconds=30 * DAY)
    decided = plan(s, 0.0, 100 * HOUR + 1800)
    assert [t for t, _ in decided.fire] == [HOUR * n for n in range(1, 101)]
    assert not decided.capped
    c = schedule(cron="0 * * * *", missed="all", catch_up_seconds=30 * DAY)
    assert plan(c, 0.0, 100 * HOUR + 1800) == decided


@given(
    cursor=st.integers(0, 4 * 86400),
    ahead=st.floats(0, 3 * 86400),
    zone=st.sampled_from(["UTC", "Europe/Berlin", "America/New_York"]),
    cadence=st.sampled_from(
        [
            {"every": "7m"},
            {"every": "1h"},
            {"cron": "*/20 * * * *"},
            {"cron": "30 2 * * *"},
            {"cron": "0 9-17 * * 1-5"},
            {"cron": "15 1,2,3 * * *"},
        ]
    ),
    missed=st.sampled_from(["skip", "latest", "all"]),
    catch_up=st.sampled_from([0, 60, 3600, 86400]),
    jitter=st.sampled_from([0, 30, 600]),
    base=st.sampled_from([date(2026, 3, 27), date(2026, 10, 23), date(2026, 10, 30)]),
)
def test_the_plan_fires_what_walking_every_tick_would(
    base: date,
    cursor: int,
    ahead: float,
    zone: str,
    cadence: dict[str, str],
    missed: str,
    catch_up: int,
    jitter: int,
) -> None:
    # Days with a DST change in Europe or America ahead of them.
    start = datetime(base.year, base.month, base.day, tzinfo=UTC).timestamp()
    s = schedule(
        **cadence, timezone=zone, missed=missed, catch_up_seconds=catch_up, jitter_seconds=jitter
    )
    now = start + cursor + ahead
    assert list(plan(s, start + cursor, now).fire) == reference_plan(s, start + cursor, now)


def test_catch_up_is_bounded_with_an_error_naming_the_value_and_the_maximum() -> None:
    assert schedule(every="1m", catch_up_seconds=MAX_CATCH_UP_SECONDS).catch_up_seconds == 31 * DAY
    with pytest.raises(ValueError) as caught:
        schedule(every="1m", catch_up_seconds=MAX_CATCH_UP_SECONDS + 1)
    assert str(caught.value) == (
        "schedule 's': catch_up_seconds must be at most 2678400 (31 days), got 2678401"
    )
    with pytest.raises(ConfigError, match=r"schedules\.n\.catch_up_seconds must be at most"):
        parse_config(
            {
                "schedules": {
                    "n": {"every": "1m", "kind": "r", "deliver_to": "d", "catch_up_seconds": 10**9}
                }
            }
        )


def test_a_catch_up_is_written_in_parts_of_a_bounded_number_of_runs() -> None:
    from trio_dispatch.schedules.service import parts

    a, b, c = schedule(name="a", every="1s"), schedule(name="b", every="1s"), schedule(every="1h")
    ticks = [(float(t), True) for t in range(1, 451)]
    cut = parts([(a, ticks, 451.0), (b, ticks[:10], 10.0), (c, [], 3600.0)], 200)
    assert [[(s.name, len(t), handled) for s, t, handled in part] for part in cut] == [
        [("a", 200, None)],
        [("a", 200, None)],
        [("a", 50, 451.0), ("b", 10, 10.0), ("s", 0, 3600.0)],
    ]
    assert [t for part in cut for s, ts, _ in part if s is a for t in ts] == ticks
