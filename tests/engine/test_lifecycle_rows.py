"""Every path that writes a status change writes the documented reason and source,
and the schema's check and partial indexes name exactly the enum's statuses:
read back from real rows."""

from __future__ import annotations

import json
import re

import pytest

from trio_dispatch import (
    Throttled,
    ack_dispatch,
    cancel_dispatch,
    deliver_due_dispatches,
    enqueue_dispatch,
    prune_dispatches,
    purge_dispatch,
    retry_dispatch,
)
from trio_dispatch import lifecycle as lc
from trio_dispatch.outbox import Outcome, claim_due, finish_attempt, release_attempt
from trio_dispatch.store import SQLiteStore
from trio_dispatch.transports import Delivery, TransportResult

from ..conftest import RawDB
from ..unit.test_lifecycle import SPEC_EDGE_SOURCES, SPEC_EDGES, SPEC_REASON_CODES, STATUSES

pytestmark = pytest.mark.anyio

DELIVERY_CODES = frozenset(
    {
        "dispatch.delivering.attempt",
        "dispatch.delivered.transport_ok",
        "dispatch.pending.awaiting_ack",
        "dispatch.pending.retry_backoff",
        "dispatch.dead_letter.max_attempts",
        "dispatch.dead_letter.ack_timeout",
        "dispatch.dead_letter.gone",
        "dispatch.expired.deadline",
        "dispatch.pending.released",
        "dispatch.pending.throttled",
    }
)


OPERATOR_CODES = frozenset(
    {"dispatch.pending.operator_retry", "dispatch.purged.operator", "dispatch.purged.retention"}
)


T0 = 1_000_000.0


@pytest.mark.sqlite_only
async def test_the_schema_check_and_partial_indexes_list_exactly_the_enum_statuses(
    store: SQLiteStore, raw: RawDB
) -> None:
    ddl = {
        row["name"]: row["sql"]
        for row in raw.rows("SELECT name, sql FROM sqlite_master WHERE sql IS NOT NULL")
    }
    check = re.search(r"CHECK \(status IN \(([^)]*)\)\)", ddl["dispatch_outbox"])
    assert check is not None
    assert {part.strip().strip("'") for part in check.group(1).split(",")} == lc.STATUSES
    due = re.search(r"WHERE (.*)$", ddl["ix_dispatch_outbox_status_next_attempt"].strip())
    finished = re.search(r"WHERE (.*)$", ddl["ix_dispatch_outbox_finished_age"].strip())
    assert due is not None and due.group(1) == lc.DUE_SQL
    assert finished is not None and finished.group(1) == lc.FINISHED_SQL
    for status in STATUSES:  # the database itself refuses anything else
        raw.execute("UPDATE dispatch_outbox SET status = ? WHERE 0", (status,))
    dispatch_id = await enqueue_dispatch(store, kind="k", deliver_to="seat")
    with pytest.raises(raw.error):
        raw.execute("UPDATE dispatch_outbox SET status = 'lost' WHERE id = ?", (dispatch_id,))


def status_of_reason(code: str) -> str:
    """``dispatch.<status>.<why>`` -> ``<status>`` (``purged`` for purges)."""
    entity, status, _ = code.split(".")
    assert entity == "dispatch"
    return status


async def test_every_transition_written_on_every_path_carries_a_spec_reason_and_source(
    store: SQLiteStore, raw: RawDB
) -> None:
    async def add(route: str, *, now: float = T0, **kwargs: object) -> str:
        return await enqueue_dispatch(
            store,
            kind="walk",
            deliver_to=route,
            now=now,
            **kwargs,  # type: ignore[arg-type]
        )

    # Rows claimed early and left to their leases: one to be recovered, one
    # whose last attempt was spent.
    recovered = await add("ok", now=T0 - 100, max_attempts=3)
    spent = await add("ok", now=T0 - 100, max_attempts=1)
    early, _ = await claim_due(store, now=T0 - 100)
    assert {claim.dispatch_id for claim in early} == {recovered, spent}

    delivered = await add("ok")
    awaiting = await add("ok", ack_required=True, max_attempts=3)
    retried = await add("fail", max_attempts=3)
    dead = await add("fail", max_attempts=1)
    ack_timeout = await add("ok", ack_required=True, max_attempts=1)
    expired = await add("ok", expires_at=T0)
    fast_acked = await add("fast-ack", ack_required=True, max_attempts=3)
    gone = await add("gone", max_attempts=5)
    throttled = await add("busy", max_attempts=1)

    sent: list[str] = []
    fast_ack_results: list[bool] = []

    async def transport(delivery: Delivery) -> bool | TransportResult:
        sent.append(delivery.dispatch_id)
        if delivery.deliver_to == "busy":
            raise Throttled(retry_after=30)
        if delivery.deliver_to == "gone":
            return TransportResult.failure("HTTP 410: no such hook", gone=True)
        if delivery.deliver_to == "fail":
            raise RuntimeError("destination refused")
        if delivery.deliver_to == "fast-ack":
            token = json.loads(delivery.payload)["ack_token"]
            fast_ack_results.append(
                await ack_dispatch(store, delivery.dispatch_id, token, now=T0 + 0.5)
            )
        return True

    counts = await deliver_due_dispatches(store, now=T0, transport=transport)

    assert counts == {
        "attempted": 11,
        "delivered": 4,  # delivered, awaiting, ack_timeout, recovered (fast ack conflicts)
        "dead_letter": 4,  # dead, ack_timeout, spent, gone
        "expired": 1,
        "retried": 1,
    }
    assert fast_ack_results == [True]
    assert spent not in sent and expired not in sent
    assert sorted(sent) == sorted(
        [recovered, delivered, awaiting, retried, dead, ack_timeout, fast_acked, gone, throttled]
    )

    # Worker shutdown interrupting an attempt: released, due at once.
    released = await add("ok", now=T0 + 5)
    [claim], _ = await claim_due(store, now=T0 + 5)
    assert claim.dispatch_id == released
    assert await release_attempt(store, claim, now=T0 + 6) is Outcome.RELEASED

    # Operator cancels (docs/controls.md): a pending row at once, a running attempt
    # by the fenced end of the attempt its worker cut.
    cancelled = await add("ok", now=T0 + 7)
    assert (await cancel_dispatch(store, cancelled, now=T0 + 7)).cancelled
    cut = await add("ok", now=T0 + 7)
    [running], _ = await claim_due(store, now=T0 + 7, ids=[cut])
    assert (await cancel_dispatch(store, cut, wait_seconds=0, now=T0 + 7)).requested
    outcome = await finish_attempt(store, running, TransportResult.cut_by_cancel(), now=T0 + 8)
    assert outcome is Outcome.CANCELLED
    # Coalescing (docs/controls.md): a newer enqueue of the key supersedes the row
    # waiting unclaimed.
    superseded = await add("ok", now=T0 + 9, coalesce_key="walk", coalesce="replace")
    replacing = await add("ok", now=T0 + 9, coalesce_key="walk", coalesce="replace")

    # Consumer ack of a row awaiting its ack (pending).
    awaiting_token = str(raw.row(awaiting)["ack_token"])
    assert await ack_dispatch(store, awaiting, awaiting_token, now=T0 + 1)
    # Operator retry from dead_letter and from expired, then a purge.
    assert await retry_dispatch(store, dead, now=T0 + 2)
    assert await retry_dispatch(store, expired, now=T0 + 2, expires_at=None)
    assert await purge_dispatch(store, dead, now=T0 + 3)
    # Retention prune of the delivered rows.
    assert await prune_dispatches(store, older_than=0, statuses=["delivered"], now=T0 + 4) == 2

    # Final statuses.
    final = {str(r["id"]): r for r in raw.rows("SELECT * FROM dispatch_outbox")}
    assert delivered not in final and recovered not in final and dead not in final
    assert final[awaiting]["status"] == "acked"
    assert final[retried]["status"] == "pending"
    assert final[ack_timeout]["status"] == "dead_letter"
    assert final[expired]["status"] == "pending"
    assert final[fast_acked]["status"] == "acked"
    assert final[spent]["status"] == "dead_letter"
    assert (final[gone]["status"], final[gone]["attempt"]) == ("dead_letter", 1)
    # Its one allowed attempt was throttled: not spent, due when the destination allows.
    assert (final[throttled]["status"], final[throttled]["attempt"]) == ("pending", 1)
    assert (final[throttled]["throttles"], final[throttled]["next_attempt_at"]) == (1, T0 + 30)
    assert final[spent]["attempt"] == 1  # no second send on the spent lease
    assert (final[released]["status"], final[released]["attempt"]) == ("pending", 1)
    assert final[released]["next_attempt_at"] == T0 + 6

    # Path-specific transitions.
    def reasons(dispatch_id: str) -> list[tuple[str | None, str, str]]:
        return [
            (t["previous_status"], str(t["status"]), str(t["reason_code"]))
            for t in raw.transitions(dispatch_id)
        ]

    assert reasons(recovered) == [
        (None, "pending", "dispatch.pending.enqueued"),
        ("pending", "delivering", "dispatch.delivering.attempt"),
        ("delivering", "delivering", "dispatch.delivering.attempt"),
        ("delivering", "delivered", "dispatch.delivered.transport_ok"),
        ("delivered", "purged", "dispatch.purged.retention"),
    ]
    assert reasons(spent) == [
        (None, "pending", "dispatch.pending.enqueued"),
        ("pending", "delivering", "dispatch.delivering.attempt"),
        ("delivering", "dead_letter", "dispatch.dead_letter.max_attempts"),
    ]
    assert reasons(awaiting)[-2:] == [
        ("delivering", "pending", "dispatch.pending.awaiting_ack"),
        ("pending", "acked", "dispatch.acked.consumer"),
    ]
    assert reasons(retried)[-1] == ("delivering", "pending", "dispatch.pending.retry_backoff")
    assert reasons(dead)[-3:] == [
        ("delivering", "dead_letter", "dispatch.dead_letter.max_attempts"),
        ("dead_letter", "pending", "dispatch.pending.operator_retry"),
        ("pending", "purged", "dispatch.purged.operator"),
    ]
    assert reasons(ack_timeout)[-1] == (
        "delivering",
        "dead_letter",
        "dispatch.dead_letter.ack_timeout",
    )
    assert reasons(expired) == [
        (None, "pending", "dispatch.pending.enqueued"),
        ("pending", "expired", "dispatch.expired.deadline"),
        ("expired", "pending", "dispatch.pending.operator_retry"),
    ]
    assert reasons(gone)[-1] == ("delivering", "dead_letter", "dispatch.dead_letter.gone")
    assert reasons(throttled)[-1] == ("delivering", "pending", "dispatch.pending.throttled")
    assert reasons(fast_acked) == [
        (None, "pending", "dispatch.pending.enqueued"),
        ("pending", "delivering", "dispatch.delivering.attempt"),
        ("delivering", "acked", "dispatch.acked.consumer"),
    ]

    # Every transition row in the database.
    transitions = raw.rows("SELECT * FROM status_transitions ORDER BY id")
    assert transitions
    seen: set[str] = set()
    last_status: dict[str, str] = {}
    for t in transitions:
        code = str(t["reason_code"])
        where = f"transition {t['id']} of {t['entity_id']}: {code}"
        assert code in SPEC_REASON_CODES, where
        seen.add(code)
        assert t["entity_type"] == "dispatch", where
        assert t["status"] == status_of_reason(code), where
        assert json.loads(str(t["evidence_refs"])) == [], where
        assert isinstance(json.loads(str(t["metadata"])), dict), where
        if code == "dispatch.pending.enqueued":
            assert (t["source"], t["actor"]) == ("system", "enqueue_dispatch"), where
            assert t["previous_status"] is None, where
        elif code in DELIVERY_CODES:
            assert (t["source"], t["actor"]) == ("scheduler", "dispatch_delivery_loop"), where
        elif code in OPERATOR_CODES:
            assert t["source"] == "operator", where
            assert t["actor"], where
        elif code == "dispatch.cancelled.operator":
            # An operator's cancel, recorded by the operator (a pending row)
            # or by the delivery loop that cut the running attempt.
            expected = "operator" if t["previous_status"] == "pending" else "scheduler"
            assert t["source"] == expected, where
            assert t["actor"], where
        elif code == "dispatch.superseded.coalesced":
            # The enqueue that replaced the row, naming the new row.
            assert (t["source"], t["actor"]) == ("system", "enqueue_dispatch"), where
            assert f"superseded by {replacing}" == t["reason_summary"], where
            assert json.loads(str(t["metadata"]))["superseded_by"] == replacing, where
        elif code == "dispatch.acked.consumer":
            assert t["source"] == "consumer", where
            assert t["actor"], where
        else:  # pragma: no cover - a code the walk cannot produce
            pytest.fail(f"unexpected {where}")
        # Each transition starts where the entity's previous one ended, and
        # every status change is an edge of the graph (docs/lifecycle.md).
        entity = str(t["entity_id"])
        assert t["previous_status"] == last_status.get(entity), where
        if t["previous_status"] is not None and t["status"] != "purged":
            edge = (t["previous_status"], t["status"])
            assert edge in SPEC_EDGES, where
            assert t["source"] in SPEC_EDGE_SOURCES[edge], where
        last_status[entity] = str(t["status"])

    # The rows still present end where their history ends.
    for dispatch_id, row in final.items():
        assert last_status[dispatch_id] == row["status"]

    assert reasons(released)[-1] == ("delivering", "pending", "dispatch.pending.released")
    assert reasons(cancelled)[-1] == ("pending", "cancelled", "dispatch.cancelled.operator")
    assert reasons(cut)[-1] == ("delivering", "cancelled", "dispatch.cancelled.operator")
    assert reasons(superseded) == [
        (None, "pending", "dispatch.pending.enqueued"),
        ("pending", "superseded", "dispatch.superseded.coalesced"),
    ]
    assert final[replacing]["status"] == "pending"
    assert seen == SPEC_REASON_CODES
