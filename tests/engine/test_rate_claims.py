"""How a claim decides a shared limit under contention (SPEC 17), on the
real PostgreSQL, both anyio backends: a claim passes over a destination
whose state row another claim holds, taking the others' rows instead of
waiting; a destination paused between a claim's read and its decision gets
nothing. Asserted on committed rows."""

from __future__ import annotations

import anyio
import pytest

from trio_dispatch import Destination, open_store, pause_destination
from trio_dispatch.outbox import Claim, claim_due
from trio_dispatch.outbox.claim import ClaimRules, DestinationAdmission, OrderingKeys
from trio_dispatch.store import SQLiteStore

from ..conftest import RawDB
from .test_capped_scan import fill
from .test_destination_admission import LEASE, NOW, T0, _Held, set_state

pytestmark = pytest.mark.anyio


def destinations_of(claims: list[Claim]) -> list[str]:
    return sorted(claim.deliver_to for claim in claims)


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
