"""Ordering keys: the rows that share a key are delivered one at a time, in
the order their enqueues committed, without holding up any other row.

**Commit order.** A keyed row's place in its key is ``(key_seq, id)``:
``key_seq`` is one more than the highest of the key's rows that still count
for its order, assigned by the insert itself while the key is locked
(PostgreSQL: the key's lock, held to the commit; SQLite: the single
writer), so a key's rows follow the order their enqueues committed on any
host, whatever each producer's clock says. ``id`` (UUIDv7, the producer's
clock) only breaks ties among rows one transaction inserted, in the order
it inserted them; rows written before ``key_seq`` existed have 0 and keep
their id order, ahead of every later one.

Everything ordering adds to the outbox is here but the claim's rule,
which lives with the claim's other rules (:mod:`.claim.keys`); the claim,
the expiry sweep, the ends of attempts, the operators' writes and enqueue
call in at four points:

- **Waiting.** A keyed row enqueued while a live (``pending`` or
  ``delivering``) row of its key has a lower id waits: its
  ``next_attempt_at`` is :data:`~trio_dispatch.lifecycle.WAITING_AT`, past
  every due time, so the claim's ordered read of the due index stops before
  it. A hundred thousand rows behind one head cost a scan nothing.
- **Promotion.** Whenever a keyed row leaves the live set (delivered,
  acked, dead-lettered, expired -- at a claim or by the expiry sweep, which
  expires waiting rows too) or a row of a key is removed (purged, pruned),
  :func:`promote` makes the key's lowest live row due if it was waiting.
  The lowest live row of a key therefore never carries the mark; under the
  ``block`` policy the one right behind a dead or expired head still waits,
  held by the claim rule alone (what operators see as waiting is both:
  :func:`~trio_dispatch.outbox.reads.waiting_term`).
- **The claim rule** (:func:`.claim.keys.claimable`), the authority whatever the
  waiting marks say: a keyed row is claimable when it is ``delivering``
  already (lease recovery: it holds the key), or when no other row of its
  key is ``delivering`` and no row with a lower id is live -- or, under the
  ``block`` policy, ``dead_letter`` or ``expired`` (a blocked key). Both
  probes read the two partial ordering indexes, never the waiting rows.
- **Key locks.** On PostgreSQL every transaction that decides for a key
  (enqueue, an attempt's end, an operator's write, a retention prune) first
  holds the key's advisory lock until it commits, and a claim takes the keys
  of its candidates with try-locks, leaves a key another transaction holds to
  the next scan, and checks the rule again in a statement that starts after
  the locks (:func:`.claim.keys.take_keys`). Two transactions never decide for one key
  from snapshots that miss each other's commit, so ``SKIP LOCKED`` cannot let
  two claimants take two rows of one key: the second claim's check runs
  after the first claim committed its row as ``delivering``. The expiry
  sweep takes its rows' keys without waiting too (:func:`try_lock_keys`) and
  leaves a key another transaction holds to its next batch. SQLite's single
  writer serializes the same decisions without locks.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Sequence
from typing import Any, Final, Literal

from ..lifecycle import BLOCKING_SQL, DUE_SQL, ORDERED_SQL, WAITING_AT, Status
from ..store.base import Conn, KeyOrderConflict, Row
from ..store.dialect import ArrayForms
from ..validate import require_text
from ..values import show

OrderingPolicy = Literal["block", "skip"]
"""What a key's head that ends ``dead_letter`` or ``expired`` does to the rows
behind it: ``block`` (they wait for an operator's retry or purge of the
head) or ``skip`` (the next row goes)."""

ORDERING_POLICIES: Final = ("block", "skip")
DEFAULT_ORDERING_POLICY: Final[OrderingPolicy] = "block"
MAX_ORDERING_KEY_LENGTH: Final = 255


def require_ordering_key(value: object) -> str | None:
    """None, or a non-empty key of at most 255 characters without control
    characters; anything else is a ``ValueError`` (``TypeError`` for a
    non-string) naming it."""
    if value is None:
        return None
    text = require_text("ordering_key", value)
    if not text.strip():
        raise ValueError(f"ordering_key must be a non-empty string, got {show(value)}")
    if len(text) > MAX_ORDERING_KEY_LENGTH:
        raise ValueError(
            f"ordering_key must be at most {MAX_ORDERING_KEY_LENGTH} characters, "
            f"got {len(text)}: {show(text[:40])}..."
        )
    if any(ord(char) < 32 or 127 <= ord(char) < 160 for char in text):
        raise ValueError(f"ordering_key must not contain control characters, got {show(value)}")
    return text


def require_policy(name: str, value: object) -> OrderingPolicy:
    """``"block"`` or ``"skip"``; anything else is a ``ValueError`` naming it."""
    if value not in ORDERING_POLICIES:
        raise ValueError(f"{name} must be 'block' or 'skip', got {show(value)}")
    return "block" if value == "block" else "skip"


_DUE_NOT_BEFORE: Final = "CASE WHEN {t}not_before > ? THEN {t}not_before ELSE ? END"
# A debounced row (docs/controls.md) made due goes no earlier than its
# not_before (NULL for every other row: the comparison is not true).

PROMOTE: Final = (
    f"UPDATE dispatch_outbox SET next_attempt_at = {_DUE_NOT_BEFORE.format(t='')} WHERE id = ("
    "SELECT k.id FROM dispatch_outbox k WHERE k.ordering_key = ? AND k.ordering_key IS NOT NULL "
    f"AND k.{ORDERED_SQL} AND k.{DUE_SQL} ORDER BY k.key_seq, k.id LIMIT 1) "
    f"AND status = '{Status.PENDING}' AND next_attempt_at >= {WAITING_AT!r}"
)
"""Make the lowest live row of the key (third parameter) due at the first
parameter (given twice; a debounced row's ``not_before`` if later), if it
waits."""

# The key's lowest live row: a probe of the ordering index.
_HEAD: Final = (
    "SELECT k.id FROM dispatch_outbox k WHERE k.ordering_key = u.key "
    f"AND k.ordering_key IS NOT NULL AND k.{ORDERED_SQL} AND k.{DUE_SQL} "
    "ORDER BY k.key_seq, k.id LIMIT 1"
)


@functools.cache
def promote_many(arrays: ArrayForms) -> str:
    """:data:`PROMOTE` for an array of keys in one statement (a probe of the
    ordering index and a primary-key update per key; an ``IN`` or ``ANY``
    form would read the waiting rows of the due index instead)."""
    return (
        f"UPDATE dispatch_outbox d SET next_attempt_at = {_DUE_NOT_BEFORE.format(t='d.')} "
        f"FROM {arrays.each('u', (('key', 'text'),), _HEAD, 'head')} "
        f"WHERE d.id = head.id AND d.status = '{Status.PENDING}' "
        f"AND d.next_attempt_at >= {WAITING_AT!r}"
    )


def lock_keys(conn: Conn, keys: Iterable[str | None]) -> None:
    """Hold these keys' locks until the transaction ends (PostgreSQL; a no-op
    where the write lock serializes every writer). Call before the
    transaction's first write to a row of these keys: a lock taken after a
    row lock could close a cycle with an operator's write.

    Every transaction takes its key locks in one order (by code point), so
    two never wait for each other's: where the connection keeps the keys
    its transaction holds (the store's own, whose transaction several units
    share), a key below one already held is only tried, never waited for,
    and if another transaction holds it :class:`KeyOrderConflict` is raised
    (the group commit then runs the unit first in a transaction of its own,
    where it waits in order)."""
    statement = lock_ahead(conn, keys)
    if statement is not None:
        conn.query(*statement)


def lock_ahead(conn: Conn, keys: Iterable[str | None]) -> tuple[str, Sequence[Any]] | None:
    """:func:`lock_keys`, but where the locks are waited for in order (no
    key below one already held), the statement that takes them is
    returned instead of run, for the caller to send ahead of its next
    statement in one round trip (:meth:`~.base.Conn.query_each`'s
    ``first``); the keys count as held from now. None: nothing to send (no
    lock wanted, or the keys tried here already, out of order)."""
    wanted = sorted({key for key in keys if key is not None})
    if not wanted or not conn.dialect.key_locks:
        return None
    held: set[str] | None = getattr(conn, "held_keys", None)
    fresh = wanted if held is None else [key for key in wanted if key not in held]
    if not fresh:
        return None
    if held is not None:
        if held and fresh[0] < max(held):
            taken = {str(row["key"]) for row in conn.query(conn.dialect.key_try_locks, (fresh,))}
            if len(taken) < len(fresh):
                raise KeyOrderConflict(
                    f"ordering key {show(min(set(fresh) - taken))} is held by another transaction"
                )
            held.update(fresh)
            return None
        held.update(fresh)
    return conn.dialect.key_locks, (fresh,)


def try_lock_keys(conn: Conn, keys: Iterable[str | None]) -> set[str]:
    """Of these keys, the ones this transaction now holds until it ends,
    taken without waiting (PostgreSQL; every key where the write lock
    serializes every writer): a key another transaction holds is left out,
    for the caller to leave its rows to a later transaction. Never waits,
    so it may follow the transaction's row locks."""
    wanted = sorted({key for key in keys if key is not None})
    if not wanted or not conn.dialect.key_try_locks:
        return set(wanted)
    taken = {str(row["key"]) for row in conn.query(conn.dialect.key_try_locks, (wanted,))}
    held: set[str] | None = getattr(conn, "held_keys", None)
    if held is not None:
        held.update(taken)
    return taken


def promote(conn: Conn, keys: Iterable[str | None], now: float) -> None:
    """After rows of these keys left the live set or were removed: each key's
    lowest live row, if it waits, is due at ``now``. The caller holds the
    keys' locks. One statement for all keys where parameters may be arrays
    (one round trip; it was 70% of what keys added to a PostgreSQL
    delivery), one per key elsewhere."""
    wanted = sorted({key for key in keys if key is not None})
    if not wanted:
        return
    arrays = conn.dialect.arrays
    if arrays is not None:
        conn.execute(promote_many(arrays), (now, now, wanted))
        return
    for key in wanted:
        conn.execute(PROMOTE, (now, now, key))


# -- what operators see ------------------------------------------------------------

_AHEAD: Final = (
    "SELECT id, status FROM dispatch_outbox k WHERE k.ordering_key = ? "
    f"AND k.ordering_key IS NOT NULL AND k.{ORDERED_SQL} "
    "AND (k.key_seq, k.id) < (SELECT r.key_seq, r.id FROM dispatch_outbox r WHERE r.id = ?)"
    "{live} ORDER BY k.key_seq, k.id LIMIT 1"
)

BLOCKED_HEADS: Final = (
    f"SELECT h.id, h.ordering_key, h.status, h.kind, h.deliver_to, h.updated_at "
    "FROM dispatch_outbox h "
    f"WHERE h.ordering_key IS NOT NULL AND h.{BLOCKING_SQL} "
    "AND NOT EXISTS (SELECT 1 FROM dispatch_outbox k "
    "WHERE k.ordering_key = h.ordering_key AND k.ordering_key IS NOT NULL "
    f"AND k.{ORDERED_SQL} AND (k.key_seq, k.id) < (h.key_seq, h.id)) "
    "AND EXISTS (SELECT 1 FROM dispatch_outbox k "
    "WHERE k.ordering_key = h.ordering_key AND k.ordering_key IS NOT NULL "
    f"AND k.{ORDERED_SQL} AND k.{DUE_SQL} AND (k.key_seq, k.id) > (h.key_seq, h.id)) "
    "{key}ORDER BY h.id LIMIT ?"
)
"""The heads of blocked keys: a ``dead_letter`` or ``expired`` row first in
its key with a live row behind it (under the ``block`` policy). The first
terms repeat the heads index's (schema version 6), so the read walks only
keyed rows that ended dead or expired, never the live or unkeyed ones."""


def ahead_of(conn: Conn, key: str | None, dispatch_id: str, policy: OrderingPolicy) -> Row | None:
    """The row a keyed row waits behind (its key's first row that still
    counts: live, or under ``block`` a dead or expired head), or None."""
    if key is None:
        return None
    live = "" if policy == "block" else f" AND k.{DUE_SQL}"
    return conn.query_one(_AHEAD.format(live=live), (key, dispatch_id))


BLOCKED_KEYS_CAP: Final = 1000
"""Blocked keys are counted up to this many (metrics, the dashboard): at the
cap, the real count is this or more."""


def count_blocked_keys(conn: Conn, cap: int = BLOCKED_KEYS_CAP) -> int:
    """How many keys are blocked (see :data:`BLOCKED_HEADS`), counted up to
    ``cap``."""
    found = conn.query_one(
        f"SELECT COUNT(*) AS n FROM ({BLOCKED_HEADS.format(key='')}) AS heads", (cap,)
    )
    return int(found["n"]) if found else 0


def blocked_heads(conn: Conn, limit: int, key: str | None = None) -> list[Row]:
    """Up to ``limit`` heads of blocked keys (of ``key`` only, if given), in
    id order."""
    statement = BLOCKED_HEADS.format(key="" if key is None else "AND h.ordering_key = ? ")
    return conn.query(statement, (limit,) if key is None else (key, limit))
