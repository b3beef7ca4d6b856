"""The statements of destination admission (:mod:`.destinations`): the
state rows that restrict a claim, the attempts running per destination,
the state rows made, locked and advanced, and the quick one-statement
decision of a rate-only destination (:func:`advance_if_room`), held starts
included (:mod:`.pins`)."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any, Final

from ...destinations.state import COLUMNS, TABLE, State
from ...lifecycle import DUE_SQL, Status
from ...store.dialect import ArrayForms, Dialect
from ...store.schema import DESTINATION_HOLDS_TABLE as HOLDS
from . import gcra


def restricts(row: str, now: str) -> str:
    # A state row that may restrict a claim now: a stored state other than
    # active, a throttle ahead, a rate with starts spent.
    return (
        f"{row}state <> '{State.ACTIVE}' OR {row}throttled_until > ? OR {row}rate_tat > {now} "
        f"OR {row}rate_held > 0"
    )


@functools.cache
def restricting(clock: str) -> str:
    # Where the store has a clock of its own, one row at least, with its
    # time (the claim's rate clock): the claim's first statement reads it.
    if not clock:
        return f"SELECT {COLUMNS} FROM {TABLE} WHERE {restricts('', '?')}"
    columns = ", ".join(f"d.{column.strip()}" for column in COLUMNS.split(","))
    return (
        f"SELECT c.now, {columns} FROM (SELECT {clock} AS now) AS c "
        f"LEFT JOIN {TABLE} d ON {restricts('d.', 'c.now')}"
    )


@functools.cache
def running(indexed_by: str, arrays: ArrayForms | None, count: int) -> str:
    # Attempts running per destination: the delivering rows whose lease has
    # not ended, a range of the due index (as many rows as run).
    names = "" if count == 0 else f" AND {among(arrays, 'deliver_to', count)}"
    return (
        f"SELECT deliver_to, COUNT(*) AS n FROM dispatch_outbox{indexed_by} WHERE {DUE_SQL} "
        f"AND status = '{Status.DELIVERING}' AND next_attempt_at > ?{names} GROUP BY deliver_to"
    )


def among(arrays: ArrayForms | None, column: str, count: int) -> str:
    if arrays is not None:
        return arrays.any_of(column)
    return f"{column} IN ({', '.join('?' * count)})"


def values(arrays: ArrayForms | None, names: Sequence[str]) -> tuple[Any, ...]:
    return (list(names),) if arrays is not None else tuple(names)


@functools.cache
def ensure(arrays: ArrayForms | None, count: int) -> str:
    source = (
        arrays.rows(("text",)) if arrays is not None else "VALUES " + ", ".join(["(?)"] * count)
    )
    return f"INSERT INTO {TABLE} (name) {source} ON CONFLICT (name) DO NOTHING"


@functools.cache
def lock(dialect: Dialect, count: int) -> str:
    # SKIP LOCKED: a state row another claim holds is passed over, not
    # waited for (see DestinationAdmission.admit).
    return (
        f"SELECT {COLUMNS} FROM {TABLE} WHERE {among(dialect.arrays, 'name', count)} "
        f"ORDER BY name{dialect.lock_clause}"
    )


@functools.cache
def lock_one(dialect: Dialect) -> str:
    # Waiting (no SKIP LOCKED): see DestinationAdmission._probe_row.
    return f"SELECT {COLUMNS} FROM {TABLE} WHERE name = ?{dialect.row_lock}"


PROBE_WAIT: Final = "trio_dispatch_probe_wait"
WAIT_SETTING: Final = (
    "SELECT current_setting('lock_timeout') AS was, set_config('lock_timeout', ?, true) AS now"
)
RESTORE_SETTING: Final = "SELECT set_config('lock_timeout', ?, true) AS now"

ADVANCE: Final = f"UPDATE {TABLE} SET rate_tat = ?, updated_at = ? WHERE name = ?"
HOLD: Final = f"UPDATE {TABLE} SET rate_held = rate_held + ?, updated_at = ? WHERE name = ?"
PROBE: Final = (
    f"UPDATE {TABLE} SET state = '{State.HALF_OPEN}', state_until = NULL, probe_id = ?, "
    "probe_until = ?, updated_at = ? WHERE name = ?"
)
START: Final = "(CASE WHEN rate_tat IS NULL OR rate_tat < ? THEN ? ELSE rate_tat END)"
"""``max(rate_tat, now)`` (parameters: ``now`` twice), portable."""
PLAINLY_ACTIVE: Final = (
    f"state = '{State.ACTIVE}' AND (throttled_until IS NULL OR throttled_until <= ?)"
)


def records_holds(dialect: Dialect) -> bool:
    """Whether :func:`advance_if_room` records held starts on the holder's
    rows itself (where ``WITH`` may write and rows lock: PostgreSQL)."""
    return dialect.arrays is not None and bool(dialect.lock_clause)


@functools.cache
def advance_if_room(dialect: Dialect, count: int, held: bool = False) -> str:
    """The quick decision of rate-only destinations, in one statement where
    the lock, the read and the write take three: for each of ``count``
    destinations (``destination``, candidate starts ``n``, the rate's
    interval ``step``, its ``burst``), if its state row is plainly active,
    admit starts by the rate at the rate's clock (``now``) and advance
    ``rate_tat`` by them -- the arithmetic of :mod:`.gcra`, ``max(tat,
    now) + starts * step`` while that less ``now`` is at most ``burst *
    step``. Where rows lock (PostgreSQL) it locks the rows in name order,
    passing over those another claim holds, admits as many of ``n`` as the
    rate allows (at least one) and answers ``name, admitted``; elsewhere
    (SQLite: one writer, the bounds read in this very transaction) it
    admits all ``n`` or none and answers ``name``. Parameters: the
    destinations' columns (arrays, or ``count`` rows of four), then
    ``now, now, at, now`` where rows lock, else ``now, now, at, at, now,
    now, now`` (``at, at, now, now, now`` with ``held``). Starts held by
    workers (``rate_held``) count as spent; with ``held`` the starts
    admitted are held too (:mod:`.pins`): they move ``rate_held``, not
    ``rate_tat``; where rows lock, the same statement records them on the
    holder's rows (two more arrays, its totals resolved and begun, and the
    holder and the lease end before the last ``at``)."""
    arrays = dialect.arrays
    pinned = held and records_holds(dialect)
    types = ("text", "int8", "float8", "float8", *(("int8", "int8") if pinned else ()))
    portable = "VALUES " + ", ".join(["(?, ?, ?, ?)"] * count)
    source = arrays.rows(types) if arrays is not None else portable
    extra = ", resolved, started" if pinned else ""
    wanted = f"WITH w(destination, n, step, burst{extra}) AS ({source})"
    moved = "rate_held = rate_held + admitted" if held else "rate_tat = start + admitted * step"
    if dialect.lock_clause:
        record = (
            f", holding AS (INSERT INTO {HOLDS} (name, holder, held, resolved, started, until_at) "
            "SELECT held, ?, admitted, resolved, started, ? FROM room JOIN w "
            "ON destination = held WHERE admitted >= 1 ON CONFLICT (name, holder) DO UPDATE "
            f"SET held = {HOLDS}.held + excluded.held, "
            f"until_at = GREATEST({HOLDS}.until_at, excluded.until_at)) "
            if pinned
            else ""
        )
        return (
            f"{wanted}, held AS (SELECT name AS held, {START} AS start, rate_held AS pins "
            f"FROM {TABLE} WHERE name IN (SELECT destination FROM w) AND {PLAINLY_ACTIVE} "
            f"ORDER BY name{dialect.lock_clause}), "
            "room AS (SELECT held, start, step, LEAST(n, FLOOR(burst - (start - ?) / step "
            f"+ {gcra.SLACK}) - pins) AS admitted FROM held JOIN w ON destination = held)"
            f"{record or ' '}"
            f"UPDATE {TABLE} SET {moved}, updated_at = ? FROM room "
            "WHERE name = held AND admitted >= 1 RETURNING name, admitted"
        )
    per = "(SELECT {} FROM w WHERE destination = name)"
    advance = (
        f"rate_held = rate_held + {per.format('n')}"
        if held
        else f"rate_tat = {START} + {per.format('n * step')}"
    )
    return (
        f"{wanted} UPDATE {TABLE} SET {advance}, "
        f"updated_at = ? WHERE name IN (SELECT destination FROM w) AND {PLAINLY_ACTIVE} "
        f"AND {START} - ? + {per.format('(n + rate_held) * step')} "
        f"<= {per.format(f'(burst + {gcra.SLACK}) * step')} RETURNING name"
    )
