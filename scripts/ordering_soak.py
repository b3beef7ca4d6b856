"""Ordering keys under real processes (docs/ordering.md): worker processes that are
SIGKILLed and restarted, or left alone, on one store, and a log of every
attempt's start and end from inside the transport.

Each worker's transport appends, per attempt, a start line and (unless the
process dies first) an end line to one log opened with O_APPEND:
``S|E <dispatch id> <attempt> <key> <incarnation> <monotonic seconds>``.
The incarnation names one spawned worker process; the driver records when
each one died (after SIGKILL, once reaped; after its SIGTERM, once exited).

The checks (:func:`ordering_figures`): nothing lost, no (id, attempt) sent
twice, per key the rows started in enqueue order, and no two attempts of a
key overlapping in time. An attempt without an end line was cut by its
process's death; its end is taken as that process's death as the driver
saw it (reaped): a moment at or after the attempt really stopped, so an
overlap the check reports is one that happened. (The start of the row's
recovery attempt would not do: it is the very moment the check questions.)

    .venv/bin/python scripts/ordering_soak.py kills   [--keys 50] [--per-key 40] [--store URL]
    .venv/bin/python scripts/ordering_soak.py workers [--keys 200] [--per-key 10] --store URL
"""

from __future__ import annotations

import argparse
import collections
import itertools
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from soaks import common

OVERLAPPING_KEYS = (
    "SELECT ordering_key FROM dispatch_outbox WHERE status = 'delivering' "
    "GROUP BY ordering_key HAVING COUNT(*) > 1"
)
"""Keys with two rows ``delivering`` at once (must never return a row)."""


def role_ordered_worker(db: str, log: str, incarnation: str, concurrency: int, seed: int) -> None:
    """A worker process whose transport logs each attempt's start and end
    (the key is the row's ``deliver_to``) and takes a few milliseconds."""
    import anyio

    from trio_dispatch import Delivery, DispatchWorker, open_store

    fd = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    rng = random.Random(f"{seed}:{incarnation}")

    def line(mark: str, delivery: Delivery) -> None:
        os.write(
            fd,
            f"{mark} {delivery.dispatch_id} {delivery.attempt} {delivery.deliver_to} "
            f"{incarnation} {time.monotonic():.6f}\n".encode(),
        )

    async def send(delivery: Delivery) -> None:
        line("S", delivery)
        await anyio.sleep(rng.random() * 0.01)  # kills land mid-send too
        line("E", delivery)

    async def main() -> None:
        async with open_store(db) as store:
            # Lease 2 s (0.5 s timeout + 1.5 s margin): a killed worker's rows,
            # and so their keys, come back sooner than with the 5 s default.
            worker = DispatchWorker(
                store,
                transport=send,
                concurrency=concurrency,
                batch_size=32,
                tick_seconds=0.2,
                timeout_seconds=0.5,
                grace_seconds=2,
                lease_margin_seconds=1.5,
                ordering_on_dead_letter="block",
            )
            await common.run_until_signalled(worker)

    anyio.run(main, backend="trio")


def _spawn(*args: str, log: Path) -> subprocess.Popen[bytes]:
    return common.spawn(*args, log=log, script=__file__)


def _enqueue_round(db: Path | str, keys: list[str], round_no: int) -> list[tuple[str, str]]:
    """One row for each key (in one ``enqueue_many``); (key, id) in enqueue order."""
    import anyio

    from trio_dispatch import enqueue_many, open_store

    async def enqueue() -> list[tuple[str, str]]:
        async with open_store(db) as store:
            results = await enqueue_many(
                store,
                [
                    {
                        "kind": "ordered",
                        "deliver_to": key,
                        "ordering_key": key,
                        "body": {"n": round_no},
                        "max_attempts": 100,  # kills only: no row may die of them
                    }
                    for key in keys
                ],
            )
            return [(key, result.id) for key, result in zip(keys, results, strict=True)]

    return anyio.run(enqueue)


def read_attempts(path: Path) -> list[dict[str, Any]]:
    """The attempts of the log, each with its start and (None if cut) end."""
    attempts: dict[tuple[str, int], dict[str, Any]] = {}
    starts: collections.Counter[tuple[str, int]] = collections.Counter()
    if not path.exists():
        return []
    for text in path.read_text().splitlines():
        parts = text.split()
        if len(parts) != 6:  # a line cut by a kill
            continue
        mark, dispatch_id, attempt, key, incarnation, at = parts
        pair = (dispatch_id, int(attempt))
        if mark == "S":
            starts[pair] += 1
            attempts[pair] = {
                "id": dispatch_id,
                "attempt": int(attempt),
                "key": key,
                "incarnation": incarnation,
                "start": float(at),
                "end": None,
                "starts": starts[pair],
            }
        elif pair in attempts:
            attempts[pair]["end"] = float(at)
    return list(attempts.values())


def ordering_figures(
    enqueued: dict[str, list[str]],
    attempts: list[dict[str, Any]],
    deaths: dict[str, float],
    statuses: dict[str, str],
) -> dict[str, Any]:
    """What the run shows: rows lost, (id, attempt) pairs sent twice, keys
    whose rows started out of enqueue order, and overlaps of two attempts of
    one key (a cut attempt ends at its process's death)."""
    ids = {dispatch_id for rows in enqueued.values() for dispatch_id in rows}
    by_key: dict[str, list[dict[str, Any]]] = collections.defaultdict(list)
    cut = 0
    for attempt in attempts:
        if attempt["end"] is None:
            cut += 1
            attempt["end"] = deaths.get(attempt["incarnation"], float("inf"))
        by_key[attempt["key"]].append(attempt)
    out_of_order, overlaps, examples = [], 0, []
    for key, rows in enqueued.items():
        runs = sorted(by_key.get(key, []), key=lambda a: a["start"])
        started: list[str] = []
        for attempt in runs:
            if not started or started[-1] != attempt["id"]:
                started.append(attempt["id"])
        if started != rows:
            out_of_order.append(key)
        for before, after in itertools.pairwise(runs):
            if before["end"] > after["start"]:
                overlaps += 1
                if len(examples) < 3:
                    examples.append({"key": key, "before": before, "after": after})
    return {
        "rows": len(ids),
        "lost": sum(1 for i in ids if statuses.get(i) != "delivered"),
        "never_sent": len(ids - {a["id"] for a in attempts}),
        "duplicate_pairs": sum(1 for a in attempts if a["starts"] > 1),
        "attempts": len(attempts),
        "cut_attempts": cut,
        "keys_out_of_order": len(out_of_order),
        "overlaps": overlaps,
        "overlap_examples": examples,
    }


class _Poller:
    """Polls the store for a key with two rows ``delivering``, in a thread,
    until stopped; counts the polls and keeps what it found."""

    def __init__(self, db: Path | str) -> None:
        self.db, self.polls, self.found = db, 0, []  # type: ignore[var-annotated]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.found.extend(
                row["ordering_key"] for row in common.query(self.db, OVERLAPPING_KEYS)
            )
            self.polls += 1
            self._stop.wait(0.01)

    def __enter__(self) -> _Poller:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def ordered_soak(
    workdir: Path,
    keys: int = 50,
    per_key: int = 40,
    workers: int = 2,
    kills: int = 10,
    concurrency: int = 8,
    store: str | None = None,
    poll: bool = False,
    seed: int = 4,
) -> dict[str, Any]:
    """``workers`` worker processes on one store (a SQLite file in workdir,
    or the PostgreSQL URL given) deliver ``keys`` x ``per_key`` keyed rows,
    enqueued one row a key at a time while they run. With ``kills``, a
    worker is SIGKILLed that many times, at random moments once it has
    sent something, and restarted; then all run until every row is
    delivered. With ``poll``, the store is polled throughout for a key with
    two rows ``delivering``."""
    rng = random.Random(seed)
    db: Path | str = store or workdir / "ordered.db"
    log, errors = workdir / "ordered.attempts", workdir / "ordered.log"
    common.make_schema(db)
    names = [f"key-{k:03d}" for k in range(keys)]
    enqueued: dict[str, list[str]] = {name: [] for name in names}
    deaths: dict[str, float] = {}
    spawned = 0

    def spawn() -> tuple[str, subprocess.Popen[bytes]]:
        nonlocal spawned
        spawned += 1
        name = f"w{spawned}"
        return name, _spawn(
            "ordered", str(db), str(log), name, str(concurrency), str(seed), log=errors
        )

    def enqueue(round_no: int) -> None:
        for key, dispatch_id in _enqueue_round(db, names, round_no):
            enqueued[key].append(dispatch_id)

    started = time.monotonic()
    poller = _Poller(db) if poll else None
    if poller:
        poller.__enter__()
    running: list[tuple[str, subprocess.Popen[bytes]]] = []
    try:
        running.extend(spawn() for _ in range(workers))
        rounds = 0
        # Production spreads over the kills: a row behind a live head waits,
        # and each end, kill or lease recovery meets keys half enqueued.
        per_kill = max(1, per_key // (kills + 1)) if kills else 1
        for kill in range(kills):
            for _ in range(per_kill):
                if rounds < per_key:
                    enqueue(rounds)
                    rounds += 1
            name, victim = running.pop(kill % len(running))
            # Killed while it has an attempt open (a send started, not
            # ended), a random 0-3 ms after that was seen: each kill cuts a
            # send, however fast the rows go (else within 5 s, regardless).
            _wait_mid_send(log, name, deadline=time.monotonic() + 5)
            time.sleep(rng.uniform(0.0, 0.003))
            victim.send_signal(signal.SIGKILL)
            victim.wait()
            deaths[name] = time.monotonic()
            running.append(spawn())
        while rounds < per_key:
            enqueue(rounds)
            rounds += 1
            if not kills:
                time.sleep(0.02)
        total = keys * per_key
        finished = _wait_delivered(db, total, timeout=60 + total / 20)
        alive_at_end = sum(1 for _, process in running if process.poll() is None)
        codes = []
        for name, process in running:
            codes.append(common.stop(process))
            deaths[name] = time.monotonic()
    finally:
        # Cut short (an error, a test's timeout): no worker outlives the run
        # to write into the next one's database.
        for _, process in running:
            if process.poll() is None:
                process.kill()
                process.wait()
        if poller:
            poller.__exit__()
    statuses = {
        row["id"]: row["status"]
        for row in common.query(db, "SELECT id, status FROM dispatch_outbox")
    }
    figures: dict[str, Any] = {
        "driver": "ordered",
        "engine": "postgresql" if common.is_postgres(db) else "sqlite",
        "keys": keys,
        "per_key": per_key,
        "workers": workers,
        "concurrency": concurrency,
        "kills": kills,
        **ordering_figures(enqueued, read_attempts(log), deaths, statuses),
        "all_delivered": finished,
        "workers_alive_at_end": alive_at_end,
        "worker_exits": codes,
        "seconds": round(time.monotonic() - started, 1),
    }
    if poller:
        figures["polls"] = poller.polls
        figures["keys_seen_delivering_twice"] = sorted(set(poller.found))
    figures["ok"] = (
        finished
        and figures["lost"] == 0
        and figures["duplicate_pairs"] == 0
        and figures["keys_out_of_order"] == 0
        and figures["overlaps"] == 0
        and not figures.get("keys_seen_delivering_twice")
        and alive_at_end == workers
        and codes == [0] * workers
    )
    if not figures["ok"] and errors.exists():
        figures["worker_log_tail"] = errors.read_text()[-2000:]
    return figures


def _wait_mid_send(log: Path, incarnation: str, deadline: float) -> None:
    """Return once the attempt log shows ``incarnation`` with a send
    started and not ended (or at ``deadline``)."""
    offset, pending, open_sends = 0, b"", set()
    while time.monotonic() < deadline:
        if log.exists():
            with log.open("rb") as lines:
                lines.seek(offset)
                chunk = lines.read()
            offset += len(chunk)
            *complete, pending = (pending + chunk).split(b"\n")
            for text in complete:
                parts = text.decode().split()
                if len(parts) == 6 and parts[4] == incarnation:
                    pair = (parts[1], parts[2])
                    if parts[0] == "S":
                        open_sends.add(pair)
                    else:
                        open_sends.discard(pair)
            if open_sends:
                return
        time.sleep(0.001)


def _wait_delivered(db: Path | str, expected: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = common.query(
            db, "SELECT COUNT(*) AS n FROM dispatch_outbox WHERE status = 'delivered'"
        )
        if int(found[0]["n"]) >= expected:
            return True
        time.sleep(0.2)
    return False


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--role":
        role, args = sys.argv[2], sys.argv[3:]
        if role == "ordered":
            role_ordered_worker(args[0], args[1], args[2], int(args[3]), int(args[4]))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("driver", choices=["kills", "workers"])
    parser.add_argument("--keys", type=int)
    parser.add_argument("--per-key", type=int)
    parser.add_argument("-k", type=int, default=10, help="kills: how many")
    parser.add_argument("--store", help="a postgresql:// URL (its tables empty) instead of SQLite")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(dir=common.ROOT) as tmp:
        if args.driver == "kills":
            figures = ordered_soak(
                Path(tmp), args.keys or 50, args.per_key or 40, kills=args.k, store=args.store
            )
        else:
            figures = ordered_soak(
                Path(tmp),
                args.keys or 200,
                args.per_key or 10,
                workers=4,
                kills=0,
                concurrency=8,
                store=args.store,
                poll=True,
            )
    print(json.dumps(figures))
    sys.exit(0 if figures["ok"] else 1)


if __name__ == "__main__":
    main()
