"""``trio-dispatch destinations`` (docs/destinations.md#pause-and-resume,
docs/destinations.md#what-operators-see) on both engines: the listing and ``show`` (read-only: they
write nothing), pause with ``--for`` or ``--until``, resume and enable, each
one line and one audit row naming the command's user; a name no one knows
and bad values write nothing."""

from __future__ import annotations

import calendar
import getpass
import json
import sqlite3
import time
from pathlib import Path
from typing import Any

import pytest

from ..conftest import RawDB
from ..helpers import assert_one_line_error, cli_process, run_cli
from .test_schedules_cli import file_state, migrate

DESTINATIONS = """\
destinations:
  "*":
    concurrency: 2
  billing:
    rate: 50/s
    burst: 10
    concurrency: 4
  quiet: {}
"""
FILL = (
    "INSERT INTO dispatch_outbox (id, kind, deliver_to, payload, status, attempt, "
    "next_attempt_at, created_at, updated_at) VALUES (?, 'k', ?, '{}', ?, ?, ?, ?, ?)"
)


def write_config(tmp_path: Path, target: str, destinations: str = DESTINATIONS) -> Path:
    config = tmp_path / "trio-dispatch.yaml"
    config.write_text(f"store: {json.dumps(target)}\n{destinations}", encoding="utf-8")
    return config


def add_row(raw: RawDB, dispatch_id: str, deliver_to: str, status: str, due: float) -> None:
    attempt = 1 if status == "delivering" else 0
    raw.execute(FILL, (dispatch_id, deliver_to, status, attempt, due, due, due))


def cli(config: Path, *argv: str) -> Any:
    return run_cli("--config", str(config), "destinations", *argv)


def listed(config: Path) -> dict[str, dict[str, Any]]:
    done = cli(config, "--json")
    assert done.returncode == 0, done.stderr
    document = json.loads(done.stdout)
    assert document["truncated"] is False
    return {entry["name"]: entry for entry in document["destinations"]}


def audit(raw: RawDB) -> list[dict[str, Any]]:
    return raw.rows(
        "SELECT destination, previous_state, state, reason, source, actor, until_at "
        "FROM dispatch_destination_changes ORDER BY id"
    )


def everything(raw: RawDB) -> list[Any]:
    return [
        raw.rows("SELECT * FROM dispatch_destinations ORDER BY name"),
        audit(raw),
        raw.rows("SELECT id, status, updated_at FROM dispatch_outbox ORDER BY id"),
    ]


def actor(action: str) -> str:
    return f"trio-dispatch destinations {action} ({getpass.getuser()})"


def test_the_listing_shows_configured_and_live_destinations(
    tmp_path: Path, db_target: str, raw: RawDB
) -> None:
    migrate(db_target)
    config = write_config(tmp_path, db_target)
    now = time.time()
    for i in range(3):
        add_row(raw, f"m{i}", "mailer", "pending", now - 90)
    add_row(raw, "m-run", "mailer", "delivering", now + 60)
    add_row(raw, "b0", "billing", "pending", now + 600)
    done = cli(config)
    assert done.returncode == 0, done.stderr
    header, *rows = done.stdout.splitlines()
    assert header.split() == [
        "NAME", "STATE", "UNTIL", "RATE", "STARTS", "RUNNING", "PENDING", "OLDEST_DUE",
        "FAILS", "LAST_OK", "LAST_FAIL", "REASON",
    ]  # fmt: skip
    cells = {row.split()[0]: row.split() for row in rows}
    assert list(cells) == ["billing", "mailer", "quiet"]
    assert cells["billing"][1:8] == ["active", "-", "50/s", "10/10", "0/4", "1", "-"]
    assert cells["mailer"][1:7] == ["active", "-", "-", "-", "1/2", "3"]
    assert cells["mailer"][7].startswith("1m3")  # 90 s and a little
    entries = listed(config)
    assert list(entries) == ["billing", "mailer", "quiet"]
    billing, mailer = entries["billing"], entries["mailer"]
    assert set(billing) == {
        "name", "state", "until", "reason", "configured", "policy_from", "policy",
        "starts_available", "starts_held", "concurrency_used", "concurrency_limit", "pending",
        "pending_capped", "oldest_due_age_seconds", "throttled_until", "failures_in_a_row",
        "last_success_at", "last_failure_at",
    }  # fmt: skip
    assert (billing["configured"], billing["policy"]["rate"], billing["starts_available"]) == (
        True,
        "50/s",
        10,
    )
    assert (mailer["policy_from"], mailer["concurrency_used"], mailer["concurrency_limit"]) == (
        "*",
        1,
        2,
    )
    assert mailer["pending"] == 3 and mailer["oldest_due_age_seconds"] >= 90


def test_without_destinations_the_listing_says_so(db_target: str) -> None:
    migrate(db_target)
    done = run_cli("--db", db_target, "destinations")
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("no destinations")
    document = json.loads(run_cli("--db", db_target, "destinations", "--json").stdout)
    assert document == {"destinations": [], "truncated": False}


def test_pause_for_a_duration_then_resume_round_trip(
    tmp_path: Path, db_target: str, raw: RawDB
) -> None:
    migrate(db_target)
    config = write_config(tmp_path, db_target)
    before = time.time()
    paused = cli(config, "pause", "billing", "--for", "30m", "--reason", "partner maintenance")
    assert paused.returncode == 0, paused.stderr
    line = paused.stdout.strip()
    assert line.startswith("paused destination billing: active -> paused until 20")
    assert line.endswith("(in 29m59s)") or line.endswith("(in 30m00s)"), line
    (change,) = audit(raw)
    assert (change["previous_state"], change["state"], change["reason"]) == (
        "active",
        "paused",
        "partner maintenance",
    )
    assert (change["source"], change["actor"]) == ("operator", actor("pause"))
    assert before + 1800 <= change["until_at"] <= time.time() + 1800
    entry = listed(config)["billing"]
    assert (entry["state"], entry["reason"]) == ("paused", "partner maintenance")
    assert entry["until"] == pytest.approx(change["until_at"])
    assert "paused" in cli(config).stdout.splitlines()[1].split()
    shown = cli(config, "show", "billing")
    assert shown.returncode == 0, shown.stderr
    assert "state               paused until 20" in shown.stdout
    assert "partner maintenance" in shown.stdout and actor("pause") in shown.stdout
    resumed = cli(config, "resume", "billing", "--reason", "partner back")
    assert resumed.stdout.strip() == "resumed destination billing: paused -> active"
    assert [(c["state"], c["reason"], c["actor"]) for c in audit(raw)][1] == (
        "active",
        "partner back",
        actor("resume"),
    )
    # Starts claimed ahead by workers and not yet begun count as spent.
    raw.execute("UPDATE dispatch_destinations SET rate_held = 3 WHERE name = 'billing'")
    shown = cli(config, "show", "billing").stdout
    assert "7 of 10 (3 claimed ahead, not yet begun)" in shown, shown
    assert listed(config)["billing"]["starts_held"] == 3
    raw.execute("UPDATE dispatch_destinations SET rate_held = 0 WHERE name = 'billing'")
    # Not paused: nothing to do, said plainly, exit 0 (as schedules resume does).
    again = cli(config, "resume", "billing")
    assert again.returncode == 0
    assert again.stdout.strip() == (
        "destination billing was not paused (it is active): nothing to do"
    )
    assert len(audit(raw)) == 2
    document = json.loads(cli(config, "resume", "billing", "--json").stdout)
    assert document == {
        "destination": "billing",
        "action": "resume",
        "changed": False,
        "from": "active",
        "to": "active",
        "until": None,
        "reason": None,
    }


def test_pause_until_a_time_and_without_an_end(tmp_path: Path, db_target: str, raw: RawDB) -> None:
    migrate(db_target)
    config = write_config(tmp_path, db_target)
    until = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() + 7200))
    done = cli(config, "pause", "billing", "--until", until, "--json")
    assert done.returncode == 0, done.stderr
    document = json.loads(done.stdout)
    expected = calendar.timegm(time.strptime(until, "%Y-%m-%dT%H:%M:%SZ"))
    assert document["until"] == pytest.approx(expected)
    assert (document["from"], document["to"], document["changed"]) == ("active", "paused", True)
    offset = cli(config, "pause", "quiet", "--until", until.replace("Z", "+00:00"))
    assert offset.stdout.strip().startswith("paused destination quiet: active -> paused until ")
    assert until in offset.stdout
    forever = cli(config, "pause", "billing")
    assert forever.stdout.strip() == ("paused destination billing: paused -> paused until resumed")
    assert (
        raw.scalar("SELECT state_until FROM dispatch_destinations WHERE name = 'billing'") is None
    )
    assert listed(config)["billing"]["until"] is None


def test_enable_closes_a_disabled_breaker_and_says_when_there_is_none(
    tmp_path: Path, db_target: str, raw: RawDB
) -> None:
    migrate(db_target)
    config = write_config(tmp_path, db_target)
    raw.execute(
        "INSERT INTO dispatch_destinations (name, state, reason, failures) "
        "VALUES ('billing', 'disabled', 'open 3600s', 12)"
    )
    entry = listed(config)["billing"]
    assert (entry["state"], entry["failures_in_a_row"]) == ("disabled", 12)
    done = cli(config, "enable", "billing", "--reason", "fixed upstream")
    assert done.stdout.strip() == "enabled destination billing: disabled -> active"
    assert [(c["previous_state"], c["state"], c["actor"]) for c in audit(raw)] == [
        ("disabled", "active", actor("enable"))
    ]
    assert listed(config)["billing"]["failures_in_a_row"] == 0
    again = cli(config, "enable", "billing")
    assert again.returncode == 0
    assert again.stdout.strip() == (
        "destination billing has no breaker open or disabled (it is active): nothing to do"
    )
    assert len(audit(raw)) == 1


@pytest.mark.parametrize("action", ["show", "pause", "resume", "enable"])
def test_a_name_no_one_knows_exits_1_naming_it_and_writes_nothing(
    tmp_path: Path, db_target: str, raw: RawDB, action: str
) -> None:
    migrate(db_target)
    config = write_config(tmp_path, db_target)
    done = cli(config, action, "biling")
    assert_one_line_error(done, 1, "'biling'", "configured: billing, quiet")
    assert raw.scalar("SELECT COUNT(*) FROM dispatch_destinations") == 0
    assert raw.scalar("SELECT COUNT(*) FROM dispatch_destination_changes") == 0
    # A destination with live rows is known without configuration.
    add_row(raw, "x1", "biling", "pending", time.time())
    assert cli(config, action, "biling").returncode == 0


@pytest.mark.parametrize(
    ("argv", "code", "words"),
    [
        (["pause", "billing", "--for", "0.5x"], 2, ["invalid duration"]),
        (["pause", "billing", "--until", "2001-01-01T00:00:00Z"], 2, ["not in the future"]),
        (["pause", "billing", "--until", "next week"], 2, ["invalid time 'next week'"]),
        (["pause", "*"], 2, ["'*' names the defaults"]),
        (["pause", "bill\x1bing"], 2, ["control characters", "\\x1b"]),
        (["resume", "nowhere"], 1, ["'nowhere'"]),
    ],
)
def test_bad_input_is_one_line_and_writes_nothing(
    tmp_path: Path,
    db_target: str,
    raw: RawDB,
    engine: str,
    argv: list[str],
    code: int,
    words: list[str],
) -> None:
    migrate(db_target)
    config = write_config(tmp_path, db_target)
    assert cli(config, "pause", "quiet", "--reason", "before").returncode == 0
    before = everything(raw)
    state = file_state(Path(db_target)) if engine == "sqlite" and code == 2 else None
    line = assert_one_line_error(cli(config, *argv), code, *words)
    assert "\x1b" not in line
    assert everything(raw) == before
    if state is not None:
        assert file_state(Path(db_target)) == state


def test_the_listing_and_show_write_nothing(
    tmp_path: Path, db_target: str, raw: RawDB, engine: str
) -> None:
    migrate(db_target)
    config = write_config(tmp_path, db_target)
    add_row(raw, "m0", "mailer", "pending", time.time() - 5)
    # A pause whose end has passed reads as active, and stays unrecorded.
    raw.execute(
        "INSERT INTO dispatch_destinations (name, state, state_until, reason) "
        "VALUES ('billing', 'paused', ?, 'old')",
        (time.time() - 10,),
    )
    before = everything(raw)
    state = file_state(Path(db_target)) if engine == "sqlite" else None
    for argv in (
        [],
        ["--json"],
        ["--wide"],
        ["show", "billing"],
        ["show", "mailer", "--json"],
        ["show", "quiet"],
    ):
        done = cli(config, *argv)
        assert done.returncode == 0, (argv, done.stderr)
    assert listed(config)["billing"]["state"] == "active"
    assert everything(raw) == before
    if state is not None:
        assert file_state(Path(db_target)) == state  # not a byte, no -wal/-shm


@pytest.mark.sqlite_only
def test_on_an_older_schema_every_destinations_command_names_migrate(
    tmp_path: Path, db_path: Path
) -> None:
    migrate(str(db_path))
    conn = sqlite3.connect(db_path)
    conn.execute("DELETE FROM trio_dispatch_schema WHERE version > 9")
    conn.commit()
    conn.close()
    config = write_config(tmp_path, str(db_path))
    before = file_state(db_path)
    for argv in (["destinations"], ["destinations", "pause", "billing"]):
        done = run_cli("--config", str(config), *argv)
        assert_one_line_error(done, 2, "schema version 9", "trio-dispatch migrate")
    assert file_state(db_path) == before


@pytest.mark.slow  # three interpreters a case; the round trip above runs in this process
def test_a_round_trip_in_a_child_process(tmp_path: Path, db_target: str, raw: RawDB) -> None:
    """``python -m trio_dispatch`` as an operator runs it."""
    migrate(db_target)
    config = write_config(tmp_path, db_target)
    paused = cli_process(
        "--config", str(config), "destinations", "pause", "billing", "--for", "1h", "--json"
    )
    assert paused.returncode == 0, paused.stderr
    assert json.loads(paused.stdout)["to"] == "paused"
    shown = cli_process("--config", str(config), "destinations", "show", "billing", "--json")
    document = json.loads(shown.stdout)["destination"]
    assert document["state"] == "paused"
    assert [c["actor"] for c in document["changes"]] == [actor("pause")]
    resumed = cli_process("destinations", "resume", "billing", "--config", str(config))
    assert resumed.stdout.strip() == "resumed destination billing: paused -> active"
    assert [c["state"] for c in audit(raw)] == ["paused", "active"]
