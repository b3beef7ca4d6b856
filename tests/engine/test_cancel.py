"""Cancel (docs/controls.md) on both engines and both backends, through the
library and real rows: a pending row at once, a running attempt marked and
settled by its fenced finish (cancelled, or too late after a success),
lease recovery and shutdown release of a marked attempt, ordering keys,
refusals that write nothing, the cancel inside a caller's transaction, and
the listeners that tell workers of a cancel."""

from __future__ import annotations

import json
from functools import partial
from typing import Any

import anyio
import pytest

from trio_dispatch import (
    ActionRefused,
    CancelTooLate,
    Delivery,
    DispatchNotFound,
    InvalidTransition,
    cancel_dispatch,
    cancel_dispatches,
    deliver_due_dispatches,
    enqueue_dispatch,
    get_dispatch,
    open_store,
)
from trio_dispatch.outbox import Outcome, claim_due, finish_attempt, release_attempt
from trio_dispatch.store import SQLiteStore
from trio_dispatch.store.base import Listener
from trio_dispatch.transports import TransportResult

from ..conftest import RawDB
from ..helpers import wait_for

pytestmark = pytest.mark.anyio

T0 = 1_000_000.0


def metadata(transition: dict[str, Any]) -> dict[str, Any]:
    meta = transition["metadata"]
    return meta if isinstance(meta, dict) else dict(json.loads(meta))


def last(raw: RawDB, dispatch_id: str) -> dict[str, Any]:
    return raw.transitions(dispatch_id)[-1]


async def send_ok(delivery: Any) -> bool:
    return True


async def running(store: SQLiteStore, **kwargs: Any) -> tuple[str, Any]:
    """A dispatch claimed at T0 with a 600 s lease: an attempt running."""
    dispatch_id = await enqueue_dispatch(store, kind="k", deliver_to="seat", now=T0, **kwargs)
    [claim], _ = await claim_due(store, now=T0, ids=[dispatch_id], lease_seconds=600)
    return dispatch_id, claim


async def test_a_pending_dispatch_is_cancelled_at_once_with_the_operators_reason(
    store: SQLiteStore, raw: RawDB
) -> None:
    dispatch_id = await enqueue_dispatch(store, kind="k", deliver_to="seat", now=T0)
    result = await cancel_dispatch(store, dispatch_id, "not needed", now=T0 + 1, actor="ops")
    assert (result.cancelled, result.previous, result.attempt) == (True, "pending", 0)
    row = raw.row(dispatch_id)
    assert (row["status"], row["updated_at"], row["cancel_requested_at"]) == (
        "cancelled",
        T0 + 1,
        None,
    )
    transition = last(raw, dispatch_id)
    assert (transition["previous_status"], transition["status"]) == ("pending", "cancelled")
    assert (transition["reason_code"], transition["source"], transition["actor"]) == (
        "dispatch.cancelled.operator",
        "operator",
        "ops",
    )
    assert metadata(transition)["reason"] == "not needed"
    assert "not needed" in str(transition["reason_summary"])
    # Nothing of it is ever sent.
    counts = await deliver_due_dispatches(store, now=T0 + 2, transport=send_ok)
    assert counts["attempted"] == 0


@pytest.mark.parametrize("status", ["delivered", "dead_letter", "expired", "cancelled"])
async def test_a_finished_dispatch_is_refused_naming_its_status_and_nothing_is_written(
    store: SQLiteStore, raw: RawDB, status: str
) -> None:
    dispatch_id = await enqueue_dispatch(
        store, kind="k", deliver_to=status, now=T0, max_attempts=1, expires_at=T0 + 5
    )

    async def send(delivery: Delivery) -> bool:
        return delivery.deliver_to != "dead_letter"

    if status == "expired":
        await deliver_due_dispatches(store, now=T0 + 10, transport=send)
    elif status == "cancelled":
        await cancel_dispatch(store, dispatch_id, now=T0)
    else:
        await deliver_due_dispatches(store, now=T0 + 1, transport=send)
    assert raw.row(dispatch_id)["status"] == status
    before = raw.counts(), raw.row(dispatch_id)
    with pytest.raises(InvalidTransition, match=status) as refused:
        await cancel_dispatch(store, dispatch_id, now=T0 + 20)
    assert not isinstance(refused.value, CancelTooLate)
    assert refused.value.from_status == status
    assert (raw.counts(), raw.row(dispatch_id)) == before


async def test_an_unknown_id_and_a_bad_reason_are_refused_before_anything_is_written(
    store: SQLiteStore, raw: RawDB
) -> None:
    dispatch_id = await enqueue_dispatch(store, kind="k", deliver_to="seat", now=T0)
    before = raw.counts()
    with pytest.raises(DispatchNotFound):
        await cancel_dispatch(store, "0" * 32)
    with pytest.raises(DispatchNotFound):
        await cancel_dispatch(store, "bad\x00id")
    with pytest.raises(ValueError, match="reason"):
        await cancel_dispatch(store, dispatch_id, "two\nlines")
    with pytest.raises(ValueError, match="wait_seconds"):
        await cancel_dispatch(store, dispatch_id, wait_seconds=-1)
    assert raw.counts() == before and raw.row(dispatch_id)["status"] == "pending"


async def test_a_running_attempt_is_marked_and_its_failed_end_records_cancelled(
    store: SQLiteStore, raw: RawDB
) -> None:
    dispatch_id, claim = await running(store)
    result = await cancel_dispatch(store, dispatch_id, "stuck", wait_seconds=0, now=T0 + 1)
    assert (result.requested, result.status, result.attempt) == (True, "delivering", 1)
    row = raw.row(dispatch_id)
    assert (row["status"], row["cancel_requested_at"]) == ("delivering", T0 + 1)
    assert json.loads(str(row["cancel_request"])) == {
        "requested_by": "cancel_dispatch",
        "reason": "stuck",
    }
    # A second cancel keeps the first request.
    await cancel_dispatch(store, dispatch_id, wait_seconds=0, now=T0 + 2, actor="other")
    assert raw.row(dispatch_id)["cancel_requested_at"] == T0 + 1
    # The attempt's end (cut by the cancel) is recorded as the cancel.
    outcome = await finish_attempt(store, claim, TransportResult.cut_by_cancel(), now=T0 + 3)
    assert outcome is Outcome.CANCELLED
    assert raw.row(dispatch_id)["status"] == "cancelled"
    transition = last(raw, dispatch_id)
    assert (transition["previous_status"], transition["reason_code"]) == (
        "delivering",
        "dispatch.cancelled.operator",
    )
    assert (transition["source"], transition["actor"]) == ("scheduler", "dispatch_delivery_loop")
    note = metadata(transition)
    assert (note["attempt"], note["requested_at"], note["reason"]) == (1, T0 + 1, "stuck")
    assert note["requested_by"] == "cancel_dispatch"


@pytest.mark.parametrize(
    "result",
    [
        TransportResult.failure("refused"),
        TransportResult.throttle("busy", retry_after=30),
        TransportResult.not_sent("out of file descriptors"),
    ],
    ids=["failure", "throttle", "not-sent"],
)
async def test_any_end_but_a_success_of_a_marked_attempt_is_cancelled_not_retried(
    store: SQLiteStore, raw: RawDB, result: TransportResult
) -> None:
    dispatch_id, claim = await running(store, max_attempts=5)
    await cancel_dispatch(store, dispatch_id, wait_seconds=0, now=T0 + 1)
    assert await finish_attempt(store, claim, result, now=T0 + 2) is Outcome.CANCELLED
    row = raw.row(dispatch_id)
    assert (row["status"], row["attempt"]) == ("cancelled", 1)
    assert [t["status"] for t in raw.transitions(dispatch_id)] == [
        "pending",
        "delivering",
        "cancelled",
    ]


async def test_a_success_that_came_first_stands_and_says_the_cancel_was_too_late(
    store: SQLiteStore, raw: RawDB
) -> None:
    dispatch_id, claim = await running(store)

    async def finish_when_marked() -> None:
        await wait_for(lambda: raw.row(dispatch_id)["cancel_requested_at"] is not None)
        outcome = await finish_attempt(store, claim, TransportResult.success(), now=T0 + 2)
        assert outcome is Outcome.DELIVERED

    async with anyio.create_task_group() as tg:
        tg.start_soon(finish_when_marked)
        with pytest.raises(CancelTooLate, match="too late") as late:
            await cancel_dispatch(store, dispatch_id, wait_seconds=10, now=T0 + 1)
    assert late.value.from_status == "delivered"
    row = raw.row(dispatch_id)
    assert (row["status"], row["cancel_requested_at"], row["cancel_request"]) == (
        "delivered",
        None,
        None,
    )
    transition = last(raw, dispatch_id)
    assert transition["reason_code"] == "dispatch.delivered.transport_ok"
    cancel = metadata(transition)["cancel"]
    assert (cancel["too_late"], cancel["requested_at"]) == (True, T0 + 1)


async def test_an_awaited_ack_success_also_stands_and_the_row_can_then_be_cancelled(
    store: SQLiteStore, raw: RawDB
) -> None:
    dispatch_id, claim = await running(store, ack_required=True, max_attempts=3)
    await cancel_dispatch(store, dispatch_id, wait_seconds=0, now=T0 + 1)
    outcome = await finish_attempt(store, claim, TransportResult.success(), now=T0 + 2)
    assert outcome is Outcome.AWAITING_ACK
    assert raw.row(dispatch_id)["cancel_requested_at"] is None  # no mark left on a pending row
    result = await cancel_dispatch(store, dispatch_id, now=T0 + 3)
    assert (result.cancelled, result.previous) == (True, "pending")


async def test_a_running_attempt_whose_lease_has_run_out_is_cancelled_by_the_operator_at_once(
    store: SQLiteStore, raw: RawDB
) -> None:
    dispatch_id, claim = await running(store)
    result = await cancel_dispatch(store, dispatch_id, now=claim.lease_until + 1)
    assert (result.cancelled, result.previous) == (True, "delivering")
    transition = last(raw, dispatch_id)
    assert (transition["source"], transition["actor"]) == ("operator", "cancel_dispatch")
    assert metadata(transition)["lease_until"] == claim.lease_until
    # The worker that held it, if it comes back, is fenced out.
    outcome = await finish_attempt(store, claim, TransportResult.success(), now=T0 + 700)
    assert outcome is Outcome.CONFLICT
    assert raw.row(dispatch_id)["status"] == "cancelled"


async def test_lease_recovery_of_a_marked_attempt_records_the_cancel_instead_of_a_new_attempt(
    store: SQLiteStore, raw: RawDB
) -> None:
    dispatch_id, claim = await running(store, max_attempts=5)
    await cancel_dispatch(store, dispatch_id, "dead worker", wait_seconds=0, now=T0 + 1)
    claims, _ = await claim_due(store, now=claim.lease_until + 1)
    assert claims == []
    row = raw.row(dispatch_id)
    assert (row["status"], row["attempt"]) == ("cancelled", 1)
    transition = last(raw, dispatch_id)
    assert (transition["source"], transition["reason_code"]) == (
        "scheduler",
        "dispatch.cancelled.operator",
    )
    assert metadata(transition)["reason"] == "dead worker"


async def test_a_shutdown_release_of_a_marked_attempt_records_the_cancel(
    store: SQLiteStore, raw: RawDB
) -> None:
    dispatch_id, claim = await running(store, max_attempts=5)
    await cancel_dispatch(store, dispatch_id, wait_seconds=0, now=T0 + 1)
    assert await release_attempt(store, claim, now=T0 + 2) is Outcome.CANCELLED
    assert raw.row(dispatch_id)["status"] == "cancelled"
    assert "worker shutdown" in str(last(raw, dispatch_id)["reason_summary"])


@pytest.mark.parametrize("head_state", ["pending", "delivering"])
async def test_a_cancelled_head_of_an_ordering_key_lets_the_next_row_go(
    store: SQLiteStore, raw: RawDB, head_state: str
) -> None:
    head = await enqueue_dispatch(store, kind="k", deliver_to="a", ordering_key="K", now=T0)
    behind = await enqueue_dispatch(store, kind="k", deliver_to="a", ordering_key="K", now=T0)
    if head_state == "delivering":
        [claim], _ = await claim_due(store, now=T0, lease_seconds=600)
        assert claim.dispatch_id == head
        await cancel_dispatch(store, head, wait_seconds=0, now=T0 + 1)
        claims, _ = await claim_due(store, now=T0 + 1)
        assert claims == []  # marked, the head still holds its key until its end
        await finish_attempt(store, claim, TransportResult.cut_by_cancel(), now=T0 + 2)
    else:
        claims, _ = await claim_due(store, now=T0, limit=10, ids=[behind])
        assert claims == []  # it waits behind its head
        await cancel_dispatch(store, head, now=T0 + 2)
    assert raw.row(head)["status"] == "cancelled"
    claims, _ = await claim_due(store, now=T0 + 2)
    assert [c.dispatch_id for c in claims] == [behind]


async def test_a_cancel_in_the_callers_transaction_commits_or_rolls_back_with_it(
    store: SQLiteStore, raw: RawDB
) -> None:
    kept = await enqueue_dispatch(store, kind="k", deliver_to="seat", now=T0)
    undone = await enqueue_dispatch(store, kind="k", deliver_to="seat", now=T0)
    async with store.transaction() as tx:
        result = await cancel_dispatch(tx, kept, now=T0 + 1)
        assert result.cancelled
    with pytest.raises(RuntimeError, match="changed my mind"):
        async with store.transaction() as tx:
            await cancel_dispatch(tx, undone, now=T0 + 1)
            raise RuntimeError("changed my mind")
    assert raw.row(kept)["status"] == "cancelled"
    assert raw.row(undone)["status"] == "pending"
    assert [t["status"] for t in raw.transitions(undone)] == ["pending"]
    # A running attempt's cancel in a transaction is asked for, not waited on.
    dispatch_id, _ = await running(store)
    async with store.transaction() as tx:
        asked = await cancel_dispatch(tx, dispatch_id, now=T0 + 1)
    assert asked.requested and raw.row(dispatch_id)["cancel_requested_at"] == T0 + 1


@pytest.mark.every_pair  # each engine's listener waits in the event loop: each backend's
async def test_a_listener_hears_a_cancel_committed_by_another_store(db_target: str) -> None:
    """PostgreSQL names the dispatch (a notice on the cancel channel);
    SQLite's commit watch hears that something committed (None)."""
    heard: list[str | None] = []
    async with open_store(db_target) as listening, open_store(db_target) as other:
        assert isinstance(listening, Listener)
        dispatch_id, _ = await running(other)  # type: ignore[arg-type]

        async with anyio.create_task_group() as tg:
            tg.start_soon(partial(listening.listen, lambda: None, on_cancel=heard.append))
            await wait_for(lambda: heard == [None])  # listening began: look once
            await cancel_dispatch(other, dispatch_id, wait_seconds=0, now=T0 + 1)
            row = await get_dispatch(other, dispatch_id)
            assert row is not None and row["status"] == "delivering"  # marked: running
            wanted = None if db_target.endswith(".db") else dispatch_id
            await wait_for(lambda: wanted in heard[1:])
            tg.cancel_scope.cancel()


async def test_a_bulk_cancel_takes_pending_and_running_rows_newest_first_and_a_dry_run_nothing(
    store: SQLiteStore, raw: RawDB
) -> None:
    keyed = [
        await enqueue_dispatch(store, kind="k", deliver_to="billing", ordering_key="K", now=T0)
        for _ in range(3)
    ]
    [claim], _ = await claim_due(store, now=T0, ids=[keyed[0]], lease_seconds=600)
    other = await enqueue_dispatch(store, kind="k", deliver_to="mail", now=T0)
    before = raw.rows("SELECT * FROM dispatch_outbox ORDER BY id"), raw.counts()
    dry = await cancel_dispatches(store, deliver_to="billing", dry_run=True, now=T0 + 1)
    assert (dry.matched, dry.cancelled, dry.requested, dry.dry_run) == (3, 0, 0, True)
    assert (raw.rows("SELECT * FROM dispatch_outbox ORDER BY id"), raw.counts()) == before
    with pytest.raises(ActionRefused, match="delivered"):
        await cancel_dispatches(store, status="delivered")
    done = await cancel_dispatches(store, deliver_to="billing", reason="gone", now=T0 + 1)
    assert (done.matched, done.cancelled, done.requested, done.skipped) == (3, 2, 1, 0)
    # Newest first: the rows behind the head went before it could promote them.
    order = raw.rows(
        "SELECT entity_id FROM status_transitions WHERE status = 'cancelled' ORDER BY id"
    )
    assert [row["entity_id"] for row in order] == [keyed[2], keyed[1]]
    assert raw.row(keyed[0])["cancel_requested_at"] == T0 + 1  # running: marked
    assert all(raw.row(i)["next_attempt_at"] >= 1e15 for i in keyed[1:])  # never made due
    assert raw.row(other)["status"] == "pending"
    assert metadata(last(raw, keyed[1]))["filter"]["deliver_to"] == "billing"
    assert await finish_attempt(store, claim, TransportResult.cut_by_cancel(), now=T0 + 2) is (
        Outcome.CANCELLED
    )
    again = await cancel_dispatches(store, deliver_to="billing", now=T0 + 3)
    assert (again.matched, again.cancelled, again.requested) == (0, 0, 0)
