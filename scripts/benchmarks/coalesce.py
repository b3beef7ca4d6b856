"""Section ``coalesce``: what coalescing (docs/controls.md) costs an enqueue, on
SQLite and on PostgreSQL in one run.

- 64 producer tasks of one process make 100,000 enqueues (``--quick``:
  5,000) with ``coalesce="replace"`` over 1,000 coalesce keys, beside the
  same enqueues without a key; the two take turns round by round. After
  the replacing run the waiting set is checked: exactly 1,000 rows, one a
  key (the section fails loudly otherwise). Target: >= 0.70x.
- The same at 1 producer, 10,000 enqueues (``--quick``: 2,000): each
  enqueue its own commit, so the figure is the enqueue's own statements
  against a plain one's.

Each enqueue sends the harness's 500-byte body. Every run starts on a fresh
store (a SQLite file, or an emptied PostgreSQL database).
"""

from __future__ import annotations

import time
from typing import Any, Final

import anyio

from trio_dispatch import enqueue_dispatch, open_store

from .harness import BODY, Bench, Figure, Outcome, at_least
from .pgserver import fresh_postgres, postgres_database

KEYS: Final = 1_000
MANY: Final = 100_000
MANY_QUICK: Final = 5_000
ONE: Final = 10_000
ONE_QUICK: Final = 2_000
PRODUCERS: Final = 64
TARGET: Final = 0.70

_WAITING: Final = (
    "SELECT COUNT(*) AS n FROM dispatch_outbox WHERE coalesce_key IS NOT NULL "
    "AND status = 'pending' AND attempt = 0 AND updated_at = created_at"
)


async def _enqueue(target: str, n: int, producers: int, keyed: bool) -> tuple[float, int]:
    """Enqueues/s of ``n`` enqueues by ``producers`` tasks (keyed: replace
    over :data:`KEYS` keys), and the rows left waiting with a key."""
    async with open_store(target) as db:
        per = n // producers

        async def produce(p: int) -> None:
            for i in range(per):
                extra: dict[str, Any] = {}
                if keyed:
                    extra = {"coalesce_key": f"key-{(p * per + i) % KEYS}", "coalesce": "replace"}
                await enqueue_dispatch(db, kind="bench", deliver_to="seat", body=BODY, **extra)

        start = time.perf_counter()
        async with anyio.create_task_group() as tg:
            for p in range(producers):
                tg.start_soon(produce, p)
        elapsed = time.perf_counter() - start
        found = await db.read(lambda conn: conn.query_one(_WAITING))
        waiting = 0 if found is None else int(found["n"])
    return per * producers / elapsed, waiting


class _Engine:
    def __init__(self, bench: Bench, name: str, url: str | None) -> None:
        self.bench, self.name, self.url = bench, name, url

    def fresh(self) -> str:
        return fresh_postgres(self.url) if self.url else str(self.bench.at("coalesce"))

    def pair(self, n: int, producers: int, turn: int) -> tuple[float, float]:
        """(replace, plain) enqueues/s, taking turns; checks the waiting set."""
        rates: dict[bool, float] = {}
        for keyed in (True, False) if turn % 2 == 0 else (False, True):
            rate, waiting = self.bench.go(_enqueue, self.fresh(), n, producers, keyed)
            if keyed and waiting != min(KEYS, n):
                raise AssertionError(
                    f"{self.name}: {waiting} rows wait after {n:,} replacing enqueues over "
                    f"{KEYS:,} keys; expected {min(KEYS, n):,}"
                )
            rates[keyed] = rate
        return rates[True], rates[False]


def run_coalesce(bench: Bench) -> Outcome:
    """The coalescing figures on each engine (see the module's text)."""
    many = MANY_QUICK if bench.quick else MANY
    one = ONE_QUICK if bench.quick else ONE
    notes: list[str] = []
    database = postgres_database()
    engines = [_Engine(bench, "SQLite", None)]
    if database is not None:
        engines.append(_Engine(bench, "PostgreSQL", database[0]))
    else:
        notes.append("coalesce section: PostgreSQL skipped, no server answered")
    measured: dict[str, tuple[list[float], list[float]]] = {}
    try:
        for round_ in range(bench.rounds):
            for engine in engines:
                for producers, n in ((PRODUCERS, many), (1, one)):
                    ours, plain = engine.pair(n, producers, round_)
                    values, baselines = measured.setdefault(f"{engine.name}/{producers}", ([], []))
                    values.append(ours)
                    baselines.append(plain)
    finally:
        if database is not None:
            database[1]()
    figures = []
    for engine in engines:
        for producers, n in ((PRODUCERS, many), (1, one)):
            values, baselines = measured[f"{engine.name}/{producers}"]
            who = f"{producers} producer tasks" if producers > 1 else "1 producer"
            figures.append(
                Figure(
                    f"{engine.name}: enqueue/s, {who}, {n:,} enqueues replacing over "
                    f"{KEYS:,} coalesce keys (1,000 left waiting)",
                    values,
                    "/s",
                    baselines,
                    f"the same {n:,} enqueues without a key",
                    f">= {TARGET:.2f}x",
                    at_least(TARGET),
                    "no key",
                    "coalesce",
                )
            )
    notes.append(
        f"coalesce section: the waiting set was {KEYS:,} rows after every replacing run (checked)"
    )
    if bench.quick:
        notes.append(
            f"coalesce section (--quick): {many:,} enqueues at {PRODUCERS} producers (full: "
            f"{MANY:,}), {one:,} at 1 (full: {ONE:,})"
        )
    return Outcome(figures, notes)
