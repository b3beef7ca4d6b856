"""How a claim decides a shared limit under contention (docs/destinations.md), on real
SQLite files and the real PostgreSQL, both anyio backends: a rate admits
what its room allows of each claim, whichever way the claim decides it; a
claim passes over a destination whose state row another claim holds,
taking the others' rows instead of waiting; a destination paused between a
claim's read and its decision gets nothing; a state row removed by hand is
made again. Asserted on committed rows."""

from __future__ import annotations

import time

import anyio
import pytest

from trio_dispatch import Destination, open_store, pause_destination
from trio_dispatch.outbox import Claim, claim_due
from trio_dispatch.outbox.claim import ClaimRules, DestinationAdmission, OrderingKeys
from trio_dispatch.outbox.claim.destinations import PASSED_OVER
from trio_dispatch.store import SQLiteStore

from ..conftest import RawDB
from .test_capped_scan import fill
from .test_destination_admission import LEASE, NOW, T0, _Held, set_state

pytestmark = pytest.mark.anyio


def destinations_of(claims: list[Claim]) -> list[str]:
    return sorted(claim.deliver_to for claim in claims)


async def test_a_rate_admits_what_its_room_allows_of_each_claim(
    store: SQLiteStore, raw: RawDB
) -> None:
    fill(raw, "api", 20, T0, step=1.0)
    fill(raw, "free", 20, T0, step=1.0)
    policies = {"api": Destination(rate="1/h", burst=5)}
    postgres = str(raw.target).startswith("postgres")

    async def claimed(limit: int) -> list[str]:
        claims, _ = await claim_due(
            store, now=NOW, limit=limit, lease_seconds=LEASE, destinations=policies
        )
        return destinations_of(claims)

    def server_now() -> float:
        return float(raw.scalar("SELECT EXTRACT(EPOCH FROM clock_timestamp())::float8"))

    began = server_now() if postgres else NOW
    # Room for all: 2 of 5; then room for some: 3 of the 5 candidates.
    assert await claimed(4) == ["api", "api", "free", "free"]
    assert await claimed(10) == ["api"] * 3 + ["free"] * 7
    assert await claimed(6) == ["free"] * 6  # none left within the hour
    ended = server_now() if postgres else NOW
    # Five starts moved the rate's time five intervals past the first claim's clock.
    tat = float(raw.scalar("SELECT rate_tat FROM dispatch_destinations WHERE name = 'api'"))
    assert began + 5 * 3600 <= tat <= ended + 5 * 3600


@pytest.mark.postgres_only
@pytest.mark.parametrize(
    "policy", [Destination(rate="10/s", burst=5), Destination(concurrency=5)], ids=["rate", "conc"]
)
async def test_a_claim_passes_over_a_destination_whose_state_row_another_claim_holds(
    store: SQLiteStore, raw: RawDB, policy: Destination
) -> None:
    import psycopg

    fill(raw, "api", 5, T0, step=1.0)
    fill(raw, "free", 3, T0, step=1.0)
    set_state(raw, "api", state="active")
    policies = {"api": policy}
    holder = await anyio.to_thread.run_sync(lambda: psycopg.connect(str(raw.target)))
    try:
        # Another claim's decision in progress: it holds the state row.
        await anyio.to_thread.run_sync(
            lambda: holder.execute(
                "SELECT * FROM dispatch_destinations WHERE name = 'api' FOR UPDATE"
            )
        )
        with anyio.fail_after(20):  # waiting for it would hang here
            claims, _ = await claim_due(
                store, now=NOW, limit=10, lease_seconds=LEASE, destinations=policies
            )
        assert destinations_of(claims) == ["free"] * 3
        assert raw.scalar("SELECT COUNT(*) FROM dispatch_outbox WHERE status = 'delivering'") == 3
    finally:
        await anyio.to_thread.run_sync(holder.rollback)
        await anyio.to_thread.run_sync(holder.close)
    # Its decision made: the destination's rows go to the next claim.
    claims, _ = await claim_due(
        store, now=NOW, limit=10, lease_seconds=LEASE, destinations=policies
    )
    assert destinations_of(claims) == ["api"] * 5


@pytest.mark.postgres_only
@pytest.mark.parametrize(
    "policy", [Destination(rate="10/s", burst=5), Destination(concurrency=5)], ids=["rate", "conc"]
)
async def test_a_destination_paused_after_the_claims_read_gets_nothing_from_it(
    store: SQLiteStore, raw: RawDB, db_target: str, policy: Destination
) -> None:
    fill(raw, "api", 5, T0, step=1.0)
    set_state(raw, "api", state="active")
    held = _Held()
    rules = ClaimRules((OrderingKeys(), held, DestinationAdmission({"api": policy})))
    found: list[Claim] = []
    async with open_store(db_target) as other, anyio.create_task_group() as group:

        async def slow() -> None:
            claims, _ = await claim_due(store, now=NOW, limit=5, lease_seconds=LEASE, rules=rules)
            found.extend(claims)

        group.start_soon(slow)
        # The claim has read its bounds (api open, room for 5) and waits;
        # an operator pauses api and commits.
        await anyio.to_thread.run_sync(held.reached.wait, 30)
        await pause_destination(other, "api", reason="maintenance")
        held.release.set()
    assert found == []
    assert raw.scalar("SELECT COUNT(*) FROM dispatch_outbox WHERE status = 'delivering'") == 0


@pytest.mark.parametrize(
    "policy",
    [Destination(rate="10/s", burst=50), Destination(concurrency=50)],
    ids=["rate", "conc"],
)
async def test_a_state_row_removed_by_hand_is_made_again_by_a_later_claim(
    store: SQLiteStore, raw: RawDB, policy: Destination
) -> None:
    fill(raw, "api", 40, T0, step=1.0)
    rules = ClaimRules((OrderingKeys(), DestinationAdmission({"api": policy})))

    async def claimed() -> list[str]:
        claims, _ = await claim_due(store, now=NOW, limit=1, lease_seconds=LEASE, rules=rules)
        return destinations_of(claims)

    assert await claimed() == ["api"]
    raw.execute("DELETE FROM dispatch_destinations")
    # Where rows lock, a missing row reads as held for a few claims (it
    # usually is); then the claim makes it again. Never a start unlimited.
    taken = [await claimed() for _ in range(PASSED_OVER + 2)]
    assert taken[-1] == ["api"]
    assert raw.scalar("SELECT COUNT(*) FROM dispatch_destinations WHERE name = 'api'") == 1


async def test_a_rate_s_starts_are_stamped_at_the_time_the_rate_decided_them(
    store: SQLiteStore, raw: RawDB
) -> None:
    # The rate decides at the store's clock where it has one (PostgreSQL:
    # the server's), and the history records each start at that time: the
    # starts read back keep to the rate whatever the claiming host's clock
    # says (a worker's clock 1 s behind stamped its start before the one
    # the rate admitted first). On SQLite the claim's own clock is the
    # rate's.
    fill(raw, "metered", 2, T0, step=1.0)
    policies = {"metered": Destination(rate="10/s", burst=1)}
    if str(raw.target).startswith("postgres"):
        clocks = (time.time, lambda: time.time() - 1.0)
    else:
        clocks = (lambda: NOW, lambda: NOW + 0.15)
    claims: list[Claim] = []
    for n, clock in enumerate(clocks):
        if n:
            await anyio.sleep(0.15)  # past the rate's interval
        found, _ = await claim_due(
            store, clock=clock, limit=1, lease_seconds=LEASE, destinations=policies
        )
        claims += found
    assert destinations_of(claims) == ["metered", "metered"]
    first, second = (raw.transitions(claim.dispatch_id)[-1]["created_at"] for claim in claims)
    assert second - first >= 0.1 - 1e-6, (first, second)
    # A claim with no rate to decide is stamped at its own (injected) time.
    fill(raw, "free", 1, T0, step=1.0)
    free, _ = await claim_due(store, now=NOW + 5, limit=1, lease_seconds=LEASE)
    assert destinations_of(free) == ["free"]
    assert raw.transitions(free[0].dispatch_id)[-1]["created_at"] == NOW + 5
