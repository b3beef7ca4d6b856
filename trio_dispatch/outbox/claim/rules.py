"""What narrows a claim: the one interface every rule implements
(:class:`ClaimRule`), and their composition (:class:`ClaimRules`) that the
claim and its reads run.

A claim (:func:`~trio_dispatch.outbox.machine.claim_batch`) asks its rules
at five points, all inside its one write transaction (a rule reads and
writes only there: a check made before the claim and trusted after it is a
race), after :meth:`~ClaimRule.sync` (what the claimant owes the store,
written first: the starts it held and began, :mod:`.pins`):

1. :attr:`~ClaimRule.term` -- an SQL term on the candidate row, part of
   every read of the claim (the ordering keys' rule). Each of its probes
   reads an index of its own, so rows the term refuses cost nothing.
2. :meth:`~ClaimRule.bounds` -- before the read: the destinations left out
   entirely and how many more attempts each destination may start now
   (:class:`Bounds`; a destination whose room is 0 is left out). The
   claim's read never steps over a left-out destination's rows
   (:mod:`.scan`).
3. :meth:`~ClaimRule.take` -- after the candidates are locked: which of
   them this transaction may decide for (the ordering keys take each key's
   lock, then check their term again in a fresh statement). A row left out
   here is neither claimed nor expired.
4. :meth:`~ClaimRule.admit` -- of the rows about to start an attempt (those
   past their deadline or out of attempts are gone by then), which start
   now: every row admitted is claimed, in this transaction, so a rule may
   write what the starts change here (the per-worker caps count what runs;
   a destination's admission locks its state row, counts again, and
   advances its rate).
5. :meth:`~ClaimRule.claimed` -- the claims made, before the transaction
   commits (the caps hold a place for each).

Steps 3 to 5 get the claim's :class:`Claiming`: its time, its lease end,
its actor and the bounds it read with (each rule finds its own there, with
whatever it noted when it set them). And once outside any transaction,
:meth:`~ClaimRule.ended`: attempts of this process that ended (the caps
give their place back). What the store must know of an end is written by
the end itself.

A rule is one module and one line in :func:`~.claim_rules`; the statements
never change for a rule.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Final

from ...store.base import Conn, Row

if TYPE_CHECKING:
    from ..transitions import Claim
    from .fair import Turns

Room = Callable[[str], int]
"""How many more attempts a destination may start now."""


@dataclasses.dataclass(frozen=True)
class Bounds:
    """What a claim may read at most, before it reads."""

    skip: frozenset[str] = frozenset()
    """Destinations left out entirely: their rows are never read."""
    room: Room | None = None
    """How many rows of each destination the claim may take (None: as many
    as it likes). Applied where the read bounds each destination (some are
    left out, or the claim shares itself fairly); otherwise the rules'
    :meth:`~ClaimRule.admit` keeps to it."""
    lifts: Mapping[str, float] = dataclasses.field(default_factory=dict)
    """When a left-out destination may be taken again, where that is known
    (a pause's end, a throttle's, a cool-down's, a rate's next start): when
    nothing else is due, the claim loop sleeps until the first of them."""
    note: Any = None
    """What the rule that set these bounds noted for its own later hooks
    (see :meth:`of`)."""
    parts: tuple[tuple[ClaimRule, Bounds], ...] = ()
    """Combined bounds: each rule's own."""
    clock: float | None = None
    """The store's time at which a rule decides starts (PostgreSQL: the
    server's, where a destination has a rate; None: the claim's own time).
    The claim stamps its starts with it, so the recorded times are the
    times the rate decided at: a rate's starts read back from the history
    keep to the rate."""

    def allows(self, destination: str) -> int | None:
        """The room of ``destination`` (0 when left out; None: no bound)."""
        if destination in self.skip:
            return 0
        return None if self.room is None else self.room(destination)

    def of(self, rule: ClaimRule) -> Bounds:
        """The bounds ``rule`` set in this claim (:data:`NO_BOUNDS` if none)."""
        for owner, bounds in self.parts:
            if owner is rule:
                return bounds
        return NO_BOUNDS


NO_BOUNDS: Final = Bounds()


@dataclasses.dataclass(frozen=True)
class Claiming:
    """The claim being made, as its rules see it after the read."""

    at: float
    """The claim's time (the worker's clock)."""
    lease_until: float
    """When the leases of its claims end."""
    actor: str
    """Who claims (the worker's actor)."""
    bounds: Bounds = NO_BOUNDS
    """The bounds the claim read with (each rule's own: :meth:`Bounds.of`)."""
    term: str = ""
    """The rules' term the claim read with (:attr:`ClaimRules.term`)."""


class ClaimRule:
    """One rule that narrows a claim. Every hook is a no-op here: a rule
    overrides the ones it needs. A hook that gets a connection runs inside
    the claim's write transaction (or, for :meth:`bounds`, the read that
    asks when the next row falls due) and must not commit, wait on the
    outside world or keep state that outlives a rolled-back transaction
    without a bound (see :meth:`claimed`)."""

    term: str = ""
    """An SQL term on an unaliased ``dispatch_outbox`` row: rows for which
    it is false are never read (empty: every row)."""

    def sync(self, conn: Conn, at: float) -> None:
        """Write what this claimant owes the store, before the claim reads
        (idempotent: a transaction that rolls back is sent again)."""

    def bounds(self, conn: Conn, at: float) -> Bounds:
        """Destinations left out and each one's room, at ``at``."""
        return NO_BOUNDS

    def take(self, conn: Conn, rows: list[Row], claiming: Claiming) -> list[Row]:
        """Of the locked candidates (in the claim's order), those this
        transaction may decide for."""
        return rows

    def admit(self, conn: Conn, rows: list[Row], claiming: Claiming) -> list[Row]:
        """Of the rows about to start an attempt (in the claim's order, each
        with its ``deliver_to``), those that start now: each is claimed in
        this transaction."""
        return rows

    def claimed(self, conn: Conn, claims: Sequence[Claim], claiming: Claiming) -> None:
        """The claims this transaction made (it has not committed yet: an
        effect outside it must end by itself, at the latest with the
        claim's lease)."""

    def ended(self, attempts: Iterable[tuple[str, float]]) -> None:
        """Attempts of this process that ended -- ``(dispatch id, lease
        end)`` of their claims -- however they ended (idempotent)."""


def _overrides(rule: ClaimRule, hook: str) -> bool:
    return getattr(type(rule), hook) is not getattr(ClaimRule, hook)


class ClaimRules:
    """The rules of one claim, composed: the terms joined, the bounds
    combined (every rule's left-out destinations; the least room), and the
    hooks run in the order the rules are listed. ``turns`` (optional) is the
    fair share's rotation across this claimant's claims (:class:`~.fair.Turns`):
    the scan orders destinations by it, and every claim made is a turn. Equal
    when the rules are (a worker's finishes with one rule set claim
    together)."""

    __slots__ = (
        "_admitting",
        "_bounding",
        "_claiming",
        "_ending",
        "_syncing",
        "_taking",
        "rules",
        "term",
        "turns",
    )

    def __init__(self, rules: Iterable[ClaimRule | None] = (), turns: Turns | None = None) -> None:
        self.turns = turns
        self.rules: tuple[ClaimRule, ...] = tuple(rule for rule in rules if rule is not None)
        self.term = " AND ".join(rule.term for rule in self.rules if rule.term)
        """Every rule's term, joined (empty: no term)."""
        # Only the rules that do something at a point are asked there: the
        # common claim pays for no hook it does not use.
        self._syncing = [rule for rule in self.rules if _overrides(rule, "sync")]
        self._bounding = [rule for rule in self.rules if _overrides(rule, "bounds")]
        self._taking = [rule for rule in self.rules if _overrides(rule, "take")]
        self._admitting = [rule for rule in self.rules if _overrides(rule, "admit")]
        self._claiming = [rule for rule in self.rules if _overrides(rule, "claimed")]
        self._ending = [rule for rule in self.rules if _overrides(rule, "ended")]

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ClaimRules) and other.rules == self.rules

    def __hash__(self) -> int:
        return hash(self.rules)

    def __repr__(self) -> str:
        return f"ClaimRules({list(self.rules)!r})"

    def sync(self, conn: Conn, at: float) -> None:
        """What every rule's claimant owes the store, written."""
        for rule in self._syncing:
            rule.sync(conn, at)

    def bounds(self, conn: Conn, at: float) -> Bounds:
        """Every rule's bounds at ``at``, combined (each kept in
        :attr:`Bounds.parts`)."""
        if not self._bounding:
            return NO_BOUNDS
        parts = tuple((rule, rule.bounds(conn, at)) for rule in self._bounding)
        found = [bounds for _, bounds in parts]
        skip = frozenset().union(*(bounds.skip for bounds in found))
        rooms = [bounds.room for bounds in found if bounds.room is not None]
        room: Room | None
        if len(rooms) <= 1:
            room = rooms[0] if rooms else None
        else:

            def room(destination: str) -> int:
                return min(each(destination) for each in rooms)

        lifts: dict[str, float] = {}
        for bounds in found:
            for name, when in bounds.lifts.items():
                lifts[name] = max(when, lifts.get(name, when))
        clock = next((bounds.clock for bounds in found if bounds.clock is not None), None)
        return Bounds(skip, room, lifts, None, parts, clock)

    def take(self, conn: Conn, rows: list[Row], claiming: Claiming) -> list[Row]:
        """The candidates every rule lets this transaction decide for."""
        for rule in self._taking:
            if not rows:
                break
            rows = rule.take(conn, rows, claiming)
        return rows

    def admit(self, conn: Conn, rows: list[Row], claiming: Claiming) -> list[Row]:
        """The rows every rule lets start an attempt now."""
        for rule in self._admitting:
            if not rows:
                break
            rows = rule.admit(conn, rows, claiming)
        return rows

    def claimed(self, conn: Conn, claims: Sequence[Claim], claiming: Claiming) -> None:
        """Tell every rule of the claims made, none too (and the turns:
        each claim is one)."""
        if claims and self.turns is not None:
            self.turns.served(claim.deliver_to for claim in claims)
        for rule in self._claiming:
            rule.claimed(conn, claims, claiming)

    def ended(self, attempts: Iterable[tuple[str, float]]) -> None:
        """Tell every rule of attempts that ended."""
        if self._ending:
            ended = list(attempts)
            for rule in self._ending:
                rule.ended(ended)


NO_RULES: Final = ClaimRules()
"""Nothing narrows the read: for reads that only ask what is due."""
