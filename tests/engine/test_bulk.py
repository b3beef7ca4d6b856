"""Bulk operator actions (docs/dashboard.md) on a real store, both engines: exactly
the filtered rows change, each with its own transition; a refused action
changes nothing."""

from __future__ import annotations

import json

import pytest

from trio_dispatch import ActionRefused, deliver_due_dispatches, enqueue_many
from trio_dispatch.attempt import Delivery, TransportResult
from trio_dispatch.outbox.bulk import apply_bulk, bulk_filter, count_matching
from trio_dispatch.store import SQLiteStore

from ..conftest import RawDB

pytestmark = pytest.mark.anyio


async def fail_some(delivery: Delivery) -> TransportResult:
    if delivery.deliver_to == "bad":
        return TransportResult.failure("down")
    return TransportResult.success()


async def mixed(store: SQLiteStore) -> None:
    """Dead letters of two kinds and two keys, and delivered rows."""
    items = [
        {"kind": kind, "deliver_to": route, "max_attempts": 1, "ordering_key": key}
        for kind, route, key in [
            ("a", "bad", None),
            ("a", "bad", None),
            ("b", "bad", None),
            ("a", "bad", "k1"),
            ("a", "ok", None),
            ("b", "ok", None),
        ]
    ]
    await enqueue_many(store, items)
    while (await deliver_due_dispatches(store, transport=fail_some))["attempted"]:
        pass


def by_status(raw: RawDB) -> dict[str, list[tuple[str, str | None]]]:
    found: dict[str, list[tuple[str, str | None]]] = {}
    for row in raw.rows("SELECT status, kind, ordering_key FROM dispatch_outbox ORDER BY id"):
        found.setdefault(row["status"], []).append((row["kind"], row["ordering_key"]))
    return found


async def test_bulk_retry_changes_exactly_the_filtered_rows_each_with_its_transition(
    store: SQLiteStore, raw: RawDB
) -> None:
    await mixed(store)
    action, chosen = bulk_filter("retry", "dead_letter", "a")
    assert await count_matching(store, chosen) == 3
    result = await apply_bulk(store, action, chosen, actor="web", metadata={"client": "127.0.0.1"})
    assert (result.matched, result.applied, result.skipped) == (3, 3, 0)
    assert by_status(raw) == {
        "pending": [("a", None), ("a", None), ("a", "k1")],
        "dead_letter": [("b", None)],
        "delivered": [("a", None), ("b", None)],
    }
    retries = raw.rows(
        "SELECT source, actor, metadata FROM status_transitions "
        "WHERE reason_code = 'dispatch.pending.operator_retry'"
    )
    assert len(retries) == 3
    for row in retries:
        assert (row["source"], row["actor"]) == ("operator", "web")
        meta = row["metadata"] if isinstance(row["metadata"], dict) else json.loads(row["metadata"])
        assert meta["client"] == "127.0.0.1"


async def test_bulk_retry_by_ordering_key_takes_only_that_keys_head(
    store: SQLiteStore, raw: RawDB
) -> None:
    await mixed(store)
    action, chosen = bulk_filter("retry", "dead_letter", ordering_key="k1")
    assert (await apply_bulk(store, action, chosen, actor="web")).applied == 1
    assert by_status(raw)["pending"] == [("a", "k1")]


async def test_bulk_purge_of_delivered_rows_and_its_limit(store: SQLiteStore, raw: RawDB) -> None:
    await mixed(store)
    action, chosen = bulk_filter("purge", "delivered")
    result = await apply_bulk(store, action, chosen, actor="web", limit=1)
    assert (result.matched, result.applied) == (1, 1)
    assert by_status(raw)["delivered"] == [("b", None)]  # the oldest went first
    purged = raw.rows(
        "SELECT actor, status FROM status_transitions "
        "WHERE reason_code = 'dispatch.purged.operator'"
    )
    assert purged == [{"actor": "web", "status": "purged"}]


@pytest.mark.parametrize("status", ["delivered", "acked", "pending", "delivering"])
async def test_a_bulk_retry_of_rows_without_that_edge_is_refused_and_changes_nothing(
    store: SQLiteStore, raw: RawDB, status: str
) -> None:
    await mixed(store)
    before = raw.rows("SELECT id, status, updated_at FROM dispatch_outbox ORDER BY id")
    with pytest.raises(ActionRefused, match=f"retry of {status} rows is not allowed"):
        bulk_filter("retry", status)
    assert raw.rows("SELECT id, status, updated_at FROM dispatch_outbox ORDER BY id") == before


@pytest.mark.parametrize(
    "args, message",
    [
        (("resend", "dead_letter"), "action must be one of retry, purge"),
        (("purge", "gone"), "status must be one of"),
        (("purge", "delivered", ""), "kind must be a non-empty string"),
        (("purge", "delivered", None, "a\x00b"), "ordering_key"),
    ],
)
def test_a_bad_bulk_request_names_its_value(args: tuple[object, ...], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        bulk_filter(*args)
