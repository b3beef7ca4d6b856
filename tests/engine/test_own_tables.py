"""The outbox's tables beside a service's own (issue: a service's own
``sessions`` table): an existing ``sessions``/``schedule_runs`` table the
foreign keys cannot point at is refused by ``open_store``,
``sync.install_schema`` and ``trio-dispatch migrate`` before anything is
created, one that fits is adopted; on PostgreSQL a schema of the outbox's
own keeps every table apart from the service's."""

from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Any, cast

import anyio
import pytest

from trio_dispatch import Delivery, DispatchWorker, enqueue_dispatch, open_store
from trio_dispatch import sync as outbox
from trio_dispatch.outbox import list_dispatches
from trio_dispatch.store import SchemaError
from trio_dispatch.store.dialect import POSTGRES, SQLITE
from trio_dispatch.store.schema import OWN_TABLES, statements

from ..helpers import assert_one_line_error, run_cli, wait_for


def connect(engine: str, target: str, *, autocommit: bool = False) -> Any:
    if engine == "sqlite":
        return sqlite3.connect(target, isolation_level=None if autocommit else "DEFERRED")
    import psycopg

    return psycopg.connect(target, autocommit=autocommit)


def run(engine: str, target: str, *statements: str) -> None:
    conn = connect(engine, target, autocommit=True)
    try:
        for statement in statements:
            conn.execute(statement)
    finally:
        conn.close()


def tables(engine: str, target: str) -> set[str]:
    """Every table and view in the database, schema-qualified on PostgreSQL."""
    conn = connect(engine, target, autocommit=True)
    try:
        if engine == "sqlite":
            query = "SELECT name FROM sqlite_master WHERE type IN ('table', 'view')"
        else:
            query = (
                "SELECT table_schema || '.' || table_name FROM information_schema.tables "
                "WHERE table_schema NOT IN ('pg_catalog', 'information_schema')"
            )
        return {str(row[0]) for row in conn.execute(query).fetchall()}
    finally:
        conn.close()


async def open_and_close(target: str, **options: Any) -> None:
    async with open_store(target, **options):
        pass


def install(engine: str, target: str) -> None:
    """``sync.install_schema`` on a caller's connection; the caller's
    transaction stays usable after a refusal."""
    conn = connect(engine, target)
    try:
        with pytest.raises(SchemaError) as info:
            outbox.install_schema(conn)
        conn.execute("SELECT 1")  # still usable
        conn.rollback()
        raise info.value
    finally:
        conn.close()


# A service's own table of a name the outbox uses, and what the refusal names.
INCOMPATIBLE = {
    "no id": ("sessions", "CREATE TABLE sessions (name TEXT)", 'has no "id" column'),
    "an id without a key": ("sessions", "CREATE TABLE sessions (id TEXT)", 'unique "id"'),
    "an id in a composite key": (
        "schedule_runs",
        "CREATE TABLE schedule_runs (id TEXT, part INTEGER, PRIMARY KEY (id, part))",
        'unique "id"',
    ),
    "a partial unique index": (
        "sessions",
        "CREATE TABLE sessions (id TEXT, live INTEGER); "
        "CREATE UNIQUE INDEX sessions_live ON sessions (id) WHERE live = 1",
        'unique "id"',
    ),
    "a view": ("sessions", "CREATE VIEW sessions AS SELECT 'x' AS id", "is a view, not a table"),
}


@pytest.mark.slow
@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["trio"])  # what is checked is the database's
@pytest.mark.parametrize("via", ["open_store", "install_schema", "migrate"])
@pytest.mark.parametrize("case", list(INCOMPATIBLE))
async def test_an_existing_table_the_foreign_keys_cannot_use_is_refused_before_anything_is_created(
    engine: str, fresh_target: str, via: str, case: str
) -> None:
    table, ddl, lacks = INCOMPATIBLE[case]
    run(engine, fresh_target, *ddl.split("; "))
    before, state = tables(engine, fresh_target), file_state(engine, fresh_target)
    if via == "migrate":
        done = await anyio.to_thread.run_sync(lambda: run_cli("--db", fresh_target, "migrate"))
        line = assert_one_line_error(done, 2, f'table "{table}" exists but', lacks)
    else:
        with pytest.raises(SchemaError) as info:
            if via == "open_store":
                await open_and_close(fresh_target)
            else:
                await anyio.to_thread.run_sync(install, engine, fresh_target)
        line = str(info.value)
        assert "\n" not in line and f'table "{table}" exists but' in line and lacks in line
    assert "of its own" in line and (engine == "sqlite" or "schema" in line)
    assert tables(engine, fresh_target) == before  # nothing of the outbox
    assert file_state(engine, fresh_target) == state  # the file as it was (journal mode too)


@pytest.mark.postgres_only
@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["trio"])
async def test_an_id_that_is_not_text_is_refused_on_postgres(fresh_target: str) -> None:
    run("postgres", fresh_target, "CREATE TABLE sessions (id BIGINT PRIMARY KEY)")
    expected = r'"sessions" exists but has an "id" column of type bigint, not text'
    with pytest.raises(SchemaError, match=expected):
        await open_and_close(fresh_target)
    assert tables("postgres", fresh_target) == {"public.sessions"}


SERVICE_SESSIONS = {
    "its id the primary key": "CREATE TABLE sessions (id TEXT PRIMARY KEY, user_name TEXT)",
    # Another primary key, and id unique beside it.
    "its id unique beside another key": (
        "CREATE TABLE sessions (n INTEGER PRIMARY KEY, id VARCHAR(64) NOT NULL UNIQUE, "
        "user_name TEXT)"
    ),
}


def file_state(engine: str, target: str) -> tuple[bytes, str] | None:
    """A SQLite file's bytes and journal mode (None on PostgreSQL)."""
    if engine != "sqlite":
        return None
    conn = sqlite3.connect(f"file:{target}?mode=ro", uri=True)
    try:
        mode = str(conn.execute("PRAGMA journal_mode").fetchone()[0])
    finally:
        conn.close()
    return Path(target).read_bytes(), mode


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["trio"])  # what is checked is the database's
@pytest.mark.parametrize("via", ["open_store", "install_schema", "migrate"])
@pytest.mark.parametrize("case", list(SERVICE_SESSIONS))
async def test_a_sessions_table_of_the_service_s_own_is_never_adopted(
    engine: str, fresh_target: str, via: str, case: str
) -> None:
    # Adopted, it became the target of dispatch_outbox.session_id, and the
    # service could no longer delete a session a dispatch named.
    run(engine, fresh_target, SERVICE_SESSIONS[case])
    run(
        engine,
        fresh_target,
        "INSERT INTO sessions (n, id) VALUES (7, 's-1')"
        if "n INTEGER" in SERVICE_SESSIONS[case]
        else "INSERT INTO sessions (id) VALUES ('s-1')",
    )
    before, state = tables(engine, fresh_target), file_state(engine, fresh_target)
    if via == "migrate":
        done = await anyio.to_thread.run_sync(lambda: run_cli("--db", fresh_target, "migrate"))
        line = assert_one_line_error(done, 2, 'table "sessions" exists without the outbox')
    else:
        with pytest.raises(SchemaError) as info:
            if via == "open_store":
                await open_and_close(fresh_target)
            else:
                await anyio.to_thread.run_sync(install, engine, fresh_target)
        line = str(info.value)
        assert "\n" not in line and 'table "sessions" exists without the outbox' in line
    assert "dispatch_outbox.session_id" in line
    if engine == "sqlite":
        assert "a database file of its own" in line and "schema" not in line
    elif via == "install_schema":  # a connection of the caller's own has no store option
        assert (
            "on this connection CREATE SCHEMA outbox and SET search_path TO outbox, public" in line
        )
    else:
        assert "the store option schema" in line and "SET search_path TO outbox, public" in line
    # Nothing of the outbox, and the file as it was: not even put in WAL mode.
    assert tables(engine, fresh_target) == before
    assert file_state(engine, fresh_target) == state
    run(engine, fresh_target, "DELETE FROM sessions WHERE id = 's-1'")


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["trio"])
async def test_a_sessions_table_an_existing_outbox_points_at_stays_in_use(
    engine: str, fresh_target: str
) -> None:
    """A store made before the outbox refused a service's own table (its
    outbox adopted it): it still opens, and its keys still hold."""
    run(engine, fresh_target, SERVICE_SESSIONS["its id the primary key"])
    run(engine, fresh_target, "INSERT INTO sessions (id, user_name) VALUES ('s-1', 'ada')")
    dialect = SQLITE if engine == "sqlite" else POSTGRES
    run(engine, fresh_target, *map(dialect.ddl, statements(1)))  # version 1, no version table
    async with open_store(fresh_target) as db:
        await enqueue_dispatch(db, kind="k", deliver_to="x", session_id="s-1")
        with pytest.raises(ValueError, match="session_id 'ghost' does not exist"):
            await enqueue_dispatch(db, kind="k", deliver_to="x", session_id="ghost")
    conn = connect(engine, fresh_target)
    try:
        outbox.install_schema(conn)  # idempotent on it too
        conn.commit()
    finally:
        conn.close()


# -- PostgreSQL: a schema of the outbox's own ------------------------------------------------


def public_sessions_of_the_service(target: str) -> None:
    run(
        "postgres",
        target,
        "CREATE TABLE sessions (name TEXT, started TIMESTAMPTZ)",
        "INSERT INTO sessions (name) VALUES ('the service''s own')",
    )


@pytest.mark.postgres_only
@pytest.mark.anyio
@pytest.mark.parametrize("how", ["option", "url"])
async def test_a_schema_of_its_own_holds_every_table_and_a_worker_delivers_from_it(
    fresh_target: str, how: str
) -> None:
    public_sessions_of_the_service(fresh_target)  # an incompatible table in public
    target, schema = fresh_target, cast("str | None", "outbox_x")
    if how == "url":
        target, schema = f"{fresh_target}?options=-csearch_path%3Doutbox_x", None
    delivered: list[str] = []

    async def send(delivery: Delivery) -> None:
        delivered.append(delivery.dispatch_id)

    async with open_store(target, schema=schema) as db, anyio.create_task_group() as tg:
        await tg.start(DispatchWorker(db, transport=send, tick_seconds=3600).run)
        dispatch_id = await enqueue_dispatch(db, kind="k", deliver_to="x", dedup_key="d")
        assert await enqueue_dispatch(db, kind="k", deliver_to="x", dedup_key="d") == dispatch_id
        await wait_for(lambda: delivered, timeout=30)
        tg.cancel_scope.cancel()
    assert delivered == [dispatch_id]
    assert tables("postgres", fresh_target) == {"public.sessions"} | {
        f"outbox_x.{table}" for table in OWN_TABLES
    }
    conn = connect("postgres", fresh_target, autocommit=True)
    try:
        status = conn.execute("SELECT status FROM outbox_x.dispatch_outbox").fetchall()
        assert status == [("delivered",)]
        assert conn.execute("SELECT name FROM public.sessions").fetchall() == [
            ("the service's own",)
        ]
    finally:
        conn.close()


@pytest.mark.postgres_only
def test_migrate_and_the_read_commands_use_the_configured_schema(
    fresh_target: str, tmp_path: Path
) -> None:
    public_sessions_of_the_service(fresh_target)
    config = tmp_path / "trio-dispatch.yaml"
    config.write_text(f"store: {fresh_target}\nschema: outbox_y\n")
    done = run_cli("--config", str(config), "check-config")
    assert done.returncode == 0 and "schema outbox_y" in done.stdout, done
    done = run_cli("--config", str(config), "migrate")
    assert done.returncode == 0, done.stderr
    assert "schema outbox_y" in done.stdout
    assert {t for t in tables("postgres", fresh_target) if t.startswith("outbox_y.")} == {
        f"outbox_y.{table}" for table in OWN_TABLES
    }
    conn = connect("postgres", fresh_target)
    try:
        conn.execute("SET search_path TO outbox_y")  # a caller's own connection
        dispatch_id = outbox.enqueue_dispatch(conn, kind="k", deliver_to="x")
        conn.commit()
    finally:
        conn.close()
    done = run_cli("--config", str(config), "ls")
    assert done.returncode == 0 and dispatch_id in done.stdout, done
    # Without the schema the same database has no outbox (public's sessions
    # is the service's), and the read commands say so.
    assert_one_line_error(run_cli("--db", fresh_target, "ls"), 2, "trio-dispatch migrate")
    url = f"{fresh_target}?options=-csearch_path%3Doutbox_y"
    done = run_cli("--db", url, "ls")
    assert done.returncode == 0 and dispatch_id in done.stdout, done


@pytest.mark.postgres_only
@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["trio"])
async def test_the_refusal_s_fix_on_a_connection_of_one_s_own_keeps_the_service_s_tables(
    fresh_target: str,
) -> None:
    run(
        "postgres",
        fresh_target,
        SERVICE_SESSIONS["its id the primary key"],
        "CREATE TABLE orders (id TEXT PRIMARY KEY)",
    )
    conn = connect("postgres", fresh_target)
    try:
        with pytest.raises(SchemaError, match="SET search_path TO outbox, public"):
            outbox.install_schema(conn)
        conn.rollback()
        # What the refusal says: a schema of the outbox's own, on the path
        # before the service's, which stays in reach.
        conn.execute("CREATE SCHEMA outbox")
        conn.execute("SET search_path TO outbox, public")
        outbox.install_schema(conn)
        conn.commit()
        conn.execute("SET LOCAL search_path TO outbox, public")
        conn.execute("INSERT INTO orders (id) VALUES ('o-1')")
        dispatch_id = outbox.enqueue_dispatch(conn, kind="order.created", deliver_to="x")
        conn.commit()
        # The advice this replaces hid the service's own tables.
        conn.execute("SET search_path TO outbox")
        with pytest.raises(Exception, match='relation "orders" does not exist'):
            conn.execute("INSERT INTO orders (id) VALUES ('o-2')")
        conn.rollback()
    finally:
        conn.close()
    async with open_store(fresh_target, schema="outbox") as db:  # the worker's store
        assert [row["id"] for row in await list_dispatches(db)] == [dispatch_id]
    run("postgres", fresh_target, "INSERT INTO public.sessions (id) VALUES ('s-1')")
    run("postgres", fresh_target, "DELETE FROM public.sessions WHERE id = 's-1'")
    assert {t for t in tables("postgres", fresh_target) if t.startswith("public.")} == {
        "public.sessions",
        "public.orders",
    }


@pytest.mark.postgres_only
def test_install_schema_uses_the_callers_search_path(fresh_target: str) -> None:
    public_sessions_of_the_service(fresh_target)
    conn = connect("postgres", fresh_target)
    try:
        conn.execute("SET search_path TO not_there")
        with pytest.raises(SchemaError, match="search_path names no schema that exists"):
            outbox.install_schema(conn)
        conn.rollback()
        conn.execute("CREATE SCHEMA app_outbox")
        conn.execute("SET search_path TO app_outbox")
        outbox.install_schema(conn)
        dispatch_id = outbox.enqueue_dispatch(conn, kind="k", deliver_to="x")
        conn.commit()
    finally:
        conn.close()
    assert {t for t in tables("postgres", fresh_target) if not t.startswith("public.")} == {
        f"app_outbox.{table}" for table in OWN_TABLES
    }
    conn = connect("postgres", fresh_target, autocommit=True)
    try:
        found = conn.execute("SELECT id FROM app_outbox.dispatch_outbox").fetchall()
        assert found == [(dispatch_id,)]
    finally:
        conn.close()


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"schema": "Outbox"}, "schema must be a lowercase identifier"),
        ({"schema": "pg_outbox"}, "schema must be a lowercase identifier"),
        ({"schema": 'x"; DROP TABLE t; --'}, "schema must be a lowercase identifier"),
    ],
)
@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["trio"])
async def test_a_schema_name_the_outbox_cannot_use_is_refused_naming_it(
    engine: str, fresh_target: str, options: dict[str, Any], message: str
) -> None:
    expected = message if engine == "postgres" else "applies to a PostgreSQL store only"
    with pytest.raises(ValueError, match=expected):
        await open_and_close(fresh_target, **options)
    assert tables(engine, fresh_target) == set()


@pytest.mark.postgres_only
@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["trio"])
async def test_a_url_search_path_and_a_schema_that_disagree_are_refused(
    fresh_target: str,
) -> None:
    url = f"{fresh_target}?options=-c%20search_path%3Da_one,public"
    with pytest.raises(ValueError, match="'b_one' and the URL's search_path 'a_one'"):
        await open_and_close(url, schema="b_one")
    with pytest.raises(ValueError, match=r"the URL's search_path .* got '\$user'"):
        await open_and_close(f"{fresh_target}?options=-csearch_path%3D%22%24user%22")
    assert tables("postgres", fresh_target) == set()
