"""Held starts (docs/destinations.md, :mod:`trio_dispatch.outbox.claim.pins`):
a worker that holds rows ahead of its slots has the claim admit its rated
rows as held starts, counted as spent until it records that each began
(then at that time) or never will. On real SQLite files and the real
PostgreSQL, both anyio backends; asserted on committed rows."""

from __future__ import annotations

import time
from typing import Any

import anyio
import pytest

from trio_dispatch import Destination
from trio_dispatch.outbox import Claim, claim_due
from trio_dispatch.outbox.claim import claim_rules
from trio_dispatch.outbox.claim.pins import REAP_MARGIN, Pins, held_starts
from trio_dispatch.store import SQLiteStore

from ..conftest import RawDB
from .test_capped_scan import fill
from .test_destination_admission import LEASE, NOW, T0

pytestmark = pytest.mark.anyio

HOUR = 3600.0
POLICIES = {"api": Destination(rate="1/h", burst=5)}


def state(raw: RawDB) -> tuple[int, float | None]:
    row = raw.rows("SELECT rate_held, rate_tat FROM dispatch_destinations WHERE name = 'api'")[0]
    return int(row["rate_held"]), None if row["rate_tat"] is None else float(row["rate_tat"])


def holds(raw: RawDB) -> list[tuple[str, int, int, int]]:
    rows = raw.rows(
        "SELECT holder, held, resolved, started FROM dispatch_destination_holds "
        "WHERE name = 'api' ORDER BY holder"
    )
    return [(str(r["holder"]), int(r["held"]), int(r["resolved"]), int(r["started"])) for r in rows]


def clock_now(raw: RawDB) -> float:
    """The rate's clock: PostgreSQL's server time, SQLite's the claim's ``now``."""
    if str(raw.target).startswith("postgres"):
        return float(raw.scalar("SELECT EXTRACT(EPOCH FROM clock_timestamp())::float8"))
    return NOW


def new_pins(policies: dict[str, Destination] = POLICIES) -> Pins:
    pins = held_starts(policies)
    assert pins is not None
    return pins


async def claim(
    store: SQLiteStore,
    pins: Pins | None,
    limit: int,
    policies: dict[str, Destination] = POLICIES,
) -> list[Claim]:
    rules = claim_rules(destinations=policies, pins=pins)
    claims, _ = await claim_due(store, now=NOW, limit=limit, lease_seconds=LEASE, rules=rules)
    if pins is not None:
        pins.claimed(claims)
    return claims


async def held_claims(
    store: SQLiteStore, raw: RawDB, rows: int, take: int
) -> tuple[Pins, list[Claim]]:
    """``rows`` due rows of ``api``, and ``take`` of them claimed as held
    starts by a fresh worker's pins."""
    fill(raw, "api", rows, T0, step=1.0)
    pins = new_pins()
    return pins, await claim(store, pins, take)


async def record(store: SQLiteStore, pins: Pins) -> None:
    """What the next claim's transaction writes first, alone."""
    await store.write(lambda conn: pins.sync(conn, NOW))


async def test_held_starts_count_as_spent_until_begun_then_at_the_time_they_began(
    store: SQLiteStore, raw: RawDB
) -> None:
    pins, first = await held_claims(store, raw, 12, 3)
    assert [c.deliver_to for c in first] == ["api"] * 3
    # Held: spent for every claimant, and the rate's time untouched.
    assert state(raw) == (3, None)
    assert holds(raw) == [(pins.holder, 3, 0, 0)]
    # One began, one is given back unsent; the third still waits.
    before = clock_now(raw)
    pins.began(first[0])
    pins.dropped([first[1]])
    assert len(pins) == 1
    # The next claim's transaction records that first: one start charged at
    # its time, one held start gone; room 5 - 1 (spent) - 1 (held) = 3.
    second = await claim(store, pins, 10)
    after = clock_now(raw)
    assert len(second) == 3
    held, tat = state(raw)
    assert held == 1 + 3
    assert tat is not None and before + HOUR - 1 <= tat <= after + HOUR
    assert holds(raw) == [(pins.holder, 4, 2, 1)]
    # A claimant that holds nothing ahead sees the held starts as spent.
    assert await claim(store, None, 10) == []
    # All begin: each charged once, nothing held any more.
    for each in [first[2], *second]:
        pins.began(each)
    await claim(store, pins, 10)
    held, tat = state(raw)
    assert held == 0
    assert tat is not None and tat >= before + 5 * HOUR - 1
    assert holds(raw) == [(pins.holder, 0, 6, 5)]


async def test_a_rolled_back_record_is_sent_again_and_applied_once(
    store: SQLiteStore, raw: RawDB
) -> None:
    pins, claims = await held_claims(store, raw, 5, 2)
    holder = pins.holder
    pins.began(claims[0])
    pins.began(claims[1])

    def sync_then_fail(conn: Any) -> None:
        pins.sync(conn, NOW)
        raise RuntimeError("the write failed after the record")

    with pytest.raises(Exception, match="the write failed"):
        await store.write(sync_then_fail)
    assert state(raw) == (2, None)  # rolled back with the transaction
    pins.failed()  # as the worker does when a write fails
    await record(store, pins)
    await record(store, pins)  # nothing owed: nothing charged twice
    held, tat = state(raw)
    assert held == 0
    assert tat is not None and tat <= clock_now(raw) + 2 * HOUR
    assert holds(raw) == [(holder, 0, 2, 2)]
    # After the failure the worker took a fresh holder: a claim whose
    # outcome the failure hid would leave starts on the old row only, which
    # ends with its lease.
    assert pins.holder != holder


async def test_a_dead_holders_starts_are_charged_in_full_once_its_lease_is_well_past(
    store: SQLiteStore, raw: RawDB
) -> None:
    raw.execute(
        "INSERT INTO dispatch_destinations (name, state, rate_held) VALUES ('api', 'active', 5)"
    )
    insert = (
        "INSERT INTO dispatch_destination_holds (name, holder, held, resolved, started, "
        "until_at) VALUES ('api', ?, ?, 0, 0, ?)"
    )
    raw.execute(insert, ("dead", 2, NOW - REAP_MARGIN - 1))
    raw.execute(insert, ("alive", 3, NOW - REAP_MARGIN + 5))  # within the margin
    pins = new_pins()
    before = clock_now(raw)
    assert await store.write(lambda conn: pins.reap(conn, NOW)) == 1
    held, tat = state(raw)
    # The dead holder's two held starts count as begun at the reap.
    assert held == 3 and tat is not None and tat >= before + 2 * HOUR - 1
    assert [h[0] for h in holds(raw)] == ["alive"]
    assert await store.write(lambda conn: pins.reap(conn, NOW)) == 0


@pytest.mark.postgres_only
async def test_a_record_passes_over_a_state_row_another_claim_holds_and_comes_again(
    store: SQLiteStore, raw: RawDB
) -> None:
    import psycopg

    pins, claims = await held_claims(store, raw, 5, 2)
    pins.began(claims[0])
    other = await anyio.to_thread.run_sync(lambda: psycopg.connect(str(raw.target)))
    try:
        await anyio.to_thread.run_sync(
            lambda: other.execute("SELECT * FROM dispatch_destinations FOR UPDATE")
        )
        started = time.monotonic()
        await record(store, pins)  # does not wait for the held row
        assert time.monotonic() - started < 2
        assert state(raw)[0] == 2
    finally:
        # A rollback answered by the server has released the lock (a close
        # alone may leave the backend holding it a moment longer).
        await anyio.to_thread.run_sync(other.rollback)
        await anyio.to_thread.run_sync(other.close)
    await record(store, pins)
    assert state(raw)[0] == 1
    assert holds(raw) == [(pins.holder, 1, 1, 1)]


async def test_resolved_held_starts_are_sent_a_quarter_of_the_burst_at_a_time_or_soon(
    store: SQLiteStore, raw: RawDB
) -> None:
    """Sending each resolution at once would cost every write a statement: a
    destination's are sent once a quarter of its burst is resolved, or
    SEND_EVERY seconds after its last send. Until then they stay counted as
    held: less room for a moment, never more."""
    policies = {"api": Destination(rate="1/h", burst=8)}
    fill(raw, "api", 6, T0, step=1.0)
    pins = new_pins(policies)
    pins.send_every = 3600  # however slow the machine, not by time until told
    claims = await claim(store, pins, 4, policies)
    pins.began(claims[0])
    await record(store, pins)  # the first is sent at once
    assert state(raw)[0] == 3
    pins.began(claims[1])
    await record(store, pins)  # 1 of the 2 it waits for
    assert state(raw)[0] == 3
    pins.began(claims[2])
    await record(store, pins)  # a quarter of the burst: sent
    assert state(raw)[0] == 1
    pins.began(claims[3])
    await record(store, pins)
    assert state(raw)[0] == 1
    pins.send_every = 0.01
    await anyio.sleep(0.02)
    await record(store, pins)  # sent once its time went by
    assert state(raw)[0] == 0
    assert holds(raw) == [(pins.holder, 0, 4, 4)]


async def test_held_starts_a_claim_admitted_but_did_not_claim_are_uncounted_at_once(
    store: SQLiteStore, raw: RawDB
) -> None:
    """A row admitted as a held start whose claim did not apply (another
    claimant's, an unreadable row dead-lettered instead) never reaches the
    worker: its count goes in the claim's own transaction."""
    pins, claims = await held_claims(store, raw, 3, 3)
    assert state(raw) == (3, None)

    def one_of_three_not_claimed(conn: Any) -> None:
        conn.execute("UPDATE dispatch_destinations SET rate_held = rate_held + 1")
        conn.execute("UPDATE dispatch_destination_holds SET held = held + 1")
        pins.made(conn, claims[:1], {"api": 2})

    await store.write(one_of_three_not_claimed)
    assert state(raw) == (3, None)
    assert holds(raw) == [(pins.holder, 3, 0, 0)]


async def test_claims_admitted_before_a_failed_write_resolve_on_their_own_holder(
    store: SQLiteStore, raw: RawDB
) -> None:
    fill(raw, "api", 4, T0, step=1.0)
    pins = new_pins()
    first = pins.holder
    rules = claim_rules(destinations=POLICIES, pins=pins)
    claims, _ = await claim_due(store, now=NOW, limit=2, lease_seconds=LEASE, rules=rules)
    # Another write failed after this claim committed and before its claims
    # reached the worker: they were admitted for the holder replaced now.
    pins.failed()
    assert pins.holder != first
    pins.claimed(claims)
    later = await claim(store, pins, 1)
    for each in [*claims, *later]:
        pins.began(each)
    await record(store, pins)
    assert state(raw)[0] == 0
    assert sorted(holds(raw)) == sorted([(first, 0, 2, 2), (pins.holder, 0, 1, 1)])
