"""Ordering keys (docs/ordering.md) under real worker processes: SIGKILL loops and
several workers on one database (scripts/ordering_soak.py). Under CI the
full sizes below run; a developer's run uses smaller ones."""

from __future__ import annotations

from pathlib import Path

import pytest

from ..helpers import load_script, size

ordering_soak = load_script("ordering_soak")


def _attempt(dispatch_id: str, key: str, start: float, end: float | None, who: str = "w1") -> str:
    lines = f"S {dispatch_id} 1 {key} {who} {start}\n"
    return lines + ("" if end is None else f"E {dispatch_id} 1 {key} {who} {end}\n")


def test_the_check_counts_an_attempt_cut_by_a_kill_as_running_until_its_process_died(
    tmp_path: Path,
) -> None:
    log = tmp_path / "attempts"
    # a: cut by the death of w1 at 5.0; b (same key) starts at 4.0: an overlap.
    log.write_text(_attempt("a", "k", 1.0, None) + _attempt("b", "k", 4.0, 4.5, "w2"))
    figures = ordering_soak.ordering_figures(
        {"k": ["a", "b"]},
        ordering_soak.read_attempts(log),
        {"w1": 5.0},
        {"a": "delivered", "b": "delivered"},
    )
    assert (figures["cut_attempts"], figures["overlaps"]) == (1, 1), figures
    log.write_text(_attempt("a", "k", 1.0, None) + _attempt("b", "k", 6.0, 6.5, "w2"))
    figures = ordering_soak.ordering_figures(
        {"k": ["a", "b"]}, ordering_soak.read_attempts(log), {"w1": 5.0}, {}
    )
    assert (figures["overlaps"], figures["lost"]) == (0, 2), figures


def test_the_check_sees_rows_of_a_key_started_out_of_enqueue_order(tmp_path: Path) -> None:
    log = tmp_path / "attempts"
    log.write_text(
        _attempt("a", "k", 1.0, 2.0) + _attempt("b", "k", 3.0, 4.0) + _attempt("a", "k", 5.0, 6.0)
    )
    figures = ordering_soak.ordering_figures(
        {"k": ["a", "b"]}, ordering_soak.read_attempts(log), {}, {}
    )
    assert figures["keys_out_of_order"] == 1 and figures["duplicate_pairs"] == 1, figures


def _assert_ordered(figures: dict[str, object], rows: int) -> None:
    assert figures["rows"] == rows and figures["all_delivered"], figures
    assert figures["lost"] == 0 and figures["never_sent"] == 0, figures
    assert figures["duplicate_pairs"] == 0, figures
    assert figures["keys_out_of_order"] == 0, figures
    assert figures["overlaps"] == 0, figures
    assert figures["ok"], figures


@pytest.mark.slow
def test_sigkilled_workers_deliver_every_key_in_order_one_attempt_at_a_time(
    tmp_path: Path, db_target: str, engine: str
) -> None:
    keys, per_key, kills = size(50, 25), size(40, 20), size(10, 5)
    figures = ordering_soak.ordered_soak(
        tmp_path, keys=keys, per_key=per_key, workers=2, kills=kills, store=db_target
    )
    assert figures["engine"] == ("sqlite" if engine == "sqlite" else "postgresql")
    _assert_ordered(figures, keys * per_key)
    assert figures["cut_attempts"] > 0, "no kill landed mid-attempt"


@pytest.mark.slow
@pytest.mark.postgres_only
def test_four_postgresql_workers_never_deliver_two_rows_of_a_key_at_once(
    tmp_path: Path, db_target: str
) -> None:
    keys, per_key = size(200, 100), size(10, 8)
    figures = ordering_soak.ordered_soak(
        tmp_path,
        keys=keys,
        per_key=per_key,
        workers=4,
        kills=0,
        concurrency=8,
        store=db_target,
        poll=True,
    )
    _assert_ordered(figures, keys * per_key)
    assert figures["polls"] > 10 and figures["keys_seen_delivering_twice"] == [], figures
    assert figures["workers_alive_at_end"] == 4 and figures["worker_exits"] == [0] * 4, figures
