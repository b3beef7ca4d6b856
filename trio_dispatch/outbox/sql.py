"""The outbox's SQL, as named statements built from the lifecycle
vocabulary. Engines share it: ``?`` placeholders and the subset of SQL that
SQLite and PostgreSQL both speak (``RETURNING``, ``ON CONFLICT ... DO
NOTHING``, ``UPDATE ... FROM (VALUES ...)``); an engine only translates
placeholders. Where an engine says a bulk statement in one fixed text
(arrays, a writing ``WITH``), its
:class:`~trio_dispatch.store.dialect.ArrayForms` spells it around the
portable pieces here, built once per engine (the functions taking
``arrays``). The claim's reads are :mod:`.claim.statements`. Status
literals come from :mod:`trio_dispatch.lifecycle`, never from user input;
every user value is a bound parameter.
"""

from __future__ import annotations

import functools
from typing import Final

from ..lifecycle import DUE_SQL, FAILURES_SQL, FINISHED_SQL, ORDERED_SQL, WAITING_AT, Status
from ..priority import HEAD_START, earliest_due
from ..store.dialect import ArrayForms, Typed
from ..store.schema import EXPIRY_TERM

COLUMNS: Final = (
    "id, kind, deliver_to, payload, dedup_key, status, attempt, max_attempts, "
    "next_attempt_at, ack_required, ack_token, session_id, schedule_run_id, "
    "last_error, created_at, expires_at, updated_at, ordering_key"
)
"""Every column of ``dispatch_outbox``, in table order."""

# A new keyed row comes last in its key (:mod:`.ordering`: commit order), so
# it waits behind any live row of its key: the probe is a range of the
# ordering index.
_DUE_OR_WAITING: Final = (
    "CASE WHEN CAST(? AS TEXT) IS NULL THEN ? WHEN EXISTS (SELECT 1 FROM dispatch_outbox k "
    f"WHERE k.ordering_key = ? AND k.ordering_key IS NOT NULL AND k.{ORDERED_SQL} "
    f"AND k.{DUE_SQL} AND k.id <> ?) THEN {WAITING_AT!r} ELSE ? END"
)
# Its place in the key: one past the highest of the key's rows that still
# count for its order, read under the key's lock (the ordering index's last
# entry for the key).
_KEY_SEQ: Final = (
    "CASE WHEN CAST(? AS TEXT) IS NULL THEN 0 ELSE COALESCE((SELECT k.key_seq "
    "FROM dispatch_outbox k WHERE k.ordering_key = ? AND k.ordering_key IS NOT NULL "
    f"AND k.{ORDERED_SQL} ORDER BY k.key_seq DESC LIMIT 1), 0) + 1 END"
)

INSERT_DISPATCH: Final = (
    f"INSERT INTO dispatch_outbox ({COLUMNS}, key_seq, priority, head_start, coalesce_key, "
    "coalesce_since, not_before) "
    f"VALUES (?, ?, ?, ?, ?, '{Status.PENDING}', 0, ?, {_DUE_OR_WAITING}, ?, ?, ?, ?, NULL, "
    f"?, ?, ?, ?, {_KEY_SEQ}, ?, {HEAD_START}, ?, ?, ?) "
    "ON CONFLICT (dedup_key) WHERE dedup_key IS NOT NULL DO NOTHING"
)
"""A new pending row (id, kind, deliver_to, payload, dedup_key, max_attempts,
then for ``next_attempt_at`` the ordering key, the due time, the key, the
id and the due time again, then ack_required, ack_token, session_id, schedule_run_id,
created_at, expires_at, updated_at, ordering_key, for ``key_seq`` the
key twice, then the priority, for ``head_start`` the priority twice, then
the coalesce key, ``coalesce_since`` and ``not_before``): due at its due
time (now, unless a debounce says later), or -- keyed and behind a live row of its key -- waiting
(:data:`WAITING_AT`), last in its key; its head start the priority times
the store's step (:mod:`trio_dispatch.priority`). A dedup key already
committed inserts nothing (the partial unique index is the final
authority)."""

INSERT_DISPATCH_AS: Final = INSERT_DISPATCH.replace(f"'{Status.PENDING}', 0,", "?, 0,", 1)
""":data:`INSERT_DISPATCH` with the status as a parameter (after
``max_attempts``): a coalescing batch inserts each row its own later
items supersede as ``superseded`` at once (:mod:`.coalesce`), so a key
never has two waiting rows, not even inside the batch's transaction."""
assert INSERT_DISPATCH_AS != INSERT_DISPATCH

INSERT_TRANSITION: Final = (
    "INSERT INTO status_transitions (entity_type, entity_id, previous_status, status, "
    "reason_code, reason_summary, source, actor, evidence_refs, metadata, created_at) "
    "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)"
)


@functools.cache
def insert_dispatch_recorded(arrays: ArrayForms) -> str:
    """:data:`INSERT_DISPATCH`, its :data:`INSERT_TRANSITION` row and the
    enqueue notice in one statement, one round trip. Parameters: the
    row's, then the transition's without its ``entity_id``. Returns the new
    id, or no row when the dedup key is taken."""
    return arrays.record_insert(INSERT_DISPATCH)


@functools.cache
def insert_dispatch_as_recorded(arrays: ArrayForms) -> str:
    """:data:`INSERT_DISPATCH_AS`, its transition row and the enqueue
    notice in one statement (as :func:`insert_dispatch_recorded`)."""
    return arrays.record_insert(INSERT_DISPATCH_AS)


SELECT_BY_DEDUP_KEY: Final = "SELECT id FROM dispatch_outbox WHERE dedup_key = ?"
SELECT_FOR_REMOVAL: Final = (
    "SELECT id, status, attempt, kind, ordering_key, next_attempt_at FROM dispatch_outbox "
    "WHERE id = ?"
)
SELECT_TRANSITIONS: Final = (
    "SELECT * FROM status_transitions WHERE entity_type = ? AND entity_id = ? ORDER BY id"
)
SESSION_EXISTS: Final = "SELECT 1 AS found FROM sessions WHERE id = ?"
SCHEDULE_RUN_EXISTS: Final = "SELECT 1 AS found FROM schedule_runs WHERE id = ?"
PRUNE_SCHEDULE_RUNS: Final = """
    DELETE FROM schedule_runs WHERE id IN (
        SELECT r.id FROM schedule_runs r
        WHERE r.schedule IS NOT NULL
          AND NOT EXISTS (SELECT 1 FROM dispatch_outbox d WHERE d.schedule_run_id = r.id)
          AND r.created_at
              < (SELECT MAX(n.created_at) FROM schedule_runs n WHERE n.schedule = r.schedule)
        LIMIT ?
    )
"""
"""A schedule's runs no dispatch refers to, its newest excepted (docs/schedules.md)."""


READ_COLUMNS: Final = (
    f"{COLUMNS}, throttles, priority, cancel_requested_at, cancel_request, coalesce_key, "
    "coalesce_since, not_before"
)
"""What reads show of a row: every column of :data:`COLUMNS`, the
throttled attempts (docs/destinations.md), the priority, a running attempt's
cancel, when one was asked for and by whom, and its coalescing: key, when
its chain began, a debounce's due time (docs/controls.md)."""


def list_newest(where: str) -> str:
    """Rows newest first under ``where`` (``""`` or ``"WHERE ... "`` of
    ``?`` terms), at most ``?`` of them."""
    return (
        f"SELECT {READ_COLUMNS} FROM dispatch_outbox {where}ORDER BY created_at DESC, id DESC "
        "LIMIT ?"
    )


SELECT_BY_ID: Final = f"SELECT {READ_COLUMNS} FROM dispatch_outbox WHERE id = ?"
# Ids that start with a prefix: a range on the primary key (ids are
# lowercase hex, so every id starting with p sorts between p and p + "g").
IDS_IN_RANGE: Final = "SELECT id FROM dispatch_outbox WHERE id >= ? AND id < ? ORDER BY id LIMIT ?"
HISTORY_IDS_IN_RANGE: Final = (
    "SELECT DISTINCT entity_id AS id FROM status_transitions "
    "WHERE entity_type = ? AND entity_id >= ? AND entity_id < ? ORDER BY entity_id LIMIT ?"
)


def last_reasons(count: int) -> str:
    """The newest transition's reason code of ``count`` dispatches (each
    a probe of the (entity_type, entity_id, id) index)."""
    marks = ", ".join("?" * count)
    return (
        "SELECT t.entity_id AS id, t.reason_code FROM status_transitions t "
        f"WHERE t.entity_type = ? AND t.entity_id IN ({marks}) AND t.id = ("
        "SELECT MAX(u.id) FROM status_transitions u "
        "WHERE u.entity_type = t.entity_type AND u.entity_id = t.entity_id)"
    )


def _claim(where_key: str) -> str:
    return (
        f"UPDATE dispatch_outbox SET status = '{Status.DELIVERING}', attempt = attempt + 1, "
        f"next_attempt_at = ?, updated_at = ? WHERE {where_key} AND status = ? "
        "RETURNING id, kind, deliver_to, payload, attempt, max_attempts, ack_required, "
        "ack_token, ordering_key, throttles"
    )


def claim_rows(row_key: str, count: int) -> str:
    """Claim ``count`` rows selected earlier in the same write transaction
    (addressed by ``row_key``) from one previous status: the next attempt,
    leased until the first parameter."""
    return _claim(f"{row_key} IN ({', '.join('?' * count)})")


@functools.cache
def claim_rows_recorded(arrays: ArrayForms) -> Typed:
    """:func:`claim_rows` with the ids as one array, and each claim's
    transition row, in one statement (the row built by the server from the
    row it updated: the client sends no history). Parameters: the lease
    end, the time, the ids, the previous status, then the entity type, the
    previous status, the reason code, the summary's prefix, the source, the
    actor, the lease end as text and the time."""
    return Typed(arrays.record_claim(_claim(arrays.any_of("id"))))


EXPIRE: Final = (
    f"UPDATE dispatch_outbox SET status = '{Status.EXPIRED}', updated_at = ? "
    "WHERE id = ? AND status = ? AND attempt = ? AND next_attempt_at <= ?"
)
"""A due row past its deadline, guarded on the (status, attempt) it was read
with."""

# -- the expiry sweep ---------------------------------------------------------------

# A row the sweep may expire: past its deadline and pending (due, waiting
# behind its key's head, or in a backoff), or delivering with its lease
# ended (as a claim would find it). A delivering row whose lease runs is
# left to its attempt's end.
_OVERDUE: Final = f"(status = '{Status.PENDING}' OR next_attempt_at <= ?)"


@functools.cache
def overdue(row_key: str, index_hint: str, lock_clause: str) -> str:
    """Up to ``?`` rows past their deadline at the first parameter (the
    second: the same time, for the lease), earliest deadline first, from the
    expiry index (its term verbatim; ``index_hint`` names it where the
    planner must be told), locked where rows lock (``lock_clause``: a row
    another transaction holds is passed over)."""
    return (
        f"SELECT id, {row_key} AS row_key, status, attempt, expires_at, ordering_key "
        f"FROM dispatch_outbox{index_hint} WHERE {EXPIRY_TERM} AND expires_at <= ? "
        f"AND {_OVERDUE} ORDER BY expires_at LIMIT ?{lock_clause}"
    )


@functools.cache
def next_expiry(index_hint: str) -> str:
    """The earliest deadline of a row the sweep may expire once it has
    passed (see :func:`overdue`; the parameter is the time a lease must
    have ended by): one seek of the expiry index, past the few delivering
    rows whose lease still runs."""
    return (
        f"SELECT expires_at FROM dispatch_outbox{index_hint} WHERE {EXPIRY_TERM} "
        f"AND {_OVERDUE} ORDER BY expires_at LIMIT 1"
    )


def _expire_rows(where_key: str) -> str:
    return (
        f"UPDATE dispatch_outbox SET status = '{Status.EXPIRED}', updated_at = ? "
        f"WHERE {where_key} AND status = ? AND expires_at <= ? AND {_OVERDUE} "
        "RETURNING id"
    )


def expire_rows(row_key: str, count: int) -> str:
    """Expire ``count`` rows that :func:`overdue` selected and locked
    earlier in the same write transaction (addressed by ``row_key``), all
    of one previous status; the guard restates the selection. Parameters:
    the time, the row keys, the previous status, the time twice. Returns
    the ids of the rows it changed."""
    return _expire_rows(f"{row_key} IN ({', '.join('?' * count)})")


@functools.cache
def expire_rows_many(arrays: ArrayForms) -> Typed:
    """:func:`expire_rows` with the ids as one array."""
    return Typed(_expire_rows(arrays.any_of("id")))


SPEND: Final = (
    f"UPDATE dispatch_outbox SET status = '{Status.DEAD_LETTER}', updated_at = ?, "
    "last_error = COALESCE(last_error, ?) "
    f"WHERE id = ? AND status = '{Status.DELIVERING}' AND attempt = ? AND next_attempt_at <= ?"
)
"""A delivering row whose lease ran out during its last allowed attempt."""

# Every write that ends an attempt is fenced on the claim: its attempt and
# its lease (`next_attempt_at` as the claim set it). The attempt alone is not
# unique once an operator retry resets it to 0; the lease time is.
FENCE: Final = f"id = ? AND status = '{Status.DELIVERING}' AND attempt = ? AND next_attempt_at = ?"
# ... and on no cancel having been asked for the attempt (docs/controls.md): an end
# that finds the mark writes nothing, and the finish then settles the
# cancel in the same transaction (cancelled, or the success that came first).
UNMARKED: Final = "cancel_requested_at IS NULL"


_FINISH_COLUMNS: Final = ("id", "attempt", "lease", "status", "next_at", "now", "err")
_FINISH_TYPES: Final = ("text", "int8", "float8", "text", "float8", "float8", "text")
_FINISH: Final = (
    "UPDATE dispatch_outbox SET status = f.status, next_attempt_at = f.next_at, "
    "updated_at = f.now, last_error = COALESCE(f.err, dispatch_outbox.last_error) "
    "FROM f WHERE dispatch_outbox.id = f.id "
    f"AND dispatch_outbox.status = '{Status.DELIVERING}' "
    "AND dispatch_outbox.attempt = f.attempt AND dispatch_outbox.next_attempt_at = f.lease "
    f"AND dispatch_outbox.{UNMARKED} RETURNING dispatch_outbox.id AS id"
)
"""The end of many attempts, read from a row source ``f`` of
:data:`_FINISH_COLUMNS`, each fenced on its claim (and on no cancel asked
for it); returns the ids whose end applied."""


def _finish(source: str) -> str:
    return f"WITH f({', '.join(_FINISH_COLUMNS)}) AS ({source}) {_FINISH}"


def finish_attempts(count: int) -> str:
    """End ``count`` attempts at once, each fenced on its claim; returns the
    ids whose end applied."""
    return _finish("VALUES " + ", ".join(["(?, ?, ?, ?, ?, ?, ?)"] * count))


@functools.cache
def finish_attempts_arrays(arrays: ArrayForms) -> Typed:
    """:func:`finish_attempts` with one array per column."""
    return Typed(_finish(arrays.rows(_FINISH_TYPES)))


@functools.cache
def finish_attempts_recorded(arrays: ArrayForms) -> Typed:
    """The finish of many attempts (one array per column, ids distinct)
    and the transition row of each end that applied, in one statement.
    Parameters: the seven arrays of :func:`finish_attempts_arrays`, then
    the reason codes, summaries and metadata (JSON text) of the transition
    rows, then the entity type, the source and the actor."""
    return Typed(arrays.record_finish(_FINISH_COLUMNS, _FINISH_TYPES, _FINISH))


RELEASE: Final = (
    "UPDATE dispatch_outbox SET status = ?, next_attempt_at = ?, updated_at = ? "
    f"WHERE {FENCE} AND {UNMARKED}"
)

GIVE_BACK: Final = (
    f"UPDATE dispatch_outbox SET status = '{Status.PENDING}', attempt = attempt - 1, "
    f"next_attempt_at = ?, updated_at = ?, last_error = ? WHERE {FENCE} AND {UNMARKED}"
)
"""Release an attempt that was never made (a local resource error): due at
once, and the claim's attempt taken back."""


# -- cancels (docs/controls.md) ----------------------------------------------------

MARK_CANCEL: Final = (
    "UPDATE dispatch_outbox SET cancel_requested_at = COALESCE(cancel_requested_at, ?), "
    "cancel_request = COALESCE(cancel_request, ?) "
    f"WHERE {FENCE}"
)
"""Mark the running attempt (fenced on the claim it was read with) as
cancelled by an operator: the first request's time and author stay."""

_MARKED: Final = (
    "SELECT id, attempt, next_attempt_at, cancel_requested_at FROM dispatch_outbox "
    f"WHERE {{ids}} AND status = '{Status.DELIVERING}' AND cancel_requested_at IS NOT NULL"
)


def marked_attempts(count: int) -> str:
    """Which of ``count`` rows (by id) are delivering with a cancel asked
    for: each row's attempt and lease, to match a claim."""
    return _MARKED.format(ids=f"id IN ({', '.join('?' * count)})")


@functools.cache
def marked_attempts_many(arrays: ArrayForms) -> Typed:
    """:func:`marked_attempts` with the ids as one array."""
    return Typed(_MARKED.format(ids=arrays.any_of("id")))


CANCEL_REQUEST: Final = (
    f"SELECT cancel_requested_at, cancel_request FROM dispatch_outbox WHERE {FENCE}"
)
"""The cancel asked for a running attempt (NULLs: none), fenced on its claim."""

CANCEL_ATTEMPT: Final = (
    f"UPDATE dispatch_outbox SET status = '{Status.CANCELLED}', updated_at = ? WHERE {FENCE}"
)
"""A running attempt's end as ``cancelled``, fenced on its claim."""

UNMARK: Final = (
    f"UPDATE dispatch_outbox SET cancel_requested_at = NULL, cancel_request = NULL WHERE {FENCE}"
)
"""Take a cancel back from an attempt that had succeeded first (too late)."""


def count_throttles(count: int) -> str:
    """Add one to the throttled attempts of ``count`` rows (by id) whose
    throttled end this same transaction just applied (so no fence is
    needed: the finish's own guard chose them)."""
    return (
        "UPDATE dispatch_outbox SET throttles = throttles + 1 "
        f"WHERE id IN ({', '.join('?' * count)})"
    )


@functools.cache
def count_throttles_many(arrays: ArrayForms) -> Typed:
    """:func:`count_throttles` with the ids as one array."""
    return Typed(
        f"UPDATE dispatch_outbox SET throttles = throttles + 1 WHERE {arrays.any_of('id')}"
    )


def set_status(assignments: str = "") -> str:
    """Move a row from the status it was read with (an operator's or a
    consumer's compare-and-set); ``assignments`` are extra ``, col = ?``."""
    return (
        f"UPDATE dispatch_outbox SET status = ?, updated_at = ?{assignments} "
        "WHERE id = ? AND status = ?"
    )


DELETE: Final = (
    "DELETE FROM dispatch_outbox WHERE id = ? AND status = ? AND attempt = ? "
    f"AND (status <> '{Status.DELIVERING}' OR next_attempt_at <= ?)"
)
"""Remove a row still as it was read (id, status, attempt); a delivering
row only once its lease (``next_attempt_at``) has ended by the last
parameter's time: one claimed again meanwhile has a running attempt."""

AGE: Final = "COALESCE(updated_at, created_at)"


def finished_older_than(status: Status, *, count: bool = False) -> str:
    """Finished rows of one status last changed at or before a cutoff; with
    ``count``, how many. The verbatim index term keeps it on the
    finished-age index."""
    what = "COUNT(*) AS n" if count else "id, status, attempt, kind, ordering_key"
    limit = "" if count else " LIMIT ?"
    return (
        f"SELECT {what} FROM dispatch_outbox WHERE {FINISHED_SQL} "
        f"AND status = '{status}' AND {AGE} <= ?{limit}"
    )


COUNT_BY_STATUS: Final = "SELECT status, COUNT(*) AS n FROM dispatch_outbox GROUP BY status"


@functools.cache
def oldest_due_pending(waiting: str, main: str = "", held: str = "") -> str:
    """When the pending row due soonest falls due (column ``due``; NULL:
    none), among the rows the SQL term ``waiting`` (rows waiting for their
    ordering key) leaves: the oldest due row's due time when that is not
    after now. Bounded reads of the due index (``main``: its hint) and the
    held-back one (``held``) whatever the table holds
    (:func:`~trio_dispatch.priority.earliest_due`); no parameters. The rows
    it steps over are the few promoted rows right behind blocked heads (a
    marked row ranks past every due row)."""
    return earliest_due(f"status = '{Status.PENDING}'", main, held, f" AND NOT {waiting}")


DEAD_LETTERS_SINCE: Final = (
    f"SELECT COUNT(*) AS n FROM dispatch_outbox WHERE {FINISHED_SQL} "
    f"AND status = '{Status.DEAD_LETTER}' AND {AGE} >= ?"
)


def undo_enqueue(count: int) -> tuple[str, str]:
    """Delete ``count`` just-enqueued dispatches (by id) and their
    transitions: the undo of a failed enqueue in a caller's transaction
    where no savepoint is at hand."""
    marks = ", ".join("?" * count)
    return (
        f"DELETE FROM status_transitions WHERE entity_id IN ({marks})",
        f"DELETE FROM dispatch_outbox WHERE id IN ({marks})",
    )


def count_capped(status: Status) -> str:
    """How many rows have ``status``, counted up to the ``?`` cap through
    the partial index that holds that status, so the cost follows the cap,
    never the table (metrics and the dashboard read it at every scrape)."""
    index_term = DUE_SQL if status in (Status.PENDING, Status.DELIVERING) else FINISHED_SQL
    return (
        "SELECT COUNT(*) AS n FROM (SELECT 1 FROM dispatch_outbox "
        f"WHERE {index_term} AND status = '{status}' LIMIT ?) AS capped"
    )


DEAD_LETTERS_SINCE_CAPPED: Final = (
    "SELECT COUNT(*) AS n FROM (SELECT 1 FROM dispatch_outbox "
    f"WHERE {FINISHED_SQL} AND status = '{Status.DEAD_LETTER}' AND {AGE} >= ? LIMIT ?) AS capped"
)
""":data:`DEAD_LETTERS_SINCE`, counted up to a cap."""


def list_page(where: str) -> str:
    """Rows newest first under ``where`` (``?`` terms, may be empty) and
    strictly before the ``(created_at, id)`` of the two parameters that
    follow, at most ``?`` of them: keyset paging, so a deep page costs what
    the first one does."""
    # The first term bounds the index range (a seek); the second breaks ties.
    older = "created_at <= ? AND (created_at < ? OR id < ?)"
    clause = f"WHERE {where} AND {older} " if where else f"WHERE {older} "
    return (
        f"SELECT {READ_COLUMNS} FROM dispatch_outbox {clause}ORDER BY created_at DESC, id DESC "
        "LIMIT ?"
    )


RECENT_KINDS: Final = (
    "SELECT kind, COUNT(*) AS n FROM (SELECT kind FROM dispatch_outbox "
    "ORDER BY created_at DESC LIMIT ?) AS recent GROUP BY kind ORDER BY n DESC, kind LIMIT ?"
)
"""The most frequent kinds among the newest ``?`` rows (the created-at
index, read backwards: bounded by the first limit)."""

RECENT_FAILURES: Final = (
    "SELECT t.id AS transition_id, t.entity_id AS id, t.status, t.reason_code, "
    "t.reason_summary, t.created_at, d.deliver_to FROM ("
    "SELECT id, entity_id, status, reason_code, reason_summary, created_at "
    f"FROM status_transitions WHERE {FAILURES_SQL} ORDER BY id DESC LIMIT ?) AS t "
    "LEFT JOIN dispatch_outbox d ON d.id = t.entity_id ORDER BY t.id DESC"
)
"""The newest ``?`` failed attempts (retried or dead-lettered), newest
first, with the dispatch's ``deliver_to`` (None once purged): the failures
index read backwards, then one primary-key probe per row, so the cost
follows the limit, not the history."""
