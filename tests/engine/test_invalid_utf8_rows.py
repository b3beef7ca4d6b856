"""A row whose stored text is not valid UTF-8 (SQLite stores whatever bytes
it is given: another program, a damaged file) neither jams the queue nor
breaks a read: the worker dead-letters it, naming its id and the column, and
delivers the rest; ls, show, history and the dashboard show it with U+FFFD.

SQLite only: PostgreSQL refuses text that is not valid UTF-8 when it is
written, so such a row cannot exist there.
"""

from __future__ import annotations

import functools
import json
import logging
import sqlite3
import time
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest

from trio_dispatch import Delivery, enqueue_dispatch, open_store
from trio_dispatch.web import WebApp, parse_listen, serve_app
from trio_dispatch.worker import DispatchWorker

from ..conftest import RawDB
from ..helpers import run_cli, statuses, wait_for
from ..integration.test_web import running

pytestmark = pytest.mark.sqlite_only


def spoil(raw: RawDB, dispatch_id: str, column: str) -> None:
    """Put bytes that are not UTF-8 into ``column`` of the row, as another
    program writing the file could."""
    raw.execute(
        f"UPDATE dispatch_outbox SET {column} = CAST(x'6bff' AS TEXT) WHERE id = ?",
        (dispatch_id,),
    )


def stored(raw: RawDB, dispatch_id: str) -> dict[str, Any]:
    """The committed row, its bad bytes shown as U+FFFD."""
    conn = sqlite3.connect(raw.path)
    try:
        conn.text_factory = lambda data: data.decode("utf-8", "replace")
        conn.row_factory = sqlite3.Row
        found = conn.execute("SELECT * FROM dispatch_outbox WHERE id = ?", (dispatch_id,))
        return dict(found.fetchone())
    finally:
        conn.close()


@pytest.mark.anyio
@pytest.mark.parametrize("column", ["kind", "payload", "deliver_to"])
async def test_a_row_not_valid_utf8_is_dead_lettered_naming_its_column_and_the_rest_deliver(
    db_target: str, raw: RawDB, column: str, caplog: pytest.LogCaptureFixture
) -> None:
    async with open_store(db_target) as db:
        bad = await enqueue_dispatch(db, kind="k", deliver_to="seat")
        good = [await enqueue_dispatch(db, kind="k", deliver_to=f"s{i}") for i in range(3)]
    spoil(raw, bad, column)
    sent: list[str] = []

    async def send(delivery: Delivery) -> None:
        sent.append(delivery.dispatch_id)

    caplog.set_level(logging.WARNING, logger="trio_dispatch")
    async with open_store(db_target) as db, anyio.create_task_group() as tg:
        worker = DispatchWorker(db, transport=send, tick_seconds=3600, batch_size=1)
        await tg.start(worker.run)
        await wait_for(lambda: statuses(raw) == {"dead_letter": 1, "delivered": 3})
        # The writer is not jammed: a later enqueue is delivered as well.
        later = await enqueue_dispatch(db, kind="k", deliver_to="later")
        await wait_for(lambda: raw.row(later)["status"] == "delivered")
        tg.cancel_scope.cancel()
    assert sorted(sent) == sorted([*good, later])  # never sent
    assert worker.statistics().scan_errors == 0
    row = stored(raw, bad)
    assert row["status"] == "dead_letter"
    assert row["last_error"] == (
        f"stored column '{column}' is not valid UTF-8; no attempt can send this dispatch"
    )
    last = raw.transitions(bad)[-1]
    assert (last["previous_status"], last["status"], last["reason_code"]) == (
        "delivering",
        "dead_letter",
        "dispatch.dead_letter.max_attempts",
    )
    assert "no attempt can send" in last["reason_summary"]
    reports = [r.getMessage() for r in caplog.records if bad in r.getMessage()]
    assert any(f"'{column}'" in line and "not valid UTF-8" in line for line in reports), reports


@pytest.mark.anyio
async def test_reads_and_the_dashboard_show_a_row_not_valid_utf8(
    db_target: str, raw: RawDB
) -> None:
    async with open_store(db_target) as db:
        bad = await enqueue_dispatch(db, kind="k", deliver_to="seat")
        await enqueue_dispatch(db, kind="fine", deliver_to="seat")
    spoil(raw, bad, "kind")
    spoil(raw, bad, "payload")
    listing = await anyio.to_thread.run_sync(run_cli, "--db", db_target, "ls", "--json")
    assert listing.returncode == 0, listing.stderr
    kinds = {row["id"]: row["kind"] for row in json.loads(listing.stdout)["dispatches"]}
    assert kinds[bad] == "k\ufffd"
    for command in (["show", bad], ["history", bad], ["stats"], ["ls"]):
        done = await anyio.to_thread.run_sync(
            functools.partial(run_cli, "--db", db_target, *command)
        )
        assert done.returncode == 0 and "Traceback" not in done.stderr, (command, done.stderr)
    async with open_store(db_target) as db, anyio.create_task_group() as tg:
        url = await tg.start(serve_app, WebApp(db), parse_listen("test", "127.0.0.1:0"))
        async with httpx.AsyncClient(base_url=url, timeout=10) as client:
            home = await client.get("/")
            page = await client.get(f"/dispatches/{bad}")
            health = await client.get("/healthz")
        tg.cancel_scope.cancel()
    assert home.status_code == 200 and bad in home.text and "k\ufffd" in home.text
    assert page.status_code == 200 and "k\ufffd" in page.text
    assert health.status_code == 200


@pytest.mark.slow
def test_the_worker_with_http_listen_starts_and_moves_past_a_row_not_valid_utf8(
    tmp_path: Path, anyio_backend: str
) -> None:
    db = tmp_path / "o.db"

    async def fill() -> tuple[str, str]:
        async with open_store(str(db)) as store:
            bad = await enqueue_dispatch(store, kind="k", deliver_to="seat")
            return bad, await enqueue_dispatch(store, kind="k", deliver_to="seat")

    bad, good = anyio.run(fill, backend=anyio_backend)
    raw = RawDB(db)
    spoil(raw, bad, "kind")
    config = tmp_path / "c.yaml"
    config.write_text(json.dumps({"store": "o.db", "dispatch": {"notify_template": ["true"]}}))
    args = ["--config", str(config), "worker", "--http", "127.0.0.1:0"]
    pattern = r"http: metrics, health and dashboard at (http://\S+)/"
    with running(args, tmp_path, pattern) as (url, process):
        deadline = time.monotonic() + 20
        while statuses(raw) != {"dead_letter": 1, "delivered": 1}:
            assert process.poll() is None, "the worker exited"
            assert time.monotonic() < deadline, statuses(raw)
            time.sleep(0.05)
        assert httpx.get(url + "/", timeout=10).status_code == 200
        assert httpx.get(url + "/healthz", timeout=10).status_code == 200
        assert process.poll() is None
    assert raw.row(good)["status"] == "delivered"
    assert "'kind' is not valid UTF-8" in str(stored(raw, bad)["last_error"])


@pytest.mark.anyio
async def test_a_row_whose_id_is_not_valid_utf8_is_dead_lettered_once_not_claimed_again(
    db_target: str, raw: RawDB
) -> None:
    # Every write about the row is fenced on its id: bound as the bytes
    # read, it finds the row (as text shown with U+FFFD it would not, and
    # the row would come back through lease recovery forever).
    async with open_store(db_target) as db:
        bad = await enqueue_dispatch(db, kind="k", deliver_to="seat")
        good = await enqueue_dispatch(db, kind="k", deliver_to="s")
    raw.execute("UPDATE dispatch_outbox SET id = CAST(x'6bff' AS TEXT) WHERE id = ?", (bad,))
    sent: list[str] = []

    async def send(delivery: Delivery) -> None:
        sent.append(delivery.dispatch_id)

    async with open_store(db_target) as db, anyio.create_task_group() as tg:
        worker = DispatchWorker(db, transport=send, tick_seconds=3600, batch_size=1)
        await tg.start(worker.run)
        await wait_for(lambda: statuses(raw) == {"dead_letter": 1, "delivered": 1})
        tg.cancel_scope.cancel()
    assert sent == [good]
    conn = sqlite3.connect(raw.path)
    try:
        conn.text_factory = bytes
        row = conn.execute(
            "SELECT status, attempt, last_error FROM dispatch_outbox "
            "WHERE id = CAST(x'6bff' AS TEXT)"
        ).fetchone()
        history = conn.execute(
            "SELECT previous_status, status FROM status_transitions "
            "WHERE entity_id = CAST(x'6bff' AS TEXT) ORDER BY id"
        ).fetchall()
    finally:
        conn.close()
    assert row[0] == b"dead_letter" and row[1] == 1
    assert b"'id' is not valid UTF-8" in row[2]
    assert history == [(b"pending", b"delivering"), (b"delivering", b"dead_letter")]
