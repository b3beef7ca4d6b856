"""The claim order, named once (docs/controls.md#priority): a claim takes due rows
by their rank -- ``next_attempt_at - head_start``, the time a row became
due moved earlier by its priority's head start
(:mod:`trio_dispatch.priority`) -- then ``created_at``, first first. Every
statement that reads rows for a claim orders, bounds and compares them
through :data:`CLAIM_ORDER`, each row carries its rank (``claim_rank``),
and the rows a scan merges in Python are sorted by its
:attr:`~ClaimOrder.key`, so SQL and Python cannot disagree.

A row is never claimed before it is due, and no index is ordered both by
rank and by due time, so a claim reads the order in two **lanes**, each one
ordered range of an index, the second read only when the first falls
short:

1. :data:`ON_TIME` -- ranked up to now and due: every due row of priority 0
   or more, and every row of a negative priority that has been due for its
   whole hold. The due index (``status`` first) or the destination index
   (``deliver_to`` first), up to now. Of the rows not due it reads only
   those of a positive priority whose head start reaches now (a retry of an
   urgent row, due within ``p * step``), and passes over each on its index
   entry (the indexes hold ``next_attempt_at`` last).
2. :data:`HELD_BACK` -- due, of a negative priority, ranked after now (due
   less than ``|p| * step`` ago). Their ranks are past now, so they all come
   after lane 1: the two lanes read one after the other are the order
   itself. Two small partial indexes hold only rows of a negative priority,
   so rows of priority 0 and above that fall due later are never read for
   them; of the rows of a negative priority not due yet it passes over
   those ranked within ``10 * step`` of now (due within ``(10 - |p|) *
   step``).

With every row at priority 0 the rank is the due time, lane 1 is the read a
claim made before priorities, and lane 2 is one seek into an empty index.

A statement that orders by it reads an index in order and stops at its
``LIMIT``; nothing is sorted, whatever the table holds.
"""

from __future__ import annotations

import dataclasses
import math
import operator
from collections.abc import Callable, Mapping
from typing import Any, Final

from ...priority import CLAIM_RANK, LONGEST_HOLD_SQL, claim_rank
from ...store.schema import (
    DESTINATION_INDEX,
    DUE_INDEX,
    HELD_BACK_DESTINATION_INDEX,
    HELD_BACK_INDEX,
)

RANK_COLUMN: Final = "claim_rank"
"""The name a row read for a claim carries its rank under."""


@dataclasses.dataclass(frozen=True)
class Lane:
    """One ordered range of due rows: ``term`` (on an unaliased
    ``dispatch_outbox`` row; ``arity`` parameters, each the claim's time)
    and the index that holds it under each leading column."""

    name: str
    term: str
    arity: int
    indexes: tuple[tuple[str, str], ...]
    """``(leading column, index name)``: ``status`` and ``deliver_to``."""

    def index(self, lead: str) -> str:
        """The name of the lane's index led by ``lead``."""
        return dict(self.indexes)[lead]

    def params(self, now: float) -> tuple[float, ...]:
        """The term's parameters at ``now``."""
        return (now,) * self.arity


ON_TIME: Final = Lane(
    "on_time",
    f"{CLAIM_RANK} <= ? AND next_attempt_at <= ?",
    2,
    (("status", DUE_INDEX), ("deliver_to", DESTINATION_INDEX)),
)
"""Due rows ranked up to now."""
HELD_BACK: Final = Lane(
    "held_back",
    # head_start < 0 repeats the held-back indexes' term; the upper bound
    # (now plus the longest hold) keeps the range to rows that can be due.
    f"head_start < 0 AND {CLAIM_RANK} > ? AND {CLAIM_RANK} <= ? + {LONGEST_HOLD_SQL} "
    "AND next_attempt_at <= ?",
    3,
    (("status", HELD_BACK_INDEX), ("deliver_to", HELD_BACK_DESTINATION_INDEX)),
)
"""Due rows of a negative priority ranked after now."""


@dataclasses.dataclass(frozen=True)
class ClaimOrder:
    """An order of due rows -- ``rank`` (an expression of a row alias, empty
    for an unaliased row), then ``tie`` -- each ascending, and the lanes a
    claim reads it in."""

    rank: Callable[[str], str]
    tie: str
    lanes: tuple[Lane, ...]
    sql: str = dataclasses.field(init=False)
    """The ``ORDER BY`` list: ``next_attempt_at - head_start, created_at``."""
    selected: str = dataclasses.field(init=False)
    """The rank in a select list, named :data:`RANK_COLUMN` (a statement
    adds it to the columns its caller names, ``tie`` among them)."""
    up_to: str = dataclasses.field(init=False)
    """The term: the rows up to a point in the order (parameters:
    :meth:`place`). Its first part alone bounds an index range (SQLite
    reads no row value of an expression as one), so the rows past the
    point are never read."""
    key: Callable[[Mapping[str, Any]], Any] = dataclasses.field(init=False)
    """A row's place in the order, for sorting rows in Python."""

    def __post_init__(self) -> None:
        rank, tie = self.rank(""), self.tie
        object.__setattr__(self, "sql", f"{rank}, {tie}")
        object.__setattr__(self, "selected", f"{rank} AS {RANK_COLUMN}")
        object.__setattr__(self, "up_to", f"{rank} <= ? AND ({rank} < ? OR {tie} <= ?)")
        object.__setattr__(self, "key", operator.itemgetter(RANK_COLUMN, tie))

    @property
    def indexes(self) -> tuple[tuple[str, str], ...]:
        """The indexes that serve the order, ``(name, leading column)``, lane
        by lane."""
        return tuple((name, lead) for lane in self.lanes for lead, name in lane.indexes)

    def of(self, alias: str) -> str:
        """The order's columns of the row ``alias`` as :attr:`selected`
        names them, and its ``next_attempt_at``."""
        return f"{self.rank(alias)} AS {RANK_COLUMN}, {alias}.{self.tie}, {alias}.next_attempt_at"

    def place(self, row: Mapping[str, Any]) -> tuple[Any, ...]:
        """``row``'s place in the order, as the parameters of :attr:`up_to`."""
        rank, tie = self.key(row)
        return (rank, rank, tie)

    def after_due(self, now: float) -> tuple[float, ...]:
        """A point past every row (the parameters of :attr:`up_to`): the
        lanes bound what is due at ``now``."""
        return (math.inf, math.inf, math.inf)

    def bound(self, now: float, *tail: Any, head: tuple[Any, ...] = ()) -> tuple[Any, ...]:
        """The parameters of a statement that reads each lane in turn (see
        :func:`~.statements.in_lanes`), lane by lane: ``head`` (what its
        text puts before the lane's term), the lane's at ``now``, then
        ``tail`` (what comes after)."""
        return tuple(value for lane in self.lanes for value in (*head, *lane.params(now), *tail))


CLAIM_ORDER: Final = ClaimOrder(claim_rank, "created_at", (ON_TIME, HELD_BACK))
"""The order every claim takes due rows in (docs/controls.md#priority)."""
