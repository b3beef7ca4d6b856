"""PostgreSQL: the transactions the group commit composes never deadlock
on ordering-key locks (one order for every transaction's key locks), a
deadlock the server breaks by aborting the store's transaction is run
again, and any other driver error reaches the caller as a StoreError."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from functools import partial
from typing import Any

import anyio
import pytest

from trio_dispatch import enqueue_dispatch, open_store
from trio_dispatch.outbox.ordering import lock_keys
from trio_dispatch.store import SQLiteStore, StoreError
from trio_dispatch.store.dialect import KEY_LOCK_SEED

from ..conftest import RawDB
from ..helpers import HeldWriter, wait_for

pytestmark = [pytest.mark.anyio, pytest.mark.postgres_only]


@contextmanager
def other_session(url: str, **settings: str) -> Iterator[Any]:
    """A transaction of another client's, open until the block ends."""
    import psycopg

    with psycopg.connect(url, autocommit=True) as conn:
        for name, value in settings.items():
            conn.execute(f"SET {name} = '{value}'")
        conn.execute("BEGIN")
        try:
            yield conn
        finally:
            conn.execute("ROLLBACK")


def lock_key(conn: Any, key: str) -> None:
    conn.execute("SELECT pg_advisory_xact_lock(hashtextextended(%s, %s))", (key, KEY_LOCK_SEED))


def waiting_on_locks(raw: RawDB) -> int:
    return int(
        raw.scalar(
            "SELECT COUNT(*) FROM pg_stat_activity WHERE datname = current_database() "
            "AND wait_event_type = 'Lock'"
        )
    )


def queued(store: SQLiteStore, count: int) -> bool:
    return store.queued_writes == count


async def queue_behind(store: SQLiteStore, *works: Any) -> list[Any]:
    """Run ``works`` as units of one group-commit batch, in this order."""
    held = HeldWriter()
    results: list[Any] = [None] * len(works)
    async with anyio.create_task_group() as tg:
        tg.start_soon(store.write, held.unit)
        await held.running()

        async def run(index: int) -> None:
            try:
                results[index] = await store.write(works[index])
            except Exception as exc:  # the test asserts on it
                results[index] = exc

        for index in range(len(works)):
            tg.start_soon(run, index)
            await wait_for(partial(queued, store, index + 1))
        held.release()
    return results


@asynccontextmanager
async def slow_deadlock_checks(raw: RawDB, db_target: str) -> AsyncIterator[Any]:
    """A store whose sessions look for deadlocks only after 5 s (sessions
    opened meanwhile on this database), so a cycle shows as a long wait."""
    name = raw.scalar("SELECT current_database()")
    raw.execute(f"ALTER DATABASE \"{name}\" SET deadlock_timeout = '5s'")
    try:
        async with open_store(db_target) as store:
            yield store
    finally:
        raw.execute(f'ALTER DATABASE "{name}" RESET deadlock_timeout')


async def test_units_sharing_a_transaction_take_key_locks_in_one_order(
    raw: RawDB, db_target: str
) -> None:
    # Another client holds key b and will want key c. The batch's first
    # unit takes c; its second wants b, a lower key: waiting for it while
    # holding c would close a cycle with the other client.
    def take(key: str) -> Any:
        def work(conn: Any) -> str:
            lock_keys(conn, [key])
            return key

        return work

    async with slow_deadlock_checks(raw, db_target) as store:
        with other_session(db_target, deadlock_timeout="10s") as other:
            lock_key(other, "b")
            async with anyio.create_task_group() as tg:
                outcome: list[Any] = []

                async def batch() -> None:
                    outcome.extend(await queue_behind(store, take("c"), take("b")))

                tg.start_soon(batch)
                await wait_for(lambda: waiting_on_locks(raw) == 1)
                # The store waits for b holding nothing: the other client
                # takes c at once (a cycle would hold it until a deadlock
                # check, 5 s away, aborted one of the two).
                started = time.monotonic()
                await anyio.to_thread.run_sync(lock_key, other, "c")
                waited = time.monotonic() - started
                other.execute("COMMIT")
                other.execute("BEGIN")
    assert waited < 2, waited
    assert outcome == ["c", "b"]


async def test_a_deadlock_the_server_breaks_runs_the_write_again(
    store: SQLiteStore, raw: RawDB, db_target: str
) -> None:
    first = await enqueue_dispatch(store, kind="k", deliver_to="x")
    second = await enqueue_dispatch(store, kind="k", deliver_to="x")
    before = {i: float(raw.row(i)["updated_at"]) for i in (first, second)}
    touch = "UPDATE dispatch_outbox SET updated_at = updated_at + 1 WHERE id = ?"

    def both(conn: Any) -> str:
        conn.execute(touch, (first,))
        conn.execute(touch, (second,))
        return "written"

    # The other client waits 10 s before it looks for a deadlock, the
    # store's session 1 s: the store's transaction is the one aborted.
    with other_session(db_target, deadlock_timeout="10s") as other:
        other.execute(touch.replace("?", "%s"), (second,))
        async with anyio.create_task_group() as tg:
            outcome: list[Any] = []

            async def write() -> None:
                outcome.append(await store.write(both))

            tg.start_soon(write)
            await wait_for(lambda: waiting_on_locks(raw) == 1)
            await anyio.to_thread.run_sync(
                lambda: other.execute(touch.replace("?", "%s"), (first,))
            )
            other.execute("COMMIT")
            other.execute("BEGIN")
    assert outcome == ["written"]
    # Both clients' writes committed, each once.
    assert {i: float(raw.row(i)["updated_at"]) for i in (first, second)} == {
        i: at + 2 for i, at in before.items()
    }


async def test_a_driver_error_in_a_write_is_a_store_error(store: SQLiteStore) -> None:
    def divide(conn: Any) -> None:
        conn.execute("SELECT 1 / 0")

    with pytest.raises(StoreError, match="division by zero") as info:
        await store.write(divide)
    assert "\n" not in str(info.value)
    # The store goes on.
    assert await enqueue_dispatch(store, kind="k", deliver_to="x")


async def test_a_unit_taking_its_own_keys_out_of_order_waits_for_them_instead_of_spinning(
    store: SQLiteStore, raw: RawDB, db_target: str
) -> None:
    def falling(conn: Any) -> str:
        lock_keys(conn, ["b"])
        lock_keys(conn, ["a"])  # below a key it holds: only tried, and "a" is taken
        return "written"

    with other_session(db_target) as other:
        lock_key(other, "a")
        async with anyio.create_task_group() as tg:
            outcome: list[Any] = []

            async def write() -> None:
                outcome.append(await store.write(falling))

            tg.start_soon(write)
            # Alone in its transaction it waits for "a" like any lock
            # (before, it tried, rolled back and tried again without end).
            await wait_for(lambda: waiting_on_locks(raw) == 1, timeout=5)
            other.execute("COMMIT")
            other.execute("BEGIN")
    assert outcome == ["written"]


async def test_enqueue_many_with_keys_in_falling_order_writes_them_all(
    store: SQLiteStore, raw: RawDB, db_target: str
) -> None:
    from trio_dispatch import enqueue_many

    with other_session(db_target) as other:
        lock_key(other, "a")
        async with anyio.create_task_group() as tg:
            results: list[Any] = []

            async def enqueue() -> None:
                results.extend(
                    await enqueue_many(
                        store,
                        [
                            {"kind": "k", "deliver_to": "x", "ordering_key": key, "dedup_key": key}
                            for key in ("b", "a")
                        ],
                    )
                )

            tg.start_soon(enqueue)
            await wait_for(lambda: waiting_on_locks(raw) == 1, timeout=5)
            other.execute("COMMIT")
            other.execute("BEGIN")
    assert [raw.row(r.id)["ordering_key"] for r in results] == ["b", "a"]
