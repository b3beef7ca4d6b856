"""A worker's start on a table the server has never analyzed (PostgreSQL:
``pg_class.reltuples`` -1), or analyzed while it was a fraction of its
size, gathers statistics before the first claim, once; on SQLite, whose
statements name their indexes, it leaves the file without statistics.
Both engines, both anyio backends."""

from __future__ import annotations

import logging
import sqlite3

import anyio
import pytest

from trio_dispatch import Delivery, enqueue_many, open_store
from trio_dispatch.worker import DispatchWorker

pytestmark = pytest.mark.anyio

ROWS = 300


def _statistics(target: str, engine: str) -> float | None:
    """PostgreSQL: the table's reltuples (-1: never analyzed); SQLite: the
    rows of sqlite_stat1, or None when ANALYZE never ran on the file."""
    if engine == "sqlite":
        file = sqlite3.connect(target)
        try:
            found = "SELECT name FROM sqlite_master WHERE name = 'sqlite_stat1'"
            if file.execute(found).fetchone():
                return float(file.execute("SELECT COUNT(*) FROM sqlite_stat1").fetchone()[0])
            return None
        finally:
            file.close()
    import psycopg

    with psycopg.connect(target) as conn:
        row = conn.execute(
            "SELECT reltuples FROM pg_class WHERE oid = to_regclass('dispatch_outbox')"
        ).fetchone()
        assert row is not None
        return float(row[0])


async def test_a_worker_analyzes_a_table_never_analyzed_once_before_its_first_claim(
    fresh_target: str, engine: str, caplog: pytest.LogCaptureFixture
) -> None:
    async with open_store(fresh_target) as db:
        rows = [
            {"kind": "k", "deliver_to": f"d{i % 5}", "priority": -5 if i % 10 == 0 else 0}
            for i in range(ROWS)
        ]
        await enqueue_many(db, rows)
        before = _statistics(fresh_target, engine)
        assert before == (-1.0 if engine == "postgres" else None)
        delivered: list[str] = []
        all_done = anyio.Event()

        async def send(delivery: Delivery) -> None:
            delivered.append(delivery.dispatch_id)
            if len(delivered) == ROWS:
                all_done.set()

        for start in range(2):
            worker = DispatchWorker(db, transport=send, tick_seconds=0.05)
            with caplog.at_level(logging.INFO):
                async with anyio.create_task_group() as tg:
                    await tg.start(worker.run)
                    if start == 0:
                        # The statistics came before the first claim.
                        assert _statistics(fresh_target, engine) == (
                            ROWS if engine == "postgres" else None
                        )
                        with anyio.fail_after(20):
                            await all_done.wait()
                    tg.cancel_scope.cancel()
    said = [r for r in caplog.records if "had no statistics" in r.getMessage()]
    assert len(said) == (1 if engine == "postgres" else 0)
    assert len(set(delivered)) == ROWS
    after = _statistics(fresh_target, engine)
    assert after is None if engine == "sqlite" else after is not None and after >= 0


async def test_statistics_taken_when_the_table_was_small_are_taken_again_at_a_start(
    fresh_target: str, engine: str
) -> None:
    async with open_store(fresh_target) as db:
        await enqueue_many(db, [{"kind": "k", "deliver_to": "d"} for _ in range(10)])
        if engine == "postgres":
            import psycopg

            with psycopg.connect(fresh_target, autocommit=True) as conn:
                conn.execute("ANALYZE dispatch_outbox")
        assert _statistics(fresh_target, engine) == (10.0 if engine == "postgres" else None)
        body = {"text": "x" * 400}
        for _ in range(3):  # about 150 pages of 8 KiB, against the 1 the statistics saw
            await enqueue_many(db, [{"kind": "k", "deliver_to": "d", "body": body}] * 1000)

        async def send(delivery: Delivery) -> None:
            pass

        worker = DispatchWorker(db, transport=send, tick_seconds=60)
        async with anyio.create_task_group() as tg:
            await tg.start(worker.run)
            tg.cancel_scope.cancel()
    after = _statistics(fresh_target, engine)
    assert after is None if engine == "sqlite" else after is not None and after > 1000
