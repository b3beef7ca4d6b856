from __future__ import annotations

import sqlite3
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from trio_dispatch import open_store
from trio_dispatch.store import SQLiteStore


@pytest.fixture(params=["trio", "asyncio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    """Every ``@pytest.mark.anyio`` test runs once on each backend."""
    return str(request.param)


@pytest.fixture
def db_path(tmp_path: Path) -> Path:
    """A real SQLite file for the test."""
    return tmp_path / "outbox.db"


@pytest.fixture
async def store(db_path: Path) -> AsyncIterator[SQLiteStore]:
    """An open store on ``db_path`` (use with ``@pytest.mark.anyio``)."""
    async with open_store(db_path) as db:
        yield db


class RawDB:
    """Reads the test's database file through a separate plain sqlite3
    connection: what is committed, not what the store believes."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def rows(self, sql: str, params: tuple[object, ...] = ()) -> list[dict[str, object]]:
        conn = sqlite3.connect(self.path)
        try:
            conn.row_factory = sqlite3.Row
            return [dict(row) for row in conn.execute(sql, params)]
        finally:
            conn.close()

    def scalar(self, sql: str, params: tuple[object, ...] = ()) -> object:
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

    def counts(self) -> tuple[int, int]:
        """(dispatch rows, transition rows)."""
        return (
            int(self.scalar("SELECT COUNT(*) FROM dispatch_outbox")),  # type: ignore[call-overload]
            int(self.scalar("SELECT COUNT(*) FROM status_transitions")),  # type: ignore[call-overload]
        )

    def row(self, dispatch_id: str) -> dict[str, object]:
        found = self.rows("SELECT * FROM dispatch_outbox WHERE id = ?", (dispatch_id,))
        assert found, f"no row {dispatch_id}"
        return found[0]

    def transitions(self, dispatch_id: str) -> list[dict[str, object]]:
        return self.rows(
            "SELECT * FROM status_transitions WHERE entity_id = ? ORDER BY id", (dispatch_id,)
        )


@pytest.fixture
def raw(db_path: Path) -> Iterator[RawDB]:
    yield RawDB(db_path)
