"""Stores: where dispatches live. :func:`open_store` picks the engine."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from .base import Conn, Database, Row, Store, Transaction
from .postgres import PostgresStore
from .sqlite import (
    DEFAULT_BUSY_TIMEOUT_SECONDS,
    DURABILITIES,
    Durability,
    SchemaError,
    SQLiteStore,
    sqlite_path_from_target,
)

__all__ = [
    "DURABILITIES",
    "Conn",
    "Database",
    "Durability",
    "PostgresStore",
    "Row",
    "SQLiteStore",
    "SchemaError",
    "Store",
    "Transaction",
    "open_store",
]


@asynccontextmanager
async def open_store(
    target: str | os.PathLike[str],
    *,
    durability: Durability = "full",
    busy_timeout: float = DEFAULT_BUSY_TIMEOUT_SECONDS,
) -> AsyncIterator[Store]:
    """Open (creating or migrating forward) the store that ``target`` names
    and close it when the block exits.

    ``target`` is a SQLite file path, ``":memory:"``, or a URL:
    ``sqlite:///relative.db``, ``sqlite:////absolute.db``, or
    ``postgresql://user@host/db`` (needs the ``postgres`` extra).
    ``durability`` is ``"full"`` (a commit survives power loss) or
    ``"normal"`` (it survives a process crash; PostgreSQL:
    ``synchronous_commit=off``). ``busy_timeout`` is how long a write waits
    for another process's lock (PostgreSQL: ``lock_timeout``). Raises
    ``ValueError`` for a target or option it cannot use, naming it, before
    touching any file.
    """
    if durability not in DURABILITIES:
        raise ValueError(f"durability must be one of {DURABILITIES}, got {durability!r}")
    if isinstance(busy_timeout, bool) or not isinstance(busy_timeout, int | float) or not (
        busy_timeout >= 0
    ):
        raise ValueError(f"busy_timeout must be a number of seconds >= 0, got {busy_timeout!r}")
    raw = os.fspath(target)
    if not isinstance(raw, str):
        raise TypeError(f"store target must be a str path or URL, got {target!r}")
    store: SQLiteStore | PostgresStore
    if raw.startswith(("postgresql://", "postgres://")):
        store = PostgresStore(raw, durability=durability, busy_timeout=busy_timeout)
    elif "://" in raw and not raw.startswith("sqlite://"):
        raise ValueError(
            f"unsupported store URL {raw!r}: use a file path, ':memory:', sqlite:///path "
            "or postgresql://..."
        )
    else:
        store = SQLiteStore(
            sqlite_path_from_target(raw), durability=durability, busy_timeout=busy_timeout
        )
    try:
        await store._open()
    except BaseException:
        store._stop_writer_thread()
        raise
    try:
        yield store
    finally:
        await store.aclose()
