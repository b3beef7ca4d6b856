"""The crash soak's roles, each run as a child process of ``scripts/soak.py``
(``soak.py --role NAME ARGS...``): a worker, a producer, an operator who
cancels, and a dedup caller."""

from __future__ import annotations

import json
import os
import random
from pathlib import Path
from typing import Any

from .common import run_until_signalled

COALESCE_KEYS = 7
"""Coalesced enqueues (docs/controls.md) share this many keys: most find a row of
their key waiting and supersede it, some find it claimed or sent."""

POLICY_ENV = "SOAK_DESTINATION_POLICY"
"""A JSON destination policy (docs/destinations.md) the roles share: the producer then
spreads its rows over three destinations and every worker runs with the
policy as ``"*"``, so the soak crosses rates, shared concurrency and an
opening breaker with its SIGKILLs."""


def _policy() -> dict[str, Any] | None:
    text = os.environ.get(POLICY_ENV)
    return json.loads(text) if text else None


def role_worker(db: str, ledger: str, fail_rate: float, seed: int) -> None:
    """A worker process whose transport appends "id attempt" to the ledger
    (the send) and fails a seeded fraction of attempts after sending."""
    import anyio

    from trio_dispatch import Delivery, DispatchWorker, open_store

    fd = os.open(ledger, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    async def send(delivery: Delivery) -> bool:
        await anyio.sleep(random.random() * 0.02)  # kills land mid-send too
        os.write(fd, f"{delivery.dispatch_id} {delivery.attempt}\n".encode())
        rng = random.Random(f"{seed}:{delivery.dispatch_id}:{delivery.attempt}")
        return rng.random() >= fail_rate

    async def main() -> None:
        async with open_store(db) as store:
            # A 1.5 s lease margin (5 s by default): a killed worker's rows come
            # back sooner, so a run sees more lease recoveries in less time.
            policy = _policy()
            worker = DispatchWorker(
                store,
                transport=send,
                destinations=None if policy is None else {"*": policy},
                concurrency=16,
                batch_size=32,
                tick_seconds=0.2,
                timeout_seconds=0.5,
                grace_seconds=1,
                lease_margin_seconds=1.5,
            )
            await run_until_signalled(worker)

    anyio.run(main, backend="trio")


def role_producer(
    db: str, ids_file: str, n: int, pace: float, coalesce_rate: float = 0.0, seed: int = 0
) -> None:
    """Enqueue n dispatches in small batches, appending each committed id;
    a seeded ``coalesce_rate`` share of them replace their coalesce key's
    waiting row (one of :data:`COALESCE_KEYS`)."""
    import anyio

    from trio_dispatch import enqueue_many, open_store

    spread = _policy() is not None
    rng = random.Random(seed)

    def coalescing() -> dict[str, Any]:
        if rng.random() >= coalesce_rate:
            return {}
        return {"coalesce_key": f"key-{rng.randrange(COALESCE_KEYS)}", "coalesce": "replace"}

    async def main() -> None:
        async with open_store(db) as store:
            with open(ids_file, "a") as out:
                done = 0
                while done < n:
                    size = min(25, n - done)
                    results = await enqueue_many(
                        store,
                        [
                            {
                                "kind": "soak",
                                "deliver_to": f"dest-{(done + i) % 3}"
                                if spread
                                else f"seat-{done + i}",
                                "max_attempts": 8,
                                **coalescing(),
                            }
                            for i in range(size)
                        ],
                    )
                    out.write("".join(f"{r.id}\n" for r in results))
                    out.flush()
                    done += size
                    await anyio.sleep(pace)

    anyio.run(main, backend="trio")


def role_canceller(db: str, ids_file: str, rate: float, seed: int, stop_file: str) -> None:
    """Cancel a seeded share of the committed ids as they appear, pending
    or running (marked for the worker, or its lease's recovery, to carry
    out), while the workers are killed; stop once ``stop_file`` exists and
    every id written by then was seen."""
    import anyio

    from trio_dispatch import InvalidTransition, cancel_dispatch, open_store

    rng = random.Random(seed)

    async def main() -> None:
        seen = 0
        async with open_store(db) as store:
            while True:
                stopping = os.path.exists(stop_file)
                ids = Path(ids_file).read_text().split() if os.path.exists(ids_file) else []
                for dispatch_id in ids[seen:]:
                    if rng.random() >= rate:
                        continue
                    try:
                        await cancel_dispatch(store, dispatch_id, "soak", wait_seconds=0)
                    except (InvalidTransition, LookupError):  # it ended first, or a cut line
                        pass
                seen = len(ids)
                if stopping:
                    return
                await anyio.sleep(rng.uniform(0.0, 0.05))

    anyio.run(main, backend="trio")


def role_dedup(db: str, out: str, keys: list[str]) -> None:
    import anyio

    from trio_dispatch import enqueue_dispatch, open_store

    async def main() -> list[str]:
        async with open_store(db) as store:
            return [
                await enqueue_dispatch(store, kind="race", deliver_to="seat", dedup_key=key)
                for key in keys
            ]

    Path(out).write_text(json.dumps(anyio.run(main, backend="trio")))


def run_role(role: str, args: list[str]) -> None:
    """The role ``soak.py --role`` names, with its arguments."""
    if role == "worker":
        role_worker(args[0], args[1], float(args[2]), int(args[3]))
    elif role == "producer":
        role_producer(args[0], args[1], int(args[2]), float(args[3]), float(args[4]), int(args[5]))
    elif role == "canceller":
        role_canceller(args[0], args[1], float(args[2]), int(args[3]), args[4])
    elif role == "dedup":
        role_dedup(args[0], args[1], json.loads(Path(args[2]).read_text()))
