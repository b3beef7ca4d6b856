"""Stores: where dispatches live. :func:`open_store` picks the engine.

The engines' connection adapters (:class:`~.sqlite.SQLiteConn`,
:class:`~.pg_session.PostgresConn`) also drive a caller's own connection
for :mod:`trio_dispatch.sync`, borrowed: nothing of its settings changed
(``SQLiteConn(conn, borrowed=True)``,
:class:`~.pg_session.BorrowedPostgresConn`)."""

from __future__ import annotations

import os
import sqlite3
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Unpack

from ..redact import mask_url, one_line, url_secrets
from ..values import show
from .base import (
    DEFAULT_BUSY_TIMEOUT_SECONDS,
    DEFAULT_MAX_BODY_BYTES,
    DURABILITIES,
    MAX_BUSY_TIMEOUT_SECONDS,
    Conn,
    ConnectionLostError,
    Database,
    Durability,
    Row,
    SchemaError,
    Store,
    StoreError,
    StoreOptionArgs,
    StoreOptions,
    Transaction,
    parse_target,
)
from .sqlite import SQLiteStore

if TYPE_CHECKING:
    from .postgres import PostgresStore

__all__ = [
    "DEFAULT_BUSY_TIMEOUT_SECONDS",
    "DEFAULT_MAX_BODY_BYTES",
    "DURABILITIES",
    "MAX_BUSY_TIMEOUT_SECONDS",
    "Conn",
    "ConnectionLostError",
    "Database",
    "Durability",
    "Row",
    "SQLiteStore",
    "SchemaError",
    "Store",
    "StoreError",
    "StoreOptionArgs",
    "StoreOptions",
    "Transaction",
    "open_store",
    "parse_target",
]


def _driver_errors(engine: str) -> tuple[type[BaseException], ...]:
    errors: list[type[BaseException]] = [sqlite3.Error, OSError]
    if engine == "postgres":
        import psycopg

        errors.append(psycopg.Error)
    return tuple(errors)


def _open_error(exc: BaseException, engine: str, location: str, masked: str) -> StoreError:
    """One line saying why the store could not be opened, password-free."""
    text = one_line(exc, url_secrets(location))
    if engine == "sqlite":
        parent = Path(location).absolute().parent
        if "unable to open database file" in text and not parent.is_dir():
            text = f"its directory {str(parent)!r} does not exist"
        elif "file is not a database" in text:
            text = "it is not a SQLite database"
        elif "readonly database" in text:
            text = f"{text} (a read-only file or directory: only read commands can use it)"
    return StoreError(f"cannot open store {masked}: {text}")


@asynccontextmanager
async def open_store(
    target: str | os.PathLike[str],
    options: StoreOptions | None = None,
    **keywords: Unpack[StoreOptionArgs],
) -> AsyncIterator[Store]:
    """Open (creating or migrating forward) the store that ``target`` names
    and close it when the block exits.

    ``options`` (a :class:`StoreOptions`) says how; any option may also be
    given by name as a keyword (``durability="normal"``), which wins.
    ``target`` is a SQLite file path, ``":memory:"``, or a URL:
    ``sqlite:///relative.db``, ``sqlite:////absolute.db``, or
    ``postgresql://user@host/db`` (needs the ``postgres`` extra).
    ``durability`` is ``"full"`` (a commit survives power loss) or
    ``"normal"`` (it survives a process crash; PostgreSQL:
    ``synchronous_commit=off``). ``busy_timeout`` is how long a write waits
    for another process's lock (PostgreSQL: ``lock_timeout``).
    ``network_timeout`` (PostgreSQL) bounds a silent network: a round trip
    with no answer after ``busy_timeout + network_timeout`` seconds fails
    with :class:`ConnectionLostError` and its connection is dropped.
    ``max_body_bytes`` bounds an enqueue's ``body`` (bytes of JSON).

    ``read_only=True`` opens without writing anything (SQLite ``mode=ro``,
    no journal-mode change; PostgreSQL read-only transactions) and never
    creates or migrates: a missing or older schema raises
    :class:`SchemaError` naming ``trio-dispatch migrate``; a write raises
    :class:`StoreError`. ``migrate=False`` opens for writing but likewise
    requires the current schema (and never creates a file). ``snapshot``
    (with ``read_only``, SQLite): each read opens a connection of its own,
    so a database no other connection has open is read without creating
    its ``-wal``/``-shm`` files, and another process's commits are seen by
    the next read.

    ``schema`` (PostgreSQL) is the schema that holds every outbox table: it
    is created if absent (when migrating) and is the ``search_path`` of
    every connection the store opens. A URL's
    ``options=-csearch_path%3Dname`` names it too (the first schema of the
    path). Without either, the tables live where the server's
    ``search_path`` puts them (usually ``public``). A ``sessions`` or
    ``schedule_runs`` table of the service's own where the outbox's foreign
    keys would point is refused (:class:`SchemaError` naming it and the
    fix) before anything is created; a refused SQLite file is left as it
    was (its journal mode too).

    Raises ``ValueError`` for a target or option it cannot use, naming it
    (password masked), before touching any file; :class:`StoreError` (one
    line, password masked) when the database cannot be opened.
    """
    chosen = (options or StoreOptions()).updated(keywords)
    raw = os.fspath(target)
    engine, location = parse_target(raw)
    if chosen.schema is not None and engine != "postgres":
        raise ValueError(
            f"schema {show(chosen.schema)} applies to a PostgreSQL store only, "
            f"not {show(mask_url(raw))}"
        )
    store: SQLiteStore | PostgresStore
    if engine == "postgres":
        from .postgres import PostgresStore  # psycopg is imported only for it

        store = PostgresStore(location, chosen)
    else:
        store = SQLiteStore(location, chosen)
    try:
        await store.open()
    except _driver_errors(engine) as exc:
        raise _open_error(exc, engine, location, mask_url(raw)) from None
    try:
        yield store
    finally:
        await store.aclose()
