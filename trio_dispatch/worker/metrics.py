"""What a worker counts about its deliveries, for ``/metrics``
(docs/dashboard.md): attempts by outcome and kind, and their durations; how its
schedules' runs are named there (docs/schedules.md); its throttled attempts
and the breaker changes its finishes made, by destination
(docs/destinations.md, :class:`DestinationMetrics`); the cancels of its running attempts
(docs/controls.md#cancel, :class:`CancelCounts`).

Kinds are outside input, so the label set is bounded: at most
:data:`MAX_KINDS` kinds get a label of their own and every other kind is
counted as ``other``. The labels go first to the most frequent kinds of the
store's recent rows (:meth:`DeliveryMetrics.prefer`, when metrics are
served), then to kinds as they appear while labels remain. A kind keeps its
label; every series only ever grows, as a Prometheus counter must. Counting
costs a few dictionary updates per attempt.
"""

from __future__ import annotations

import bisect
import threading
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Final

MAX_KINDS: Final = 50
OTHER: Final = "other"
DURATION_BUCKETS: Final = (
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
)
"""Upper bounds (seconds) of the delivery-duration histogram; +Inf follows."""
SCHEDULE_OUTCOMES: Final = {"tick": "fired", "backfilled": "backfilled", "manual": "manual"}
"""A schedule run's origin (``schedule_runs.origin``) -> the ``outcome``
label of ``trio_dispatch_schedule_runs_total``: a tick on time is "fired"."""


@dataclass
class _Series:
    """One label value's counts: attempts by outcome, durations."""

    outcomes: dict[str, int] = field(default_factory=dict)
    buckets: list[int] = field(default_factory=lambda: [0] * (len(DURATION_BUCKETS) + 1))
    seconds: float = 0.0

    @property
    def total(self) -> int:
        return sum(self.outcomes.values())

    def add(self, outcome: str, seconds: float) -> None:
        self.outcomes[outcome] = self.outcomes.get(outcome, 0) + 1
        self.buckets[bisect.bisect_left(DURATION_BUCKETS, seconds)] += 1
        self.seconds += seconds

    def absorb(self, other: _Series) -> None:
        for outcome, n in other.outcomes.items():
            self.outcomes[outcome] = self.outcomes.get(outcome, 0) + n
        self.buckets = [a + b for a, b in zip(self.buckets, other.buckets, strict=True)]
        self.seconds += other.seconds


@dataclass(frozen=True)
class KindSeries:
    """What :meth:`DeliveryMetrics.series` reports for one label value."""

    kind: str
    outcomes: dict[str, int]
    buckets: tuple[int, ...]
    """Cumulative counts per bucket of :data:`DURATION_BUCKETS`, then +Inf."""
    seconds: float

    @property
    def count(self) -> int:
        return self.buckets[-1]


class DeliveryMetrics:
    """Attempts by outcome and kind, and their durations (thread-safe)."""

    def __init__(self, max_kinds: int = MAX_KINDS) -> None:
        self.max_kinds = max_kinds
        self._lock = threading.Lock()
        self._labelled: dict[str, _Series] = {}
        self._other = _Series()

    def prefer(self, kinds: Iterable[str]) -> None:
        """Give free labels to these kinds first (most frequent first)."""
        with self._lock:
            for kind in kinds:
                if len(self._labelled) >= self.max_kinds:
                    break
                if kind != OTHER:
                    self._labelled.setdefault(kind, _Series())

    def observe(self, kind: str, outcome: str, seconds: float) -> None:
        """Count one attempt of ``kind`` that ended with ``outcome``."""
        with self._lock:
            series = self._labelled.get(kind)
            if series is None:
                if len(self._labelled) >= self.max_kinds or kind == OTHER:
                    self._other.add(outcome, seconds)
                    return
                series = self._labelled[kind] = _Series()
            series.add(outcome, seconds)

    def series(self) -> list[KindSeries]:
        """Every label value with what it counted (``other`` last)."""
        with self._lock:
            snapshot = [*sorted(self._labelled.items()), (OTHER, self._other)]
            return [
                KindSeries(
                    kind, dict(series.outcomes), tuple(_cumulative(series.buckets)), series.seconds
                )
                for kind, series in snapshot
            ]


def _cumulative(counts: list[int]) -> Iterator[int]:
    total = 0
    for n in counts:
        total += n
        yield total


class CancelCounts:
    """The cancels of running attempts one worker settled
    (docs/controls.md#cancel): ``cancelled`` (the attempt, cut or not, ended its row
    ``cancelled``) and ``too_late`` (it had succeeded first, and the
    success stands). Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts = {"cancelled": 0, "too_late": 0}

    def ended(self, cancelled: bool, too_late: bool) -> None:
        """Count one attempt's end, if a cancel concerned it."""
        if cancelled or too_late:
            with self._lock:
                self._counts["cancelled" if cancelled else "too_late"] += 1

    def snapshot(self) -> dict[str, int]:
        """Each result's count so far."""
        with self._lock:
            return dict(self._counts)


MAX_DESTINATIONS: Final = 50
"""``deliver_to`` values that get a label of their own in the destinations'
counters (the rest: :data:`OTHER`), as kinds do."""


class DestinationMetrics:
    """What a worker counts about its destinations (docs/destinations.md):
    throttled attempts by ``deliver_to``, and the breaker's changes of
    state its finishes made, by ``deliver_to`` and the state it went to.
    ``deliver_to`` is outside input: at most :data:`MAX_DESTINATIONS`
    values get a label (the configured ones first, :meth:`prefer`), the
    rest count as ``other``; a value keeps its label. Thread-safe."""

    def __init__(
        self, max_destinations: int = MAX_DESTINATIONS, preferred: Iterable[str] = ()
    ) -> None:
        self.max_destinations = max_destinations
        self._lock = threading.Lock()
        self._labelled: set[str] = set()
        self._throttled: dict[str, int] = {}
        self._transitions: dict[tuple[str, str], int] = {}
        self.prefer(preferred)

    def prefer(self, names: Iterable[str]) -> None:
        """Give free labels to these destinations first."""
        with self._lock:
            for name in names:
                if len(self._labelled) >= self.max_destinations:
                    break
                if name != OTHER:
                    self._labelled.add(name)

    def _label(self, name: str) -> str:
        if name in self._labelled:
            return name
        if len(self._labelled) >= self.max_destinations or name == OTHER:
            return OTHER
        self._labelled.add(name)
        return name

    def throttled(self, name: str) -> None:
        """Count one throttled attempt to ``name`` whose end was recorded."""
        with self._lock:
            label = self._label(name)
            self._throttled[label] = self._throttled.get(label, 0) + 1

    def transition(self, name: str, to: str) -> None:
        """Count one change of ``name``'s breaker to state ``to``."""
        with self._lock:
            key = (self._label(name), to)
            self._transitions[key] = self._transitions.get(key, 0) + 1

    def ended(self, name: str, throttled: bool, transitions: Iterable[tuple[str, object]]) -> None:
        """Count a recorded attempt's end to ``name``: its throttle, and
        the breaker changes (destination, state gone to) its finish made."""
        if throttled:
            self.throttled(name)
        for destination, state in transitions:
            self.transition(destination, str(state))

    def throttled_counts(self) -> dict[str, int]:
        """Throttled attempts per label."""
        with self._lock:
            return dict(sorted(self._throttled.items()))

    def transition_counts(self) -> dict[tuple[str, str], int]:
        """Breaker changes per (label, state gone to)."""
        with self._lock:
            return dict(sorted(self._transitions.items()))
