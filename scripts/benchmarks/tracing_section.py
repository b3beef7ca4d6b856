"""Section ``tracing``: what tracing (SPEC section 16) costs an enqueue and a
delivery, three ways in one run: without tracing (``tracing.ACTIVE``
False: the one flag the hot paths check when opentelemetry is missing),
with the ``[otel]`` extra installed and no tracer provider set, and with an
SDK tracer provider whose exporter does nothing.

Within a round the three ways take turns (their order rotating); each
figure is the median of the rounds' own ratios to "without".
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from trio_dispatch import open_store, tracing

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
from .workloads import enqueue_side, noop, ours_deliveries

WAYS = ("without", "no provider", "sdk")


def sdk_provider() -> Any:
    """An SDK tracer provider exporting to nowhere through the batch
    processor an application would use (export on a thread of its own)."""
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import (
        BatchSpanProcessor,
        SpanExporter,
        SpanExportResult,
    )

    class Nowhere(SpanExporter):
        def export(self, spans: Sequence[Any]) -> SpanExportResult:
            return SpanExportResult.SUCCESS

    provider = TracerProvider()
    provider.add_span_processor(BatchSpanProcessor(Nowhere()))
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


async def enqueue_rates(paths: Sequence[str], n: int, provider: Any) -> list[float]:
    """Enqueues/s of one producer (``enqueue_dispatch`` one by one, a
    500-byte body, durability full) each way, on a store of its own."""
    async with open_store(paths[0]) as a, open_store(paths[1]) as b, open_store(paths[2]) as c:
        sides = [
            traced(enqueue_side(db, BODY), name, provider)
            for db, name in zip((a, b, c), WAYS, strict=True)
        ]
        return await interleave(sides, n)


def delivery_rates(bench: Bench, k: int, provider: Any) -> dict[str, float]:
    """Deliveries/s of one worker (no-op callable, concurrency 64) each
    way, the rows enqueued (untimed) the same way, so a traced row's
    attempt has its creation context to link to."""

    def run(name: str) -> Callable[[], float]:
        def measure() -> float:
            with way(name, provider):
                rate: float = bench.go(ours_deliveries, bench.at("trace-d"), k, noop, 64)
            return rate

        return measure

    turns = take_turns({name: run(name) for name in WAYS}, 3)
    return {name: statistics.median(rates) for name, rates in turns.items()}


def run_tracing(bench: Bench) -> Outcome:
    """The four ratios of the tracing issue: ``[otel]`` installed with no
    provider (>= 0.97x) and an SDK provider with a no-op exporter (>= 0.85x),
    each beside no tracing, for one producer's enqueues and for deliveries."""
    if not tracing.ACTIVE:
        return Outcome(notes=["tracing: skipped, opentelemetry is not installed"])
    provider = sdk_provider()
    scale = bench.scale
    n, k = 600 * scale, 4000 * scale
    pairs = Pairs()
    tracing.ACTIVE = False
    try:
        for _ in range(bench.rounds):
            paths = [str(bench.at(f"trace-e{i}")) for i in range(3)]
            without, proxy, sdk = bench.go(enqueue_rates, paths, n, provider)
            pairs.add("e-proxy", proxy, without)
            pairs.add("e-sdk", sdk, without)
            rates = delivery_rates(bench, k, provider)
            pairs.add("d-proxy", rates["no provider"], rates["without"])
            pairs.add("d-sdk", rates["sdk"], rates["without"])
    finally:
        tracing.ACTIVE = True
        provider.shutdown()
    enqueue_how = (
        f"enqueue_dispatch one by one, a {len(BODY_JSON)}-byte body, durability full; "
        f"{n // TURNS} a turn, {TURNS} turns in rotation with the other ways, the median"
    )
    delivery_how = (
        f"{k} rows, one worker, no-op callable, concurrency 64; the three ways in "
        "rotation, 3 runs each, the median"
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
    ]
    return Outcome(figures=figures)
