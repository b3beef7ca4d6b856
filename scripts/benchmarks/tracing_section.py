"""Section ``tracing``: what tracing (docs/tracing.md) costs an enqueue and a
delivery, three ways in one run: without tracing (``tracing.ACTIVE``
False: the one flag the hot paths check when opentelemetry is missing),
with the ``[otel]`` extra installed and no tracer provider set, and with an
SDK tracer provider whose exporter does nothing.

Within a round the three ways take turns (their order rotating); each
figure is the median of the rounds' own ratios to "without".
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import anyio

from trio_dispatch import Delivery, DispatchWorker, open_store, tracing

from .core import ours_command_deliveries
from .harness import (
    BODY,
    BODY_JSON,
    TURNS,
    Bench,
    Figure,
    Outcome,
    Pairs,
    Side,
    interleave,
    take_turns,
)
from .workloads import enqueue_side, fill_ours, noop, ours_deliveries

WAYS = ("without", "no provider", "sdk")


def sdk_provider(batch: bool = True) -> Any:
    """An SDK tracer provider exporting to nowhere through the batch
    processor an application would use (export on a thread of its own), or
    the simple one (export at each span's end)."""
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import (
        BatchSpanProcessor,
        SimpleSpanProcessor,
        SpanExporter,
        SpanExportResult,
    )

    class Nowhere(SpanExporter):
        def export(self, spans: Sequence[Any]) -> SpanExportResult:
            return SpanExportResult.SUCCESS

    provider = TracerProvider()
    provider.add_span_processor((BatchSpanProcessor if batch else SimpleSpanProcessor)(Nowhere()))
    return provider


@contextmanager
def way(name: str, provider: Any) -> Iterator[None]:
    """Tracing as ``name`` says for the block; off again after it."""
    tracing.ACTIVE = name != "without"
    tracing.use_tracer_provider(provider if name == "sdk" else None)
    try:
        yield
    finally:
        tracing.ACTIVE = False
        tracing.use_tracer_provider(None)


def traced(side: Side, name: str, provider: Any) -> Side:
    async def run(count: int) -> None:
        with way(name, provider):
            await side(count)

    return run


async def enqueue_rates(path: str, n: int, provider: Any) -> list[float]:
    """Enqueues/s of one producer (``enqueue_dispatch`` one by one, a
    500-byte body, durability full) each way, all on one store: the ways
    differ in tracing only, never in the file or its writer."""
    async with open_store(path) as db:
        return await interleave(
            [traced(enqueue_side(db, BODY), name, provider) for name in WAYS], n
        )


async def windowed_delivery_rates(
    path: str, rows: int, turns: int, window: float, provider: Any
) -> dict[str, float]:
    """Deliveries/s of one worker (no-op callable, concurrency 64) draining
    one backlog of ``rows`` traced rows while the ways take turns of
    ``window`` seconds (their order rotating): the same store, worker and
    moment for every way; each way's median window. Turns the backlog
    cannot fill are left out for every way alike."""
    done = 0

    async def counting(delivery: Delivery) -> None:
        nonlocal done
        done += 1

    # Every row carries a creation context; its spans go to a provider of
    # their own, not to the queue of the one measured.
    filler = sdk_provider(batch=False)
    with way("sdk", filler):
        await fill_ours(path, rows)
    filler.shutdown()
    rates: dict[str, list[float]] = {name: [] for name in WAYS}
    async with open_store(path) as db, anyio.create_task_group() as tg:
        worker = DispatchWorker(
            db, transport=counting, concurrency=64, batch_size=100, tick_seconds=3600
        )
        await tg.start(worker.run)
        await anyio.sleep(window)  # the first claims, the caches warm
        for turn in range(turns):
            taken: dict[str, float] = {}
            for offset in range(len(WAYS)):
                name = WAYS[(turn + offset) % len(WAYS)]
                with way(name, provider):
                    before, started = done, time.perf_counter()
                    await anyio.sleep(window)
                    taken[name] = (done - before) / (time.perf_counter() - started)
            if done >= rows:
                break  # the backlog ran out within this turn
            for name, rate in taken.items():
                rates[name].append(rate)
        tg.cancel_scope.cancel()
    if not rates["without"]:
        raise RuntimeError(f"tracing: {rows} rows did not last one turn of {window}s windows")
    return {name: statistics.median(values) for name, values in rates.items()}


def delivery_rates(
    bench: Bench, k: int, provider: Any, ways: Sequence[str] = WAYS, command: bool = False
) -> dict[str, float]:
    """Deliveries/s of one worker (no-op callable, concurrency 64; or
    ``/bin/true`` at concurrency 8) each way, the rows enqueued (untimed)
    the same way, so a traced row's attempt has its creation context to
    link to."""

    def run(name: str) -> Callable[[], float]:
        def measure() -> float:
            with way(name, provider):
                rate: float = (
                    bench.go(ours_command_deliveries, bench.at("trace-c"), k, 8)
                    if command
                    else bench.go(ours_deliveries, bench.at("trace-d"), k, noop, 64)
                )
            return rate

        return measure

    turns = take_turns({name: run(name) for name in ways}, 3)
    return {name: statistics.median(rates) for name, rates in turns.items()}


def span_costs(provider: Any, n: int = 20000) -> dict[str, float]:
    """Microseconds per span, in a tight loop: the SDK's own start and end
    of a bare span, a ``create`` span as an enqueue makes it (context
    formatted for the envelope), and an attempt's ``process`` span (context
    read from the envelope, linked, made current, ended)."""
    from trio_dispatch.outbox.enqueue import prepare
    from trio_dispatch.outbox.transitions import Claim
    from trio_dispatch.transports import TransportResult

    with way("sdk", provider):
        found = tracing.tracer()
        assert found is not None
        creations = tracing.creations()
        assert creations is not None
        metadata = creations.start("bench")
        new = prepare({"kind": "bench", "deliver_to": "seat"}, metadata=metadata)
        claim = Claim(new.id, "bench", "seat", new.payload, 1, 8, False, 0.0)
        ok = TransportResult.success()

        def bare() -> None:
            found.start_span("bench").end()

        def create() -> None:
            spans = tracing.creations()
            assert spans is not None
            with spans:
                spans.start("bench")
                spans.written([new.id])

        def process() -> None:
            with tracing.processing(claim) as span:
                span.record(ok)

        costs = {}
        for name, fn in (("sdk bare span", bare), ("create", create), ("process", process)):
            started = time.perf_counter()
            for _ in range(n):
                fn()
            costs[name] = (time.perf_counter() - started) / n * 1e6
        return costs


def run_tracing(bench: Bench) -> Outcome:
    """The four ratios of the tracing issue: ``[otel]`` installed with no
    provider (>= 0.97x) and an SDK provider with a no-op exporter (>= 0.85x),
    each beside no tracing, for one producer's enqueues and for deliveries."""
    if not tracing.ACTIVE:
        return Outcome(notes=["tracing: skipped, opentelemetry is not installed"])
    provider = sdk_provider()
    scale = bench.scale
    n, k, s = 600 * scale, 60000 * scale, 300 * scale
    turns = 8 * scale
    pairs = Pairs()
    tracing.ACTIVE = False
    try:
        for _ in range(bench.rounds):
            without, proxy, sdk = bench.go(enqueue_rates, str(bench.at("trace-e")), n, provider)
            pairs.add("e-proxy", proxy, without)
            pairs.add("e-sdk", sdk, without)
            rates = bench.go(
                windowed_delivery_rates, str(bench.at("trace-w")), k, turns, 0.2, provider
            )
            pairs.add("d-proxy", rates["no provider"], rates["without"])
            pairs.add("d-sdk", rates["sdk"], rates["without"])
            rates = delivery_rates(bench, s, provider, ("without", "sdk"), command=True)
            pairs.add("c-sdk", rates["sdk"], rates["without"])
    finally:
        tracing.ACTIVE = True
        provider.shutdown()
    enqueue_how = (
        f"enqueue_dispatch one by one, a {len(BODY_JSON)}-byte body, durability full; "
        f"{n // TURNS} a turn, {TURNS} turns in rotation with the other ways on one store, "
        "the median"
    )
    delivery_how = (
        f"one worker (no-op callable, concurrency 64) draining a backlog of {k} rows while "
        f"the three ways take turns of 0.2 s, up to {turns} turns, the median window"
    )
    figures: list[Figure] = [
        pairs.figure(
            "e-proxy",
            "enqueue, 1 producer, [otel] installed, no provider",
            "/s",
            f"without tracing: {enqueue_how}",
            0.97,
            "without tracing",
            "tracing",
        ),
        pairs.figure(
            "d-proxy",
            "deliveries/s, [otel] installed, no provider",
            "/s",
            f"without tracing: {delivery_how}",
            0.97,
            "without tracing",
            "tracing",
        ),
        pairs.figure(
            "e-sdk",
            "enqueue, 1 producer, SDK provider, no-op exporter",
            "/s",
            f"without tracing: {enqueue_how}; ours: a create span per enqueue "
            "(BatchSpanProcessor, an exporter that drops every span)",
            0.85,
            "without tracing",
            "tracing",
        ),
        pairs.figure(
            "d-sdk",
            "deliveries/s, SDK provider, no-op exporter",
            "/s",
            f"without tracing: {delivery_how}; ours: a linked process span per attempt "
            "(BatchSpanProcessor, an exporter that drops every span)",
            0.85,
            "without tracing",
            "tracing",
        ),
        pairs.figure(
            "c-sdk",
            "deliveries/s, /bin/true, SDK provider, no-op exporter",
            "/s",
            f"without tracing: {s} rows, one worker running /bin/true at concurrency 8 "
            "(a process per attempt, as the command transport does); ours: a linked process "
            "span per attempt and TRACEPARENT in each child's environment",
            0.85,
            "without tracing",
            "tracing",
        ),
    ]
    costs = span_costs(sdk_provider())
    notes = [
        "tracing: microseconds per span in a tight loop (SDK, BatchSpanProcessor, no-op "
        "exporter): "
        + ", ".join(f"{name} {value:.1f}" for name, value in costs.items())
        + '; "without" is tracing.ACTIVE = False, the one check the hot paths make '
        "when opentelemetry is missing"
    ]
    return Outcome(figures=figures, notes=notes)
