"""How many rows a worker holds ahead of its slots (trio_dispatch.worker.finisher):
as many as its slots get through, at the attempts' mean pace, in a quarter
of the lease's margin, up to the most; none once one attempt takes longer."""

from __future__ import annotations

import pytest

from trio_dispatch.worker.finisher import MOST_AHEAD, MOST_AHEAD_ONE_WRITER, Pace, most_ahead


def test_the_most_held_ahead_is_128_or_64_on_one_writer_or_twice_the_concurrency() -> None:
    assert most_ahead(1) == most_ahead(16) == MOST_AHEAD == 128
    assert most_ahead(64) == 128 and most_ahead(100) == 200
    assert most_ahead(1, True) == most_ahead(16, True) == MOST_AHEAD_ONE_WRITER == 64
    assert most_ahead(64, True) == 128


def test_short_attempts_hold_the_most_ahead() -> None:
    pace = Pace(margin=5.0)  # a held row may wait 1.25 s
    assert pace.ahead_rows(16, 64) == 64  # nothing measured yet
    for _ in range(50):
        pace.note(0.001)
    assert pace.ahead_rows(16, 64) == 64


@pytest.mark.parametrize(
    ("seconds", "rows"),
    [(0.5, 40), (1.0, 20), (1.25, 16), (2.0, 10)],
)
def test_slower_attempts_hold_fewer_ahead_so_a_held_row_waits_at_most_the_wait(
    seconds: float, rows: int
) -> None:
    pace = Pace(margin=5.0)
    for _ in range(200):
        pace.note(seconds)
    assert pace.ahead_rows(16, 64) == rows
    # 16 slots get through ``rows`` held rows in about rows / 16 attempts.
    assert rows / 16 * seconds <= 1.25 + 1e-9


def test_attempts_longer_than_the_wait_times_the_slots_hold_none_ahead() -> None:
    pace = Pace(margin=1.5)  # a held row may wait 0.375 s
    for _ in range(200):
        pace.note(10.0)
    assert pace.ahead_rows(1, 64) == 0
