"""Enqueue's writes: a new dispatch row and its ``dispatch.pending.enqueued``
transition, one at a time (with dedup and provenance checks) or many plain
ones in bulk. Each function is part of a unit of work, inside one
transaction; the edge check and the history rows are the state machine's
(:mod:`.machine`).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any, Final

from ..errors import StoreError
from ..lifecycle import Reason, Status
from ..priority import HEAD_START
from ..store.base import Conn, KeyOrderConflict
from ..store.dialect import ArrayForms
from ..store.schema import COALESCE_WAITING_TERM
from . import sql
from .coalesce import (
    INSERTED,
    KEPT,
    REPLACED,
    Placed,
    _supersede,
    place,
    plan_group,
    supersede_changes,
    supersede_first,
    supersede_stored,
    waiting_rows,
)
from .ordering import lock_ahead, lock_keys, promote
from .transitions import Change, EnqueueResult, NewDispatch, record, transition_rows


def _enqueued(new: NewDispatch, now: float, replaces: str | None = None) -> Change:
    return Change(
        new.id,
        None,
        Status.PENDING,
        Reason.ENQUEUED,
        f"enqueued kind={new.kind}" + ("" if replaces is None else f", replaces {replaces}"),
        new.source,
        new.actor,
        now,
        new.note,
    )


def _row(new: NewDispatch, now: float, placed: Placed | None = None) -> tuple[Any, ...]:
    due = now if placed is None else placed.due
    return (
        new.id,
        new.kind,
        new.deliver_to,
        new.payload,
        new.dedup_key,
        new.max_attempts,
        new.ordering_key,
        due,
        new.ordering_key,
        new.id,
        due,
        int(new.ack_required),
        new.ack_token,
        new.session_id,
        new.schedule_run_id,
        now,
        new.expires_at,
        now,
        new.ordering_key,
        new.ordering_key,
        new.ordering_key,
        new.priority,
        new.priority,
        new.priority,
        None if new.coalesce is None else new.coalesce.key,
        None if placed is None else placed.since,
        None if placed is None else placed.not_before,
    )


def insert_new(conn: Conn, new: NewDispatch, now: float) -> EnqueueResult:
    """Insert one dispatch and its ``dispatch.pending.enqueued`` transition,
    or -- its dedup key already committed -- return that row's id and write
    nothing. With a coalesce key, the key's waiting row is kept (nothing
    written) or superseded first, in the same transaction
    (:mod:`.coalesce`). An unknown ``session_id``/``schedule_run_id`` is a ValueError
    naming it."""
    for column, value, table, exists in (
        ("session_id", new.session_id, "sessions", sql.SESSION_EXISTS),
        ("schedule_run_id", new.schedule_run_id, "schedule_runs", sql.SCHEDULE_RUN_EXISTS),
    ):
        if value is not None and conn.query_one(exists, (value,)) is None:
            raise ValueError(f"{column} {value!r} does not exist in {table}")
    # The insert comes first: a key already committed makes it do nothing
    # (and the first row's id is read after), so the write lock -- or, on
    # PostgreSQL, the wait for a concurrent same-key transaction -- comes
    # before any read, and a read never sees a snapshot older than the
    # winner (a same-key race returns the winner's id).
    rule = new.coalesce
    lock_keys(conn, [new.ordering_key, None if rule is None else rule.lock])
    if rule is None:
        return _insert(conn, new, now, None)
    # Coalescing (docs/controls.md): a dedup hit answers first, then the
    # key's waiting row decides (keep it, or supersede it).
    if new.dedup_key is not None:
        first = conn.query_one(sql.SELECT_BY_DEDUP_KEY, (new.dedup_key,))
        if first is not None:
            return EnqueueResult(_text(first["id"]), True, KEPT)
    # On PostgreSQL a plain enqueue of the same dedup key may commit after
    # the read above: its row wins, and the supersede must not stand.
    guarded = new.dedup_key is not None and bool(conn.dialect.key_locks)
    if guarded:
        conn.execute(f"SAVEPOINT {_GUARD}")
    placed = place(conn, new, rule, now)
    if isinstance(placed, str):
        result = EnqueueResult(placed, False, KEPT)
    else:
        result = _insert(conn, new, now, placed)
        if guarded and result.dedup_hit:
            conn.execute(f"ROLLBACK TO SAVEPOINT {_GUARD}")
    if guarded:
        conn.execute(f"RELEASE SAVEPOINT {_GUARD}")
    return result


_GUARD: Final = "trio_dispatch_coalesce"


def _insert(conn: Conn, new: NewDispatch, now: float, placed: Placed | None) -> EnqueueResult:
    replaces = None if placed is None else placed.superseded
    arrays = conn.dialect.arrays
    row = _row(new, now, placed)
    if arrays is not None:  # row, history and NOTIFY in one round trip
        entity_type, _, *history = transition_rows([_enqueued(new, now, replaces)])[0]
        statement = sql.insert_dispatch_recorded(arrays)
        params = (*row, entity_type, *history)
        if new.dedup_key is None and placed is None:  # nothing can conflict: no result to read
            conn.send(statement, params)
            return EnqueueResult(new.id, False, INSERTED)
        inserted = conn.query_one(statement, params) is not None
    else:
        inserted = conn.execute(sql.INSERT_DISPATCH, row) != 0
        if inserted:
            record(conn, [_enqueued(new, now, replaces)])
            conn.announce_enqueue()
    if inserted:
        return EnqueueResult(new.id, False, INSERTED if replaces is None else REPLACED)
    winner = conn.query_one(sql.SELECT_BY_DEDUP_KEY, (new.dedup_key,))
    if winner is None:
        raise StoreError(f"dedup_key {new.dedup_key!r} conflicted but no row holds it")
    return EnqueueResult(_text(winner["id"]), True, KEPT)


def _text(value: object) -> str:
    # A caller's own sqlite3 connection may return text as bytes.
    return value.decode() if isinstance(value, bytes) else str(value)


def insert_plain(conn: Conn, items: Sequence[tuple[NewDispatch, float]]) -> list[EnqueueResult]:
    """Insert plain dispatches (see :attr:`NewDispatch.plain`), each at its
    own ``now``, with two bulk statements; coalesced, this serves every
    concurrent plain enqueue of a group commit at once. On an engine with
    data-modifying ``WITH`` it is one statement per row instead, sent in
    one pipelined round trip (the server delivers the repeated ``NOTIFY``
    of one transaction once): one unkeyed item is one statement there.
    Keyed rows go in id order, so each waits behind the live rows of its
    key that come before it."""
    results = [EnqueueResult(new.id, False) for new, _ in items]
    if any(new.ordering_key is not None for new, _ in items):
        items = sorted(items, key=lambda item: item[0].id)
        lock_keys(conn, [new.ordering_key for new, _ in items])
    arrays = conn.dialect.arrays
    if arrays is not None:
        rows = [
            (*_row(new, now), entity_type, *history)
            for (new, now), (entity_type, _, *history) in zip(
                items, transition_rows([_enqueued(new, now) for new, now in items]), strict=True
            )
        ]
        statement = sql.insert_dispatch_recorded(arrays)
        if len(rows) == 1:
            conn.execute(statement, rows[0])
        else:
            conn.executemany(statement, rows)
        return results
    conn.executemany(sql.INSERT_DISPATCH, [_row(new, now) for new, now in items])
    record(conn, [_enqueued(new, now) for new, now in items])
    conn.announce_enqueue()
    return results


def insert_all(
    conn: Conn, batch: Sequence[NewDispatch], now: float, name_items: bool = False
) -> list[EnqueueResult]:
    """Insert a batch: plain rows with two bulk statements, the others one
    by one (a key repeated within the batch resolves to its first row, in
    order). With ``name_items``, an error (an unknown session, say) names
    its item."""

    def one(index: int, new: NewDispatch) -> EnqueueResult:
        try:
            return insert_new(conn, new, now)
        except ValueError as exc:
            if not name_items:
                raise
            raise ValueError(f"item {index}: {exc}") from None

    # Every key of the batch locked at once, in the one order: the items
    # below take their keys one by one, in the batch's order.
    lock_keys(
        conn,
        [new.ordering_key for new in batch]
        + [new.coalesce.lock for new in batch if new.coalesce is not None],
    )
    plain = [new for new in batch if new.plain]
    if len(plain) < 2:
        return [one(index, new) for index, new in enumerate(batch)]
    done = {result.id: result for result in insert_plain(conn, [(new, now) for new in plain])}
    return [done[new.id] if new.id in done else one(index, new) for index, new in enumerate(batch)]


def insert_coalesced(conn: Conn, items: Sequence[tuple[NewDispatch, float]]) -> list[EnqueueResult]:
    """The coalescing enqueues of a group commit (each
    :func:`~.coalesce.grouped`), each at its own ``now``, as if enqueued one
    after the other in this order, in a few statements for the whole group:
    the keys' locks, their waiting rows, the supersede of those the group
    replaces, the new rows with their transitions, the supersedes'
    transitions. A waiting row a claim takes meanwhile is left alone (its
    key's first item is then an insert); a waiting row with an ordering key
    (its key's next row may have to be made due) sends the group one by
    one (:func:`insert_new`)."""
    locks = [new.coalesce.lock for new, _ in items if new.coalesce is not None]
    arrays = conn.dialect.arrays
    if arrays is not None and all(_mode(new) != "keep" for new, _ in items):
        return _replace_each(conn, arrays, items, lock_ahead(conn, locks))
    lock_keys(conn, locks)
    firsts: dict[str, tuple[NewDispatch, float]] = {}
    for new, now in items:
        assert new.coalesce is not None
        firsts.setdefault(new.coalesce.key, (new, now))
    if arrays is not None:
        # PostgreSQL: each key's waiting row superseded by its first item
        # when that one replaces, with its transition, in one statement
        # without a read; only the keys whose first item keeps are read.
        keeping = sorted(key for key, (new, _) in firsts.items() if _mode(new) == "keep")
        kept = waiting_rows(conn, keeping) if keeping else {}
        if any(row["ordering_key"] is not None for row in kept.values()):
            return [insert_new(conn, new, now) for new, now in items]
        replacing = [(key, new, now) for key, (new, now) in firsts.items() if _mode(new) != "keep"]
        superseded = supersede_first(conn, arrays, replacing) if replacing else {}
        moved = [row["ordering_key"] for row in superseded.values()]
        if any(key is not None for key in moved):
            # A row of an ordering key left it: its next row may go.
            lock_keys(conn, moved)
            promote(conn, moved, max(now for _, now in items))
        waiting = {**superseded, **kept}
        already = {_text(row["id"]) for row in superseded.values()}
        plan = plan_group(items, waiting, already)
    else:
        waiting = waiting_rows(conn, sorted(firsts))
        if any(row["ordering_key"] is not None for row in waiting.values()):
            return [insert_new(conn, new, now) for new, now in items]
        already = set()
        plan = plan_group(items, waiting)
    if plan.stored:
        done = supersede_stored(conn, plan.stored)
        if len(done) < len(plan.stored):  # a claim took some first: plan again without them
            gone = set(plan.stored) - done
            still = {k: r for k, r in waiting.items() if _text(r["id"]) not in gone}
            plan = plan_group(items, still, already)
    if plan.rows:
        changes = [_enqueued(new, now, placed.superseded) for new, now, placed, _ in plan.rows]
        rows = [
            (*row[:5], status, *row[5:])
            for row, status in (
                (_row(new, now, placed), status) for new, now, placed, status in plan.rows
            )
        ]
        if arrays is not None:  # row, history and NOTIFY, one statement a row, pipelined
            statement = sql.insert_dispatch_as_recorded(arrays)
            recorded = [
                (*row, entity_type, *history)
                for row, (entity_type, _, *history) in zip(
                    rows, transition_rows(changes), strict=True
                )
            ]
            if len(recorded) == 1:
                conn.execute(statement, recorded[0])
            else:
                conn.executemany(statement, recorded)
        else:
            conn.executemany(sql.INSERT_DISPATCH_AS, rows)
            record(conn, changes)
            conn.announce_enqueue()
    record(conn, supersede_changes(plan))
    return [EnqueueResult(dispatch_id, False, outcome) for dispatch_id, outcome in plan.results]


@functools.cache
def _replace_recorded(arrays: ArrayForms, lock: str | None = None) -> str:
    return arrays.record_replace(
        COALESCE_WAITING_TERM, HEAD_START, Reason.COALESCED.value, Reason.ENQUEUED.value, lock
    )


def _replace_each(
    conn: Conn,
    arrays: ArrayForms,
    items: Sequence[tuple[NewDispatch, float]],
    locks: tuple[str, Sequence[Any]] | None,
) -> list[EnqueueResult]:
    """Where statements take arrays (PostgreSQL), a group of replacing and
    debouncing enqueues: each one statement that finds its key's waiting
    row through the waiting rows' unique index, supersedes it and inserts
    the new row with both transitions
    (:meth:`~trio_dispatch.store.dialect.ArrayForms.record_replace`), in
    the group's order -- a later item of a key supersedes the row an
    earlier one inserted. No read comes first, and no plan depends on the
    table's size when it was first planned: the index finds the row. A
    waiting row a claim takes meanwhile is no longer waiting once the
    statement has its lock: the new row is then inserted beside it.

    ``locks`` (from :func:`.ordering.lock_ahead`): the statement taking the
    keys' locks, sent ahead of the group's statements in one round trip;
    one item takes them inside its own statement, which then commits by
    itself where the store sends a single statement alone. An item whose
    key's waiting row has an ordering key writes nothing there and is
    enqueued the long way (:func:`insert_new`, which lets that key's next
    row go), in a transaction."""
    params = []
    for new, now in items:
        rule = new.coalesce
        assert rule is not None
        enqueued, superseded = transition_rows([_enqueued(new, now), _supersede("", new, now)])
        debounce = rule.mode == "debounce"
        params.append(
            (
                new.id,
                new.kind,
                new.deliver_to,
                new.payload,
                new.max_attempts,
                int(new.ack_required),
                new.ack_token,
                float(now),
                new.expires_at,
                new.priority,
                rule.key,
                rule.seconds if debounce else None,
                rule.max_wait if debounce else None,
                enqueued[5],
                str(enqueued[6]),
                enqueued[7],
                enqueued[9],
                superseded[9],
                enqueued[0],
            )
        )
    if len(items) == 1 and locks is not None:
        lock, keys = locks
        found = [conn.query(_replace_recorded(arrays, lock), (*keys, *params[0]))]
    else:
        found = conn.query_each(_replace_recorded(arrays), params, first=locks)
    results = []
    for (new, now), rows in zip(items, found, strict=True):
        if rows:
            old = _text(rows[0]["id"])
            results.append(EnqueueResult(new.id, False, INSERTED if old == new.id else REPLACED))
        elif getattr(conn, "single", None) is False:
            # Its statement went alone and committed nothing: the long way
            # needs a transaction, which the group commit gives it next.
            raise KeyOrderConflict("a coalesce key's waiting row has an ordering key")
        else:
            results.append(insert_new(conn, new, now))
    return results


def _mode(new: NewDispatch) -> str:
    return "keep" if new.coalesce is None else new.coalesce.mode
