"""The unit tier opens no database: a test here that reaches for SQLite or
PostgreSQL fails at once, naming the tier it belongs to instead."""

from __future__ import annotations

import sqlite3
from typing import Any, NoReturn

import pytest


def _refuse(*args: Any, **kwargs: Any) -> NoReturn:
    raise AssertionError(
        "a unit test opened a database: move it to tests/engine or tests/integration"
    )


@pytest.fixture(autouse=True)
def _no_database(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sqlite3, "connect", _refuse)
    try:
        import psycopg
    except ImportError:
        return
    monkeypatch.setattr(psycopg.Connection, "connect", classmethod(_refuse))
    monkeypatch.setattr(psycopg.AsyncConnection, "connect", classmethod(_refuse))
