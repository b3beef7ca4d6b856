"""The default backoff formula, ``backoff_seconds``, value by value."""

from __future__ import annotations

from trio_dispatch import (
    backoff_seconds,
)


def test_backoff_seconds_is_the_adr_formula() -> None:
    assert [backoff_seconds(a) for a in range(9)] == [30, 60, 120, 240, 480, 960, 1800, 1800, 1800]
    assert backoff_seconds(1000) == 1800
