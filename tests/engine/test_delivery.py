"""Delivery (docs/guarantees.md): scan, expiry, claim, fencing, backoff,
dead letter, the ack tier and failure bookkeeping."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import anyio
import pytest

from trio_dispatch import (
    Delivery,
    deliver_due_dispatches,
    enqueue_dispatch,
    open_store,
    retry_dispatch,
)
from trio_dispatch.outbox import Outcome, claim_due, finish_attempt, release_attempt
from trio_dispatch.store import SQLiteStore, Store
from trio_dispatch.transports import TransportResult

from ..conftest import RawDB

pytestmark = pytest.mark.anyio

T0 = 1_000_000.0


class Recorder:
    """An async callable transport that records what it was asked to send
    and answers with a fixed outcome."""

    def __init__(self, ok: bool = True, error: str = "boom") -> None:
        self.ok = ok
        self.error = error
        self.sent: list[Delivery] = []

    async def __call__(self, delivery: Delivery) -> TransportResult:
        self.sent.append(delivery)
        return TransportResult.success() if self.ok else TransportResult.failure(self.error)


async def test_counters_are_exactly_the_adr_mapping(store: SQLiteStore) -> None:
    counts = await deliver_due_dispatches(store, now=T0, transport=Recorder())
    assert counts == {"attempted": 0, "delivered": 0, "dead_letter": 0, "expired": 0, "retried": 0}


async def test_scan_orders_by_due_time_then_creation_and_stops_at_the_batch_size(
    store: SQLiteStore, raw: RawDB
) -> None:
    ids = [
        await enqueue_dispatch(store, kind="k", deliver_to=f"s{i}", now=T0 + i) for i in range(6)
    ]
    # Due order: s3 (earliest due), then s0, s1, s2 by creation; s4, s5 later.
    raw.execute("UPDATE dispatch_outbox SET next_attempt_at = ? WHERE id = ?", (T0 - 50, ids[3]))
    for i in (0, 1, 2):
        raw.execute("UPDATE dispatch_outbox SET next_attempt_at = ? WHERE id = ?", (T0, ids[i]))
    sender = Recorder()
    counts = await deliver_due_dispatches(store, now=T0 + 10, transport=sender, batch_size=3)
    assert [d.deliver_to for d in sender.sent] == ["s3", "s0", "s1"]
    assert counts["attempted"] == 3 and counts["delivered"] == 3
    assert raw.row(ids[2])["status"] == "pending"


async def test_rows_due_at_the_same_moment_go_in_creation_order_not_insertion_order(
    store: SQLiteStore, raw: RawDB
) -> None:
    created = {"s0": T0 + 5, "s1": T0 + 3, "s2": T0 + 4}
    for route, at in created.items():
        await enqueue_dispatch(store, kind="k", deliver_to=route, now=at)
    raw.execute("UPDATE dispatch_outbox SET next_attempt_at = ?", (T0 + 6,))
    sender = Recorder()
    await deliver_due_dispatches(store, now=T0 + 10, transport=sender, batch_size=2)
    assert [d.deliver_to for d in sender.sent] == ["s1", "s2"]


async def test_rows_not_yet_due_are_not_scanned(store: SQLiteStore, raw: RawDB) -> None:
    dispatch_id = await enqueue_dispatch(store, kind="k", deliver_to="seat", now=T0)
    sender = Recorder()
    counts = await deliver_due_dispatches(store, now=T0 - 1, transport=sender)
    assert counts["attempted"] == 0 and sender.sent == []
    assert raw.row(dispatch_id)["status"] == "pending"


async def test_claim_sets_delivering_increments_attempt_and_leases_15_seconds(
    store: SQLiteStore, raw: RawDB
) -> None:
    dispatch_id = await enqueue_dispatch(store, kind="k", deliver_to="seat", now=T0)
    seen: dict[str, Any] = {}

    async def look(delivery: Delivery) -> None:
        seen.update(raw.row(dispatch_id))
        seen["delivery_attempt"] = delivery.attempt

    await deliver_due_dispatches(store, now=T0 + 1, transport=look)
    assert (seen["status"], seen["attempt"], seen["delivery_attempt"]) == ("delivering", 1, 1)
    assert seen["next_attempt_at"] == T0 + 1 + 15
    claim = raw.transitions(dispatch_id)[1]
    assert (claim["previous_status"], claim["status"], claim["reason_code"]) == (
        "pending",
        "delivering",
        "dispatch.delivering.attempt",
    )
    assert json.loads(str(claim["metadata"])) == {"attempt": 1, "lease_until": T0 + 16}


async def test_claim_transitions_read_the_same_on_every_engine(
    store: SQLiteStore, raw: RawDB
) -> None:
    # PostgreSQL writes a claim's transition row from the row it updated;
    # its text must be what the other engine's client-built row says.
    dispatch_id = await enqueue_dispatch(store, kind="k", deliver_to="seat", now=T0)
    first, _ = await claim_due(store, now=T0 + 1, lease_seconds=15)
    again, _ = await claim_due(store, now=T0 + 20.25, lease_seconds=15)
    assert [c.attempt for c in first + again] == [1, 2]
    claimed, recovered = raw.transitions(dispatch_id)[1:3]
    assert (claimed["reason_summary"], str(claimed["metadata"])) == (
        "attempt 1 of 8",
        '{"attempt": 1, "lease_until": 1000016.0}',
    )
    assert (recovered["previous_status"], recovered["status"], recovered["source"]) == (
        "delivering",
        "delivering",
        "scheduler",
    )
    assert (recovered["reason_summary"], str(recovered["metadata"])) == (
        "lease expired; attempt 2 of 8",
        '{"attempt": 2, "lease_until": 1000035.25}',
    )
    assert claimed["created_at"] == T0 + 1 and recovered["created_at"] == T0 + 20.25
    # The finishes write their rows the same way: the stale claim's none.
    stale = await finish_attempt(store, first[0], TransportResult.success(), now=T0 + 21)
    done = await finish_attempt(store, again[0], TransportResult.failure("503"), now=T0 + 22)
    assert (stale, done) == (Outcome.CONFLICT, Outcome.RETRY)
    history = raw.transitions(dispatch_id)
    assert len(history) == 4
    assert (history[3]["previous_status"], history[3]["status"], history[3]["actor"]) == (
        "delivering",
        "pending",
        recovered["actor"],
    )
    assert json.loads(str(history[3]["metadata"]))["error"] == "503"
    assert (claimed["reason_code"], history[3]["reason_code"]) == (
        "dispatch.delivering.attempt",
        "dispatch.pending.retry_backoff",
    )
    assert history[3]["created_at"] == T0 + 22


async def test_lease_follows_a_configured_timeout(store: SQLiteStore, raw: RawDB) -> None:
    dispatch_id = await enqueue_dispatch(store, kind="k", deliver_to="seat", now=T0)
    claims, _ = await claim_due(store, now=T0, lease_seconds=2 + 5)
    assert [c.lease_until for c in claims] == [T0 + 7]
    assert raw.row(dispatch_id)["next_attempt_at"] == T0 + 7


async def test_expiry_wins_before_the_claim_and_nothing_is_sent(
    store: SQLiteStore, raw: RawDB
) -> None:
    dispatch_id = await enqueue_dispatch(
        store, kind="k", deliver_to="seat", expires_at=T0 + 5, now=T0
    )
    sender = Recorder()
    counts = await deliver_due_dispatches(store, now=T0 + 5, transport=sender)
    assert sender.sent == []
    assert counts == {"attempted": 1, "delivered": 0, "dead_letter": 0, "expired": 1, "retried": 0}
    row = raw.row(dispatch_id)
    assert (row["status"], row["attempt"]) == ("expired", 0)
    assert raw.transitions(dispatch_id)[-1]["reason_code"] == "dispatch.expired.deadline"


async def test_a_stale_delivering_row_is_recovered_after_its_lease(
    store: SQLiteStore, raw: RawDB
) -> None:
    dispatch_id = await enqueue_dispatch(store, kind="k", deliver_to="seat", now=T0)
    claims, _ = await claim_due(store, now=T0)  # a claimant that then dies
    assert len(claims) == 1
    sender = Recorder()
    early = await deliver_due_dispatches(store, now=T0 + 14, transport=sender)
    assert early["attempted"] == 0 and sender.sent == []
    counts = await deliver_due_dispatches(store, now=T0 + 15, transport=sender)
    assert counts["delivered"] == 1 and [d.attempt for d in sender.sent] == [2]
    recovery = raw.transitions(dispatch_id)[2]
    assert (recovery["previous_status"], recovery["status"]) == ("delivering", "delivering")
    assert recovery["reason_code"] == "dispatch.delivering.attempt"
    assert raw.row(dispatch_id)["status"] == "delivered"


async def test_a_stale_claimant_cannot_overwrite_the_newer_attempt(
    store: SQLiteStore, raw: RawDB
) -> None:
    dispatch_id = await enqueue_dispatch(store, kind="k", deliver_to="seat", now=T0)
    [stale], _ = await claim_due(store, now=T0)
    [fresh], _ = await claim_due(store, now=T0 + 16)  # lease recovered by another worker
    assert (stale.attempt, fresh.attempt) == (1, 2)
    history = len(raw.transitions(dispatch_id))
    for result in (TransportResult.success(), TransportResult.failure("late")):
        assert await finish_attempt(store, stale, result, now=T0 + 17) is Outcome.CONFLICT
    row = raw.row(dispatch_id)
    assert (row["status"], row["attempt"], row["last_error"]) == ("delivering", 2, None)
    assert len(raw.transitions(dispatch_id)) == history
    assert await finish_attempt(store, fresh, TransportResult.success(), now=T0 + 18) is (
        Outcome.DELIVERED
    )
    assert raw.row(dispatch_id)["status"] == "delivered"


async def test_overlapping_scans_never_send_one_attempt_twice(db_target: str, raw: RawDB) -> None:
    sent: list[tuple[str, int]] = []

    async def slow(delivery: Delivery) -> None:
        sent.append((delivery.dispatch_id, delivery.attempt))
        await anyio.sleep(0.01)

    async with open_store(db_target) as a, open_store(db_target) as b:
        ids = [await enqueue_dispatch(a, kind="k", deliver_to=f"s{i}", now=T0) for i in range(30)]
        totals: list[dict[str, int]] = []

        async def scan(db: Store) -> None:
            totals.append(await deliver_due_dispatches(db, now=T0 + 1, transport=slow))

        async with anyio.create_task_group() as tg:
            for db in (a, b, a, b):
                tg.start_soon(scan, db)
    assert sorted(sent) == sorted((i, 1) for i in ids)
    assert sum(t["delivered"] for t in totals) == 30
    assert raw.scalar("SELECT COUNT(*) FROM dispatch_outbox WHERE status = 'delivered'") == 30


async def test_backoff_schedule_then_dead_letter_at_max_attempts(
    store: SQLiteStore, raw: RawDB
) -> None:
    dispatch_id = await enqueue_dispatch(store, kind="k", deliver_to="seat", now=T0)
    sender = Recorder(ok=False, error="refused")
    delays = []
    now = T0
    for attempt in range(1, 9):
        counts = await deliver_due_dispatches(store, now=now, transport=sender)
        row = raw.row(dispatch_id)
        assert row["attempt"] == attempt and row["last_error"] == "refused"
        if attempt < 8:
            assert counts["retried"] == 1 and row["status"] == "pending"
            delays.append(row["next_attempt_at"] - now)
            now = float(row["next_attempt_at"])
        else:
            assert counts["dead_letter"] == 1 and row["status"] == "dead_letter"
    assert delays == [60, 120, 240, 480, 960, 1800, 1800]
    codes = [t["reason_code"] for t in raw.transitions(dispatch_id)]
    assert codes.count("dispatch.pending.retry_backoff") == 7
    assert codes[-1] == "dispatch.dead_letter.max_attempts"
    assert len(sender.sent) == 8
    assert await deliver_due_dispatches(store, now=now + 10**6, transport=sender) == {
        "attempted": 0,
        "delivered": 0,
        "dead_letter": 0,
        "expired": 0,
        "retried": 0,
    }


async def test_max_attempts_one_dead_letters_on_the_first_failure(
    store: SQLiteStore, raw: RawDB
) -> None:
    dispatch_id = await enqueue_dispatch(store, kind="k", deliver_to="seat", max_attempts=1, now=T0)
    counts = await deliver_due_dispatches(store, now=T0, transport=Recorder(ok=False))
    assert counts["dead_letter"] == 1 and counts["retried"] == 0
    assert raw.row(dispatch_id)["status"] == "dead_letter"


async def test_ack_tier_resends_with_backoff_until_sends_run_out(
    store: SQLiteStore, raw: RawDB
) -> None:
    dispatch_id = await enqueue_dispatch(
        store, kind="k", deliver_to="seat", ack_required=True, max_attempts=3, now=T0
    )
    sender = Recorder()
    first = await deliver_due_dispatches(store, now=T0, transport=sender)
    assert first["delivered"] == 1 and first["retried"] == 0
    row = raw.row(dispatch_id)
    assert (row["status"], row["next_attempt_at"]) == ("pending", T0 + 60)
    await deliver_due_dispatches(store, now=T0 + 60, transport=sender)
    assert raw.row(dispatch_id)["next_attempt_at"] == T0 + 60 + 120
    last = await deliver_due_dispatches(store, now=T0 + 180, transport=sender)
    assert last["delivered"] == 1 and last["dead_letter"] == 1
    assert raw.row(dispatch_id)["status"] == "dead_letter"
    codes = [t["reason_code"] for t in raw.transitions(dispatch_id)]
    assert codes == [
        "dispatch.pending.enqueued",
        "dispatch.delivering.attempt",
        "dispatch.pending.awaiting_ack",
        "dispatch.delivering.attempt",
        "dispatch.pending.awaiting_ack",
        "dispatch.delivering.attempt",
        "dispatch.dead_letter.ack_timeout",
    ]
    assert len(sender.sent) == 3


async def test_failure_bookkeeping_is_one_transaction(store: SQLiteStore, raw: RawDB) -> None:
    dispatch_id = await enqueue_dispatch(store, kind="k", deliver_to="seat", now=T0)
    [claim], _ = await claim_due(store, now=T0)
    # The transition insert fails after the row update ran in the same
    # transaction: nothing of the failure may remain (no early retry).
    raw.refuse_transitions("crash here", "dispatch.pending.retry_backoff")
    with pytest.raises(raw.error, match="crash here"):
        await finish_attempt(store, claim, TransportResult.failure("refused"), now=T0 + 1)
    row = raw.row(dispatch_id)
    assert (row["status"], row["attempt"], row["last_error"]) == ("delivering", 1, None)
    assert row["next_attempt_at"] == T0 + 15  # still the lease, not a retry time
    raw.allow_transitions()
    assert (
        await finish_attempt(store, claim, TransportResult.failure("refused"), now=T0 + 1)
        is Outcome.RETRY
    )
    row = raw.row(dispatch_id)
    assert (row["status"], row["last_error"], row["next_attempt_at"]) == (
        "pending",
        "refused",
        T0 + 1 + 60,
    )


async def test_a_historical_last_error_is_kept_after_a_later_success(
    store: SQLiteStore, raw: RawDB
) -> None:
    dispatch_id = await enqueue_dispatch(store, kind="k", deliver_to="seat", now=T0)
    await deliver_due_dispatches(store, now=T0, transport=Recorder(ok=False, error="first"))
    await deliver_due_dispatches(store, now=T0 + 60, transport=Recorder())
    row = raw.row(dispatch_id)
    assert (row["status"], row["last_error"]) == ("delivered", "first")


async def test_a_lease_lost_on_the_last_attempt_dead_letters_without_another_send(
    store: SQLiteStore, raw: RawDB
) -> None:
    dispatch_id = await enqueue_dispatch(store, kind="k", deliver_to="seat", max_attempts=1, now=T0)
    await claim_due(store, now=T0)  # the claimant dies mid-send
    sender = Recorder()
    counts = await deliver_due_dispatches(store, now=T0 + 15, transport=sender)
    assert sender.sent == [] and counts["dead_letter"] == 1
    row = raw.row(dispatch_id)
    assert (row["status"], row["attempt"]) == ("dead_letter", 1)
    last = raw.transitions(dispatch_id)[-1]
    assert (last["previous_status"], last["reason_code"]) == (
        "delivering",
        "dispatch.dead_letter.max_attempts",
    )


def _script(tmp_path: Path, name: str, body: str) -> list[str]:
    path = tmp_path / name
    path.write_text(body)
    return [sys.executable, str(path)]


@pytest.mark.parametrize(
    "body, expected",
    [
        ("import sys; sys.stderr.write('  bad route \\n'); sys.exit(3)", "bad route"),
        ("import sys; sys.exit(3)", "exit 3"),
        ("import sys; sys.stderr.write('x' * 5000); sys.exit(1)", "x" * 2000),
    ],
    ids=["stripped-stderr", "exit-code", "cut-to-2000"],
)
async def test_last_error_is_stripped_stderr_or_exit_code_cut_to_2000_chars(
    store: SQLiteStore, raw: RawDB, tmp_path: Path, body: str, expected: str
) -> None:
    dispatch_id = await enqueue_dispatch(store, kind="k", deliver_to="seat", now=T0)
    template = _script(tmp_path, "t.py", body)
    counts = await deliver_due_dispatches(store, now=T0, notify_template=template)
    assert counts["retried"] == 1
    assert raw.row(dispatch_id)["last_error"] == expected


async def test_a_command_transport_delivers_the_payload_and_route(
    store: SQLiteStore, raw: RawDB, tmp_path: Path
) -> None:
    out = tmp_path / "got.json"
    template = [
        *_script(
            tmp_path,
            "t.py",
            "import json, os, sys\n"
            f"open({str(out)!r}, 'w').write(json.dumps({{'argv': sys.argv[1:], "
            "'stdin': sys.stdin.read(), 'env': {k: v for k, v in os.environ.items() "
            "if k.startswith('TRIO_DISPATCH_')}}))\n",
        ),
        "{deliver_to}",
    ]
    dispatch_id = await enqueue_dispatch(store, kind="ping", deliver_to="seat-9", now=T0)
    counts = await deliver_due_dispatches(store, now=T0, notify_template=template)
    assert counts["delivered"] == 1
    got = json.loads(out.read_text())
    assert got["argv"] == ["seat-9"]
    assert got["stdin"] == raw.row(dispatch_id)["payload"]
    assert got["env"] == {
        "TRIO_DISPATCH_ID": dispatch_id,
        "TRIO_DISPATCH_ATTEMPT": "1",
        "TRIO_DISPATCH_KIND": "ping",
        "TRIO_DISPATCH_DELIVER_TO": "seat-9",
    }
    assert raw.row(dispatch_id)["status"] == "delivered"


@pytest.mark.parametrize("template", [None, [], "not-a-list", ["ok", 3]])
async def test_a_missing_or_invalid_template_is_a_recorded_failure(
    store: SQLiteStore, raw: RawDB, template: Any
) -> None:
    dispatch_id = await enqueue_dispatch(store, kind="k", deliver_to="seat", now=T0)
    counts = await deliver_due_dispatches(store, now=T0, notify_template=template)
    assert counts["retried"] == 1
    row = raw.row(dispatch_id)
    assert row["status"] == "pending" and "notify_template" in str(row["last_error"])


async def test_a_missing_executable_is_a_recorded_failure(
    store: SQLiteStore, raw: RawDB, tmp_path: Path
) -> None:
    dispatch_id = await enqueue_dispatch(store, kind="k", deliver_to="seat", now=T0)
    missing = str(tmp_path / "no-such-command")
    counts = await deliver_due_dispatches(store, now=T0, notify_template=[missing])
    assert counts["retried"] == 1
    assert "no-such-command" in str(raw.row(dispatch_id)["last_error"])


async def test_a_transport_timeout_is_a_recorded_failure(
    store: SQLiteStore, raw: RawDB, tmp_path: Path
) -> None:
    dispatch_id = await enqueue_dispatch(store, kind="k", deliver_to="seat", now=T0)
    template = _script(tmp_path, "t.py", "import time; time.sleep(30)")
    with anyio.fail_after(10):
        counts = await deliver_due_dispatches(
            store, now=T0, notify_template=template, timeout_seconds=0.5
        )
    assert counts["retried"] == 1
    assert "timeout" in str(raw.row(dispatch_id)["last_error"])


async def test_a_raising_callable_transport_is_a_recorded_failure(
    store: SQLiteStore, raw: RawDB
) -> None:
    async def broken(delivery: Delivery) -> None:
        raise ConnectionError(f"no route to {delivery.deliver_to}")

    dispatch_id = await enqueue_dispatch(store, kind="k", deliver_to="seat", now=T0)
    counts = await deliver_due_dispatches(store, now=T0, transport=broken)
    assert counts["retried"] == 1
    assert raw.row(dispatch_id)["last_error"] == "ConnectionError: no route to seat"


async def test_a_stale_claim_is_fenced_even_after_an_operator_retry_reset_the_attempt(
    store: SQLiteStore, raw: RawDB
) -> None:
    dispatch_id = await enqueue_dispatch(
        store, kind="k", deliver_to="seat", expires_at=T0 + 10, now=T0
    )
    [stale], _ = await claim_due(store, now=T0)  # worker A stalls mid-send
    _, counts = await claim_due(store, now=T0 + 20)  # lease over, deadline past
    assert counts["expired"] == 1
    assert await retry_dispatch(store, dispatch_id, expires_at=None, now=T0 + 21)
    [fresh], _ = await claim_due(store, now=T0 + 22)  # attempt 1 again, a new lease
    assert (stale.attempt, fresh.attempt) == (1, 1)
    assert await finish_attempt(store, stale, TransportResult.success(), now=T0 + 23) is (
        Outcome.CONFLICT
    )
    assert await release_attempt(store, stale, now=T0 + 23) is Outcome.CONFLICT
    assert raw.row(dispatch_id)["status"] == "delivering"
    assert (
        await finish_attempt(store, fresh, TransportResult.failure("boom"), now=T0 + 24)
        is Outcome.RETRY
    )
    row = raw.row(dispatch_id)
    assert (row["status"], row["attempt"], row["last_error"]) == ("pending", 1, "boom")


async def test_delivery_refuses_a_transaction_handle(store: SQLiteStore, raw: RawDB) -> None:
    dispatch_id = await enqueue_dispatch(store, kind="k", deliver_to="seat", now=T0)
    sender = Recorder()
    async with store.transaction() as tx:
        with pytest.raises(TypeError, match="not a transaction handle"):
            await deliver_due_dispatches(tx, now=T0, transport=sender)
    assert raw.row(dispatch_id)["status"] == "pending" and sender.sent == []


async def test_a_transport_object_that_raises_is_a_recorded_failure(
    store: SQLiteStore, raw: RawDB
) -> None:
    class Exploding:
        async def __call__(self, delivery: Delivery) -> TransportResult:
            raise OSError("socket closed")

    dispatch_id = await enqueue_dispatch(store, kind="k", deliver_to="seat", now=T0)
    counts = await deliver_due_dispatches(store, now=T0, transport=Exploding())
    assert counts["retried"] == 1
    assert raw.row(dispatch_id)["last_error"] == "OSError: socket closed"


async def test_a_transport_that_ignores_its_timeout_is_stopped_before_the_lease_ends(
    store: SQLiteStore, raw: RawDB
) -> None:
    class Stubborn:  # a transport object with no timeout of its own
        async def __call__(self, delivery: Delivery) -> TransportResult:
            await anyio.sleep(60)
            return TransportResult.success()

    dispatch_id = await enqueue_dispatch(store, kind="k", deliver_to="seat", now=T0)
    with anyio.fail_after(10):
        # timeout 0 -> lease 1.5 s (its margin) -> the transport is cut at 0.5 s
        counts = await deliver_due_dispatches(
            store, now=T0, transport=Stubborn(), timeout_seconds=0, lease_margin_seconds=1.5
        )
    assert counts["retried"] == 1
    assert "timeout" in str(raw.row(dispatch_id)["last_error"])


async def test_a_transport_object_returning_something_else_is_a_recorded_failure(
    store: SQLiteStore, raw: RawDB
) -> None:
    class Sloppy:
        async def __call__(self, delivery: Delivery) -> None:
            return None

    dispatch_id = await enqueue_dispatch(store, kind="k", deliver_to="seat", now=T0)
    counts = await deliver_due_dispatches(store, now=T0, transport=Sloppy())
    assert counts["retried"] == 1
    assert raw.row(dispatch_id)["last_error"] == "transport returned None, not a TransportResult"


async def test_a_pass_sends_only_the_rows_due_when_it_started(
    store: SQLiteStore, raw: RawDB
) -> None:
    # A transport that enqueues follow-ups: they are due at once, but they
    # belong to the next pass, as a row that falls due again does.
    first = await enqueue_dispatch(store, kind="k", deliver_to="seat", now=T0)
    sent: list[str] = []

    async def send(delivery: Delivery) -> None:
        sent.append(delivery.dispatch_id)
        await enqueue_dispatch(store, kind="follow-up", deliver_to="seat", now=T0)

    counts = await deliver_due_dispatches(store, now=T0, transport=send)
    assert sent == [first] and counts["attempted"] == counts["delivered"] == 1
    assert raw.scalar("SELECT COUNT(*) FROM dispatch_outbox WHERE status = 'pending'") == 1


async def test_a_pass_with_nothing_due_takes_no_write_lock(db_target: str, raw: RawDB) -> None:
    async def send(delivery: Delivery) -> None:
        raise AssertionError("nothing is due")

    async with open_store(db_target):
        pass
    async with open_store(db_target, read_only=True) as reader:  # it could not write
        counts = await deliver_due_dispatches(reader, transport=send)
    assert counts == {"attempted": 0, "delivered": 0, "dead_letter": 0, "expired": 0, "retried": 0}
