"""Tracing on every engine and both anyio backends (docs/tracing.md): the
``create`` span of an enqueue and its context in the stored envelope, a
``process`` span per attempt linked to it (through a pass and through the
worker), a failed attempt's error, and the sync enqueue functions."""

from __future__ import annotations

import json
import threading
from typing import Any

import anyio
import pytest

from trio_dispatch import (
    Delivery,
    DispatchWorker,
    deliver_due_dispatches,
    enqueue_dispatch,
    enqueue_many,
    open_store,
)
from trio_dispatch import sync as outbox
from trio_dispatch.store import SQLiteStore
from trio_dispatch.transports import TransportResult

from ..conftest import RawDB
from ..helpers import statuses, wait_for
from .test_sync import connect

T0 = 1_000_000.0


def producer_attributes(kind: str, dispatch_id: str) -> dict[str, Any]:
    return {
        "messaging.system": "trio_dispatch",
        "messaging.operation.name": "create",
        "messaging.destination.name": kind,
        "messaging.message.id": dispatch_id,
    }


def traceparent(span: Any) -> str:
    context = span.get_span_context()
    return f"00-{context.trace_id:032x}-{context.span_id:016x}-{context.trace_flags:02x}"


def stored_metadata(raw: RawDB, dispatch_id: str) -> dict[str, Any]:
    metadata: dict[str, Any] = json.loads(str(raw.row(dispatch_id)["payload"]))["metadata"]
    return metadata


def by_kind(spans: Any, kind: Any) -> list[Any]:
    from opentelemetry.trace import SpanKind

    wanted = SpanKind.PRODUCER if kind == "producer" else SpanKind.CONSUMER
    return [span for span in spans.get_finished_spans() if span.kind == wanted]


@pytest.mark.anyio
async def test_an_enqueue_has_a_producer_span_whose_context_is_in_the_stored_payload(
    store: SQLiteStore, raw: RawDB, spans: Any
) -> None:
    from opentelemetry import trace

    tracer = trace.get_tracer("app", tracer_provider=_provider_of(spans))
    with tracer.start_as_current_span("request") as request:
        dispatch_id = await enqueue_dispatch(
            store, kind="order.shipped", deliver_to="billing", body={"n": 1}
        )
    [create] = by_kind(spans, "producer")
    assert create.name == "create order.shipped"
    assert dict(create.attributes) == producer_attributes("order.shipped", dispatch_id)
    assert create.parent.span_id == request.get_span_context().span_id  # the caller's span
    metadata = stored_metadata(raw, dispatch_id)
    assert metadata["traceparent"] == traceparent(create)
    assert list(metadata) == ["lion_class", "traceparent"]  # tracestate only when there is one
    assert create.status.is_ok


@pytest.mark.anyio
async def test_the_callers_tracestate_is_stored_too(
    store: SQLiteStore, raw: RawDB, spans: Any
) -> None:
    from opentelemetry import trace
    from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags, TraceState

    remote = SpanContext(
        trace_id=0x0AF7651916CD43DD8448EB211C80319C,
        span_id=0xB7AD6B7169203331,
        is_remote=True,
        trace_flags=TraceFlags(1),
        trace_state=TraceState([("rojo", "00f067aa0ba902b7")]),
    )
    with trace.use_span(NonRecordingSpan(remote)):
        dispatch_id = await enqueue_dispatch(store, kind="k", deliver_to="d", ack_required=True)
    [create] = by_kind(spans, "producer")
    metadata = stored_metadata(raw, dispatch_id)
    assert metadata["traceparent"] == traceparent(create)
    assert metadata["traceparent"].startswith("00-0af7651916cd43dd8448eb211c80319c-")
    assert metadata["tracestate"] == "rojo=00f067aa0ba902b7"


@pytest.mark.anyio
async def test_enqueue_many_gives_each_dispatch_its_own_span(
    store: SQLiteStore, raw: RawDB, spans: Any
) -> None:
    results = await enqueue_many(
        store,
        [
            {"kind": "a", "deliver_to": "d"},
            {"kind": "b", "deliver_to": "d", "dedup_key": "k"},
            {"kind": "b", "deliver_to": "d", "dedup_key": "k"},  # the second item's row
        ],
    )
    creates = by_kind(spans, "producer")
    assert [span.name for span in creates] == ["create a", "create b", "create b"]
    ids = [result.id for result in results]
    assert [span.attributes["messaging.message.id"] for span in creates] == ids
    for span, dispatch_id in zip(creates[:2], ids[:2], strict=True):
        assert stored_metadata(raw, dispatch_id)["traceparent"] == traceparent(span)
    assert raw.counts()[0] == 2


@pytest.mark.anyio
async def test_a_failed_enqueue_ends_its_span_with_an_error_and_writes_nothing(
    store: SQLiteStore, raw: RawDB, spans: Any
) -> None:
    from opentelemetry.trace import StatusCode

    with pytest.raises(ValueError, match="session_id"):
        await enqueue_dispatch(store, kind="k", deliver_to="d", session_id="f" * 32)
    with pytest.raises(ValueError, match="item 1"):
        await enqueue_many(
            store, [{"kind": "a", "deliver_to": "d"}, {"kind": "", "deliver_to": "d"}]
        )
    creates = by_kind(spans, "producer")
    assert [span.name for span in creates] == ["create k", "create a", "create"]
    assert all(span.status.status_code is StatusCode.ERROR for span in creates)
    assert {span.attributes["error.type"] for span in creates} == {"ValueError"}
    assert raw.counts()[0] == 0


@pytest.mark.anyio
async def test_each_attempt_has_a_consumer_span_linked_to_the_producer(
    store: SQLiteStore, raw: RawDB, spans: Any
) -> None:
    from opentelemetry.trace import StatusCode

    answers = [TransportResult.failure("HTTP 503: busy"), TransportResult.success()]
    seen: list[str] = []

    async def send(delivery: Delivery) -> TransportResult:
        from opentelemetry import trace

        seen.append(traceparent(trace.get_current_span()))
        return answers.pop(0)

    dispatch_id = await enqueue_dispatch(store, kind="invoice.paid", deliver_to="billing", now=T0)
    await deliver_due_dispatches(store, transport=send, now=T0)
    await deliver_due_dispatches(store, transport=send, now=T0 + 3600)
    assert raw.row(dispatch_id)["status"] == "delivered"
    [create] = by_kind(spans, "producer")
    failed, delivered = by_kind(spans, "consumer")
    for number, span in enumerate((failed, delivered), start=1):
        assert span.name == "process invoice.paid"
        assert span.parent is None  # linked, not a child
        [link] = span.links
        assert link.context.trace_id == create.context.trace_id
        assert link.context.span_id == create.context.span_id
        assert {k: v for k, v in span.attributes.items() if k != "error.type"} == {
            "messaging.system": "trio_dispatch",
            "messaging.operation.name": "process",
            "messaging.message.id": dispatch_id,
            "trio_dispatch.attempt": number,
            "trio_dispatch.deliver_to": "billing",
        }
    assert failed.attributes["error.type"] == "503"
    assert failed.status.status_code is StatusCode.ERROR
    assert failed.status.description == "HTTP 503: busy"
    assert "error.type" not in delivered.attributes
    assert delivered.status.status_code is StatusCode.UNSET
    assert seen == [traceparent(failed), traceparent(delivered)]  # current during the send


@pytest.mark.anyio
async def test_a_transport_that_raises_names_the_exception_in_its_span(
    store: SQLiteStore, spans: Any
) -> None:
    async def send(delivery: Delivery) -> None:
        raise LookupError("no such customer")

    await enqueue_dispatch(store, kind="k", deliver_to="d", now=T0)
    await deliver_due_dispatches(store, transport=send, now=T0)
    [process] = by_kind(spans, "consumer")
    assert process.attributes["error.type"] == "LookupError"
    assert [event.name for event in process.events] == ["exception"]


@pytest.mark.anyio
async def test_the_worker_traces_each_attempt(db_target: str, raw: RawDB, spans: Any) -> None:
    from opentelemetry.trace import StatusCode

    async def send(delivery: Delivery) -> TransportResult:
        if delivery.kind == "bad":
            return TransportResult.failure("exit 3")
        return TransportResult.success()

    async with open_store(db_target) as db, anyio.create_task_group() as tg:
        worker = DispatchWorker(db, transport=send, tick_seconds=3600)
        await tg.start(worker.run)
        good = await enqueue_dispatch(db, kind="good", deliver_to="d")
        bad = await enqueue_dispatch(db, kind="bad", deliver_to="d", max_attempts=1)
        await wait_for(lambda: statuses(raw) == {"delivered": 1, "dead_letter": 1})
        await wait_for(lambda: len(by_kind(spans, "consumer")) == 2)
        tg.cancel_scope.cancel()
    creates = {span.attributes["messaging.message.id"]: span for span in by_kind(spans, "producer")}
    processes = {
        span.attributes["messaging.message.id"]: span for span in by_kind(spans, "consumer")
    }
    for dispatch_id in (good, bad):
        [link] = processes[dispatch_id].links
        assert link.context.trace_id == creates[dispatch_id].context.trace_id
        assert link.context.span_id == creates[dispatch_id].context.span_id
    assert processes[good].status.status_code is StatusCode.UNSET
    assert processes[bad].attributes["error.type"] == "exit 3"
    assert processes[bad].status.status_code is StatusCode.ERROR


def test_the_sync_enqueue_takes_the_calling_threads_context(
    engine: str, db_target: str, raw: RawDB, spans: Any
) -> None:
    from opentelemetry import trace

    tracer = trace.get_tracer("app", tracer_provider=_provider_of(spans))
    conn = connect(engine, db_target)
    outbox.install_schema(conn)
    conn.commit()
    found: dict[str, Any] = {}

    def request() -> None:  # a thread of a WSGI app, say
        with tracer.start_as_current_span("request") as span:
            found["parent"] = span.get_span_context().span_id
            found["one"] = outbox.enqueue_dispatch(conn, kind="one", deliver_to="d")
            found["many"] = outbox.enqueue_many(conn, [{"kind": "two", "deliver_to": "d"}])
        conn.commit()

    thread = threading.Thread(target=request)
    thread.start()
    thread.join()
    conn.close()
    creates = by_kind(spans, "producer")
    assert [span.name for span in creates] == ["create one", "create two"]
    assert all(span.parent.span_id == found["parent"] for span in creates)
    ids = [found["one"], found["many"][0].id]
    for span, dispatch_id in zip(creates, ids, strict=True):
        assert dict(span.attributes) == producer_attributes(span.name[7:], dispatch_id)
        assert stored_metadata(raw, dispatch_id)["traceparent"] == traceparent(span)


@pytest.mark.anyio
async def test_no_provider_writes_no_context_and_starts_no_span(
    store: SQLiteStore, raw: RawDB
) -> None:
    from opentelemetry import trace

    from trio_dispatch import tracing

    assert isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider)
    assert tracing.tracer() is None
    dispatch_id = await enqueue_dispatch(store, kind="k", deliver_to="d", now=T0)
    assert list(stored_metadata(raw, dispatch_id)) == ["lion_class"]

    async def send(delivery: Delivery) -> None:
        pass

    assert (await deliver_due_dispatches(store, transport=send, now=T0))["delivered"] == 1


def _provider_of(spans: Any) -> Any:
    """The tracer provider the ``spans`` fixture installed."""
    from trio_dispatch import tracing

    return tracing._own_provider


@pytest.mark.anyio
async def test_each_fired_tick_has_a_root_producer_span_in_its_envelope(
    store: SQLiteStore, raw: RawDB, spans: Any
) -> None:
    import logging
    import time
    from functools import partial

    from trio_dispatch.schedules import Schedule, Scheduler
    from trio_dispatch.schedules.runs import see

    hour = 3600.0
    now = time.time()
    if now % hour <= 60:  # the hour's tick would be on time: be before it
        now -= 120
    last = now - now % hour
    await store.write(partial(see, names=["s"], now=last - 2 * hour + 1))  # two ticks missed
    schedule = Schedule(
        name="s", every="1h", kind="tick", deliver_to="d", missed="all", catch_up_seconds=3 * hour
    )
    # A frozen clock: a run across the hour must not find the next tick due too.
    scheduler = Scheduler(store, [schedule], clock=lambda: now, log=logging.getLogger("tests"))
    async with anyio.create_task_group() as tg:
        tg.start_soon(scheduler.run)
        # >=: on PostgreSQL the store's clock decides what is due, and it
        # may pass the next hour while the test runs (one more tick then).
        await wait_for(
            lambda: (raw.scalar("SELECT last_tick FROM dispatch_schedules") or 0) >= last
        )
        await anyio.sleep(0.2)  # a tick past the hour, if any, is written too
        tg.cancel_scope.cancel()
    newest = raw.scalar("SELECT last_tick FROM dispatch_schedules")
    assert newest in (last, last + hour)
    rows = raw.rows("SELECT id FROM dispatch_outbox ORDER BY id")
    creates = by_kind(spans, "producer")
    assert len(rows) == len(creates) == 2 + round((newest - last) / hour)
    by_id = {span.attributes["messaging.message.id"]: span for span in creates}
    for row in rows:
        span = by_id[row["id"]]
        assert span.name == "create tick"
        assert span.parent is None
        assert dict(span.attributes) == producer_attributes("tick", row["id"])
        metadata = stored_metadata(raw, row["id"])
        assert list(metadata)[:2] == ["lion_class", "traceparent"]
        assert metadata["traceparent"] == traceparent(span)
        assert metadata["schedule"] == "s"


@pytest.mark.anyio
async def test_a_manual_run_is_made_by_the_outboxs_enqueue_call_span_and_body_limit_included(
    store: SQLiteStore, raw: RawDB, spans: Any
) -> None:
    import time
    from functools import partial

    from trio_dispatch.outbox.enqueue import EnqueueCall
    from trio_dispatch.schedules import Schedule
    from trio_dispatch.schedules.runs import fire_manual

    schedule = Schedule(name="s", every="1h", kind="tick", deliver_to="d", body={"pad": "x" * 60})
    with pytest.raises(ValueError, match=r"over the limit of 50 bytes \(max_body_bytes\)"):
        with EnqueueCall(50) as call:
            await store.write(partial(fire_manual, schedule=schedule, now=time.time(), call=call))
    # The run's row went with its dispatch: the tick's unit of work is one.
    assert raw.counts() == (0, 0) and raw.scalar("SELECT COUNT(*) FROM schedule_runs") == 0
    with EnqueueCall.on(store) as call:
        run = await store.write(partial(fire_manual, schedule=schedule, now=time.time(), call=call))
        call.written([run.dispatch_id])
    refused, made = by_kind(spans, "producer")
    assert not refused.status.is_ok and refused.attributes["error.type"] == "ValueError"
    assert made.status.is_ok and made.parent is None
    assert dict(made.attributes) == producer_attributes("tick", run.dispatch_id)
    metadata = stored_metadata(raw, run.dispatch_id)
    assert list(metadata)[:2] == ["lion_class", "traceparent"]
    assert metadata["traceparent"] == traceparent(made)
    assert (metadata["schedule"], metadata["manual"]) == ("s", True)
    [enqueued] = raw.transitions(run.dispatch_id)
    assert (enqueued["source"], enqueued["actor"]) == ("scheduler", "schedule:s")


@pytest.mark.anyio
async def test_a_tracer_provider_that_fails_never_fails_an_enqueue_or_a_delivery(
    db_target: str, raw: RawDB
) -> None:
    from opentelemetry.sdk.trace import TracerProvider

    from trio_dispatch import tracing

    class Broken(TracerProvider):
        def get_tracer(self, *args: Any, **kwargs: Any) -> Any:
            raise RuntimeError("exporter misconfigured")

    async def send(delivery: Delivery) -> TransportResult:
        return TransportResult.success()

    tracing.use_tracer_provider(Broken())
    try:
        async with open_store(db_target) as db, anyio.create_task_group() as tg:
            worker = DispatchWorker(db, transport=send, tick_seconds=3600)
            await tg.start(worker.run)
            await enqueue_dispatch(db, kind="k", deliver_to="d")
            await wait_for(lambda: statuses(raw) == {"delivered": 1})
            tg.cancel_scope.cancel()
    finally:
        tracing.use_tracer_provider(None)
