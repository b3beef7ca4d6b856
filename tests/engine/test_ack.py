"""Consumer acknowledgement (docs/guarantees.md, docs/lifecycle.md).

Every test runs on trio and asyncio against a real SQLite file and asserts
what is committed, read back through a separate sqlite3 connection (``raw``).
"""

from __future__ import annotations

import json
import re
from typing import TYPE_CHECKING, Any

import anyio
import pytest

from trio_dispatch import (
    AckRefused,
    DispatchNotFound,
    InvalidTransition,
    ack_dispatch,
    deliver_due_dispatches,
    enqueue_dispatch,
    open_store,
)
from trio_dispatch.outbox import Outcome, claim_due, finish_attempt
from trio_dispatch.store import SQLiteStore
from trio_dispatch.transports import Delivery, TransportResult

if TYPE_CHECKING:
    from ..conftest import RawDB

pytestmark = pytest.mark.anyio

T0 = 1_000_000.0
ACKED_CONSUMER = "dispatch.acked.consumer"


async def enqueue(store: SQLiteStore, *, ack: bool = True, **kwargs: Any) -> str:
    kwargs.setdefault("now", T0)
    return await enqueue_dispatch(
        store, kind="ping", deliver_to="seat-1", ack_required=ack, **kwargs
    )


def token_of(raw: RawDB, dispatch_id: str) -> str:
    token = raw.row(dispatch_id)["ack_token"]
    assert isinstance(token, str)
    return token


def snapshot(raw: RawDB) -> tuple[list[dict[str, object]], list[dict[str, object]]]:
    """Every committed row of both tables, to prove a call wrote nothing."""
    return (
        raw.rows("SELECT * FROM dispatch_outbox ORDER BY id"),
        raw.rows("SELECT * FROM status_transitions ORDER BY id"),
    )


async def succeed(delivery: Delivery) -> bool:
    return True


# -- errors: each raises, and nothing is written --------------------------------


async def test_ack_of_missing_row_raises_lookup_error_and_writes_nothing(
    store: SQLiteStore, raw: RawDB
) -> None:
    dispatch_id = await enqueue(store)
    before = snapshot(raw)

    with pytest.raises(DispatchNotFound) as caught:
        await ack_dispatch(store, "0" * 32, token_of(raw, dispatch_id), now=T0 + 1)

    assert isinstance(caught.value, LookupError)  # what callers caught before
    assert caught.value.dispatch_id == "0" * 32

    assert snapshot(raw) == before
    assert raw.counts() == (1, 1)


async def test_ack_of_row_without_ack_required_raises_value_error_and_writes_nothing(
    store: SQLiteStore, raw: RawDB
) -> None:
    dispatch_id = await enqueue(store, ack=False)
    before = snapshot(raw)

    with pytest.raises(ValueError, match="acknowledg") as caught:
        await ack_dispatch(store, dispatch_id, "f" * 32, now=T0 + 1)

    assert not isinstance(caught.value, InvalidTransition)
    assert isinstance(caught.value, AckRefused)
    assert snapshot(raw) == before
    assert raw.row(dispatch_id)["status"] == "pending"


@pytest.mark.parametrize(
    "make_wrong",
    [
        pytest.param(lambda t: ("0" if t[0] != "0" else "1") + t[1:], id="same-length-hex"),
        pytest.param(lambda t: t.upper() if t.upper() != t else t[::-1], id="different-case"),
        pytest.param(lambda t: t[:-1] + "\u00e9", id="non-ascii-same-char-length"),
        pytest.param(lambda t: "\u00e9" * 32, id="all-non-ascii"),
        pytest.param(lambda t: "\u6f22" * 11, id="cjk"),
        pytest.param(lambda t: t[:-1] + "\ud800", id="lone-surrogate"),
        pytest.param(lambda t: t[:-1], id="shorter"),
        pytest.param(lambda t: t + "0", id="longer"),
        pytest.param(lambda t: "", id="empty"),
        pytest.param(lambda t: t + "\x00", id="nul-suffix"),
    ],
)
async def test_ack_with_wrong_token_raises_value_error_and_writes_nothing(
    store: SQLiteStore, raw: RawDB, make_wrong: Any
) -> None:
    dispatch_id = await enqueue(store)
    token = token_of(raw, dispatch_id)
    wrong = make_wrong(token)
    assert wrong != token
    before = snapshot(raw)

    with pytest.raises(ValueError) as caught:
        await ack_dispatch(store, dispatch_id, wrong, now=T0 + 1)

    # A ValueError, as callers caught before; not InvalidTransition, not TypeError.
    assert type(caught.value) is AckRefused
    assert snapshot(raw) == before
    assert raw.row(dispatch_id)["status"] == "pending"


@pytest.mark.parametrize("bad", [None, 12345, ["token"]], ids=["none", "int", "list"])
async def test_ack_with_non_str_token_raises_type_error_and_writes_nothing(
    store: SQLiteStore, raw: RawDB, bad: object
) -> None:
    dispatch_id = await enqueue(store)
    before = snapshot(raw)

    with pytest.raises(TypeError):
        await ack_dispatch(store, dispatch_id, bad, now=T0 + 1)  # type: ignore[arg-type]

    assert snapshot(raw) == before


async def test_ack_with_token_as_bytes_raises_type_error_and_writes_nothing(
    store: SQLiteStore, raw: RawDB
) -> None:
    dispatch_id = await enqueue(store)
    token = token_of(raw, dispatch_id)
    before = snapshot(raw)

    with pytest.raises(TypeError):
        await ack_dispatch(store, dispatch_id, token.encode(), now=T0 + 1)  # type: ignore[arg-type]

    assert snapshot(raw) == before
    assert raw.row(dispatch_id)["status"] == "pending"


# -- valid acks ----------------------------------------------------------------


async def test_ack_after_successful_send_moves_awaiting_row_from_pending_to_acked(
    store: SQLiteStore, raw: RawDB
) -> None:
    dispatch_id = await enqueue(store, max_attempts=3)
    counts = await deliver_due_dispatches(store, now=T0, transport=succeed)
    assert counts == {"attempted": 1, "delivered": 1, "dead_letter": 0, "expired": 0, "retried": 0}
    assert raw.row(dispatch_id)["status"] == "pending"
    assert raw.transitions(dispatch_id)[-1]["reason_code"] == "dispatch.pending.awaiting_ack"

    assert await ack_dispatch(store, dispatch_id, token_of(raw, dispatch_id), now=T0 + 7) is True

    row = raw.row(dispatch_id)
    assert row["status"] == "acked"
    assert row["attempt"] == 1
    assert row["updated_at"] == T0 + 7
    last = raw.transitions(dispatch_id)[-1]
    assert last["reason_code"] == ACKED_CONSUMER
    assert last["previous_status"] == "pending"
    assert last["status"] == "acked"
    assert last["source"] == "consumer"
    assert last["created_at"] == T0 + 7
    assert raw.counts() == (1, 4)  # enqueued, attempt, awaiting_ack, acked
    # An acked row is finished: no later scan resends it.
    later = await deliver_due_dispatches(store, now=T0 + 100_000, transport=succeed)
    assert later["attempted"] == 0
    assert raw.row(dispatch_id)["status"] == "acked"


async def test_ack_of_never_sent_pending_row_is_allowed(store: SQLiteStore, raw: RawDB) -> None:
    dispatch_id = await enqueue(store)

    assert await ack_dispatch(store, dispatch_id, token_of(raw, dispatch_id), now=T0 + 1)

    assert raw.row(dispatch_id)["status"] == "acked"
    reasons = [(t["previous_status"], t["reason_code"]) for t in raw.transitions(dispatch_id)]
    assert reasons == [(None, "dispatch.pending.enqueued"), ("pending", ACKED_CONSUMER)]


async def test_fast_ack_during_delivery_wins_and_the_finish_is_a_conflict(
    store: SQLiteStore, raw: RawDB
) -> None:
    dispatch_id = await enqueue(store, max_attempts=3)
    seen: list[tuple[str, bool]] = []

    async def acking_transport(delivery: Delivery) -> bool:
        # The consumer acknowledges while the attempt is still running.
        token = json.loads(delivery.payload)["ack_token"]
        status_during = raw.row(delivery.dispatch_id)["status"]
        acked = await ack_dispatch(store, delivery.dispatch_id, token, now=T0 + 1)
        seen.append((str(status_during), acked))
        return True

    counts = await deliver_due_dispatches(store, now=T0, transport=acking_transport)

    assert seen == [("delivering", True)]
    assert counts == {"attempted": 1, "delivered": 0, "dead_letter": 0, "expired": 0, "retried": 0}
    row = raw.row(dispatch_id)
    assert row["status"] == "acked"
    assert row["attempt"] == 1
    transitions = raw.transitions(dispatch_id)
    assert [t["reason_code"] for t in transitions] == [
        "dispatch.pending.enqueued",
        "dispatch.delivering.attempt",
        ACKED_CONSUMER,
    ]
    assert transitions[-1]["previous_status"] == "delivering"
    assert transitions[-1]["source"] == "consumer"


async def test_fast_ack_between_claim_and_finish_makes_finish_return_conflict(
    store: SQLiteStore, raw: RawDB
) -> None:
    dispatch_id = await enqueue(store, max_attempts=3)
    claims, _ = await claim_due(store, now=T0)
    assert [c.dispatch_id for c in claims] == [dispatch_id]

    assert await ack_dispatch(store, dispatch_id, token_of(raw, dispatch_id), now=T0 + 1)
    after_ack = snapshot(raw)
    outcome = await finish_attempt(store, claims[0], TransportResult.success(), now=T0 + 2)

    assert outcome is Outcome.CONFLICT
    assert snapshot(raw) == after_ack
    assert raw.row(dispatch_id)["status"] == "acked"
    assert raw.transitions(dispatch_id)[-1]["reason_code"] == ACKED_CONSUMER


# -- statuses without an edge to acked --------------------------------------------


@pytest.mark.parametrize("status", ["acked", "delivered", "dead_letter", "expired"])
async def test_ack_from_finished_status_raises_invalid_transition_and_writes_nothing(
    store: SQLiteStore, raw: RawDB, status: str
) -> None:
    dispatch_id = await enqueue(store)
    raw.execute(
        "UPDATE dispatch_outbox SET status = ?, attempt = 1 WHERE id = ?", (status, dispatch_id)
    )
    before = snapshot(raw)

    with pytest.raises(InvalidTransition):
        await ack_dispatch(store, dispatch_id, token_of(raw, dispatch_id), now=T0 + 1)

    assert snapshot(raw) == before
    assert raw.row(dispatch_id)["status"] == status


async def test_second_ack_of_acked_row_raises_invalid_transition(
    store: SQLiteStore, raw: RawDB
) -> None:
    dispatch_id = await enqueue(store)
    token = token_of(raw, dispatch_id)
    assert await ack_dispatch(store, dispatch_id, token, now=T0 + 1)
    before = snapshot(raw)

    with pytest.raises(InvalidTransition):
        await ack_dispatch(store, dispatch_id, token, now=T0 + 2)

    assert snapshot(raw) == before


# -- compare-and-set ----------------------------------------------------------------


async def test_ack_returns_false_when_status_changes_between_read_and_write(
    store: SQLiteStore, raw: RawDB, db_target: str
) -> None:
    dispatch_id = await enqueue(store)
    token = token_of(raw, dispatch_id)
    result: list[bool] = []

    async def acknowledge() -> None:
        result.append(await ack_dispatch(store, dispatch_id, token, now=T0 + 1))

    async with open_store(db_target) as other:
        async with anyio.create_task_group() as tg:
            async with other.transaction() as tx:
                changed = await tx.execute(
                    "UPDATE dispatch_outbox SET status = 'delivering', attempt = attempt + 1 "
                    "WHERE id = ?",
                    (dispatch_id,),
                )
                assert changed == 1
                tg.start_soon(acknowledge)
                # The ack reads the committed snapshot (pending), then its
                # write waits for the other store's IMMEDIATE lock.
                await anyio.sleep(0.5)
                assert result == [], "the ack's write must be waiting for the lock"
            # leaving the block committed the other store's change

    assert result == [False]
    row = raw.row(dispatch_id)
    assert row["status"] == "delivering"
    assert row["attempt"] == 1
    assert [t["reason_code"] for t in raw.transitions(dispatch_id)] == ["dispatch.pending.enqueued"]


# -- the token ----------------------------------------------------------------------


async def test_ack_token_generated_only_when_ack_required_and_stored_in_row_and_payload(
    store: SQLiteStore, raw: RawDB
) -> None:
    first = await enqueue(store, ack=True)
    second = await enqueue(store, ack=True)
    plain = await enqueue(store, ack=False)

    for dispatch_id in (first, second):
        row = raw.row(dispatch_id)
        token = row["ack_token"]
        assert isinstance(token, str)
        assert re.fullmatch(r"[0-9a-f]{32}", token)
        assert token != dispatch_id
        assert row["ack_required"] == 1
        assert json.loads(str(row["payload"]))["ack_token"] == token
    assert raw.row(first)["ack_token"] != raw.row(second)["ack_token"]

    row = raw.row(plain)
    assert row["ack_token"] is None
    assert row["ack_required"] == 0
    assert json.loads(str(row["payload"]))["ack_token"] is None
