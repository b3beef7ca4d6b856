"""A key's rows go in the order their enqueues committed, not in the order
of their ids: a producer whose clock is behind (ids are UUIDv7 from the
producer's clock) cannot put its row ahead of one committed before it."""

from __future__ import annotations

import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from trio_dispatch import enqueue_dispatch, open_store
from trio_dispatch.outbox import claim_due, finish_attempt
from trio_dispatch.store import SQLiteStore
from trio_dispatch.transports import TransportResult

from ..conftest import RawDB

pytestmark = pytest.mark.anyio

BEHIND = """
import sys, time
import anyio
real = time.time_ns
# This host's clock is a minute behind: more than its start takes on a
# loaded machine (2 s was not), so its ids sort before the rows before it.
time.time_ns = lambda: real() - 60_000_000_000
from trio_dispatch import enqueue_dispatch, open_store

async def main():
    async with open_store(sys.argv[1]) as db:
        print(await enqueue_dispatch(db, kind="k", deliver_to="x", ordering_key=sys.argv[2]))

anyio.run(main)
"""


def enqueue_from_a_host_whose_clock_is_behind(target: str, key: str) -> str:
    done = subprocess.run(
        [sys.executable, "-c", BEHIND, target, key],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return done.stdout.strip()


async def test_a_key_follows_commit_order_whatever_the_producers_clock(
    store: SQLiteStore, raw: RawDB, db_target: str
) -> None:
    first = await enqueue_dispatch(store, kind="k", deliver_to="x", ordering_key="acct-1")
    second = enqueue_from_a_host_whose_clock_is_behind(db_target, "acct-1")
    third = await enqueue_dispatch(store, kind="k", deliver_to="x", ordering_key="acct-1")
    assert second < first  # its id sorts first: the lagging clock

    delivered: list[str] = []
    for _ in range(3):
        claims, _ = await claim_due(store, lease_seconds=30)
        assert len(claims) == 1, [c.dispatch_id for c in claims]  # one at a time
        delivered.append(claims[0].dispatch_id)
        await finish_attempt(store, claims[0], TransportResult.success())
    assert delivered == [first, second, third]
    assert [raw.row(i)["key_seq"] for i in delivered] == [1, 2, 3]


@pytest.mark.sqlite_only
async def test_keyed_rows_from_before_commit_order_keep_their_order_ahead_of_new_ones(
    db_path: Path, raw: RawDB
) -> None:
    from trio_dispatch.store.schema import statements

    # A database at schema version 7 holding two rows of one key (ordered
    # by id then), migrated forward by opening it.
    async with open_store(db_path) as db:
        older = [
            await enqueue_dispatch(db, kind="k", deliver_to="x", ordering_key="acct-1")
            for _ in range(2)
        ]
    conn = sqlite3.connect(db_path, isolation_level=None)
    conn.execute("DROP INDEX ix_dispatch_outbox_ordering_seq")
    conn.execute("ALTER TABLE dispatch_outbox DROP COLUMN key_seq")
    for statement in statements(5):  # version 5's ordering index
        if "ix_dispatch_outbox_ordering " in statement or "(ordering_key, id)" in statement:
            conn.execute(statement)
    conn.execute("DELETE FROM trio_dispatch_schema WHERE version > 7")
    conn.close()

    async with open_store(db_path) as db:
        newer = await enqueue_dispatch(db, kind="k", deliver_to="x", ordering_key="acct-1")
        delivered: list[str] = []
        for _ in range(3):
            claims, _ = await claim_due(db, lease_seconds=30)
            assert len(claims) == 1
            delivered.append(claims[0].dispatch_id)
            await finish_attempt(db, claims[0], TransportResult.success())
    assert delivered == [*older, newer]
    assert [raw.row(i)["key_seq"] for i in delivered] == [0, 0, 1]
