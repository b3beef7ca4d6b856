"""What the CLI shows of ordering keys (docs/ordering.md): the key and the
row a keyed row waits behind (``show``), ``ls --ordering-key`` and
``ls --blocked``, and "waiting" in place of a waiting row's next attempt,
on rows that real delivery passes put in those states."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import anyio
import pytest

from trio_dispatch import Delivery, deliver_due_dispatches, enqueue_dispatch, open_store
from trio_dispatch.cli.read import KEY_COLUMN_WIDTH
from trio_dispatch.lifecycle import WAITING_AT

from ..conftest import RawDB
from ..helpers import assert_one_line_error, run_cli
from .test_cli import _on_a_terminal

pytestmark = pytest.mark.sqlite_only  # the command's own behaviour; the engines share it

LONG_KEY = "tenant-" + "k" * 120


@pytest.fixture
def keyed(db_path: Path) -> dict[str, str]:
    """Rows of three keys, by real passes: ``head`` (retrying) with
    ``behind`` waiting after it; ``dead`` (dead-lettered) blocking
    ``blocked`` and ``last``; a delivered row of a long key; an unkeyed row."""

    async def build() -> dict[str, str]:
        now = time.time()
        async with open_store(db_path) as db:
            ids = {
                "head": await enqueue_dispatch(
                    db, kind="order.created", deliver_to="flaky", ordering_key="order-1", now=now
                ),
                "dead": await enqueue_dispatch(
                    db,
                    kind="order.created",
                    deliver_to="gone",
                    ordering_key="order-2",
                    max_attempts=1,
                    now=now,
                ),
                "long": await enqueue_dispatch(
                    db, kind="k", deliver_to="ok", ordering_key=LONG_KEY, now=now
                ),
                "unkeyed": await enqueue_dispatch(db, kind="k", deliver_to="later", now=now + 3600),
            }
            ids["behind"] = await enqueue_dispatch(
                db, kind="order.paid", deliver_to="ok", ordering_key="order-1", now=now
            )
            ids["blocked"] = await enqueue_dispatch(
                db, kind="order.paid", deliver_to="ok", ordering_key="order-2", now=now
            )
            ids["last"] = await enqueue_dispatch(
                db, kind="order.shipped", deliver_to="ok", ordering_key="order-2", now=now
            )

            async def send(delivery: Delivery) -> bool:
                return delivery.deliver_to == "ok"

            await deliver_due_dispatches(db, transport=send, now=now + 1)
            await deliver_due_dispatches(db, transport=send, now=now + 2)
            return ids

    return anyio.run(build)


def test_the_fixture_holds_a_waiting_row_and_a_blocked_key(
    db_path: Path, keyed: dict[str, str]
) -> None:
    raw = RawDB(db_path)
    status = {name: raw.row(i)["status"] for name, i in keyed.items()}
    assert status == {
        "head": "pending",
        "behind": "pending",
        "dead": "dead_letter",
        "blocked": "pending",
        "last": "pending",
        "long": "delivered",
        "unkeyed": "pending",
    }
    assert raw.row(keyed["behind"])["next_attempt_at"] == WAITING_AT
    assert raw.row(keyed["head"])["attempt"] == 1  # it failed once and keeps its place


def test_show_names_the_key_and_the_row_a_keyed_row_waits_behind(
    db_path: Path, keyed: dict[str, str]
) -> None:
    done = run_cli("--db", str(db_path), "show", keyed["behind"])
    assert done.returncode == 0, done.stderr
    fields = dict(
        (line[:16].strip(), line[16:]) for line in done.stdout.split("payload:")[0].splitlines()
    )
    assert fields["ordering_key"] == "order-1"
    assert fields["next_attempt_at"] == "waiting"
    assert fields["waiting behind"] == f"{keyed['head']} (pending)"
    assert "1e+15" not in done.stdout and "31690" not in done.stdout
    blocked = run_cli("--db", str(db_path), "show", keyed["last"]).stdout
    assert f"waiting behind  {keyed['dead']} (dead_letter)" in blocked
    head = run_cli("--db", str(db_path), "show", keyed["head"]).stdout
    assert "waiting behind" not in head and "ordering_key    order-1" in head
    unkeyed = run_cli("--db", str(db_path), "show", keyed["unkeyed"]).stdout
    assert "ordering_key    -" in unkeyed and "waiting behind" not in unkeyed


def test_show_json_keeps_the_mark_and_says_waiting_and_behind_what(
    db_path: Path, keyed: dict[str, str]
) -> None:
    shown = json.loads(run_cli("--db", str(db_path), "show", keyed["behind"], "--json").stdout)
    row = shown["dispatch"]
    assert row["ordering_key"] == "order-1"
    assert row["next_attempt_at"] == WAITING_AT and row["waiting"] is True
    assert row["waiting_behind"] == {"id": keyed["head"], "status": "pending"}
    head = json.loads(run_cli("--db", str(db_path), "show", keyed["head"], "--json").stdout)
    assert head["dispatch"]["waiting"] is False and head["dispatch"]["waiting_behind"] is None


def test_the_row_behind_a_blocked_head_is_waiting_in_ls_show_and_stats(
    db_path: Path, keyed: dict[str, str]
) -> None:
    # Promoted when its head died, the claim rule holds it; ten minutes ago.
    raw = RawDB(db_path)
    assert raw.row(keyed["blocked"])["next_attempt_at"] < WAITING_AT
    raw.execute(
        "UPDATE dispatch_outbox SET next_attempt_at = ? WHERE id = ?",
        (time.time() - 600, keyed["blocked"]),
    )
    document = json.loads(
        run_cli("--db", str(db_path), "ls", "--ordering-key", "order-2", "--json").stdout
    )
    waiting = {row["id"]: row["waiting"] for row in document["dispatches"]}
    assert waiting == {keyed["dead"]: False, keyed["blocked"]: True, keyed["last"]: True}
    header, *rows = run_cli("--db", str(db_path), "ls", "--ordering-key", "order-2").stdout.split(
        "\n"
    )
    column = header.index("NEXT")
    nexts = {row.split()[0]: row[column:].split()[0] for row in rows if row}
    assert nexts[keyed["blocked"]] == nexts[keyed["last"]] == "waiting"
    shown = json.loads(run_cli("--db", str(db_path), "show", keyed["blocked"], "--json").stdout)
    assert shown["dispatch"]["waiting"] is True
    assert shown["dispatch"]["waiting_behind"] == {"id": keyed["dead"], "status": "dead_letter"}
    text = run_cli("--db", str(db_path), "show", keyed["blocked"]).stdout
    assert re.search(r"^next_attempt_at +waiting$", text, re.MULTILINE), text
    stats = json.loads(run_cli("--db", str(db_path), "stats", "--json").stdout)
    # Nothing else is due for a minute (the retrying head's backoff).
    assert stats["oldest_due_pending_age_seconds"] is None, stats


def test_under_skip_a_dead_head_is_nothing_to_wait_behind_and_no_key_is_blocked(
    tmp_path: Path, db_path: Path, keyed: dict[str, str]
) -> None:
    config = tmp_path / "skip.yaml"
    config.write_text(f"store: {db_path}\ndispatch:\n  ordering:\n    on_dead_letter: skip\n")
    shown = json.loads(run_cli("--config", str(config), "show", keyed["last"], "--json").stdout)
    assert shown["dispatch"]["waiting_behind"] == {"id": keyed["blocked"], "status": "pending"}
    listed = run_cli("--config", str(config), "ls", "--blocked")
    assert listed.returncode == 0 and listed.stdout.startswith("no blocked keys")
    document = json.loads(run_cli("--config", str(config), "ls", "--blocked", "--json").stdout)
    assert document == {"dispatches": [], "on_dead_letter": "skip"}
    # --db and a configuration: the configuration's policy still holds
    both = run_cli("--db", str(db_path), "--config", str(config), "ls", "--blocked", "--json")
    assert json.loads(both.stdout)["dispatches"] == []


def test_ls_blocked_lists_the_heads_of_blocked_keys_only(
    db_path: Path, keyed: dict[str, str]
) -> None:
    done = run_cli("--db", str(db_path), "ls", "--blocked")
    assert done.returncode == 0, done.stderr
    header, *rows = done.stdout.splitlines()
    assert "KEY" in header.split()
    assert [row.split()[0] for row in rows] == [keyed["dead"]]
    assert "order-2" in rows[0] and "dead_letter" in rows[0]
    document = json.loads(run_cli("--db", str(db_path), "ls", "--blocked", "--json").stdout)
    assert [row["id"] for row in document["dispatches"]] == [keyed["dead"]]
    assert document["on_dead_letter"] == "block"
    one = run_cli("--db", str(db_path), "ls", "--blocked", "--ordering-key", "order-1")
    assert one.stdout.strip() == "no blocked keys with ordering key order-1"
    mixed = run_cli("--db", str(db_path), "ls", "--blocked", "--status", "dead_letter")
    assert_one_line_error(mixed, 2, "--blocked", "--status")


def test_ls_filters_by_ordering_key_and_shows_waiting_not_a_date(
    db_path: Path, keyed: dict[str, str]
) -> None:
    done = run_cli("--db", str(db_path), "ls", "--ordering-key", "order-1")
    assert done.returncode == 0, done.stderr
    header, *rows = done.stdout.splitlines()
    assert header.split() == [
        "ID", "KIND", "DELIVER_TO", "STATUS", "ATTEMPT", "NEXT", "KEY", "LAST_ERROR",
    ]  # fmt: skip
    assert [row.split()[0] for row in rows] == [keyed["behind"], keyed["head"]]
    next_column = header.index("NEXT")
    assert rows[0][next_column:].split()[0] == "waiting"
    assert rows[1][next_column:].split()[0] != "waiting"
    document = json.loads(
        run_cli("--db", str(db_path), "ls", "--ordering-key", "order-1", "--json").stdout
    )
    waiting = {row["id"]: row["waiting"] for row in document["dispatches"]}
    assert waiting == {keyed["behind"]: True, keyed["head"]: False}
    assert {row["ordering_key"] for row in document["dispatches"]} == {"order-1"}
    none = run_cli("--db", str(db_path), "ls", "--ordering-key", "order-9")
    assert none.stdout.strip() == "no dispatches with ordering key order-9"


def test_ls_shows_the_key_column_only_when_a_listed_row_is_keyed(
    db_path: Path, keyed: dict[str, str]
) -> None:
    unkeyed = run_cli("--db", str(db_path), "ls", "--kind", "k", "--status", "pending")
    assert unkeyed.stdout.splitlines()[0].split() == [
        "ID", "KIND", "DELIVER_TO", "STATUS", "ATTEMPT", "NEXT", "LAST_ERROR",
    ]  # fmt: skip
    every = run_cli("--db", str(db_path), "ls").stdout
    assert every.splitlines()[0].split()[6] == "KEY"
    assert LONG_KEY in every  # not a terminal: whole


@pytest.mark.parametrize("key", ["", "a\x01b", "k" * 256])
def test_a_bad_ordering_key_is_one_line_naming_it(db_path: Path, key: str) -> None:
    anyio.run(_empty_store, db_path)
    done = run_cli("--db", str(db_path), "ls", "--ordering-key", key)
    assert_one_line_error(done, 2, "--ordering-key", "ordering_key")


async def _empty_store(path: Path) -> None:
    async with open_store(path):
        pass


@pytest.mark.slow
def test_on_a_terminal_a_long_key_is_cut_and_the_table_fits(
    db_path: Path, keyed: dict[str, str]
) -> None:
    shown = _on_a_terminal("--db", str(db_path), "ls", columns=160)
    assert LONG_KEY not in shown
    assert LONG_KEY[: KEY_COLUMN_WIDTH - 1] + "…" in shown
    assert max(len(line) for line in shown.splitlines()) <= 160
    wide = _on_a_terminal("--db", str(db_path), "ls", "--wide", columns=160)
    assert LONG_KEY in wide
