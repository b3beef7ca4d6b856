"""Operator controls (docs/usage.md, docs/cli.md): get, list, retry,
purge, prune, history and the revival heartbeat.

Every test runs on trio and asyncio against a real SQLite file and asserts
what is committed, read back through a separate sqlite3 connection (``raw``).
State that would take many deliveries to reach is set up directly with
``raw.execute``.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

import pytest

from trio_dispatch import (
    InvalidTransition,
    deliver_due_dispatches,
    enqueue_dispatch,
    enqueue_many,
    enqueue_revival_heartbeat,
    get_dispatch,
    list_dispatches,
    list_transitions,
    prune_dispatches,
    purge_dispatch,
    retry_dispatch,
)
from trio_dispatch.errors import ActionRefused
from trio_dispatch.outbox import claim_due, finish_attempt
from trio_dispatch.outbox.bulk import bulk_filter
from trio_dispatch.store import SQLiteStore
from trio_dispatch.transports import Delivery, TransportResult

if TYPE_CHECKING:
    from ..conftest import RawDB

pytestmark = pytest.mark.anyio

T0 = 1_000_000.0
DAY = 86400.0
STATUSES = ("pending", "delivering", "delivered", "acked", "dead_letter", "expired")


async def enqueue(store: SQLiteStore, *, now: float = T0, **kwargs: Any) -> str:
    kwargs.setdefault("kind", "ping")
    kwargs.setdefault("deliver_to", "seat-1")
    return await enqueue_dispatch(store, now=now, **kwargs)


def set_state(raw: RawDB, dispatch_id: str, **columns: object) -> None:
    assignments = ", ".join(f"{name} = ?" for name in columns)
    raw.execute(
        f"UPDATE dispatch_outbox SET {assignments} WHERE id = ?", (*columns.values(), dispatch_id)
    )


def snapshot(raw: RawDB) -> tuple[list[dict[str, object]], list[dict[str, object]]]:
    """Every committed row of both tables, to prove a call wrote nothing."""
    return (
        raw.rows("SELECT * FROM dispatch_outbox ORDER BY id"),
        raw.rows("SELECT * FROM status_transitions ORDER BY id"),
    )


def ids_in(raw: RawDB) -> set[str]:
    return {str(row["id"]) for row in raw.rows("SELECT id FROM dispatch_outbox")}


# -- get_dispatch ---------------------------------------------------------------


async def test_get_dispatch_returns_none_for_missing_id(store: SQLiteStore, raw: RawDB) -> None:
    await enqueue(store)
    assert await get_dispatch(store, "0" * 32) is None
    assert raw.counts() == (1, 1)


async def test_get_dispatch_returns_row_with_payload_decoded_to_dict(
    store: SQLiteStore, raw: RawDB
) -> None:
    dispatch_id = await enqueue(store, body={"text": "h\u00e9llo", "n": [1, 2]}, dedup_key="k1")

    got = await get_dispatch(store, dispatch_id)

    assert got is not None
    stored = raw.row(dispatch_id)
    assert isinstance(got["payload"], dict)
    assert got["payload"] == json.loads(str(stored["payload"]))
    assert got["payload"]["dispatch_id"] == dispatch_id
    assert got["payload"]["body"] == {"text": "h\u00e9llo", "n": [1, 2]}
    # key_seq is the store's own bookkeeping of a key's order, not shown,
    # nor is head_start (what the priority made of the step, docs/controls.md);
    # throttles is, beside the attempts (docs/destinations.md), and the priority.
    assert {k: v for k, v in got.items() if k != "payload"} == {
        k: v for k, v in stored.items() if k not in ("payload", "key_seq", "head_start")
    }
    assert got["priority"] == 0


# -- list_dispatches --------------------------------------------------------------


async def test_list_dispatches_orders_newest_created_first(store: SQLiteStore) -> None:
    ids = [await enqueue(store, now=T0 + offset) for offset in (0.0, 2.0, 1.0)]

    listed = await list_dispatches(store)

    assert [row["id"] for row in listed] == [ids[1], ids[2], ids[0]]
    assert all(isinstance(row["payload"], dict) for row in listed)


async def test_list_dispatches_filters_by_status(store: SQLiteStore, raw: RawDB) -> None:
    ids = {status: await enqueue(store, now=T0 + i) for i, status in enumerate(STATUSES)}
    extra_dead = await enqueue(store, now=T0 + 10)
    for status, dispatch_id in ids.items():
        set_state(raw, dispatch_id, status=status)
    set_state(raw, extra_dead, status="dead_letter")

    dead = await list_dispatches(store, status="dead_letter")
    assert [row["id"] for row in dead] == [extra_dead, ids["dead_letter"]]
    for status in STATUSES:
        listed = await list_dispatches(store, status=status)
        assert {row["status"] for row in listed} == {status}


async def test_list_dispatches_filters_by_kind_and_combines_with_status(
    store: SQLiteStore, raw: RawDB
) -> None:
    alpha = await enqueue(store, kind="alpha", now=T0)
    beta = await enqueue(store, kind="beta", now=T0 + 1)
    alpha_done = await enqueue(store, kind="alpha", now=T0 + 2)
    set_state(raw, alpha_done, status="delivered")

    assert [r["id"] for r in await list_dispatches(store, kind="alpha")] == [alpha_done, alpha]
    assert [r["id"] for r in await list_dispatches(store, kind="beta")] == [beta]
    assert await list_dispatches(store, kind="gamma") == []
    pending_alpha = await list_dispatches(store, kind="alpha", status="pending")
    assert [r["id"] for r in pending_alpha] == [alpha]


async def test_list_dispatches_applies_limit_to_newest(store: SQLiteStore) -> None:
    ids = [await enqueue(store, now=T0 + i) for i in range(5)]

    assert [r["id"] for r in await list_dispatches(store, limit=2)] == [ids[4], ids[3]]
    assert len(await list_dispatches(store, limit=1)) == 1
    assert len(await list_dispatches(store)) == 5


async def test_list_dispatches_unknown_status_raises_value_error_naming_allowed(
    store: SQLiteStore,
) -> None:
    await enqueue(store)
    with pytest.raises(ValueError) as caught:
        await list_dispatches(store, status="bogus_status")
    message = str(caught.value)
    assert "bogus_status" in message
    for status in STATUSES:
        assert status in message


@pytest.mark.parametrize(
    ("limit", "error"),
    [
        (0, ValueError),
        (-1, ValueError),
        ("5", (TypeError, ValueError)),
        (2.5, (TypeError, ValueError)),
    ],
    ids=["zero", "negative", "str", "float"],
)
async def test_list_dispatches_rejects_invalid_limit(
    store: SQLiteStore, limit: object, error: Any
) -> None:
    await enqueue(store)
    with pytest.raises(error):
        await list_dispatches(store, limit=limit)  # type: ignore[arg-type]


# -- retry_dispatch --------------------------------------------------------------------


@pytest.mark.parametrize("status", ["dead_letter", "expired"])
async def test_retry_from_dead_letter_or_expired_resets_attempt_due_time_and_error(
    store: SQLiteStore, raw: RawDB, status: str
) -> None:
    dispatch_id = await enqueue(store, max_attempts=3)
    set_state(
        raw,
        dispatch_id,
        status=status,
        attempt=3,
        last_error="boom",
        next_attempt_at=T0 + 5000,
        updated_at=T0 + 10,
    )

    assert await retry_dispatch(store, dispatch_id, now=T0 + 100) is True

    row = raw.row(dispatch_id)
    assert row["status"] == "pending"
    assert row["attempt"] == 0
    assert row["next_attempt_at"] == T0 + 100
    assert row["last_error"] is None
    assert row["updated_at"] == T0 + 100
    assert row["expires_at"] is None  # kept (it had none)
    last = raw.transitions(dispatch_id)[-1]
    assert last["reason_code"] == "dispatch.pending.operator_retry"
    assert last["previous_status"] == status
    assert last["status"] == "pending"
    assert last["source"] == "operator"
    assert last["created_at"] == T0 + 100
    assert raw.counts() == (1, 2)


async def test_retried_dead_letter_is_delivered_by_the_next_scan(
    store: SQLiteStore, raw: RawDB
) -> None:
    dispatch_id = await enqueue(store, max_attempts=1)

    async def fail(delivery: Delivery) -> bool:
        raise RuntimeError("destination down")

    counts = await deliver_due_dispatches(store, now=T0, transport=fail)
    assert counts["dead_letter"] == 1
    assert raw.row(dispatch_id)["status"] == "dead_letter"
    assert "destination down" in str(raw.row(dispatch_id)["last_error"])

    assert await retry_dispatch(store, dispatch_id, now=T0 + 50)

    sent: list[int] = []

    async def succeed(delivery: Delivery) -> None:
        sent.append(delivery.attempt)

    counts = await deliver_due_dispatches(store, now=T0 + 50, transport=succeed)
    assert sent == [1]
    assert counts["delivered"] == 1
    row = raw.row(dispatch_id)
    assert row["status"] == "delivered"
    assert row["attempt"] == 1
    assert row["last_error"] is None


@pytest.mark.parametrize("status", ["pending", "delivering", "delivered", "acked"])
async def test_retry_from_non_failed_status_raises_invalid_transition_and_writes_nothing(
    store: SQLiteStore, raw: RawDB, status: str
) -> None:
    dispatch_id = await enqueue(store)
    set_state(raw, dispatch_id, status=status, attempt=1, last_error="old")
    before = snapshot(raw)

    with pytest.raises(InvalidTransition):
        await retry_dispatch(store, dispatch_id, now=T0 + 100)

    assert snapshot(raw) == before


async def test_retry_of_missing_row_returns_false_and_writes_nothing(
    store: SQLiteStore, raw: RawDB
) -> None:
    await enqueue(store)
    before = snapshot(raw)

    assert await retry_dispatch(store, "0" * 32, now=T0) is False

    assert snapshot(raw) == before


async def test_retry_with_expires_at_replaces_or_clears_the_expiry(
    store: SQLiteStore, raw: RawDB
) -> None:
    replaced = await enqueue(store, expires_at=T0 + 1)
    cleared = await enqueue(store, expires_at=T0 + 1)
    kept = await enqueue(store, expires_at=T0 + 1)
    for dispatch_id in (replaced, cleared, kept):
        set_state(raw, dispatch_id, status="expired")

    assert await retry_dispatch(store, replaced, now=T0 + 10, expires_at=T0 + 5000)
    assert await retry_dispatch(store, cleared, now=T0 + 10, expires_at=None)
    assert await retry_dispatch(store, kept, now=T0 + 10)

    assert raw.row(replaced)["expires_at"] == T0 + 5000
    assert raw.row(cleared)["expires_at"] is None
    assert raw.row(kept)["expires_at"] == T0 + 1
    for dispatch_id in (replaced, cleared, kept):
        assert raw.row(dispatch_id)["status"] == "pending"

    sent: list[str] = []

    async def record(delivery: Delivery) -> None:
        sent.append(delivery.dispatch_id)

    counts = await deliver_due_dispatches(store, now=T0 + 10, transport=record)
    assert sorted(sent) == sorted([replaced, cleared])
    assert counts["expired"] == 1
    assert raw.row(kept)["status"] == "expired"


async def test_retry_with_invalid_expires_at_raises_and_writes_nothing(
    store: SQLiteStore, raw: RawDB
) -> None:
    dispatch_id = await enqueue(store)
    set_state(raw, dispatch_id, status="dead_letter")
    before = snapshot(raw)

    with pytest.raises(ValueError):
        await retry_dispatch(store, dispatch_id, now=T0, expires_at=float("nan"))

    assert snapshot(raw) == before


async def test_retried_expired_row_keeps_past_expiry_by_default_and_is_expired_again(
    store: SQLiteStore, raw: RawDB
) -> None:
    """Documented default: ``retry_dispatch`` keeps ``expires_at``; an expired
    row whose deadline is still past is expired again by the next scan
    without any send. Pass ``expires_at=`` to give it a new deadline."""
    dispatch_id = await enqueue(store, expires_at=T0 + 10)
    sent: list[str] = []

    async def record(delivery: Delivery) -> None:
        sent.append(delivery.dispatch_id)

    first = await deliver_due_dispatches(store, now=T0 + 20, transport=record)
    assert first["expired"] == 1
    assert raw.row(dispatch_id)["status"] == "expired"

    assert await retry_dispatch(store, dispatch_id, now=T0 + 30)
    assert raw.row(dispatch_id)["status"] == "pending"
    assert raw.row(dispatch_id)["expires_at"] == T0 + 10

    second = await deliver_due_dispatches(store, now=T0 + 30, transport=record)

    assert second["expired"] == 1
    assert sent == []
    assert raw.row(dispatch_id)["status"] == "expired"
    assert [t["reason_code"] for t in raw.transitions(dispatch_id)] == [
        "dispatch.pending.enqueued",
        "dispatch.expired.deadline",
        "dispatch.pending.operator_retry",
        "dispatch.expired.deadline",
    ]


# -- purge_dispatch ----------------------------------------------------------------------


@pytest.mark.parametrize("status", STATUSES)
async def test_purge_deletes_row_in_any_status_and_records_operator_transition(
    store: SQLiteStore, raw: RawDB, status: str
) -> None:
    dispatch_id = await enqueue(store)
    other = await enqueue(store)
    set_state(raw, dispatch_id, status=status, attempt=2)

    assert await purge_dispatch(store, dispatch_id, now=T0 + 50) is True

    assert ids_in(raw) == {other}
    assert raw.counts() == (1, 3)
    last = raw.transitions(dispatch_id)[-1]
    assert last["entity_type"] == "dispatch"
    assert last["reason_code"] == "dispatch.purged.operator"
    assert last["status"] == "purged"
    assert last["previous_status"] == status
    assert last["source"] == "operator"
    assert last["created_at"] == T0 + 50
    assert await get_dispatch(store, dispatch_id) is None
    history = await list_transitions(store, dispatch_id)
    assert [t["reason_code"] for t in history] == [
        "dispatch.pending.enqueued",
        "dispatch.purged.operator",
    ]


async def test_a_running_attempt_cannot_be_purged_so_its_key_never_overlaps(
    store: SQLiteStore, raw: RawDB
) -> None:
    head = await enqueue(store, ordering_key="order-7")
    behind = await enqueue(store, ordering_key="order-7")
    claims, _ = await claim_due(store, now=T0, lease_seconds=30)
    assert [claim.dispatch_id for claim in claims] == [head]
    before = snapshot(raw)

    with pytest.raises(InvalidTransition, match="its attempt is running"):
        await purge_dispatch(store, head, now=T0 + 10)
    with pytest.raises(ActionRefused, match="purge of delivering rows is not allowed"):
        bulk_filter("purge", "delivering", ordering_key="order-7")
    assert snapshot(raw) == before
    # The key stays held: the row behind the running head is not claimed.
    claims, _ = await claim_due(store, now=T0 + 10, lease_seconds=30)
    assert claims == []
    # Once its lease has run out the attempt is over: the head can go.
    assert await purge_dispatch(store, head, now=T0 + 31) is True
    claims, _ = await claim_due(store, now=T0 + 31, lease_seconds=30)
    assert [claim.dispatch_id for claim in claims] == [behind]


async def test_purge_keeps_full_transition_history(store: SQLiteStore, raw: RawDB) -> None:
    dispatch_id = await enqueue(store, max_attempts=1)

    async def fail(delivery: Delivery) -> bool:
        return False

    await deliver_due_dispatches(store, now=T0, transport=fail)
    before = await list_transitions(store, dispatch_id)

    assert await purge_dispatch(store, dispatch_id, now=T0 + 1)

    after = await list_transitions(store, dispatch_id)
    assert after[:-1] == before
    assert [t["reason_code"] for t in after] == [
        "dispatch.pending.enqueued",
        "dispatch.delivering.attempt",
        "dispatch.dead_letter.max_attempts",
        "dispatch.purged.operator",
    ]
    assert after[-1]["previous_status"] == "dead_letter"


async def test_purge_of_missing_row_returns_false_and_writes_nothing(
    store: SQLiteStore, raw: RawDB
) -> None:
    dispatch_id = await enqueue(store)
    assert await purge_dispatch(store, dispatch_id, now=T0 + 1)
    before = snapshot(raw)

    assert await purge_dispatch(store, dispatch_id, now=T0 + 2) is False
    assert await purge_dispatch(store, "0" * 32, now=T0 + 2) is False

    assert snapshot(raw) == before


# -- prune_dispatches ----------------------------------------------------------------------


async def make_aged(store: SQLiteStore, raw: RawDB, status: str, age: float, *, now: float) -> str:
    dispatch_id = await enqueue(store, now=now - age)
    set_state(raw, dispatch_id, status=status, updated_at=now - age)
    return dispatch_id


async def test_prune_with_defaults_applies_per_status_retention(
    store: SQLiteStore, raw: RawDB
) -> None:
    now = T0 + 100 * DAY
    doomed = {
        await make_aged(store, raw, "delivered", 7 * DAY + 60, now=now),
        await make_aged(store, raw, "acked", 8 * DAY, now=now),
        await make_aged(store, raw, "dead_letter", 30 * DAY + 60, now=now),
        await make_aged(store, raw, "expired", 31 * DAY, now=now),
    }
    kept = {
        await make_aged(store, raw, "delivered", 7 * DAY - 60, now=now),
        await make_aged(store, raw, "acked", 6 * DAY, now=now),
        await make_aged(store, raw, "dead_letter", 29 * DAY, now=now),
        await make_aged(store, raw, "dead_letter", 8 * DAY, now=now),
        await make_aged(store, raw, "expired", 30 * DAY - 60, now=now),
        await make_aged(store, raw, "pending", 90 * DAY, now=now),
        await make_aged(store, raw, "delivering", 90 * DAY, now=now),
    }
    before_transitions = raw.counts()[1]

    assert await prune_dispatches(store, now=now) == 4

    assert ids_in(raw) == kept
    assert raw.counts() == (len(kept), before_transitions + 4)
    for dispatch_id in doomed:
        last = raw.transitions(dispatch_id)[-1]
        assert last["reason_code"] == "dispatch.purged.retention"
        assert last["status"] == "purged"
        assert last["source"] == "operator"
        assert last["created_at"] == now
    for dispatch_id in kept:
        assert raw.transitions(dispatch_id)[-1]["reason_code"] == "dispatch.pending.enqueued"


async def test_prune_records_previous_status_of_each_pruned_row(
    store: SQLiteStore, raw: RawDB
) -> None:
    now = T0 + 100 * DAY
    by_status = {
        status: await make_aged(store, raw, status, 60 * DAY, now=now)
        for status in ("delivered", "acked", "dead_letter", "expired")
    }

    assert await prune_dispatches(store, now=now) == 4

    for status, dispatch_id in by_status.items():
        last = raw.transitions(dispatch_id)[-1]
        assert (last["previous_status"], last["status"]) == (status, "purged")


async def test_prune_older_than_applies_one_age_to_all_chosen_statuses(
    store: SQLiteStore, raw: RawDB
) -> None:
    now = T0 + 100 * DAY
    old = {
        s: await make_aged(store, raw, s, 7200, now=now)
        for s in ("delivered", "acked", "dead_letter", "expired")
    }
    young = {
        s: await make_aged(store, raw, s, 1800, now=now)
        for s in ("delivered", "acked", "dead_letter", "expired")
    }
    live = {await make_aged(store, raw, s, 7200, now=now) for s in ("pending", "delivering")}

    assert await prune_dispatches(store, older_than=3600, now=now) == 4

    assert ids_in(raw) == set(young.values()) | live
    assert not ids_in(raw) & set(old.values())


async def test_prune_older_than_with_statuses_prunes_only_those(
    store: SQLiteStore, raw: RawDB
) -> None:
    now = T0 + 100 * DAY
    delivered = await make_aged(store, raw, "delivered", 7200, now=now)
    dead = await make_aged(store, raw, "dead_letter", 7200, now=now)

    assert await prune_dispatches(store, older_than=3600, statuses=["delivered"], now=now) == 1

    assert ids_in(raw) == {dead}
    assert raw.transitions(delivered)[-1]["reason_code"] == "dispatch.purged.retention"


@pytest.mark.parametrize(
    "statuses",
    [["pending"], ["delivering"], ["delivered", "pending"], ["bogus"]],
    ids=["pending", "delivering", "mixed-with-live", "unknown"],
)
async def test_prune_refuses_live_or_unknown_statuses_and_writes_nothing(
    store: SQLiteStore, raw: RawDB, statuses: list[str]
) -> None:
    now = T0 + 100 * DAY
    for status in STATUSES:
        await make_aged(store, raw, status, 60 * DAY, now=now)
    before = snapshot(raw)

    with pytest.raises(ValueError):
        await prune_dispatches(store, older_than=0, statuses=statuses, now=now)

    assert snapshot(raw) == before


async def test_prune_dry_run_returns_count_and_deletes_nothing(
    store: SQLiteStore, raw: RawDB
) -> None:
    now = T0 + 100 * DAY
    for status, age in (
        ("delivered", 10 * DAY),
        ("expired", 40 * DAY),
        ("acked", 1 * DAY),
        ("pending", 90 * DAY),
    ):
        await make_aged(store, raw, status, age, now=now)
    before = snapshot(raw)

    assert await prune_dispatches(store, now=now, dry_run=True) == 2
    assert await prune_dispatches(store, older_than=0, now=now, dry_run=True) == 3

    assert snapshot(raw) == before
    assert await prune_dispatches(store, now=now) == 2


async def test_prune_deletes_more_rows_than_one_chunk(store: SQLiteStore, raw: RawDB) -> None:
    now = T0 + 100 * DAY
    created = now - 40 * DAY
    results = await enqueue_many(
        store, [{"kind": "bulk", "deliver_to": f"seat-{i}"} for i in range(1200)], now=created
    )
    ids = [result.id for result in results]
    raw.execute(
        "UPDATE dispatch_outbox SET status = CASE WHEN substr(id, 32, 1) IN "
        "('0', '2', '4', '6', '8', 'a', 'c', 'e') THEN 'delivered' ELSE 'expired' END"
    )
    young = await make_aged(store, raw, "delivered", DAY, now=now)
    assert raw.counts() == (1201, 1201)

    assert await prune_dispatches(store, now=now, dry_run=True) == 1200
    assert await prune_dispatches(store, now=now) == 1200

    assert ids_in(raw) == {young}
    assert (
        raw.scalar(
            "SELECT COUNT(*) FROM status_transitions "
            "WHERE reason_code = 'dispatch.purged.retention'"
        )
        == 1200
    )
    assert (
        raw.scalar(
            "SELECT COUNT(DISTINCT entity_id) FROM status_transitions "
            "WHERE reason_code = 'dispatch.purged.retention'"
        )
        == 1200
    )
    assert raw.transitions(ids[0])[-1]["reason_code"] == "dispatch.purged.retention"
    assert raw.transitions(ids[-1])[-1]["reason_code"] == "dispatch.purged.retention"


async def test_prune_measures_age_on_updated_at_else_created_at(
    store: SQLiteStore, raw: RawDB
) -> None:
    now = T0 + 100 * DAY
    recently_updated = await enqueue(store, now=now - 60 * DAY)
    set_state(raw, recently_updated, status="delivered", updated_at=now - DAY)
    old_never_updated = await enqueue(store, now=now - 60 * DAY)
    set_state(raw, old_never_updated, status="delivered", updated_at=None)
    young_never_updated = await enqueue(store, now=now - DAY)
    set_state(raw, young_never_updated, status="delivered", updated_at=None)

    assert await prune_dispatches(store, now=now) == 1

    assert ids_in(raw) == {recently_updated, young_never_updated}


@pytest.mark.parametrize(
    "kwargs",
    [
        {"older_than": -1},
        {"older_than": float("nan")},
        {"older_than": "7d"},
        {"statuses": "delivered"},
        {"dry_run": "yes"},
    ],
    ids=["negative", "nan", "str-age", "str-statuses", "non-bool-dry-run"],
)
async def test_prune_rejects_invalid_arguments_and_writes_nothing(
    store: SQLiteStore, raw: RawDB, kwargs: dict[str, Any]
) -> None:
    now = T0 + 100 * DAY
    await make_aged(store, raw, "delivered", 60 * DAY, now=now)
    before = snapshot(raw)

    with pytest.raises((TypeError, ValueError)):
        await prune_dispatches(store, now=now, **kwargs)

    assert snapshot(raw) == before


# -- list_transitions -------------------------------------------------------------------------


async def test_list_transitions_returns_history_oldest_first_with_json_decoded(
    store: SQLiteStore, raw: RawDB
) -> None:
    dispatch_id = await enqueue(store, max_attempts=3)
    claims, _ = await claim_due(store, now=T0 + 1)
    await finish_attempt(store, claims[0], TransportResult.failure("boom"), now=T0 + 2)

    history = await list_transitions(store, dispatch_id)

    assert [t["reason_code"] for t in history] == [
        "dispatch.pending.enqueued",
        "dispatch.delivering.attempt",
        "dispatch.pending.retry_backoff",
    ]
    assert [t["created_at"] for t in history] == [T0, T0 + 1, T0 + 2]
    assert [t["id"] for t in history] == sorted(t["id"] for t in history)
    for transition in history:
        assert transition["evidence_refs"] == []
        assert isinstance(transition["metadata"], dict)
        assert transition["entity_id"] == dispatch_id
    assert history[0]["metadata"] == {}
    assert history[1]["metadata"]["attempt"] == 1
    assert history[2]["metadata"]["error"] == "boom"
    raw_rows = raw.transitions(dispatch_id)
    assert [json.loads(str(r["metadata"])) for r in raw_rows] == [t["metadata"] for t in history]
    assert await list_transitions(store, "0" * 32) == []


# -- enqueue_revival_heartbeat -------------------------------------------------------------------


async def test_revival_heartbeat_enqueues_one_ping_per_seat_with_dedup_key_and_ttl(
    store: SQLiteStore, raw: RawDB
) -> None:
    epoch = 1_700_000_000.0

    ids = await enqueue_revival_heartbeat(store, ["seat-a", "seat-b"], reset_epoch=epoch)

    assert len(ids) == 2 and len(set(ids)) == 2
    assert raw.counts() == (2, 2)
    for seat, dispatch_id in zip(["seat-a", "seat-b"], ids, strict=True):
        row = raw.row(dispatch_id)
        assert row["kind"] == "revival_ping"
        assert row["deliver_to"] == seat
        assert row["dedup_key"] == f"revival:{seat}:{epoch}"
        assert row["ack_required"] == 0
        assert row["ack_token"] is None
        assert row["expires_at"] == epoch + 3600.0
        assert row["status"] == "pending"
        assert raw.transitions(dispatch_id)[0]["reason_code"] == "dispatch.pending.enqueued"


async def test_revival_heartbeat_custom_ttl_and_zero_epoch_means_no_expiry(
    store: SQLiteStore, raw: RawDB
) -> None:
    [short] = await enqueue_revival_heartbeat(
        store, ["seat-a"], reset_epoch=1000.0, ttl_seconds=60.0
    )
    [forever] = await enqueue_revival_heartbeat(store, ["seat-a"], reset_epoch=0)

    assert raw.row(short)["expires_at"] == 1060.0
    assert raw.row(forever)["expires_at"] is None
    assert raw.row(forever)["dedup_key"] == "revival:seat-a:0"


async def test_revival_heartbeat_repeats_return_first_ids_and_write_nothing(
    store: SQLiteStore, raw: RawDB
) -> None:
    epoch = 1_700_000_000.0
    first = await enqueue_revival_heartbeat(store, ["a", "b", "a"], reset_epoch=epoch)
    assert first[2] == first[0]
    assert raw.counts() == (2, 2)
    before = snapshot(raw)

    again = await enqueue_revival_heartbeat(store, ["b", "a"], reset_epoch=epoch)

    assert again == [first[1], first[0]]
    assert snapshot(raw) == before
    fresh = await enqueue_revival_heartbeat(store, ["a"], reset_epoch=epoch + 1)
    assert fresh[0] not in first
    assert raw.counts() == (3, 3)


async def test_a_purge_that_read_a_row_before_another_worker_reclaimed_it_deletes_nothing(
    store: SQLiteStore, raw: RawDB
) -> None:
    from trio_dispatch.lifecycle import Reason
    from trio_dispatch.outbox.machine import delete
    from trio_dispatch.outbox.sql import SELECT_FOR_REMOVAL

    dispatch_id = await enqueue(store, ordering_key="order-9")
    await claim_due(store, now=T0, lease_seconds=30)
    # The purge reads the row once its lease has ended ...
    stale = await store.read(lambda conn: conn.query_one(SELECT_FOR_REMOVAL, (dispatch_id,)))
    assert stale is not None
    # ... and before it deletes, another worker recovers the lease.
    claims, _ = await claim_due(store, now=T0 + 31, lease_seconds=30)
    assert [claim.dispatch_id for claim in claims] == [dispatch_id]

    def purge(conn: Any) -> bool:
        return delete(conn, stale, Reason.PURGED_OPERATOR, "purged", "test", T0 + 32, None)

    assert await store.write(purge) is False
    assert (raw.row(dispatch_id)["status"], raw.row(dispatch_id)["attempt"]) == ("delivering", 2)
