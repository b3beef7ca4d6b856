"""What every section shares: the figure (values beside baselines, round
by round, and their ratio), paired rounds, sides taking turns
(:func:`take_turns` for whole runs, :func:`interleave` for the figures an
fsync per operation bounds), the payload every side sends, the run's
settings (:class:`Bench`), and the report (plain text, the Markdown table,
the load average).

Nothing here measures trio_dispatch itself; the sections do.
"""

from __future__ import annotations

import importlib.metadata
import json
import statistics
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final, TypeVar

import anyio

ROOT: Final = Path(__file__).resolve().parents[2]
"""The repository: scratch files go under it, child processes import from it."""

WARMUP: Final = 20
"""Untimed operations each side runs before its timed ones (connections
open, statements prepared, caches warm)."""

TURNS: Final = 20
"""Turns the sides of an interleaved figure take (:func:`interleave`)."""

PAYLOAD = json.dumps(
    {
        "id": str(uuid.uuid4()),
        "created_at": time.time(),
        "metadata": {"lion_class": "trio_dispatch.signal.DispatchSignal"},
        "data": None,
        "emitter_role": None,
        "schema_version": 1,
        "dispatch_id": uuid.uuid4().hex,
        "kind": "bench",
        "deliver_to": "seat-1",
        "attempt": 0,
        "ack_token": None,
        "body": {},
    }
)


def _body(size: int) -> dict[str, Any]:
    """An order event whose JSON is ``size`` bytes: what a caller enqueues."""
    body: dict[str, Any] = {
        "event": "order.created",
        "order_id": "ord-2026-000123",
        "customer_id": "cus-000042",
        "currency": "EUR",
        "total_cents": 12999,
        "items": [{"sku": f"sku-{i:04d}", "qty": 1, "price_cents": 4333} for i in range(3)],
        "note": "",
    }
    body["note"] = "n" * (size - len(json.dumps(body)))
    return body


BODY: Final = _body(500)
"""The payload every side-by-side figure sends (huey's task argument,
pgqueuer's job payload, our ``body``)."""
BODY_JSON: Final = json.dumps(BODY)


@dataclass
class Figure:
    """One figure: ``values`` of ours and ``baselines`` measured beside them,
    pair by pair (one pair per round). ``meets`` judges the figure; ``peer``
    names the baseline in a word or two (the Markdown table), ``section``
    the group that measured it."""

    name: str
    values: list[float]
    unit: str
    baselines: list[float]
    baseline_name: str
    target: str
    meets: Callable[[Figure], bool]
    peer: str = ""
    section: str = "core"

    @property
    def value(self) -> float:
        return statistics.median(self.values)

    @property
    def baseline(self) -> float:
        return statistics.median(self.baselines)

    @property
    def ratios(self) -> list[float]:
        return [
            v / b if b else float("nan") for v, b in zip(self.values, self.baselines, strict=True)
        ]

    @property
    def ratio(self) -> float:
        """The median of the rounds' own ratios: each ratio compares two runs
        made one right after the other, so the machine's drift between
        rounds cancels out."""
        return statistics.median(self.ratios)

    @property
    def spread(self) -> str:
        """The range of the rounds' ratios ("" for a single round)."""
        ratios = self.ratios
        return f"{min(ratios):.2f}-{max(ratios):.2f}" if len(ratios) > 1 else ""

    def row(self) -> dict[str, Any]:
        return {
            "figure": self.name,
            "section": self.section,
            "value": round(self.value, 3),
            "unit": self.unit,
            "baseline": round(self.baseline, 3),
            "baseline_name": self.baseline_name,
            "peer": self.peer or self.baseline_name,
            "ratio": round(self.ratio, 3),
            "ratios": [round(r, 3) for r in self.ratios],
            "values": [round(v, 3) for v in self.values],
            "baselines": [round(b, 3) for b in self.baselines],
            "target": self.target,
            "meets_target": self.meets(self),
        }


def at_least(times: float) -> Callable[[Figure], bool]:
    return lambda figure: figure.ratio >= times


def at_most(limit: float) -> Callable[[Figure], bool]:
    return lambda figure: figure.value <= limit


def ratio_at_most(times: float) -> Callable[[Figure], bool]:
    return lambda figure: figure.ratio <= times


FigureRow = tuple[str, str, str, str, str, Callable[[Figure], bool]]
"""One figure of a section's table: its key, what it measures, the unit, the
baseline's name, the target and whether a figure meets it."""


class Pairs:
    """Paired measurements by key, one (ours, baseline) pair per round."""

    def __init__(self) -> None:
        self._pairs: dict[str, tuple[list[float], list[float]]] = {}

    def add(self, key: str, ours: float, baseline: float) -> None:
        values, baselines = self._pairs.setdefault(key, ([], []))
        values.append(ours)
        baselines.append(baseline)

    def figures(self, engine: str, rows: Sequence[FigureRow], section: str) -> list[Figure]:
        """The figure of each row, of the pairs of key ``ENGINE/KEY`` (the
        baseline's name is its peer's too)."""
        found = []
        for key, name, unit, baseline, target, meets in rows:
            values, baselines = self._pairs[f"{engine}/{key}"]
            found.append(
                Figure(name, values, unit, baselines, baseline, target, meets, baseline, section)
            )
        return found

    def figure(
        self,
        key: str,
        name: str,
        unit: str,
        baseline_name: str,
        times: float,
        peer: str,
        section: str,
        target: str = "",
    ) -> Figure:
        """The figure of ``key``, its target a ratio of at least ``times``
        (``target`` spells it, by default ">= 0.60x" / ">= 4x")."""
        values, baselines = self._pairs[key]
        target = target or (f">= {times:.2f}x" if times < 1 else f">= {times:g}x")
        return Figure(
            name, values, unit, baselines, baseline_name, target, at_least(times), peer, section
        )


T = TypeVar("T")


def take_turns(sides: dict[str, Callable[[], T]], turns: int, first: int = 0) -> dict[str, list[T]]:
    """Each side's results, run ``turns`` times with the sides taking turns
    (the order rotating turn by turn, starting at side ``first``), so that a
    slow spell of a shared machine falls on every side alike and no side
    always gets the warmer or the quieter half."""
    names = list(sides)
    results: dict[str, list[T]] = {name: [] for name in names}
    for turn in range(turns):
        for offset in range(len(names)):
            name = names[(first + turn + offset) % len(names)]
            results[name].append(sides[name]())
    return results


def median_of_turns(
    sides: dict[str, Callable[[], float]], turns: int, first: int = 0
) -> dict[str, float]:
    """The median result of each side over :func:`take_turns`."""
    return {
        name: statistics.median(values) for name, values in take_turns(sides, turns, first).items()
    }


Side = Callable[[int], Awaitable[None]]
"""One side of an interleaved figure: run this many operations."""


def sync_side(fn: Callable[[int], None]) -> Side:
    """A blocking side (a peer's or raw code) run as is inside the event
    loop; nothing else runs meanwhile."""

    async def side(count: int) -> None:
        fn(count)

    return side


async def interleave(sides: Sequence[Side], n: int, turns: int = TURNS) -> list[float]:
    """Operations/s of each side running ``n`` operations in ``turns`` turns
    (the order rotating turn by turn), after ``WARMUP`` untimed each: the
    median of the side's per-turn rates.

    For the figures one fsync per operation bounds. On a shared machine an
    fsync's cost drifts within seconds and stalls now and then for a few
    hundred milliseconds (one turn of raw sqlite3 ran at 127/s between
    turns at 2,000-3,800/s): sides taking turns of a fraction of a second
    meet the same disk, and the median turn leaves out a stall that hit one
    side only."""
    for side in sides:
        await side(WARMUP)
    rates: list[list[float]] = [[] for _ in sides]
    size = max(1, n // turns)
    for turn in range(turns):
        for offset in range(len(sides)):
            k = (turn + offset) % len(sides)
            start = time.perf_counter()
            await sides[k](size)
            rates[k].append(size / (time.perf_counter() - start))
    return [statistics.median(side_rates) for side_rates in rates]


@dataclass
class Outcome:
    """What a section measured: its figures, the notes printed under the
    table, and rows for the engines table."""

    figures: list[Figure] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    engines: list[dict[str, Any]] = field(default_factory=list)


class Bench:
    """What every section shares: the run's size, rounds and backend, and a
    scratch directory for its files."""

    def __init__(self, quick: bool, backend: str, rounds: int, scratch: Path) -> None:
        self.quick = quick
        self.scale = 1 if quick else 3
        self.backend = backend
        self.rounds = rounds
        self.scratch = scratch

    def at(self, name: str) -> Path:
        """A fresh file name in the scratch directory."""
        return self.scratch / f"{name}-{uuid.uuid4().hex[:6]}.db"

    def go(self, fn: Any, *args: Any, backend: str | None = None) -> Any:
        """``fn(*args)`` in its own event loop (the run's backend unless named)."""
        return anyio.run(fn, *args, backend=backend or self.backend)


def version_of(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "?"


def percentile(samples: Sequence[float], fraction: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))]


def format_loads(loads: tuple[float, float, float]) -> str:
    return " ".join(f"{load:.2f}" for load in loads)


def _amount(value: float, unit: str) -> str:
    """A value for the Markdown table: rates whole, with thousands commas."""
    if unit.endswith("/s"):
        return f"{value:,.0f}{unit}" if unit == "/s" else f"{value:,.0f} {unit}"
    return f"{value:,.1f} {unit}"


def markdown(figures: list[Figure]) -> str:
    """The figures as a Markdown table (for the README's Performance part)."""
    lines = [
        "| figure | ours | peer/baseline | ratio | target | met |",
        "| --- | ---: | --- | ---: | --- | --- |",
    ]
    for f in figures:
        spread = f" ({f.spread})" if f.spread else ""
        lines.append(
            f"| {f.name} | {_amount(f.value, f.unit)} | {_amount(f.baseline, f.unit)} "
            f"{f.peer or f.baseline_name} | {f.ratio:.2f}x{spread} | {f.target} | "
            f"{'yes' if f.meets(f) else 'no'} |"
        )
    return "\n".join(lines)


def print_report(figures: list[Figure], notes: list[str], engines: list[dict[str, Any]]) -> None:
    if figures:
        width = max(len(f.name) for f in figures)
        print(
            f"{'figure':<{width}}  {'value':>12}  {'baseline':>12}  {'ratio':>7}  "
            f"{'rounds':>11}  target     ok"
        )
        for f in figures:
            ok = "yes" if f.meets(f) else "NO"
            print(
                f"{f.name:<{width}}  {f.value:>10.1f}{f.unit:>2}  {f.baseline:>12.1f}  "
                f"{f.ratio:>7.2f}  {f.spread:>11}  {f.target:<9}  {ok}"
            )
        for f in figures:
            print(f"  baseline of '{f.name}': {f.baseline_name}")
    for note in notes:
        print(f"  note: {note}")
    if engines:
        print()
        keys = [
            "enqueue_1_producer_per_s",
            "enqueue_64_producers_per_s",
            "deliveries_1_worker_per_s",
            "deliveries_4_workers_per_s",
        ]
        print(f"{'engine':<12}" + "".join(f"{k:>30}" for k in keys))
        for row in engines:
            print(f"{row['engine']:<12}" + "".join(f"{row[k]:>30.0f}" for k in keys))
        if all(row["engine"] != "postgresql" for row in engines):
            print("(no PostgreSQL row: the postgres section did not run or no server answered)")
