"""What is PostgreSQL's own: the schema's equivalence, forward-only
migrations, row-locking claims, and the read pool."""

from __future__ import annotations

import functools
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, cast

import anyio
import pytest

from trio_dispatch import deliver_due_dispatches, enqueue_dispatch, enqueue_many, open_store
from trio_dispatch.outbox import claim_due
from trio_dispatch.outbox.machine import insert_rows
from trio_dispatch.store import SchemaError, SQLiteStore, StoreError
from trio_dispatch.store.schema import SCHEMA_VERSION

from ..conftest import RawDB
from ..helpers import HeldWriter, wait_for

pytestmark = [pytest.mark.anyio, pytest.mark.postgres_only]


async def test_the_schema_matches_the_sqlite_one(store: SQLiteStore, raw: RawDB) -> None:
    columns = raw.rows(
        "SELECT column_name, data_type, is_nullable, column_default FROM "
        "information_schema.columns WHERE table_name = 'dispatch_outbox' "
        "ORDER BY ordinal_position"
    )
    assert [c["column_name"] for c in columns] == [
        "id",
        "kind",
        "deliver_to",
        "payload",
        "dedup_key",
        "status",
        "attempt",
        "max_attempts",
        "next_attempt_at",
        "ack_required",
        "ack_token",
        "session_id",
        "schedule_run_id",
        "last_error",
        "created_at",
        "expires_at",
        "updated_at",
        "ordering_key",
        "key_seq",
        "throttles",
        "cancel_requested_at",
        "cancel_request",
        "priority",
        "head_start",
        "coalesce_key",
        "coalesce_since",
        "not_before",
    ]
    types = {c["column_name"]: c["data_type"] for c in columns}
    assert types["payload"] == "json" and types["next_attempt_at"] == "double precision"
    not_null = {c["column_name"] for c in columns if c["is_nullable"] == "NO"}
    assert not_null == {
        "id",
        "kind",
        "deliver_to",
        "payload",
        "status",
        "attempt",
        "max_attempts",
        "next_attempt_at",
        "ack_required",
        "created_at",
        "key_seq",
        "throttles",
        "priority",
        "head_start",
    }
    defaults = {c["column_name"]: c["column_default"] for c in columns if c["column_default"]}
    assert defaults == {
        "status": "'pending'::text",
        "attempt": "0",
        "max_attempts": "8",
        "ack_required": "0",
        "key_seq": "0",
        "throttles": "0",
        "priority": "0",
        "head_start": "0",
    }
    indexes = {
        r["indexname"]: r["indexdef"]
        for r in raw.rows(
            "SELECT indexname, indexdef FROM pg_indexes WHERE tablename = 'dispatch_outbox'"
        )
    }
    dedup = indexes["ux_dispatch_outbox_dedup_key"]
    assert "UNIQUE" in dedup and "WHERE (dedup_key IS NOT NULL)" in dedup
    due = indexes["ix_dispatch_outbox_status_next_attempt"]
    # The claim rank where the original index had next_attempt_at (docs/controls.md).
    assert "(status, ((next_attempt_at - head_start)), created_at, next_attempt_at)" in due
    assert "(ordering_key, key_seq, id)" in indexes["ix_dispatch_outbox_ordering_seq"]
    assert "pending" in due and "delivering" in due
    coalesce = indexes["ux_dispatch_outbox_coalesce_waiting"]
    assert "UNIQUE" in coalesce and "(coalesce_key)" in coalesce
    assert "attempt = 0" in coalesce and "updated_at = created_at" in coalesce
    checks = [
        r["def"]
        for r in raw.rows(
            "SELECT pg_get_constraintdef(oid) AS def FROM pg_constraint "
            "WHERE conrelid = 'dispatch_outbox'::regclass AND contype = 'c'"
        )
    ]
    assert any("dead_letter" in c and "expired" in c for c in checks)
    assert any("priority >= '-10'" in c or "priority >= -10" in c for c in checks), checks
    fks = {
        r["def"]
        for r in raw.rows(
            "SELECT pg_get_constraintdef(oid) AS def FROM pg_constraint "
            "WHERE conrelid = 'dispatch_outbox'::regclass AND contype = 'f'"
        )
    }
    assert fks == {
        "FOREIGN KEY (session_id) REFERENCES sessions(id)",
        "FOREIGN KEY (schedule_run_id) REFERENCES schedule_runs(id)",
    }
    assert (
        raw.rows(
            "SELECT conname FROM pg_constraint WHERE "
            "conrelid = 'status_transitions'::regclass AND contype = 'f'"
        )
        == []
    )
    assert raw.scalar("SELECT MAX(version) FROM trio_dispatch_schema") == SCHEMA_VERSION


async def test_a_newer_schema_version_is_refused(db_target: str, raw: RawDB) -> None:
    async with open_store(db_target):
        pass
    raw.execute("INSERT INTO trio_dispatch_schema VALUES (99, 0)")
    try:
        with pytest.raises(SchemaError, match="schema version 99"):
            async with open_store(db_target):
                pass
    finally:
        raw.execute("DELETE FROM trio_dispatch_schema WHERE version = 99")


async def test_concurrent_claims_from_two_hosts_never_overlap(
    store: SQLiteStore, db_target: str, raw: RawDB
) -> None:
    await enqueue_many(store, [{"kind": "k", "deliver_to": f"s{i}"} for i in range(400)])
    claimed: list[list[str]] = [[], [], []]

    async def host(k: int) -> None:
        async with open_store(db_target) as db:
            while True:
                claims, _ = await claim_due(db, limit=25)
                if not claims:
                    return
                claimed[k].extend(c.dispatch_id for c in claims)

    async with anyio.create_task_group() as tg:
        for k in range(3):
            tg.start_soon(host, k)
    every = [i for part in claimed for i in part]
    assert len(every) == len(set(every)) == 400
    assert sum(1 for part in claimed if part) >= 2  # the work really was shared
    assert (
        raw.scalar(
            "SELECT COUNT(*) FROM dispatch_outbox WHERE status = 'delivering' AND attempt = 1"
        )
        == 400
    )


async def test_reads_run_concurrently_on_the_pool(store: SQLiteStore) -> None:
    def slow(conn: object) -> float:
        time.sleep(0.3)
        return time.monotonic()

    started = time.monotonic()
    async with anyio.create_task_group() as tg:
        for _ in range(4):
            tg.start_soon(store.read, slow)
    assert time.monotonic() - started < 0.3 * 3  # not one after another


def _open_transactions(raw: RawDB) -> int:
    """Backends of the test's database inside a transaction, this query's own
    connection left out."""
    return int(
        raw.scalar(
            "SELECT COUNT(*) FROM pg_stat_activity WHERE datname = current_database() "
            "AND pid <> pg_backend_pid() AND state LIKE 'idle in transaction%'"
        )
    )


async def test_a_lazily_begun_writer_transaction_is_closed_by_every_outcome(
    store: SQLiteStore, raw: RawDB
) -> None:
    # Nothing run: no transaction was opened, none is left behind.
    async with store.transaction():
        pass
    assert _open_transactions(raw) == 0
    # A first statement that fails (BEGIN went out with it): nothing is
    # committed, the transaction is closed, the store writes on.
    with pytest.raises(raw.error):
        async with store.transaction() as tx:
            await tx.execute("INSERT INTO no_such_table VALUES (1)")
    assert _open_transactions(raw) == 0
    # A statement's results come back through the pipelined first round trip.
    async with store.transaction() as tx:
        assert (
            await tx.execute("INSERT INTO sessions (id, created_at) VALUES (?, ?)", ("s", 1.0)) == 1
        )
        assert await tx.query("SELECT id FROM sessions") == [{"id": "s"}]
        await enqueue_dispatch(tx, kind="k", deliver_to="seat", session_id="s")
        assert _open_transactions(raw) == 1  # open until the commit
    assert _open_transactions(raw) == 0
    assert raw.counts() == (1, 1)
    # The group commit's first statement is a coalesced enqueue: one row per
    # caller, each with its transition, all committed.
    held = HeldWriter()  # the others queue behind it, then commit as one batch
    async with anyio.create_task_group() as tg:
        tg.start_soon(store.write, held.unit)
        await held.running()
        for i in range(20):
            tg.start_soon(functools.partial(enqueue_dispatch, store, kind="k", deliver_to=f"d{i}"))
        await wait_for(lambda: store.queued_writes == 20)
        held.release()
    assert raw.counts() == (21, 21)
    assert _open_transactions(raw) == 0


async def test_a_first_statement_of_several_commands_still_runs_in_the_transaction(
    store: SQLiteStore, raw: RawDB
) -> None:
    # No parameters: the simple protocol, which a pipeline cannot carry.
    async with store.transaction() as tx:
        await tx.execute(
            "INSERT INTO sessions (id, created_at) VALUES ('a', 1); "
            "INSERT INTO sessions (id, created_at) VALUES ('b', 1)"
        )
        assert _open_transactions(raw) == 1
    assert raw.scalar("SELECT COUNT(*) FROM sessions") == 2
    with pytest.raises(RuntimeError):
        async with store.transaction() as tx:
            await tx.execute(
                "INSERT INTO sessions (id, created_at) VALUES ('c', 1); "
                "INSERT INTO sessions (id, created_at) VALUES ('d', 1)"
            )
            raise RuntimeError("the caller changes its mind")
    assert raw.scalar("SELECT COUNT(*) FROM sessions") == 2
    assert _open_transactions(raw) == 0


async def test_bulk_history_keeps_its_order_and_takes_int_and_float_times(
    store: SQLiteStore, raw: RawDB
) -> None:
    rows = [
        ("dispatch", f"d{i}", None, "pending", "dispatch.pending.enqueued", "", "system", "t",
         "[]", "{}", 1000 if i % 2 else 1000.5)  # a caller's clock may give ints
        for i in range(6)
    ]  # fmt: skip
    await store.write(lambda conn: insert_rows(conn, rows))
    got = raw.rows("SELECT entity_id, created_at FROM status_transitions ORDER BY id")
    assert [(r["entity_id"], r["created_at"]) for r in got] == [
        (f"d{i}", 1000.0 if i % 2 else 1000.5) for i in range(6)
    ]


async def test_a_transaction_that_went_on_after_a_failed_statement_says_nothing_committed(
    store: SQLiteStore, raw: RawDB
) -> None:
    with pytest.raises(StoreError, match="nothing was committed"):
        async with store.transaction() as tx:
            await tx.execute("INSERT INTO sessions (id, created_at) VALUES (?, ?)", ("s", 1.0))
            await enqueue_dispatch(tx, kind="k", deliver_to="seat", session_id="s")
            with pytest.raises(raw.error):  # the caller catches it and goes on
                await tx.execute("INSERT INTO no_such_table VALUES (1)")
    assert raw.counts() == (0, 0)
    assert raw.scalar("SELECT COUNT(*) FROM sessions") == 0
    assert _open_transactions(raw) == 0
    await enqueue_dispatch(store, kind="k", deliver_to="seat")  # the store writes on
    assert raw.counts() == (1, 1)


async def test_a_transaction_takes_two_round_trips_and_a_lone_enqueue_one(
    store: SQLiteStore, raw: RawDB, tmp_path: Path
) -> None:
    # libpq's own protocol trace of the writer connection: every round trip
    # ends with the server's ReadyForQuery.
    writer = cast(Any, store)._writer  # the PostgreSQL store's writer connection
    trace = tmp_path / "libpq.trace"

    async def round_trips(work: Callable[[], Awaitable[object]]) -> int:
        with trace.open("w") as sink:
            writer.pgconn.trace(sink.fileno())
            try:
                await work()
            finally:
                writer.pgconn.untrace()
        return trace.read_text().count("\tReadyForQuery")

    async def one_insert() -> None:
        async with store.transaction() as tx:
            await tx.execute("INSERT INTO sessions (id, created_at) VALUES (?, ?)", ("s", 1.0))

    # BEGIN rides with the INSERT (one pipeline), then COMMIT.
    assert await round_trips(one_insert) == 2
    # A lone plain enqueue is one statement (row, history, NOTIFY): sent
    # alone, it commits by itself, with no BEGIN or COMMIT.
    assert await round_trips(lambda: enqueue_dispatch(store, kind="k", deliver_to="seat")) == 1
    assert "BEGIN" not in trace.read_text() and "COMMIT" not in trace.read_text()
    assert raw.counts() == (1, 1)
    # With a dedup key it may read the winner's id after: BEGIN rides with
    # the insert, then COMMIT.
    dedup = enqueue_dispatch(store, kind="k", deliver_to="seat", dedup_key="d")
    assert await round_trips(lambda: dedup) == 2
    assert raw.counts() == (2, 2)


async def test_a_single_statement_write_refuses_a_second_statement(store: SQLiteStore) -> None:
    def two(conn: Any, items: list[int]) -> list[int]:
        conn.execute("SELECT 1")
        conn.execute("SELECT 2")
        return items

    with pytest.raises(StoreError, match="second statement"):
        await store.write_many(two, 1, single=True)
    # The store goes on: the same work, not promised single, runs.
    assert await store.write_many(two, 2) == 2


async def test_the_claim_and_finish_send_their_parameters_in_binary(
    store: SQLiteStore, raw: RawDB, tmp_path: Path
) -> None:
    # Text arrays in text form cost psycopg a quoting pass over every
    # element; binary form skips it. libpq's trace shows each Bind's
    # parameter format codes (1: binary).
    for i in range(2):
        await enqueue_dispatch(store, kind="k", deliver_to=f"seat-{i}")
    writer = cast(Any, store)._writer
    trace = tmp_path / "libpq.trace"

    async def ok(delivery: Any) -> None:
        pass

    with trace.open("w") as sink:
        writer.pgconn.trace(sink.fileno())
        try:
            assert (await deliver_due_dispatches(store, transport=ok))["delivered"] == 2
        finally:
            writer.pgconn.untrace()
    formats: dict[str, list[list[str]]] = {"claim": [], "finish": []}
    statement = None
    for line in trace.read_text().splitlines():
        fields = line.split("\t")
        if len(fields) < 5 or fields[1] != "F":
            continue
        if fields[3] == "Parse":
            text = fields[4]
            statement = (
                "claim" if "WITH claimed AS" in text else "finish" if "WITH f(id" in text else None
            )
        elif fields[3] == "Bind" and statement is not None:
            words = fields[4].split()
            count = int(words[2])
            formats[statement].append(words[3 : 3 + count])
            statement = None
    assert formats["claim"] and formats["finish"], trace.read_text()[:2000]
    for codes in formats["claim"]:
        assert set(codes) == {"1"}, codes
    for codes in formats["finish"]:  # an array of NULLs (no errors) may go as text
        assert codes.count("1") >= len(codes) - 1, codes
    assert raw.scalar("SELECT COUNT(*) FROM dispatch_outbox WHERE status = 'delivered'") == 2


async def test_the_store_sessions_run_without_jit(store: SQLiteStore) -> None:
    # The claim rule's subplans push a scan's estimate past jit_above_cost;
    # compiling it cost 11 ms of a 0.1 ms read (the capped-backlog bench).
    def jit(conn: Any) -> object:
        row = conn.query_one("SELECT current_setting('jit') AS jit")
        return None if row is None else row["jit"]

    assert await store.read(jit) == "off"
    assert await store.write(jit) == "off"
