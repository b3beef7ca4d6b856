"""The claim order, named once (SPEC B5): a claim takes due rows by
``next_attempt_at``, then ``created_at``, oldest first. Every statement
that reads rows for a claim orders, bounds and compares them through
:data:`CLAIM_ORDER`, and the rows a scan merges in Python are sorted by
its :attr:`~ClaimOrder.key`, so SQL and Python cannot disagree.

Two indexes serve it, each with the order as its trailing columns: the due
index (``status`` first: one ordered range read per live status) and the
destination index (``deliver_to`` first: one range per destination). A
statement that orders by it reads an index in order and stops at its
``LIMIT``; nothing is sorted, whatever the table holds.
"""

from __future__ import annotations

import dataclasses
import math
import operator
from collections.abc import Callable, Mapping
from typing import Any, Final

from ...store.schema import DESTINATION_INDEX, DUE_INDEX


@dataclasses.dataclass(frozen=True)
class ClaimOrder:
    """An order of due rows: ``columns``, each ascending, and the indexes
    that serve it (``(name, leading column)``: the order follows that
    column in each)."""

    columns: tuple[str, ...]
    indexes: tuple[tuple[str, str], ...]
    sql: str = dataclasses.field(init=False)
    """The ``ORDER BY`` list: ``next_attempt_at, created_at``."""
    up_to: str = dataclasses.field(init=False)
    """The term ``(next_attempt_at, created_at) <= (?, ?)``: the rows up to
    a point in the order. As a row value it bounds an index range, so the
    rows past the point are never read."""
    key: Callable[[Mapping[str, Any]], Any] = dataclasses.field(init=False)
    """A row's place in the order, for sorting rows in Python."""

    def __post_init__(self) -> None:
        row = f"({', '.join(self.columns)})"
        object.__setattr__(self, "sql", ", ".join(self.columns))
        object.__setattr__(self, "up_to", f"{row} <= ({', '.join('?' * len(self.columns))})")
        object.__setattr__(self, "key", operator.itemgetter(*self.columns))

    def of(self, alias: str) -> str:
        """The columns of the order on ``alias``, comma-separated."""
        return ", ".join(f"{alias}.{column}" for column in self.columns)

    def place(self, row: Mapping[str, Any]) -> tuple[Any, ...]:
        """``row``'s place in the order, as a tuple (the parameters of
        :attr:`up_to`)."""
        return tuple(row[column] for column in self.columns)

    def after_due(self, now: float) -> tuple[float, ...]:
        """The point past every row due at ``now`` (the parameters of
        :attr:`up_to`): its due time, then past any value of the others."""
        return (now, *[math.inf] * (len(self.columns) - 1))


CLAIM_ORDER: Final = ClaimOrder(
    ("next_attempt_at", "created_at"),
    ((DUE_INDEX, "status"), (DESTINATION_INDEX, "deliver_to")),
)
"""The order every claim takes due rows in (SPEC B5)."""
