"""Destinations' shared state (docs/destinations.md): the policy a configuration
gives, and the operators' pause, resume and enable, each one transaction
with its audit row, on both engines and both anyio backends."""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest

from trio_dispatch import (
    Breaker,
    Destination,
    enable_destination,
    open_store,
    pause_destination,
    resume_destination,
)
from trio_dispatch.destinations import State
from trio_dispatch.destinations.policy import Rate, parse_destinations, policy_for
from trio_dispatch.destinations.state import effective, read

if TYPE_CHECKING:
    from ..conftest import RawDB

T0 = 1_000_000.0


def test_rate_parses_counts_per_period() -> None:
    assert Rate.parse("50/s") == Rate(50, 1.0)
    assert Rate.parse("600/m").interval == pytest.approx(0.1)
    assert str(Rate.parse("1000 / h")) == "1000/h"
    for bad in ("50", "0/s", "5/d", "-1/s", 5, None):
        with pytest.raises((TypeError, ValueError), match="rate"):
            Rate.parse(bad)


def test_destinations_mapping_names_the_bad_setting() -> None:
    policies = parse_destinations(
        {
            "*": {"concurrency": 8},
            "billing": {
                "rate": "50/s",
                "burst": 10,
                "concurrency": 4,
                "breaker": {"failures": 3, "cool_down_seconds": 5},
            },
        }
    )
    billing = policies["billing"]
    assert billing.gcra_rate == Rate(50, 1.0) and billing.burst == 10
    assert billing.gcra_breaker == Breaker(failures=3, cool_down_seconds=5)
    assert policy_for(policies, "other").concurrency == 8
    assert policy_for({}, "other") == Destination() and not Destination().limits
    with pytest.raises(ValueError, match=r"destinations\.billing\.burst must be"):
        parse_destinations({"billing": {"burst": 0}})
    with pytest.raises(ValueError, match=r"destinations\.billing: unknown setting 'rates'"):
        parse_destinations({"billing": {"rates": "5/s"}})
    with pytest.raises(ValueError, match=r"destinations\.billing\.breaker\.failures must be"):
        parse_destinations({"billing": {"breaker": {"failures": 0}}})
    with pytest.raises(ValueError, match="max_cool_down_seconds must be a number >= 60"):
        Breaker(max_cool_down_seconds=10)
    with pytest.raises(ValueError, match="deliver_to must not contain control"):
        parse_destinations({"bad\nname": {}})
    with pytest.raises(TypeError, match="destinations must be a mapping"):
        parse_destinations(["billing"])


def test_breaker_cool_down_doubles_to_its_cap() -> None:
    breaker = Breaker(cool_down_seconds=60, max_cool_down_seconds=200)
    assert breaker.next_cool_down(None) == 60
    assert breaker.next_cool_down(60) == 120
    assert breaker.next_cool_down(120) == 200


@pytest.mark.anyio
async def test_pause_with_an_end_then_resume_writes_state_and_audit(
    db_target: str, raw: RawDB
) -> None:
    async with open_store(db_target) as db:
        before = await pause_destination(
            db, "billing", for_seconds=60, reason="maintenance  window", actor="ops", now=T0
        )
        assert before.state is State.ACTIVE
        (row,) = raw.rows("SELECT * FROM dispatch_destinations")
        assert (row["name"], row["state"], row["state_until"]) == ("billing", "paused", T0 + 60)
        assert effective(row, T0 + 59).state is State.PAUSED
        assert effective(row, T0 + 60).state is State.ACTIVE  # lifts itself
        assert await resume_destination(db, "billing", actor="ops", now=T0 + 10)
        assert not await resume_destination(db, "billing", actor="ops", now=T0 + 11)
        found = await db.read(lambda conn: [read(conn, "billing")])
        assert found[0] is not None and found[0]["state"] == "active"
    changes = raw.rows("SELECT * FROM dispatch_destination_changes ORDER BY id")
    assert [(c["previous_state"], c["state"], c["reason"], c["actor"]) for c in changes] == [
        ("active", "paused", "maintenance window", "ops"),
        ("paused", "active", None, "ops"),
    ]
    assert changes[0]["until_at"] == T0 + 60 and changes[0]["source"] == "operator"


@pytest.mark.anyio
async def test_enable_closes_a_disabled_breaker_only(db_target: str, raw: RawDB) -> None:
    async with open_store(db_target) as db:
        assert not await enable_destination(db, "billing", now=T0)
        assert raw.scalar("SELECT COUNT(*) FROM dispatch_destination_changes") == 0
        raw.execute(
            "UPDATE dispatch_destinations SET state = 'disabled', failures = 12, "
            "cool_down = 240 WHERE name = 'billing'"
        )
        assert await enable_destination(db, "billing", reason="fixed", now=T0 + 1)
    (row,) = raw.rows("SELECT * FROM dispatch_destinations")
    assert (row["state"], row["failures"], row["cool_down"]) == ("active", 0, None)
    (change,) = raw.rows("SELECT * FROM dispatch_destination_changes")
    assert (change["previous_state"], change["state"], change["reason"]) == (
        "disabled",
        "active",
        "fixed",
    )


@pytest.mark.anyio
async def test_bad_operator_input_writes_nothing(db_target: str, raw: RawDB) -> None:
    async with open_store(db_target) as db:
        with pytest.raises(ValueError, match="'\\*' names the defaults"):
            await pause_destination(db, "*")
        with pytest.raises(ValueError, match=r"for_seconds must be a number >= 0\.001"):
            await pause_destination(db, "billing", for_seconds=0)
        with pytest.raises(ValueError, match="give for_seconds or until"):
            await pause_destination(db, "billing", for_seconds=5, until=T0 + 5, now=T0)
        with pytest.raises(ValueError, match="until must be in the future"):
            await pause_destination(db, "billing", until=T0 - 1, now=T0)
        with pytest.raises(TypeError, match="reason must be a str"):
            await pause_destination(db, "billing", reason=5)  # type: ignore[arg-type]
    assert raw.scalar("SELECT COUNT(*) FROM dispatch_destinations") == 0
    assert raw.scalar("SELECT COUNT(*) FROM dispatch_destination_changes") == 0


def test_effective_state_reads_throttle_and_breaker() -> None:
    base = {
        "state": "active",
        "state_until": None,
        "reason": None,
        "throttled_until": T0 + 30,
        "probe_until": None,
    }
    assert effective(base, T0).state is State.THROTTLED
    assert effective(base, T0).until == T0 + 30
    assert effective(base, T0 + 30).state is State.ACTIVE
    opened = {**base, "state": "open", "state_until": T0 + 60, "throttled_until": None}
    assert effective(opened, T0).state is State.OPEN
    assert effective(opened, T0 + 60).state is State.HALF_OPEN
    assert effective(None, T0).state is State.ACTIVE
