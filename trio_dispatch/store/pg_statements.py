"""PostgreSQL's one-statement forms of the outbox's bulk work: parameters
as arrays (``unnest``), one ``LATERAL`` range per array element, and a
``WITH`` that writes -- a row's history and the enqueue notice in the very
statement that changes the row. One round trip and one statement text
(prepared once by the server, whatever the batch size) where the portable
forms send a ``VALUES`` row of placeholders per item.

:data:`~.dialect.POSTGRES` carries :data:`ARRAYS` (its
:attr:`~.dialect.Dialect.arrays`); the outbox builds each statement once
from its own portable pieces (the insert, the claim's UPDATE, the
finish's UPDATE, a range of an index) and never spells an array, a cast or
a notice itself. The pieces name the lifecycle's columns and statuses
(:mod:`trio_dispatch.lifecycle`), which this module knows as the schema
does; it knows nothing of how the outbox decides.

Array element types are named as PostgreSQL names them (``text``,
``int8``, ``float8``, ``json``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final

from ..lifecycle import Status

CHANNEL: Final = "trio_dispatch"
"""The PostgreSQL ``LISTEN``/``NOTIFY`` channel of enqueues."""
CANCEL_CHANNEL: Final = "trio_dispatch_cancel"
"""The channel of cancels of running attempts: each notice's payload is
the dispatch id whose attempt an operator cancelled (docs/controls.md)."""

_HISTORY: Final = (
    "INSERT INTO status_transitions (entity_type, entity_id, previous_status, status, "
    "reason_code, reason_summary, source, actor, evidence_refs, metadata, created_at)"
)


class PostgresArrays:
    """PostgreSQL's :class:`~.dialect.ArrayForms`. Every method returns the
    same text for the same arguments, so a caller may build a statement
    once and keep it."""

    __slots__ = ()

    transitions: Final = (
        f"{_HISTORY} "
        "SELECT t, e, p, s, r, m, so, a, ev, md, c FROM unnest(?::text[], ?::text[], ?::text[], "
        "?::text[], ?::text[], ?::text[], ?::text[], ?::text[], ?::json[], ?::json[], "
        "?::float8[]) WITH ORDINALITY AS u(t, e, p, s, r, m, so, a, ev, md, c, n) ORDER BY n"
    )
    """Many ``status_transitions`` rows, one array per column in table
    order (``entity_type`` ... ``metadata`` as text and JSON, ``created_at``
    as float8), inserted in array order (ids follow it)."""

    def any_of(self, column: str) -> str:
        """``column`` equals one of the texts of one array parameter: the
        many-ids form, one statement text for any number of ids."""
        return f"{column} = ANY(?::text[])"

    def rows(self, types: Sequence[str], *, numbered: bool = False) -> str:
        """A query of one row per array element, from one array parameter
        per column (of ``types``), in order; ``numbered`` adds the position
        (from 1) as the last column."""
        arrays = ", ".join(f"?::{kind}[]" for kind in types)
        return f"SELECT * FROM unnest({arrays}){' WITH ORDINALITY' if numbered else ''}"

    def each(self, alias: str, columns: Sequence[tuple[str, str]], subquery: str, name: str) -> str:
        """A ``FROM`` item: ``subquery`` (which reads ``alias.<column>``) run
        once for each element of the arrays -- one parameter per
        ``(column, type)`` -- its rows named ``name``. Each run is a range of
        an index of its own, so the cost follows the elements, not a
        merged read."""
        arrays = ", ".join(f"?::{kind}[]" for _, kind in columns)
        names = ", ".join(column for column, _ in columns)
        return f"unnest({arrays}) AS {alias}({names}) CROSS JOIN LATERAL ({subquery}) AS {name}"

    def record_insert(self, insert: str) -> str:
        """``insert`` (one row, ``ON CONFLICT ... DO NOTHING``), its
        transition row and the enqueue notice in one statement. Parameters:
        the insert's, then the transition's columns without ``entity_id``.
        Answers the new id (column ``id``), or no row when nothing was
        inserted."""
        return (
            f"WITH inserted AS ({insert} RETURNING id), "
            f"recorded AS ({_HISTORY} "
            "SELECT ?, id, ?, ?, ?, ?, ?, ?, ?, ?, ? FROM inserted RETURNING entity_id) "
            f"SELECT entity_id AS id, pg_notify('{CHANNEL}', '') AS announced FROM recorded"
        )

    def record_claim(self, claim: str) -> str:
        """``claim`` (an UPDATE to ``delivering`` that returns the rows it
        claimed, ``id``, ``attempt`` and ``max_attempts`` among them) and
        each claim's transition row, built by the server from the row it
        updated. Parameters: the claim's, then the entity type, the
        previous status, the reason code, the summary's prefix, the source,
        the actor, the lease end as text and the time. Answers the claimed
        rows."""
        return (
            f"WITH claimed AS ({claim}), "
            f"recorded AS ({_HISTORY} "
            f"SELECT ?::text, id, ?::text, '{Status.DELIVERING}', ?::text, "
            "?::text || 'attempt ' || attempt || ' of ' || max_attempts, ?::text, ?::text, '[]', "
            "('{\"attempt\": ' || attempt || ', \"lease_until\": ' || ?::text || '}')::json, "
            "?::float8 "
            "FROM claimed ORDER BY id) "
            "SELECT * FROM claimed"
        )

    def record_finish(self, columns: Sequence[str], types: Sequence[str], update: str) -> str:
        """``update`` -- the end of many attempts, reading a row source
        ``f`` of ``columns`` (``id``, ``status`` and ``now`` among them) and
        returning the ids it changed -- with the transition row of each end
        that applied, out of ``delivering``, in one statement. Parameters:
        one array per column (of ``types``), then the arrays of the
        transitions' reason codes, summaries and metadata (JSON text), then
        the entity type, the source and the actor. Answers the ids."""
        source = self.rows((*types, "text", "text", "json"), numbered=True)
        return (
            f"WITH f({', '.join(columns)}, reason, summary, meta, n) AS ({source}), "
            f"done AS ({update}), "
            f"recorded AS ({_HISTORY} "
            f"SELECT ?::text, f.id, '{Status.DELIVERING}', f.status, f.reason, f.summary, ?::text, "
            "?::text, '[]', f.meta, f.now FROM done JOIN f ON f.id = done.id ORDER BY f.n) "
            "SELECT id FROM done"
        )

    def record_supersede(self, term: str, guard: str, status: str, reason: str) -> str:
        """The rows waiting under ``term`` (a condition on their columns;
        ``guard``, the same on ``d`` without the key's) whose
        coalesce key is one of an array's, set to ``status`` at each key's
        time, with each one's transition row naming its key's successor,
        in one statement. Parameters: arrays of the keys, the successors'
        ids, the times, the summaries, the metadata (JSON), the sources and
        the actors; then the entity type. Answers the rows it changed:
        ``id``, ``coalesce_key``, ``created_at``, ``coalesce_since``,
        ``ordering_key``."""
        source = self.rows(
            ("text", "text", "float8", "text", "json", "text", "text"), numbered=True
        )
        # One probe of the key's index per key (LIMIT 1 keeps the planner
        # from joining the whole array against the index, which read every
        # waiting row: 19 ms a group of 44 among 1,000), then each row by
        # its primary key, guarded on its still waiting (``guard``: without
        # the key's term, so the planner keeps to the primary key).
        return (
            f"WITH f(key, successor, now, summary, meta, source, actor, n) AS ({source}), "
            "w AS (SELECT k.id, f.n FROM f CROSS JOIN LATERAL (SELECT o.id FROM dispatch_outbox o "
            f"WHERE o.coalesce_key = f.key AND {term} LIMIT 1) AS k), "
            f"up AS (UPDATE dispatch_outbox d SET status = '{status}', updated_at = f.now "
            f"FROM w JOIN f ON f.n = w.n WHERE d.id = w.id AND {guard} "
            "RETURNING d.id, d.coalesce_key, d.created_at, d.coalesce_since, d.ordering_key), "
            f"recorded AS ({_HISTORY} "
            f"SELECT ?::text, up.id, '{Status.PENDING}', '{status}', '{reason}', f.summary, "
            "f.source, f.actor, '[]', f.meta, f.now FROM up JOIN f ON f.key = up.coalesce_key "
            "ORDER BY f.n) "
            "SELECT * FROM up"
        )

    def record_replace(
        self, term: str, head_start: str, reason: str, enqueued: str, lock: str | None = None
    ) -> str:
        """One coalescing enqueue that replaces (or debounces) in one
        statement, found by the waiting rows' unique index itself (``ON
        CONFLICT`` on ``term``, its predicate): no waiting row, the new one
        is inserted; else that row is superseded (``updated_at`` the new
        one's time, transition ``reason``) and the new one inserted after
        it, its chain's start and due time taken from it. Both transitions
        (``enqueued``: the new row's, naming the row it replaces) and the
        enqueue notice go in the same statement. ``head_start`` spells the
        priority's head start with ``?`` for ``f.priority``. Parameters:
        id, kind, deliver_to, payload (JSON), max_attempts, ack_required,
        ack_token, now, expires_at, priority, key, debounce seconds (or
        None), max wait (or None), the enqueued summary, source, actor,
        the enqueued metadata, the superseded metadata, the entity type.
        Answers one row: ``id`` (the new row's own when nothing waited,
        else the superseded row's) and that row's ``ordering_key``; no row
        when the waiting row has an ordering key (nothing written: the
        caller supersedes it the long way, which lets its key's next row
        go). With ``lock`` (a query taking the keys' locks, its parameters
        first), the statement takes them before it looks for the waiting
        row: the index's look is no snapshot's, so it sees what the lock's
        last holder committed, and the statement may commit alone."""
        columns = (
            "id, kind, deliver_to, payload, status, attempt, max_attempts, next_attempt_at, "
            "ack_required, ack_token, created_at, expires_at, updated_at, key_seq, priority, "
            "head_start, coalesce_key, coalesce_since, not_before"
        )
        start = head_start.replace("?", "f.priority")
        values = (
            f"f.id, f.kind, f.deliver_to, f.payload, '{Status.PENDING}', 0, f.max_attempts, "
            "f.due, f.ack_required, f.ack_token, f.now, f.expires_at, f.now, 0, f.priority, "
            f"{start}, f.key, f.since, CASE WHEN f.seconds IS NULL THEN NULL ELSE f.due END"
        )
        # A debounce is due its seconds after this enqueue, and no later
        # than its chain's start plus its max wait (LEAST skips a NULL).
        due = (
            "CASE WHEN v.seconds IS NULL THEN v.now "
            "ELSE LEAST(v.now + v.seconds, {since} + v.max_wait) END"
        )
        locked = "" if lock is None else f"lk AS ({lock}), "
        return (
            f"WITH {locked}v(id, kind, deliver_to, payload, max_attempts, ack_required, "
            "ack_token, now, expires_at, priority, key, seconds, max_wait, summary, source, "
            "actor, note, meta, etype) AS (VALUES (?::text, ?::text, ?::text, ?::json, "
            "?::int4, ?::int4, ?::text, ?::float8, ?::float8, ?::int4, ?::text, ?::float8, "
            "?::float8, ?::text, ?::text, ?::text, ?::json, ?::json, ?::text)), "
            f"up AS (INSERT INTO dispatch_outbox AS d ({columns}) SELECT {values} FROM "
            f"(SELECT v.*, v.now AS since, {due.format(since='v.now')} AS due "
            f"FROM v{'' if lock is None else ' CROSS JOIN lk'}) AS f "
            f"ON CONFLICT (coalesce_key) WHERE {term} DO UPDATE SET "
            f"status = '{Status.SUPERSEDED}', updated_at = EXCLUDED.updated_at "
            "WHERE d.ordering_key IS NULL "
            "RETURNING d.id, COALESCE(d.coalesce_since, d.created_at) AS since, d.ordering_key), "
            f"fresh AS (INSERT INTO dispatch_outbox ({columns}) SELECT {values} FROM "
            f"(SELECT v.*, up.since, {due.format(since='up.since')} AS due "
            "FROM v JOIN up ON up.id <> v.id) AS f RETURNING id), "
            f"recorded AS ({_HISTORY} "
            f"SELECT v.etype, up.id, '{Status.PENDING}', '{Status.SUPERSEDED}', '{reason}', "
            "'superseded by ' || v.id, v.source, v.actor, '[]'::json, v.meta, v.now "
            "FROM v JOIN up ON up.id <> v.id "
            "UNION ALL "
            f"SELECT v.etype, v.id, NULL, '{Status.PENDING}', '{enqueued}', v.summary || "
            "CASE WHEN up.id = v.id THEN '' ELSE ', replaces ' || up.id END, v.source, v.actor, "
            "'[]'::json, v.note, v.now FROM v CROSS JOIN up) "
            f"SELECT up.id, up.ordering_key, pg_notify('{CHANNEL}', '') AS announced FROM up"
        )


ARRAYS: Final = PostgresArrays()
