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

import statistics
import time
import uuid
from collections.abc import Callable
from typing import Any, Final

import anyio

from trio_dispatch import Delivery, DispatchWorker, enqueue_many, open_store
from trio_dispatch.lifecycle import WAITING_AT
from trio_dispatch.outbox import claim_due
from trio_dispatch.store import Store

from .harness import Bench, Figure, Outcome, at_least, ratio_at_most
from .pgserver import fresh_postgres, postgres_database
from .workloads import load_rows

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
    "id",
    "kind",
    "deliver_to",
    "payload",
    "status",
    "attempt",
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
    done = 0
    finished = anyio.Event()

    async def counting(delivery: Delivery) -> None:
        nonlocal done
        done += 1
        if done == n:
            finished.set()

    async with open_store(target) as db:
        worker = DispatchWorker(
            db,
            transport=counting,
            concurrency=concurrency,
            batch_size=100,
            tick_seconds=3600,
            ordering_on_dead_letter="block",
        )
        async with anyio.create_task_group() as tg:
            start = time.perf_counter()
            await tg.start(worker.run)
            await finished.wait()
            elapsed = time.perf_counter() - start
            tg.cancel_scope.cancel()
    return n / elapsed


async def _claim_ms(db: Store) -> float:
    """One ``claim_due`` of up to 100 rows, in milliseconds; then (untimed)
    its rows go back to pending as they were."""
    started = time.perf_counter()
    claims, _ = await claim_due(db, limit=CLAIM_LIMIT, ordering="block")
    elapsed = time.perf_counter() - started
    if len(claims) != CLAIM_LIMIT:
        raise RuntimeError(f"the claim took {len(claims)} rows, not {CLAIM_LIMIT}")
    ids = [(claim.dispatch_id,) for claim in claims]
    await db.write(
        lambda conn: conn.executemany(
            "UPDATE dispatch_outbox SET status = 'pending', attempt = 0, "
            "next_attempt_at = created_at WHERE id = ?",
            ids,
        )
    )
    return elapsed * 1000


async def claim_times(backlog_target: str, empty_target: str) -> tuple[float, float]:
    """Median claim milliseconds on the store with the backlog and on the
    one without, the two taking turns."""
    times: dict[str, list[float]] = {"big": [], "empty": []}
    async with open_store(backlog_target) as big, open_store(empty_target) as empty:
        stores = [("big", big), ("empty", empty)]
        for _, db in stores:
            await _claim_ms(db)  # warm
        for turn in range(CLAIMS):
            for name, db in stores if turn % 2 else stores[::-1]:
                times[name].append(await _claim_ms(db))
    return statistics.median(times["big"]), statistics.median(times["empty"])


class _Engine:
    """Fresh stores of one engine: SQLite files, or PostgreSQL databases
    emptied before each use."""

    def __init__(self, bench: Bench, name: str, urls: list[str]) -> None:
        self.bench, self.name, self.urls = bench, name, urls

    def fresh(self, which: int = 0) -> str:
        if self.urls:
            target = fresh_postgres(self.urls[which])
        else:
            target = str(self.bench.at(f"ordering{which}"))
        self.bench.go(_fill, target, [])
        return target


def _many_keys(engine: _Engine, keys: int) -> tuple[float, float]:
    n = keys * ROWS_A_KEY
    go = engine.bench.go
    keyed = engine.fresh()
    # Row j of every key, then row j + 1: each key's later rows wait.
    go(_fill, keyed, _items(n, lambda i: f"key-{i % keys}"))
    ours = go(deliveries, keyed, n, CONCURRENCY)
    plain = engine.fresh()
    go(_fill, plain, _items(n, lambda i: None))
    return ours, go(deliveries, plain, n, CONCURRENCY)


def _blocked(engine: _Engine, unkeyed: int) -> tuple[float, float, float, float]:
    go = engine.bench.go
    big, empty = engine.fresh(0), engine.fresh(1)
    build_backlog(big, BACKLOG)
    for target in (big, empty):
        go(_fill, target, _items(unkeyed, lambda i: None))
    claim_big, claim_empty = go(claim_times, big, empty)
    with_backlog = go(deliveries, big, unkeyed, CONCURRENCY)
    without = go(deliveries, empty, unkeyed, CONCURRENCY)
    return with_backlog, without, claim_big, claim_empty


def _hot(engine: _Engine, n: int) -> tuple[float, float]:
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
    notes: list[str] = []
    databases = [db for db in (postgres_database(), postgres_database()) if db is not None]
    engines = [_Engine(bench, "SQLite", [])]
    if len(databases) == 2:
        engines.append(_Engine(bench, "PostgreSQL", [url for url, _ in databases]))
    else:
        notes.append("ordering section: PostgreSQL skipped, no server answered")
    measured: dict[str, tuple[list[float], list[float]]] = {}

    def add(key: str, ours: float, baseline: float) -> None:
        values, baselines = measured.setdefault(key, ([], []))
        values.append(ours)
        baselines.append(baseline)

    try:
        for _ in range(bench.rounds):
            for engine in engines:
                add(f"{engine.name}/keys", *_many_keys(engine, keys))
                with_backlog, without, claim_big, claim_empty = _blocked(engine, unkeyed)
                add(f"{engine.name}/blocked", with_backlog, without)
                add(f"{engine.name}/claim", claim_big, claim_empty)
                add(f"{engine.name}/hot", *_hot(engine, hot))
    finally:
        for _, drop in databases:
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
        for key, what, unit, baseline, target, meets in rows:
            values, baselines = measured[f"{name}/{key}"]
            figures.append(
                Figure(what, values, unit, baselines, baseline, target, meets, baseline, "ordering")
            )
    if bench.quick:
        notes.append(
            f"ordering section (--quick): {keys:,} keys x {ROWS_A_KEY} (full: {KEYS:,}), "
            f"{unkeyed:,} unkeyed rows beside the backlog (full: {UNKEYED:,}), hot key "
            f"{hot:,} rows (full: {HOT:,}); the backlog is {BACKLOG:,} rows either way"
        )
    return Outcome(figures, notes)
