"""Retry schedules, a destination's Retry-After and 410, and per-destination
caps (docs/webhooks.md: they apply to every transport), on real stores and
both backends."""

from __future__ import annotations

import json
from typing import Any

import anyio
import pytest

from trio_dispatch import Delivery, deliver_due_dispatches, enqueue_dispatch
from trio_dispatch.outbox import claim_due, finish_attempt
from trio_dispatch.store import SQLiteStore
from trio_dispatch.transports import TransportResult
from trio_dispatch.worker import DispatchWorker

from ..conftest import RawDB
from ..helpers import statuses, wait_for

pytestmark = pytest.mark.anyio

T0 = 1_000_000.0


def _last(raw: RawDB, dispatch_id: str) -> dict[str, Any]:
    row = raw.transitions(dispatch_id)[-1]
    return {**row, "metadata": json.loads(str(row["metadata"]))}


# -- retry schedule -----------------------------------------------------------


async def test_a_failed_attempt_waits_the_schedules_delay(store: SQLiteStore, raw: RawDB) -> None:
    dispatch_id = await enqueue_dispatch(store, kind="k", deliver_to="d", now=T0)

    async def fail(delivery: Delivery) -> bool:
        return False

    for attempt, now, expected in ((1, T0, 5.0), (2, T0 + 5, 300.0), (3, T0 + 305, 300.0)):
        counts = await deliver_due_dispatches(
            store, now=now, transport=fail, retry_schedule=[5, 300]
        )
        assert counts["retried"] == 1
        row = raw.row(dispatch_id)
        assert (row["attempt"], row["next_attempt_at"]) == (attempt, now + expected)
        assert _last(raw, dispatch_id)["metadata"]["next_attempt_at"] == now + expected


async def test_a_worker_uses_its_schedule(store: SQLiteStore, raw: RawDB) -> None:
    async def fail(delivery: Delivery) -> bool:
        return False

    dispatch_id = await enqueue_dispatch(store, kind="k", deliver_to="d")
    async with anyio.create_task_group() as tg:
        worker = DispatchWorker(store, transport=fail, retry_schedule=[0.2, 3600], tick_seconds=60)
        await tg.start(worker.run)
        await wait_for(lambda: raw.row(dispatch_id)["attempt"] == 2, timeout=5)
        tg.cancel_scope.cancel()
    row = raw.row(dispatch_id)
    assert row["status"] == "pending"
    assert 3500 < float(row["next_attempt_at"]) - float(row["updated_at"]) <= 3600


# -- what the destination says --------------------------------------------------


async def test_gone_dead_letters_at_once_with_its_own_reason(
    store: SQLiteStore, raw: RawDB
) -> None:
    dispatch_id = await enqueue_dispatch(store, kind="k", deliver_to="d", max_attempts=8, now=T0)

    async def gone(delivery: Delivery) -> TransportResult:
        return TransportResult.failure("HTTP 410: unsubscribed", gone=True)

    counts = await deliver_due_dispatches(store, now=T0, transport=gone)
    assert counts["dead_letter"] == 1 and counts["retried"] == 0
    row = raw.row(dispatch_id)
    assert (row["status"], row["attempt"], row["last_error"]) == (
        "dead_letter",
        1,
        "HTTP 410: unsubscribed",
    )
    last = _last(raw, dispatch_id)
    assert last["reason_code"] == "dispatch.dead_letter.gone"
    assert last["metadata"]["error"] == "HTTP 410: unsubscribed"
    # Nothing is due any more: a later pass sends nothing.
    assert (await deliver_due_dispatches(store, now=T0 + 10**6, transport=gone))["attempted"] == 0


@pytest.mark.parametrize(
    ("retry_after", "expected_wait"),
    [(600.0, 600.0), (1.0, 60.0), (10**7, 86400.0)],
    ids=["later-than-backoff", "sooner-than-backoff", "capped-at-24h"],
)
async def test_retry_after_delays_the_next_attempt_to_at_least_that_capped_at_a_day(
    store: SQLiteStore, raw: RawDB, retry_after: float, expected_wait: float
) -> None:
    dispatch_id = await enqueue_dispatch(store, kind="k", deliver_to="d", now=T0)
    [claim], _ = await claim_due(store, now=T0)
    result = TransportResult.failure("HTTP 503: busy", retry_after=retry_after)
    await finish_attempt(store, claim, result, now=T0 + 1)
    row = raw.row(dispatch_id)
    assert row["next_attempt_at"] == T0 + 1 + expected_wait  # backoff_seconds(1) is 60 s
    metadata = _last(raw, dispatch_id)["metadata"]
    assert metadata["retry_after_seconds"] == min(retry_after, 86400.0)
    assert metadata["next_attempt_at"] == T0 + 1 + expected_wait


# -- per-destination caps -------------------------------------------------------


async def test_never_more_than_the_cap_run_for_one_destination(
    store: SQLiteStore, raw: RawDB
) -> None:
    running: dict[str, int] = {}
    peak: dict[str, int] = {}

    async def send(delivery: Delivery) -> None:
        name = delivery.deliver_to
        running[name] = running.get(name, 0) + 1
        peak[name] = max(peak.get(name, 0), running[name])
        await anyio.sleep(0.02)
        running[name] -= 1

    for i in range(60):
        await enqueue_dispatch(store, kind="k", deliver_to=f"d{i % 3}")
    async with anyio.create_task_group() as tg:
        worker = DispatchWorker(
            store, transport=send, concurrency=16, per_destination_concurrency=2, tick_seconds=60
        )
        await tg.start(worker.run)
        await wait_for(lambda: statuses(raw) == {"delivered": 60}, timeout=20)
        tg.cancel_scope.cancel()
    assert peak == {"d0": 2, "d1": 2, "d2": 2}


@pytest.mark.slow
async def test_a_hung_destination_holds_only_its_cap_and_the_others_keep_going(
    store: SQLiteStore, raw: RawDB
) -> None:
    release = anyio.Event()
    hung_running = 0

    async def send(delivery: Delivery) -> None:
        nonlocal hung_running
        if delivery.deliver_to == "hung":
            hung_running += 1
            await release.wait()

    hung = [await enqueue_dispatch(store, kind="k", deliver_to="hung") for _ in range(40)]
    healthy = [await enqueue_dispatch(store, kind="k", deliver_to="ok") for _ in range(40)]
    async with anyio.create_task_group() as tg:
        worker = DispatchWorker(
            store, transport=send, concurrency=16, per_destination_concurrency=4, tick_seconds=60
        )
        await tg.start(worker.run)
        await wait_for(lambda: all(raw.row(i)["status"] == "delivered" for i in healthy))
        await wait_for(lambda: worker.in_flight == 4)  # the last healthy slot frees
        await anyio.sleep(0.1)
        assert hung_running == 4  # the hung destination holds 4 slots, never 16
        assert worker.in_flight == 4
        release.set()
        await wait_for(lambda: all(raw.row(i)["status"] == "delivered" for i in hung), timeout=20)
        tg.cancel_scope.cancel()
