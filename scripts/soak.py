"""Reliability drivers: crash soak, several workers, dedup race.

Each prints its figures and exits non-zero if the outbox broke its promise
(a row lost, an (id, attempt) sent twice, a worker dead of SQLITE_BUSY, a
dedup caller told the wrong id). The test suite runs small versions of the
same functions (tests/process/test_soak.py); the roles they start are in
scripts/soaks/roles.py.

    .venv/bin/python scripts/soak.py crash   [-n 5000] [-k 50] [--cancel-rate 0.1]
                                             [--coalesce-rate 0.2]
    .venv/bin/python scripts/soak.py workers [-n 10000] [-w 4]
    .venv/bin/python scripts/soak.py dedup   [-n 1000] [-p 8]
    .venv/bin/python scripts/soak.py all     (the three, default sizes)
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import random
import signal
import sqlite3
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # soaks/, when a test imports this

from soaks.common import (
    ROOT,
    TERMINAL,
    is_postgres,
    ledger_figures,
    make_schema,
    outbox_rows,
    query,
    read_ledger,
    spawn,
    stop,
    wait_terminal,
)
from soaks.roles import COALESCE_KEYS, POLICY_ENV, run_role

CANCELLED_REASON = "dispatch.cancelled.operator"
SUPERSEDED_REASON = "dispatch.superseded.coalesced"


def _spawn(*args: str, log: Path | None = None) -> subprocess.Popen[bytes]:
    """A role of this driver (:mod:`soaks.roles`) as a child process, its
    stderr appended to ``log``."""
    return spawn(*args, script=__file__, log=log)


# -- the drivers -------------------------------------------------------------------


def crash_soak(
    workdir: Path,
    n: int = 5000,
    kills: int = 50,
    seed: int = 1,
    policy: dict[str, Any] | None = None,
    fail_rate: float = 0.0,
    cancel_rate: float = 0.0,
    coalesce_rate: float = 0.0,
    store: str | None = None,
) -> dict[str, Any]:
    """A producer enqueues n dispatches while the worker process is SIGKILLed
    at random moments and restarted, `kills` times; then one worker finishes.
    With ``policy`` (a destination policy, e.g. a rate and a breaker) every
    role runs with it over three destinations; with ``fail_rate`` a seeded
    share of sends fail (so a breaker opens and rows retry); with
    ``cancel_rate`` an operator process cancels that share of the rows as
    they are committed, waiting or running (docs/controls.md): each ends
    ``cancelled`` with its transition, or delivered first (too late); with
    ``coalesce_rate`` that share of the enqueues replace their coalesce
    key's waiting row (docs/controls.md): a superseded row is accounted for by its
    transition, and is never sent. On a SQLite file in workdir, or the
    PostgreSQL URL ``store`` (its tables empty)."""
    rng = random.Random(seed)
    if policy is None:
        os.environ.pop(POLICY_ENV, None)
    else:
        os.environ[POLICY_ENV] = json.dumps(policy)
    db: Path | str = store or workdir / "crash.db"
    ledger, ids_file = workdir / "crash.ledger", workdir / "crash.ids"
    log = workdir / "crash.log"
    make_schema(db)
    started = time.monotonic()
    pace = kills * 0.4 / max(1, n / 25)  # spread production over the kills
    producer = _spawn(
        "producer",
        str(db),
        str(ids_file),
        str(n),
        str(pace),
        str(coalesce_rate),
        str(seed),
        log=log,
    )
    stop_cancels = workdir / "crash.cancels-done"
    canceller = (
        _spawn("canceller", str(db), str(ids_file), str(cancel_rate), str(seed), str(stop_cancels))
        if cancel_rate > 0
        else None
    )
    for _ in range(kills):
        sent_before = ledger.stat().st_size if ledger.exists() else 0
        worker = _spawn("worker", str(db), str(ledger), str(fail_rate), str(seed), log=log)
        # Kill while it works: once it has sent something, at a random point
        # of its claim / send / finish cycle.
        deadline = time.monotonic() + 3
        while time.monotonic() < deadline and (
            not ledger.exists() or ledger.stat().st_size == sent_before
        ):
            time.sleep(0.005)
        time.sleep(rng.uniform(0.0, 0.08))
        worker.send_signal(signal.SIGKILL)
        worker.wait()
    producer_code = producer.wait(timeout=300)
    stop_cancels.touch()
    canceller_code = 0 if canceller is None else canceller.wait(timeout=300)
    final = _spawn("worker", str(db), str(ledger), str(fail_rate), str(seed), log=log)
    finished = wait_terminal(db, n, timeout=60 + n / 50)
    final_code = stop(final)
    os.environ.pop(POLICY_ENV, None)
    ids = set(ids_file.read_text().split())
    rows = outbox_rows(db)
    cancelled = {i for i in ids if i in rows and rows[i]["status"] == "cancelled"}
    recorded = {
        r["entity_id"]
        for r in query(
            db,
            "SELECT entity_id FROM status_transitions WHERE reason_code = ? AND status = ?",
            (CANCELLED_REASON, "cancelled"),
        )
    }
    superseded = {i for i in ids if i in rows and rows[i]["status"] == "superseded"}
    replaced = {
        r["entity_id"]
        for r in query(
            db,
            "SELECT entity_id FROM status_transitions WHERE reason_code = ? AND status = ?",
            (SUPERSEDED_REASON, "superseded"),
        )
    }
    sent = {i for i, _ in read_ledger(ledger)}
    figures = {
        "driver": "crash soak",
        "engine": "postgresql" if is_postgres(db) else "sqlite",
        "n": n,
        "kills": kills,
        "policy": policy,
        "fail_rate": fail_rate,
        "cancel_rate": cancel_rate,
        "coalesce_rate": coalesce_rate,
        "committed_ids": len(ids),
        "lost": len(ids - set(rows))
        + sum(1 for i in ids if i in rows and rows[i]["status"] not in TERMINAL),
        "all_terminal": finished,
        "statuses": dict(collections.Counter(r["status"] for r in rows.values())),
        # A cancelled row is accounted for by its transition; it may never
        # have been sent (cancelled waiting, or cut before its send).
        "cancelled_without_transition": len(cancelled - recorded),
        "cancelled_after_a_send": len(cancelled & sent),
        # A superseded row waited unclaimed until a newer enqueue of its key
        # replaced it: accounted for by its transition, never sent.
        "superseded": len(superseded),
        "superseded_without_transition": len(superseded - replaced),
        "superseded_after_a_send": len(superseded & sent),
        **ledger_figures(ids - cancelled - superseded, read_ledger(ledger)),
        "producer_exit": producer_code,
        "canceller_exit": canceller_code,
        "final_worker_exit": final_code,
        "seconds": round(time.monotonic() - started, 1),
    }
    figures["ok"] = (
        figures["lost"] == 0
        and finished
        and len(ids) == n
        and figures["missing_from_ledger"] == 0
        and figures["duplicate_pairs"] == 0
        and figures["cancelled_without_transition"] == 0
        and (cancel_rate == 0 or len(cancelled) > 0)
        and figures["superseded_without_transition"] == 0
        and figures["superseded_after_a_send"] == 0
        and (coalesce_rate == 0 or len(superseded) > 0)
        # A failing send is sent again by design; without failures an id is
        # sent again only after a kill.
        and (fail_rate > 0 or figures["max_sends_of_one_id"] <= kills + 1)
        and final_code == 0
        and canceller_code == 0
    )
    return figures


def several_workers(
    workdir: Path,
    n: int = 10000,
    workers: int = 4,
    fail_rate: float = 0.1,
    seed: int = 2,
    store: str | None = None,
) -> dict[str, Any]:
    """`workers` worker processes on one store (a SQLite file in workdir, or
    the PostgreSQL URL given), n dispatches, a transport that fails a
    fraction of attempts (retried: time is pulled forward)."""
    import anyio

    from trio_dispatch import enqueue_many, open_store

    db: Path | str = store or workdir / "multi.db"
    ledger, log = workdir / "multi.ledger", workdir / "multi.log"

    async def produce() -> set[str]:
        ids: set[str] = set()
        async with open_store(db) as store:
            for offset in range(0, n, 1000):
                results = await enqueue_many(
                    store,
                    [
                        {"kind": "multi", "deliver_to": f"seat-{offset + i}", "max_attempts": 8}
                        for i in range(min(1000, n - offset))
                    ],
                )
                ids.update(r.id for r in results)
        return ids

    started = time.monotonic()
    ids = anyio.run(produce)
    procs = [
        _spawn("worker", str(db), str(ledger), str(fail_rate), str(seed), log=log)
        for _ in range(workers)
    ]
    finished = wait_terminal(db, n, timeout=60 + n / 50)
    alive_at_end = sum(1 for p in procs if p.poll() is None)
    codes = [stop(p) for p in procs]
    rows = outbox_rows(db)
    text = log.read_text() if log.exists() else ""
    figures = {
        "driver": "several workers",
        "n": n,
        "workers": workers,
        "fail_rate": fail_rate,
        "engine": "postgresql" if is_postgres(db) else "sqlite",
        "lost": len(ids - set(rows)) + sum(1 for i in ids if rows[i]["status"] not in TERMINAL),
        "all_terminal": finished,
        "statuses": dict(collections.Counter(r["status"] for r in rows.values())),
        "status_sum": len(rows),
        **ledger_figures(ids, read_ledger(ledger)),
        "busy_errors_logged": text.count("database is locked") + text.count("LockNotAvailable"),
        "workers_alive_at_end": alive_at_end,
        "worker_exits": codes,
        "seconds": round(time.monotonic() - started, 1),
    }
    figures["ok"] = (
        figures["lost"] == 0
        and finished
        and figures["status_sum"] == n
        and figures["duplicate_pairs"] == 0
        and figures["missing_from_ledger"] == 0
        and alive_at_end == workers
        and codes == [0] * workers
    )
    return figures


def dedup_race(workdir: Path, n: int = 1000, processes: int = 8, seed: int = 3) -> dict[str, Any]:
    """`processes` processes enqueue the same n dedup keys at once."""
    rng = random.Random(seed)
    db = workdir / "dedup.db"
    make_schema(db)
    keys = [f"key-{i}" for i in range(n)]
    orders, procs = [], []
    started = time.monotonic()
    for k in range(processes):
        order = keys[:]
        rng.shuffle(order)
        orders.append(order)
        (workdir / f"keys{k}.json").write_text(json.dumps(order))
        procs.append(
            subprocess.Popen(
                [
                    sys.executable,
                    __file__,
                    "--role",
                    "dedup",
                    str(db),
                    str(workdir / f"out{k}.json"),
                    str(workdir / f"keys{k}.json"),
                ],
                stderr=subprocess.PIPE,
            )
        )
    errors = [p.communicate(timeout=300)[1].decode()[-500:] for p in procs]
    conn = sqlite3.connect(db)
    winners = dict(conn.execute("SELECT dedup_key, id FROM dispatch_outbox").fetchall())
    rows, transitions = conn.execute(
        "SELECT (SELECT COUNT(*) FROM dispatch_outbox), (SELECT COUNT(*) FROM status_transitions)"
    ).fetchone()
    conn.close()
    wrong = 0
    for k, order in enumerate(orders):
        out = workdir / f"out{k}.json"
        got = json.loads(out.read_text()) if out.exists() else []
        wrong += sum(1 for key, value in zip(order, got, strict=False) if winners.get(key) != value)
        wrong += n - len(got)
    figures = {
        "driver": "dedup race",
        "keys": n,
        "processes": processes,
        "rows": rows,
        "transitions": transitions,
        "callers_told_wrong_id": wrong,
        "process_exits": [p.returncode for p in procs],
        "seconds": round(time.monotonic() - started, 1),
    }
    figures["ok"] = (
        rows == n == transitions and wrong == 0 and figures["process_exits"] == [0] * processes
    )
    if not figures["ok"]:
        figures["stderr_tails"] = [e for e in errors if e]
    return figures


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--role":
        run_role(sys.argv[2], sys.argv[3:])
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("driver", choices=["crash", "workers", "dedup", "all"])
    parser.add_argument("-n", type=int, help="dispatches (or keys)")
    parser.add_argument("-k", type=int, default=50, help="crash soak: kills")
    parser.add_argument(
        "--cancel-rate",
        type=float,
        default=0.1,
        help="crash soak: the share of rows an operator cancels as they come (default 0.1)",
    )
    parser.add_argument(
        "--coalesce-rate",
        type=float,
        default=0.2,
        help="crash soak: the share of enqueues that replace their coalesce key's waiting "
        f"row, over {COALESCE_KEYS} keys (default 0.2)",
    )
    parser.add_argument("-w", type=int, default=4, help="several workers: processes")
    parser.add_argument("-p", type=int, default=8, help="dedup race: processes")
    parser.add_argument(
        "--store",
        help="crash soak and several workers: a postgresql:// URL instead of "
        "a SQLite file (its tables must be empty)",
    )
    args = parser.parse_args()
    results = []
    with tempfile.TemporaryDirectory(dir=ROOT) as tmp:
        work = Path(tmp)
        if args.driver in ("crash", "all"):
            results.append(
                crash_soak(
                    work,
                    n=args.n or 5000,
                    kills=args.k,
                    cancel_rate=args.cancel_rate,
                    coalesce_rate=args.coalesce_rate,
                    store=args.store,
                )
            )
        if args.driver in ("workers", "all"):
            results.append(
                several_workers(work, n=args.n or 10000, workers=args.w, store=args.store)
            )
        if args.driver in ("dedup", "all"):
            results.append(dedup_race(work, n=args.n or 1000, processes=args.p))
    for figures in results:
        print(json.dumps(figures))
    sys.exit(0 if all(f["ok"] for f in results) else 1)


if __name__ == "__main__":
    main()
