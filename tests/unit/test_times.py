"""How a time a person types is read (``--since``, the dashboard's replay
form): ISO 8601 with an offset, or a duration before now; nothing else."""

from __future__ import annotations

import pytest

from trio_dispatch.times import iso_time, read_time

NOW = 1_796_202_000.0  # 2026-12-02T09:00:00Z


@pytest.mark.parametrize(
    "text, expected",
    [
        ("2026-12-02T09:00:00Z", NOW),
        ("2026-12-02T09:00:00z", NOW),
        ("2026-12-02T10:00+01:00", NOW),
        ("2026-12-02 04:00:00.5-05:00", NOW + 0.5),
        (" 2h ", NOW - 7200),
        ("2h ago", NOW - 7200),
        ("90s", NOW - 90),
        ("1.5d", NOW - 129_600),
        ("1w", NOW - 604_800),
    ],
)
def test_a_time_is_iso_8601_with_an_offset_or_a_duration_before_now(
    text: str, expected: float
) -> None:
    assert read_time("since", text, NOW) == expected


@pytest.mark.parametrize(
    "text, message",
    [
        ("2026-12-02T09:00", "invalid since '2026-12-02T09:00': no UTC offset"),
        ("2026-12-02", "no UTC offset"),
        ("90", "invalid since '90': use ISO 8601"),
        ("soon", "invalid since 'soon'"),
        ("", "invalid since ''"),
        ("2h later", "invalid since '2h later'"),
        ("-2h", "invalid since '-2h'"),
    ],
)
def test_anything_else_is_refused_naming_it(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        read_time("since", text, NOW)


@pytest.mark.parametrize("when", [NOW, NOW + 0.123456, 0.0])
def test_iso_time_reads_back_as_the_same_instant(when: float) -> None:
    assert read_time("until", iso_time(when), NOW) == pytest.approx(when, abs=1e-6)
