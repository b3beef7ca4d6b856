"""Fixtures: both anyio backends, and both engines.

A test that takes ``store``, ``raw`` or ``db_target`` runs on SQLite (a real
file) and on PostgreSQL (a throwaway database on the local server, created
for the run and dropped after it; tables emptied between tests). Mark a test
or module ``sqlite_only`` when what it checks is SQLite's own. Without a
PostgreSQL server the postgres cases skip, except under CI, where they fail.
Outside CI, an async test on both engines runs as trio-sqlite and
asyncio-postgres only (:func:`pytest_collection_modifyitems`).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sqlite3
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from trio_dispatch import open_store, redact
from trio_dispatch.store import SQLiteStore

from . import hypothesis_profiles  # noqa: F401  (registers and loads the profile)

POSTGRES_ADMIN_URL = os.environ.get(
    "TRIO_DISPATCH_TEST_POSTGRES", "postgresql://postgres@127.0.0.1:5432/postgres"
)
TABLES = (
    "dispatch_outbox",
    "status_transitions",
    "sessions",
    "schedule_runs",
    "dispatch_schedules",
    "dispatch_destinations",
    "dispatch_destination_changes",
    "dispatch_destination_holds",
    "dispatch_settings",
)
_SHARED: dict[str, Any] = {}
"""The run's database (``postgres_url``) -> the one autocommit connection
this process's :class:`PostgresRaw` reads and writes it through (None until
first used). A connection costs the server a new backend process (3 ms and
a fork; more under load), and ``wait_for`` polls raw reads every 10 ms."""
_MIGRATED: list[Path] = []
"""This process's SQLite file as the store creates it, once made."""


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "sqlite_only: runs on the SQLite engine only")
    config.addinivalue_line("markers", "postgres_only: runs on the PostgreSQL engine only")
    config.addinivalue_line(
        "markers",
        "every_pair: outside CI too, runs on all four backend/engine pairs, not only on the "
        "diagonal (trio-sqlite, asyncio-postgres) that the loop keeps of other such tests",
    )


DIAGONAL = {("trio", "sqlite"), ("asyncio", "postgres")}
"""The (backend, engine) pairs the loop keeps of a test that runs on all four."""


@pytest.hookimpl(tryfirst=True)  # before -m deselects by the markers
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """A test that runs on both backends and both engines has its two pairs
    off the diagonal marked slow, so the loop run after every change covers
    each engine and each backend once a test and CI runs all four. The
    store does its work on a thread of its own and hands results to either
    event loop the same way (``trio_dispatch._threads``), so what a backend
    changes and what an engine changes meet in few places (an engine's
    listener waits in the event loop); a test of one of them is marked
    ``every_pair`` and keeps its four pairs in the loop. A test on one
    engine keeps both backends; one on one backend keeps both engines."""
    pairs: dict[str, set[tuple[Any, Any]]] = {}
    for item in items:
        pair = _pair(item)
        if None not in pair:
            pairs.setdefault(item.nodeid.split("[", 1)[0], set()).add(pair)
    for item in items:
        pair = _pair(item)
        if (
            pair not in DIAGONAL
            and len(pairs.get(item.nodeid.split("[", 1)[0], ())) == 4
            and item.get_closest_marker("every_pair") is None
        ):
            item.add_marker(pytest.mark.slow)


def _pair(item: pytest.Item) -> tuple[Any, Any]:
    """(backend, engine) of a test's parametrization (None where it has none)."""
    params = getattr(getattr(item, "callspec", None), "params", {})
    return params.get("anyio_backend"), params.get("engine")


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "engine" in metafunc.fixturenames:
        engines = ["sqlite", "postgres"]
        if metafunc.definition.get_closest_marker("sqlite_only"):
            engines = ["sqlite"]
        elif metafunc.definition.get_closest_marker("postgres_only"):
            engines = ["postgres"]
        metafunc.parametrize("engine", engines, indirect=True)


@pytest.fixture(autouse=True)
def _secrets_of_this_test(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test starts with no registered secrets: the registry is per
    process, and one test's short secret (``?token=abc``) would otherwise
    mask pieces of another test's dispatch ids in its log lines."""
    monkeypatch.setattr(redact, "_known", set())


@pytest.fixture(autouse=True, scope="session")
def _system_cas_loaded_once() -> Iterator[None]:
    """A webhook transport verifying with the system's CAs (``verify=True``,
    the default) has httpx load the CA bundle, 20-40 ms, and a run builds
    some 140 transports: each process loads it once here and every such
    transport gets that context, as a long-running worker's one transport
    would (a CA file or a context of the caller's own is used as given)."""
    import httpx

    make = httpx.create_ssl_context
    system: list[Any] = []

    def once(*args: Any, **kwargs: Any) -> Any:
        if args or kwargs != {"trust_env": False}:  # not tls_context's call
            return make(*args, **kwargs)
        if not system:
            system.append(make(trust_env=False))
        return system[0]

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(httpx, "create_ssl_context", once)
        yield


@pytest.fixture
def spans() -> Iterator[Any]:
    """An in-memory span exporter that receives this test's spans
    (docs/tracing.md): a tracer provider of the test's own, never the global one,
    which a process can set only once."""
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from trio_dispatch import tracing

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracing.use_tracer_provider(provider)
    try:
        yield exporter
    finally:
        tracing.use_tracer_provider(None)
        provider.shutdown()


@pytest.fixture(params=["trio", "asyncio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    """Every ``@pytest.mark.anyio`` test runs once on each backend."""
    return str(request.param)


@pytest.fixture
def engine(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(scope="session")
def postgres_url() -> Iterator[str | None]:
    """A database created for this run on the local PostgreSQL server (None
    if no server answers), dropped at the end."""
    try:
        import psycopg
    except ImportError:
        yield None
        return
    name = f"trio_dispatch_test_{uuid.uuid4().hex[:12]}"
    try:
        with psycopg.connect(POSTGRES_ADMIN_URL, autocommit=True, connect_timeout=3) as admin:
            admin.execute(f'CREATE DATABASE "{name}"')
    except psycopg.OperationalError:
        yield None
        return
    base = POSTGRES_ADMIN_URL.rsplit("/", 1)[0]
    url = f"{base}/{name}"
    _SHARED[url] = None
    yield url
    shared = _SHARED.pop(url)
    if shared is not None:
        shared.close()
    with psycopg.connect(POSTGRES_ADMIN_URL, autocommit=True) as admin:
        admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture
def db_path(tmp_path: Path) -> Path:
    """A real SQLite file for the test."""
    return tmp_path / "outbox.db"


@pytest.fixture
def db_target(engine: str, db_path: Path, request: pytest.FixtureRequest) -> str:
    """What to pass to ``open_store`` for this test's (empty) database."""
    if engine == "sqlite":
        return str(db_path)
    url = request.getfixturevalue("postgres_url")
    if url is None:
        if os.environ.get("CI"):
            pytest.fail(f"no PostgreSQL server answers at {POSTGRES_ADMIN_URL}")
        pytest.skip(f"no PostgreSQL server answers at {POSTGRES_ADMIN_URL}")
    PostgresRaw(url).empty()
    return str(url)


@pytest.fixture
def fresh_target(engine: str, db_path: Path, request: pytest.FixtureRequest) -> Iterator[str]:
    """A database of this test's alone, with nothing in it: a new SQLite
    file, or a PostgreSQL database created for the test and dropped after
    it (for a test that puts tables of its own where the outbox's go)."""
    if engine == "sqlite":
        yield str(db_path)
        return
    if request.getfixturevalue("postgres_url") is None:
        pytest.skip(f"no PostgreSQL server answers at {POSTGRES_ADMIN_URL}")
    import psycopg

    name = f"trio_dispatch_test_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(POSTGRES_ADMIN_URL, autocommit=True) as admin:
        admin.execute(f'CREATE DATABASE "{name}"')
    try:
        yield f"{POSTGRES_ADMIN_URL.rsplit('/', 1)[0]}/{name}"
    finally:
        with psycopg.connect(POSTGRES_ADMIN_URL, autocommit=True) as admin:
            admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture
async def store(
    engine: str, db_target: str, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[SQLiteStore]:
    """An open store on ``db_target`` (use with ``@pytest.mark.anyio``).
    On SQLite the file starts as a copy of one the store created and
    migrated from nothing, once a process, as each test's PostgreSQL store
    opens the run's database migrated once: migrating a new file took
    10 ms of CPU and a dozen fsyncs a test, a copy takes 1 ms. Creating and
    migrating a store is tested where it is the subject."""
    if engine == "sqlite":
        shutil.copyfile(await _migrated_sqlite(tmp_path_factory), db_target)
    async with open_store(db_target) as db:
        yield db  # type: ignore[misc]


async def _migrated_sqlite(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """This process's SQLite file as the store creates it (made on first use)."""
    if not _MIGRATED:
        path = tmp_path_factory.mktemp("migrated") / "outbox.db"
        async with open_store(str(path)):
            pass
        # Closed by its last connection, the file holds everything: no WAL left.
        assert not path.with_name(path.name + "-wal").exists()
        _MIGRATED.append(path)
    return _MIGRATED[0]


class RawDB:
    """Reads the test's database file through a separate plain sqlite3
    connection: what is committed, not what the store believes."""

    error: type[Exception] | tuple[type[Exception], ...] = sqlite3.DatabaseError
    """What a failed statement raises: the driver's error (on PostgreSQL,
    the store's group commit reports it as a StoreError)."""
    """What a refused write raises."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.target = str(path)

    def rows(self, sql: str, params: tuple[object, ...] = ()) -> list[dict[str, Any]]:
        conn = sqlite3.connect(self.path)
        try:
            conn.row_factory = sqlite3.Row
            return [dict(row) for row in conn.execute(sql, params)]
        finally:
            conn.close()

    def scalar(self, sql: str, params: tuple[object, ...] = ()) -> Any:
        conn = sqlite3.connect(self.path)
        try:
            return conn.execute(sql, params).fetchone()[0]
        finally:
            conn.close()

    def execute(self, sql: str, params: tuple[object, ...] = ()) -> None:
        conn = sqlite3.connect(self.path, isolation_level=None)
        try:
            conn.execute(sql, params)
        finally:
            conn.close()

    def refuse_transitions(
        self, message: str, reason_code: str | None = None, entity_id: str | None = None
    ) -> None:
        """Make inserting a transition (of one reason, of one dispatch) fail,
        as a crash there would."""
        terms = [f"NEW.reason_code = '{reason_code}'"] if reason_code else []
        terms += [f"NEW.entity_id = '{entity_id}'"] if entity_id else []
        when = f"WHEN {' AND '.join(terms)} " if terms else ""
        self.execute(
            f"CREATE TRIGGER refuse BEFORE INSERT ON status_transitions {when}"
            f"BEGIN SELECT RAISE(ABORT, '{message}'); END"
        )

    def allow_transitions(self) -> None:
        self.execute("DROP TRIGGER refuse")

    def refuse_kind(self, kind: str, message: str) -> None:
        """Make inserting a dispatch of ``kind`` fail, as a constraint of the
        database's own would (dropped when the next test empties the store)."""
        self.execute(
            "CREATE TRIGGER refuse_kind BEFORE INSERT ON dispatch_outbox "
            f"WHEN NEW.kind = '{kind}' BEGIN SELECT RAISE(ABORT, '{message}'); END"
        )

    def allow_kinds(self) -> None:
        self.execute("DROP TRIGGER refuse_kind")

    def counts(self) -> tuple[int, int]:
        """(dispatch rows, transition rows)."""
        return (
            int(self.scalar("SELECT COUNT(*) FROM dispatch_outbox")),
            int(self.scalar("SELECT COUNT(*) FROM status_transitions")),
        )

    def row(self, dispatch_id: str) -> dict[str, Any]:
        found = self.rows("SELECT * FROM dispatch_outbox WHERE id = ?", (dispatch_id,))
        assert found, f"no row {dispatch_id}"
        return found[0]

    def transitions(self, dispatch_id: str) -> list[dict[str, Any]]:
        return self.rows(
            "SELECT * FROM status_transitions WHERE entity_id = ? ORDER BY id", (dispatch_id,)
        )


class PostgresRaw(RawDB):
    """The same reads and writes on the test's PostgreSQL database."""

    def __init__(self, url: str) -> None:
        import psycopg

        self.url = self.target = url
        from trio_dispatch.store import StoreError

        self.error = (psycopg.Error, StoreError)

    def _connect(self) -> Any:
        import psycopg
        from psycopg.types.string import TextLoader

        conn = psycopg.connect(self.url, autocommit=True)
        conn.adapters.register_loader("json", TextLoader)
        return conn

    @contextlib.contextmanager
    def _connection(self) -> Iterator[Any]:
        """The run's shared connection on the run's database (made anew if
        the server ended it); on any other database, one of its own."""
        if self.url not in _SHARED:
            with self._connect() as conn:
                yield conn
            return
        conn = _SHARED[self.url]
        if conn is None or conn.broken or conn.closed:
            conn = _SHARED[self.url] = self._connect()
            # Nothing prepared: a plan kept across tests would outlive a
            # test's change to a table.
            conn.prepare_threshold = None
        yield conn

    @staticmethod
    def _sql(sql: str) -> str:
        from trio_dispatch.store.pg_session import placeholders as _placeholders

        return _placeholders(sql)

    def rows(self, sql: str, params: tuple[object, ...] = ()) -> list[dict[str, Any]]:
        from psycopg.rows import dict_row

        with self._connection() as conn, conn.cursor(row_factory=dict_row) as cursor:
            cursor.execute(self._sql(sql), params)
            return list(cursor.fetchall())

    def scalar(self, sql: str, params: tuple[object, ...] = ()) -> Any:
        with self._connection() as conn:
            row = conn.execute(self._sql(sql), params).fetchone()
            return None if row is None else row[0]

    def execute(self, sql: str, params: tuple[object, ...] = ()) -> None:
        with self._connection() as conn:
            conn.execute(self._sql(sql), params)

    def refuse_transitions(
        self, message: str, reason_code: str | None = None, entity_id: str | None = None
    ) -> None:
        terms = [f"NEW.reason_code = '{reason_code}'"] if reason_code else []
        terms += [f"NEW.entity_id = '{entity_id}'"] if entity_id else []
        when = f"WHEN ({' AND '.join(terms)}) " if terms else ""
        self.execute(
            "CREATE OR REPLACE FUNCTION refuse() RETURNS trigger AS $$ BEGIN "
            f"RAISE EXCEPTION '{message}'; END $$ LANGUAGE plpgsql"
        )
        self.execute(
            f"CREATE TRIGGER refuse BEFORE INSERT ON status_transitions FOR EACH ROW {when}"
            "EXECUTE FUNCTION refuse()"
        )

    def allow_transitions(self) -> None:
        self.execute("DROP TRIGGER refuse ON status_transitions")

    def refuse_kind(self, kind: str, message: str) -> None:
        self.execute(
            "CREATE OR REPLACE FUNCTION refuse_kind() RETURNS trigger AS $$ BEGIN "
            f"RAISE EXCEPTION '{message}'; END $$ LANGUAGE plpgsql"
        )
        self.execute(
            "CREATE TRIGGER refuse_kind BEFORE INSERT ON dispatch_outbox FOR EACH ROW "
            f"WHEN (NEW.kind = '{kind}') EXECUTE FUNCTION refuse_kind()"
        )

    def allow_kinds(self) -> None:
        self.execute("DROP TRIGGER refuse_kind ON dispatch_outbox")

    @staticmethod
    def _delete_all(conn: Any) -> None:
        """DELETE (0.2 ms on a test's few rows, where TRUNCATE takes 15 ms
        for its new files); TRUNCATE ... CASCADE only when a table of the
        test's own refers to the outbox's."""
        import psycopg

        try:
            with conn.transaction():
                for table in TABLES:  # referring tables first
                    conn.execute(f"DELETE FROM {table}")
                conn.execute(
                    "SELECT setval(pg_get_serial_sequence('status_transitions', 'id'), 1, false)"
                )
        except psycopg.errors.ForeignKeyViolation:
            conn.execute(f"TRUNCATE {', '.join(TABLES)} RESTART IDENTITY CASCADE")

    def empty(self) -> None:
        """Empty every table (the schema stays; the store re-creates it if absent)."""
        with self._connection() as conn:
            present = {
                r[0]
                for r in conn.execute("SELECT tablename FROM pg_tables WHERE schemaname = 'public'")
            }
            if set(TABLES) <= present:
                self._delete_all(conn)
            conn.execute(
                "DROP TRIGGER IF EXISTS refuse ON status_transitions"
                if "status_transitions" in present
                else "SELECT 1"
            )
            conn.execute(
                "DROP TRIGGER IF EXISTS refuse_kind ON dispatch_outbox"
                if "dispatch_outbox" in present
                else "SELECT 1"
            )


@pytest.fixture
def raw(engine: str, db_target: str, db_path: Path) -> Iterator[RawDB]:
    yield RawDB(db_path) if engine == "sqlite" else PostgresRaw(db_target)
