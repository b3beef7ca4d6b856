"""The ordering keys' rule of the claim (docs/ordering.md): a keyed row is claimable
when it is ``delivering`` already (lease recovery: it holds the key), or
when no other row of its key is ``delivering`` and no row before it in its
key is live -- or, under the ``block`` policy, ``dead_letter`` or
``expired`` (a blocked key). Waiting, promotion and the key locks are
:mod:`..ordering`'s; this is what the claim asks.

As a claim rule (:class:`OrderingKeys`) it is an SQL term on the candidate
row, whose two probes read the partial ordering indexes only (never the
rows waiting behind a head), and a check after the candidates are locked
(:func:`take_keys`): the claim takes its candidates' keys with try-locks,
leaves a key another transaction holds to the next claim, and checks the
term again in a statement that starts after the locks. Two transactions
never decide for one key from snapshots that miss each other's commit, so
``SKIP LOCKED`` cannot let two claimants take two rows of one key.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Collection, Sequence
from typing import Final

from ...lifecycle import DUE_SQL, ORDERED_SQL, WAITING_AT, Status
from ...store.base import Conn, Row
from ...store.dialect import ArrayForms
from ..ordering import DEFAULT_ORDERING_POLICY, OrderingPolicy
from .rules import Claiming, ClaimRule


def _ahead(policy: OrderingPolicy) -> str:
    # What, with a lower id, keeps a row of the same key from its claim.
    return "" if policy == "block" else f" AND k.{DUE_SQL}"


def claimable(policy: OrderingPolicy, table: str = "dispatch_outbox") -> str:
    """The claim rule as an SQL term on ``table`` (an unaliased
    ``dispatch_outbox`` of the enclosing statement). Each probe repeats its
    partial index's terms verbatim, so it reads that index only."""
    return (
        f"({table}.ordering_key IS NULL OR {table}.status = '{Status.DELIVERING}' OR ("
        "NOT EXISTS (SELECT 1 FROM dispatch_outbox k "
        f"WHERE k.ordering_key = {table}.ordering_key AND k.ordering_key IS NOT NULL "
        f"AND k.{ORDERED_SQL} AND (k.key_seq, k.id) < ({table}.key_seq, {table}.id)"
        f"{_ahead(policy)}) "
        "AND NOT EXISTS (SELECT 1 FROM dispatch_outbox k "
        f"WHERE k.ordering_key = {table}.ordering_key AND k.ordering_key IS NOT NULL "
        f"AND k.{DUE_SQL} AND k.next_attempt_at < {WAITING_AT!r} "
        f"AND k.status = '{Status.DELIVERING}' AND k.id <> {table}.id)))"
    )


CLAIMABLE: Final = {policy: claimable(policy) for policy in ("block", "skip")}
"""The claim rule of each policy (``"block"``, ``"skip"``)."""


def take_keys(conn: Conn, rows: Sequence[Row], policy: OrderingPolicy) -> list[Row]:
    """The candidates of a claim that stay claimable once their keys are
    held: unkeyed rows as they are; keyed rows only where this transaction
    took the key's lock (PostgreSQL: without waiting; a key another
    transaction holds waits for the next scan) and, checked again after the
    locks, the rule still holds."""
    keyed = [row for row in rows if row.get("ordering_key") is not None]
    if not keyed or not conn.dialect.key_try_locks:
        return list(rows)
    taken = {
        str(found["key"])
        for found in conn.query(
            conn.dialect.key_try_locks, (sorted({str(row["ordering_key"]) for row in keyed}),)
        )
    }
    held: set[str] | None = getattr(conn, "held_keys", None)
    if held is not None:
        held.update(taken)
    candidates = [str(row["id"]) for row in keyed if row["ordering_key"] in taken]
    still = still_claimable(conn, candidates, policy)
    return [row for row in rows if row.get("ordering_key") is None or row["id"] in still]


@functools.cache
def _still(arrays: ArrayForms, policy: OrderingPolicy) -> str:
    # One statement text for any number of ids, prepared once.
    return f"SELECT id FROM dispatch_outbox WHERE {arrays.any_of('id')} AND {CLAIMABLE[policy]}"


def still_claimable(conn: Conn, ids: Collection[str], policy: OrderingPolicy) -> set[str]:
    """Which of ``ids`` the claim rule allows now (a fresh statement)."""
    if not ids:
        return set()
    arrays = conn.dialect.arrays
    if arrays is not None:
        found = conn.query(_still(arrays, policy), (list(ids),))
    else:
        marks = ", ".join("?" * len(ids))
        found = conn.query(
            f"SELECT id FROM dispatch_outbox WHERE id IN ({marks}) AND {CLAIMABLE[policy]}",
            tuple(ids),
        )
    return {str(row["id"]) for row in found}


@dataclasses.dataclass(frozen=True)
class OrderingKeys(ClaimRule):
    """The ordering keys' claim rule under ``policy``: every claim has it."""

    policy: OrderingPolicy = DEFAULT_ORDERING_POLICY
    term: str = dataclasses.field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "term", CLAIMABLE[self.policy])

    def take(self, conn: Conn, rows: list[Row], claiming: Claiming) -> list[Row]:
        return take_keys(conn, rows, self.policy)
