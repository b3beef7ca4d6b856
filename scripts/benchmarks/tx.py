"""Section ``tx``: a caller's own transaction (raw sqlite3 /
``db.transaction()`` / with an enqueue inside) on trio and on asyncio, and
our figures on asyncio beside trio.
"""

from __future__ import annotations

import functools
import itertools
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Final

from trio_dispatch import (
    enqueue_dispatch,
    open_store,
)
from trio_dispatch.store import Store

from .harness import (
    BODY,
    BODY_JSON,
    TURNS,
    WARMUP,
    Bench,
    Figure,
    Outcome,
    Pairs,
    Side,
    interleave,
    median_of_turns,
    sync_side,
    take_turns,
)
from .workloads import (
    APP_INSERT,
    APP_TABLE,
    noop,
    ours_concurrent_enqueue,
    ours_deliveries,
    ours_enqueue_many,
    ours_single_enqueue,
    raw_caller_tx,
)

BACKENDS: Final = ("trio", "asyncio")


async def caller_tx_rates(
    raw_path: Path, plain_path: Path, enqueue_path: Path, n: int, turns: int = TURNS
) -> list[float]:
    """Transactions/s, interleaved: (a) plain sqlite3 (WAL, synchronous=FULL):
    BEGIN IMMEDIATE; one INSERT into the caller's table; COMMIT; (b) ``async
    with db.transaction() as tx`` holding the same INSERT; (c) the same plus
    ``enqueue_dispatch(tx, ...)`` of the payload. Each on a file of its own."""
    conn, raw = raw_caller_tx(raw_path)
    serial = itertools.count()  # order ids of our side (a file of its own)

    def caller(db: Store, enqueue: bool) -> Side:
        async def side(count: int) -> None:
            for _ in range(count):
                async with db.transaction() as tx:
                    await tx.execute(APP_INSERT, (f"order-{next(serial)}", BODY_JSON, time.time()))
                    if enqueue:
                        await enqueue_dispatch(
                            tx, kind="order.created", deliver_to="seat-1", body=BODY
                        )

        return side

    try:
        async with open_store(plain_path) as plain_db, open_store(enqueue_path) as enqueue_db:
            for db in (plain_db, enqueue_db):
                async with db.transaction() as tx:
                    await tx.execute(APP_TABLE)
            return await interleave(
                [sync_side(raw), caller(plain_db, False), caller(enqueue_db, True)], n, turns
            )
    finally:
        conn.close()


def run_tx(bench: Bench) -> Outcome:
    """A caller's own transaction beside raw sqlite3, and each of our
    throughput figures on asyncio beside trio (each side in its own
    ``anyio.run``; which backend goes first alternates by round)."""
    scale, at, go = bench.scale, bench.at, bench.go
    n_tx, n1, n64, m, k = 800 * scale, 1500 * scale, 6400 * scale, 20000 * scale, 5000 * scale
    pairs = Pairs()

    def on(backend: str, fn: Any, *args: Any) -> Callable[[], Any]:
        return functools.partial(go, fn, *args, backend=backend)

    for i in range(bench.rounds):
        # The caller transactions: 4 turns per backend, each of n_tx / 4
        # transactions on each of the three sides (taking 5 turns inside).
        files = {b: (at(f"raw-{b}"), at(f"tx-{b}"), at(f"txe-{b}")) for b in BACKENDS}
        tx = take_turns(
            {b: on(b, caller_tx_rates, *files[b], n_tx // 4, TURNS // 4) for b in BACKENDS},
            4,
            i,
        )
        medians = {
            b: [statistics.median(side) for side in zip(*tx[b], strict=True)] for b in BACKENDS
        }
        for b in BACKENDS:
            raw, plain, with_enqueue = medians[b]
            pairs.add(f"tx-{b}", plain, raw)
            pairs.add(f"txe-{b}", with_enqueue, plain)
        pairs.add("vs-tx", medians["asyncio"][1], medians["trio"][1])
        pairs.add("vs-txe", medians["asyncio"][2], medians["trio"][2])
        # Our throughput figures, each backend on a file of its own, in turns.
        measures: tuple[tuple[str, int, Callable[[str], Callable[[], Any]]], ...] = (
            ("e1", 10, lambda b: on(b, ours_single_enqueue, at(f"e1-{b}"), n1 // 10, BODY, 5)),
            (
                "e64",
                5,
                lambda b: on(b, ours_concurrent_enqueue, at(f"e64-{b}"), n64 // 5, 64, BODY, 5),
            ),
            ("many", 5, lambda b: on(b, ours_enqueue_many, at(f"many-{b}"), m // 5, BODY)),
            (
                "noop",
                5,
                lambda b: on(b, ours_deliveries, at(f"noop-{b}"), k // 5, noop, 64, 100, BODY),
            ),
        )
        for key, turns, measure in measures:
            got = median_of_turns({b: measure(b) for b in BACKENDS}, turns, i)
            pairs.add(f"vs-{key}", got["asyncio"], got["trio"])
    figures: list[Figure] = []
    for backend in ("trio", "asyncio"):
        figures.append(
            pairs.figure(
                f"tx-{backend}",
                f"caller tx + 1 INSERT, vs raw sqlite3 tx ({backend})",
                "/s",
                f"raw sqlite3 tx/s (WAL, synchronous=FULL): BEGIN IMMEDIATE; one INSERT of "
                f"a {len(BODY_JSON)}-byte row into the caller's table; COMMIT; ours: "
                f"`async with db.transaction() as tx: await tx.execute(INSERT)`, the same "
                f"row, on {backend}; each on a file of its own; {n_tx // TURNS} "
                f"transactions a turn, {TURNS} turns each taken in rotation with the enqueue "
                f"figure's (in 4 event loops, alternating with the other backend's), the "
                f"median turn, {WARMUP} untimed in each loop",
                0.65,
                "raw sqlite3 tx",
                "tx",
            )
        )
    for backend in ("trio", "asyncio"):
        figures.append(
            pairs.figure(
                f"txe-{backend}",
                f"caller tx + INSERT + enqueue_dispatch, vs without ({backend})",
                "/s",
                f"the same caller transaction without the enqueue (the figure above, in the "
                f"same turns); ours adds `await enqueue_dispatch(tx, kind=..., "
                f"deliver_to=..., body=...)` of the same payload to each, on {backend}",
                0.85,
                "same tx without enqueue",
                "tx",
            )
        )
    payload = f"the {len(BODY_JSON)}-byte payload"
    for key, what, measured in (
        ("tx", "caller tx + 1 INSERT", "the caller transactions above (4 turns)"),
        ("txe", "caller tx + INSERT + enqueue", "the caller transactions above (4 turns)"),
        ("e1", "enqueue, 1 producer", f"10 turns of {n1 // 10} enqueue_dispatch of {payload}"),
        (
            "e64",
            "enqueue, 64 producer tasks",
            f"5 turns of {n64 // 5} enqueue_dispatch from 64 tasks, {payload}",
        ),
        ("many", "enqueue_many, 1,000 per call", f"5 turns of {m // 5} rows of {payload}"),
        (
            "noop",
            "deliveries, no-op callable, 1 worker",
            f"5 turns of one DispatchWorker (concurrency 64) over {k // 5} dispatches "
            f"queued beforehand",
        ),
    ):
        figures.append(
            pairs.figure(
                f"vs-{key}",
                f"asyncio vs trio: {what}",
                "rows/s" if key == "many" else "/s",
                f"ours on trio in the same round, the backends taking turns (each turn its "
                f"own anyio.run on that backend's file, the order rotating), the median "
                f"turn: {measured}",
                0.85,
                "ours on trio",
                "tx",
            )
        )
    return Outcome(figures)
