"""What a schedule is (docs/schedules.md): its fields, checked once, and its
ticks in time.

A :class:`Schedule` is built by the library (``Schedule(name=..., ...)``)
or from the configuration file's ``schedules:`` section
(:func:`schedules_from_config`); both run the same checks, and an error
names the field (``schedules.nightly.cron: ...``). Cron expressions are
parsed and evaluated by ``cronsim`` (Debian cron's semantics, DST included:
a wall time a spring-forward skips fires once at the change, a repeated
hour fires once); ``every`` ticks are aligned to the Unix epoch. Times are
Unix seconds (UTC) throughout.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import re
import sys
from collections.abc import Generator, Iterator, Mapping
from datetime import UTC, datetime
from typing import Any, Final, Literal, TypeVar
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from ..errors import ConfigError
from ..outbox.coalesce import require_coalesce
from ..outbox.ordering import require_ordering_key
from ..priority import DEFAULT_PRIORITY, require_priority
from ..validate import (
    require_body,
    require_body_size,
    require_bool,
    require_int,
    require_kind,
    require_number,
    require_route,
    require_text,
)
from ..values import show

MissedPolicy = Literal["skip", "latest", "all"]
MISSED_POLICIES: Final[tuple[MissedPolicy, ...]] = ("skip", "latest", "all")
DEFAULT_CATCH_UP_SECONDS: Final = 3600.0
ON_TIME_SECONDS: Final = 60.0
"""A tick fired within this many seconds of its fire time is on time; a tick
older than that, or followed by a newer due tick, was missed (no worker ran,
or the schedule was paused) and follows the schedule's ``missed`` policy."""
MAX_TICKS_PER_PLAN: Final = 10_000
"""Most wall times one search for the next tick passes over (a repeated
hour's) before it gives up."""
MAX_CATCH_UP_SECONDS: Final = 31 * 86400
"""The longest ``catch_up_seconds``: 31 days, so a monthly cron's missed
tick can still be caught up."""
MAX_BACKFILL_RUNS: Final = 1000
"""The most runs one catch-up of ``missed: all`` fires: the newest missed
ticks inside the window. Older ones are passed over, and the service says
so once."""
WALK_STEP: Final = 64
"""Cron ticks walked between two yields of a plan (:func:`planning`), so a
long walk never holds the event loop for more than a fraction of a
millisecond at a time."""
_SEARCH_WALK: Final = 8
"""Ticks walked from the cursor before the newest due tick is searched for
instead (a worker that keeps up finds it within one or two)."""
_NAME: Final = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:-]{0,127}")
_EVERY: Final = re.compile(r"(\d+)\s*(s|m|h|d)")
_UNITS: Final = {"s": 1, "m": 60, "h": 3600, "d": 86400}
T = TypeVar("T")
Steps = Generator[None, None, T]
"""A computation that yields now and then, so the service can let other
tasks run between its steps; :func:`finish` runs one to its end at once."""
ENQUEUE_FIELDS: Final = (
    "max_attempts",
    "ack_required",
    "ordering_key",
    "expires_after_seconds",
    "priority",
    "coalesce_key",
    "coalesce",
    "coalesce_seconds",
    "coalesce_max_wait_seconds",
)
"""The enqueue arguments a schedule may set for each of its dispatches."""
_NEWER_FIELDS: Final = (
    "priority",
    "coalesce_key",
    "coalesce",
    "coalesce_seconds",
    "coalesce_max_wait_seconds",
)
"""Fields a definition written before them leaves out: at their default they
stay out of the fingerprint (a rolling upgrade changes no definition)."""


def _every_seconds(label: str, value: object) -> int:
    if isinstance(value, bool):
        raise TypeError(f"{label} must be a duration such as 30s, 5m or 1h, got {show(value)}")
    if isinstance(value, int):
        seconds = value
    elif isinstance(value, str) and (match := _EVERY.fullmatch(value.strip())):
        seconds = int(match[1]) * _UNITS[match[2]]
    else:
        raise ValueError(f"{label} must be a duration such as 30s, 5m or 1h, got {show(value)}")
    if not 1 <= seconds <= 366 * 86400:
        raise ValueError(f"{label} must be between 1s and 366d, got {show(value)}")
    return seconds


def _cron(label: str, value: object) -> str:
    try:
        from cronsim import CronSim, CronSimError
    except ImportError:
        raise ValueError(
            f"{label}: cron schedules need the cronsim package: "
            "pip install 'trio_dispatch[schedules]'"
        ) from None
    text = require_text(label, value).strip()
    if len(text.split()) != 5:
        raise ValueError(
            f"{label} must have five fields (minute hour day month weekday), got {show(value)}"
        )
    try:
        CronSim(text, datetime(2000, 1, 1, tzinfo=UTC))
    except CronSimError as exc:
        raise ValueError(f"{label} is not a valid cron expression ({exc}): {show(value)}") from None
    return text


def _zone(label: str, value: object) -> ZoneInfo:
    name = require_text(label, value)
    try:
        return ZoneInfo(name)
    except (ZoneInfoNotFoundError, ValueError):
        raise ValueError(f"{label} is not a known IANA time zone: {show(value)}") from None


@dataclasses.dataclass(frozen=True)
class Schedule:
    """One periodic dispatch: ``cron`` (five fields, evaluated in
    ``timezone``) or ``every`` (``"30s"``, ``"5m"``, ``"1h"``, ``"1d"`` or
    seconds, aligned to the Unix epoch), and what each tick enqueues.
    Every field is checked when the object is built; a bad one raises
    ``TypeError``/``ValueError`` naming it."""

    name: str
    kind: str
    deliver_to: str
    cron: str | None = None
    every: str | int | None = None
    timezone: str = "UTC"
    body: Mapping[str, Any] | None = None
    missed: MissedPolicy = "latest"
    catch_up_seconds: float = DEFAULT_CATCH_UP_SECONDS
    jitter_seconds: float = 0.0
    max_attempts: int | None = None
    ack_required: bool = False
    ordering_key: str | None = None
    expires_after_seconds: float | None = None
    """Each dispatch expires this long after its tick (None: never)."""
    priority: int = DEFAULT_PRIORITY
    """Each dispatch's priority, -10 to 10 (docs/controls.md)."""
    coalesce_key: str | None = None
    """Each dispatch's coalesce key (docs/controls.md): a tick whose previous
    dispatch still waits unclaimed keeps it, replaces it or debounces, as
    ``coalesce`` says; a replace is recorded with the source ``scheduler``."""
    coalesce: str | None = None
    """``keep`` (the default with a key), ``replace`` or ``debounce``."""
    coalesce_seconds: float | None = None
    """``debounce``: how long after the tick its dispatch falls due."""
    coalesce_max_wait_seconds: float | None = None
    """``debounce``: the latest it falls due after its chain's first row."""
    where: str = dataclasses.field(default="", repr=False, compare=False)
    """How errors name this schedule (``schedules.NAME.`` from the file)."""

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not _NAME.fullmatch(self.name):
            raise ValueError(
                f"{self.where or 'schedule '}name must be 1-128 letters, digits, "
                f"'_', '.', ':' or '-', starting with a letter or digit, got {show(self.name)}"
            )
        at = self.where or f"schedule {self.name!r}: "
        if (self.cron is None) == (self.every is None):
            whole = f"{at[:-1]}: " if at.endswith(".") else at  # the schedule, not a field
            raise ValueError(f"{whole}set exactly one of cron or every")
        seconds = None if self.every is None else _every_seconds(f"{at}every", self.every)
        cron = None if self.cron is None else _cron(f"{at}cron", self.cron)
        zone = _zone(f"{at}timezone", self.timezone)
        try:  # these checks name the bare field
            require_kind(self.kind)
            require_route(self.deliver_to)
            body_bytes = 0
            if self.body is not None:
                if not isinstance(self.body, Mapping):
                    raise TypeError(f"body must be a mapping, got {type(self.body).__name__}")
                # Its size is held to the store's limit where that is known
                # (the configuration's dispatch.max_body_bytes, the store a
                # worker runs on): :meth:`check_body_size`.
                body_bytes = len(require_body(dict(self.body), sys.maxsize).encode())
            if self.ordering_key is not None:
                require_ordering_key(self.ordering_key)
            require_priority(self.priority)
            require_coalesce(
                self.coalesce_key,
                self.coalesce,
                self.coalesce_seconds,
                self.coalesce_max_wait_seconds,
            )
        except (TypeError, ValueError) as exc:
            raise type(exc)(f"{at}{exc}") from None
        if self.missed not in MISSED_POLICIES:
            raise ValueError(
                f"{at}missed must be one of {', '.join(MISSED_POLICIES)}, got {show(self.missed)}"
            )
        catch_up = require_number(f"{at}catch_up_seconds", self.catch_up_seconds, minimum=0.0)
        if catch_up > MAX_CATCH_UP_SECONDS:
            raise ValueError(
                f"{at}catch_up_seconds must be at most {MAX_CATCH_UP_SECONDS} (31 days), "
                f"got {show(self.catch_up_seconds)}"
            )
        jitter = require_number(f"{at}jitter_seconds", self.jitter_seconds, minimum=0.0)
        if self.max_attempts is not None:
            require_int(f"{at}max_attempts", self.max_attempts, minimum=1)
        require_bool(f"{at}ack_required", self.ack_required)
        if self.expires_after_seconds is not None:
            require_number(f"{at}expires_after_seconds", self.expires_after_seconds, minimum=0.0)
        object.__setattr__(self, "cron", cron)
        object.__setattr__(self, "catch_up_seconds", catch_up)
        object.__setattr__(self, "jitter_seconds", jitter)
        object.__setattr__(self, "_seconds", seconds)
        object.__setattr__(self, "_zone", zone)
        object.__setattr__(self, "_body_bytes", body_bytes)
        object.__setattr__(self, "_fingerprint", self._digest())

    def _digest(self) -> str:
        definition = {
            "cron": None if self.cron is None else " ".join(self.cron.split()),
            "every": self.interval_seconds,
            "timezone": self.timezone,
            "kind": self.kind,
            "deliver_to": self.deliver_to,
            # As stored: keys as strings, so any body sorts.
            "body": None if self.body is None else json.loads(json.dumps(dict(self.body))),
            "missed": self.missed,
            "catch_up_seconds": self.catch_up_seconds,
            "jitter_seconds": self.jitter_seconds,
            **{field: getattr(self, field) for field in ENQUEUE_FIELDS},
        }
        for field in _NEWER_FIELDS:
            if not definition[field]:
                del definition[field]
        text = json.dumps(definition, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
        return hashlib.blake2b(text.encode(), digest_size=8).hexdigest()

    @property
    def fingerprint(self) -> str:
        """A digest of the definition: every field but the name (cadence,
        timezone, what each tick enqueues, the missed policy), 16 hex
        digits. Workers whose fingerprints for one name differ hold
        different definitions; the store records the one in force (see
        :mod:`.runs`)."""
        fingerprint: str = self.__dict__["_fingerprint"]
        return fingerprint

    @property
    def body_bytes(self) -> int:
        """The size of ``body`` in bytes of JSON (0 without one)."""
        size: int = self.__dict__["_body_bytes"]
        return size

    def check_body_size(self, limit: int, setting: str = "max_body_bytes") -> None:
        """Raise ``ValueError`` naming the schedule, its body's size and
        ``setting`` when the body is over ``limit`` bytes of JSON: every
        tick's enqueue would be refused."""
        at = self.where or f"schedule {self.name!r}: "
        try:
            require_body_size(self.body_bytes, limit, setting)
        except ValueError as exc:
            raise ValueError(f"{at}{exc}") from None

    @property
    def interval_seconds(self) -> int | None:
        """``every`` in seconds; None for a cron schedule."""
        seconds: int | None = self.__dict__["_seconds"]
        return seconds

    @property
    def cadence(self) -> str:
        """How the schedule is written: ``cron 30 2 * * *`` or ``every 5m``."""
        return f"cron {self.cron}" if self.cron is not None else f"every {self.every}"

    def describe(self) -> dict[str, Any]:
        """What the schedule is, as JSON values (``check-config --json`` and
        ``schedules --json`` start from this)."""
        return {
            "name": self.name,
            "cron": self.cron,
            "every": None if self.every is None else str(self.every),
            "timezone": self.timezone,
            "kind": self.kind,
            "deliver_to": self.deliver_to,
            "missed": self.missed,
            "catch_up_seconds": self.catch_up_seconds,
            "jitter_seconds": self.jitter_seconds,
            "priority": self.priority,
            **{
                field: getattr(self, field)
                for field in _NEWER_FIELDS[1:]
                if getattr(self, field) is not None
            },
            "fingerprint": self.fingerprint,
        }

    def next_tick(self, after: float) -> float:
        """The first tick strictly after ``after`` (Unix seconds); ``inf``
        when the cron expression matches nothing in the next 50 years."""
        seconds = self.interval_seconds
        if seconds is not None:
            return float((math.floor(after / seconds) + 1) * seconds)
        return next(self._cron_ticks(after), math.inf)

    def _cron_ticks(self, after: float) -> Iterator[float]:
        """The cron's ticks after ``after``, in order, each instant once."""
        from cronsim import CronSim

        start = datetime.fromtimestamp(math.floor(after), self.__dict__["_zone"])
        newest, passed = after, 0
        try:
            # A repeated hour yields wall times whose instants lie behind
            # ``after`` (or behind the tick before); they are passed over
            # (each instant fires once).
            for moment in CronSim(str(self.cron), start):
                stamp = moment.timestamp()
                if stamp > newest:
                    newest, passed = stamp, 0
                    yield stamp
                elif (passed := passed + 1) > MAX_TICKS_PER_PLAN:
                    return
        except StopIteration:  # pragma: no cover - cronsim's 50-year horizon
            return

    def last_tick(self, after: float, at: float) -> float | None:
        """The newest tick in ``(after, at]``, or None. Arithmetic for
        ``every``; for a cron, a few steps from ``after`` or else a binary
        search over the seconds between (about 22 looks for a 31-day span),
        never a walk over every tick between."""
        seconds = self.interval_seconds
        if seconds is not None:
            tick = float(math.floor(at / seconds) * seconds)
            return tick if tick > after else None
        found = None
        for count, tick in enumerate(self._cron_ticks(after)):
            if tick > at:
                return found
            if count == _SEARCH_WALK:
                break
            found = tick
        else:
            return found
        # Ticks fall on whole seconds, and the first tick after a second is
        # never earlier than the first tick after an earlier one: the newest
        # tick up to ``at`` is the first tick after the last second whose
        # first tick after it is still no later than ``at``.
        assert found is not None
        low, high = math.floor(found), math.floor(at)  # next_tick(low) <= at < next_tick(high)
        while high - low > 1:
            middle = (low + high) // 2
            if self.next_tick(middle) <= at:
                low = middle
            else:
                high = middle
        return self.next_tick(low)

    def ticks_between(self, after: float, until: float) -> Steps[list[float]]:
        """Every tick in ``(after, until]``, oldest first; a cron's are
        walked, with a yield every :data:`WALK_STEP` ticks."""
        seconds = self.interval_seconds
        if seconds is not None:
            first = math.floor(after / seconds) + 1
            last = math.floor(until / seconds)
            return [float(n * seconds) for n in range(first, last + 1)]
        found: list[float] = []
        for tick in self._cron_ticks(after):
            if tick > until:
                break
            found.append(tick)
            if len(found) % WALK_STEP == 0:
                yield
        return found

    def newest_ticks(
        self, after: float, until: float, most: int
    ) -> Steps[tuple[list[float], bool]]:
        """The newest ``most`` ticks in ``(after, until]``, oldest first,
        and whether older ones in that span were left out. A cron is walked
        back from ``until`` in spans that double, each walked forward, so
        the walk covers about the ticks kept, not the whole span."""
        seconds = self.interval_seconds
        if seconds is not None:
            first = math.floor(after / seconds) + 1
            last = math.floor(until / seconds)
            kept = max(first, last - most + 1)
            return [float(n * seconds) for n in range(kept, last + 1)], kept > first
        before = self.last_tick(after, until - 0.5)
        if before is None:
            return ([until] if until > after else []), False
        span = max(60.0, (until - before) * most)
        found: list[float] = []
        end, start = until, until
        while len(found) < most and start > after:
            start = max(after, end - span)
            found = (yield from self.ticks_between(start, end)) + found
            end, span = start, span * 2
        if len(found) > most:
            return found[-most:], True
        return found, start > after and self.last_tick(after, start) is not None

    def next_fire(self, after: float) -> float | None:
        """When the first tick after ``after`` is due (its jitter included);
        None when the cron expression matches no time ahead."""
        tick = self.next_tick(after)
        return None if math.isinf(tick) else self.fire_time(tick)

    def jitter_for(self, tick: float) -> float:
        """The seconds after ``tick`` at which it fires: a spread of up to
        ``jitter_seconds`` that every worker computes alike (a hash of the
        name and the tick), so they all aim at the same instant. It stays
        short of the next tick, so ticks fire in their order (a jitter as
        long as the interval would let a later tick come due first, and the
        earlier one be passed over as missed)."""
        if not self.jitter_seconds:
            return 0.0
        digest = hashlib.blake2b(f"{self.name}\0{tick!r}".encode(), digest_size=8).digest()
        room = min(self.jitter_seconds, self.next_tick(tick) - tick)
        return room * int.from_bytes(digest, "big") / 2**64

    def fire_time(self, tick: float) -> float:
        """When ``tick`` is due: the tick plus its jitter."""
        return tick + self.jitter_for(tick)


@dataclasses.dataclass(frozen=True)
class Plan:
    """What one look at a schedule decided."""

    fire: tuple[tuple[float, bool], ...]
    """Ticks to fire now, oldest first, each with whether it is backfilled."""
    handled: float | None
    """The newest due tick (fired or passed over): the schedule's new cursor."""
    wake_at: float
    """When the next tick is due."""
    capped: bool = False
    """Whether ``missed: all`` found more missed ticks inside the window than
    :data:`MAX_BACKFILL_RUNS`: only the newest fire, the older are passed over."""


def finish(steps: Steps[T]) -> T:
    """Run ``steps`` to its end at once and return its result."""
    while True:
        try:
            next(steps)
        except StopIteration as done:
            result: T = done.value
            return result


def plan(schedule: Schedule, cursor: float, now: float) -> Plan:
    """:func:`planning` run at once."""
    return finish(planning(schedule, cursor, now))


def planning(schedule: Schedule, cursor: float, now: float) -> Steps[Plan]:
    """Which ticks after ``cursor`` (the newest tick handled, else when the
    schedule was first seen) fire at ``now`` under the ``missed`` policy:
    the newest due tick fires if it is on time (:data:`ON_TIME_SECONDS`);
    the missed ones fire as ``skip`` (none), ``latest`` (the newest inside
    ``catch_up_seconds``, unless an on-time tick fires) or ``all`` (each
    inside ``catch_up_seconds``, oldest first, at most
    :data:`MAX_BACKFILL_RUNS` of the newest) say, flagged backfilled.

    The work does not grow with the window: the newest due tick is found
    by arithmetic (``every``) or a search (cron), and only ``all`` walks
    ticks, at most about twice the runs it fires, yielding every
    :data:`WALK_STEP` of them."""
    horizon = now - max(schedule.catch_up_seconds, ON_TIME_SECONDS) - schedule.jitter_seconds
    # A tick exactly at the window's edge is inside it.
    after = cursor if cursor >= horizon else horizon - 0.001
    newest = schedule.last_tick(after, now)
    if newest is not None and schedule.fire_time(newest) > now:
        # Its jitter has not passed yet; the tick before it is due (a
        # jitter stays short of the next tick).
        newest = schedule.last_tick(after, newest - 0.5)
    upcoming = schedule.next_tick(after if newest is None else newest)
    wake_at = upcoming if math.isinf(upcoming) else schedule.fire_time(upcoming)
    if newest is None:
        return Plan((), None, wake_at)
    on_time = newest if now - schedule.fire_time(newest) <= ON_TIME_SECONDS else None
    oldest = now - schedule.catch_up_seconds
    chosen: list[float] = []
    capped = False
    if schedule.missed == "latest" and on_time is None and newest >= oldest:
        chosen = [newest]
    elif schedule.missed == "all":
        missed = newest if on_time is None else schedule.last_tick(after, newest - 0.5)
        if missed is not None and missed >= oldest:
            # A tick exactly ``catch_up_seconds`` old is inside the window.
            start = max(after, math.nextafter(oldest, -math.inf))
            chosen, capped = yield from schedule.newest_ticks(start, missed, MAX_BACKFILL_RUNS)
    fire = [(t, True) for t in chosen] + ([(on_time, False)] if on_time is not None else [])
    return Plan(tuple(fire), newest, wake_at, capped)


_FILE_KEYS: Final = (
    "cron",
    "every",
    "timezone",
    "kind",
    "deliver_to",
    "body",
    "missed",
    "catch_up_seconds",
    "jitter_seconds",
    *ENQUEUE_FIELDS,
)


def schedules_from_config(key: str, value: object) -> tuple[Schedule, ...]:
    """The ``schedules:`` section of the configuration file (name ->
    fields); a problem raises ``TypeError``/``ValueError`` naming the
    dotted key, and problems in several schedules a ``ConfigError`` (a
    ``ValueError``) holding each."""
    if value is None:
        return ()
    if not isinstance(value, Mapping):
        raise TypeError(f"{key} must be a mapping of schedule names, got {type(value).__name__}")
    found: list[Schedule] = []
    errors: list[TypeError | ValueError] = []
    for name, fields in value.items():
        try:
            found.append(_schedule_from_file(key, name, fields))
        except (TypeError, ValueError) as exc:
            errors.append(exc)
    if len(errors) == 1:
        raise errors[0]
    if errors:  # every bad schedule, each its own problem of the file
        problems = tuple(str(error) for error in errors)
        raise ConfigError("; ".join(problems), problems)
    return tuple(found)


def _schedule_from_file(key: str, name: object, fields: object) -> Schedule:
    """One schedule of the file's section, its errors naming the dotted key."""
    where = f"{key}.{name}"
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise ValueError(
            f"{key}: schedule name must be 1-128 letters, digits, '_', '.', ':' or '-', "
            f"starting with a letter or digit, got {show(name)}"
        )
    if not isinstance(fields, Mapping):
        raise TypeError(f"{where} must be a mapping, got {type(fields).__name__}")
    for field in fields:
        if field not in _FILE_KEYS:
            raise ValueError(
                f"unknown key {f'{where}.{field}'!r} (allowed: {', '.join(_FILE_KEYS)})"
            )
    for required in ("kind", "deliver_to"):
        if required not in fields:
            raise ValueError(f"{where}.{required} is required")
    return Schedule(name=name, where=f"{where}.", **fields)
