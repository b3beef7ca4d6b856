"""The schema's versions: each one's DDL, for every engine, in order
(:data:`MIGRATIONS`); :mod:`.schema` applies them.

Version 1 is the original outbox table exactly (every column, default, CHECK and
both partial indexes), the ``status_transitions`` history, and minimal
``sessions`` / ``schedule_runs`` tables for the provenance foreign keys. Every
statement is idempotent (``IF NOT EXISTS``), so a database created by an
earlier implementation of the same design is adopted without touching its
rows. Version 2 appends ``created_at`` to the original partial due index, so
the claim order comes from the index alone (the index still serves every
query the original two-column one does). Version 3 adds a partial index of the
history's failed attempts (the dashboard's recent failures). Version 4
adds a partial index of the due rows by destination, so a claim that
leaves out destinations at their cap finds the others' rows without
reading the capped ones. Version 5 adds the ``ordering_key`` column and
its two partial indexes (docs/ordering.md); version 6 the index of blocked
keys' heads. Version 7 gives ``schedule_runs`` its job (docs/schedules.md): the
tick columns, their unique index, and the ``dispatch_schedules`` state table.
Version 8 orders a key's rows by commit order: the ``key_seq`` column, and
the ordering index on (ordering_key, key_seq, id) in place of (ordering_key,
id). Version 9 gives the schedules' state table its record of which
definition of each schedule is in force (its fingerprint, the ones it
replaced, when it was last confirmed). Version 10 adds the destinations'
shared state and its audit (docs/destinations.md) and each row's count of
throttled attempts. Version 11 admits the statuses ``superseded`` and
``cancelled`` (docs/controls.md): the status CHECK widened in place and the
finished-age index rebuilt over every finished status. Version 12 adds a
partial index of the live rows that have an ``expires_at``, by deadline:
the worker's expiry sweep reads the rows past theirs, whichever
destination or key holds them back, and nothing else. Version 13 lets an
operator's cancel mark a running attempt (docs/controls.md): when it was
asked for and by whom, read by the worker that runs the attempt and by the
fenced finish that ends it. Version 14 orders
the claim by priority (docs/controls.md): each row's ``priority`` and
``head_start``, the store-wide settings that hold the step a head start is
made of, the due and destination indexes keyed by the claim rank
(``next_attempt_at - head_start``) in place of ``next_attempt_at``, and the
two small indexes of held-back rows. Version 15 coalesces enqueues
(docs/controls.md): each row's ``coalesce_key``, when its chain of superseded rows
began (``coalesce_since``) and the earliest a debounced row may go
(``not_before``), with a partial unique index of the key over the rows
still waiting and never claimed, so one key has at most one such row
whoever writes it.

The status lists in the DDL come from :mod:`trio_dispatch.lifecycle`; the
statements are written once, in SQLite's spelling, and the connection's
:class:`~.dialect.Dialect` says how its engine spells the few things that
differ.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Final, TypeAlias

from ..lifecycle import (
    BLOCKING_SQL,
    DUE_SQL,
    FAILURES_SQL,
    FINISHED_SQL,
    ORDERED_SQL,
    STATUS_CHECK_SQL,
    Status,
)
from ..priority import (
    CLAIM_RANK,
    DEFAULT_PRIORITY_STEP_SECONDS,
    HELD_BACK_SQL,
    MAX_PRIORITY,
    MIN_PRIORITY,
    SETTINGS_TABLE,
    STEP_SETTING,
)
from .base import Conn

Step: TypeAlias = "str | Callable[[Conn], None]"
"""One step of a migration: a statement in SQLite's spelling, or a function
for a change each engine makes its own way (through its dialect)."""
FINISHED_STATUSES_SQL: Final = FINISHED_SQL
"""A query that wants the finished-age index must repeat this term verbatim."""

_V1: Final = (
    """
    CREATE TABLE IF NOT EXISTS sessions (
        id TEXT PRIMARY KEY,
        created_at FLOAT
    )
    """,
    """
    CREATE TABLE IF NOT EXISTS schedule_runs (
        id TEXT PRIMARY KEY,
        created_at FLOAT
    )
    """,
    f"""
    CREATE TABLE IF NOT EXISTS dispatch_outbox (
        id               TEXT PRIMARY KEY,
        kind             TEXT NOT NULL,
        deliver_to       TEXT NOT NULL,
        payload          JSON NOT NULL,
        dedup_key        TEXT NULL,
        status           TEXT NOT NULL DEFAULT '{Status.PENDING}'
                         CHECK ({STATUS_CHECK_SQL}),
        attempt          INTEGER NOT NULL DEFAULT 0,
        max_attempts     INTEGER NOT NULL DEFAULT 8,
        next_attempt_at  FLOAT NOT NULL,
        ack_required     INTEGER NOT NULL DEFAULT 0,
        ack_token        TEXT NULL,
        session_id       TEXT NULL REFERENCES sessions(id),
        schedule_run_id  TEXT NULL REFERENCES schedule_runs(id),
        last_error       TEXT NULL,
        created_at       FLOAT NOT NULL,
        expires_at       FLOAT NULL,
        updated_at       FLOAT NULL
    )
    """,
    """
    CREATE UNIQUE INDEX IF NOT EXISTS ux_dispatch_outbox_dedup_key
        ON dispatch_outbox (dedup_key) WHERE dedup_key IS NOT NULL
    """,
    f"""
    CREATE INDEX IF NOT EXISTS ix_dispatch_outbox_status_next_attempt
        ON dispatch_outbox (status, next_attempt_at)
        WHERE {DUE_SQL}
    """,
    # Retention (prune) and stats select finished rows of one status by age.
    # Partial: live rows (the hot path) never pay for it.
    f"""
    CREATE INDEX IF NOT EXISTS ix_dispatch_outbox_finished_age
        ON dispatch_outbox (status, COALESCE(updated_at, created_at))
        WHERE {FINISHED_SQL}
    """,
    """
    CREATE INDEX IF NOT EXISTS ix_dispatch_outbox_created
        ON dispatch_outbox (created_at)
    """,
    """
    CREATE TABLE IF NOT EXISTS status_transitions (
        id               INTEGER PRIMARY KEY,
        entity_type      TEXT NOT NULL,
        entity_id        TEXT NOT NULL,
        previous_status  TEXT NULL,
        status           TEXT NOT NULL,
        reason_code      TEXT NOT NULL,
        reason_summary   TEXT NOT NULL DEFAULT '',
        source           TEXT NOT NULL,
        actor            TEXT NOT NULL,
        evidence_refs    JSON NOT NULL DEFAULT '[]',
        metadata         JSON NOT NULL DEFAULT '{}',
        created_at       FLOAT NOT NULL
    )
    """,
    """
    CREATE INDEX IF NOT EXISTS ix_status_transitions_entity
        ON status_transitions (entity_type, entity_id, id)
    """,
)

DUE_INDEX: Final = "ix_dispatch_outbox_status_next_attempt"
"""The due rows by status in claim order (version 2; keyed by the claim
rank since version 14, under its first name): every claim reads it
(:data:`~trio_dispatch.outbox.claim.order.CLAIM_ORDER`)."""

_V2: Final = (
    # The original due index, with ``created_at`` appended: the scan order
    # (``next_attempt_at, created_at``; docs/controls.md) then comes straight from
    # the index. Without it, rows sharing a due time (every row of one
    # ``enqueue_many`` does) are sorted as one block on every claim, so a
    # single claim behind a bulk enqueue of 20,000 rows cost 6 ms.
    f"DROP INDEX IF EXISTS {DUE_INDEX}",
    f"""
    CREATE INDEX {DUE_INDEX}
        ON dispatch_outbox (status, next_attempt_at, created_at)
        WHERE {DUE_SQL}
    """,
)

_V3: Final = (
    # The history's failed attempts (retried or dead-lettered), newest
    # first: the dashboard's recent failures read the newest few through
    # this partial index, however long the history and however rare the
    # failures in it. Every other transition stays out of it.
    f"""
    CREATE INDEX IF NOT EXISTS ix_status_transitions_failures
        ON status_transitions (id)
        WHERE {FAILURES_SQL}
    """,
)

DESTINATION_INDEX: Final = "ix_dispatch_outbox_destination_due"
"""The due rows by destination in claim order (version 4; keyed by the
claim rank since version 14); SQLite is told to use it by
name, since without statistics it prefers the status index."""

_V4: Final = (
    # The due rows of each destination in claim order. A scan that leaves
    # out destinations at their per-destination cap walks the due index
    # past every row of theirs: 200,000 rows of one capped destination made
    # each scan read all of them inside the write transaction (28 ms on
    # SQLite and on PostgreSQL). With this index it reads the head of each
    # destination and the few rows it claims instead.
    f"""
    CREATE INDEX IF NOT EXISTS {DESTINATION_INDEX}
        ON dispatch_outbox (deliver_to, next_attempt_at, created_at)
        WHERE {DUE_SQL}
    """,
)

ORDERING_INDEX: Final = "ix_dispatch_outbox_ordering"
ORDERING_LIVE_INDEX: Final = "ix_dispatch_outbox_ordering_live"

_V5: Final = (
    # Ordering keys (docs/ordering.md). Existing rows stay unkeyed; unkeyed
    # rows enter neither index, so they cost nothing of what keys add.
    "ALTER TABLE dispatch_outbox ADD COLUMN ordering_key TEXT NULL",
    # A key's rows in id order while they count for its order: what is
    # ahead of a row, and the first row waiting behind a head.
    f"""
    CREATE INDEX IF NOT EXISTS {ORDERING_INDEX}
        ON dispatch_outbox (ordering_key, id)
        WHERE ordering_key IS NOT NULL AND {ORDERED_SQL}
    """,
    # A key's live rows by due time: whether a live row that is not waiting
    # remains (waiting rows sort last), without reading the waiting ones.
    f"""
    CREATE INDEX IF NOT EXISTS {ORDERING_LIVE_INDEX}
        ON dispatch_outbox (ordering_key, next_attempt_at)
        WHERE ordering_key IS NOT NULL AND {DUE_SQL}
    """,
)

HEADS_INDEX: Final = "ix_dispatch_outbox_ordering_heads"

_V6: Final = (
    # Keyed rows that ended dead_letter or expired, in id order: the
    # candidates for the heads of blocked keys (docs/ordering.md), which the
    # dashboard and /metrics count at every load and scrape. Without it the
    # count walked the whole table by id: 15-34 ms at 100,000 rows (live
    # keyed rows, unkeyed dead letters or one key's waiting rows), growing
    # with the table; with it, 0.01-0.05 ms.
    f"""
    CREATE INDEX IF NOT EXISTS {HEADS_INDEX}
        ON dispatch_outbox (id)
        WHERE ordering_key IS NOT NULL AND {BLOCKING_SQL}
    """,
)

SCHEDULES_TABLE: Final = "dispatch_schedules"
SCHEDULE_TICK_INDEX: Final = "ux_schedule_runs_tick"

_V7: Final = (
    # Schedules (docs/schedules.md). A tick fires by inserting its run, unique
    # on (schedule, scheduled_for), with its dispatch in one transaction;
    # manual runs ("schedules run NAME") are not ticks and stay out of the
    # unique index. Runs a service wrote itself keep NULL in these columns.
    "ALTER TABLE schedule_runs ADD COLUMN schedule TEXT NULL",
    "ALTER TABLE schedule_runs ADD COLUMN scheduled_for FLOAT NULL",
    "ALTER TABLE schedule_runs ADD COLUMN origin TEXT NULL",
    f"""
    CREATE UNIQUE INDEX IF NOT EXISTS {SCHEDULE_TICK_INDEX}
        ON schedule_runs (schedule, scheduled_for)
        WHERE origin IN ('tick', 'backfilled')
    """,
    # Each schedule's newest run (listing, pruning).
    """
    CREATE INDEX IF NOT EXISTS ix_schedule_runs_schedule
        ON schedule_runs (schedule, created_at)
        WHERE schedule IS NOT NULL
    """,
    # Whether a dispatch still refers to a run (pruning of runs).
    """
    CREATE INDEX IF NOT EXISTS ix_dispatch_outbox_schedule_run
        ON dispatch_outbox (schedule_run_id)
        WHERE schedule_run_id IS NOT NULL
    """,
    # Each schedule's runtime state, shared by every worker: when a worker
    # first saw it (its history starts there), whether an operator paused
    # it, and the newest tick handled (fired or passed over by ``missed``).
    f"""
    CREATE TABLE IF NOT EXISTS {SCHEDULES_TABLE} (
        name           TEXT PRIMARY KEY,
        first_seen_at  FLOAT NOT NULL,
        paused         INTEGER NOT NULL DEFAULT 0,
        last_tick      FLOAT NULL,
        updated_at     FLOAT NULL
    )
    """,
)

ORDERING_SEQ_INDEX: Final = "ix_dispatch_outbox_ordering_seq"

_V8: Final = (
    # A keyed row's place in its key by commit order: key_seq, assigned by
    # the insert under the key's lock (ids come from each producer's clock,
    # which may lag another host's). Rows written before keep 0 and their id
    # order, ahead of every later row of their key.
    "ALTER TABLE dispatch_outbox ADD COLUMN key_seq BIGINT NOT NULL DEFAULT 0",
    f"DROP INDEX IF EXISTS {ORDERING_INDEX}",
    f"""
    CREATE INDEX IF NOT EXISTS {ORDERING_SEQ_INDEX}
        ON dispatch_outbox (ordering_key, key_seq, id)
        WHERE ordering_key IS NOT NULL AND {ORDERED_SQL}
    """,
)

_V9: Final = (
    # Which definition of a schedule is in force, when workers disagree (a
    # rolling deploy that changes a cron): the fingerprint of the one whose
    # ticks fire (the cursor's UPDATE requires it), the fingerprints it
    # replaced (a JSON array, newest first: a worker holding one of them
    # waits), and when a worker holding it last said so (one that goes
    # unconfirmed long enough gives way). Rows from before have none; the
    # first worker to look records its own.
    f"ALTER TABLE {SCHEDULES_TABLE} ADD COLUMN definition TEXT NULL",
    f"ALTER TABLE {SCHEDULES_TABLE} ADD COLUMN superseded TEXT NULL",
    f"ALTER TABLE {SCHEDULES_TABLE} ADD COLUMN confirmed_at FLOAT NULL",
)

DESTINATIONS_TABLE: Final = "dispatch_destinations"
DESTINATION_CHANGES_TABLE: Final = "dispatch_destination_changes"

_V10: Final = (
    # Destinations (docs/destinations.md): each one's runtime state, shared by
    # every worker (pause, throttle, the rate limit's GCRA state, the
    # breaker), one row per destination that ever had state; what each
    # column means is in trio_dispatch.destinations.state. The state
    # values are checked here as the statuses are.
    f"""
    CREATE TABLE IF NOT EXISTS {DESTINATIONS_TABLE} (
        name              TEXT PRIMARY KEY,
        state             TEXT NOT NULL DEFAULT 'active'
                          CHECK (state IN ('active', 'paused', 'open', 'half_open', 'disabled')),
        state_until       FLOAT NULL,
        reason            TEXT NULL,
        throttled_until   FLOAT NULL,
        rate_tat          FLOAT NULL,
        failures          INTEGER NOT NULL DEFAULT 0,
        first_failure_at  FLOAT NULL,
        cool_down         FLOAT NULL,
        opened_at         FLOAT NULL,
        probe_id          TEXT NULL,
        probe_until       FLOAT NULL,
        last_success_at   FLOAT NULL,
        last_failure_at   FLOAT NULL,
        updated_at        FLOAT NULL
    )
    """,
    # Every change of a destination's state: who, when, why.
    f"""
    CREATE TABLE IF NOT EXISTS {DESTINATION_CHANGES_TABLE} (
        id               INTEGER PRIMARY KEY,
        destination      TEXT NOT NULL,
        previous_state   TEXT NULL,
        state            TEXT NOT NULL,
        reason           TEXT NULL,
        source           TEXT NOT NULL,
        actor            TEXT NOT NULL,
        until_at         FLOAT NULL,
        created_at       FLOAT NOT NULL
    )
    """,
    f"""
    CREATE INDEX IF NOT EXISTS ix_dispatch_destination_changes_destination
        ON {DESTINATION_CHANGES_TABLE} (destination, id)
    """,
    # A row's throttled attempts: they keep their number (the fence) but
    # do not count toward max_attempts, up to 20 of them.
    "ALTER TABLE dispatch_outbox ADD COLUMN throttles INTEGER NOT NULL DEFAULT 0",
)

FINISHED_INDEX: Final = "ix_dispatch_outbox_finished_age"


def _admit_every_status(conn: Conn) -> None:
    conn.dialect.replace_check(conn, "dispatch_outbox", "status", STATUS_CHECK_SQL)


_V11: Final[tuple[Step, ...]] = (
    # Coalescing and cancel (docs/controls.md) end rows in two new statuses.
    # The CHECK allows more values than before, so every row already
    # there satisfies it: each engine swaps the constraint without copying
    # the table (dialect.replace_check).
    _admit_every_status,
    # Retention and stats read finished rows of each status by age; the
    # index's term lists every finished status (a query repeats it).
    f"DROP INDEX IF EXISTS {FINISHED_INDEX}",
    f"""
    CREATE INDEX IF NOT EXISTS {FINISHED_INDEX}
        ON dispatch_outbox (status, COALESCE(updated_at, created_at))
        WHERE {FINISHED_SQL}
    """,
)

EXPIRY_INDEX: Final = "ix_dispatch_outbox_expiry"
"""The live rows that have a deadline, by ``expires_at`` (version 12): the
expiry sweep (:mod:`trio_dispatch.outbox.expiry`) reads those past theirs
in deadline order. A query that wants it repeats :data:`EXPIRY_TERM`."""
EXPIRY_TERM: Final = f"expires_at IS NOT NULL AND {DUE_SQL}"
"""The index's term, verbatim in every query that reads it."""

_V12: Final[tuple[Step, ...]] = (
    # Rows held back from every claim (a paused, throttled, open or full
    # destination, a worker's cap, a key's waiting rows) are never read by
    # one, so the claim alone cannot expire them. The sweep finds those past
    # their deadline here. Partial: rows without a deadline, and finished
    # rows, never enter it, so they cost nothing of it.
    f"""
    CREATE INDEX IF NOT EXISTS {EXPIRY_INDEX}
        ON dispatch_outbox (expires_at)
        WHERE {EXPIRY_TERM}
    """,
)

_V13: Final[tuple[Step, ...]] = (
    # A delivering row an operator cancelled: the worker running its attempt
    # cuts it and records `cancelled`, unless the attempt's finish comes
    # first with a success. Set only on a delivering row; every write that
    # moves a row out of `delivering` is fenced on it (NULL) or reads it.
    "ALTER TABLE dispatch_outbox ADD COLUMN cancel_requested_at FLOAT NULL",
    # Who asked and why (JSON: actor, reason, the client's address), for
    # the transition that records the cancel.
    "ALTER TABLE dispatch_outbox ADD COLUMN cancel_request TEXT NULL",
)

HELD_BACK_INDEX: Final = "ix_dispatch_outbox_held_back"
"""The live rows of a negative priority by status, in claim order (version
14): the claim's second lane (:mod:`trio_dispatch.outbox.claim.order`)."""
HELD_BACK_DESTINATION_INDEX: Final = "ix_dispatch_outbox_held_back_destination"
"""The same rows by destination (version 14)."""

_V14: Final[tuple[Step, ...]] = (
    # Priority (docs/controls.md). Rows from before get priority 0 and no
    # head start, so their rank is their due time: nothing moves.
    "ALTER TABLE dispatch_outbox ADD COLUMN priority INTEGER NOT NULL DEFAULT 0 "
    f"CHECK (priority BETWEEN {MIN_PRIORITY} AND {MAX_PRIORITY})",
    "ALTER TABLE dispatch_outbox ADD COLUMN head_start FLOAT NOT NULL DEFAULT 0",
    # What every writer must agree on, decided by the store: the step of
    # one priority level, read by the enqueue that writes a head start.
    f"""
    CREATE TABLE IF NOT EXISTS {SETTINGS_TABLE} (
        name        TEXT PRIMARY KEY,
        value       FLOAT NOT NULL,
        updated_at  FLOAT NULL
    )
    """,
    f"INSERT INTO {SETTINGS_TABLE} (name, value) "
    f"VALUES ('{STEP_SETTING}', {DEFAULT_PRIORITY_STEP_SECONDS!r}) ON CONFLICT (name) DO NOTHING",
    # The claim order is the rank, then created_at: both indexes that serve
    # it hold the rank expression where they held next_attempt_at, so every
    # write that moves next_attempt_at moves the rank (no writer computes
    # it). next_attempt_at follows: a row read in rank order that is not due
    # yet (a head start reaching past now) is passed over on its index
    # entry, without a read of the row (7x faster among 20,000 such rows on
    # SQLite), and when the earliest row falls due is read from the index
    # alone. The names stay, so a hint written for them still holds.
    f"DROP INDEX IF EXISTS {DUE_INDEX}",
    f"""
    CREATE INDEX {DUE_INDEX}
        ON dispatch_outbox (status, ({CLAIM_RANK}), created_at, next_attempt_at)
        WHERE {DUE_SQL}
    """,
    f"DROP INDEX IF EXISTS {DESTINATION_INDEX}",
    f"""
    CREATE INDEX {DESTINATION_INDEX}
        ON dispatch_outbox (deliver_to, ({CLAIM_RANK}), created_at, next_attempt_at)
        WHERE {DUE_SQL}
    """,
    # Rows of a negative priority: one due now but still within its hold
    # ranks after every row the due index's range up to now holds, and the
    # claim reads it here, where rows of priority 0 and above (the common
    # rows, due later or not) never enter.
    f"""
    CREATE INDEX IF NOT EXISTS {HELD_BACK_INDEX}
        ON dispatch_outbox (status, ({CLAIM_RANK}), created_at, next_attempt_at)
        WHERE {HELD_BACK_SQL}
    """,
    f"""
    CREATE INDEX IF NOT EXISTS {HELD_BACK_DESTINATION_INDEX}
        ON dispatch_outbox (deliver_to, ({CLAIM_RANK}), created_at, next_attempt_at)
        WHERE {HELD_BACK_SQL}
    """,
)

COALESCE_INDEX: Final = "ux_dispatch_outbox_coalesce_waiting"
"""At most one row per coalesce key among the rows waiting and never
claimed (version 15). A query that wants it repeats
:data:`COALESCE_WAITING_TERM`."""
COALESCE_WAITING_TERM: Final = (
    f"coalesce_key IS NOT NULL AND status = '{Status.PENDING}' AND attempt = 0 "
    "AND updated_at = created_at"
)
"""A row a coalescing enqueue may keep or supersede: pending and never
touched since its insert. A claim, a retry's reset, an ack's wait: every
write that moves a row out of its first wait sets ``updated_at``, so
``attempt = 0`` alone would count a dead-lettered row an operator retried
(its attempt reset) as never claimed."""

_V15: Final[tuple[Step, ...]] = (
    # Coalescing (docs/controls.md). Rows from before have no key: the index
    # leaves them out, and nothing about them changes.
    "ALTER TABLE dispatch_outbox ADD COLUMN coalesce_key TEXT NULL",
    # created_at of the first row of a chain of superseded rows: a debounce
    # is due no later than this plus its max wait, however often replaced.
    "ALTER TABLE dispatch_outbox ADD COLUMN coalesce_since FLOAT NULL",
    # A debounced row's due time, kept apart from next_attempt_at: a keyed
    # row waits behind its key's head (next_attempt_at far away) and, made
    # due when the head leaves, still goes no earlier than this.
    "ALTER TABLE dispatch_outbox ADD COLUMN not_before FLOAT NULL",
    # The authority behind "one waiting row per key", on every engine and
    # inside a caller's own transaction: two enqueues that both found no
    # waiting row cannot both insert one.
    f"""
    CREATE UNIQUE INDEX IF NOT EXISTS {COALESCE_INDEX}
        ON dispatch_outbox (coalesce_key)
        WHERE {COALESCE_WAITING_TERM}
    """,
)

DESTINATION_HOLDS_TABLE: Final = "dispatch_destination_holds"

_V16: Final[tuple[Step, ...]] = (
    # A rate's starts claimed ahead and not yet begun (docs/destinations.md):
    # the rate counts each one as spent until its worker records that it
    # began (then at that time) or that it never will. The total per
    # destination, which every claim's admission reads under the state
    # row's lock; and each holder's (one worker) share with its lease, so
    # that a dead worker's share is charged in full once that lease ends.
    f"ALTER TABLE {DESTINATIONS_TABLE} ADD COLUMN rate_held INTEGER NOT NULL DEFAULT 0",
    f"""
    CREATE TABLE IF NOT EXISTS {DESTINATION_HOLDS_TABLE} (
        name        TEXT NOT NULL,
        holder      TEXT NOT NULL,
        held        INTEGER NOT NULL DEFAULT 0,
        resolved    INTEGER NOT NULL DEFAULT 0,
        started     INTEGER NOT NULL DEFAULT 0,
        until_at    FLOAT NOT NULL,
        PRIMARY KEY (name, holder)
    )
    """,
)

MIGRATIONS: Final[tuple[tuple[Step, ...], ...]] = (
    _V1,
    _V2,
    _V3,
    _V4,
    _V5,
    _V6,
    _V7,
    _V8,
    _V9,
    _V10,
    _V11,
    _V12,
    _V13,
    _V14,
    _V15,
    _V16,
)
"""``MIGRATIONS[n]`` takes a database from version ``n`` to ``n + 1``."""

SCHEMA_VERSION: Final = len(MIGRATIONS)


def statements(*versions: int) -> tuple[str, ...]:
    """The statements of these versions (1-based), in order: a database of
    an earlier version, as its migrations wrote it (tests build one). A
    version with an engine-specific step has no such form: ValueError."""
    found: list[str] = []
    for version in versions:
        for step in MIGRATIONS[version - 1]:
            if callable(step):
                raise ValueError(f"version {version} has a step of each engine's own")
            found.append(step)
    return tuple(found)
