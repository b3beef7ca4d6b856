"""The operator CLI against a real SQLite file: exit code, output, and the
database state after. Commands run in this process through ``cli.main``
(argparse and all); the console script, ``python -m`` and a closed pipe are
proven as real processes."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import anyio
import pytest

from trio_dispatch import Delivery, deliver_due_dispatches, enqueue_dispatch, open_store
from trio_dispatch.cli import parse_duration, relative_time

from .conftest import RawDB
from .helpers import assert_one_line_error, cli_process, run_cli

T0 = time.time()
pytestmark = pytest.mark.sqlite_only  # the command's own behaviour; the engines share it


cli = run_cli  # in this process, through cli.main: the command's own behaviour


@pytest.fixture
def populated(db_path: Path) -> dict[str, str]:
    """Dispatches in several statuses: name -> id."""

    async def build() -> dict[str, str]:
        async with open_store(db_path) as db:
            ids = {
                "delivered": await enqueue_dispatch(
                    db, kind="build", deliver_to="seat-ok", now=T0 - 300
                ),
                "failing": await enqueue_dispatch(
                    db, kind="build", deliver_to="seat-fail", now=T0 - 200
                ),
                "dead": await enqueue_dispatch(
                    db, kind="review", deliver_to="seat-fail", max_attempts=1, now=T0 - 100
                ),
                "awaiting": await enqueue_dispatch(
                    db, kind="review", deliver_to="seat-ok", ack_required=True, now=T0 - 50
                ),
            }

            async def send(delivery: Delivery) -> bool:
                return delivery.deliver_to == "seat-ok"

            await deliver_due_dispatches(db, transport=send, now=T0 - 10)
            ids["pending"] = await enqueue_dispatch(db, kind="build", deliver_to="seat-new", now=T0)
            return ids

    return anyio.run(build)


# -- store resolution --------------------------------------------------------


def test_db_flag_then_config_then_env_then_cwd_file(
    tmp_path: Path, db_path: Path, populated: dict[str, str]
) -> None:
    config = tmp_path / "conf" / "c.yaml"
    config.parent.mkdir()
    config.write_text(f"store: {db_path}\n")
    assert json.loads(cli("--db", str(db_path), "stats", "--json").stdout)["total"] == 5
    assert json.loads(cli("--config", str(config), "stats", "--json").stdout)["total"] == 5
    by_env = cli("stats", "--json", env={"TRIO_DISPATCH_CONFIG": str(config)})
    assert json.loads(by_env.stdout)["total"] == 5
    (tmp_path / "trio-dispatch.yaml").write_text(f"store: {db_path.name}\n")
    assert json.loads(cli("stats", "--json", cwd=tmp_path).stdout)["total"] == 5
    assert cli("-m", cwd=tmp_path).returncode == 2


def test_a_missing_store_is_an_error_naming_what_was_tried_and_creates_nothing(
    tmp_path: Path,
) -> None:
    done = cli("ls", cwd=tmp_path)
    assert_one_line_error(done, 2, "--db", "--config", "TRIO_DISPATCH_CONFIG", "trio-dispatch.yaml")
    missing = tmp_path / "missing.db"
    assert_one_line_error(cli("--db", str(missing), "stats"), 2, str(missing), "does not exist")
    config = tmp_path / "c.yaml"
    config.write_text("store: nowhere.db\n")
    assert_one_line_error(cli("--config", str(config), "ls"), 2, "nowhere.db", str(config))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.yaml"]


def test_a_bad_config_file_is_a_one_line_error_naming_the_key(tmp_path: Path) -> None:
    config = tmp_path / "c.yaml"
    config.write_text("store: x.db\nworker:\n  concurrency: many\n")
    assert_one_line_error(cli("--config", str(config), "ls"), 2, "worker.concurrency", "'many'")
    assert_one_line_error(cli("check-config", str(config)), 2, "worker.concurrency")
    assert_one_line_error(cli("--config", str(tmp_path / "nope.yaml"), "ls"), 2, "nope.yaml")


def test_python_dash_m_and_the_console_script_are_the_same_command(
    db_path: Path, populated: dict[str, str]
) -> None:
    script = Path(sys.executable).parent / "trio-dispatch"
    via_script = subprocess.run(
        [str(script), "--db", str(db_path), "stats", "--json"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert via_script.returncode == 0
    via_module = cli_process("--db", str(db_path), "stats", "--json")
    assert via_module.returncode == 0
    assert cli_process("--db", str(db_path), "show", "nope").returncode == 1
    assert cli_process("--db", str(db_path), "ls", "--status", "lost").returncode == 2
    assert json.loads(via_script.stdout)["counts"] == json.loads(via_module.stdout)["counts"]


# -- ls ----------------------------------------------------------------------


def test_ls_prints_an_aligned_table_newest_first(db_path: Path, populated: dict[str, str]) -> None:
    done = cli("--db", str(db_path), "ls")
    assert done.returncode == 0, done.stderr
    header, *rows = done.stdout.splitlines()
    assert header.split() == ["ID", "KIND", "DELIVER_TO", "STATUS", "ATTEMPT", "NEXT", "LAST_ERROR"]
    assert [row.split()[0] for row in rows] == [
        populated[k] for k in ("pending", "awaiting", "dead", "failing", "delivered")
    ]
    status_column = header.index("STATUS")
    shown = {row.split()[0]: row[status_column:].split("  ")[0] for row in rows}
    assert shown == {
        populated["pending"]: "pending",
        populated["awaiting"]: "awaiting ack",  # sent, waiting for its consumer
        populated["dead"]: "dead_letter",
        populated["failing"]: "pending",  # its send failed: a retry, not an ack, is due
        populated["delivered"]: "delivered",
    }
    failing = next(row for row in rows if row.startswith(populated["failing"]))
    assert re.search(
        r"  1/8 +\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ \(in \d+s\) +transport returned False$", failing
    ), failing


def test_ls_filters_by_status_and_kind_and_limits(db_path: Path, populated: dict[str, str]) -> None:
    def ids(*args: str) -> list[str]:
        done = cli("--db", str(db_path), "ls", "--json", *args)
        assert done.returncode == 0, done.stderr
        return [d["id"] for d in json.loads(done.stdout)["dispatches"]]

    assert ids("--status", "dead_letter") == [populated["dead"]]
    assert ids("--kind", "review") == [populated["awaiting"], populated["dead"]]
    assert ids("--status", "pending", "--kind", "build", "--limit", "1") == [populated["pending"]]
    assert cli("--db", str(db_path), "ls", "--status", "acked").stdout == (
        "no dispatches with status acked\n"
    )


def test_ls_rejects_an_unknown_status_listing_the_six(
    db_path: Path, populated: dict[str, str]
) -> None:
    done = cli("--db", str(db_path), "ls", "--status", "lost")
    assert_one_line_error(
        done, 2, "'lost'", "pending", "delivering", "delivered", "acked", "dead_letter", "expired"
    )
    assert_one_line_error(cli("--db", str(db_path), "ls", "--limit", "0"), 2, "'0'")


def test_ls_json_has_stable_keys_and_never_the_token(
    db_path: Path, populated: dict[str, str]
) -> None:
    document = json.loads(cli("--db", str(db_path), "ls", "--json").stdout)
    assert list(document) == ["dispatches"]
    for row in document["dispatches"]:
        assert sorted(row) == sorted(
            [
                "id",
                "kind",
                "deliver_to",
                "status",
                "attempt",
                "max_attempts",
                "next_attempt_at",
                "created_at",
                "updated_at",
                "expires_at",
                "last_error",
                "dedup_key",
                "ack_required",
                "awaiting_ack",
            ]
        )
    waiting = {row["id"]: row["awaiting_ack"] for row in document["dispatches"]}
    assert waiting == {
        populated[k]: k == "awaiting" for k in ("pending", "awaiting", "dead", "failing", "delivered")
    }


# -- show and history --------------------------------------------------------


def test_show_masks_the_ack_token_unless_asked(
    db_path: Path, raw: RawDB, populated: dict[str, str]
) -> None:
    dispatch_id = populated["awaiting"]
    token = str(raw.row(dispatch_id)["ack_token"])
    shown = cli("--db", str(db_path), "show", dispatch_id)
    assert shown.returncode == 0
    assert token not in shown.stdout and "<hidden: use --show-token>" in shown.stdout
    assert '"kind": "review"' in shown.stdout  # the payload, pretty-printed
    revealed = cli("--db", str(db_path), "show", dispatch_id, "--show-token", "--json")
    row = json.loads(revealed.stdout)["dispatch"]
    assert row["ack_token"] == token == row["payload"]["ack_token"]
    masked = json.loads(cli("--db", str(db_path), "show", dispatch_id, "--json").stdout)
    assert token not in json.dumps(masked)


def test_show_and_history_of_a_missing_id_exit_1(db_path: Path, populated: dict[str, str]) -> None:
    assert_one_line_error(cli("--db", str(db_path), "show", "nope"), 1, "'nope'", "not found")
    assert_one_line_error(cli("--db", str(db_path), "history", "nope"), 1, "'nope'")


def test_history_lists_transitions_oldest_first(db_path: Path, populated: dict[str, str]) -> None:
    dispatch_id = populated["dead"]
    done = cli("--db", str(db_path), "history", dispatch_id)
    assert done.returncode == 0
    lines = done.stdout.splitlines()[1:]
    for line in lines:  # UTC, ISO 8601, and how long ago
        assert re.match(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ \((\d+s ago|now)\) ", line), line
    codes = [line.split(") ", 1)[1].split()[3] for line in lines]
    assert codes == [
        "dispatch.pending.enqueued",
        "dispatch.delivering.attempt",
        "dispatch.dead_letter.max_attempts",
    ]
    document = json.loads(cli("--db", str(db_path), "history", dispatch_id, "--json").stdout)
    assert document["id"] == dispatch_id
    assert [t["reason_code"] for t in document["transitions"]] == codes


# -- ack, retry, purge ---------------------------------------------------------


def test_ack_with_the_right_token_applies_and_exits_0(
    db_path: Path, raw: RawDB, populated: dict[str, str]
) -> None:
    dispatch_id = populated["awaiting"]
    token = str(raw.row(dispatch_id)["ack_token"])
    assert_one_line_error(
        cli("--db", str(db_path), "ack", dispatch_id, "wrong"), 1, "token does not match"
    )
    assert raw.row(dispatch_id)["status"] == "pending"
    done = cli("--db", str(db_path), "ack", dispatch_id, token, "--json")
    assert done.returncode == 0
    assert json.loads(done.stdout) == {
        "id": dispatch_id,
        "applied": True,
        "error": None,
        "status": "acked",
    }
    assert raw.row(dispatch_id)["status"] == "acked"
    last = raw.transitions(dispatch_id)[-1]
    assert last["reason_code"] == "dispatch.acked.consumer"
    assert str(last["actor"]).startswith("trio-dispatch ack")
    assert_one_line_error(cli("--db", str(db_path), "ack", dispatch_id, token), 1, "acked")
    assert_one_line_error(cli("--db", str(db_path), "ack", "nope", token), 1, "not found")


def test_retry_applies_from_dead_letter_only(
    db_path: Path, raw: RawDB, populated: dict[str, str]
) -> None:
    assert_one_line_error(
        cli("--db", str(db_path), "retry", populated["pending"]), 1, "dead_letter or expired"
    )
    assert raw.row(populated["pending"])["status"] == "pending"
    done = cli("--db", str(db_path), "retry", populated["dead"])
    assert done.returncode == 0 and "now pending" in done.stdout
    row = raw.row(populated["dead"])
    assert (row["status"], row["attempt"], row["last_error"]) == ("pending", 0, None)
    last = raw.transitions(populated["dead"])[-1]
    assert (last["reason_code"], last["source"]) == ("dispatch.pending.operator_retry", "operator")
    assert_one_line_error(cli("--db", str(db_path), "retry", "nope"), 1, "not found")


def test_purge_deletes_records_and_exits_1_when_absent(
    db_path: Path, raw: RawDB, populated: dict[str, str]
) -> None:
    dispatch_id = populated["delivered"]
    done = cli("--db", str(db_path), "purge", dispatch_id, "--json")
    assert done.returncode == 0 and json.loads(done.stdout)["applied"] is True
    assert raw.rows("SELECT id FROM dispatch_outbox WHERE id = ?", (dispatch_id,)) == []
    assert raw.transitions(dispatch_id)[-1]["reason_code"] == "dispatch.purged.operator"
    assert_one_line_error(cli("--db", str(db_path), "purge", dispatch_id), 1, "not found")


# -- prune and stats --------------------------------------------------------------


def test_prune_dry_run_then_prune_by_age_and_status(
    db_path: Path, raw: RawDB, populated: dict[str, str]
) -> None:
    default = cli("--db", str(db_path), "prune", "--json")
    assert json.loads(default.stdout)["deleted"] == 0  # nothing is a week old
    dry = cli("--db", str(db_path), "prune", "--older-than", "1s", "--dry-run")
    assert dry.returncode == 0 and dry.stdout.startswith("would delete 2 dispatches")
    assert raw.counts()[0] == 5
    done = cli(
        "--db", str(db_path), "prune", "--older-than", "1s", "--status", "delivered", "--json"
    )
    assert json.loads(done.stdout) == {
        "deleted": 1,
        "dry_run": False,
        "statuses": ["delivered"],
        "older_than_seconds": 1.0,
    }
    assert raw.rows("SELECT id FROM dispatch_outbox WHERE id = ?", (populated["delivered"],)) == []
    assert raw.transitions(populated["delivered"])[-1]["reason_code"] == (
        "dispatch.purged.retention"
    )
    assert_one_line_error(cli("--db", str(db_path), "prune", "--status", "pending"), 2, "'pending'")
    assert_one_line_error(cli("--db", str(db_path), "prune", "--older-than", "soon"), 2, "'soon'")
    assert raw.counts()[0] == 4


def test_stats_counts_each_status_and_recent_dead_letters(
    db_path: Path, populated: dict[str, str]
) -> None:
    document = json.loads(cli("--db", str(db_path), "stats", "--json").stdout)
    assert document["counts"] == {
        "pending": 3,
        "delivering": 0,
        "delivered": 1,
        "acked": 0,
        "dead_letter": 1,
        "expired": 0,
    }
    assert document["total"] == 5 and document["dead_letters_last_24h"] == 1
    age = document["oldest_due_pending_age_seconds"]
    assert age is not None and 0 <= age < 120  # the new row, due since T0
    text = cli("--db", str(db_path), "stats").stdout
    assert "dead_letter" in text and "dead letters (last 24 h)    1" in text


def test_check_config_accepts_the_example_file() -> None:
    example = Path(__file__).resolve().parents[1] / "config.example.yaml"
    done = cli("check-config", str(example), "--json")
    assert done.returncode == 0, done.stderr
    document = json.loads(done.stdout)
    assert document["valid"] is True
    assert document["notify_template"][1:3] == ["scripts/demo_transport.py", "--"]
    assert document["warnings"] == []


def test_piping_into_a_closed_reader_is_not_an_error(
    db_path: Path, populated: dict[str, str]
) -> None:
    done = subprocess.run(
        f"{sys.executable} -m trio_dispatch --db {db_path} show {populated['awaiting']} | head -1",
        shell=True,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert "Traceback" not in done.stderr and done.stdout.startswith("id")


def test_durations_and_relative_times() -> None:
    assert [parse_duration(t) for t in ("90", "45s", "30m", "12h", "7d", "2w", "1.5h")] == [
        90,
        45,
        1800,
        43200,
        604800,
        1209600,
        5400,
    ]
    assert [relative_time(t, 1000.0) for t in (1000.4, 1065.0, 940.0, 1000.0 + 7200)] == [
        "now",
        "in 1m05s",
        "1m00s ago",
        "in 2h00m",
    ]
    assert relative_time(None, 0) == "-"
