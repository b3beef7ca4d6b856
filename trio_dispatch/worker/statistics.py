"""A frozen snapshot of what a worker has done (trio's ``statistics()`` style)."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class WorkerStatistics:
    """What :meth:`DispatchWorker.statistics` returns: totals since the
    worker was made, and its state at the moment of the call."""

    attempted: int
    """Due rows scanned (docs/usage.md: what ``attempted`` counts)."""
    delivered: int
    """Successful transport calls whose end was recorded."""
    dead_letter: int
    """Rows this worker dead-lettered."""
    expired: int
    """Rows this worker expired."""
    retried: int
    """Failed attempts scheduled for a retry."""
    in_flight: int
    """Deliveries running now."""
    concurrency: int
    """Delivery slots."""
    scans: int
    """Scans (claim transactions) that completed."""
    scan_errors: int
    """Scans that failed (a held lock, a store error); the next tick retries."""
    lease_recoveries: int
    """Claims of rows whose previous claimant's lease had run out."""
    last_scan_at: float | None
    """Wall-clock time of the last completed scan, or None."""
    running: bool
    """Whether :meth:`DispatchWorker.run` is running."""
    held_ahead: int = 0
    """Rows claimed ahead of the slots, not yet started (``delivering``
    under this worker's leases; trio_dispatch.worker.finisher)."""
    held_starts: int = 0
    """Claims of rated destinations whose starts the store counts as spent
    until this worker records that they began (docs/destinations.md)."""

    @property
    def counts(self) -> dict[str, int]:
        """The five counters of ``deliver_due_dispatches``."""
        return {
            "attempted": self.attempted,
            "delivered": self.delivered,
            "dead_letter": self.dead_letter,
            "expired": self.expired,
            "retried": self.retried,
        }


@dataclasses.dataclass
class ScanTally:
    """A worker's claims so far (a scan's, or a finish's that refills the
    slots): how many completed and failed, how many of their rows were
    recovered from a lease that ran out, and when the last one completed."""

    scans: int = 0
    scan_errors: int = 0
    lease_recoveries: int = 0
    last_scan_at: float | None = None

    def scanned(
        self, totals: dict[str, int], counts: dict[str, int], recovered: int, at: float
    ) -> None:
        """A claim completed at ``at``: add what it did besides claiming
        (rows seen, expired, spent: ``counts``) to the worker's ``totals``,
        and its ``recovered`` rows to the lease recoveries."""
        for key in ("attempted", "expired", "dead_letter"):
            totals[key] += counts[key]
        self.lease_recoveries += recovered
        self.scans += 1
        self.last_scan_at = at
