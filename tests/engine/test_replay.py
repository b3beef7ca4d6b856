"""Replay (docs/destinations.md): ``retry_dispatches`` on both engines and both
backends puts exactly the filtered failed rows back to ``pending``, in id
order, a chunk a transaction; ordering keys keep their order; a dry run
writes nothing; a second run retries nothing twice and takes up what an
interrupted one left; bad input is refused before anything is written."""

from __future__ import annotations

import datetime
import json
from typing import Any

import pytest

from trio_dispatch import (
    ActionRefused,
    RetryResult,
    enqueue_dispatch,
    enqueue_many,
    retry_dispatches,
)
from trio_dispatch.lifecycle import WAITING_AT
from trio_dispatch.outbox import PRUNE_CHUNK, claim_due, finish_attempt
from trio_dispatch.outbox.ordering import OrderingPolicy
from trio_dispatch.store import SQLiteStore
from trio_dispatch.transports import TransportResult

from ..conftest import RawDB
from ..helpers import everything

pytestmark = pytest.mark.anyio

T0 = 1_000_000.0
OK = TransportResult(ok=True)
FAIL = TransportResult.failure("down")
RETRY = "dispatch.pending.operator_retry"


async def fail(
    store: SQLiteStore, dispatch_id: str, at: float, ordering: OrderingPolicy = "block"
) -> None:
    """One attempt of the row, claimed and failed at ``at`` (its last)."""
    claims, _ = await claim_due(
        store, ids=[dispatch_id], now=at, lease_seconds=30, ordering=ordering
    )
    assert [c.dispatch_id for c in claims] == [dispatch_id]
    await finish_attempt(store, claims[0], FAIL, now=at)


async def outage(store: SQLiteStore, raw: RawDB) -> dict[str, str]:
    """Failed rows of two destinations at known times, and rows that are
    not failed: name -> id. ``updated_at`` is when each failed."""
    ids: dict[str, str] = {}
    for name, route in [
        ("a10", "billing"),
        ("a20", "billing"),
        ("mail20", "mail"),
        ("e25", "billing"),
        ("a30", "billing"),
        ("pending", "billing"),
        ("delivered", "billing"),
    ]:
        ids[name] = await enqueue_dispatch(
            store,
            kind="order.paid",
            deliver_to=route,
            max_attempts=1,
            expires_at=T0 + 5 if name == "e25" else None,
            now=T0,
        )
    await fail(store, ids["a10"], T0 + 10)
    await fail(store, ids["a20"], T0 + 20)
    await fail(store, ids["mail20"], T0 + 20)
    expired, _ = await claim_due(store, ids=[ids["e25"]], now=T0 + 25)  # past its expires_at
    assert expired == []
    await fail(store, ids["a30"], T0 + 30)
    claims, _ = await claim_due(store, ids=[ids["delivered"]], now=T0 + 20)
    await finish_attempt(store, claims[0], OK, now=T0 + 20)
    found = {name: (raw.row(i)["status"], raw.row(i)["updated_at"]) for name, i in ids.items()}
    assert found == {
        "a10": ("dead_letter", T0 + 10),
        "a20": ("dead_letter", T0 + 20),
        "mail20": ("dead_letter", T0 + 20),
        "e25": ("expired", T0 + 25),
        "a30": ("dead_letter", T0 + 30),
        "pending": ("pending", T0),
        "delivered": ("delivered", T0 + 20),
    }
    return ids


def retried(raw: RawDB) -> list[str]:
    """The dispatches retried by an operator, in the order they were."""
    return [
        row["entity_id"]
        for row in raw.rows(
            "SELECT entity_id FROM status_transitions WHERE reason_code = ? ORDER BY id", (RETRY,)
        )
    ]


def names(ids: dict[str, str], chosen: list[str]) -> list[str]:
    by_id = {v: k for k, v in ids.items()}
    return [by_id[i] for i in chosen]


async def test_a_replay_by_destination_retries_its_dead_and_expired_rows_in_id_order(
    store: SQLiteStore, raw: RawDB
) -> None:
    ids = await outage(store, raw)
    untouched = {name: raw.row(ids[name]) for name in ("mail20", "pending", "delivered")}
    result = await retry_dispatches(
        store, deliver_to="billing", actor="ops", reason="billing is back", now=T0 + 100
    )
    assert result == RetryResult(matched=4, retried=4)
    assert result.to_dict() == {"matched": 4, "retried": 4, "dry_run": False, "skipped": 0}
    chosen = [ids[name] for name in ("a10", "a20", "e25", "a30")]
    assert retried(raw) == sorted(chosen)  # id order
    for dispatch_id in chosen:
        row = raw.row(dispatch_id)
        assert (row["status"], row["attempt"], row["last_error"]) == ("pending", 0, None)
        assert (row["next_attempt_at"], row["updated_at"]) == (T0 + 100, T0 + 100)
        last = raw.transitions(dispatch_id)[-1]
        assert (last["reason_code"], last["source"], last["actor"]) == (RETRY, "operator", "ops")
        meta = (
            last["metadata"] if isinstance(last["metadata"], dict) else json.loads(last["metadata"])
        )
        assert meta["reason"] == "billing is back" and meta["bulk"] is True
        assert meta["filter"]["deliver_to"] == "billing"
        assert meta["filter"]["statuses"] == ["dead_letter", "expired"]
    for name, row in untouched.items():
        assert raw.row(ids[name]) == row, name


@pytest.mark.parametrize(
    "filters, expected",
    [
        ({"status": "dead_letter"}, ["a10", "a20", "a30"]),
        ({"status": "expired"}, ["e25"]),
        ({"since": T0 + 20}, ["a20", "e25", "a30"]),  # since is inclusive
        ({"since": T0 + 30}, ["a30"]),
        ({"since": T0 + 30.001}, []),
        ({"until": T0 + 20}, ["a10"]),  # until is exclusive
        ({"until": T0 + 30}, ["a10", "a20", "e25"]),
        ({"since": T0 + 20, "until": T0 + 30}, ["a20", "e25"]),
        ({"since": T0 + 11, "until": T0 + 20}, []),
        ({"status": "dead_letter", "since": T0 + 15, "until": T0 + 25}, ["a20"]),
        (
            {
                "since": datetime.datetime.fromtimestamp(T0 + 20, datetime.UTC),
                "until": datetime.datetime.fromtimestamp(
                    T0 + 30, datetime.timezone(datetime.timedelta(hours=5))
                ),
            },
            ["a20", "e25"],
        ),
        ({"kind": "other"}, []),
    ],
)
async def test_the_filters_select_exactly_their_rows(
    store: SQLiteStore, raw: RawDB, filters: dict[str, Any], expected: list[str]
) -> None:
    ids = await outage(store, raw)
    dry = await retry_dispatches(store, deliver_to="billing", dry_run=True, **filters)
    assert (dry.matched, dry.retried, dry.dry_run) == (len(expected), 0, True)
    result = await retry_dispatches(store, deliver_to="billing", now=T0 + 100, **filters)
    assert (result.matched, result.retried) == (len(expected), len(expected))
    assert names(ids, retried(raw)) == expected
    failed = {"a10", "a20", "mail20", "e25", "a30"} - set(expected)
    assert {n for n in failed if raw.row(ids[n])["status"] != "pending"} == failed


async def test_a_dry_run_counts_and_writes_nothing(store: SQLiteStore, raw: RawDB) -> None:
    await outage(store, raw)
    before = everything(raw)
    result = await retry_dispatches(store, deliver_to="billing", dry_run=True, now=T0 + 100)
    assert result.to_dict() == {"matched": 4, "retried": 0, "dry_run": True, "skipped": 0}
    assert (await retry_dispatches(store, status="dead_letter", dry_run=True)).matched == 4
    assert everything(raw) == before


async def test_running_it_twice_retries_nothing_twice(store: SQLiteStore, raw: RawDB) -> None:
    ids = await outage(store, raw)
    first = await retry_dispatches(store, deliver_to="billing", until=T0 + 50, now=T0 + 100)
    assert (first.matched, first.retried) == (4, 4)
    after_first = everything(raw)
    second = await retry_dispatches(store, deliver_to="billing", until=T0 + 50, now=T0 + 101)
    assert (second.matched, second.retried, second.skipped) == (0, 0, 0)
    assert everything(raw) == after_first
    # Failing again after the replay is a new failure, outside the window.
    await fail(store, ids["a10"], T0 + 200)
    third = await retry_dispatches(store, deliver_to="billing", until=T0 + 50, now=T0 + 201)
    assert third.matched == 0 and raw.row(ids["a10"])["status"] == "dead_letter"
    assert sorted(retried(raw)) == sorted(ids[n] for n in ("a10", "a20", "e25", "a30"))


async def test_ordering_keys_keep_their_order_after_a_replay(
    store: SQLiteStore, raw: RawDB
) -> None:
    # Under skip, every row of the key fails in turn; one more waits live.
    keyed = [
        r.id
        for r in await enqueue_many(
            store,
            [
                {"kind": "k", "deliver_to": "billing", "ordering_key": "order-7", "max_attempts": 1}
                for _ in range(4)
            ],
            now=T0,
        )
    ]
    for n, dispatch_id in enumerate(keyed):
        await fail(store, dispatch_id, T0 + 10 + n, ordering="skip")
    behind = await enqueue_dispatch(
        store, kind="k", deliver_to="billing", ordering_key="order-7", now=T0 + 20
    )
    result = await retry_dispatches(store, ordering_key="order-7", now=T0 + 100)
    assert (result.matched, result.retried) == (4, 4)
    assert retried(raw) == keyed
    # The first retried row is due; the others wait behind it, unread by a
    # claim. The live row behind them keeps its due time: the claim rule
    # holds it until the rows ahead of it are gone.
    assert [raw.row(i)["next_attempt_at"] for i in [*keyed, behind]] == [
        T0 + 100,
        WAITING_AT,
        WAITING_AT,
        WAITING_AT,
        T0 + 20,
    ]
    sent = []
    at = T0 + 200
    while True:
        claims, _ = await claim_due(store, now=at, lease_seconds=30)
        if not claims:
            break
        assert len(claims) == 1  # one row of a key at a time
        sent.append(claims[0].dispatch_id)
        await finish_attempt(store, claims[0], OK, now=at)
        at += 1
    assert sent == [*keyed, behind]


async def test_a_replay_runs_in_chunks_and_an_interrupted_one_resumes_without_repeats(
    store: SQLiteStore, raw: RawDB
) -> None:
    total = 2 * PRUNE_CHUNK + 1
    made = await enqueue_many(
        store,
        [{"kind": "k", "deliver_to": "bulk", "expires_at": T0 + 1} for _ in range(total)],
        now=T0,
    )
    _, counts = await claim_due(store, now=T0 + 2, limit=total + 10)
    assert counts["expired"] == total
    ids = sorted(r.id for r in made)
    # A failure in the second chunk: the first stays committed, the second
    # is rolled back whole, the third never starts.
    raw.refuse_transitions("injected", RETRY, ids[PRUNE_CHUNK + 200])
    with pytest.raises(raw.error):
        await retry_dispatches(store, deliver_to="bulk", now=T0 + 100)
    pending = [r["id"] for r in raw.rows("SELECT id FROM dispatch_outbox WHERE status = 'pending'")]
    assert sorted(pending) == ids[:PRUNE_CHUNK]
    assert retried(raw) == ids[:PRUNE_CHUNK]
    raw.allow_transitions()
    assert (await retry_dispatches(store, deliver_to="bulk", dry_run=True)).matched == total - (
        PRUNE_CHUNK
    )
    rest = await retry_dispatches(store, deliver_to="bulk", now=T0 + 101)
    assert (rest.matched, rest.retried) == (total - PRUNE_CHUNK, total - PRUNE_CHUNK)
    assert retried(raw) == ids  # each exactly once, in id order
    statuses = raw.rows("SELECT status, COUNT(*) AS n FROM dispatch_outbox GROUP BY status")
    assert statuses == [{"status": "pending", "n": total}]


async def test_a_limit_stops_after_that_many_rows_and_the_next_call_takes_the_rest(
    store: SQLiteStore, raw: RawDB
) -> None:
    ids = await outage(store, raw)
    first = await retry_dispatches(store, deliver_to="billing", limit=3, now=T0 + 100)
    assert (first.matched, first.retried) == (3, 3)
    rest = await retry_dispatches(store, deliver_to="billing", limit=3, now=T0 + 101)
    assert (rest.matched, rest.retried) == (1, 1)
    chosen = sorted(ids[name] for name in ("a10", "a20", "e25", "a30"))
    assert retried(raw) == chosen


async def test_expires_at_none_lets_a_replayed_expired_row_go_out(
    store: SQLiteStore, raw: RawDB
) -> None:
    ids = await outage(store, raw)
    await retry_dispatches(store, status="expired", expires_at=None, now=T0 + 100)
    assert raw.row(ids["e25"])["expires_at"] is None
    claims, counts = await claim_due(store, ids=[ids["e25"]], now=T0 + 200)
    assert [c.dispatch_id for c in claims] == [ids["e25"]] and counts["expired"] == 0


NAIVE = datetime.datetime(2026, 12, 2, 9, 0)


@pytest.mark.parametrize(
    "filters, error, message",
    [
        ({"status": "delivered"}, ActionRefused, "retry of delivered rows is not allowed"),
        ({"status": "pending"}, ActionRefused, "retry of pending rows is not allowed"),
        ({"status": "lost"}, ValueError, "status must be one of"),
        ({"since": NAIVE}, ValueError, "since must have a time zone"),
        ({"until": float("nan")}, ValueError, "until must be a finite number"),
        ({"since": "2h"}, TypeError, "since must be a finite number"),
        ({"since": 1e300}, ValueError, "since is beyond what a calendar holds"),
        ({"since": T0 + 30, "until": T0 + 10}, ValueError, "must be before until"),
        ({"since": T0 + 30, "until": T0 + 30}, ValueError, "must be before until"),
        ({"deliver_to": ""}, ValueError, "deliver_to must be a non-empty string"),
        ({"deliver_to": 7}, TypeError, "deliver_to must be a str"),
        ({"kind": ""}, ValueError, "kind must be a non-empty string"),
        ({"ordering_key": "a\nb"}, ValueError, "ordering_key must not contain control"),
        ({"reason": "two\nlines"}, ValueError, "reason must not contain control"),
        ({"reason": "x" * 501}, ValueError, "reason must be at most 500"),
        ({"limit": 0}, ValueError, "limit must be an integer from 1"),
        ({"dry_run": "yes"}, TypeError, "dry_run must be a bool"),
        ({"expires_at": float("inf")}, ValueError, "expires_at must be a finite number"),
    ],
)
async def test_bad_input_is_refused_naming_it_and_writes_nothing(
    store: SQLiteStore,
    raw: RawDB,
    filters: dict[str, Any],
    error: type[Exception],
    message: str,
) -> None:
    await outage(store, raw)
    before = everything(raw)
    with pytest.raises(error, match=message):
        await retry_dispatches(store, now=T0 + 100, **filters)
    assert everything(raw) == before
