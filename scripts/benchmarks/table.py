"""Section ``table``: our throughput figures on an empty table beside the
same on one holding 1,000,000 finished rows and their history (100,000 with
``--quick``), and the metrics scrape on the big table.
"""

from __future__ import annotations

import functools
import sqlite3
import time
from pathlib import Path

import anyio

from trio_dispatch import (
    open_store,
)
from trio_dispatch.outbox.reads import COUNT_CAP
from trio_dispatch.signal import dispatch_envelope_json, uuid7_bytes

from .harness import (
    BODY,
    BODY_JSON,
    TURNS,
    WARMUP,
    Bench,
    Outcome,
    Pairs,
    interleave,
    median_of_turns,
)
from .workloads import enqueue_side, flush_file, make_schema, noop, ours_deliveries


def build_history_table(path: Path, finished: int) -> tuple[int, float]:
    """``finished`` delivered dispatches shaped like real ones (UUIDv7 ids
    made as the store makes them, an envelope of the payload, timestamps
    spread over the 30 days before now in id order) with one ``delivered``
    transition each, written with plain sqlite3 (synchronous=OFF, 50,000
    rows per transaction) after the store made the schema. Returns what
    :func:`trim_history` keeps: the highest transition id and the time the
    table was built (every row is older)."""
    anyio.run(make_schema, path)
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("PRAGMA synchronous=OFF")
    now = time.time()
    first, span = now - 30 * 86400, 29 * 86400
    for offset in range(0, finished, 50_000):
        rows, history = [], []
        for i in range(offset, min(finished, offset + 50_000)):
            dispatch_id = uuid7_bytes().hex()
            route = f"seat-{i % 100}"
            created = first + span * i / finished
            payload = dispatch_envelope_json(
                dispatch_id=dispatch_id,
                kind="bench",
                deliver_to=route,
                ack_token=None,
                body_json=BODY_JSON,
            )
            rows.append((dispatch_id, route, payload, created + 0.05, created, created + 0.05))
            history.append((dispatch_id, created + 0.05))
        conn.execute("BEGIN")
        conn.executemany(
            "INSERT INTO dispatch_outbox (id, kind, deliver_to, payload, status, attempt, "
            "next_attempt_at, created_at, updated_at) "
            "VALUES (?, 'bench', ?, ?, 'delivered', 1, ?, ?, ?)",
            rows,
        )
        conn.executemany(
            "INSERT INTO status_transitions (entity_type, entity_id, previous_status, status, "
            "reason_code, reason_summary, source, actor, metadata, created_at) "
            "VALUES ('dispatch', ?, 'delivering', 'delivered', 'dispatch.delivered.transport_ok', "
            "'transport succeeded on attempt 1', 'scheduler', 'dispatch_delivery_loop', "
            "'{\"attempt\": 1}', ?)",
            history,
        )
        conn.execute("COMMIT")
    conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    last: int = conn.execute("SELECT MAX(id) FROM status_transitions").fetchone()[0]
    conn.close()
    flush_file(path)
    return last, now


async def two_tables_enqueue(empty: Path, big: Path, n: int, per_call: int) -> list[float]:
    """Our enqueue rates on an empty store and on the big table,
    interleaved (``per_call`` 1: ``enqueue_dispatch``; else ``enqueue_many``)."""
    async with open_store(empty) as empty_db, open_store(big) as big_db:
        return await interleave(
            [enqueue_side(empty_db, BODY, per_call), enqueue_side(big_db, BODY, per_call)], n
        )


def trim_history(path: Path, last_transition: int, built_at: float) -> None:
    """Delete what a measurement added to the big table (rows created after
    it was built, transitions after its last), so that every measurement
    meets the same finished rows (untimed)."""
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("BEGIN IMMEDIATE")
    conn.execute("DELETE FROM status_transitions WHERE id > ?", (last_transition,))
    conn.execute("DELETE FROM dispatch_outbox WHERE created_at > ?", (built_at,))
    conn.execute("COMMIT")
    conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    conn.close()


async def scrape_rate(path: Path, seconds: float = 1.0) -> float:
    """Scrapes/s of what ``/metrics`` and the dashboard read from the store
    (``bounded_stats``: counts per status up to 10,000, oldest due, dead
    letters of 24 h), rendered as Prometheus text, for ``seconds``."""
    from trio_dispatch.outbox.reads import bounded_stats

    try:
        from trio_dispatch.web.metrics import families, render
    except ImportError:  # the web extra is missing: the reads alone
        families = render = None  # type: ignore[assignment]
    async with open_store(str(path)) as db:
        await bounded_stats(db)  # warm-up
        done, start = 0, time.perf_counter()
        while time.perf_counter() - start < seconds:
            stats = await bounded_stats(db)
            if families is not None and render is not None:
                render(families(stats, None, time.time()))
            done += 1
        return done / (time.perf_counter() - start)


def run_table(bench: Bench) -> Outcome:
    """Our throughput figures on an empty table and at 1,000,000 finished
    rows (built once; what each measurement adds is deleted after it)."""
    scale, at, go = bench.scale, bench.at, bench.go
    n1, m, k = 1500 * scale, 20000 * scale, 5000 * scale
    finished = 100_000 if bench.quick else 1_000_000
    big = at("history")
    started = time.perf_counter()
    last_transition, built_at = build_history_table(big, finished)
    built_in = time.perf_counter() - started
    size_mb = big.stat().st_size / 1e6

    def deliveries_at_empty() -> float:
        rate: float = go(ours_deliveries, at("empty-noop"), k // 4, noop, 64, 100, BODY)
        return rate

    def deliveries_at_big() -> float:
        rate: float = go(ours_deliveries, big, k // 4, noop, 64, 100, BODY)
        trim_history(big, last_transition, built_at)
        return rate

    # A table just past the metrics' count cap: beyond it, a scrape must cost
    # the same whatever the table holds.
    mid_rows = 2 * COUNT_CAP
    mid = at("scrape-mid")
    build_history_table(mid, mid_rows)
    pairs = Pairs()
    for i in range(bench.rounds):
        # Enqueues: both stores open, the two sides taking turns.
        for key, count, per_call in (("e1", n1, 1), ("many", m, 1000)):
            empty, full = go(two_tables_enqueue, at(f"empty-{key}"), big, count, per_call)
            trim_history(big, last_transition, built_at)
            pairs.add(key, full, empty)
        # Deliveries: worker runs over k / 4 dispatches on each table in turns.
        got = median_of_turns({"empty": deliveries_at_empty, "big": deliveries_at_big}, 4, i)
        pairs.add("noop", got["big"], got["empty"])
        # Metrics: what a scrape reads from the store, on each table in turns.
        got = median_of_turns(
            {
                "empty": functools.partial(go, scrape_rate, mid),
                "big": functools.partial(go, scrape_rate, big),
            },
            3,
            i,
        )
        pairs.add("scrape", got["big"], got["empty"])
    rows = f"{finished:,} finished"
    base = (
        f"the same figure on an empty store in the same round; the big table: {rows} "
        f"dispatches (status delivered, UUIDv7 ids, the {len(BODY_JSON)}-byte payload's "
        f"envelope, timestamps over the past 30 days) and one transition each, no ANALYZE"
    )
    figures = [
        pairs.figure(
            "e1",
            f"enqueue, 1 producer, at {rows} / empty",
            "/s",
            f"{base}; {n1} enqueue_dispatch on each in {TURNS} turns taken in rotation, "
            f"both stores open, the median turn, after {WARMUP} untimed",
            0.9,
            "same, empty table",
            "table",
        ),
        pairs.figure(
            "many",
            f"enqueue_many, 1,000 per call, at {rows} / empty",
            "rows/s",
            f"{base}; {m} rows on each in {TURNS} turns taken in rotation, both stores open, "
            f"the median turn",
            0.9,
            "same, empty table",
            "table",
        ),
        pairs.figure(
            "noop",
            f"deliveries, no-op callable, 1 worker, at {rows} / empty",
            "/s",
            f"{base}; one DispatchWorker (concurrency 64) over {k // 4} dispatches queued "
            f"beforehand, 4 turns on each table taken in rotation, the median turn",
            0.9,
            "same, empty table",
            "table",
        ),
    ]
    figures.append(
        pairs.figure(
            "scrape",
            f"a /metrics scrape's store reads, at {rows} / at {mid_rows:,}",
            "/s",
            f"the same figure on a table of {mid_rows:,} finished rows built the same way "
            f"(twice the count cap: each status is counted up to {COUNT_CAP:,}, so the cost "
            f"grows up to the cap and must stay flat beyond it); bounded_stats (capped "
            "counts per status on the partial indexes, oldest due, dead letters of 24 h) "
            "plus the Prometheus rendering, scraping for 1 s, 3 turns on each table in "
            "rotation",
            0.8,
            f"same, {mid_rows:,} rows",
            "table",
        )
    )
    note = (
        f"table section: the {rows}-row table ({size_mb:,.0f} MB) took {built_in:.0f} s to "
        f"build; after each measurement on it the rows and transitions it added are deleted"
    )
    return Outcome(figures, [note])
