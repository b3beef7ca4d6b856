"""The expiry sweep (docs/destinations.md#expiry-of-rows-held-back) on both engines and both
backends: rows no claim reads -- a paused or throttled destination's, one
behind its shared concurrency or rate, one at a worker's cap, a keyed row
waiting behind its head -- expire at their own ``expires_at`` with the
claim's transition, a batch a transaction; a delivering row whose lease
runs is left to its attempt; a keyed head's expiry promotes or blocks as a
claim's does; two sweepers write one transition per row; a version 10
database gains the expiry index. Asserted on the committed rows, with
fixed clocks."""

from __future__ import annotations

import sqlite3
from collections import Counter

import anyio
import pytest

from trio_dispatch import (
    Destination,
    enqueue_dispatch,
    open_store,
    pause_destination,
    resume_destination,
)
from trio_dispatch.outbox import Claim, claim_due, finish_attempt
from trio_dispatch.outbox.claim import DestinationCaps
from trio_dispatch.outbox.expiry import (
    SWEEP_BATCH,
    expire_overdue_dispatches,
    next_expiry,
    next_expiry_at,
)
from trio_dispatch.outbox.ordering import OrderingPolicy
from trio_dispatch.store import SQLiteStore
from trio_dispatch.store.base import Conn, Store
from trio_dispatch.store.schema import EXPIRY_INDEX, MIGRATIONS, SCHEMA_VERSION
from trio_dispatch.transports import TransportResult

from ..conftest import PostgresRaw, RawDB
from .test_capped_scan import Reads

pytestmark = pytest.mark.anyio

T0 = 1_000_000.0
DEADLINE = T0 + 100
LEASE = 3600.0
DEADLINE_REASON = "dispatch.expired.deadline"


async def enqueue(
    store: SQLiteStore,
    deliver_to: str,
    expires_at: float | None = DEADLINE,
    ordering_key: str | None = None,
) -> str:
    return await enqueue_dispatch(
        store,
        kind="k",
        deliver_to=deliver_to,
        expires_at=expires_at,
        ordering_key=ordering_key,
        now=T0,
    )


async def claim(store: SQLiteStore, at: float, **rules: object) -> list[Claim]:
    claims, _ = await claim_due(store, now=at, lease_seconds=LEASE, **rules)  # type: ignore[arg-type]
    return claims


def reasons(raw: RawDB, dispatch_id: str) -> list[str]:
    return [t["reason_code"] for t in raw.transitions(dispatch_id)]


async def assert_expires_at_its_deadline_only(
    store: SQLiteStore, raw: RawDB, dispatch_id: str, previous: str = "pending"
) -> None:
    """Not before its deadline; at it, with the claim's own transition,
    from ``previous``, no attempt made."""
    attempt = raw.row(dispatch_id)["attempt"]
    assert (await expire_overdue_dispatches(store, now=DEADLINE - 0.001)).expired == 0
    assert raw.row(dispatch_id)["status"] == previous
    assert await next_expiry_at(store, now=DEADLINE - 0.001) == DEADLINE
    swept = await expire_overdue_dispatches(store, now=DEADLINE)
    assert swept.expired >= 1
    row = raw.row(dispatch_id)
    assert (row["status"], row["attempt"], row["updated_at"]) == ("expired", attempt, DEADLINE)
    last = raw.transitions(dispatch_id)[-1]
    assert (last["previous_status"], last["status"], last["reason_code"]) == (
        previous,
        "expired",
        DEADLINE_REASON,
    )
    assert (last["source"], last["actor"], last["created_at"]) == (
        "scheduler",
        "dispatch_delivery_loop",
        DEADLINE,
    )
    assert last["reason_summary"] == f"expires_at {DEADLINE} passed before attempt {attempt + 1}"
    assert await next_expiry_at(store, now=DEADLINE) is None


# -- rows no claim reads ---------------------------------------------------------------


async def test_a_paused_destinations_row_expires_at_its_deadline_without_a_claim(
    store: SQLiteStore, raw: RawDB
) -> None:
    row = await enqueue(store, "paused")
    await pause_destination(store, "paused", reason="maintenance", now=T0)
    assert await claim(store, DEADLINE + 50) == []  # the claim never reads it
    assert raw.row(row)["status"] == "pending"
    await assert_expires_at_its_deadline_only(store, raw, row)
    assert reasons(raw, row) == ["dispatch.pending.enqueued", DEADLINE_REASON]


async def test_a_throttled_destinations_row_expires_at_its_deadline_without_a_claim(
    store: SQLiteStore, raw: RawDB
) -> None:
    first = await enqueue(store, "throttled")
    waiting = await enqueue(store, "throttled")
    [sent] = await claim(store, T0, limit=1)
    assert sent.dispatch_id == first
    # The destination answers 429 with Retry-After: 1 h.
    throttled = TransportResult.throttle("HTTP 429", retry_after=3600)
    await finish_attempt(store, sent, throttled, now=T0 + 1)
    assert await claim(store, DEADLINE + 50) == []
    assert raw.row(waiting)["status"] == raw.row(first)["status"] == "pending"
    await assert_expires_at_its_deadline_only(store, raw, waiting)
    # The throttled row's deadline passed too: both expired, neither sent again.
    assert raw.row(first)["status"] == "expired"
    assert reasons(raw, first)[-2:] == ["dispatch.pending.throttled", DEADLINE_REASON]


@pytest.mark.parametrize("limit", [Destination(concurrency=1), Destination(rate="1/h")])
async def test_a_destinations_row_behind_its_shared_limit_expires_without_a_claim(
    store: SQLiteStore, raw: RawDB, limit: Destination
) -> None:
    running = await enqueue(store, "full", expires_at=None)
    behind = await enqueue(store, "full")
    policies = {"full": limit}
    [sent] = await claim(store, T0, destinations=policies)  # holds the one place
    assert sent.dispatch_id == running
    assert await claim(store, DEADLINE + 50, destinations=policies) == []
    await assert_expires_at_its_deadline_only(store, raw, behind)
    assert raw.row(running)["status"] == "delivering"


async def test_a_row_of_a_destination_at_a_workers_cap_expires_without_a_claim(
    store: SQLiteStore, raw: RawDB
) -> None:
    running = await enqueue(store, "capped", expires_at=None)
    behind = await enqueue(store, "capped")
    caps = DestinationCaps(1)
    [sent] = await claim(store, T0, caps=caps)
    assert sent.dispatch_id == running
    assert await claim(store, DEADLINE + 50, caps=caps) == []
    await assert_expires_at_its_deadline_only(store, raw, behind)


@pytest.mark.parametrize("policy", ["block", "skip"])
async def test_a_keyed_row_waiting_behind_a_slow_head_expires_at_its_deadline(
    store: SQLiteStore, raw: RawDB, policy: OrderingPolicy
) -> None:
    head = await enqueue(store, "d", expires_at=None, ordering_key="order-1")
    waiting = await enqueue(store, "d", ordering_key="order-1")
    last = await enqueue(store, "d", expires_at=None, ordering_key="order-1")
    [sent] = await claim(store, T0, ordering=policy)
    assert sent.dispatch_id == head
    assert await claim(store, DEADLINE + 50, ordering=policy) == []  # the head is slow
    await assert_expires_at_its_deadline_only(store, raw, waiting)
    assert raw.row(head)["status"] == "delivering"  # untouched: no deadline
    await finish_attempt(store, sent, TransportResult.success(), now=DEADLINE + 1)
    # As if the claim had expired it when its turn came: under block the
    # expired row holds its key (every undelivered row needs a decision),
    # under skip the next one goes.
    after = await claim(store, DEADLINE + 2, ordering=policy)
    assert [c.dispatch_id for c in after] == ([] if policy == "block" else [last])


@pytest.mark.parametrize("policy", ["block", "skip"])
async def test_an_expiring_head_promotes_the_next_row_as_the_claims_expiry_does(
    store: SQLiteStore, raw: RawDB, policy: OrderingPolicy
) -> None:
    head = await enqueue(store, "paused", ordering_key="k")
    second = await enqueue(store, "paused", expires_at=None, ordering_key="k")
    await pause_destination(store, "paused", now=T0)
    await assert_expires_at_its_deadline_only(store, raw, head)
    # The next row is due from the head's expiry on, as a claim's expiry
    # makes it (ordering.promote) ...
    assert raw.row(second)["next_attempt_at"] == DEADLINE
    await resume_destination(store, "paused", now=DEADLINE)
    # ... and whether it goes is the policy's: block holds the key.
    after = await claim(store, DEADLINE + 1, ordering=policy)
    assert [c.dispatch_id for c in after] == ([] if policy == "block" else [second])


# -- what the sweep leaves alone -----------------------------------------------------


async def test_a_delivering_row_whose_lease_runs_is_not_swept(
    store: SQLiteStore, raw: RawDB
) -> None:
    row = await enqueue(store, "d", expires_at=T0 + 5)
    [sent] = await claim(store, T0)  # leased until T0 + 3600
    assert (await expire_overdue_dispatches(store, now=T0 + 60)).read == 0
    assert await next_expiry_at(store, now=T0 + 60) is None
    assert raw.row(row)["status"] == "delivering"
    # Its attempt ends as it would have: a success past the deadline is
    # still recorded (the fence decides, not the deadline).
    await finish_attempt(store, sent, TransportResult.success(), now=T0 + 61)
    assert reasons(raw, row) == [
        "dispatch.pending.enqueued",
        "dispatch.delivering.attempt",
        "dispatch.delivered.transport_ok",
    ]


async def test_a_delivering_row_whose_lease_ended_expires_as_a_claim_would_find_it(
    store: SQLiteStore, raw: RawDB
) -> None:
    row = await enqueue(store, "paused")
    [sent] = await claim(store, T0)  # its worker dies; then the destination is paused
    await pause_destination(store, "paused", now=T0 + 1)
    assert (await expire_overdue_dispatches(store, now=T0 + LEASE - 1)).read == 0
    assert await next_expiry_at(store, now=T0 + LEASE - 1) is None
    assert (await expire_overdue_dispatches(store, now=T0 + LEASE)).expired == 1
    last = raw.transitions(row)[-1]
    assert (last["previous_status"], last["status"], last["reason_code"]) == (
        "delivering",
        "expired",
        DEADLINE_REASON,
    )
    assert last["reason_summary"] == f"expires_at {DEADLINE} passed before attempt 2"
    # The dead claimant's late end finds the fence moved: nothing written.
    history = len(raw.transitions(row))
    await finish_attempt(store, sent, TransportResult.success(), now=T0 + LEASE + 1)
    assert len(raw.transitions(row)) == history and raw.row(row)["status"] == "expired"


async def test_rows_without_a_deadline_or_before_it_are_never_swept(
    store: SQLiteStore, raw: RawDB
) -> None:
    await enqueue(store, "d", expires_at=None)
    later = await enqueue(store, "d", expires_at=DEADLINE + 1)
    assert (await expire_overdue_dispatches(store, now=DEADLINE)).read == 0
    assert await next_expiry_at(store, now=DEADLINE) == DEADLINE + 1
    assert raw.row(later)["status"] == "pending"
    assert await store.read(lambda conn: next_expiry(conn, DEADLINE)) == DEADLINE + 1


# -- batches and several sweepers -------------------------------------------------------

_FILL = (
    "WITH RECURSIVE n(i) AS (SELECT 0 UNION ALL SELECT i + 1 FROM n WHERE i + 1 < ?) "
    "INSERT INTO dispatch_outbox (id, kind, deliver_to, payload, status, attempt, "
    "next_attempt_at, created_at, updated_at, expires_at) "
    "SELECT CAST(? AS TEXT) || i, 'k', 'paused', '{}', 'pending', 0, ?, ?, ?, ? + i * 0.001 FROM n"
)


def fill_overdue(raw: RawDB, count: int, prefix: str = "x-") -> None:
    """``count`` pending rows whose deadlines (DEADLINE on, a millisecond
    apart) have all passed at ``DEADLINE + 100``."""
    raw.execute(_FILL, (count, prefix, T0, T0, T0, DEADLINE))


def deadline_transitions(raw: RawDB) -> Counter[str]:
    return Counter(
        str(r["entity_id"])
        for r in raw.rows(
            "SELECT entity_id FROM status_transitions WHERE reason_code = ?", (DEADLINE_REASON,)
        )
    )


async def test_a_sweep_expires_a_batch_a_transaction_earliest_deadline_first(
    store: SQLiteStore, raw: RawDB
) -> None:
    total = 2 * SWEEP_BATCH + 7
    fill_overdue(raw, total)
    done = []
    while (swept := await expire_overdue_dispatches(store, now=DEADLINE + 100)).read:
        done.append(swept)
        expired = raw.rows(
            "SELECT id FROM dispatch_outbox WHERE status = 'expired' ORDER BY expires_at"
        )
        # Each batch committed on its own, and took the earliest deadlines.
        assert [r["id"] for r in expired] == [f"x-{i}" for i in range(len(expired))]
    assert [(s.read, s.expired) for s in done] == [
        (SWEEP_BATCH, SWEEP_BATCH),
        (SWEEP_BATCH, SWEEP_BATCH),
        (7, 7),
    ]
    assert raw.scalar("SELECT COUNT(*) FROM dispatch_outbox WHERE status = 'expired'") == total
    assert set(deadline_transitions(raw).values()) == {1}


async def test_two_sweepers_of_the_same_rows_write_one_transition_per_row(
    store: SQLiteStore, raw: RawDB, db_target: str
) -> None:
    total = 3 * SWEEP_BATCH
    fill_overdue(raw, total)
    expired: list[int] = []

    async def sweeper(db: Store) -> None:
        while True:
            swept = await expire_overdue_dispatches(db, now=DEADLINE + 100, limit=100)
            expired.append(swept.expired)
            if not swept.read:
                return

    async with open_store(db_target) as other, anyio.create_task_group() as tg:
        tg.start_soon(sweeper, store)
        tg.start_soon(sweeper, other)  # a second store: its own writer, as another host's
    transitions = deadline_transitions(raw)
    assert len(transitions) == total and set(transitions.values()) == {1}
    assert sum(expired) == total
    assert raw.scalar("SELECT COUNT(*) FROM dispatch_outbox WHERE status = 'expired'") == total


async def test_a_look_at_the_expiry_index_reads_nothing_of_the_rows_not_past_due(
    store: SQLiteStore, raw: RawDB
) -> None:
    """What a look and an idle sweep read stays the same with 20,000 live
    rows that have no deadline or a later one (counted in what the engine
    does, never timed)."""
    reads = Reads(raw)
    await enqueue(store, "d", expires_at=DEADLINE + 1)

    def look(conn: Conn) -> float | None:
        from trio_dispatch.outbox.machine import expire_overdue

        assert expire_overdue(conn, DEADLINE, 10, "test").read == 0
        return next_expiry(conn, DEADLINE)

    found, before = reads.counted(look)
    assert found == DEADLINE + 1
    raw.execute(_FILL.replace("? + i * 0.001", "NULL"), (10_000, "none-", T0, T0, T0))
    raw.execute(_FILL, (10_000, "later-", T0, T0, T0, DEADLINE + 10))
    if reads.postgres:
        raw.execute("ANALYZE dispatch_outbox")
    found, after = reads.counted(look)
    assert found == DEADLINE + 1
    assert after <= before + 10, (before, after)


# -- the schema ---------------------------------------------------------------------


EXPIRY_VERSION = next(
    n + 1
    for n, steps in enumerate(MIGRATIONS)
    if any(isinstance(step, str) and EXPIRY_INDEX in step for step in steps)
)
"""The schema version that adds the expiry index."""


def _version_10(target: str) -> None:
    """Take the store at ``target`` back to the version before the expiry index (as before
    this index existed), with a pending row past its deadline."""
    row = (
        "INSERT INTO dispatch_outbox (id, kind, deliver_to, payload, status, attempt, "
        "next_attempt_at, created_at, expires_at) "
        "VALUES ('old', 'k', 'd', '{}', 'pending', 0, 1e15, ?, ?)"
    )
    statements = (
        (f"DROP INDEX {EXPIRY_INDEX}", ()),
        ("DELETE FROM trio_dispatch_schema WHERE version >= ?", (EXPIRY_VERSION,)),
        (row, (T0, DEADLINE)),
    )
    if target.startswith("postgres"):
        raw: RawDB = PostgresRaw(target)
        for statement, params in statements:
            raw.execute(statement, params)
        return
    conn = sqlite3.connect(target, isolation_level=None)
    try:
        for statement, params in statements:
            conn.execute(statement, params)
    finally:
        conn.close()


def _has_expiry_index(target: str) -> bool:
    if target.startswith("postgres"):
        return bool(
            PostgresRaw(target).scalar("SELECT to_regclass(?) IS NOT NULL", (EXPIRY_INDEX,))
        )
    conn = sqlite3.connect(target)
    try:
        found = conn.execute("SELECT COUNT(*) FROM sqlite_master WHERE name = ?", (EXPIRY_INDEX,))
        return bool(found.fetchone()[0])
    finally:
        conn.close()


async def test_a_database_from_before_the_expiry_index_gains_it_and_its_rows_expire(
    fresh_target: str,
) -> None:
    assert SCHEMA_VERSION >= EXPIRY_VERSION
    async with open_store(fresh_target):
        pass
    _version_10(fresh_target)
    assert not _has_expiry_index(fresh_target)
    async with open_store(fresh_target) as db:
        assert _has_expiry_index(fresh_target)
        assert await next_expiry_at(db, now=DEADLINE) == DEADLINE
        assert (await expire_overdue_dispatches(db, now=DEADLINE)).expired == 1
        versions = await db.read(
            lambda conn: conn.query("SELECT version FROM trio_dispatch_schema ORDER BY version")
        )
    assert [int(v["version"]) for v in versions] == list(range(1, SCHEMA_VERSION + 1))
    # Adopted as the other versions are: a database recorded at version 10
    # that has the index already migrates, and keeps it.
    async with open_store(fresh_target) as db:
        await db.write(
            lambda conn: conn.execute(
                "DELETE FROM trio_dispatch_schema WHERE version >= ?", (EXPIRY_VERSION,)
            )
        )
    async with open_store(fresh_target) as db:
        assert _has_expiry_index(fresh_target)
        top = await db.read(
            lambda conn: conn.query_one("SELECT MAX(version) AS v FROM trio_dispatch_schema")
        )
    assert top is not None and int(top["v"]) == SCHEMA_VERSION
