"""The worker's per-attempt report: the metrics count every attempt, and
the log line is written exactly when its level is enabled."""

from __future__ import annotations

import logging
import time
import uuid

import pytest

from trio_dispatch.attempt import TransportResult
from trio_dispatch.outbox import Claim, Outcome
from trio_dispatch.settings import WorkerSettings
from trio_dispatch.worker.metrics import OTHER, DeliveryMetrics, DestinationMetrics
from trio_dispatch.worker.report import log_outcome


class _Kept(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def _claim() -> Claim:
    return Claim("d1", "mail", "smtp", "{}", 1, 5, False, time.time() + 60)


def _report(level: int, outcome: Outcome, result: TransportResult) -> tuple[_Kept, DeliveryMetrics]:
    log = logging.getLogger(f"trio_dispatch.test.report.{uuid.uuid4().hex}")
    log.propagate = False
    log.setLevel(level)
    kept = _Kept()
    log.addHandler(kept)
    metrics = DeliveryMetrics()
    log_outcome(
        log, metrics, _claim(), outcome, time.monotonic(), result, WorkerSettings(), time.time
    )
    return kept, metrics


@pytest.mark.parametrize("level", [logging.INFO, logging.WARNING])
def test_a_delivered_attempt_is_counted_and_logged_only_at_info(level: int) -> None:
    kept, metrics = _report(level, Outcome.DELIVERED, TransportResult.success())
    [series] = [s for s in metrics.series() if s.kind == "mail"]
    assert series.outcomes == {"delivered": 1}
    assert series.count == 1
    if level == logging.INFO:
        [record] = kept.records
        assert record.levelno == logging.INFO
        assert "result=delivered" in record.getMessage()
    else:
        assert kept.records == []


def test_a_retry_is_logged_at_warning_with_its_error_and_next_attempt() -> None:
    kept, metrics = _report(logging.WARNING, Outcome.RETRY, TransportResult.failure("boom"))
    [record] = kept.records
    assert record.levelno == logging.WARNING
    message = record.getMessage()
    assert "result=retry" in message
    assert "error='boom'" in message
    assert "next_attempt=" in message
    [series] = [s for s in metrics.series() if s.kind == "mail"]
    assert series.outcomes == {"retry": 1}


def test_a_plain_success_is_one_shared_equal_result() -> None:
    assert TransportResult.success() == TransportResult(ok=True)
    assert TransportResult.success() is TransportResult.success()
    assert TransportResult.success("said").output == "said"


def test_a_throttled_attempt_is_logged_at_info_with_until_when_not_as_an_error() -> None:
    result = TransportResult.throttle("HTTP 429: slow down", retry_after=30)
    kept, metrics = _report(logging.INFO, Outcome.THROTTLED, result)
    [record] = kept.records
    assert record.levelno == logging.INFO
    message = record.getMessage()
    assert "result=throttled" in message and "next_in=30s" in message
    assert "throttled_until=" in message and "throttles=1/20" in message
    assert "answer='HTTP 429: slow down'" in message and "error=" not in message
    [series] = [s for s in metrics.series() if s.kind == "mail"]
    assert series.outcomes == {"throttled": 1}


def test_destination_labels_are_capped_with_the_configured_ones_first() -> None:
    counts = DestinationMetrics(max_destinations=2)
    counts.prefer(["billing"])
    for name in ("new-1", "billing", "new-2", OTHER, "new-1"):
        counts.throttled(name)
    counts.transition("new-2", "open")
    counts.transition("billing", "open")
    assert counts.throttled_counts() == {"billing": 1, "new-1": 2, OTHER: 2}
    assert counts.transition_counts() == {("billing", "open"): 1, (OTHER, "open"): 1}
