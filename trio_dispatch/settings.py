"""The worker's settings, validated once.

:class:`WorkerSettings` is the one object that says how a
:class:`~trio_dispatch.worker.DispatchWorker` runs: the worker keeps it as
``worker.settings`` and reads its fields (no copies), its keyword arguments
go into it by name, and the configuration file's ``worker:`` section (with
``dispatch.retry_schedule``, ``dispatch.ordering.on_dead_letter`` and the
transport's timeout) validates into it as ``Config.worker``.
:data:`SETTING_CHECKS` is the one check per setting that every way in
uses: ``check-config`` accepts exactly what the worker accepts, with the
same limits and the same message under the file's dotted key.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Final, Protocol

from .backoff import check_retry_schedule
from .outbox.delivery import DEFAULT_BATCH_SIZE as DEFAULT_BATCH_SIZE
from .outbox.ordering import DEFAULT_ORDERING_POLICY, OrderingPolicy, require_policy
from .priority import require_step
from .transports import DEFAULT_KILL_GRACE_SECONDS, TRANSPORT_TIMEOUT_SECONDS
from .validate import require_bool, require_int, require_number
from .values import replaced

DEFAULT_CONCURRENCY: Final = 16
DEFAULT_TICK_SECONDS: Final = 30.0
DEFAULT_GRACE_SECONDS: Final = 5.0
CLAIM_LEASE_MARGIN_SECONDS: Final = 5.0
"""A claim's lease is the transport timeout plus this margin (10 + 5 = 15 s)."""
LEASE_SAFETY_SECONDS: Final = 1.0
"""A transport still running this close to its claim's lease end is
cancelled, so no second claimant can ever overlap it."""
MIN_LEASE_MARGIN_SECONDS: Final = LEASE_SAFETY_SECONDS + 0.5
"""The smallest margin: a lease must outlive the transport's own timeout
past the safety cut, or every attempt would be cut before its timeout."""
MIN_SECONDS: Final = 0.001
"""The shortest tick and transport timeout: a millisecond."""


def _count(name: str, value: object) -> int:
    return require_int(name, value, minimum=1)


def _seconds(name: str, value: object) -> float:
    return require_number(name, value, minimum=MIN_SECONDS)


def _grace(name: str, value: object) -> float:
    return require_number(name, value, minimum=0.0)


def _margin(name: str, value: object) -> float:
    return require_number(name, value, minimum=MIN_LEASE_MARGIN_SECONDS)


def _jitter(name: str, value: object) -> float:
    return require_number(name, value, minimum=0.0, maximum=1.0)


def _optional_count(name: str, value: object) -> int | None:
    return None if value is None else _count(name, value)


def _optional_step(name: str, value: object) -> float | None:
    return None if value is None else require_step(name, value)


SETTING_CHECKS: Final[Mapping[str, Callable[[str, object], Any]]] = {
    "concurrency": _count,
    "batch_size": _count,
    "tick_seconds": _seconds,
    "timeout_seconds": _seconds,
    "grace_seconds": _grace,
    "retry_jitter": _jitter,
    "kill_grace_seconds": _grace,
    "lease_margin_seconds": _margin,
    "listen": require_bool,
    "retry_schedule": check_retry_schedule,
    "per_destination_concurrency": _optional_count,
    "ordering_on_dead_letter": require_policy,
    "priority_step_seconds": _optional_step,
}
"""``check(name, value)`` per setting: the value as the worker uses it, or
``TypeError``/``ValueError`` whose message starts with ``name``."""


class _Configured(Protocol):
    """A loaded configuration file, as far as the settings need one."""

    def worker_settings(self) -> WorkerSettings: ...


class ConfiguredWorker(Protocol):
    """A loaded configuration file, as far as a worker needs one (the
    configuration module is the caller's business, not the worker's)."""

    def worker_options(self) -> dict[str, Any]:
        """``DispatchWorker`` keyword arguments, ``settings`` among them."""
        ...


@dataclasses.dataclass(frozen=True)
class WorkerSettings:
    """How a worker runs; every field is checked when the object is built
    (a bad one raises ``TypeError``/``ValueError`` naming it)."""

    concurrency: int = DEFAULT_CONCURRENCY
    """Deliveries running at once."""
    batch_size: int = DEFAULT_BATCH_SIZE
    """Most rows claimed per scan."""
    tick_seconds: float = DEFAULT_TICK_SECONDS
    """Seconds between scans when nothing wakes the worker sooner."""
    timeout_seconds: float = TRANSPORT_TIMEOUT_SECONDS
    """Seconds one transport call may take."""
    grace_seconds: float = DEFAULT_GRACE_SECONDS
    """On shutdown, seconds running deliveries get before they are killed."""
    retry_jitter: float = 0.0
    """Spread of each retry delay, as a fraction of itself (0 to 1)."""
    kill_grace_seconds: float = DEFAULT_KILL_GRACE_SECONDS
    """Seconds between SIGTERM and SIGKILL for a command's process group."""
    listen: bool = True
    """Wake on other processes' enqueues, and hear their cancels of running
    attempts, where the store can tell (without: cancels are read every
    0.5 s while attempts run)."""
    lease_margin_seconds: float = CLAIM_LEASE_MARGIN_SECONDS
    """A claim's lease is ``timeout_seconds`` plus this."""
    retry_schedule: Sequence[float] | None = None
    """Seconds before attempt 2, 3, ... (the last repeats); None:
    ``backoff_seconds``."""
    per_destination_concurrency: int | None = None
    """Most deliveries to one ``deliver_to`` at once; None: no cap below
    ``concurrency``."""
    ordering_on_dead_letter: OrderingPolicy = DEFAULT_ORDERING_POLICY
    """What a key's head that ends ``dead_letter`` or ``expired`` does to the
    rows behind it (docs/ordering.md): ``block`` (they wait for an operator)
    or ``skip`` (the next row goes)."""
    priority_step_seconds: float | None = None
    """The head start of one priority level, in seconds (docs/controls.md),
    which the worker records as the store's when it starts (every enqueue
    reads it there); None: the store's as it is (300 unless set)."""

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            checked = SETTING_CHECKS[field.name](field.name, getattr(self, field.name))
            object.__setattr__(self, field.name, checked)

    @classmethod
    def from_config(cls, config: _Configured) -> WorkerSettings:
        """The settings a loaded configuration file gives (its ``worker``
        section, the transport's timeout, ``dispatch.retry_schedule``)."""
        return config.worker_settings()

    def updated(self, values: Mapping[str, Any], caller: str = "DispatchWorker") -> WorkerSettings:
        """These settings with ``values`` (setting name -> value) in place,
        each checked; an unknown name raises ``TypeError`` naming it."""
        updated: WorkerSettings = replaced(self, values, caller, "settings")
        return updated

    @property
    def lease_seconds(self) -> float:
        """How long a claim owns its row: the timeout plus the margin."""
        return self.timeout_seconds + self.lease_margin_seconds
