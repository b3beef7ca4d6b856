"""Coalescing (docs/controls.md) on a caller's own connection, on both
engines: sqlite3 and psycopg in each transaction mode, and SQLAlchemy
sessions and autocommit connections. The supersede commits or rolls back
with the caller's writes, and an enqueue that fails after it leaves the
caller's transaction usable with nothing of it in."""

from __future__ import annotations

import sqlite3
from typing import Any

import pytest

from trio_dispatch import EnqueuedId
from trio_dispatch import sync as outbox

from ..conftest import RawDB
from .test_sync import sqlalchemy_url

T0 = 1_000_000.0
REPLACE: dict[str, Any] = {
    "kind": "k",
    "deliver_to": "x",
    "coalesce_key": "k",
    "coalesce": "replace",
}


def outcome(dispatch_id: str) -> str:
    assert isinstance(dispatch_id, EnqueuedId)
    return dispatch_id.outcome


def waiting(raw: RawDB) -> list[str]:
    return [
        str(row["id"])
        for row in raw.rows(
            "SELECT id FROM dispatch_outbox WHERE coalesce_key = 'k' AND status = 'pending'"
        )
    ]


def _connect(engine: str, target: str, mode: str) -> Any:
    """A connection of the caller's: ``implicit`` (the driver begins a
    transaction at the first write), ``explicit`` (the caller began one) or
    ``autocommit``."""
    if engine == "sqlite":
        own = (
            sqlite3.connect(target)
            if mode == "implicit"
            else sqlite3.connect(target, isolation_level=None)
        )
        if mode == "explicit":
            own.execute("BEGIN IMMEDIATE")
        return own
    import psycopg

    conn = psycopg.connect(target, autocommit=mode == "autocommit")
    if mode == "explicit":
        conn.execute("SELECT 1")  # psycopg begins the transaction
    return conn


@pytest.mark.parametrize("mode", ["implicit", "explicit"])
def test_a_rolled_back_transaction_supersedes_nothing(
    engine: str, db_target: str, raw: RawDB, mode: str
) -> None:
    setup = _connect(engine, db_target, "autocommit")
    outbox.install_schema(setup)
    first = outbox.enqueue_dispatch(setup, **REPLACE, now=T0)  # commits at once
    setup.close()
    assert waiting(raw) == [first]
    conn = _connect(engine, db_target, mode)
    try:
        second = outbox.enqueue_dispatch(conn, **REPLACE, now=T0 + 1)
        assert outcome(second) == "replaced"
        with pytest.raises(ValueError, match="session_id 'ghost'"):
            outbox.enqueue_many(
                conn, [REPLACE, {"kind": "k", "deliver_to": "x", "session_id": "ghost"}]
            )
        assert waiting(raw) == [first]  # nothing committed yet
        conn.rollback()
        assert waiting(raw) == [first] and raw.row(first)["status"] == "pending"
        if mode == "explicit" and engine == "sqlite":
            conn.execute("BEGIN IMMEDIATE")
        third = outbox.enqueue_dispatch(conn, **REPLACE, now=T0 + 2)
        conn.commit()
        assert waiting(raw) == [third] and raw.row(first)["status"] == "superseded"
        assert raw.counts() == (2, 3)  # the rolled-back rows left nothing
    finally:
        conn.close()


def test_on_an_autocommit_connection_each_enqueue_commits_supersede_and_row_together(
    engine: str, db_target: str, raw: RawDB
) -> None:
    conn = _connect(engine, db_target, "autocommit")
    try:
        outbox.install_schema(conn)
        first = outbox.enqueue_dispatch(conn, **REPLACE, now=T0)
        with pytest.raises(ValueError, match="schedule_run_id 'ghost'"):
            outbox.enqueue_many(
                conn, [REPLACE, {"kind": "k", "deliver_to": "x", "schedule_run_id": "ghost"}]
            )
        assert waiting(raw) == [first]
        second = outbox.enqueue_dispatch(conn, **REPLACE, now=T0 + 1)
        assert waiting(raw) == [second] and raw.row(first)["status"] == "superseded"
    finally:
        conn.close()


@pytest.mark.parametrize("autocommit", [False, True])
def test_an_sqlalchemy_connection_supersedes_with_its_transaction(
    engine: str, db_target: str, raw: RawDB, autocommit: bool
) -> None:
    from sqlalchemy import create_engine
    from sqlalchemy.orm import Session

    setup = _connect(engine, db_target, "autocommit")
    outbox.install_schema(setup)
    setup.close()
    options = {"isolation_level": "AUTOCOMMIT"} if autocommit else {}
    sa_engine = create_engine(sqlalchemy_url(engine, db_target), **options)
    try:
        with sa_engine.connect() as connection:
            first = outbox.enqueue_dispatch(connection, **REPLACE, now=T0)
            if not autocommit:
                connection.commit()
            assert waiting(raw) == [first]
        if autocommit:
            with sa_engine.connect() as connection:
                second = outbox.enqueue_dispatch(connection, **REPLACE, now=T0 + 1)
            assert waiting(raw) == [second]
            return
        with Session(sa_engine) as session:
            assert outcome(outbox.enqueue_dispatch(session, **REPLACE, now=T0 + 1)) == "replaced"
            with pytest.raises(ValueError, match="session_id 'ghost'"):
                outbox.enqueue_dispatch(session, **REPLACE, session_id="ghost")
            session.rollback()
        assert waiting(raw) == [first]
        with Session(sa_engine) as session, session.begin():
            third = outbox.enqueue_dispatch(session, **REPLACE, now=T0 + 2)
        assert waiting(raw) == [third] and raw.row(first)["status"] == "superseded"
    finally:
        sa_engine.dispose()
