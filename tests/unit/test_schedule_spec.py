"""Schedules without a store (SPEC 14): checks, ticks across DST, the plan
for missed ticks, the configuration section."""

from __future__ import annotations

import itertools
from collections import Counter
from datetime import UTC, date, datetime, timedelta
from zoneinfo import ZoneInfo

import pytest

from trio_dispatch.config import ConfigError, parse_config
from trio_dispatch.schedules import Schedule, schedules_from_config
from trio_dispatch.schedules.spec import ON_TIME_SECONDS, plan


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
