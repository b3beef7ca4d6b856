"""A destination's policy: what configuration (or ``DispatchWorker(...,
destinations=...)``) says about one ``deliver_to`` value -- its shared
concurrency, its rate, how long a throttle may last and its circuit breaker.

The policy is the same on every worker that shares a store (it comes from
the same configuration); the state it governs lives in the store
(:mod:`.state`). A ``deliver_to`` not named takes the policy of ``"*"``,
and without ``"*"`` the default :class:`Destination`, which limits nothing.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from typing import Any, Final

from ..errors import ConfigError
from ..validate import require_int, require_number, require_route
from ..values import show

ANY_DESTINATION: Final = "*"
"""The policy name that applies to every ``deliver_to`` not named."""

_RATE: Final = re.compile(r"^\s*(\d+)\s*/\s*(s|sec|second|m|min|minute|h|hour)\s*$")
_PERIODS: Final = {"s": 1.0, "m": 60.0, "h": 3600.0}

DEFAULT_THROTTLE_MAX_SECONDS: Final = 3600.0
"""The longest ``Retry-After`` a destination honours unless told."""
MAX_THROTTLES_PER_ROW: Final = 20
"""Throttled attempts of one row that do not count toward its
``max_attempts``; the next one counts as an ordinary failure."""


@dataclasses.dataclass(frozen=True)
class Rate:
    """``count`` attempt starts per ``per_seconds`` (1, 60 or 3600)."""

    count: int
    per_seconds: float

    @property
    def interval(self) -> float:
        """Seconds between starts at the steady rate (the GCRA's emission
        interval)."""
        return self.per_seconds / self.count

    def __str__(self) -> str:
        unit = {1.0: "s", 60.0: "m", 3600.0: "h"}[self.per_seconds]
        return f"{self.count}/{unit}"

    @classmethod
    def parse(cls, value: object, name: str = "rate") -> Rate:
        """``"50/s"``, ``"600/m"``, ``"1000/h"`` (or a :class:`Rate`); any
        other value is a ``ValueError`` naming it."""
        if isinstance(value, Rate):
            return value
        match = _RATE.match(value) if isinstance(value, str) else None
        if match is None:
            raise ValueError(
                f"{name} must be a count per second, minute or hour such as '50/s', "
                f"'600/m' or '1000/h', got {show(value)}"
            )
        count = require_int(name, int(match.group(1)), minimum=1)
        return cls(count, _PERIODS[match.group(2)[0]])


@dataclasses.dataclass(frozen=True)
class Breaker:
    """A circuit breaker: ``failures`` failed attempts in a row (transport
    failures and timeouts; not throttles, not 410) whose first and last are
    at least ``min_span_seconds`` apart open it; after ``cool_down_seconds``
    one probe goes, and each failed probe doubles the cool-down up to
    ``max_cool_down_seconds``. Open for ``disable_after_seconds`` (None:
    never): disabled until an operator enables it."""

    failures: int = 10
    min_span_seconds: float = 60.0
    cool_down_seconds: float = 60.0
    max_cool_down_seconds: float = 3600.0
    disable_after_seconds: float | None = None

    def __post_init__(self) -> None:
        require_int("failures", self.failures, minimum=1)
        require_number("min_span_seconds", self.min_span_seconds, minimum=0)
        require_number("cool_down_seconds", self.cool_down_seconds, minimum=0.001)
        require_number(
            "max_cool_down_seconds",
            self.max_cool_down_seconds,
            minimum=float(self.cool_down_seconds),
        )
        if self.disable_after_seconds is not None:
            require_number("disable_after_seconds", self.disable_after_seconds, minimum=0.001)

    def next_cool_down(self, last: float | None) -> float:
        """The cool-down after a failed probe: twice the last, capped."""
        if last is None:
            return float(self.cool_down_seconds)
        return min(float(self.max_cool_down_seconds), 2 * last)


@dataclasses.dataclass(frozen=True)
class Destination:
    """The policy of one destination (docs/destinations.md). Every limit is
    shared by every worker, process and host on the store.

    ``concurrency``: most ``delivering`` rows at once (a dead worker's rows
    count until their lease ends); None: no limit. ``rate``: attempt starts
    admitted per period (``"50/s"``, ``"600/m"``, ``"1000/h"``, GCRA) with
    ``burst`` starts allowed at once after an idle spell; None: no limit.
    ``throttle_max_seconds``: the longest ``Retry-After`` honoured.
    ``breaker``: a :class:`Breaker` (or its fields as a mapping); None: off."""

    concurrency: int | None = None
    rate: Rate | str | None = None
    burst: int = 1
    throttle_max_seconds: float = DEFAULT_THROTTLE_MAX_SECONDS
    breaker: Breaker | Mapping[str, Any] | None = None

    def __post_init__(self) -> None:
        if self.concurrency is not None:
            require_int("concurrency", self.concurrency, minimum=1)
        if self.rate is not None:
            object.__setattr__(self, "rate", Rate.parse(self.rate))
        require_int("burst", self.burst, minimum=1)
        require_number("throttle_max_seconds", self.throttle_max_seconds, minimum=0)
        if self.breaker is not None and not isinstance(self.breaker, Breaker):
            object.__setattr__(self, "breaker", _breaker(self.breaker, "breaker"))

    @property
    def limits(self) -> bool:
        """Whether a claim has anything to decide for it in the store:
        a shared concurrency, a rate or a breaker."""
        return self.concurrency is not None or self.rate is not None or self.breaker is not None

    @property
    def gcra_rate(self) -> Rate | None:
        """:attr:`rate` as parsed (never a string after construction)."""
        return self.rate if isinstance(self.rate, Rate) else None

    @property
    def gcra_breaker(self) -> Breaker | None:
        """:attr:`breaker` as parsed."""
        return self.breaker if isinstance(self.breaker, Breaker) else None

    def to_dict(self) -> dict[str, Any]:
        """The policy as configuration would spell it (``--json``)."""
        breaker = self.gcra_breaker
        return {
            "concurrency": self.concurrency,
            "rate": None if self.gcra_rate is None else str(self.gcra_rate),
            "burst": self.burst,
            "throttle_max_seconds": self.throttle_max_seconds,
            "breaker": None if breaker is None else dataclasses.asdict(breaker),
        }


UNLIMITED: Final = Destination()
"""The policy of a destination no configuration names (and no ``"*"``)."""

_FIELDS: Final = ("concurrency", "rate", "burst", "throttle_max_seconds", "breaker")
_BREAKER_FIELDS: Final = tuple(field.name for field in dataclasses.fields(Breaker))


def _breaker(value: object, where: str) -> Breaker:
    if isinstance(value, Breaker):
        return value
    if not isinstance(value, Mapping):
        raise TypeError(f"{where} must be a mapping of breaker settings, got {show(value)}")
    unknown = sorted(str(key) for key in value if key not in _BREAKER_FIELDS)
    if unknown:
        raise ValueError(
            f"{where}: unknown setting {show(unknown[0])} (allowed: {', '.join(_BREAKER_FIELDS)})"
        )
    try:
        return Breaker(**{str(key): item for key, item in value.items()})
    except (TypeError, ValueError) as error:
        raise type(error)(f"{where}.{error}") from None


def _destination(value: object, where: str) -> Destination:
    if isinstance(value, Destination):
        return value
    if value is None:
        return UNLIMITED
    if not isinstance(value, Mapping):
        raise TypeError(f"{where} must be a mapping of settings, got {show(value)}")
    unknown = sorted(str(key) for key in value if key not in _FIELDS)
    if unknown:
        raise ValueError(
            f"{where}: unknown setting {show(unknown[0])} (allowed: {', '.join(_FIELDS)})"
        )
    settings = {str(key): item for key, item in value.items()}
    if settings.get("breaker") is not None:
        settings["breaker"] = _breaker(settings["breaker"], f"{where}.breaker")
    try:
        return Destination(**settings)
    except (TypeError, ValueError) as error:
        raise type(error)(f"{where}.{error}") from None


def parse_destinations(value: object, where: str = "destinations") -> dict[str, Destination]:
    """The policies of a configuration's ``destinations`` mapping (or
    ``DispatchWorker``'s ``destinations``): each key a ``deliver_to`` value
    or ``"*"``, each value a :class:`Destination` or its settings as a
    mapping. A bad name or value is a ``ValueError``/``TypeError`` naming
    it (``where.name.setting``); bad values in several destinations, a
    :class:`~trio_dispatch.errors.ConfigError` (a ``ValueError``) holding
    one problem per destination."""
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise TypeError(f"{where} must be a mapping of destination names, got {show(value)}")
    policies: dict[str, Destination] = {}
    errors: list[TypeError | ValueError] = []
    for name, settings in value.items():
        try:
            if name != ANY_DESTINATION:
                try:
                    require_route(name)
                except (TypeError, ValueError) as error:
                    raise type(error)(f"{where}: {error}") from None
            policies[str(name)] = _destination(settings, f"{where}.{name}")
        except (TypeError, ValueError) as error:
            errors.append(error)
    if len(errors) == 1:
        raise errors[0]
    if errors:  # every bad destination, each its own problem (check-config lists them)
        problems = tuple(str(error) for error in errors)
        raise ConfigError("; ".join(problems), problems)
    return policies


def policy_for(policies: Mapping[str, Destination], name: str) -> Destination:
    """The policy of ``deliver_to`` ``name``: its own, else ``"*"``'s, else
    :data:`UNLIMITED`."""
    found = policies.get(name)
    if found is not None:
        return found
    return policies.get(ANY_DESTINATION, UNLIMITED)
