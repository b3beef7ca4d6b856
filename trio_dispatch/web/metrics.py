"""``/metrics``: the Prometheus text format (docs/dashboard.md), rendered by
``prometheus_client`` from a worker's counts and bounded store reads made
at scrape time."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4, generate_latest

from ..worker.metrics import DURATION_BUCKETS, SCHEDULE_OUTCOMES

if TYPE_CHECKING:
    from ..schedules import Scheduler
    from ..worker import DispatchWorker

CONTENT_TYPE = CONTENT_TYPE_PLAIN_0_0_4


class _Families:
    """What ``generate_latest`` collects from: families built beforehand
    (the store was read asynchronously, before rendering)."""

    def __init__(self, families: Iterable[Metric]) -> None:
        self._families = list(families)

    def collect(self) -> Iterator[Metric]:
        return iter(self._families)


def families(stats: dict[str, Any], worker: DispatchWorker | None, now: float) -> list[Metric]:
    """Every metric family: the store's (``stats`` from
    :func:`~trio_dispatch.outbox.reads.bounded_stats`) and, with a worker,
    its counters."""
    out: list[Metric] = []
    dispatches = GaugeMetricFamily(
        "trio_dispatch_dispatches",
        f"Dispatches per status, counted up to {stats['cap']} each (a bounded query).",
        labels=["status"],
    )
    for status, n in stats["counts"].items():
        dispatches.add_metric([status], n)
    out.append(dispatches)
    out.append(
        GaugeMetricFamily(
            "trio_dispatch_dispatches_cap",
            "Where trio_dispatch_dispatches stops counting: at this value, the real count is "
            "this or more.",
            value=stats["cap"],
        )
    )
    oldest = stats["oldest_due_pending_age_seconds"]
    out.append(
        GaugeMetricFamily(
            "trio_dispatch_oldest_due_seconds",
            "How long the pending dispatch due the longest has been due (0 when none is "
            "due): rows waiting for their ordering key (behind a live row, or a blocked "
            "head) are left out; rows a paused, throttled or open destination holds back "
            "count (trio-dispatch destinations gives each destination's own).",
            value=0.0 if oldest is None else oldest,
        )
    )
    out.append(
        GaugeMetricFamily(
            "trio_dispatch_dead_letters_24h",
            f"Dispatches dead-lettered in the last 24 hours (up to {stats['cap']}).",
            value=stats["dead_letters_last_24h"],
        )
    )
    if "blocked_keys" in stats:
        out.append(
            GaugeMetricFamily(
                "trio_dispatch_blocked_keys",
                "Ordering keys whose head is dead_letter or expired with rows waiting behind it "
                f"(counted up to {stats['blocked_keys_cap']}; 0 under on_dead_letter: skip).",
                value=stats["blocked_keys"],
            )
        )
    if worker is None:
        return out
    deliveries = CounterMetricFamily(
        "trio_dispatch_deliveries",
        "Delivery attempts by how they ended and by kind (at most 50 kinds, the most "
        "frequent recent ones first; the rest: other).",
        labels=["outcome", "kind"],
    )
    durations = HistogramMetricFamily(
        "trio_dispatch_delivery_seconds",
        "How long delivery attempts took, from transport start to recorded outcome.",
        labels=["kind"],
    )
    for series in worker.metrics.series():
        for outcome, n in sorted(series.outcomes.items()):
            deliveries.add_metric([outcome, series.kind], n)
        bounds = [f"{bound:g}" for bound in DURATION_BUCKETS] + ["+Inf"]
        durations.add_metric(
            [series.kind],
            buckets=list(zip(bounds, series.buckets, strict=True)),
            sum_value=series.seconds,
        )
    statistics = worker.statistics()
    out += [deliveries, durations, *destination_families(worker)]
    cancels = CounterMetricFamily(
        "trio_dispatch_cancels",
        "Running attempts an operator cancelled, as this worker settled them: cancelled "
        "(the row ended cancelled) or too_late (the attempt had succeeded first).",
        labels=["result"],
    )
    for result, n in sorted(worker.cancel_counts.snapshot().items()):
        cancels.add_metric([result], n)
    out.append(cancels)
    out.append(
        GaugeMetricFamily(
            "trio_dispatch_in_flight", "Deliveries running now.", value=statistics.in_flight
        )
    )
    out.append(
        GaugeMetricFamily(
            "trio_dispatch_held_ahead",
            "Rows claimed ahead of the worker's slots, not yet started.",
            value=statistics.held_ahead,
        )
    )
    out.append(
        GaugeMetricFamily(
            "trio_dispatch_held_starts",
            "Claims of rated destinations whose starts the rate counts as spent until this "
            "worker records that they began.",
            value=statistics.held_starts,
        )
    )
    out.append(
        CounterMetricFamily(
            "trio_dispatch_scan_errors",
            "Scans for due dispatches that failed (a held lock, a store error).",
            value=statistics.scan_errors,
        )
    )
    out.append(
        CounterMetricFamily(
            "trio_dispatch_lease_recoveries",
            "Claims of dispatches whose previous claimant's lease had run out.",
            value=statistics.lease_recoveries,
        )
    )
    if statistics.last_scan_at is not None:
        out.append(
            GaugeMetricFamily(
                "trio_dispatch_last_scan_age_seconds",
                "Seconds since the worker last completed a scan.",
                value=max(0.0, now - statistics.last_scan_at),
            )
        )
    if worker.scheduler is not None:
        out += schedule_families(worker.scheduler)
    return out


def destination_families(worker: DispatchWorker) -> list[Metric]:
    """A worker's destinations (docs/destinations.md): its throttled attempts by
    ``deliver_to``, and the changes of state of the breakers its finishes
    made, by ``deliver_to`` and the state gone to (at most 50
    ``deliver_to`` labels, the configured ones first; the rest: other)."""
    counts = worker.destination_metrics
    throttled = CounterMetricFamily(
        "trio_dispatch_throttled",
        "Attempts whose destination asked to wait (429, 503 with Retry-After, Throttled, "
        "exit 75), by deliver_to (at most 50; the rest: other).",
        labels=["deliver_to"],
    )
    for name, n in counts.throttled_counts().items():
        throttled.add_metric([name], n)
    transitions = CounterMetricFamily(
        "trio_dispatch_breaker_transitions",
        "Changes of a destination's circuit breaker this worker's finishes made, by "
        "deliver_to and the state it went to (open, active, disabled).",
        labels=["deliver_to", "to"],
    )
    for (name, to), n in counts.transition_counts().items():
        transitions.add_metric([name, to], n)
    return [throttled, transitions]


def schedule_families(scheduler: Scheduler) -> list[Metric]:
    """A worker's schedules (docs/schedules.md): the runs this process fired,
    by schedule and outcome (every pair, from 0), each schedule's next
    fire time (none while it is paused, another definition is in force or
    it matches no time ahead), its failed writes (from 0), and whether
    another definition than this worker's is in force."""
    runs = CounterMetricFamily(
        "trio_dispatch_schedule_runs",
        "Schedule runs this worker fired, by schedule and outcome (fired: a tick on time; "
        "backfilled: a missed tick caught up; manual: an extra run).",
        labels=["schedule", "outcome"],
    )
    fired = dict(scheduler.fired)
    for name in sorted(scheduler.schedules):
        for origin, outcome in SCHEDULE_OUTCOMES.items():
            runs.add_metric([name, outcome], fired.get((name, origin), 0))
    next_fire = GaugeMetricFamily(
        "trio_dispatch_schedule_next_fire_timestamp_seconds",
        "When each schedule's next tick is due (Unix time); absent while it is paused.",
        labels=["schedule"],
    )
    for name, when in sorted(scheduler.next_fire.items()):
        if when is not None:
            next_fire.add_metric([name], when)
    failures = CounterMetricFamily(
        "trio_dispatch_schedule_failures",
        "Writes of a schedule's ticks this worker made that failed (the schedule was "
        "rolled back alone and waits, doubling, before it tries again).",
        labels=["schedule"],
    )
    mismatch = GaugeMetricFamily(
        "trio_dispatch_schedule_definition_mismatch",
        "1 while another definition of the schedule than this worker's is in force (this "
        "worker fires nothing for it), else 0.",
        labels=["schedule"],
    )
    for name in sorted(scheduler.schedules):
        failures.add_metric([name], scheduler.failures[name])
        mismatch.add_metric([name], 1.0 if name in scheduler.mismatched else 0.0)
    return [runs, next_fire, failures, mismatch]


def render(metric_families: Iterable[Metric]) -> bytes:
    """The Prometheus text exposition (format 0.0.4)."""
    return generate_latest(_Families(metric_families))
