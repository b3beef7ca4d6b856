"""A worker's start on PostgreSQL: statistics for an outbox table that has none.

The claim's statements read ordered ranges of partial indexes, and which
index serves a range is the planner's choice. On a table the server has
never analyzed (``pg_class.reltuples`` is -1: no ``ANALYZE``, no
``VACUUM``, autovacuum not yet come by -- a new table filled before its
first worker starts, say), the planner guesses every selectivity, and
some guesses are ruinous: a read of one status's held-back rows went
through the destination-led held-back index, every negative-priority row
read and filtered at each claim (4 ms among 2,000 such rows, growing with
them, against 0.03 ms through the status-led index once analyzed), and a
drain of 20,000 rows to 50 destinations ran at 1,751 deliveries/s
against 2,766/s analyzed. The same holds for statistics taken while the
table was a fraction of its size (created or emptied, then filled in a
burst). So a worker that finds the table never analyzed, or grown past
:data:`GROWTH` times the pages its statistics saw (and at least
:data:`MIN_PAGES` pages), analyzes it before its first claim; after that,
autovacuum keeps the statistics, as for any table. SQLite's statements
name their indexes themselves: nothing to do there.
"""

from __future__ import annotations

import logging
from typing import Final

from ..store.base import Conn, Database

TABLE: Final = "dispatch_outbox"
GROWTH: Final = 4
"""The table's pages beyond this many times those its statistics saw: stale."""
MIN_PAGES: Final = 16
"""A table smaller than this (128 KiB) is read alike whatever the plan."""

_STALE: Final = (
    "SELECT c.reltuples, c.relpages, pg_relation_size(c.oid) / "
    "current_setting('block_size')::int AS pages "
    f"FROM pg_class c WHERE c.oid = to_regclass('{TABLE}')"
)


def _stale(conn: Conn) -> bool:
    if conn.dialect.name != "postgres":
        return False
    row = conn.query_one(_STALE)
    if row is None:
        return False
    if float(row["reltuples"]) < 0:  # never analyzed nor vacuumed
        return True
    pages = int(row["pages"])
    return pages >= MIN_PAGES and pages > GROWTH * max(int(row["relpages"]), 1)


def _analyze(conn: Conn) -> None:
    # Statistics only (a sample of the table): no row changes, and the
    # table's readers and writers go on meanwhile.
    conn.execute(f"ANALYZE {TABLE}")


async def analyze_if_stale(db: Database, log: logging.Logger) -> bool:
    """Analyze the outbox table where the server never has, or where its
    statistics are stale by :data:`GROWTH` (PostgreSQL); whether it did.
    A failure is logged, not raised: the worker runs either way.
    Cancellation propagates."""
    try:
        if not await db.read(_stale):
            return False
        await db.write(_analyze)
    except Exception:
        log.exception("gathering the first statistics of %s failed", TABLE)
        return False
    log.info(
        "%s had no statistics, or statistics of a table a quarter its size: "
        "analyzed it before the first claim",
        TABLE,
    )
    return True
