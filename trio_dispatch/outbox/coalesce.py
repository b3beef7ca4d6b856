"""Coalescing (docs/controls.md): enqueues that share a ``coalesce_key``
leave at most one row waiting for its first attempt.

Among a key's rows only the one that is ``pending`` and never claimed
counts (the *waiting* row: :data:`~trio_dispatch.store.migrations.COALESCE_WAITING_TERM`,
the term of schema version 15's partial unique index). An enqueue with the
key, in its mode:

- ``keep`` (the default): a waiting row answers the enqueue -- its id is
  returned, outcome ``kept``, and nothing is written;
- ``replace``: the waiting row becomes ``superseded``
  (``dispatch.superseded.coalesced``, its summary and metadata naming the
  new row) and the new row is inserted, in one transaction: ``replaced``;
- ``debounce``: as ``replace``, and the new row is due ``coalesce_seconds``
  from now, but never later than ``coalesce_max_wait_seconds`` after the
  first row of the chain it replaces was created (``coalesce_since``).

Without a waiting row the new row is simply inserted (``inserted``): a
row already claimed, retrying or awaiting an ack is never touched, and the
new one waits as any row does (with an ordering key: behind it). A payload
is never rewritten: the superseded row keeps its own, the new row carries
the new one.

**Order of checks.** A dedup key is looked at first: a hit returns the
first row's id and writes nothing, whatever the coalesce mode says. Then
the key's waiting row decides.

**Concurrency.** The unique index is the authority: whatever the engine
or whose transaction, a key never has two waiting rows. On PostgreSQL an
enqueue first holds the key's advisory lock (the ordering keys' lock, on a
name no ordering key can spell) until it commits, so a second enqueue of
the key waits and then reads the first one's row instead of failing on the
index; SQLite's single writer serializes them without a lock.

**Ordering keys.** A superseded row leaves its key's live set: the next row
of its key, if it waited behind it, is made due (:func:`.ordering.promote`),
and the new row goes last in its key. A debounced row that waits behind its
key's head is made due when the head leaves, but not before its
``not_before``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Mapping, Sequence
from typing import Any, Final, Literal

from ..lifecycle import Reason, Status
from ..store.base import Conn, Row
from ..store.dialect import ArrayForms, Replanned
from ..store.schema import COALESCE_WAITING_TERM
from ..validate import require_number
from ..values import show
from .ordering import lock_keys, promote, require_ordering_key
from .transitions import Change, NewDispatch, record, transition_rows

CoalesceMode = Literal["keep", "replace", "debounce"]
"""What an enqueue does to its key's waiting row (see the module)."""

COALESCE_MODES: Final = ("keep", "replace", "debounce")
DEFAULT_COALESCE: Final[CoalesceMode] = "keep"

MAX_COALESCE_SECONDS: Final = 366 * 86400.0
"""The longest debounce or max wait: a year."""

Outcome = Literal["inserted", "replaced", "kept"]
"""What an enqueue did: wrote a new row (``inserted``), wrote one in place
of its key's waiting row (``replaced``), or returned an existing row's id
and wrote nothing (``kept``: a coalesce ``keep``, or a dedup hit)."""

INSERTED: Final[Outcome] = "inserted"
REPLACED: Final[Outcome] = "replaced"
KEPT: Final[Outcome] = "kept"

LOCK_PREFIX: Final = "\x1fcoalesce:"
"""Before a coalesce key, the name of its advisory lock: an ordering key
has no control character, so no ordering key's lock shares the name."""


@dataclasses.dataclass(frozen=True)
class Coalesce:
    """One enqueue's coalescing, checked."""

    key: str
    mode: CoalesceMode = DEFAULT_COALESCE
    seconds: float | None = None
    """``debounce``: how long after this enqueue the row falls due."""
    max_wait: float | None = None
    """``debounce``: the latest it falls due, counted from the creation of
    the first row of the chain (None: no bound)."""

    @property
    def lock(self) -> str:
        """The name of the key's lock (see :func:`.ordering.lock_keys`)."""
        return LOCK_PREFIX + self.key

    def as_metadata(self) -> dict[str, object]:
        """What the transitions record of it."""
        found: dict[str, object] = {"coalesce_key": self.key, "coalesce": self.mode}
        if self.seconds is not None:
            found["coalesce_seconds"] = self.seconds
        if self.max_wait is not None:
            found["coalesce_max_wait_seconds"] = self.max_wait
        return found


def require_coalesce(
    key: object, mode: object = None, seconds: object = None, max_wait: object = None
) -> Coalesce | None:
    """The enqueue arguments ``coalesce_key``, ``coalesce``,
    ``coalesce_seconds`` and ``coalesce_max_wait_seconds`` checked together
    (None for a mode means the default, ``keep``). A bad value or a
    combination that means nothing (a mode without a key, seconds without
    ``debounce``, a max wait shorter than the debounce) is a ``ValueError``
    (``TypeError`` for a wrong type) naming it."""
    text = _require_key(key)
    if mode is not None and mode not in COALESCE_MODES:
        raise ValueError(f"coalesce must be 'keep', 'replace' or 'debounce', got {show(mode)}")
    chosen: CoalesceMode = DEFAULT_COALESCE if mode is None else _mode(mode)
    wait = _seconds("coalesce_seconds", seconds)
    bound = _seconds("coalesce_max_wait_seconds", max_wait)
    if text is None:
        for name, value in (
            ("coalesce", mode),
            ("coalesce_seconds", seconds),
            ("coalesce_max_wait_seconds", max_wait),
        ):
            if value is not None:
                raise ValueError(f"{name}={show(value)} needs a coalesce_key")
        return None
    if chosen != "debounce":
        for name, value in (
            ("coalesce_seconds", seconds),
            ("coalesce_max_wait_seconds", max_wait),
        ):
            if value is not None:
                raise ValueError(
                    f"{name}={show(value)} applies only to coalesce='debounce', not {show(chosen)}"
                )
        return Coalesce(text, chosen)
    if wait is None:
        raise ValueError("coalesce='debounce' needs coalesce_seconds (a number >= 0)")
    if bound is not None and bound < wait:
        raise ValueError(
            f"coalesce_max_wait_seconds={show(max_wait)} must be at least "
            f"coalesce_seconds={show(seconds)}"
        )
    return Coalesce(text, chosen, wait, bound)


def _require_key(value: object) -> str | None:
    try:
        return require_ordering_key(value)
    except (TypeError, ValueError) as exc:
        raise type(exc)(str(exc).replace("ordering_key", "coalesce_key", 1)) from None


def _mode(value: object) -> CoalesceMode:
    if value == "replace":
        return "replace"
    return "debounce" if value == "debounce" else "keep"


def _seconds(name: str, value: object) -> float | None:
    if value is None:
        return None
    return require_number(name, value, minimum=0, maximum=MAX_COALESCE_SECONDS)


# -- the writes ---------------------------------------------------------------------

WAITING_ROW: Final = Replanned(
    "SELECT id, created_at, coalesce_since, ordering_key FROM dispatch_outbox "
    f"WHERE coalesce_key = ? AND {COALESCE_WAITING_TERM}"
)
"""The key's waiting row, if any: a probe of the unique index (its term
verbatim)."""

SUPERSEDE: Final = (
    f"UPDATE dispatch_outbox SET status = '{Status.SUPERSEDED}', updated_at = ? "
    f"WHERE id = ? AND coalesce_key = ? AND {COALESCE_WAITING_TERM}"
)
"""The waiting row (time, id, key) superseded, guarded on its still
waiting: a claim that took it first leaves it alone."""


@dataclasses.dataclass(frozen=True)
class Placed:
    """Where a coalescing enqueue's new row goes, once its key's waiting
    row was dealt with."""

    since: float
    """Its ``coalesce_since``."""
    due: float
    """Its due time (``next_attempt_at`` unless it waits behind its key)."""
    not_before: float | None
    """A debounced row's due time, kept through a wait behind its key."""
    superseded: str | None = None
    """The waiting row it replaces, now ``superseded``."""


def place(conn: Conn, new: NewDispatch, rule: Coalesce, now: float) -> Placed | str:
    """Deal with ``rule.key``'s waiting row for the enqueue of ``new`` at
    ``now`` (the caller holds the key's lock): under ``keep``, its id (the
    enqueue writes nothing); else where the new row goes, the waiting row
    superseded first in the same transaction, its transition naming
    ``new.id``. A waiting row a claim took meanwhile is left alone."""
    row = conn.query_one(WAITING_ROW, (rule.key,))
    since = now
    superseded: str | None = None
    if row is not None:
        if rule.mode == "keep":
            return _text(row["id"])
        old = _text(row["id"])
        lock_keys(conn, [row["ordering_key"]])  # held already when it is the new row's key
        if conn.execute(SUPERSEDE, (now, old, rule.key)):
            superseded = old
            first = row["coalesce_since"]
            since = float(row["created_at"] if first is None else first)
            record(conn, [_supersede(old, new, now)])
            # Its key's next row, if it waited behind it, goes now.
            promote(conn, [row["ordering_key"]], now)
    if rule.mode != "debounce":
        return Placed(since, now, None, superseded)
    assert rule.seconds is not None
    due = now + rule.seconds
    if rule.max_wait is not None:
        due = min(due, since + rule.max_wait)
    return Placed(since, due, due, superseded)


def _text(value: object) -> str:
    # A caller's own sqlite3 connection may return text as bytes.
    return value.decode() if isinstance(value, bytes) else str(value)


# -- a group commit's coalescing enqueues, together -----------------------------------


def grouped(new: NewDispatch) -> bool:
    """Whether ``new`` may go with other coalescing enqueues of a group
    commit (:func:`~.inserts.insert_coalesced`): a coalesce key and nothing
    else to look up or order (no dedup key, provenance or ordering key)."""
    return (
        new.coalesce is not None
        and new.dedup_key is None
        and new.session_id is None
        and new.schedule_run_id is None
        and new.ordering_key is None
    )


def waiting_rows(conn: Conn, keys: Sequence[str]) -> dict[str, Row]:
    """The waiting row of each of ``keys`` that has one, by key: one
    statement (the caller holds the keys' locks)."""
    arrays = conn.dialect.arrays
    if arrays is not None:
        where = arrays.any_of("coalesce_key")
        params: tuple[Any, ...] = (list(keys),)
    else:
        where = f"coalesce_key IN ({', '.join('?' * len(keys))})"
        params = tuple(keys)
    rows = conn.query(
        Replanned(
            "SELECT id, coalesce_key, created_at, coalesce_since, ordering_key "
            f"FROM dispatch_outbox WHERE {where} AND {COALESCE_WAITING_TERM}"
        ),
        params,
    )
    return {_text(row["coalesce_key"]): row for row in rows}


@dataclasses.dataclass
class GroupPlan:
    """What a group of coalescing enqueues writes, in their order."""

    results: list[tuple[str, Outcome]] = dataclasses.field(default_factory=list)
    """Each item's id and outcome."""
    rows: list[tuple[NewDispatch, float, Placed, Status]] = dataclasses.field(default_factory=list)
    """The rows to insert: a row a later item of the group supersedes is
    inserted ``superseded``, so a key never has two waiting rows."""
    stored: dict[str, tuple[NewDispatch, float]] = dataclasses.field(default_factory=dict)
    """Rows waiting before the group, by id: what supersedes each, when."""
    superseded: list[tuple[str, NewDispatch, float]] = dataclasses.field(default_factory=list)
    """Every supersede (old id, new row, time), in the group's order."""


def plan_group(
    items: Sequence[tuple[NewDispatch, float]],
    waiting: Mapping[str, Row],
    done: Collection[str] = (),
) -> GroupPlan:
    """The group's writes, item after item as if each were enqueued alone
    in this order, given each key's ``waiting`` row; those ``done`` are
    superseded and recorded already (by their key's first item)."""
    plan = GroupPlan()
    current: dict[str, tuple[str, float, bool]] = {
        key: (
            _text(row["id"]),
            float(row["created_at"] if row["coalesce_since"] is None else row["coalesce_since"]),
            True,
        )
        for key, row in waiting.items()
    }
    index: dict[str, int] = {}  # a row of the group: its place in plan.rows
    for new, now in items:
        rule = new.coalesce
        assert rule is not None
        found = current.get(rule.key)
        if found is not None and rule.mode == "keep":
            plan.results.append((found[0], KEPT))
            continue
        since = now if found is None else found[1]
        due = now
        not_before = None
        if rule.mode == "debounce":
            assert rule.seconds is not None
            due = now + rule.seconds
            if rule.max_wait is not None:
                due = min(due, since + rule.max_wait)
            not_before = due
        superseded = None
        if found is not None:
            old, _, stored = found
            superseded = old
            if old not in done:
                plan.superseded.append((old, new, now))
            if stored:
                if old not in done:
                    plan.stored[old] = (new, now)
            else:
                before, at, placed, _ = plan.rows[index[old]]
                plan.rows[index[old]] = (before, at, placed, Status.SUPERSEDED)
        index[new.id] = len(plan.rows)
        plan.rows.append((new, now, Placed(since, due, not_before, superseded), Status.PENDING))
        current[rule.key] = (new.id, since, False)
        plan.results.append((new.id, INSERTED if superseded is None else REPLACED))
    return plan


def supersede_stored(conn: Conn, stored: Mapping[str, tuple[NewDispatch, float]]) -> set[str]:
    """Supersede the rows that waited before the group (each at its
    successor's time), guarded on their still waiting; the ids that were."""
    ids = list(stored)
    cases = " ".join("WHEN ? THEN ?" for _ in ids)
    rows = conn.query(
        f"UPDATE dispatch_outbox SET status = '{Status.SUPERSEDED}', "
        f"updated_at = CASE id {cases} END "
        f"WHERE id IN ({', '.join('?' * len(ids))}) AND {COALESCE_WAITING_TERM} RETURNING id",
        (*(value for old in ids for value in (old, stored[old][1])), *ids),
    )
    return {_text(row["id"]) for row in rows}


def _supersede(old: str, new: NewDispatch, now: float) -> Change:
    return Change(
        old,
        Status.PENDING,
        Status.SUPERSEDED,
        Reason.COALESCED,
        f"superseded by {new.id}",
        new.source,
        new.actor,
        now,
        {"superseded_by": new.id, **(new.coalesce.as_metadata() if new.coalesce else {})},
    )


def supersede_changes(plan: GroupPlan) -> list[Change]:
    """The transitions of the group's supersedes, in its order."""
    return [_supersede(old, new, now) for old, new, now in plan.superseded]


_STILL_WAITING: Final = (
    f"d.status = '{Status.PENDING}' AND d.attempt = 0 AND d.updated_at = d.created_at"
)
"""A row ``d`` found by its key's waiting-row probe still waits."""


def supersede_first(
    conn: Conn, arrays: ArrayForms, firsts: Sequence[tuple[str, NewDispatch, float]]
) -> dict[str, Row]:
    """Where statements take arrays (PostgreSQL): the waiting row of each
    key superseded by its first item of the group ``(key, new row, time)``
    -- when that item replaces -- and each one's transition written, in one
    statement, without reading first. The rows superseded, by key."""
    changes = [_supersede("", new, now) for _, new, now in firsts]
    rows = transition_rows(changes)  # the edge checked, as every transition's
    found = conn.query(
        Replanned(
            arrays.record_supersede(
                COALESCE_WAITING_TERM, _STILL_WAITING, Status.SUPERSEDED, Reason.COALESCED
            )
        ),
        (
            [key for key, _, _ in firsts],
            [new.id for _, new, _ in firsts],
            [float(now) for _, _, now in firsts],
            [change.summary for change in changes],
            [row[9] for row in rows],
            [str(change.source) for change in changes],
            [change.actor for change in changes],
            rows[0][0],
        ),
    )
    return {_text(row["coalesce_key"]): row for row in found}
