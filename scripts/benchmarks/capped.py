"""Section ``capped`` (also ``--capped-backlog``): the claim scan behind a
capped destination's backlog.

A worker with per-destination caps leaves the destinations at their cap out
of its scans. The figure: the time of one scan (``claim_due`` with the
worker's caps, in its write transaction) on a store where the capped
destination holds a backlog of due rows ahead of everyone else's, beside
the same scan on a store where that backlog is empty; the two stores open
side by side, the scans taking turns. Also the idle path's read
(``next_due_at`` leaving the capped destination out). Both engines.
"""

from __future__ import annotations

import statistics
import time
import uuid
from typing import Any, Final

from trio_dispatch import open_store
from trio_dispatch.outbox import claim_due, next_due_at
from trio_dispatch.outbox.claim import ClaimRules, DestinationCaps
from trio_dispatch.store import Store

from .harness import Bench, Figure, Outcome, ratio_at_most
from .pgserver import postgres_database
from .workloads import ROW_COLUMNS, load_rows

BACKLOG: Final = 200_000
"""Due rows of the capped destination (``--quick``: the same; building
them takes a few seconds)."""
CAP: Final = 4
HEALTHY: Final = 8
"""Destinations below their cap, each with ``ROWS_EACH`` due rows queued
after the backlog."""
ROWS_EACH: Final = 20
LIMIT: Final = 64
"""The scan's limit (a worker's free slots, up to its batch size)."""
CAPPED: Final = "hung"

_COLUMNS: Final = (*ROW_COLUMNS, "next_attempt_at", "created_at", "updated_at")


def _rows(backlog: int, now: float) -> list[tuple[Any, ...]]:
    """The capped destination's backlog (due an hour ago onwards, one row a
    microsecond apart), then the healthy destinations' rows (due a minute
    ago onwards, interleaved)."""
    start = now - 3600
    rows = [
        (uuid.uuid4().hex, CAPPED, start + i * 1e-6, start + i * 1e-6, start)
        for i in range(backlog)
    ]
    for j in range(HEALTHY * ROWS_EACH):
        due = now - 60 + j * 1e-3
        rows.append((uuid.uuid4().hex, f"ok-{j % HEALTHY}", due, due, due))
    return rows


async def build(target: str, backlog: int) -> None:
    """An outbox (made by the store) holding :func:`_rows`, written with
    the engine's own driver; statistics gathered where the engine keeps
    them (PostgreSQL's autovacuum would, SQLite's never does by itself)."""
    async with open_store(target):
        pass
    load_rows(
        target,
        _COLUMNS,
        (
            (row_id, "bench", to, "{}", "pending", 0, due, created, updated)
            for row_id, to, due, created, updated in _rows(backlog, time.time())
        ),
        analyze=False,
    )


def _caps(*full: str) -> DestinationCaps:
    """A worker's caps with ``full`` destinations at their cap (attempts
    held well past the run)."""
    caps = DestinationCaps(CAP)
    until = time.time() + 86400
    for destination in full:
        for i in range(CAP):
            caps.hold(f"held-{destination}-{i}", destination, until)
    return caps


async def _claim_and_put_back(db: Store, caps: DestinationCaps) -> tuple[float, int]:
    """Seconds of one scan with ``caps``, and its claims; then (untimed)
    the claimed rows go back to pending at their old due time and their
    holds end, so the next scan meets the same store."""
    started = time.perf_counter()
    claims, _ = await claim_due(db, limit=LIMIT, caps=caps)
    elapsed = time.perf_counter() - started
    if claims:
        caps.drop([(claim.dispatch_id, claim.lease_until) for claim in claims])
        ids = [claim.dispatch_id for claim in claims]
        await db.write(
            lambda conn: conn.executemany(
                "UPDATE dispatch_outbox SET status = 'pending', attempt = 0, "
                "next_attempt_at = created_at WHERE id = ?",
                [(i,) for i in ids],
            )
        )
    return elapsed, len(claims)


async def scan_times(backlog_target: str, empty_target: str, scans: int) -> dict[str, float]:
    """Milliseconds (the median of ``scans`` turns each) of three reads,
    on the store with the backlog and on the one without, taking turns:
    ``claim`` (a scan that claims the healthy destinations' rows, up to
    their caps), ``nothing`` (every destination at its cap: the scan finds
    nothing it may claim) and ``next_due`` (the idle path's read)."""
    results: dict[str, list[float]] = {}
    async with open_store(backlog_target) as big, open_store(empty_target) as empty:
        healthy = [f"ok-{j}" for j in range(HEALTHY)]
        for name, store in (("big", big), ("empty", empty)):
            for key in ("claim", "nothing", "next_due"):
                results[f"{key}/{name}"] = []
            caps = _caps(CAPPED)
            _, claimed = await _claim_and_put_back(store, caps)  # warm, and check
            if claimed != HEALTHY * CAP:
                raise RuntimeError(f"the scan claimed {claimed}, not {HEALTHY * CAP}")
        for turn in range(scans):
            order = [("big", big), ("empty", empty)]
            for name, store in order if turn % 2 else order[::-1]:
                seconds, _ = await _claim_and_put_back(store, _caps(CAPPED))
                results[f"claim/{name}"].append(seconds * 1000)
                seconds, claimed = await _claim_and_put_back(store, _caps(CAPPED, *healthy))
                assert claimed == 0
                results[f"nothing/{name}"].append(seconds * 1000)
                started = time.perf_counter()
                due = await next_due_at(store, rules=ClaimRules((_caps(CAPPED),)))
                results[f"next_due/{name}"].append((time.perf_counter() - started) * 1000)
                assert due is not None
    return {key: statistics.median(values) for key, values in results.items()}


def run_capped(bench: Bench) -> Outcome:
    """A worker's claim scan (per-destination caps, one destination at its
    cap) with that destination's 200,000 due rows ahead of the others,
    beside the same scan with its backlog empty, on each engine; the two
    stores open side by side, their scans taking turns."""
    scans = 10 if bench.quick else 20
    engines: list[tuple[str, str, str]] = [
        ("SQLite", str(bench.at("capped-backlog")), str(bench.at("capped-empty")))
    ]
    notes: list[str] = []
    databases = [db for db in (postgres_database(), postgres_database()) if db is not None]
    if len(databases) == 2:
        engines.append(("PostgreSQL", databases[0][0], databases[1][0]))
    else:
        notes.append("capped section: PostgreSQL skipped, no server answered")
    measured: dict[str, tuple[list[float], list[float]]] = {}
    try:
        built: dict[str, float] = {}
        for engine, big, empty in engines:
            started = time.perf_counter()
            bench.go(build, big, BACKLOG)
            bench.go(build, empty, 0)
            built[engine] = time.perf_counter() - started
        for _ in range(bench.rounds):
            for engine, big, empty in engines:
                got = bench.go(scan_times, big, empty, scans)
                for key in ("claim", "nothing", "next_due"):
                    values, baselines = measured.setdefault(f"{engine}/{key}", ([], []))
                    values.append(got[f"{key}/big"])
                    baselines.append(got[f"{key}/empty"])
    finally:
        for _, drop in databases:
            drop()
    backlog = f"{BACKLOG:,}"
    setup = (
        f"the same on a store whose capped destination has no backlog; both stores hold "
        f"{HEALTHY} destinations below their cap (cap {CAP}) with "
        f"{ROWS_EACH} due rows each, one destination at its cap, and on the other "
        f"store its {backlog} due rows, all due before the others'; {scans} turns on each "
        f"store in rotation, the median turn"
    )
    figures = []
    for engine, _, _ in engines:
        for key, what in (
            ("claim", f"claim scan (limit {LIMIT}) taking the others' rows"),
            ("nothing", "claim scan finding nothing it may claim"),
            ("next_due", "idle path's next-due read"),
        ):
            values, baselines = measured[f"{engine}/{key}"]
            figures.append(
                Figure(
                    f"{engine}: {what}, {backlog}-row capped backlog / none",
                    values,
                    "ms",
                    baselines,
                    setup,
                    "<= 2x",
                    ratio_at_most(2.0),
                    "same, no backlog",
                    "capped",
                )
            )
    notes.append(
        "capped section: building the stores took "
        + ", ".join(f"{engine} {seconds:.0f} s" for engine, seconds in built.items())
    )
    return Outcome(figures, notes)
