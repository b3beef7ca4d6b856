"""Tracing's pure parts (docs/tracing.md): the trace context read back from
an envelope's head, and a failed attempt's ``error.type``."""

from __future__ import annotations

import json
from typing import Any

import pytest

from trio_dispatch.outbox.enqueue import prepare
from trio_dispatch.signal import dispatch_envelope_json
from trio_dispatch.tracing import creation_context, error_type
from trio_dispatch.transports import TransportResult

PARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
STATE = "congo=t61rcWkgMzE,rojo=00f067aa0ba902b7"


def envelope(metadata: dict[str, Any] | None, body: str = "{}") -> str:
    return dispatch_envelope_json(
        dispatch_id="0" * 32,
        kind="order.shipped",
        deliver_to="billing",
        ack_token=None,
        body_json=body,
        metadata=metadata,
    )


@pytest.mark.parametrize(
    "metadata, expected",
    [
        ({"traceparent": PARENT}, (PARENT, None)),
        ({"traceparent": PARENT, "tracestate": STATE}, (PARENT, STATE)),
        (
            {"traceparent": PARENT, "tracestate": STATE, "schedule": "nightly", "manual": True},
            (PARENT, STATE),
        ),
        (None, None),
        ({"schedule": "nightly"}, None),
    ],
)
def test_the_trace_context_is_read_from_the_envelope_head(
    metadata: dict[str, Any] | None, expected: tuple[str, str | None] | None
) -> None:
    payload = envelope(metadata)
    assert creation_context(payload) == expected
    parsed = json.loads(payload)["metadata"]  # what a full parse says
    if expected is not None:
        assert (parsed["traceparent"], parsed.get("tracestate")) == expected


def test_a_body_or_schedule_name_quoting_a_traceparent_is_not_read() -> None:
    quoted = f'"lion_class": "trio_dispatch.signal.DispatchSignal", "traceparent": "{PARENT}"'
    body = json.dumps({"note": quoted, "traceparent": PARENT})
    assert creation_context(envelope(None, body)) is None
    assert creation_context(envelope({"schedule": quoted}, body)) is None


def test_the_stored_envelope_of_an_enqueue_carries_the_context_it_was_given() -> None:
    new = prepare(
        {"kind": "k", "deliver_to": "d", "body": {"traceparent": "no"}},
        metadata={"traceparent": PARENT, "tracestate": STATE},
    )
    assert creation_context(new.payload) == (PARENT, STATE)
    assert json.loads(new.payload)["body"] == {"traceparent": "no"}


def test_a_payload_of_another_shape_is_parsed() -> None:
    foreign = json.dumps({"metadata": {"tracestate": STATE, "traceparent": PARENT}, "body": {}})
    assert creation_context(foreign) == (PARENT, STATE)
    assert creation_context("not json") is None
    assert creation_context("[1, 2]") is None
    assert creation_context(json.dumps({"metadata": {"traceparent": 7}})) is None


@pytest.mark.parametrize(
    "result, expected",
    [
        (TransportResult.failure("HTTP 503: busy", retry_after=5), "503"),
        (TransportResult.failure("HTTP 410: unsubscribed", gone=True), "410"),
        (TransportResult.failure("timeout after 10s"), "timeout"),
        (TransportResult.failure("timeout: transport still running 10s into a lease"), "timeout"),
        (TransportResult.failure("exit 3"), "exit 3"),
        (TransportResult.failure("argv too large", permanent=True), "permanent"),
        (TransportResult.not_sent("EMFILE"), "not_sent"),
        (TransportResult.failure("ValueError: bad"), "_OTHER"),
    ],
)
def test_a_failed_attempt_has_a_low_cardinality_error_type(
    result: TransportResult, expected: str
) -> None:
    assert error_type(result) == expected


def test_importing_the_package_imports_no_opentelemetry() -> None:
    import subprocess
    import sys

    script = (
        "import sys, trio_dispatch, trio_dispatch.sync, trio_dispatch.tracing as t\n"
        "from trio_dispatch import worker\n"
        "print(t.ACTIVE, sorted(m for m in sys.modules if m.startswith('opentelemetry')))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=True
    )
    assert done.stdout.split() == ["True", "[]"]  # installed here, imported on first span only
