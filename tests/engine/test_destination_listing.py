"""What operators see of destinations (docs/destinations.md#what-operators-see),
on both engines and both anyio backends: which destinations
are listed, each one's state as it stands now from the stored row, its
counters, its audit; and that a listing reads a bounded part of the store
whatever a destination's backlog, and writes nothing."""

from __future__ import annotations

import time
from functools import partial
from typing import Any

import pytest

from trio_dispatch import open_store, pause_destination, resume_destination
from trio_dispatch.destinations import State, parse_destinations
from trio_dispatch.destinations import listing as listing_module
from trio_dispatch.destinations.listing import (
    Listing,
    list_destinations,
    listing,
    show_destination,
    store_now,
)
from trio_dispatch.outbox.reads import bounded_stats, dispatch_stats
from trio_dispatch.store import SQLiteStore
from trio_dispatch.store.base import Conn

from ..conftest import RawDB
from .test_capped_scan import Reads, fill

pytestmark = pytest.mark.anyio

POLICIES = parse_destinations(
    {
        "*": {"concurrency": 2},
        "billing": {"rate": "10/s", "burst": 5, "concurrency": 3},
        "quiet": {},
    }
)
STATE_COLUMNS = (
    "name, state, state_until, reason, throttled_until, rate_tat, failures, "
    "last_success_at, last_failure_at, probe_until, rate_held"
)


def put_state(raw: RawDB, name: str, state: str = "active", **columns: Any) -> None:
    values = {
        "state_until": None,
        "reason": None,
        "throttled_until": None,
        "rate_tat": None,
        "failures": 0,
        "last_success_at": None,
        "last_failure_at": None,
        "probe_until": None,
        "rate_held": 0,
        **columns,
    }
    raw.execute(
        f"INSERT INTO dispatch_destinations ({STATE_COLUMNS}) VALUES ({', '.join('?' * 11)})",
        (name, state, *values.values()),
    )


def by_name(found: Listing) -> dict[str, Any]:
    return {entry.name: entry for entry in found.entries}


async def test_lists_configured_live_and_stateful_destinations_with_their_counters(
    store: SQLiteStore, raw: RawDB
) -> None:
    now = time.time()
    fill(raw, "mailer", 3, now - 120, step=10)  # due 120 s, 110 s, 100 s ago
    fill(raw, "billing", 2, now + 600)  # not due yet
    fill(raw, "mailer", 1, now + 30, status="delivering", prefix="run")  # lease ahead
    fill(raw, "mailer", 1, now - 5, status="delivering", prefix="dead")  # lease over
    put_state(raw, "archive", "paused", reason="moved", last_failure_at=now - 60, failures=4)
    found = await list_destinations(store, POLICIES)
    assert abs(found.now - now) < 30 and not found.truncated
    # "*" is no destination; "quiet" is configured with nothing; "archive"
    # has only its state row.
    entries = by_name(found)
    assert list(entries) == ["archive", "billing", "mailer", "quiet"]
    mailer, billing = entries["mailer"], entries["billing"]
    assert (mailer.policy_from, mailer.configured, mailer.policy.concurrency) == ("*", False, 2)
    assert (mailer.state, mailer.pending, mailer.running) == (State.ACTIVE, 3, 1)
    assert 119 <= mailer.oldest_due_age <= 150
    assert (billing.policy_from, billing.pending, billing.oldest_due_age) == ("own", 2, None)
    assert (billing.starts_available, billing.running) == (5, 0)
    archive = entries["archive"]
    assert (archive.state, archive.seen.reason, archive.failures) == (State.PAUSED, "moved", 4)
    assert archive.seen.until is None and archive.pending == 0
    assert archive.last_failure_at == pytest.approx(now - 60)
    document = mailer.to_dict()
    assert document == {
        "name": "mailer",
        "state": "active",
        "until": None,
        "reason": None,
        "configured": False,
        "policy_from": "*",
        "policy": {
            "concurrency": 2,
            "rate": None,
            "burst": 1,
            "throttle_max_seconds": 3600.0,
            "breaker": None,
        },
        "starts_available": None,
        "starts_held": 0,
        "concurrency_used": 1,
        "concurrency_limit": 2,
        "pending": 3,
        "pending_capped": False,
        "oldest_due_age_seconds": document["oldest_due_age_seconds"],
        "throttled_until": None,
        "failures_in_a_row": 0,
        "last_success_at": None,
        "last_failure_at": None,
    }


async def test_each_state_is_read_as_it_stands_now_from_the_stored_row(
    store: SQLiteStore, raw: RawDB
) -> None:
    now = time.time()
    put_state(raw, "a-paused", "paused", state_until=now + 3600, reason="maintenance")
    put_state(raw, "b-pause-over", "paused", state_until=now - 1, reason="maintenance")
    put_state(raw, "c-throttled", throttled_until=now + 90, reason="Retry-After 90")
    put_state(raw, "d-open", "open", state_until=now + 60, reason="10 failures")
    put_state(raw, "e-cooled", "open", state_until=now - 1, reason="10 failures")
    put_state(raw, "f-probing", "half_open", probe_until=now + 20)
    put_state(raw, "g-disabled", "disabled", reason="open 3600s")
    put_state(raw, "h-rated", rate_tat=now + 150, last_success_at=now - 2)
    put_state(raw, "i-held", rate_tat=now - 10, rate_held=3)
    policies = parse_destinations(
        {"h-rated": {"rate": "1/m", "burst": 5}, "i-held": {"rate": "1/m", "burst": 5}}
    )
    entries = by_name(await list_destinations(store, policies))
    seen = {name: (str(e.state), e.seen.until, e.seen.reason) for name, e in entries.items()}
    assert seen == {
        "a-paused": ("paused", now + 3600, "maintenance"),
        "b-pause-over": ("active", None, None),  # lifted itself, whether recorded or not
        "c-throttled": ("throttled", now + 90, "Retry-After 90"),
        "d-open": ("open", now + 60, "10 failures"),
        "e-cooled": ("half_open", None, "10 failures"),  # a probe may go
        "f-probing": ("half_open", now + 20, None),
        "g-disabled": ("disabled", None, "open 3600s"),
        "h-rated": ("active", None, None),
        "i-held": ("active", None, None),
    }
    assert entries["c-throttled"].throttled_until == pytest.approx(now + 90)
    # 1/m with a burst of 5, the next start 150 s ahead: 2.5 intervals of
    # the 5 spent, 2 whole starts left (for the next 30 s).
    assert entries["h-rated"].starts_available == 2
    # Starts claimed ahead and not yet begun count as spent.
    assert (entries["i-held"].starts_available, entries["i-held"].starts_held) == (2, 3)
    assert entries["h-rated"].starts_held == 0
    assert entries["h-rated"].last_success_at == pytest.approx(now - 2)
    # The listing writes nothing: the pause that ended stays as stored.
    assert raw.scalar("SELECT state FROM dispatch_destinations WHERE name = 'b-pause-over'") == (
        "paused"
    )
    assert raw.scalar("SELECT COUNT(*) FROM dispatch_destination_changes") == 0


async def test_show_gives_one_destination_whole_with_its_audit_newest_first(
    store: SQLiteStore, raw: RawDB
) -> None:
    await pause_destination(store, "billing", for_seconds=600, reason="partner down", actor="ops")
    await resume_destination(store, "billing", reason="partner back", actor="ops")
    now, entry = await show_destination(store, POLICIES, "billing")
    assert entry is not None and entry.state is State.ACTIVE
    assert [(c.previous, c.state, c.reason, c.actor) for c in entry.changes] == [
        ("paused", "active", "partner back", "ops"),
        ("active", "paused", "partner down", "ops"),
    ]
    assert entry.changes[1].until == pytest.approx(entry.changes[1].at + 600)
    assert entry.to_dict()["changes"][0]["to"] == "active"
    # A name neither configured, nor live, nor stored is no destination.
    assert (await show_destination(store, POLICIES, "nowhere"))[1] is None
    assert (await show_destination(store, POLICIES, "*"))[1] is None
    fill(raw, "nowhere", 1, now)
    assert (await show_destination(store, POLICIES, "nowhere"))[1] is not None


async def test_pending_is_counted_up_to_the_cap(
    store: SQLiteStore, raw: RawDB, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(listing_module, "PENDING_CAP", 5)
    fill(raw, "busy", 8, time.time() - 10)
    fill(raw, "calm", 5 - 1, time.time() - 10)
    entries = by_name(await list_destinations(store, {}))
    busy, calm = entries["busy"], entries["calm"]
    assert (busy.pending, busy.pending_capped, busy.pending_text()) == (5, True, "5+")
    assert (calm.pending, calm.pending_capped, calm.pending_text()) == (4, False, "4")
    states = by_name(await list_destinations(store, {}, counts=False))
    assert states["busy"].pending is None and states["busy"].pending_text() == "-"


async def test_a_listing_stops_at_its_limit_by_name(store: SQLiteStore, raw: RawDB) -> None:
    for name in ("d", "b", "e"):
        fill(raw, name, 1, time.time())
    put_state(raw, "c")
    policies = parse_destinations({"a": {}, "*": {}})

    def first(limit: int) -> Any:
        return lambda conn: listing(conn, policies, time.time(), limit=limit)

    found = await store.read(first(3))
    assert [e.name for e in found.entries] == ["a", "b", "c"] and found.truncated
    found = await store.read(first(5))
    assert [e.name for e in found.entries] == ["a", "b", "c", "d", "e"] and not found.truncated


async def test_now_is_the_store_s_clock_where_it_has_one(
    store: SQLiteStore, raw: RawDB, engine: str
) -> None:
    """On PostgreSQL every host reads the database server's clock, as the
    claim does: a caller's clock two hours ahead does not lift a one-hour
    pause in what it is shown. SQLite's clock is the caller's."""
    await pause_destination(store, "billing", for_seconds=3600)
    ahead = time.time() + 7200
    at = await store.read(partial(store_now, fallback=ahead))
    entry = by_name(await list_destinations(store, POLICIES, now=ahead))["billing"]
    if engine == "postgres":
        assert abs(at - time.time()) < 30
        assert entry.state is State.PAUSED
    else:
        assert at == ahead
        assert entry.state is State.ACTIVE


async def test_a_listing_reads_the_same_whatever_a_destination_s_backlog(
    store: SQLiteStore, raw: RawDB, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Counted in what the engine reads, never timed: the destinations come
    from a loose scan of the destination index and the running attempts
    from the due index's delivering range, so 50,000 rows of one
    destination add nothing but their count, which stops at the cap."""
    monkeypatch.setattr(listing_module, "PENDING_CAP", 100)
    now = time.time()
    for i in range(3):
        fill(raw, f"ok-{i}", 5, now - 60)
    fill(raw, "ok-0", 2, now + 60, status="delivering", prefix="run")
    fill(raw, "hung", 200, now - 3600)
    reads = Reads(raw)
    if reads.postgres:  # no dead entries of an earlier test's rows to step over
        raw.execute("VACUUM ANALYZE dispatch_outbox")

    def unit(counts: bool) -> Any:
        def read(conn: Conn) -> list[tuple[str, Any]]:
            found = listing(conn, POLICIES, now, counts=counts)
            return [(e.name, e.pending) for e in found.entries]

        return read

    small_states, states_before = reads.counted(unit(False))
    small_counts, counts_before = reads.counted(unit(True))
    fill(raw, "hung", 50_000, now - 7200, prefix="more")
    if reads.postgres:
        raw.execute("ANALYZE dispatch_outbox")
    big_states, states_after = reads.counted(unit(False))
    big_counts, counts_after = reads.counted(unit(True))
    assert big_states == small_states
    assert dict(big_counts)["hung"] == dict(small_counts)["hung"] == 100  # at the cap
    assert states_after <= 2 * states_before + 10, (states_before, states_after)
    assert counts_after <= 2 * counts_before + 10, (counts_before, counts_after)
    # Walking the backlog would read at least 50,000 tuples (PostgreSQL) or
    # 2,500 hundreds of steps (SQLite).
    assert max(states_after, counts_after) < 1_000


async def test_a_listing_on_a_store_opened_read_only(db_target: str, raw: RawDB) -> None:
    async with open_store(db_target) as db:
        await pause_destination(db, "billing", reason="held")
    async with open_store(db_target, read_only=True, migrate=False) as db:
        entries = by_name(await list_destinations(db, POLICIES))
    assert entries["billing"].state is State.PAUSED


async def test_a_paused_destination_s_rows_count_in_the_oldest_due_age_and_its_own(
    store: SQLiteStore, raw: RawDB
) -> None:
    # The store-wide age is the oldest due row's, whatever its destination's
    # state: a pause holds rows back, and their age shows it (an alert on the
    # age sees a paused backlog grow); the listing says whose rows they are.
    now = time.time()
    fill(raw, "held", 2, now - 300)
    fill(raw, "open", 1, now - 30)
    await pause_destination(store, "held", reason="maintenance", now=now - 200)
    stats = await dispatch_stats(store, now=now)
    assert stats["oldest_due_pending_age_seconds"] == pytest.approx(300, abs=1)
    bounded = await bounded_stats(store, now=now)
    assert bounded["oldest_due_pending_age_seconds"] == pytest.approx(300, abs=1)
    entries = by_name(await list_destinations(store, {}, now=now))
    assert entries["held"].state == State.PAUSED
    assert entries["held"].oldest_due_age == pytest.approx(300, abs=1)
    assert entries["open"].oldest_due_age == pytest.approx(30, abs=1)
    await resume_destination(store, "held", now=now)
    assert (await dispatch_stats(store, now=now))["oldest_due_pending_age_seconds"] == (
        pytest.approx(300, abs=1)
    )
