"""What a worker does to the store before its first claim: record its
priority step (:mod:`~trio_dispatch.outbox.priority_step`) and, on
PostgreSQL, analyze an outbox table without statistics
(:mod:`~trio_dispatch.outbox.first_statistics`). Each logs a failure and
lets the worker run."""

from __future__ import annotations

import logging

from ..outbox.first_statistics import analyze_if_stale
from ..outbox.priority_step import apply_priority_step
from ..settings import WorkerSettings
from ..store.base import Conn, Database


async def prepare_store(db: Database, settings: WorkerSettings, log: logging.Logger) -> bool:
    """Both, in that order (cancellation propagates); whether the store's
    writes take turns on one writer (SQLite) -- where rows lock, writers
    run side by side (PostgreSQL)."""
    await apply_priority_step(db, settings.priority_step_seconds, log)
    await analyze_if_stale(db, log)
    return await db.read(_one_writer)


def _one_writer(conn: Conn) -> bool:
    return not conn.dialect.lock_clause
