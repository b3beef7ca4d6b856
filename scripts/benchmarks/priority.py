"""Section ``priority``: what priorities (docs/controls.md) cost, on SQLite and on
PostgreSQL in one run.

- Mixed priorities: a worker (no-op transport, concurrency 16) drains
  10,000 rows (``--quick``: 5,000) over 50 destinations, of a typical mix
  (10% at 5, 80% at 0, 10% at -5) and of priorities spread evenly over -10
  to 10, each beside the same rows all of priority 0; the three take turns
  round by round. A row below 0 is due at once but ranked after now, so it
  goes through the claim's second lane.
- The claim among finished rows: one ``claim_due`` of 100 rows (the median
  of many, each put back untimed) among 5,000 due rows of mixed priorities,
  in a table that also holds 1,000,000 finished rows (``--quick``:
  200,000), beside the same claim among 1,000 finished rows.
- The cost of head starts on an idle queue: one claim (nothing due) among
  20,000 rows waiting for retries within the next 50 minutes with mixed
  priorities, beside the same rows all of priority 0. A row of a head start
  whose rank reaches now is read and passed over on its index entry; with
  every row at 0 none is read. No target: the figure says what it costs.
"""

from __future__ import annotations

import functools
import itertools
import random
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any, Final

from trio_dispatch import enqueue_many, open_store
from trio_dispatch.outbox import claim_due
from trio_dispatch.priority import DEFAULT_PRIORITY_STEP_SECONDS
from trio_dispatch.store import Store

from .harness import Bench, Outcome, Pairs, at_least, ratio_at_most
from .workloads import ROW_COLUMNS, Engine, claim_ms, drain_rate, load_rows, taking_turns

DRAIN: Final = 10_000
DRAIN_QUICK: Final = 5_000
CONCURRENCY: Final = 16
FINISHED: Final = 1_000_000
FINISHED_QUICK: Final = 200_000
SMALL: Final = 1_000
DUE: Final = 5_000
CLAIM_LIMIT: Final = 100
CLAIMS: Final = 60
RETRYING: Final = 20_000
IDLE_CLAIMS: Final = 40
SEED: Final = 18

_COLUMNS: Final = (
    *ROW_COLUMNS,
    "max_attempts",
    "next_attempt_at",
    "created_at",
    "updated_at",
    "priority",
    "head_start",
)


MIXES: Final = ("zero", "typical", "spread")
"""Every row at 0; a typical mix (10% at 5, 80% at 0, 10% at -5); every
priority from -10 to 10 alike (a stress: most rows off 0)."""


def _priorities(n: int, mix: str) -> list[int]:
    """``n`` priorities of ``mix`` (one of :data:`MIXES`), seeded."""
    chooser = random.Random(SEED)
    if mix == "zero":
        return [0] * n
    if mix == "typical":
        return [chooser.choices((5, 0, -5), (1, 8, 1))[0] for _ in range(n)]
    return [chooser.randint(-10, 10) for _ in range(n)]


def _destinations(n: int) -> list[str]:
    """50 destinations in a seeded random order, the same for both sides: in
    turn (s0, s1, ...) the first rows of a claim would always name as many
    destinations as rows, so the claim of all-0 rows would share itself by
    its quickest path and the mixed rows (in another order) by a slower one."""
    chooser = random.Random(SEED + 1)
    return [f"s{chooser.randrange(50)}" for _ in range(n)]


async def _fill(target: str, priorities: list[int]) -> None:
    destinations = _destinations(len(priorities))
    async with open_store(target) as db:
        for offset in range(0, len(priorities), 1000):
            await enqueue_many(
                db,
                [
                    {"kind": "bench", "deliver_to": destinations[offset + i], "priority": p}
                    for i, p in enumerate(priorities[offset : offset + 1000])
                ],
            )


def _rows(n: int, status: str, due: Callable[[int], float], mix: str) -> Iterator[tuple[Any, ...]]:
    """``n`` rows of ``status`` (made as they are written, so a million
    never sit in memory), each due at ``due(i)``, of priority 0 or spread
    over -10..10, with the head start the store's default step gives."""
    step = DEFAULT_PRIORITY_STEP_SECONDS
    now = time.time()
    for i, priority in enumerate(_priorities(n, mix)):
        yield (
            uuid.uuid4().hex,
            "bench",
            f"s{i % 50}",
            "{}",
            status,
            1 if status == "delivered" else 0,
            8,
            due(i),
            now - 86400 + i * 1e-3,
            now - 86400,
            priority,
            priority * step,
        )


def _build_claim_table(target: str, finished: int) -> None:
    """``finished`` delivered rows and :data:`DUE` due rows of mixed
    priorities, written with the engine's own driver, statistics gathered."""
    ago = time.time() - 3600
    rows = itertools.chain(
        _rows(finished, "delivered", lambda i: ago, "spread"),
        _rows(DUE, "pending", lambda i: ago + i * 1e-3, "spread"),
    )
    load_rows(target, _COLUMNS, rows, analyze=True)


async def _idle_claim_ms(db: Store) -> float:
    """One ``claim_due`` that finds nothing due, in milliseconds."""
    started = time.perf_counter()
    claims, _ = await claim_due(db, limit=CLAIM_LIMIT)
    elapsed = time.perf_counter() - started
    if claims:
        raise RuntimeError(f"the idle claim took {len(claims)} rows")
    return elapsed * 1000


def _mixed(engine: Engine, n: int, turn: int) -> dict[str, float]:
    """Deliveries/s of a drain of each mix, the mixes taking turns."""
    go = engine.bench.go
    rates: dict[str, float] = {}
    for k in range(len(MIXES)):
        mix = MIXES[(turn + k) % len(MIXES)]
        target = engine.fresh()
        go(_fill, target, _priorities(n, mix))
        rates[mix] = go(drain_rate, target, n, CONCURRENCY)
    return rates


def _idle(engine: Engine) -> tuple[float, float]:
    mixed, plain = engine.fresh(0), engine.fresh(1)
    now = time.time()

    def due(i: int) -> float:
        # Retries due within the next 50 minutes (the backoff's span), evenly.
        return now + 60 + i * 2900 / RETRYING

    for target, mix in ((mixed, "spread"), (plain, "zero")):
        load_rows(target, _COLUMNS, _rows(RETRYING, "pending", due, mix), analyze=True)
    result: tuple[float, float] = engine.bench.go(
        taking_turns, mixed, plain, _idle_claim_ms, IDLE_CLAIMS
    )
    return result


def run_priority(bench: Bench) -> Outcome:
    """The priority figures on each engine (see the module's text)."""
    drain = DRAIN_QUICK if bench.quick else DRAIN
    finished = FINISHED_QUICK if bench.quick else FINISHED
    engines, drops, notes = Engine.available(bench, "priority", 4)
    measured = Pairs()
    claim = functools.partial(claim_ms, limit=CLAIM_LIMIT)
    try:
        # The claim's tables are built once per engine (a million rows take
        # a while), in databases of their own; each round measures them.
        tables = {engine.name: (engine.fresh(2), engine.fresh(3)) for engine in engines}
        for big, small in tables.values():
            _build_claim_table(big, finished)
            _build_claim_table(small, SMALL)
        for round_ in range(bench.rounds):
            for engine in engines:
                rates = _mixed(engine, drain, round_)
                measured.add(f"{engine.name}/typical", rates["typical"], rates["zero"])
                measured.add(f"{engine.name}/spread", rates["spread"], rates["zero"])
                big, small = tables[engine.name]
                measured.add(
                    f"{engine.name}/claim", *bench.go(taking_turns, big, small, claim, CLAIMS)
                )
                measured.add(f"{engine.name}/idle", *_idle(engine))
    finally:
        for drop in drops:
            drop()
    figures = []
    for engine in engines:
        name = engine.name
        rows = [
            (
                "typical",
                f"{name}: deliveries/s, {drain:,} rows, 10% at priority 5, 80% at 0, 10% at -5, "
                f"concurrency {CONCURRENCY}",
                "deliveries/s",
                f"the same {drain:,} rows, every priority 0",
                ">= 0.95x",
                at_least(0.95),
            ),
            (
                "spread",
                f"{name}: deliveries/s, {drain:,} rows, priorities -10..10 alike, "
                f"concurrency {CONCURRENCY}",
                "deliveries/s",
                f"the same {drain:,} rows, every priority 0",
                ">= 0.95x",
                at_least(0.95),
            ),
            (
                "claim",
                f"{name}: one claim_due of {CLAIM_LIMIT} among {DUE:,} due rows of mixed "
                f"priorities, {finished:,} finished rows in the table (median of {CLAIMS})",
                "ms",
                f"the same claim among {SMALL:,} finished rows",
                "<= 1.2x",
                ratio_at_most(1.2),
            ),
            (
                "idle",
                f"{name}: an idle claim among {RETRYING:,} retries due within 50 min, "
                "priorities -10..10",
                "ms",
                "the same retries, every priority 0",
                "(its cost)",
                lambda figure: True,
            ),
        ]
        figures += measured.figures(name, rows, "priority")
    if bench.quick:
        notes.append(
            f"priority section (--quick): {drain:,} rows drained (full: {DRAIN:,}), "
            f"{finished:,} finished rows (full: {FINISHED:,})"
        )
    return Outcome(figures, notes)
