"""Retry schedules and per-destination caps as values: the delay before each
attempt, bad schedules refused by name, which rows caps let through."""

from __future__ import annotations

import pytest

from trio_dispatch.backoff import check_retry_schedule, retry_delay
from trio_dispatch.outbox.claim import DestinationCaps

T0 = 1_000_000.0


def test_a_schedule_gives_the_delay_before_each_next_attempt_and_repeats_its_last() -> None:
    schedule = (5, 300, 1800)
    assert [retry_delay(attempt, schedule) for attempt in (1, 2, 3, 4, 9)] == [
        5.0,
        300.0,
        1800.0,
        1800.0,
        1800.0,
    ]
    assert retry_delay(1) == 60.0  # without one: backoff_seconds


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ([], "retry_schedule must be a non-empty list"),
        ("5, 10", "retry_schedule must be a non-empty list"),
        ([5, -1], "retry_schedule[1] must be a number of seconds from 0"),
        ([5, float("nan")], "retry_schedule[1] must be a number of seconds from 0"),
        ([True], "retry_schedule[0] must be a number of seconds from 0"),
        ([1e12], "retry_schedule[0] must be a number of seconds from 0"),
    ],
)
def test_a_bad_schedule_is_refused_naming_the_item(value: object, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        check_retry_schedule("retry_schedule", value)


def test_caps_fit_rows_in_order_under_what_is_running() -> None:
    caps = DestinationCaps(2)
    caps.hold("a1", "a", lease_until=T0 + 10)
    rows = [{"deliver_to": d} for d in ("a", "a", "b", "b", "b", "c")]
    assert [row["deliver_to"] for row in caps.fit(rows, T0)] == ["a", "b", "b", "c"]
    caps.hold("a2", "a", lease_until=T0 + 10)
    assert caps.full(T0) == ["a"]
    assert caps.full(T0 + 11) == []  # a hold ends with its lease whatever happened
    caps.hold("a3", "a", lease_until=T0 + 20)
    caps.drop([("a3", T0 + 20), ("never-held", T0)])
    assert caps.running(T0) == {}
    # A row claimed again at once is a new attempt: ending the old one keeps it.
    caps.hold("a4", "a", lease_until=T0 + 30)
    caps.hold("a4", "a", lease_until=T0 + 31)
    caps.drop([("a4", T0 + 30)])
    assert caps.running(T0) == {"a": 1}
    with pytest.raises(ValueError, match="per_destination_concurrency must be"):
        DestinationCaps(0)
