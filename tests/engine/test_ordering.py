"""Ordering keys (docs/ordering.md) on both engines and both backends: rows of
one key are claimed one at a time in id order; a failing, unacknowledged or
recovered head keeps its place; a dead head blocks its key (``block``) or
lets the next row go (``skip``); an operator's retry or purge unblocks it;
other keys and unkeyed rows never wait. Asserted on the committed rows."""

from __future__ import annotations

from typing import Any

import anyio
import pytest

from trio_dispatch import (
    Delivery,
    DispatchWorker,
    ack_dispatch,
    deliver_due_dispatches,
    enqueue_dispatch,
    enqueue_many,
    open_store,
    purge_dispatch,
    retry_dispatch,
)
from trio_dispatch.lifecycle import WAITING_AT
from trio_dispatch.outbox import Claim, claim_due, finish_attempt
from trio_dispatch.outbox.ordering import OrderingPolicy
from trio_dispatch.outbox.reads import bounded_stats, dispatch_stats, list_dispatches, waiting_ids
from trio_dispatch.store import SQLiteStore
from trio_dispatch.transports import TransportResult

from ..conftest import RawDB
from ..helpers import wait_for

pytestmark = pytest.mark.anyio

T0 = 1_000_000.0
OK = TransportResult(ok=True)
FAIL = TransportResult.failure("boom")


async def claim(
    store: SQLiteStore, at: float = T0, ordering: OrderingPolicy = "block", limit: int = 100
) -> list[Claim]:
    claims, _ = await claim_due(store, now=at, limit=limit, lease_seconds=30, ordering=ordering)
    return claims


async def keyed(store: SQLiteStore, key: str | None, n: int, **kwargs: Any) -> list[str]:
    return [
        await enqueue_dispatch(
            store, kind="k", deliver_to=f"d{i}", ordering_key=key, now=T0, **kwargs
        )
        for i in range(n)
    ]


async def test_one_row_of_a_key_at_a_time_in_id_order_and_the_rest_wait_unread(
    store: SQLiteStore, raw: RawDB
) -> None:
    a = await keyed(store, "order-1", 3)
    b = await keyed(store, "order-2", 2)
    plain = await keyed(store, None, 2)
    assert raw.row(a[1])["next_attempt_at"] == raw.row(a[2])["next_attempt_at"] == WAITING_AT
    assert raw.row(a[1])["ordering_key"] == "order-1"
    first = await claim(store)
    assert sorted(c.dispatch_id for c in first) == sorted([a[0], b[0], *plain])
    assert await claim(store, T0 + 1) == []  # the heads are delivering: nothing else
    for c in first:
        assert c.ordering_key == raw.row(c.dispatch_id)["ordering_key"]
        await finish_attempt(store, c, OK, now=T0 + 2)
    second = await claim(store, T0 + 3)
    assert sorted(c.dispatch_id for c in second) == sorted([a[1], b[1]])
    for c in second:
        await finish_attempt(store, c, OK, now=T0 + 4)
    assert [c.dispatch_id for c in await claim(store, T0 + 5)] == [a[2]]


async def test_a_failing_head_keeps_its_place_through_every_backoff(
    store: SQLiteStore, raw: RawDB
) -> None:
    head, behind = await keyed(store, "k", 2, max_attempts=5)
    now = T0
    for attempt in range(1, 4):
        [c] = await claim(store, now)
        assert (c.dispatch_id, c.attempt) == (head, attempt)
        await finish_attempt(store, c, FAIL, now=now, retry_schedule=[10])
        assert await claim(store, now + 5) == []  # backoff: the row behind still waits
        now += 11
    [c] = await claim(store, now)
    await finish_attempt(store, c, OK, now=now)
    [c] = await claim(store, now + 1)
    assert c.dispatch_id == behind
    assert raw.row(head)["status"] == "delivered"


async def test_a_head_awaiting_its_ack_holds_the_key_until_acked(
    store: SQLiteStore, raw: RawDB
) -> None:
    [head] = await keyed(store, "k", 1, ack_required=True)
    [behind] = await keyed(store, "k", 1)
    [c] = await claim(store)
    await finish_attempt(store, c, OK, now=T0 + 1)
    assert raw.row(head)["status"] == "pending"  # awaiting its ack
    assert await claim(store, T0 + 2) == []
    await ack_dispatch(store, head, str(raw.row(head)["ack_token"]), now=T0 + 3)
    [c] = await claim(store, T0 + 4)
    assert c.dispatch_id == behind


async def test_a_recovered_head_keeps_its_place(store: SQLiteStore, raw: RawDB) -> None:
    head, _ = await keyed(store, "k", 2)
    assert [c.dispatch_id for c in await claim(store)] == [head]  # its worker dies then
    assert await claim(store, T0 + 29) == []
    [again] = await claim(store, T0 + 31)
    assert (again.dispatch_id, again.attempt, again.recovered) == (head, 2, True)


async def test_a_dead_head_blocks_its_key_until_an_operator_retries_it(
    store: SQLiteStore, raw: RawDB
) -> None:
    head, *behind = await keyed(store, "k", 3, max_attempts=1)
    [other] = await keyed(store, "other", 1)
    [plain] = await keyed(store, None, 1)
    first = {c.dispatch_id: c for c in await claim(store)}
    assert set(first) == {head, other, plain}
    await finish_attempt(store, first[head], FAIL, now=T0 + 1)
    assert raw.row(head)["status"] == "dead_letter"
    assert await claim(store, T0 + 2) == []  # blocked; the others were claimed already
    assert {raw.row(i)["status"] for i in behind} == {"pending"}
    assert await retry_dispatch(store, head, now=T0 + 3)
    [c] = await claim(store, T0 + 4)
    assert c.dispatch_id == head  # back first, before the rows behind it
    await finish_attempt(store, c, OK, now=T0 + 5)
    assert [c.dispatch_id for c in await claim(store, T0 + 6)] == [behind[0]]


async def test_the_row_behind_a_blocked_head_waits_and_is_never_the_oldest_due(
    store: SQLiteStore, raw: RawDB
) -> None:
    head, second, third = await keyed(store, "k", 3, max_attempts=1)
    [c] = await claim(store)
    await finish_attempt(store, c, FAIL, now=T0 + 1)
    # Promotion made the row behind the dead head due at T0 + 1; the claim
    # rule holds it (block), so every reader calls it waiting, not due.
    assert raw.row(second)["next_attempt_at"] == T0 + 1
    rows = await list_dispatches(store, ordering_key="k")
    assert await waiting_ids(store, rows) == {second, third}
    assert await waiting_ids(store, rows, "skip") == {third}
    later = T0 + 1000
    for stats in (
        await dispatch_stats(store, now=later),
        await bounded_stats(store, now=later),
    ):
        assert stats["oldest_due_pending_age_seconds"] is None
    # Under skip it is due (and claimable): it counts, and so does a plain row.
    skip = await dispatch_stats(store, now=later, ordering="skip")
    assert skip["oldest_due_pending_age_seconds"] == 999
    [plain] = await keyed(store, None, 1)  # due at T0
    for stats in (
        await dispatch_stats(store, now=later),
        await bounded_stats(store, now=later, ordering="block"),
    ):
        assert stats["oldest_due_pending_age_seconds"] == 1000
    assert [c.dispatch_id for c in await claim(store, later)] == [plain]
    assert await retry_dispatch(store, head, now=later + 1)  # the head live again
    assert await waiting_ids(store, await list_dispatches(store, ordering_key="k")) == {
        second,
        third,
    }
    assert (await dispatch_stats(store, now=later + 2))["oldest_due_pending_age_seconds"] == 1


async def test_purging_a_blocked_head_lets_the_next_row_go(store: SQLiteStore) -> None:
    head, second, _ = await keyed(store, "k", 3, max_attempts=1)
    [c] = await claim(store)
    await finish_attempt(store, c, FAIL, now=T0 + 1)
    assert await claim(store, T0 + 2) == []
    assert await purge_dispatch(store, head, now=T0 + 3)
    assert [c.dispatch_id for c in await claim(store, T0 + 4)] == [second]


async def test_the_skip_policy_lets_the_next_row_go_after_a_dead_head(
    store: SQLiteStore, raw: RawDB
) -> None:
    head, second = await keyed(store, "k", 2, max_attempts=1)
    [c] = await claim(store, ordering="skip")
    await finish_attempt(store, c, FAIL, now=T0 + 1)
    assert raw.row(head)["status"] == "dead_letter"
    assert [c.dispatch_id for c in await claim(store, T0 + 2, ordering="skip")] == [second]


async def test_an_expired_head_blocks_and_the_skip_policy_passes_it(
    store: SQLiteStore, raw: RawDB
) -> None:
    [head] = await keyed(store, "k", 1, expires_at=T0 + 1)
    [second] = await keyed(store, "k", 1)
    assert await claim(store, T0 + 2) == []  # the head expires at its claim; the key blocks
    assert raw.row(head)["status"] == "expired"
    assert raw.row(second)["status"] == "pending"
    assert [c.dispatch_id for c in await claim(store, T0 + 3, ordering="skip")] == [second]


async def test_a_batch_waits_behind_its_first_row_and_goes_in_id_order(
    store: SQLiteStore, raw: RawDB
) -> None:
    results = await enqueue_many(
        store,
        [{"kind": "k", "deliver_to": f"d{i}", "ordering_key": "k"} for i in range(4)],
        now=T0,
    )
    ids = [r.id for r in results]
    assert [raw.row(i)["next_attempt_at"] == WAITING_AT for i in ids] == [
        False,
        True,
        True,
        True,
    ]
    order = []
    at = T0 + 10
    for _ in ids:
        [c] = await claim(store, at)
        order.append(c.dispatch_id)
        await finish_attempt(store, c, OK, now=at)
        at += 1
    assert order == ids


@pytest.mark.parametrize(
    "bad, message",
    [
        ("", "non-empty"),
        ("   ", "non-empty"),
        ("x" * 256, "at most 255"),
        ("a\nb", "control"),
        ("a\x00b", "control"),
        (7, "ordering_key"),
    ],
)
async def test_a_bad_ordering_key_is_refused_naming_it_and_writes_nothing(
    store: SQLiteStore, raw: RawDB, bad: object, message: str
) -> None:
    with pytest.raises((TypeError, ValueError), match=message):
        await enqueue_dispatch(store, kind="k", deliver_to="d", ordering_key=bad)  # type: ignore[arg-type]
    assert raw.counts() == (0, 0)


async def test_workers_deliver_each_key_in_order_never_two_at_once(
    db_target: str, raw: RawDB
) -> None:
    keys = [f"key-{n}" for n in range(6)]
    running: dict[str, str] = {}
    overlaps: list[str] = []
    delivered: dict[str, list[str]] = {key: [] for key in keys}

    async def send(delivery: Delivery) -> None:
        key = delivery.deliver_to.split("/")[0]
        if key in running:
            overlaps.append(f"{running[key]} and {delivery.dispatch_id}")
        running[key] = delivery.dispatch_id
        await anyio.sleep(0.002)
        del running[key]
        delivered[key].append(delivery.dispatch_id)

    async with open_store(db_target) as db:
        expected: dict[str, list[str]] = {key: [] for key in keys}
        for row in range(5):
            for key in keys:
                dispatch_id = await enqueue_dispatch(
                    db, kind="k", deliver_to=f"{key}/{row}", ordering_key=key
                )
                expected[key].append(dispatch_id)
        async with anyio.create_task_group() as tg:
            for _ in range(2):
                await tg.start(DispatchWorker(db, transport=send, concurrency=8).run)
            await wait_for(lambda: sum(map(len, delivered.values())) == 30, timeout=30)
            tg.cancel_scope.cancel()
    assert overlaps == []
    assert delivered == expected
    assert raw.scalar("SELECT COUNT(*) FROM dispatch_outbox WHERE status = 'delivered'") == 30


async def test_a_worker_beside_a_blocked_key_sleeps_instead_of_scanning_again_and_again(
    store: SQLiteStore, raw: RawDB
) -> None:
    async def refuse(delivery: Delivery) -> bool:
        return False

    head, behind = await keyed(store, "k", 2, max_attempts=1)
    async with anyio.create_task_group() as tg:
        worker = DispatchWorker(store, transport=refuse, tick_seconds=3600, listen=False)
        await tg.start(worker.run)
        await wait_for(lambda: raw.row(head)["status"] == "dead_letter")
        # Settled: the scans that the dead letter's end itself wakes are done
        # (a spinning worker never settles: it fails below after 5 s).
        scans = -1
        with anyio.move_on_after(5):
            while (now_scans := worker.statistics().scans) != scans:
                scans = now_scans
                await anyio.sleep(0.2)
        scans = worker.statistics().scans
        worker.wake()  # a scan now: it finds the row behind the dead head held back
        await wait_for(lambda: worker.statistics().scans > scans)
        await anyio.sleep(0.5)  # a window in which a spinning worker would scan hundreds of times
        assert worker.statistics().scans - scans <= 2
        tg.cancel_scope.cancel()
    assert (raw.row(behind)["status"], raw.row(behind)["attempt"]) == ("pending", 0)


async def test_a_delivery_pass_is_not_crowded_out_by_rows_behind_blocked_heads(
    store: SQLiteStore, raw: RawDB
) -> None:
    # Two keys whose heads end dead_letter; the rows behind them look due.
    items: list[dict[str, Any]] = []
    for key in ("a", "b"):
        items += [
            {"kind": "k", "deliver_to": "bad", "ordering_key": key, "max_attempts": 1},
            {"kind": "k", "deliver_to": "ok", "ordering_key": key},
        ]
    await enqueue_many(store, items)

    async def send(delivery: Any) -> TransportResult:
        if delivery.deliver_to == "bad":
            return TransportResult.failure("down")
        return TransportResult.success()

    first = await deliver_due_dispatches(store, transport=send)
    assert first["dead_letter"] == 2 and first["delivered"] == 0
    free = await enqueue_dispatch(store, kind="k", deliver_to="ok")
    # A pass of two: the blocked keys' next rows do not take the places.
    done = await deliver_due_dispatches(store, transport=send, batch_size=2)
    assert (done["attempted"], done["delivered"]) == (1, 1)
    assert raw.row(free)["status"] == "delivered"
