"""``trio-dispatch retry`` with filters (docs/destinations.md#replay) on both engines:
the round trip in a child process (dry run, run, run again), the refusals
(one line, exit 1 or 2, nothing written) and the help."""

from __future__ import annotations

import json
from typing import Any

import anyio
import pytest

from trio_dispatch import open_store
from trio_dispatch.times import iso_time

from ..conftest import RawDB
from ..engine.test_replay import RETRY, T0, names, outage, retried
from ..helpers import cli_process, dry_run, everything, json_output, refused, run_cli


@pytest.fixture
def failed(db_target: str, raw: RawDB) -> dict[str, str]:
    """The engine tests' outage: failed rows of two destinations at known
    times (``updated_at``), and rows that did not fail."""

    async def build() -> dict[str, str]:
        async with open_store(db_target) as store:
            return await outage(store, raw)  # type: ignore[arg-type]

    return anyio.run(build, backend="trio")


def test_a_replay_round_trip_in_a_child_process(
    db_target: str, raw: RawDB, failed: dict[str, str]
) -> None:
    """Dry run, the replay itself as a real ``python -m trio_dispatch``
    process, and the same command again."""
    window = ["--since", iso_time(T0 + 15), "--until", iso_time(T0 + 30)]
    args = ["retry", "--db", db_target, "--deliver-to", "billing", *window]
    said = dry_run(raw, *args)
    assert said.startswith("would retry 2 dispatches (status dead_letter or expired, ")
    assert "deliver_to 'billing', changed since 1970-01-12T13:46:55Z" in said
    done = cli_process(*args, "--reason", "billing is back", "--json")
    assert json_output(done, "matched", "retried", "skipped", "dry_run") == {
        "matched": 2,
        "retried": 2,
        "skipped": 0,
        "dry_run": False,
    }
    assert json_output(done)["filter"] == {
        "statuses": ["dead_letter", "expired"],
        "deliver_to": "billing",
        "kind": None,
        "ordering_key": None,
        "since": T0 + 15,
        "until": T0 + 30,
    }
    assert names(failed, retried(raw)) == ["a20", "e25"]
    last = raw.transitions(failed["a20"])[-1]
    assert last["reason_code"] == RETRY and last["actor"].startswith("trio-dispatch retry (")
    meta = last["metadata"] if isinstance(last["metadata"], dict) else json.loads(last["metadata"])
    assert meta["reason"] == "billing is back"
    after = everything(raw)
    again = run_cli(*args)
    assert again.returncode == 0, again.stderr
    assert again.stdout.startswith("retried 0 of 0 matching dispatches")
    assert everything(raw) == after


def test_a_replay_of_one_status_with_a_new_deadline(
    db_target: str, raw: RawDB, failed: dict[str, str]
) -> None:
    done = run_cli("retry", "--db", db_target, "--status", "expired", "--expires-in", "1d")
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("retried 1 of 1 matching dispatches (status expired)")
    row = raw.row(failed["e25"])
    assert row["status"] == "pending" and row["expires_at"] > row["updated_at"] + 86_000
    assert names(failed, retried(raw)) == ["e25"]


@pytest.mark.parametrize(
    "args, code, words",
    [
        ([], 2, ["retry needs a dispatch id, or at least one filter", "--deliver-to"]),
        (["--dry-run"], 2, ["at least one filter"]),
        (["ID", "--deliver-to", "billing"], 2, ["an id or filters, not both", "--deliver-to"]),
        (["--status", "pending"], 1, ["retry of pending rows is not allowed"]),
        (["--status", "delivered", "--deliver-to", "billing"], 1, ["delivered"]),
        (["--status", "lost"], 2, ["--status", "invalid status 'lost'"]),
        (["--since", "soon"], 2, ["--since", "invalid time 'soon'", "ISO 8601"]),
        (["--until", "2026-12-02T09:00"], 2, ["--until", "no UTC offset"]),
        (["--since", "90"], 2, ["--since", "invalid time '90'"]),
        (["--since", "1h", "--until", "2h"], 2, ["must be before until"]),
        (["--deliver-to", "a\x1bb"], 2, ["--deliver-to", "control characters", "\\x1b"]),
        (["--deliver-to", "billing", "--reason", "two\nlines"], 2, ["reason", "control"]),
        (["--deliver-to", "billing", "--expires-in", "later"], 2, ["invalid duration"]),
    ],
)
def test_a_bad_replay_is_one_line_and_writes_nothing(
    db_target: str, raw: RawDB, failed: dict[str, str], args: list[str], code: int, words: Any
) -> None:
    args = [failed["a10"] if arg == "ID" else arg for arg in args]
    done = refused(raw, code, words, "retry", "--db", db_target, *args)
    assert done.stdout == ""


@pytest.mark.sqlite_only  # the parser's own
def test_retry_help_shows_both_forms_and_what_since_compares() -> None:
    done = run_cli("retry", "--help")
    assert done.returncode == 0
    text = " ".join(done.stdout.split())
    for option in ("--deliver-to NAME", "--status STATUS", "--since TIME", "--until TIME"):
        assert option in text
    assert "--dry-run" in text and "[id]" in text
    assert "since <= updated_at < until" in text and "none is retried twice" in text


@pytest.mark.sqlite_only  # the command's output; the engines share it
def test_a_refused_replay_with_json_prints_the_error_document(
    db_target: str, failed: dict[str, str]
) -> None:
    done = run_cli("retry", "--db", db_target, "--status", "acked", "--json")
    assert done.returncode == 1
    assert "retry of acked rows is not allowed" in json.loads(done.stdout)["error"]
