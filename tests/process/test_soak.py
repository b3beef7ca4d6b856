"""Small runs of the reliability drivers in scripts/soak.py: real worker
processes, real SIGKILLs, one real SQLite file. Under CI (the full tier)
they run at the sizes below; a developer's run uses about half of each."""

from __future__ import annotations

from pathlib import Path

import pytest

from ..helpers import load_script, size

soak = load_script("soak")


@pytest.mark.slow
def test_crash_soak_loses_nothing_and_never_repeats_an_attempt(tmp_path: Path) -> None:
    """SIGKILLs while an operator cancels a fifth of the rows as they come,
    waiting or running, and a quarter of the enqueues replace their coalesce
    key's waiting row (docs/controls.md): a cancelled or superseded row is accounted
    for by its transition (a superseded one never sent), every other row is
    sent, and no (id, attempt) twice."""
    n, kills = size(300, 150), size(6, 4)
    figures = soak.crash_soak(tmp_path, n=n, kills=kills, cancel_rate=0.2, coalesce_rate=0.25)
    assert figures["committed_ids"] == n
    assert figures["lost"] == 0 and figures["all_terminal"], figures
    assert figures["statuses"].get("cancelled", 0) > 0, figures
    assert figures["cancelled_without_transition"] == 0, figures
    assert figures["superseded"] > 0, figures
    assert figures["superseded_without_transition"] == 0, figures
    assert figures["superseded_after_a_send"] == 0, figures
    assert figures["missing_from_ledger"] == 0, figures
    assert figures["duplicate_pairs"] == 0, figures
    assert figures["max_sends_of_one_id"] <= kills + 1, figures
    assert figures["ok"], figures


@pytest.mark.slow
@pytest.mark.postgres_only
def test_crash_soak_on_postgresql_loses_nothing_and_never_repeats_an_attempt(
    tmp_path: Path, db_target: str
) -> None:
    """The crash soak on PostgreSQL: the worker processes claim rows ahead
    of their slots, and SIGKILLs land among them; every row is sent, none
    with an (id, attempt) twice."""
    n, kills = size(300, 150), size(6, 4)
    figures = soak.crash_soak(tmp_path, n=n, kills=kills, cancel_rate=0.2, store=db_target)
    assert figures["engine"] == "postgresql"
    assert figures["committed_ids"] == n
    assert figures["lost"] == 0 and figures["all_terminal"], figures
    assert figures["cancelled_without_transition"] == 0, figures
    assert figures["missing_from_ledger"] == 0, figures
    assert figures["duplicate_pairs"] == 0, figures
    assert figures["ok"], figures


@pytest.mark.slow
def test_crash_soak_with_a_rate_a_shared_limit_and_a_breaker_loses_nothing(
    tmp_path: Path,
) -> None:
    """SIGKILLs while three destinations run under a shared rate, a shared
    concurrency and a breaker that failures open (docs/destinations.md): every row ends
    accounted for, and no (id, attempt) is sent twice."""
    n, kills = size(300, 150), size(6, 4)
    policy = {
        "rate": "300/s",
        "burst": 20,
        "concurrency": 6,
        # Cool-downs capped at 1 s: doubling after every failed probe would
        # otherwise park a destination for minutes while half the sends fail.
        "breaker": {
            "failures": 3,
            "min_span_seconds": 0,
            "cool_down_seconds": 0.3,
            "max_cool_down_seconds": 1,
        },
    }
    # Half the sends fail: three in a row to one destination happen with
    # near certainty among the run's hundreds of sends (the breaker opens).
    figures = soak.crash_soak(tmp_path, n=n, kills=kills, policy=policy, fail_rate=0.5)
    assert figures["committed_ids"] == n
    assert figures["lost"] == 0 and figures["all_terminal"], figures
    assert figures["missing_from_ledger"] == 0, figures
    assert figures["duplicate_pairs"] == 0, figures
    assert figures["ok"], figures
    changes = soak.query(
        tmp_path / "crash.db",
        "SELECT COUNT(*) AS n FROM dispatch_destination_changes WHERE state = 'open'",
    )
    assert changes[0]["n"] > 0, "the failing sends should have opened a breaker"


@pytest.mark.slow
def test_several_workers_share_one_file_without_a_double_send(tmp_path: Path) -> None:
    n = size(1500, 600)
    figures = soak.several_workers(tmp_path, n=n, workers=4, fail_rate=0.1)
    assert figures["lost"] == 0 and figures["status_sum"] == n, figures
    assert figures["duplicate_pairs"] == 0 and figures["missing_from_ledger"] == 0, figures
    assert figures["repeated_ids"] > 0, "the failing transport should have caused retries"
    assert figures["workers_alive_at_end"] == 4 and figures["worker_exits"] == [0] * 4, figures
    assert figures["ok"], figures


@pytest.mark.slow
@pytest.mark.parametrize("processes", [size(8, 4)])
def test_dedup_race_across_processes_gives_every_caller_the_winner(
    tmp_path: Path, processes: int
) -> None:
    n = size(300, 150)
    figures = soak.dedup_race(tmp_path, n=n, processes=processes)
    assert figures["rows"] == figures["transitions"] == n, figures
    assert figures["callers_told_wrong_id"] == 0, figures
    assert figures["ok"], figures


@pytest.mark.slow
@pytest.mark.postgres_only
def test_several_workers_share_one_postgresql_database_without_a_double_send(
    tmp_path: Path, db_target: str
) -> None:
    n = size(1500, 600)
    figures = soak.several_workers(tmp_path, n=n, workers=4, fail_rate=0.1, store=db_target)
    assert figures["engine"] == "postgresql"
    assert figures["lost"] == 0 and figures["status_sum"] == n, figures
    assert figures["duplicate_pairs"] == 0 and figures["missing_from_ledger"] == 0, figures
    assert figures["workers_alive_at_end"] == 4 and figures["worker_exits"] == [0] * 4, figures
    assert figures["ok"], figures
