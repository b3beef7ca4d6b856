"""The performance report: every figure beside a raw baseline or a peer
library measured in the same run on the same machine, with the ratio and
the target.

    .venv/bin/python scripts/bench.py                  # every section, 3 rounds
    .venv/bin/python scripts/bench.py --quick          # every section, about 5 minutes
    .venv/bin/python scripts/bench.py --section huey   # one group (repeat for more)
    .venv/bin/python scripts/bench.py --json bench-results.json
    .venv/bin/python scripts/bench.py --capped-backlog # the claim scan behind a capped backlog

Sections (``--section``; default: all of them, in this order):

- ``core``: enqueue, ``enqueue_many``, deliveries, wake latency, the claim
  tick and RSS, each beside plain sqlite3; the SQLite row of the engines table.
- ``huey``: one producer, 64 producers, one delivery worker, and one and two
  worker processes at the default concurrency beside huey's ``SqliteHuey``
  (same payload, synchronous=FULL).
- ``tx``: a caller's own transaction (raw sqlite3 / ``db.transaction()`` /
  with an enqueue inside) on trio and on asyncio; asyncio beside trio.
- ``table``: our throughput figures on an empty table and on one holding
  1,000,000 finished rows and their history (100,000 with ``--quick``).
- ``postgres``: PostgreSQL beside raw psycopg, pgqueuer and Python's Oban
  (deliveries at our default concurrency, 16, and at 64), with the cost
  account of each; skipped, with a note, when no server answers (Oban's
  figures when no Python 3.12 or PyPI is at hand).
- ``sync``: enqueue through the caller's own connection (``trio_dispatch.sync``)
  beside the same transaction without it, and another process's commit to
  our worker's transport start.
- ``webhook``: the webhook transport posting to a local HTTP/1.1 server in a
  process of its own: deliveries/s beside a bare httpx loop, at 100 ms server
  latency beside the ideal, and a healthy endpoint's rate beside a hung one
  (per-destination caps).
- ``capped`` (also ``--capped-backlog``): the claim scan of a worker with
  per-destination caps, on SQLite and PostgreSQL, with 200,000 due rows of a
  destination at its cap ahead of the others, beside the same scan with that
  backlog empty.
- ``ordering``: ordering keys on SQLite and PostgreSQL: 10,000 keys x 5 rows
  beside the same rows unkeyed; unkeyed deliveries and one claim beside a
  blocked key's 100,000-row backlog, and without it; one hot key beside the
  no-op transport at concurrency 1.
- ``schedules``: schedules (docs/schedules.md) on SQLite and PostgreSQL: the fire lag
  (p50, p99) of 1,000 schedules ``every: 1m`` spread by ``jitter_seconds:
  60`` over 4 worker processes, beside the same at one instant (jitter 0),
  and the ticks doubled; then the CPU of an idle worker with 1,000
  schedules beside one with none. About 12 minutes (it waits for minute
  boundaries); ``--quick`` 200 schedules, one tick each, about 8.
- ``tracing``: one producer's enqueues and a worker's deliveries with the
  ``[otel]`` extra and no tracer provider, and with an SDK provider whose
  exporter drops every span, each beside no tracing (docs/tracing.md).
- ``destinations``: destination policies (docs/destinations.md) on SQLite and
  PostgreSQL: 4 worker processes sharing ``rate: 200/s`` (starts beside
  ``200 x t``, the most in any window beyond the rate beside the burst); the
  others' deliveries and one claim beside a paused destination's 200,000
  pending rows; B's enqueue -> start p99 behind A's 100,000-row backlog
  (fair share) beside B alone; a rate that never binds beside no policy;
  the others' deliveries while the sweep expires a paused destination's
  100,000 past-due rows, beside the same rows with deadlines ahead.
- ``cancel``: an operator's cancel of a running command attempt (docs/controls.md)
  on SQLite and PostgreSQL: the p99 of 50 cancels, from the cancel to the
  command's process group gone (killed by a worker process, reaped),
  beside as many SIGTERMs sent straight to such a group; target 1 s.
- ``priority``: priorities (docs/controls.md) on SQLite and PostgreSQL: a drain of
  rows of priorities -10..10 beside the same rows at 0; one claim among
  1,000,000 finished rows beside 1,000; an idle claim among 20,000 retries
  of mixed priorities due within 50 minutes beside the same at 0.
- ``coalesce``: coalescing (docs/controls.md) on SQLite and PostgreSQL: 100,000
  enqueues replacing over 1,000 coalesce keys beside the same enqueues
  without a key, at 64 producer tasks and (10,000 of them) at 1; the
  waiting set checked to stay 1,000 rows.

The peers come with the ``bench`` extra (huey, pgqueuer, asyncpg, psycopg);
the webhook section needs the ``http`` extra (httpx).
Every ratio is the median of paired rounds' ratios. Within a round of the
side-by-side figures the two sides take turns, their order rotating, and
each side's value is its median turn (:func:`interleave` for the figures an
fsync per operation bounds, in one event loop; :func:`take_turns` for whole
runs), so that both sides meet the same moments of a shared machine. The
core section keeps its pairing: raw, then ours, once per round. Not a timed
test: the machines are shared and noisy; read the ratios.

The sections live in ``scripts/benchmarks/``, one module each, over one
shared harness (``harness.py``: figures, rounds and ratios, taking turns,
the report); ``benchmarks/sections.py`` is the registry of them. This file
is the command line.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sqlite3
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.harness import (
    BODY_JSON,
    ROOT,
    Bench,
    Figure,
    format_loads,
    markdown,
    print_report,
    version_of,
)
from benchmarks.sections import SECTIONS


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--quick", action="store_true", help="smaller runs, about 5 minutes for every section"
    )
    parser.add_argument("--backend", choices=["trio", "asyncio"], default="trio")
    parser.add_argument(
        "--section",
        action="append",
        choices=[*SECTIONS, "all"],
        default=None,
        help=f"run one group of figures (repeatable; default all): {', '.join(SECTIONS)}",
    )
    parser.add_argument(
        "--capped-backlog",
        action="store_true",
        help="run the capped section (the claim scan behind a capped destination's "
        "200,000-row backlog, both engines); with --section, besides those",
    )
    parser.add_argument(
        "--json",
        metavar="FILE",
        default=None,
        help="write the figures as JSON (default bench-results.json)",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=None,
        help="paired rounds of the throughput figures (default 3, 1 with --quick)",
    )
    args = parser.parse_args()
    rounds = args.rounds if args.rounds is not None else (1 if args.quick else 3)
    if rounds < 1:
        parser.error(f"--rounds must be at least 1, got {rounds}")
    chosen = set(args.section or ([] if args.capped_backlog else ["all"]))
    if args.capped_backlog:
        chosen.add("capped")
    sections = [s for s in SECTIONS if "all" in chosen or s in chosen]
    started = time.perf_counter()
    load_before = os.getloadavg()
    figures: list[Figure] = []
    notes: list[str] = []
    engines: list[dict[str, Any]] = []
    seconds: dict[str, float] = {}
    for section in sections:
        began = time.perf_counter()
        with tempfile.TemporaryDirectory(dir=ROOT) as tmp:
            outcome = SECTIONS[section](Bench(args.quick, args.backend, rounds, Path(tmp)))
        seconds[section] = round(time.perf_counter() - began, 1)
        figures += outcome.figures
        notes += outcome.notes
        engines += outcome.engines
    load_after = os.getloadavg()
    print_report(figures, notes, engines)
    print(
        f"load average (1, 5, 15 min): before {format_loads(load_before)}, "
        f"after {format_loads(load_after)}; {os.cpu_count()} CPUs; {rounds} round(s); "
        "seconds by section: " + ", ".join(f"{k} {v:.0f}" for k, v in seconds.items())
    )
    if figures:
        print()
        print(markdown(figures))
    report = {
        "backend": args.backend,
        "quick": args.quick,
        "sections": sections,
        "python": platform.python_version(),
        "sqlite": sqlite3.sqlite_version,
        "peers": {p: version_of(p) for p in ("huey", "pgqueuer", "asyncpg", "psycopg")},
        "cpus": os.cpu_count(),
        "seconds": round(time.perf_counter() - started, 1),
        "seconds_by_section": seconds,
        "rounds": rounds,
        "load_before": list(load_before),
        "load_after": list(load_after),
        "payload_bytes": len(BODY_JSON),
        "figures": [f.row() for f in figures],
        "notes": notes,
        "engines": engines,
        "markdown": markdown(figures),
    }
    Path(args.json or ROOT / "bench-results.json").write_text(json.dumps(report, indent=2))
    print(f"\n({report['seconds']} s; JSON in {args.json or 'bench-results.json'})")


if __name__ == "__main__":
    main()
