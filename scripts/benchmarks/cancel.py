"""Section ``cancel``: how soon an operator's cancel stops a running
command attempt (docs/controls.md), on SQLite and on PostgreSQL in one run.

A worker process runs a command that says its process group and sleeps;
this process, another one as an operator's would be, cancels the row
(``cancel_dispatch``, not waiting) and polls ``killpg(pgid, 0)`` until the
group is gone (killed and reaped by the worker). Each round measures
:data:`CANCELS` cancels, taking turns with as many plain kills of the same
kind of attempt: ``SIGTERM`` sent to the group by this process, gone when
the worker has reaped it -- the floor no cancel can beat. The figure is the
p99 of a round's cancels (from the moment the cancel was asked, so its
commit is inside the time), beside the p99 of its kills; the target is an
absolute one, 1 s.
"""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Final

import anyio

from trio_dispatch import cancel_dispatch, enqueue_dispatch, open_store
from trio_dispatch.store import Store

from .harness import ROOT, Bench, Figure, Outcome, at_most, percentile
from .pgserver import fresh_postgres, postgres_database

CANCELS: Final = 50
"""Cancels a round measures (and plain kills beside them)."""
TARGET_MS: Final = 1000.0
POLL_SECONDS: Final = 0.002
"""How often this process looks for the group: often enough for the
figure, seldom enough to leave the 2 cores to the worker."""

WORKER = """
import signal, sys
import anyio
from trio_dispatch import DispatchWorker, open_store

async def main():
    async with open_store(sys.argv[1]) as store, anyio.create_task_group() as tg:
        worker = DispatchWorker(
            store, notify_template=["sh", "-c", sys.argv[2]], concurrency=4,
            tick_seconds=3600, timeout_seconds=300, grace_seconds=1,
        )
        with anyio.open_signal_receiver(signal.SIGTERM) as signals:
            await tg.start(worker.run)
            print("ready", flush=True)
            async for _ in signals:
                tg.cancel_scope.cancel()
                break

anyio.run(main, backend="trio")
"""
"""A worker process: each attempt's command writes its process group (its
own pid: it leads the group the transport made) to a file named by the
dispatch id, then becomes ``sleep``: one process in the group."""


def _script(groups: Path) -> str:
    # The shell's builtin echo, then exec: the group never holds a second
    # process. (A child such as mv, killed with its shell, is an orphan
    # zombie until the machine's init reaps it -- 2 s here -- and a zombie
    # still counts in its group.)
    return f'echo $$ > {shlex.quote(str(groups))}/"$TRIO_DISPATCH_ID"; exec sleep 120'


def _gone(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return True
    return False


async def _group_of(store: Store, groups: Path) -> tuple[str, int]:
    """Enqueue a row and wait for its attempt's command to say its group."""
    dispatch_id = await enqueue_dispatch(store, kind="bench", deliver_to="seat", max_attempts=1)
    found = groups / dispatch_id
    deadline = time.monotonic() + 60
    while True:
        text = found.read_text() if found.exists() else ""
        if text.endswith("\n"):  # written whole
            return dispatch_id, int(text)
        if time.monotonic() > deadline:
            raise RuntimeError("the worker never started the attempt's command")
        await anyio.sleep(0.001)


async def _until_gone(pgid: int, started: float) -> float:
    while not _gone(pgid):
        if time.perf_counter() - started > 30:
            raise RuntimeError(f"process group {pgid} still there after 30 s")
        await anyio.sleep(POLL_SECONDS)
    return (time.perf_counter() - started) * 1000


async def _round(target: str, groups: Path) -> tuple[list[float], list[float]]:
    """One round: :data:`CANCELS` cancels and as many plain kills, taking
    turns, against one worker process; the milliseconds of each."""
    groups.mkdir(parents=True, exist_ok=True)
    worker = subprocess.Popen(
        [sys.executable, "-c", WORKER, target, _script(groups)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,  # a line per attempt
        text=True,
    )
    cancels: list[float] = []
    kills: list[float] = []
    try:
        assert worker.stdout is not None
        if worker.stdout.readline().strip() != "ready":
            raise RuntimeError("the worker process did not start")
        async with open_store(target) as store:

            async def cancel() -> None:
                dispatch_id, pgid = await _group_of(store, groups)
                await cancel_dispatch(store, dispatch_id, wait_seconds=0)
                cancels.append(await _until_gone(pgid, time.perf_counter()))  # committed

            async def kill() -> None:
                _, pgid = await _group_of(store, groups)
                started = time.perf_counter()
                os.killpg(pgid, signal.SIGTERM)
                kills.append(await _until_gone(pgid, started))

            sides: list[Callable[[], Awaitable[None]]] = [cancel, kill]
            for turn in range(CANCELS):
                for side in sides[turn % 2 :] + sides[: turn % 2]:
                    await side()
    finally:
        worker.send_signal(signal.SIGTERM)
        try:
            worker.wait(timeout=30)
        except subprocess.TimeoutExpired:
            worker.kill()
            worker.wait()
    return cancels, kills


def run_cancel(bench: Bench) -> Outcome:
    """The cancel figure on each engine (see the module's text)."""
    notes: list[str] = []
    engines: list[tuple[str, Callable[[int], str]]] = [
        ("SQLite", lambda round_: str(bench.at(f"cancel-{round_}")))
    ]
    database = postgres_database()
    if database is not None:
        url, _ = database
        engines.append(("PostgreSQL", lambda round_: fresh_postgres(url)))
    else:
        notes.append("cancel section: PostgreSQL skipped, no server answered")
    figures = []
    try:
        for name, target in engines:
            values: list[float] = []
            baselines: list[float] = []
            medians: list[tuple[float, float]] = []
            for round_ in range(bench.rounds):
                groups = bench.scratch / f"cancel-groups-{name}-{round_}"
                cancels, kills = bench.go(_round, target(round_), groups)
                values.append(percentile(cancels, 0.99))
                baselines.append(percentile(kills, 0.99))
                medians.append((percentile(cancels, 0.5), percentile(kills, 0.5)))
            figures.append(
                Figure(
                    f"{name}: a running command's process group gone after its cancel, "
                    f"p99 of {CANCELS}",
                    values,
                    "ms",
                    baselines,
                    "the p99 of as many SIGTERMs sent straight to such a group",
                    f"<= {TARGET_MS:.0f} ms",
                    at_most(TARGET_MS),
                    "SIGTERM itself",
                    "cancel",
                )
            )
            notes.append(
                f"cancel section, {name}: p50 per round (cancel / plain SIGTERM): "
                + ", ".join(f"{c:.1f} / {k:.1f} ms" for c, k in medians)
            )
    finally:
        if database is not None:
            database[1]()
    return Outcome(figures, notes)


__all__ = ["run_cancel"]
