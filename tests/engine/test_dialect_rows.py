"""The dialect a connection carries is the one its engine needs, and its
named statements run on a real SQLite file."""

from __future__ import annotations

import pathlib
import sqlite3

import pytest

from trio_dispatch.store.dialect import SQLITE
from trio_dispatch.store.sqlite import SQLiteConn


def test_a_sqlite_connection_carries_the_sqlite_dialect_and_its_queries_run(
    tmp_path: pathlib.Path,
) -> None:
    raw = sqlite3.connect(tmp_path / "t.db")
    try:
        conn = SQLiteConn(raw)
        assert conn.dialect is SQLITE
        raw.execute("CREATE TABLE present (id TEXT PRIMARY KEY)")
        found = conn.query_one(SQLITE.table_exists, ("present",))
        missing = conn.query_one(SQLITE.table_exists, ("absent",))
        assert found is not None and found["found"]
        assert missing is not None and not missing["found"]
    finally:
        raw.close()


def test_the_sync_adapters_take_their_dialect_from_the_connection(
    tmp_path: pathlib.Path,
) -> None:
    from trio_dispatch.sync import _adapt

    raw = sqlite3.connect(tmp_path / "t.db")
    try:
        assert _adapt(raw).conn.dialect is SQLITE
    finally:
        raw.close()
    sqlalchemy = pytest.importorskip("sqlalchemy")
    engine = sqlalchemy.create_engine(f"sqlite:///{tmp_path / 'a.db'}")
    with engine.connect() as connection:
        assert _adapt(connection).conn.dialect is SQLITE
    engine.dispose()
