"""The SQLite store: schema, pragmas, migrations, transactions, group commit."""

from __future__ import annotations

import multiprocessing
import sqlite3
import threading
from functools import partial
from pathlib import Path
from typing import Any

import anyio
import pytest

from trio_dispatch import enqueue_dispatch, get_dispatch, open_store
from trio_dispatch.store import SchemaError, SQLiteStore
from trio_dispatch.store.schema import SCHEMA_VERSION, statements

from ..conftest import RawDB
from ..helpers import HeldWriter, wait_for

pytestmark = [pytest.mark.anyio, pytest.mark.sqlite_only]

# (name, type, notnull, default) of every column of schema version 1, in order.
ADR_COLUMNS = [
    ("id", "TEXT", 0, None),
    ("kind", "TEXT", 1, None),
    ("deliver_to", "TEXT", 1, None),
    ("payload", "JSON", 1, None),
    ("dedup_key", "TEXT", 0, None),
    ("status", "TEXT", 1, "'pending'"),
    ("attempt", "INTEGER", 1, "0"),
    ("max_attempts", "INTEGER", 1, "8"),
    ("next_attempt_at", "FLOAT", 1, None),
    ("ack_required", "INTEGER", 1, "0"),
    ("ack_token", "TEXT", 0, None),
    ("session_id", "TEXT", 0, None),
    ("schedule_run_id", "TEXT", 0, None),
    ("last_error", "TEXT", 0, None),
    ("created_at", "FLOAT", 1, None),
    ("expires_at", "FLOAT", 0, None),
    ("updated_at", "FLOAT", 0, None),
    # Schema v5: ordering keys (docs/ordering.md), appended, nullable.
    ("ordering_key", "TEXT", 0, None),
    # Schema v8: a keyed row's place in its key by commit order.
    ("key_seq", "BIGINT", 1, "0"),
    # Schema v10: a row's throttled attempts (docs/destinations.md).
    ("throttles", "INTEGER", 1, "0"),
    # A running attempt's cancel, when asked and by whom (docs/controls.md).
    ("cancel_requested_at", "FLOAT", 0, None),
    ("cancel_request", "TEXT", 0, None),
    # The priority migration: a row's priority and the head start it gave
    # (docs/controls.md).
    ("priority", "INTEGER", 1, "0"),
    ("head_start", "FLOAT", 1, "0"),
    # The coalescing migration (docs/controls.md): the key, when its chain of
    # superseded rows began, a debounced row's due time.
    ("coalesce_key", "TEXT", 0, None),
    ("coalesce_since", "FLOAT", 0, None),
    ("not_before", "FLOAT", 0, None),
]


async def test_open_store_creates_the_adr_schema_exactly(store: SQLiteStore, raw: RawDB) -> None:
    columns = raw.rows("PRAGMA table_info(dispatch_outbox)")
    assert [(c["name"], c["type"], c["notnull"], c["dflt_value"]) for c in columns] == ADR_COLUMNS
    assert [c["name"] for c in columns if c["pk"]] == ["id"]
    fks = raw.rows("PRAGMA foreign_key_list(dispatch_outbox)")
    assert {(f["from"], f["table"], f["to"]) for f in fks} == {
        ("session_id", "sessions", "id"),
        ("schedule_run_id", "schedule_runs", "id"),
    }
    indexes = {
        r["name"]: r["sql"]
        for r in raw.rows("SELECT name, sql FROM sqlite_master WHERE type = 'index'")
        if r["sql"]
    }
    dedup = indexes["ux_dispatch_outbox_dedup_key"]
    assert "UNIQUE" in dedup and "WHERE dedup_key IS NOT NULL" in dedup
    due = indexes["ix_dispatch_outbox_status_next_attempt"]
    # Version 1's (status, next_attempt_at), with created_at appended (schema
    # v2), and the claim rank in next_attempt_at's place (docs/controls.md):
    # with every priority 0 the rank is next_attempt_at.
    assert "(status, (next_attempt_at - head_start), created_at, next_attempt_at)" in due
    assert "WHERE status IN ('pending', 'delivering')" in due
    held = indexes["ix_dispatch_outbox_held_back"]
    assert "(status, (next_attempt_at - head_start), created_at, next_attempt_at)" in held
    assert "WHERE status IN ('pending', 'delivering') AND head_start < 0" in held
    assert "ix_dispatch_outbox_ordering" not in indexes  # by id: replaced in schema v8
    ordering = indexes["ix_dispatch_outbox_ordering_seq"]
    assert "(ordering_key, key_seq, id)" in ordering and "ordering_key IS NOT NULL" in ordering
    assert "status IN ('pending', 'delivering', 'dead_letter', 'expired')" in ordering
    coalesce = indexes["ux_dispatch_outbox_coalesce_waiting"]
    assert "UNIQUE" in coalesce and "(coalesce_key)" in coalesce
    assert (
        "WHERE coalesce_key IS NOT NULL AND status = 'pending' AND attempt = 0 "
        "AND updated_at = created_at" in coalesce
    )
    live = indexes["ix_dispatch_outbox_ordering_live"]
    assert "(ordering_key, next_attempt_at)" in live
    assert "WHERE ordering_key IS NOT NULL AND status IN ('pending', 'delivering')" in live
    heads = indexes["ix_dispatch_outbox_ordering_heads"]
    assert "(id)" in heads
    assert "WHERE ordering_key IS NOT NULL AND status IN ('dead_letter', 'expired')" in heads
    transitions = [c["name"] for c in raw.rows("PRAGMA table_info(status_transitions)")]
    assert transitions == [
        "id",
        "entity_type",
        "entity_id",
        "previous_status",
        "status",
        "reason_code",
        "reason_summary",
        "source",
        "actor",
        "evidence_refs",
        "metadata",
        "created_at",
    ]
    assert raw.rows("PRAGMA foreign_key_list(status_transitions)") == []
    tables = {r["name"] for r in raw.rows("SELECT name FROM sqlite_master WHERE type='table'")}
    assert {"sessions", "schedule_runs", "trio_dispatch_schema"} <= tables
    assert raw.scalar("SELECT MAX(version) FROM trio_dispatch_schema") == SCHEMA_VERSION


async def test_status_check_constraint_rejects_unknown_status(store: SQLiteStore) -> None:
    with pytest.raises(sqlite3.IntegrityError, match="CHECK"):
        async with store.transaction() as tx:
            await tx.execute(
                "INSERT INTO dispatch_outbox (id, kind, deliver_to, payload, status, "
                "next_attempt_at, created_at) VALUES ('x', 'k', 'r', '{}', 'lost', 0, 0)"
            )


async def test_store_uses_wal_and_enforces_foreign_keys(store: SQLiteStore, raw: RawDB) -> None:
    assert raw.scalar("PRAGMA journal_mode") == "wal"
    pragmas = await store.write(
        lambda c: (c.query_one("PRAGMA busy_timeout"), c.query_one("PRAGMA foreign_keys"))
    )
    assert pragmas == ({"timeout": 10_000}, {"foreign_keys": 1})
    with pytest.raises(sqlite3.IntegrityError, match="FOREIGN KEY"):
        async with store.transaction() as tx:
            await tx.execute(
                "INSERT INTO dispatch_outbox (id, kind, deliver_to, payload, session_id, "
                "next_attempt_at, created_at) VALUES ('x', 'k', 'r', '{}', 'nope', 0, 0)"
            )
    assert raw.counts() == (0, 0)


@pytest.mark.parametrize("form", ["path", "str", "url", "memory", "memory_url"])
async def test_open_store_accepts_paths_urls_and_memory(tmp_path: Path, form: str) -> None:
    file = tmp_path / "a.db"
    targets: dict[str, str | Path] = {
        "path": file,
        "str": str(file),
        "url": f"sqlite:///{file}",  # sqlite:/// + absolute path = four slashes
        "memory": ":memory:",
        "memory_url": "sqlite:///:memory:",
    }
    async with open_store(targets[form]) as db:
        dispatch_id = await enqueue_dispatch(db, kind="k", deliver_to="seat")
        assert (await get_dispatch(db, dispatch_id) or {})["status"] == "pending"
    if form.startswith("memory"):
        assert not file.exists()
    else:
        assert RawDB(file).counts() == (1, 1)


@pytest.mark.parametrize("durability, level", [("full", 2), ("normal", 1)])
async def test_durability_option_sets_synchronous(
    db_path: Path, durability: str, level: int
) -> None:
    async with open_store(db_path, durability=durability) as db:  # type: ignore[arg-type]
        found = await db.write(lambda c: c.query_one("PRAGMA synchronous"))
    assert found == {"synchronous": level}


async def test_reopening_a_file_keeps_every_row(db_path: Path, raw: RawDB) -> None:
    async with open_store(db_path) as db:
        ids = [await enqueue_dispatch(db, kind="k", deliver_to=f"s{i}") for i in range(5)]
    async with open_store(db_path) as db:
        assert [(await get_dispatch(db, i) or {})["id"] for i in ids] == ids
    assert raw.counts() == (5, 5)
    assert raw.scalar("SELECT COUNT(*) FROM trio_dispatch_schema") == SCHEMA_VERSION


async def test_a_database_of_the_source_design_is_adopted_without_losing_rows(
    db_path: Path, raw: RawDB
) -> None:
    conn = sqlite3.connect(db_path)
    conn.executescript(
        """
        CREATE TABLE sessions (id TEXT PRIMARY KEY, name TEXT);
        CREATE TABLE dispatch_outbox (
          id TEXT PRIMARY KEY, kind TEXT NOT NULL, deliver_to TEXT NOT NULL,
          payload JSON NOT NULL, dedup_key TEXT NULL,
          status TEXT NOT NULL DEFAULT 'pending' CHECK (status IN ('pending','delivering',
            'delivered','acked','dead_letter','expired')),
          attempt INTEGER NOT NULL DEFAULT 0, max_attempts INTEGER NOT NULL DEFAULT 8,
          next_attempt_at FLOAT NOT NULL, ack_required INTEGER NOT NULL DEFAULT 0,
          ack_token TEXT NULL, session_id TEXT NULL REFERENCES sessions(id),
          schedule_run_id TEXT NULL, last_error TEXT NULL, created_at FLOAT NOT NULL,
          expires_at FLOAT NULL, updated_at FLOAT NULL);
        INSERT INTO sessions VALUES ('s1', 'kept');
        INSERT INTO dispatch_outbox (id, kind, deliver_to, payload, next_attempt_at,
          created_at, session_id) VALUES ('old1', 'k', 'seat', '{}', 1, 1, 's1');
        """
    )
    conn.close()
    async with open_store(db_path) as db:
        row = await get_dispatch(db, "old1")
        assert row is not None and row["session_id"] == "s1"
        await enqueue_dispatch(db, kind="k", deliver_to="seat", session_id="s1")
    assert raw.scalar("SELECT name FROM sessions WHERE id = 's1'") == "kept"
    assert raw.scalar("SELECT COUNT(*) FROM dispatch_outbox") == 2
    assert raw.scalar("SELECT MAX(version) FROM trio_dispatch_schema") == SCHEMA_VERSION


async def test_a_version_1_database_gets_the_due_index_with_created_at_and_keeps_its_rows(
    db_path: Path, raw: RawDB
) -> None:
    conn = sqlite3.connect(db_path, isolation_level=None)
    for statement in statements(1):
        conn.execute(statement)
    conn.execute(
        "CREATE TABLE trio_dispatch_schema (version INTEGER NOT NULL, applied_at FLOAT NOT NULL)"
    )
    conn.execute("INSERT INTO trio_dispatch_schema VALUES (1, 0)")
    conn.execute(
        "INSERT INTO dispatch_outbox (id, kind, deliver_to, payload, next_attempt_at, "
        "created_at) VALUES ('old1', 'k', 'seat', '{}', 1, 1)"
    )
    conn.close()
    async with open_store(db_path) as db:
        assert (await get_dispatch(db, "old1") or {})["status"] == "pending"
    due = raw.scalar(
        "SELECT sql FROM sqlite_master WHERE name = 'ix_dispatch_outbox_status_next_attempt'"
    )
    assert "(status, (next_attempt_at - head_start), created_at, next_attempt_at)" in due
    assert [
        r["version"] for r in raw.rows("SELECT version FROM trio_dispatch_schema ORDER BY version")
    ] == list(range(1, SCHEMA_VERSION + 1))
    plan = raw.rows(
        "EXPLAIN QUERY PLAN SELECT id FROM dispatch_outbox "
        "WHERE status IN ('pending', 'delivering') AND status = 'pending' "
        "AND next_attempt_at - head_start <= 5 "
        "ORDER BY next_attempt_at - head_start, created_at LIMIT 10"
    )
    assert not any("TEMP B-TREE" in row["detail"] for row in plan), plan


def _writer_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("trio_dispatch writer")]


async def test_the_writer_thread_ends_with_the_store_and_when_opening_fails(
    db_path: Path, raw: RawDB
) -> None:
    before = _writer_threads()
    async with open_store(db_path) as db:
        await enqueue_dispatch(db, kind="k", deliver_to="seat")
    assert _writer_threads() == before
    raw.execute("INSERT INTO trio_dispatch_schema VALUES (99, 0)")
    with pytest.raises(SchemaError):
        async with open_store(db_path):
            pass
    assert _writer_threads() == before
    assert raw.counts() == (1, 1)


async def test_a_newer_schema_version_is_refused_and_left_untouched(
    db_path: Path, raw: RawDB
) -> None:
    async with open_store(db_path) as db:
        await enqueue_dispatch(db, kind="k", deliver_to="seat")
    raw.execute("INSERT INTO trio_dispatch_schema VALUES (99, 0)")
    with pytest.raises(SchemaError, match="schema version 99"):
        async with open_store(db_path):
            pass
    assert raw.counts() == (1, 1)


async def test_a_cancelled_caller_runs_nothing_in_its_transaction(
    store: SQLiteStore, raw: RawDB
) -> None:
    async with store.transaction() as tx:
        with anyio.CancelScope() as scope:
            scope.cancel()
            await enqueue_dispatch(tx, kind="k", deliver_to="seat")
        assert scope.cancelled_caught
        with anyio.move_on_after(0.05) as loop_scope:
            for _ in range(100_000):
                await tx.query("SELECT COUNT(*) AS n FROM dispatch_outbox")
        assert loop_scope.cancelled_caught
    assert raw.counts() == (0, 0)


async def test_transaction_commits_caller_sql_and_dispatch_together(
    store: SQLiteStore, raw: RawDB
) -> None:
    async with store.transaction() as tx:
        await tx.execute("INSERT INTO sessions (id, created_at) VALUES ('s1', 0)")
        dispatch_id = await enqueue_dispatch(tx, kind="k", deliver_to="seat", session_id="s1")
        # Not visible outside the transaction before it commits.
        assert raw.counts() == (0, 0)
        assert [r["id"] for r in await tx.query("SELECT id FROM dispatch_outbox")] == [dispatch_id]
    assert raw.row(dispatch_id)["session_id"] == "s1"
    assert raw.counts() == (1, 1)


async def test_transaction_rollback_discards_caller_sql_and_dispatch(
    store: SQLiteStore, raw: RawDB
) -> None:
    class Boom(Exception):
        pass

    with pytest.raises(Boom):
        async with store.transaction() as tx:
            await tx.execute("INSERT INTO sessions (id, created_at) VALUES ('s1', 0)")
            await enqueue_dispatch(tx, kind="k", deliver_to="seat", session_id="s1")
            raise Boom
    assert raw.counts() == (0, 0)
    assert raw.scalar("SELECT COUNT(*) FROM sessions") == 0
    # The store is usable afterwards.
    await enqueue_dispatch(store, kind="k", deliver_to="seat")
    assert raw.counts() == (1, 1)


async def test_cancelled_transaction_rolls_back(store: SQLiteStore, raw: RawDB) -> None:
    with anyio.move_on_after(0.2):
        async with store.transaction() as tx:
            await enqueue_dispatch(tx, kind="k", deliver_to="seat")
            await anyio.sleep(5)
    assert raw.counts() == (0, 0)


async def test_using_the_store_inside_its_own_transaction_is_an_error(
    store: SQLiteStore, raw: RawDB
) -> None:
    async with store.transaction():
        with pytest.raises(RuntimeError, match="transaction handle"):
            await enqueue_dispatch(store, kind="k", deliver_to="seat")
    assert raw.counts() == (0, 0)


async def test_other_writers_wait_for_an_open_transaction(store: SQLiteStore, raw: RawDB) -> None:
    order: list[str] = []

    async def other_writer() -> None:
        await enqueue_dispatch(store, kind="k", deliver_to="other")
        order.append("other committed")

    async with anyio.create_task_group() as tg:
        async with store.transaction() as tx:
            tg.start_soon(other_writer)
            await wait_for(lambda: store.queued_writes == 1)  # it waits for the writer
            await enqueue_dispatch(tx, kind="k", deliver_to="mine")
            order.append("tx body done")
    assert order == ["tx body done", "other committed"]
    assert raw.counts() == (2, 2)


async def test_group_commit_keeps_each_callers_result_and_error_apart(
    store: SQLiteStore, raw: RawDB
) -> None:
    async with store.transaction() as tx:
        await tx.execute("INSERT INTO sessions (id, created_at) VALUES ('known', 0)")
    results: dict[int, object] = {}

    async def producer(i: int) -> None:
        try:
            results[i] = await enqueue_dispatch(
                store,
                kind="k",
                deliver_to=f"seat-{i}",
                session_id="known" if i % 3 else "unknown",
            )
        except ValueError as exc:
            results[i] = exc

    async with anyio.create_task_group() as tg:
        for i in range(60):
            tg.start_soon(producer, i)
    good = {i: r for i, r in results.items() if isinstance(r, str)}
    bad = {i: r for i, r in results.items() if isinstance(r, ValueError)}
    assert set(bad) == {i for i in range(60) if i % 3 == 0}
    assert all("'unknown'" in str(e) for e in bad.values())
    assert len(set(good.values())) == len(good) == 40
    for i, dispatch_id in good.items():
        assert raw.row(dispatch_id)["deliver_to"] == f"seat-{i}"
    assert raw.counts() == (40, 40)


async def test_group_commit_shares_transactions_between_concurrent_writers(
    store: SQLiteStore, raw: RawDB
) -> None:
    async with anyio.create_task_group() as tg:
        for i in range(200):
            tg.start_soon(partial(enqueue_dispatch, store, kind="k", deliver_to=f"s{i}"))
    assert raw.counts() == (200, 200)
    # 200 writers committed in fewer transactions than writers: WAL frames
    # are not a reliable count, so read the store's own batch counter.
    assert 1 <= store.stats["batches"] < 200
    assert store.stats["units"] == 200


def _enqueue_in_child(path: str, tag: str, n: int) -> None:
    async def main() -> None:
        async with open_store(path) as db:
            for i in range(n):
                await enqueue_dispatch(db, kind="k", deliver_to=f"{tag}-{i}")

    anyio.run(main)


@pytest.mark.slow
async def test_several_processes_write_one_file_without_losing_rows(
    db_path: Path, raw: RawDB
) -> None:
    async with open_store(db_path):
        pass
    ctx = multiprocessing.get_context("spawn")
    children = [
        ctx.Process(target=_enqueue_in_child, args=(str(db_path), f"p{k}", 150)) for k in range(3)
    ]
    for child in children:
        child.start()
    async with open_store(db_path) as db:
        for i in range(150):
            await enqueue_dispatch(db, kind="k", deliver_to=f"parent-{i}")
    for child in children:
        await anyio.to_thread.run_sync(child.join, 60)
        assert child.exitcode == 0
    assert raw.counts() == (600, 600)
    assert raw.scalar("PRAGMA integrity_check") == "ok"


async def _limit_file_growth(store: SQLiteStore, extra_pages: int) -> None:
    """Make the database 'full' a few pages from now (a real SQLITE_FULL)."""
    pages = await store.write(lambda c: c.query_one("PRAGMA page_count"))
    assert pages is not None
    limit = int(pages["page_count"]) + extra_pages
    await store.write(lambda c: c.query(f"PRAGMA max_page_count = {limit}"))


async def test_a_batch_is_never_reported_done_without_running(
    store: SQLiteStore, raw: RawDB
) -> None:
    results: dict[str, object] = {}

    held = HeldWriter()

    async def holder() -> None:
        await store.write(held.unit)  # the others queue behind this batch
        with anyio.CancelScope() as scope:
            scope.cancel()  # cancelled just as it would lead the next batch
            await store.write(lambda c: None)

    async def producer(name: str) -> None:
        results[name] = await enqueue_dispatch(store, kind="k", deliver_to=name)

    async with anyio.create_task_group() as tg:
        tg.start_soon(holder)
        await held.running()
        tg.start_soon(producer, "a")
        tg.start_soon(producer, "b")
        await wait_for(lambda: store.queued_writes == 2)
        held.release()
    assert sorted(results) == ["a", "b"]
    for name, dispatch_id in results.items():
        assert raw.row(str(dispatch_id))["deliver_to"] == name


async def test_a_full_disk_fails_only_the_unit_that_filled_it(
    store: SQLiteStore, raw: RawDB
) -> None:
    await _limit_file_growth(store, 2)
    outcomes: dict[str, str] = {}

    async def call(name: str, value: str) -> None:
        try:
            await store.write(
                lambda c: c.execute(
                    "INSERT INTO sessions (id, created_at) VALUES (?, ?)", (name, value)
                )
            )
            outcomes[name] = "ok"
        except sqlite3.OperationalError as exc:
            outcomes[name] = str(exc)

    held = HeldWriter()  # the three queue behind it, in this order, as one batch
    async with anyio.create_task_group() as tg:
        tg.start_soon(store.write, held.unit)
        await held.running()
        for queued, (name, value) in enumerate(
            [("small-1", "0"), ("huge", "x" * 200_000), ("small-2", "0")], start=1
        ):
            tg.start_soon(call, name, value)
            await wait_for(lambda n=queued: store.queued_writes == n)  # type: ignore[misc]
        held.release()
    assert outcomes == {"small-1": "ok", "huge": "database or disk is full", "small-2": "ok"}
    assert {r["id"] for r in raw.rows("SELECT id FROM sessions")} == {"small-1", "small-2"}
    await store.write(lambda c: c.execute("INSERT INTO sessions (id) VALUES ('after')"))
    assert raw.scalar("PRAGMA integrity_check") == "ok"


async def test_a_transaction_sqlite_abandoned_commits_nothing_afterwards(
    store: SQLiteStore, raw: RawDB
) -> None:
    await _limit_file_growth(store, 3)
    with pytest.raises(RuntimeError, match="rolled back by the database"):
        async with store.transaction() as tx:
            await tx.execute("INSERT INTO sessions (id, created_at) VALUES ('mine', 0)")
            with pytest.raises(sqlite3.OperationalError, match="full"):
                await tx.execute(
                    "INSERT INTO sessions (id, created_at) VALUES ('big', ?)", ("x" * 200_000,)
                )
            await enqueue_dispatch(tx, kind="k", deliver_to="seat")  # must not autocommit
    assert raw.counts() == (0, 0)
    assert raw.scalar("SELECT COUNT(*) FROM sessions") == 0


async def test_a_unit_raising_a_base_exception_leaves_the_writer_usable(
    store: SQLiteStore, raw: RawDB
) -> None:
    def exits(conn: object) -> None:
        raise SystemExit(3)

    with pytest.raises(SystemExit):
        await store.write(exits)
    await enqueue_dispatch(store, kind="k", deliver_to="seat")
    assert raw.counts() == (1, 1)
    raw.execute("INSERT INTO sessions (id) VALUES ('other process')")  # not locked out


async def test_coalesced_writes_share_one_call_and_a_failing_item_fails_alone(
    store: SQLiteStore, raw: RawDB
) -> None:
    calls: list[list[str]] = []

    def insert_sessions(conn: Any, ids: list[str]) -> list[object]:
        calls.append(list(ids))
        for session_id in ids:
            if session_id == "bad":
                raise ValueError("bad session id")
            conn.execute("INSERT INTO sessions (id) VALUES (?)", (session_id,))
        return [f"ok:{i}" for i in ids]

    results: dict[str, object] = {}

    async def one(session_id: str) -> None:
        try:
            results[session_id] = await store.write_many(insert_sessions, session_id)
        except ValueError as exc:
            results[session_id] = exc

    held = HeldWriter()  # the others queue behind it, then run as one batch
    async with anyio.create_task_group() as tg:
        tg.start_soon(store.write, held.unit)
        await held.running()
        for session_id in ("a", "bad", "b"):
            tg.start_soon(one, session_id)
        await wait_for(lambda: store.queued_writes == 3)
        held.release()
    assert results["a"] == "ok:a" and results["b"] == "ok:b"
    assert isinstance(results["bad"], ValueError)
    assert sorted(calls[0]) == ["a", "b", "bad"]  # first tried together, in one call
    # Then each alone (a unit before the failing one runs again after the
    # rollback): "bad" once, and every retry is a single item.
    assert all(len(call) == 1 for call in calls[1:])
    assert calls[1:].count(["bad"]) == 1 and ["a"] in calls[1:] and ["b"] in calls[1:]
    assert {r["id"] for r in raw.rows("SELECT id FROM sessions")} == {"a", "b"}


async def test_a_callers_transaction_costs_one_hop_per_statement_and_one_for_the_commit(
    store: SQLiteStore, raw: RawDB
) -> None:
    def hops() -> int:
        return store.stats["hops"]

    before = hops()
    async with store.transaction():
        pass  # ran nothing: no BEGIN, no COMMIT
    assert hops() == before
    before = hops()
    async with store.transaction() as tx:
        await tx.execute("INSERT INTO sessions (id, created_at) VALUES (?, ?)", ("s1", 1.0))
    assert hops() - before == 2  # BEGIN rides with the INSERT; then COMMIT
    before = hops()
    async with store.transaction() as tx:
        await tx.execute("INSERT INTO sessions (id, created_at) VALUES (?, ?)", ("s2", 1.0))
        await enqueue_dispatch(tx, kind="k", deliver_to="seat", session_id="s2")
    assert hops() - before == 3
    assert raw.counts() == (1, 1)
    assert raw.scalar("SELECT COUNT(*) FROM sessions") == 2


async def test_a_transaction_whose_first_statement_fails_leaves_nothing_and_the_store_usable(
    store: SQLiteStore, raw: RawDB
) -> None:
    with pytest.raises(raw.error):
        async with store.transaction() as tx:
            await tx.execute("INSERT INTO no_such_table VALUES (1)")
    await enqueue_dispatch(store, kind="k", deliver_to="seat")
    assert raw.counts() == (1, 1)
