"""The claim's rules compose through one interface: their terms joined,
their bounds combined (every left-out destination, the least room), their
hooks run in the order they are listed. No database: the hooks here read
none."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from trio_dispatch.destinations import Destination
from trio_dispatch.outbox.claim import (
    NO_BOUNDS,
    Bounds,
    ClaimRule,
    ClaimRules,
    DestinationAdmission,
    DestinationCaps,
    OrderingKeys,
    claim_rules,
)
from trio_dispatch.outbox.claim.keys import CLAIMABLE
from trio_dispatch.outbox.claim.rules import Claiming
from trio_dispatch.store.base import Conn, Row

T0 = 1_000_000.0
CLAIMING = Claiming(T0, T0 + 30, "test")


class _Rule(ClaimRule):
    def __init__(self, name: str, term: str, skip: set[str], room: dict[str, int]) -> None:
        self.name, self.term, self.skip, self.room = name, term, frozenset(skip), room
        self.calls: list[str] = []

    def bounds(self, conn: Conn, at: float) -> Bounds:
        return Bounds(self.skip, lambda destination: self.room.get(destination, 100))

    def take(self, conn: Conn, rows: list[Row], claiming: Claiming) -> list[Row]:
        self.calls.append("take")
        return [row for row in rows if row["id"] != f"not-{self.name}"]

    def admit(self, conn: Conn, rows: list[Row], claiming: Claiming) -> list[Row]:
        self.calls.append("admit")
        return rows[:-1]

    def ended(self, attempts: Iterable[tuple[str, float]]) -> None:
        self.calls.extend(f"ended {dispatch_id}" for dispatch_id, _ in attempts)


def test_rules_combine_their_terms_bounds_and_hooks_in_order() -> None:
    first = _Rule("first", "a = 1", {"x"}, {"d": 3, "e": 1})
    second = _Rule("second", "b = 2", {"y"}, {"d": 2, "e": 5})
    rules = ClaimRules((first, None, second))
    conn: Any = None  # the rules here read nothing
    assert rules.term == "a = 1 AND b = 2"
    bounds = rules.bounds(conn, T0)
    assert bounds.skip == {"x", "y"}
    assert [bounds.allows(d) for d in ("d", "e", "x", "f")] == [2, 1, 0, 100]
    rows: list[Row] = [{"id": i} for i in ("a", "not-first", "b", "not-second", "c")]
    assert [row["id"] for row in rules.take(conn, rows, CLAIMING)] == ["a", "b", "c"]
    assert [row["id"] for row in rules.admit(conn, rows[:3], CLAIMING)] == ["a"]
    rules.ended([("a", T0 + 30)])
    assert first.calls == second.calls == ["take", "admit", "ended a"]


def test_a_claim_without_bounds_reads_as_it_always_has() -> None:
    conn: Any = None
    rules = ClaimRules((OrderingKeys(),))
    assert claim_rules().rules == (OrderingKeys("block"), DestinationAdmission({}))
    assert rules.term == CLAIMABLE["block"]
    assert rules.bounds(conn, T0) is NO_BOUNDS
    assert claim_rules() == claim_rules() and hash(claim_rules()) == hash(claim_rules())
    assert claim_rules(ordering="skip") != claim_rules()
    assert claim_rules(destinations={"d": Destination(rate="1/s")}) != claim_rules()


def test_the_caps_leave_full_destinations_out_and_give_the_others_their_room() -> None:
    caps = DestinationCaps(2)
    caps.hold("a1", "a", T0 + 10)
    caps.hold("a2", "a", T0 + 10)
    caps.hold("b1", "b", T0 + 10)
    bounds = ClaimRules((caps,)).bounds(None, T0)  # type: ignore[arg-type]
    assert bounds.skip == {"a"}
    assert [bounds.allows(d) for d in ("a", "b", "c")] == [0, 1, 2]
    # A hold ends with its lease: past it, nothing is left out.
    assert ClaimRules((caps,)).bounds(None, T0 + 11).skip == frozenset()  # type: ignore[arg-type]
