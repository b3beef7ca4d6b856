"""The store's priority step (docs/controls.md): the head start of one
priority level, which every enqueue reads in its own statement
(:data:`~trio_dispatch.priority.HEAD_START`), so every writer -- a library
producer, a caller's own connection, a worker's schedules -- gives a row of
one priority the same head start. A worker records its configured step at
start (:func:`record_priority_step`); a row keeps the head start it was
enqueued with.
"""

from __future__ import annotations

import logging
import time
from typing import Final

from ..priority import (
    DEFAULT_PRIORITY_STEP_SECONDS,
    SETTINGS_TABLE,
    STEP_SETTING,
    require_step,
)
from ..store.base import Conn, Database

_READ: Final = f"SELECT value FROM {SETTINGS_TABLE} WHERE name = ?"
_WRITE: Final = (
    f"INSERT INTO {SETTINGS_TABLE} (name, value, updated_at) VALUES (?, ?, ?) "
    "ON CONFLICT (name) DO UPDATE SET value = excluded.value, updated_at = excluded.updated_at"
)


def _step(conn: Conn) -> float:
    row = conn.query_one(_READ, (STEP_SETTING,))
    return DEFAULT_PRIORITY_STEP_SECONDS if row is None else float(row["value"])


async def priority_step(db: Database) -> float:
    """The store's step, in seconds (300 unless a worker recorded another)."""
    return await db.read(_step)


async def record_priority_step(
    db: Database, seconds: float, log: logging.Logger | None = None
) -> float | None:
    """Make ``seconds`` (1 to 86400) the store's step: rows enqueued from
    now on get ``priority * seconds`` as their head start, rows already
    written keep theirs. Returns the step it replaced, or None when the
    store had it already (nothing is written). A change is logged on
    ``log`` as a warning naming both values: workers whose configurations
    disagree replace each other's step at every start. A bad value raises
    ``TypeError``/``ValueError`` naming it before anything is written."""
    seconds = require_step("priority_step_seconds", seconds)

    def record(conn: Conn) -> float | None:
        before = _step(conn)
        if before == seconds:
            return None
        conn.execute(_WRITE, (STEP_SETTING, seconds, time.time()))
        return before

    if await db.read(_step) == seconds:  # the common start: a read, no write
        return None
    replaced = await db.write(record)
    if replaced is not None and log is not None:
        log.warning(
            "priority_step_seconds: the store's was %gs, now %gs (rows enqueued from now on)",
            replaced,
            seconds,
        )
    return replaced


async def apply_priority_step(
    db: Database, seconds: float | None, log: logging.Logger
) -> float | None:
    """:func:`record_priority_step` at a worker's start (nothing when
    ``seconds`` is None), a store error logged instead of raised: the step
    only decides the head starts of rows enqueued later, and the worker
    runs either way. Cancellation propagates."""
    if seconds is None:
        return None
    try:
        return await record_priority_step(db, seconds, log)
    except Exception:
        log.exception("recording priority_step_seconds %gs in the store failed", seconds)
        return None
