"""Section ``ordering``: what ordering keys (docs/ordering.md) cost, on SQLite and on
PostgreSQL in one run.

- Many keys: 10,000 keys x 5 rows (``--quick``: 2,000 x 5), a no-op
  transport, concurrency 16: deliveries/s beside the same number of
  unkeyed rows.
- A blocked key: one key whose head is ``dead_letter`` under ``block``,
  100,000 rows waiting behind it (the first of them due, never claimable).
  Unkeyed deliveries/s beside the same run without that backlog; and the
  time of one ``claim_due`` of 100 rows (the median of many, each put back
  untimed) with and without it.
- One hot key: every row one key, concurrency 16, beside the no-op
  transport's rate at concurrency 1 unkeyed (the floor a key's one-at-a-time
  delivery cannot beat by much).
"""

from __future__ import annotations

import functools
import time
import uuid
from collections.abc import Callable
from typing import Any, Final

from trio_dispatch import enqueue_many, open_store
from trio_dispatch.lifecycle import WAITING_AT

from .harness import Bench, Outcome, Pairs, at_least, ratio_at_most
from .workloads import ROW_COLUMNS, Engine, claim_ms, drain_rate, load_rows, taking_turns

KEYS: Final = 10_000
KEYS_QUICK: Final = 2_000
ROWS_A_KEY: Final = 5
CONCURRENCY: Final = 16
BACKLOG: Final = 100_000
"""Rows waiting behind the blocked head (``--quick``: the same)."""
UNKEYED: Final = 20_000
UNKEYED_QUICK: Final = 5_000
"""Unkeyed rows delivered beside the blocked key's backlog."""
CLAIM_LIMIT: Final = 100
CLAIMS: Final = 60
HOT: Final = 5_000
HOT_QUICK: Final = 2_000
BLOCKED: Final = "blocked-key"

_COLUMNS: Final = (
    *ROW_COLUMNS,
    "max_attempts",
    "next_attempt_at",
    "created_at",
    "updated_at",
    "ordering_key",
)


def _items(n: int, key: Callable[[int], str | None]) -> list[dict[str, Any]]:
    return [
        {"kind": "bench", "deliver_to": f"s{i}", "ordering_key": key(i), "max_attempts": 5}
        for i in range(n)
    ]


async def _fill(target: str, items: list[dict[str, Any]]) -> None:
    async with open_store(target) as db:
        for offset in range(0, len(items), 1000):
            await enqueue_many(db, items[offset : offset + 1000])


def _backlog_rows(backlog: int, now: float) -> list[tuple[Any, ...]]:
    """The blocked key: its head ``dead_letter``, the next row due (an hour
    ago, before every other row), the rest waiting; ids in that order."""
    start = now - 3600
    rows: list[tuple[Any, ...]] = [
        (uuid.uuid4().hex, "dead_letter", 5, start, start, start, BLOCKED)
    ]
    for i in range(backlog):
        due = start + 1e-6 if i == 0 else WAITING_AT
        rows.append((uuid.uuid4().hex, "pending", 0, due, start + i * 1e-6, start, BLOCKED))
    # uuid4 ids are not in time order: give them their order (id order is the key's order)
    return [(f"{i:012x}{row[0][12:]}", *row[1:]) for i, row in enumerate(rows)]


def build_backlog(target: str, backlog: int) -> None:
    """Put the blocked key and its ``backlog`` into the (made) outbox, with
    the engine's own driver; statistics gathered."""
    load_rows(
        target,
        _COLUMNS,
        (
            (row_id, "bench", "seat", "{}", status, attempt, 5, due, created, updated, key)
            for row_id, status, attempt, due, created, updated, key in _backlog_rows(
                backlog, time.time()
            )
        ),
        analyze=True,
    )


async def deliveries(target: str, n: int, concurrency: int) -> float:
    """Deliveries/s of a worker (no-op transport, ``block`` policy) taking
    ``n`` rows out of the store as it is."""
    return await drain_rate(target, n, concurrency, ordering_on_dead_letter="block")


async def claim_times(backlog_target: str, empty_target: str) -> tuple[float, float]:
    """Median milliseconds of one ``claim_due`` of up to 100 rows (each put
    back untimed) on the store with the backlog and on the one without, the
    two taking turns."""
    claim = functools.partial(claim_ms, limit=CLAIM_LIMIT, ordering="block")
    return await taking_turns(backlog_target, empty_target, claim, CLAIMS)


def _many_keys(engine: Engine, keys: int) -> tuple[float, float]:
    n = keys * ROWS_A_KEY
    go = engine.bench.go
    keyed = engine.fresh()
    # Row j of every key, then row j + 1: each key's later rows wait.
    go(_fill, keyed, _items(n, lambda i: f"key-{i % keys}"))
    ours = go(deliveries, keyed, n, CONCURRENCY)
    plain = engine.fresh()
    go(_fill, plain, _items(n, lambda i: None))
    return ours, go(deliveries, plain, n, CONCURRENCY)


def _blocked(engine: Engine, unkeyed: int) -> tuple[float, float, float, float]:
    go = engine.bench.go
    big, empty = engine.fresh(0), engine.fresh(1)
    build_backlog(big, BACKLOG)
    for target in (big, empty):
        go(_fill, target, _items(unkeyed, lambda i: None))
    claim_big, claim_empty = go(claim_times, big, empty)
    with_backlog = go(deliveries, big, unkeyed, CONCURRENCY)
    without = go(deliveries, empty, unkeyed, CONCURRENCY)
    return with_backlog, without, claim_big, claim_empty


def _hot(engine: Engine, n: int) -> tuple[float, float]:
    go = engine.bench.go
    hot = engine.fresh()
    go(_fill, hot, _items(n, lambda i: "hot"))
    ours = go(deliveries, hot, n, CONCURRENCY)
    plain = engine.fresh()
    go(_fill, plain, _items(n, lambda i: None))
    return ours, go(deliveries, plain, n, 1)


def run_ordering(bench: Bench) -> Outcome:
    """The three ordering figures on each engine (see the module's text)."""
    keys = KEYS_QUICK if bench.quick else KEYS
    unkeyed = UNKEYED_QUICK if bench.quick else UNKEYED
    hot = HOT_QUICK if bench.quick else HOT
    engines, drops, notes = Engine.available(bench, "ordering", 2)
    measured = Pairs()
    try:
        for _ in range(bench.rounds):
            for engine in engines:
                measured.add(f"{engine.name}/keys", *_many_keys(engine, keys))
                with_backlog, without, claim_big, claim_empty = _blocked(engine, unkeyed)
                measured.add(f"{engine.name}/blocked", with_backlog, without)
                measured.add(f"{engine.name}/claim", claim_big, claim_empty)
                measured.add(f"{engine.name}/hot", *_hot(engine, hot))
    finally:
        for drop in drops:
            drop()
    figures = []
    n = keys * ROWS_A_KEY
    for engine in engines:
        name = engine.name
        rows = [
            (
                "keys",
                f"{name}: deliveries/s, {keys:,} keys x {ROWS_A_KEY} rows, concurrency "
                f"{CONCURRENCY}",
                "deliveries/s",
                f"the same {n:,} rows unkeyed",
                ">= 0.80x",
                at_least(0.80),
            ),
            (
                "blocked",
                f"{name}: unkeyed deliveries/s ({unkeyed:,}) beside a blocked key with "
                f"{BACKLOG:,} rows behind it",
                "deliveries/s",
                "the same run without that backlog",
                ">= 0.90x",
                at_least(0.90),
            ),
            (
                "claim",
                f"{name}: one claim_due of {CLAIM_LIMIT} rows, blocked key's {BACKLOG:,}-row "
                f"backlog / none (median of {CLAIMS})",
                "ms",
                "the same claim without that backlog",
                "<= 1.2x",
                ratio_at_most(1.2),
            ),
            (
                "hot",
                f"{name}: deliveries/s, one hot key ({hot:,} rows), concurrency {CONCURRENCY}",
                "deliveries/s",
                "no-op transport, concurrency 1, unkeyed (the floor)",
                ">= 0.50x",
                at_least(0.50),
            ),
        ]
        figures += measured.figures(name, rows, "ordering")
    if bench.quick:
        notes.append(
            f"ordering section (--quick): {keys:,} keys x {ROWS_A_KEY} (full: {KEYS:,}), "
            f"{unkeyed:,} unkeyed rows beside the backlog (full: {UNKEYED:,}), hot key "
            f"{hot:,} rows (full: {HOT:,}); the backlog is {BACKLOG:,} rows either way"
        )
    return Outcome(figures, notes)
