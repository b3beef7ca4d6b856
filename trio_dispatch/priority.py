"""Priority (docs/controls.md): the values a row's ``priority`` may take, the
head start it gives, and the SQL every reader of the claim order shares.

A row of priority ``p`` is ordered among due rows as if it had become due
``p * step`` seconds earlier, ``step`` being the store's
``priority_step_seconds`` (default 300): its **head start**, stored with the
row when it is enqueued (``head_start``, seconds). A row is never claimed
before it is due, so a head start only reorders rows that are due; a row of
priority -10 waits at most ``20 * step`` longer than a row of priority 10
due at the same time, and nothing starves.

The claim order is :data:`CLAIM_RANK` (``next_attempt_at - head_start``),
then ``created_at``. The due indexes hold that expression, not a column of
its own: every write that moves ``next_attempt_at`` (a retry's backoff, a
throttle, a release, a lease, an operator's retry, a key's promotion, a
hand-made ``UPDATE``) moves the rank with it, and no writer has to know the
step. Only an enqueue reads the step, in its own statement
(:data:`HEAD_START`), so a library producer, a caller's own connection
(:mod:`trio_dispatch.sync`) and a worker give the same head start whatever
configuration each has: the store decides it (``dispatch_settings``; a
worker's ``dispatch.priority_step_seconds`` sets it). A row keeps its head
start for life, through retries and throttles (a row's priority never
falls back to the default).

This is a leaf: constants, checks and SQL text, no I/O.
"""

from __future__ import annotations

from typing import Final

from .lifecycle import DUE_SQL
from .values import show

MIN_PRIORITY: Final = -10
MAX_PRIORITY: Final = 10
DEFAULT_PRIORITY: Final = 0
DEFAULT_PRIORITY_STEP_SECONDS: Final = 300.0
"""The head start of one priority level, unless the store says otherwise."""
MIN_PRIORITY_STEP_SECONDS: Final = 1.0
MAX_PRIORITY_STEP_SECONDS: Final = 86400.0
"""A day: at most, a row of priority -10 waits 20 days longer than one of
priority 10 due at the same time."""

SETTINGS_TABLE: Final = "dispatch_settings"
"""Store-wide settings every writer reads from the store (name -> value)."""
STEP_SETTING: Final = "priority_step_seconds"


def claim_rank(alias: str = "") -> str:
    """A row's place in the claim order before ``created_at``: when it
    became due, moved earlier by its head start; of the row ``alias`` (empty:
    an unaliased ``dispatch_outbox``)."""
    row = f"{alias}." if alias else ""
    return f"{row}next_attempt_at - {row}head_start"


CLAIM_RANK: Final = claim_rank()
"""The claim rank of an unaliased row. The due indexes hold this
expression; a query that wants them repeats it verbatim."""

STEP_SQL: Final = (
    f"COALESCE((SELECT value FROM {SETTINGS_TABLE} WHERE name = '{STEP_SETTING}'), "
    f"{DEFAULT_PRIORITY_STEP_SECONDS!r})"
)
"""The store's step, read in the statement that needs it."""

HEAD_START: Final = f"CASE WHEN ? = 0 THEN 0 ELSE ? * {STEP_SQL} END"
"""A new row's head start from its priority (the parameter, twice): the
step is read only for a priority other than 0."""

HELD_BACK_SQL: Final = f"{DUE_SQL} AND head_start < 0"
"""The partial term of the held-back indexes: live rows of a negative
priority. A query that wants them repeats it verbatim."""

LONGEST_HOLD_SQL: Final = f"{-MIN_PRIORITY} * {STEP_SQL}"
"""The longest a due row of a negative priority is held back at the
store's step: ``10 * step``."""

EARLIEST_WINDOW: Final = 1000
"""At most this many index entries are read past the first in claim order
to find when the earliest of a range falls due (:func:`earliest_due`)."""


def require_priority(value: object, name: str = "priority") -> int:
    """An int from -10 to 10 (a bool is not one); anything else raises
    ``TypeError``/``ValueError`` naming the value."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(
            f"{name} must be an integer from {MIN_PRIORITY} to {MAX_PRIORITY}, got {show(value)}"
        )
    if not MIN_PRIORITY <= value <= MAX_PRIORITY:
        raise ValueError(
            f"{name} must be an integer from {MIN_PRIORITY} to {MAX_PRIORITY}, got {show(value)}"
        )
    return value


def require_step(name: str, value: object) -> float:
    """Seconds from 1 to 86400 (an int or a finite float, not a bool);
    anything else raises ``TypeError``/``ValueError`` naming the value."""
    allowed = f"a number of seconds from {MIN_PRIORITY_STEP_SECONDS:g} to "
    allowed += f"{MAX_PRIORITY_STEP_SECONDS:g}"
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"{name} must be {allowed}, got {show(value)}")
    if not MIN_PRIORITY_STEP_SECONDS <= value <= MAX_PRIORITY_STEP_SECONDS:  # NaN fails too
        raise ValueError(f"{name} must be {allowed}, got {show(value)}")
    return float(value)


def first_due(where: str, main: str = "", term: str = "") -> str:
    """When the first live row of a range in claim order falls due (a
    scalar subquery; NULL: none), as :func:`earliest_due` reads it first:
    one seek. No parameters but ``where``'s."""
    return (
        f"SELECT next_attempt_at FROM dispatch_outbox{main} WHERE {DUE_SQL} AND {where}{term} "
        f"ORDER BY {CLAIM_RANK}, created_at LIMIT 1"
    )


def earliest_due(where: str, main: str = "", held: str = "", term: str = "") -> str:
    """When the earliest live row of a range falls due (column ``due``; NULL:
    none), read in claim order. ``where`` selects the range (an index's
    leading column, e.g. ``status = 'pending'`` or ``deliver_to = ?``; its
    parameters are given five times), ``main`` and ``held`` name the
    indexes that hold the range (an engine's index hint, or empty), and
    ``term`` (with its ``AND``) narrows it.

    No index is ordered by due time, but a row's rank and its due time
    differ by its head start only: a row of priority 0 or more is due at or
    after its rank, so no row ranked after the first row's due time can be
    due before it, and a held-back row (priority below 0) is due at most
    :data:`LONGEST_HOLD_SQL` before its rank. So the read is the first row
    in claim order, the rows ranked before its due time, and the held-back
    rows ranked before that plus the longest hold: one seek each with every
    priority 0, a few more with head starts among the first rows. Each
    window reads at most :data:`EARLIEST_WINDOW` entries; past that the
    answer may be later than the earliest, never earlier (a caller that
    sleeps until it wakes to no due row and asks again)."""
    order = f"ORDER BY {CLAIM_RANK}, created_at"
    head = first_due(where, main, term)
    return (
        f"SELECT MIN(due) AS due FROM (SELECT ({head}) AS due "
        "UNION ALL SELECT due FROM (SELECT next_attempt_at AS due "
        f"FROM dispatch_outbox{main} WHERE {DUE_SQL} AND {where}{term} "
        # "+ 0": a column's affinity on the right would keep SQLite from
        # reading the comparison as a range of the expression index.
        f"AND {CLAIM_RANK} < ({head}) + 0 {order} LIMIT {EARLIEST_WINDOW}) AS ahead "
        "UNION ALL SELECT due FROM (SELECT next_attempt_at AS due "
        f"FROM dispatch_outbox{held} WHERE {HELD_BACK_SQL} AND {where}{term} "
        f"AND {CLAIM_RANK} < ({head}) + {LONGEST_HOLD_SQL} {order} LIMIT {EARLIEST_WINDOW}) "
        "AS held) AS candidates"
    )
