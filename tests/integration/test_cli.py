"""The operator CLI against a real SQLite file: exit code, output, and the
database state after. Commands run in this process through ``cli.main``
(argparse and all); the console script, ``python -m`` and a closed pipe are
proven as real processes."""

from __future__ import annotations

import json
import os
import pty
import re
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import anyio
import pytest

from trio_dispatch import (
    Delivery,
    TransportResult,
    deliver_due_dispatches,
    enqueue_dispatch,
    open_store,
)
from trio_dispatch.cli import format_time

from ..conftest import RawDB
from ..helpers import assert_one_line_error, cli_process, run_cli, start_worker

T0 = time.time()
pytestmark = pytest.mark.sqlite_only  # the command's own behaviour; the engines share it


cli = run_cli  # in this process, through cli.main: the command's own behaviour


@pytest.fixture
def populated(db_path: Path) -> dict[str, str]:
    """Dispatches in several statuses: name -> id."""

    async def build() -> dict[str, str]:
        T0 = time.time()  # now, not at import: a loaded run starts a test minutes late
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


@pytest.mark.slow
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
                "throttles",
                "next_attempt_at",
                "created_at",
                "updated_at",
                "expires_at",
                "last_error",
                "dedup_key",
                "ack_required",
                "awaiting_ack",
                "ordering_key",
                "priority",
                "coalesce_key",
                "waiting",
            ]
        )
    waiting = {row["id"]: row["awaiting_ack"] for row in document["dispatches"]}
    assert waiting == {
        populated[k]: k == "awaiting"
        for k in ("pending", "awaiting", "dead", "failing", "delivered")
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
        assert re.match(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ \(([0-9dhms]+ ago|now)\) ", line), line
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
    again = cli("--db", str(db_path), "ack", dispatch_id, token)
    line = assert_one_line_error(again, 1, "already acked")
    assert "transition" not in line and "not allowed" not in line
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
        "superseded": 0,
        "cancelled": 0,
    }
    assert document["total"] == 5 and document["dead_letters_last_24h"] == 1
    age = document["oldest_due_pending_age_seconds"]
    assert age is not None and 0 <= age < 120  # the new row, due since T0
    text = cli("--db", str(db_path), "stats").stdout
    assert "dead_letter" in text and "dead letters (last 24 h)    1" in text


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


# -- issue 19: usability -------------------------------------------------------------


def test_global_options_are_accepted_after_the_command_too(
    tmp_path: Path, db_path: Path, populated: dict[str, str]
) -> None:
    config = tmp_path / "c.yaml"
    config.write_text(f"store: {db_path}\n")
    for args in (
        ["stats", "--json", "--db", str(db_path)],
        ["stats", "--config", str(config), "--json"],
        ["stats", "--db", str(db_path), "--busy-timeout", "2", "--json"],
        ["--busy-timeout", "2", "stats", "--db", str(db_path), "--json"],
        ["--db", str(tmp_path / "missing.db"), "stats", "--db", str(db_path), "--json"],
    ):
        done = cli(*args)
        assert done.returncode == 0, (args, done.stderr)
        assert json.loads(done.stdout)["total"] == 5
    # given before only, a value is not reset by the command's own options
    assert cli("--db", str(db_path), "show", populated["dead"]).returncode == 0
    assert_one_line_error(cli("ls", "--busy-timeout", "-1", "--db", str(db_path)), 2, "-1")


def test_times_are_utc_iso_8601_with_their_age_everywhere(
    db_path: Path, populated: dict[str, str]
) -> None:
    iso = r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ \(([0-9dhms]+ ago|in [0-9dhms]+|now)\)"
    shown = cli("--db", str(db_path), "show", populated["failing"]).stdout
    for key in ("created_at", "updated_at", "next_attempt_at"):
        line = next(line for line in shown.splitlines() if line.startswith(key))
        assert re.fullmatch(rf"{key} +{iso}", line), line
    assert re.search(r"^expires_at +-$", shown, re.MULTILINE)
    stats = cli("--db", str(db_path), "stats").stdout
    assert re.search(rf"^oldest due pending +{iso}$", stats, re.MULTILINE), stats
    # the JSON keeps Unix seconds
    document = json.loads(cli("--db", str(db_path), "show", populated["failing"], "--json").stdout)
    assert isinstance(document["dispatch"]["created_at"], float)
    assert format_time(0.0, 90.0) == "1970-01-01T00:00:00Z (1m30s ago)"
    assert format_time(None, 0.0) == "-"
    assert format_time(1e300, 0.0) == "1e+300"


def test_show_marks_a_row_waiting_for_its_ack(db_path: Path, populated: dict[str, str]) -> None:
    shown = cli("--db", str(db_path), "show", populated["awaiting"]).stdout
    assert re.search(r"^status +pending \(awaiting ack\)$", shown, re.MULTILINE), shown
    failing = cli("--db", str(db_path), "show", populated["failing"]).stdout
    assert re.search(r"^status +pending$", failing, re.MULTILINE), failing
    as_json = cli("--db", str(db_path), "show", populated["awaiting"], "--json").stdout
    assert json.loads(as_json)["dispatch"]["awaiting_ack"] is True
    assert json.loads(as_json)["dispatch"]["status"] == "pending"


LONG_ERROR = "refused: " + "x" * 300 + " END"


@pytest.fixture
def long_error(db_path: Path) -> str:
    """A dispatch whose last_error is wider than any terminal."""

    async def build() -> str:
        async with open_store(db_path) as db:
            dispatch_id = await enqueue_dispatch(db, kind="k", deliver_to="seat", now=T0 - 10)

            async def send(delivery: Delivery) -> TransportResult:
                return TransportResult.failure(LONG_ERROR)

            await deliver_due_dispatches(db, transport=send, now=T0 - 5)
            return dispatch_id

    return anyio.run(build)


def _on_a_terminal(*args: str, columns: int = 80) -> str:
    """``trio-dispatch ARGS`` as a real process whose stdout is a terminal
    ``columns`` wide: what it printed there."""
    leader, follower = pty.openpty()
    env = {k: v for k, v in os.environ.items() if k != "TRIO_DISPATCH_CONFIG"}
    chunks = []
    with subprocess.Popen(
        [sys.executable, "-m", "trio_dispatch", *args],
        stdout=follower,
        stderr=subprocess.PIPE,
        env={**env, "COLUMNS": str(columns)},
    ) as process:
        os.close(follower)
        try:
            while True:
                ready, _, _ = select.select([leader], [], [], 60)
                if not ready:
                    break
                try:
                    chunk = os.read(leader, 65536)
                except OSError:  # the terminal's other end closed: the command ended
                    break
                if not chunk:
                    break
                chunks.append(chunk)
        finally:
            os.close(leader)
            assert process.wait(timeout=60) == 0
    return b"".join(chunks).decode().replace("\r\n", "\n")


@pytest.mark.slow
def test_tables_are_cut_only_on_a_terminal_and_never_with_wide(
    db_path: Path, long_error: str
) -> None:
    piped = cli("--db", str(db_path), "ls")
    assert LONG_ERROR in piped.stdout  # not a terminal: whole values
    history = cli("--db", str(db_path), "history", long_error).stdout
    assert LONG_ERROR[:200] in history  # the summary quotes 200 characters, whole
    on_terminal = _on_a_terminal("--db", str(db_path), "ls", columns=150)
    row = next(line for line in on_terminal.splitlines() if line.startswith(long_error))
    assert len(row) == 150 and row.endswith("…") and "END" not in row, row
    wide = _on_a_terminal("--db", str(db_path), "ls", "--wide")
    assert LONG_ERROR in wide
    history_wide = _on_a_terminal("--db", str(db_path), "history", long_error, "--wide")
    assert LONG_ERROR[:200] in history_wide


def test_a_unique_id_prefix_is_accepted_and_an_ambiguous_one_is_refused(
    db_path: Path, raw: RawDB, populated: dict[str, str]
) -> None:
    ids = sorted(populated.values())
    shared = ids[0][: next(n for n in range(32) if len({i[: n + 1] for i in ids}) > 1)]
    assert len(shared) >= 8, ids  # UUIDv7: made in the same second
    dead = populated["dead"]
    # the shortest prefix only the dead-lettered row has
    unique = next(
        dead[:n]
        for n in range(len(shared) + 1, 33)
        if sum(i.startswith(dead[:n]) for i in ids) == 1
    )
    shown = json.loads(cli("--db", str(db_path), "show", unique, "--json").stdout)
    assert shown["dispatch"]["id"] == dead
    assert cli("--db", str(db_path), "show", unique.upper()).returncode == 0
    history = json.loads(cli("--db", str(db_path), "history", unique, "--json").stdout)
    assert history["id"] == dead
    retried = cli("--db", str(db_path), "retry", unique, "--json")
    assert json.loads(retried.stdout)["id"] == dead and raw.row(dead)["status"] == "pending"
    awaiting = populated["awaiting"]
    token = str(raw.row(awaiting)["ack_token"])
    prefix = next(
        awaiting[:n]
        for n in range(len(shared) + 1, 33)
        if sum(i.startswith(awaiting[:n]) for i in ids) == 1
    )
    assert cli("--db", str(db_path), "ack", prefix, token).returncode == 0
    assert raw.row(awaiting)["status"] == "acked"
    purged = cli("--db", str(db_path), "purge", unique)
    assert purged.returncode == 0 and dead in purged.stdout
    # history still finds a purged dispatch by its prefix
    after = json.loads(cli("--db", str(db_path), "history", unique, "--json").stdout)
    assert after["id"] == dead and after["transitions"][-1]["status"] == "purged"

    ambiguous = shared[:8]
    matching = sum(i.startswith(ambiguous) for i in ids) - 1  # the purged one is gone
    for command in (["show"], ["retry"], ["purge"], ["ack"]):
        extra = ["token"] if command == ["ack"] else []
        done = cli("--db", str(db_path), *command, ambiguous, *extra)
        assert_one_line_error(done, 2, repr(ambiguous), f"matches {matching} dispatches")
    assert_one_line_error(
        cli("--db", str(db_path), "show", ids[0][:7]), 2, "too short", "at least 8"
    )
    assert_one_line_error(cli("--db", str(db_path), "show", "ffffffff"), 1, "not found")
    assert raw.counts()[0] == 4  # nothing else changed


@pytest.mark.slow
def test_the_store_and_the_token_can_stay_out_of_argv(
    db_path: Path, raw: RawDB, populated: dict[str, str]
) -> None:
    env = {"OUTBOX_STORE": str(db_path)}
    done = cli_process("--db-env", "OUTBOX_STORE", "stats", "--json", env=env)
    assert done.returncode == 0 and json.loads(done.stdout)["total"] == 5
    after = cli_process("ls", "--db-env", "OUTBOX_STORE", "--json", env=env)
    assert after.returncode == 0 and len(json.loads(after.stdout)["dispatches"]) == 5
    assert_one_line_error(cli("--db-env", "NO_SUCH_VARIABLE_HERE", "ls"), 2, "not set")
    assert_one_line_error(cli("--db-env", "EMPTY", "ls", env={"EMPTY": ""}), 2, "empty")
    assert_one_line_error(
        cli("--db-env", "OUTBOX_STORE", "--db", str(db_path), "ls", env=env), 2, "not both"
    )
    dispatch_id = populated["awaiting"]
    token = str(raw.row(dispatch_id)["ack_token"])
    base = {k: v for k, v in os.environ.items() if k != "TRIO_DISPATCH_CONFIG"}
    argv = [sys.executable, "-m", "trio_dispatch", "--db-env", "OUTBOX_STORE", "ack"]

    def ack(*args: str, stdin: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [*argv, *args],
            input=stdin,
            capture_output=True,
            text=True,
            timeout=60,
            env={**base, **env},
        )

    assert_one_line_error(ack(dispatch_id, "--token-stdin", stdin=""), 2, "no token")
    assert_one_line_error(ack(dispatch_id, token, "--token-stdin", stdin=token), 2, "not both")
    assert_one_line_error(ack(dispatch_id, stdin=token), 2, "--token-stdin")
    assert_one_line_error(ack(dispatch_id, "--token-stdin", stdin="wrong\n"), 1, "does not match")
    assert raw.row(dispatch_id)["status"] == "pending"
    done = ack(dispatch_id, "--token-stdin", stdin=token + "\n")
    assert done.returncode == 0 and done.stderr == "", done.stderr
    assert raw.row(dispatch_id)["status"] == "acked"


def test_a_command_transport_without_a_template_is_warned_about(tmp_path: Path) -> None:
    config = tmp_path / "c.yaml"
    config.write_text("store: o.db\n")
    done = cli("check-config", str(config))
    assert done.returncode == 0
    warning = done.stderr.strip()
    assert warning.startswith("trio-dispatch: warning: dispatch.notify_template is not set")
    assert len(done.stderr.splitlines()) == 1
    document = json.loads(cli("check-config", str(config), "--json").stdout)
    assert len(document["warnings"]) == 1 and "notify_template" in document["warnings"][0]
    # the worker logs it at start
    with start_worker(config) as worker:
        try:
            assert worker.stderr is not None
            deadline = time.monotonic() + 60
            lines: list[str] = []
            while time.monotonic() < deadline:
                line = worker.stderr.readline()
                if not line:
                    break
                lines.append(line)
                if "worker started" in line:
                    break
            warned = [line for line in lines if "notify_template is not set" in line]
            assert warned and "WARNING" in warned[0], lines
        finally:
            worker.send_signal(signal.SIGTERM)
            worker.wait(timeout=30)
