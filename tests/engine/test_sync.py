"""Enqueue inside the caller's own transaction (docs/usage.md#use-your-own-connection): sqlite3,
psycopg and SQLAlchemy connections, on real databases; commit, rollback,
errors that leave the caller's transaction usable, a SIGKILLed producer,
a same-key race between two processes, and wake-ups at commit."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest

from trio_dispatch import Delivery, DispatchWorker, open_store
from trio_dispatch import sync as outbox
from trio_dispatch.store import SchemaError
from trio_dispatch.store.schema import OWN_TABLES

from ..conftest import RawDB
from ..helpers import listening_backends, wait_for

APP_TABLE = "CREATE TABLE IF NOT EXISTS orders (id TEXT PRIMARY KEY, total INTEGER)"


def connect(engine: str, target: str, *, autocommit: bool = False) -> Any:
    """A connection of the caller's own, to the test's database."""
    if engine == "sqlite":  # (used from worker threads in some tests)
        if autocommit:
            return sqlite3.connect(target, isolation_level=None, check_same_thread=False)
        # The default mode: sqlite3's own implicit transactions.
        return sqlite3.connect(target, check_same_thread=False)
    import psycopg

    return psycopg.connect(target, autocommit=autocommit)


@pytest.fixture
def app(engine: str, db_target: str) -> Iterator[Any]:
    """The caller's connection, with the outbox schema and an app table."""
    conn = connect(engine, db_target)
    outbox.install_schema(conn)
    conn.execute(APP_TABLE)
    conn.execute("DELETE FROM orders")  # the database outlives a test on PostgreSQL
    conn.commit()
    yield conn
    conn.close()


def sql(engine: str, text: str) -> str:
    return text if engine == "sqlite" else text.replace("?", "%s")


def order(app: Any, engine: str, order_id: str) -> None:
    app.execute(sql(engine, "INSERT INTO orders (id, total) VALUES (?, ?)"), (order_id, 3))


# -- commit, rollback, errors ------------------------------------------------------------


def test_the_dispatch_commits_with_the_callers_writes(app: Any, engine: str, raw: RawDB) -> None:
    order(app, engine, "o-1")
    dispatch_id = outbox.enqueue_dispatch(
        app, kind="order.created", deliver_to="billing", body={"order": "o-1"}
    )
    assert raw.counts() == (0, 0)  # not before the caller commits
    app.commit()
    row = raw.row(dispatch_id)
    assert (row["status"], row["kind"], row["attempt"]) == ("pending", "order.created", 0)
    assert json.loads(str(row["payload"]))["body"] == {"order": "o-1"}
    [transition] = raw.transitions(dispatch_id)
    assert (transition["reason_code"], transition["actor"]) == (
        "dispatch.pending.enqueued",
        "enqueue_dispatch",
    )
    assert raw.scalar("SELECT COUNT(*) FROM orders") == 1


def test_a_rollback_leaves_no_dispatch_and_no_transition(app: Any, engine: str, raw: RawDB) -> None:
    order(app, engine, "o-1")
    outbox.enqueue_many(app, [{"kind": "a", "deliver_to": "x"}, {"kind": "b", "deliver_to": "y"}])
    app.rollback()
    assert raw.counts() == (0, 0)
    assert raw.scalar("SELECT COUNT(*) FROM orders") == 0


def test_an_exception_inside_the_callers_with_block_leaves_nothing(
    app: Any, engine: str, raw: RawDB
) -> None:
    with pytest.raises(RuntimeError, match="payment declined"):
        with app:
            order(app, engine, "o-1")
            outbox.enqueue_dispatch(app, kind="order.created", deliver_to="billing")
            raise RuntimeError("payment declined")
    assert raw.counts() == (0, 0)
    assert raw.scalar("SELECT COUNT(*) FROM orders") == 0


def test_bad_arguments_raise_naming_them_and_the_transaction_stays_usable(
    app: Any, engine: str, raw: RawDB
) -> None:
    order(app, engine, "o-1")
    with pytest.raises(ValueError, match="max_attempts"):
        outbox.enqueue_dispatch(app, kind="k", deliver_to="x", max_attempts=0)
    with pytest.raises(ValueError, match="item 1: deliver_to"):
        outbox.enqueue_many(
            app, [{"kind": "k", "deliver_to": "x"}, {"kind": "k", "deliver_to": ""}]
        )
    with pytest.raises(ValueError, match="session_id 'ghost' does not exist"):
        outbox.enqueue_dispatch(app, kind="k", deliver_to="x", session_id="ghost")
    dispatch_id = outbox.enqueue_dispatch(app, kind="k", deliver_to="x")
    app.commit()
    assert raw.counts() == (1, 1) and raw.row(dispatch_id)["status"] == "pending"
    assert raw.scalar("SELECT COUNT(*) FROM orders") == 1


@pytest.mark.parametrize("field", ["kind", "deliver_to"])
def test_bidirectional_controls_are_refused_in_the_callers_transaction(
    app: Any, engine: str, raw: RawDB, field: str
) -> None:
    order(app, engine, "o-1")
    for char in ("\u202a", "\u202e", "\u2066", "\u2069"):
        args: dict[str, Any] = {"kind": "k", "deliver_to": "x", field: f"refund{char}"}
        with pytest.raises(ValueError, match=f"^{field} must not contain bidirectional"):
            outbox.enqueue_dispatch(app, **args)
        with pytest.raises(ValueError, match=f"item 0: {field} must not contain bidirectional"):
            outbox.enqueue_many(app, [args])
    dispatch_id = outbox.enqueue_dispatch(app, kind="k", deliver_to="x")
    app.commit()
    assert raw.counts() == (1, 1) and raw.row(dispatch_id)["status"] == "pending"


def test_a_database_without_the_schema_names_install_schema_and_migrate(
    engine: str, db_target: str, tmp_path: Path
) -> None:
    target = str(tmp_path / "bare.db") if engine == "sqlite" else db_target
    conn = connect(engine, target)
    try:
        if engine == "postgres":  # the throwaway database holds no outbox yet
            for table in OWN_TABLES:  # the next test's store makes them all again
                conn.execute(f"DROP TABLE IF EXISTS {table} CASCADE")
            conn.commit()
        conn.execute(APP_TABLE)
        conn.execute("DELETE FROM orders")
        order(conn, engine, "o-1")
        with pytest.raises(SchemaError) as info:
            outbox.enqueue_dispatch(conn, kind="k", deliver_to="x")
        assert "install_schema" in str(info.value) and "trio-dispatch migrate" in str(info.value)
        order(conn, engine, "o-2")  # the caller's transaction is still usable
        conn.commit()
        check = connect(engine, target)
        assert check.execute("SELECT COUNT(*) FROM orders").fetchone()[0] == 2
        check.close()
    finally:
        conn.close()


def test_an_unsupported_connection_is_a_type_error_naming_its_type() -> None:
    class Handmade:
        pass

    with pytest.raises(TypeError, match=r"test_sync\.[\w.<>]*Handmade"):
        outbox.enqueue_dispatch(Handmade(), kind="k", deliver_to="x")
    with pytest.raises(TypeError, match=r"sqlite3\.Connection, a psycopg\.Connection"):
        outbox.install_schema("outbox.db")


def test_install_schema_is_idempotent_and_never_commits(engine: str, db_target: str) -> None:
    conn = connect(engine, db_target)
    outbox.install_schema(conn)
    outbox.install_schema(conn)
    conn.commit()
    outbox.enqueue_dispatch(conn, kind="k", deliver_to="x")
    conn.rollback()  # nothing enqueued survives a rollback, schema or not
    assert conn.execute("SELECT COUNT(*) FROM dispatch_outbox").fetchone()[0] == 0
    conn.close()


def test_autocommit_mode_commits_the_enqueue_at_once(
    engine: str, db_target: str, raw: RawDB
) -> None:
    setup = connect(engine, db_target)
    outbox.install_schema(setup)
    setup.commit()
    setup.close()
    conn = connect(engine, db_target, autocommit=True)
    dispatch_id = outbox.enqueue_dispatch(conn, kind="k", deliver_to="x")
    assert raw.row(dispatch_id)["status"] == "pending"  # committed, no commit() called
    assert len(raw.transitions(dispatch_id)) == 1
    conn.close()


def _own_row(cursor: sqlite3.Cursor, row: tuple[Any, ...]) -> str:
    return f"row of {len(row)}"  # nothing the outbox could read a column from


SQLITE_MODES = [
    pytest.param({}, id="implicit-transactions"),
    pytest.param({"isolation_level": "IMMEDIATE"}, id="immediate"),
    pytest.param({"isolation_level": None}, id="isolation-none"),
    pytest.param(
        {"autocommit": True},
        id="autocommit-true",
        marks=pytest.mark.skipif(sys.version_info < (3, 12), reason="autocommit: Python 3.12+"),
    ),
    pytest.param(
        {"autocommit": False},
        id="autocommit-false",
        marks=pytest.mark.skipif(sys.version_info < (3, 12), reason="autocommit: Python 3.12+"),
    ),
]


@pytest.mark.sqlite_only
@pytest.mark.parametrize("mode", SQLITE_MODES)
def test_a_callers_sqlite3_connection_keeps_its_own_settings_through_every_enqueue(
    db_target: str, raw: RawDB, mode: dict[str, Any]
) -> None:
    conn = sqlite3.connect(db_target, **mode)
    outbox.install_schema(conn)
    conn.execute(APP_TABLE)
    conn.commit()
    conn.text_factory = bytes
    conn.row_factory = _own_row
    settings = (conn.isolation_level, getattr(conn, "autocommit", None))
    conn.execute("INSERT INTO orders (id, total) VALUES ('o-1', 3)")
    first = outbox.enqueue_dispatch(conn, kind="k", deliver_to="x", dedup_key="order-o-1")
    # A dedup hit reads the first row's id back, a keyed row its key's place.
    assert outbox.enqueue_dispatch(conn, kind="k", deliver_to="x", dedup_key="order-o-1") == first
    outbox.enqueue_many(conn, [{"kind": "k", "deliver_to": "x", "ordering_key": "o-1"}] * 2)
    with pytest.raises(ValueError, match="session_id 'ghost' does not exist"):
        outbox.enqueue_dispatch(conn, kind="k", deliver_to="x", session_id="ghost")
    assert conn.text_factory is bytes and conn.row_factory is _own_row
    assert (conn.isolation_level, getattr(conn, "autocommit", None)) == settings
    # The caller's own reads still come through the caller's factories.
    assert conn.execute("SELECT id, total FROM orders").fetchall() == ["row of 2"]
    conn.row_factory = None
    assert conn.execute("SELECT id FROM orders").fetchall() == [(b"o-1",)]
    if conn.in_transaction:
        conn.commit()
    conn.close()
    assert raw.row(first)["dedup_key"] == "order-o-1"
    assert raw.counts() == (3, 3)


@pytest.mark.postgres_only
@pytest.mark.parametrize("autocommit", [False, True], ids=["transaction", "autocommit"])
def test_a_callers_psycopg_connection_keeps_its_own_settings_through_every_enqueue(
    db_target: str, raw: RawDB, autocommit: bool
) -> None:
    import psycopg
    from psycopg.rows import namedtuple_row

    setup = psycopg.connect(db_target)
    outbox.install_schema(setup)
    setup.commit()
    setup.close()
    conn = psycopg.connect(db_target, autocommit=autocommit, row_factory=namedtuple_row)
    if not autocommit:
        conn.isolation_level = psycopg.IsolationLevel.REPEATABLE_READ
    before = (conn.autocommit, conn.isolation_level, conn.row_factory, conn.read_only)
    timeout = conn.execute("SHOW statement_timeout").fetchone()
    first = outbox.enqueue_dispatch(conn, kind="k", deliver_to="x", dedup_key="order-o-1")
    assert outbox.enqueue_dispatch(conn, kind="k", deliver_to="x", dedup_key="order-o-1") == first
    outbox.enqueue_many(conn, [{"kind": "k", "deliver_to": "x", "ordering_key": "o-1"}] * 2)
    with pytest.raises(ValueError, match="session_id 'ghost' does not exist"):
        outbox.enqueue_dispatch(conn, kind="k", deliver_to="x", session_id="ghost")
    assert (conn.autocommit, conn.isolation_level, conn.row_factory, conn.read_only) == before
    # No session setting of the store's, and JSON still parsed as the
    # caller's loaders say (the store reads it as text).
    assert conn.execute("SHOW statement_timeout").fetchone() == timeout
    doc = conn.execute("""SELECT '{"a": 1}'::json""").fetchone()
    assert doc is not None and doc[0] == {"a": 1}
    conn.commit()
    conn.close()
    assert raw.row(first)["dedup_key"] == "order-o-1"
    assert raw.counts() == (3, 3)


def test_a_dedup_hit_returns_the_first_rows_id_and_writes_nothing(
    app: Any, engine: str, raw: RawDB
) -> None:
    first = outbox.enqueue_dispatch(app, kind="k", deliver_to="x", dedup_key="order:o-1")
    again = outbox.enqueue_dispatch(app, kind="other", deliver_to="y", dedup_key="order:o-1")
    app.commit()
    assert first == again and raw.counts() == (1, 1)


# -- the caller's own process dies ------------------------------------------------------

PRODUCER = """
import sys, time
sys.path.insert(0, sys.argv[3])
from tests.engine.test_sync import connect, order
from trio_dispatch import sync as outbox
engine, target = sys.argv[1], sys.argv[2]
conn = connect(engine, target)
order(conn, engine, "o-1")
outbox.enqueue_dispatch(conn, kind="order.created", deliver_to="billing")
if sys.argv[4] == "commit":
    conn.commit()
print("written", flush=True)
time.sleep(60)
"""


@pytest.mark.slow
@pytest.mark.parametrize("commit", [False, True])
def test_a_sigkilled_producer_leaves_both_rows_or_neither(
    app: Any, engine: str, db_target: str, raw: RawDB, commit: bool
) -> None:
    root = str(Path(__file__).resolve().parents[2])
    with subprocess.Popen(
        [sys.executable, "-c", PRODUCER, engine, db_target, root, "commit" if commit else "-"],
        stdout=subprocess.PIPE,
        text=True,
    ) as producer:
        try:
            assert producer.stdout is not None and producer.stdout.readline() == "written\n"
            os.kill(producer.pid, signal.SIGKILL)
            producer.wait(timeout=10)
        finally:
            producer.kill()
    orders = raw.scalar("SELECT COUNT(*) FROM orders")
    assert raw.counts() == ((1, 1) if commit else (0, 0))
    assert orders == (1 if commit else 0)


# -- a same-key race between two processes' transactions ----------------------------------

RACER = """
import json, sys, time
sys.path.insert(0, sys.argv[3])
from tests.engine.test_sync import connect, order
from trio_dispatch import sync as outbox
engine, target, _, name, hold = sys.argv[1:6]
conn = connect(engine, target)
if engine == "sqlite":
    conn.execute("PRAGMA busy_timeout = 10000")
print("writing", flush=True)  # (on SQLite the first write waits for the lock)
order(conn, engine, name)
got = outbox.enqueue_dispatch(conn, kind="k", deliver_to=name, dedup_key="shared")
if hold == "hold":
    print("holding", flush=True)  # the key is taken in an open transaction
    sys.stdin.readline()  # until the test has started the other racer
order(conn, engine, name + "-after")  # the transaction is still usable
conn.commit()
print(json.dumps(got), flush=True)
"""

WAITING_LOCKS = (
    "SELECT COUNT(*) FROM pg_stat_activity"
    " WHERE datname = current_database() AND wait_event_type = 'Lock'"
)


@pytest.mark.slow
def test_a_same_key_race_gives_both_transactions_the_winner_and_aborts_neither(
    app: Any, engine: str, db_target: str, raw: RawDB
) -> None:
    root = str(Path(__file__).resolve().parents[2])

    def racer(name: str, hold: str) -> subprocess.Popen[str]:
        return subprocess.Popen(
            [sys.executable, "-c", RACER, engine, db_target, root, name, hold],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )

    first = racer("a", "hold")  # holds its transaction (and the key) until told
    assert first.stdout is not None and first.stdin is not None
    assert first.stdout.readline() == "writing\n", first.stderr
    assert first.stdout.readline() == "holding\n", first.stderr
    second = racer("b", "go")  # blocks on the first's key, then finds its row
    assert second.stdout is not None
    assert second.stdout.readline() == "writing\n", second.stderr
    if engine == "postgres":  # the server shows the wait
        deadline = time.monotonic() + 30
        while raw.scalar(WAITING_LOCKS) == 0:
            assert time.monotonic() < deadline, "the second racer never waited on the key"
            time.sleep(0.01)
    else:  # SQLite shows nothing: give its busy handler a moment to be in the wait
        time.sleep(0.3)
    assert second.poll() is None  # it is waiting, not done
    first.stdin.write("\n")
    first.stdin.flush()
    out_a, err_a = first.communicate(timeout=60)
    out_b, err_b = second.communicate(timeout=60)
    assert first.returncode == 0, err_a
    assert second.returncode == 0, err_b
    winner = raw.rows("SELECT id, deliver_to FROM dispatch_outbox")
    assert len(winner) == 1 and winner[0]["deliver_to"] == "a"
    assert json.loads(out_a) == json.loads(out_b) == winner[0]["id"]
    assert raw.scalar("SELECT COUNT(*) FROM orders") == 4  # both transactions committed


# -- wake-ups -------------------------------------------------------------------------


@pytest.mark.anyio
async def test_a_worker_wakes_at_the_callers_commit_not_at_its_tick(
    engine: str, db_target: str, raw: RawDB
) -> None:
    started: list[float] = []

    async def send(delivery: Delivery) -> None:
        started.append(time.monotonic())

    async with open_store(db_target) as db, anyio.create_task_group() as tg:
        worker = DispatchWorker(db, transport=send, tick_seconds=3600)
        await tg.start(worker.run)
        await wait_for(  # the worker is idle, listening
            lambda: (
                worker.statistics().scans >= 1
                and (engine == "sqlite" or listening_backends(raw) == 1)
            )
        )
        conn = await anyio.to_thread.run_sync(connect, engine, db_target)
        dispatch_id = await anyio.to_thread.run_sync(
            lambda: outbox.enqueue_dispatch(conn, kind="k", deliver_to="x")
        )
        await anyio.sleep(0.3)  # a window in which nothing may happen
        assert started == []  # written, not committed: nothing to deliver yet
        await anyio.to_thread.run_sync(conn.rollback)
        await anyio.sleep(0.3)
        assert started == [] and raw.counts() == (0, 0)
        dispatch_id = await anyio.to_thread.run_sync(
            lambda: outbox.enqueue_dispatch(conn, kind="k", deliver_to="x")
        )
        committed = time.monotonic()
        await anyio.to_thread.run_sync(conn.commit)
        await wait_for(lambda: started, timeout=5)
        tg.cancel_scope.cancel()
    conn.close()
    assert started[0] - committed < 1.0  # the tick is an hour
    assert raw.row(dispatch_id)["status"] == "delivered"


# -- SQLAlchemy ---------------------------------------------------------------------------


def sqlalchemy_url(engine: str, db_target: str, *, asyncio: bool = False) -> str:
    if engine == "sqlite":
        return f"sqlite+{'aiosqlite' if asyncio else 'pysqlite'}:///{db_target}"
    return db_target.replace("postgresql://", "postgresql+psycopg://", 1)


def test_an_sqlalchemy_session_commits_and_rolls_back_with_the_dispatch(
    app: Any, engine: str, db_target: str, raw: RawDB
) -> None:
    from sqlalchemy import create_engine, text
    from sqlalchemy.orm import Session

    sa_engine = create_engine(sqlalchemy_url(engine, db_target))
    with Session(sa_engine) as session, session.begin():
        session.execute(text("INSERT INTO orders (id, total) VALUES ('o-1', 1)"))
        kept = outbox.enqueue_dispatch(session, kind="order.created", deliver_to="billing")
    with Session(sa_engine) as session:
        session.execute(text("INSERT INTO orders (id, total) VALUES ('o-2', 2)"))
        outbox.enqueue_dispatch(session, kind="order.created", deliver_to="billing")
        session.rollback()
    with sa_engine.begin() as connection:  # a Connection, too
        connection.execute(text("INSERT INTO orders (id, total) VALUES ('o-3', 3)"))
        also = outbox.enqueue_dispatch(connection, kind="order.created", deliver_to="billing")
    sa_engine.dispose()
    assert {row["id"] for row in raw.rows("SELECT id FROM dispatch_outbox")} == {kept, also}
    assert raw.counts() == (2, 2)
    assert raw.scalar("SELECT COUNT(*) FROM orders") == 2


def test_an_error_inside_an_sqlalchemy_session_leaves_it_usable(
    app: Any, engine: str, db_target: str, raw: RawDB
) -> None:
    from sqlalchemy import create_engine, text
    from sqlalchemy.orm import Session

    sa_engine = create_engine(sqlalchemy_url(engine, db_target))
    with Session(sa_engine) as session, session.begin():
        session.execute(text("INSERT INTO orders (id, total) VALUES ('o-1', 1)"))
        with pytest.raises(ValueError, match="schedule_run_id 'ghost' does not exist"):
            outbox.enqueue_dispatch(session, kind="k", deliver_to="x", schedule_run_id="ghost")
        outbox.enqueue_dispatch(session, kind="k", deliver_to="x")
    sa_engine.dispose()
    assert raw.counts() == (1, 1) and raw.scalar("SELECT COUNT(*) FROM orders") == 1


def test_a_keyed_enqueue_on_an_autocommit_sqlalchemy_connection_is_one_transaction(
    app: Any, engine: str, db_target: str, raw: RawDB
) -> None:
    from sqlalchemy import create_engine

    sa_engine = create_engine(sqlalchemy_url(engine, db_target), isolation_level="AUTOCOMMIT")
    with sa_engine.connect() as connection:
        first = outbox.enqueue_dispatch(connection, kind="k", deliver_to="x", ordering_key="o-7")
        with pytest.raises(ValueError, match="schedule_run_id 'ghost' does not exist"):
            outbox.enqueue_dispatch(
                connection, kind="k", deliver_to="x", ordering_key="o-7", schedule_run_id="ghost"
            )
        second = outbox.enqueue_dispatch(connection, kind="k", deliver_to="x", ordering_key="o-7")
    sa_engine.dispose()
    assert raw.counts() == (2, 2)  # the failed one left nothing
    assert [raw.row(i)["key_seq"] for i in (first, second)] == [1, 2]


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])  # asyncio SQLAlchemy runs on asyncio
async def test_an_asyncio_sqlalchemy_session_enqueues_through_run_sync(
    app: Any, engine: str, db_target: str, raw: RawDB
) -> None:
    from sqlalchemy import text
    from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine

    sa_engine = create_async_engine(sqlalchemy_url(engine, db_target, asyncio=True))
    async with AsyncSession(sa_engine) as session, session.begin():
        await session.execute(text("INSERT INTO orders (id, total) VALUES ('o-1', 1)"))
        kept = await session.run_sync(
            lambda sync_session: outbox.enqueue_dispatch(
                sync_session, kind="order.created", deliver_to="billing"
            )
        )
    async with AsyncSession(sa_engine) as session:
        await session.run_sync(
            lambda sync_session: outbox.enqueue_dispatch(sync_session, kind="x", deliver_to="y")
        )
        await session.rollback()
    await sa_engine.dispose()
    assert [row["id"] for row in raw.rows("SELECT id FROM dispatch_outbox")] == [kept]
    assert raw.counts() == (1, 1)


# -- a store's own unit of work ------------------------------------------------------------


@pytest.mark.anyio
async def test_a_whole_transaction_as_one_unit_of_the_group_commit(
    db_target: str, raw: RawDB
) -> None:
    async with open_store(db_target) as db:
        hops = db.stats["hops"]  # type: ignore[attr-defined]

        def place_order(conn: Any) -> str:
            conn.execute("INSERT INTO sessions (id, created_at) VALUES (?, ?)", ("s-1", 1.0))
            return outbox.enqueue_dispatch(conn, kind="k", deliver_to="x", session_id="s-1")

        dispatch_id = await db.write(place_order)
        assert db.stats["hops"] - hops == 1  # type: ignore[attr-defined]  # one hop, commit too
    assert raw.row(dispatch_id)["session_id"] == "s-1" and raw.counts() == (1, 1)


# -- PostgreSQL: every error on a warm connection, and pipeline mode ---------------------


def hold_dedup_key(target: str, key: str) -> Any:
    """Another transaction holding ``key``, uncommitted: a same-key insert
    waits for it."""
    holder = connect("postgres", target)
    outbox.enqueue_dispatch(holder, kind="k", deliver_to="holder", dedup_key=key)
    return holder


def fail_an_enqueue(app: Any, failure: str) -> None:
    """An enqueue that fails in the server, the connection already warm."""
    import psycopg

    if failure == "missing schema":  # the caller's search_path points elsewhere
        app.execute("SET search_path TO somewhere_else")
        with pytest.raises(SchemaError, match="install_schema"):
            outbox.enqueue_dispatch(app, kind="k", deliver_to="lost")
        app.execute("SET search_path TO DEFAULT")
    else:  # the key is held by another transaction longer than the caller waits
        app.execute("SET lock_timeout = '50ms'")
        with pytest.raises(psycopg.errors.LockNotAvailable):
            outbox.enqueue_dispatch(app, kind="k", deliver_to="lost", dedup_key="held")
        app.execute("SET lock_timeout = DEFAULT")


@pytest.mark.postgres_only
@pytest.mark.parametrize("pipeline", [False, True], ids=["plain", "pipeline"])
@pytest.mark.parametrize("failure", ["missing schema", "lock timeout"])
def test_a_failing_enqueue_on_a_warm_connection_leaves_the_callers_transaction_usable(
    app: Any, engine: str, db_target: str, raw: RawDB, failure: str, pipeline: bool
) -> None:
    holder = hold_dedup_key(db_target, "held")
    try:
        with app.pipeline() if pipeline else contextlib.nullcontext():
            order(app, engine, "o-1")
            first = outbox.enqueue_dispatch(app, kind="k", deliver_to="warm")
            fail_an_enqueue(app, failure)
            order(app, engine, "o-2")  # the caller's transaction goes on
            second = outbox.enqueue_dispatch(app, kind="k", deliver_to="after")
        app.commit()
    finally:
        holder.rollback()
        holder.close()
    assert raw.scalar("SELECT COUNT(*) FROM orders") == 2
    rows = raw.rows("SELECT id, deliver_to FROM dispatch_outbox ORDER BY deliver_to")
    assert [(r["id"], r["deliver_to"]) for r in rows] == [(second, "after"), (first, "warm")]
    assert raw.counts() == (2, 2)


@pytest.mark.postgres_only
@pytest.mark.parametrize("autocommit", [False, True], ids=["transaction", "autocommit"])
def test_enqueues_inside_the_callers_pipeline_return_the_ids_that_commit(
    engine: str, db_target: str, raw: RawDB, autocommit: bool
) -> None:
    with contextlib.closing(connect(engine, db_target, autocommit=True)) as setup:
        outbox.install_schema(setup)
    conn = connect(engine, db_target, autocommit=autocommit)
    try:
        warm = outbox.enqueue_dispatch(conn, kind="k", deliver_to="warm")
        with conn.pipeline():
            first = outbox.enqueue_dispatch(conn, kind="k", deliver_to="x", dedup_key="d")
            again = outbox.enqueue_dispatch(conn, kind="k", deliver_to="y", dedup_key="d")
            many = outbox.enqueue_many(
                conn,
                [
                    {"kind": "k", "deliver_to": "a"},
                    {"kind": "k", "deliver_to": "b", "dedup_key": "d"},
                    {"kind": "k", "deliver_to": "c", "dedup_key": "e"},
                ],
            )
        if not autocommit:
            conn.commit()
    finally:
        conn.close()
    assert again == first and many[1] == outbox.EnqueueResult(first, True)
    assert not many[0].dedup_hit and not many[2].dedup_hit
    rows = raw.rows("SELECT id, deliver_to FROM dispatch_outbox")
    assert {r["id"]: r["deliver_to"] for r in rows} == {
        warm: "warm",
        first: "x",
        many[0].id: "a",
        many[2].id: "c",
    }
    assert raw.counts() == (4, 4)


@pytest.mark.postgres_only
def test_an_error_queued_in_the_callers_pipeline_is_raised_before_the_enqueue_sends_anything(
    app: Any, engine: str, raw: RawDB, tmp_path: Path
) -> None:
    import psycopg

    trace = tmp_path / "libpq.trace"
    with trace.open("w") as sink:
        app.pgconn.trace(sink.fileno())
        try:
            with pytest.raises(psycopg.errors.DivisionByZero), app.pipeline():
                app.execute("SELECT 1 / 0")
                outbox.enqueue_dispatch(app, kind="k", deliver_to="x")
        finally:
            app.pgconn.untrace()
    sent = trace.read_text()
    assert "1 / 0" in sent and "SAVEPOINT" not in sent and "dispatch_outbox" not in sent
    app.rollback()
    assert raw.counts() == (0, 0)


@pytest.mark.postgres_only
@pytest.mark.parametrize(
    ("extra", "round_trips"),
    [({}, 1), ({"dedup_key": "d"}, 2)],
    ids=["plain", "dedup key"],
)
def test_a_warm_enqueue_takes_one_round_trip_with_its_savepoint(
    app: Any, tmp_path: Path, raw: RawDB, extra: dict[str, str], round_trips: int
) -> None:
    outbox.enqueue_dispatch(app, kind="k", deliver_to="warm")
    trace = tmp_path / "libpq.trace"
    with trace.open("w") as sink:
        app.pgconn.trace(sink.fileno())
        try:
            outbox.enqueue_dispatch(app, kind="k", deliver_to="x", **extra)  # type: ignore[arg-type]
        finally:
            app.pgconn.untrace()
    sent = trace.read_text()
    # SAVEPOINT, the one-statement enqueue (row, history, NOTIFY) and RELEASE
    # go together; a dedup key's insert is read first (a hit returns the
    # first row's id), and RELEASE follows.
    assert sent.count("\tReadyForQuery") == round_trips
    assert "SAVEPOINT trio_dispatch_enqueue" in sent and "RELEASE SAVEPOINT" in sent
    app.commit()
    assert raw.counts() == (2, 2)


@pytest.mark.postgres_only
@pytest.mark.parametrize("pipeline", [False, True], ids=["plain", "pipeline"])
def test_an_insert_that_fails_in_the_one_round_trip_leaves_the_callers_transaction_usable(
    app: Any, engine: str, db_target: str, raw: RawDB, pipeline: bool
) -> None:
    """A plain row's insert is sent unread with the RELEASE; the server
    refuses it (a trigger of the app's): the error is raised by the enqueue,
    and the caller's transaction goes on with nothing of it."""
    import psycopg

    with contextlib.closing(connect(engine, db_target, autocommit=True)) as setup:
        setup.execute(
            "CREATE OR REPLACE FUNCTION refuse() RETURNS trigger LANGUAGE plpgsql AS "
            "$$ BEGIN IF NEW.deliver_to = 'refused' THEN RAISE EXCEPTION 'refused by the app'; "
            "END IF; RETURN NEW; END $$"
        )
        setup.execute("DROP TRIGGER IF EXISTS refuse ON dispatch_outbox")
        setup.execute(
            "CREATE TRIGGER refuse BEFORE INSERT ON dispatch_outbox "
            "FOR EACH ROW EXECUTE FUNCTION refuse()"
        )
    try:
        with app.pipeline() if pipeline else contextlib.nullcontext():
            order(app, engine, "o-1")
            first = outbox.enqueue_dispatch(app, kind="k", deliver_to="before")
            with pytest.raises(psycopg.errors.RaiseException, match="refused by the app"):
                outbox.enqueue_dispatch(app, kind="k", deliver_to="refused")
            order(app, engine, "o-2")
            second = outbox.enqueue_dispatch(app, kind="k", deliver_to="after")
        app.commit()
    finally:
        with contextlib.closing(connect(engine, db_target, autocommit=True)) as setup:
            setup.execute("DROP TRIGGER refuse ON dispatch_outbox")
            setup.execute("DROP FUNCTION refuse()")
    assert raw.scalar("SELECT COUNT(*) FROM orders") == 2
    rows = raw.rows("SELECT id, deliver_to FROM dispatch_outbox ORDER BY deliver_to")
    assert [(r["id"], r["deliver_to"]) for r in rows] == [(second, "after"), (first, "before")]
    assert raw.counts() == (2, 2)


@pytest.mark.postgres_only
def test_an_sqlalchemy_session_on_psycopg_enqueues_in_one_round_trip(
    app: Any, engine: str, db_target: str, raw: RawDB, tmp_path: Path
) -> None:
    from sqlalchemy import create_engine
    from sqlalchemy.orm import Session

    sa_engine = create_engine(sqlalchemy_url(engine, db_target))
    trace = tmp_path / "libpq.trace"
    try:
        with Session(sa_engine) as session:
            outbox.enqueue_dispatch(session, kind="k", deliver_to="warm")
            driver: Any = session.connection().connection.driver_connection
            with trace.open("w") as sink:
                driver.pgconn.trace(sink.fileno())
                try:
                    kept = outbox.enqueue_dispatch(session, kind="k", deliver_to="x")
                finally:
                    driver.pgconn.untrace()
            session.commit()
        # The enqueue as a Connection's first statement: SQLAlchemy's own
        # transaction holds it, so its rollback undoes it.
        with sa_engine.connect() as connection:
            outbox.enqueue_dispatch(connection, kind="k", deliver_to="rolled back")
            connection.rollback()
    finally:
        sa_engine.dispose()
    assert trace.read_text().count("\tReadyForQuery") == 1
    assert kept in {row["id"] for row in raw.rows("SELECT id FROM dispatch_outbox")}
    assert raw.counts() == (2, 2)
