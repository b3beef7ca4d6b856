"""trio_dispatch: a durable dispatch outbox for async Python services.

A producer commits a notification as a database row (``enqueue_dispatch``);
a worker delivers it through a configured transport with leases, bounded
retries and backoff, expiry, dead-lettering and optional consumer
acknowledgement, recording every status change with a reason.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ._version import __version__

if TYPE_CHECKING:  # the names, for type checkers; at run time each loads on first use
    from .backoff import backoff_seconds
    from .config import resolve_notify_template
    from .destinations import (
        Breaker,
        Destination,
        enable_destination,
        pause_destination,
        resume_destination,
    )
    from .errors import (
        AckRefused,
        ActionRefused,
        CancelTooLate,
        ConfigError,
        ConnectionLostError,
        DispatchError,
        DispatchNotFound,
        InvalidTransition,
        SchemaError,
        StoreError,
        Throttled,
        TransactionMisuse,
        WorkerError,
    )
    from .outbox import (
        DEFAULT_MAX_ATTEMPTS,
        CancelManyResult,
        CancelResult,
        EnqueuedId,
        EnqueueResult,
        RetryResult,
        ack_dispatch,
        cancel_dispatch,
        cancel_dispatches,
        enqueue_dispatch,
        enqueue_many,
        get_dispatch,
        list_dispatches,
        list_transitions,
        prune_dispatches,
        purge_dispatch,
        retry_dispatch,
        retry_dispatches,
    )
    from .outbox.enqueue import EnqueueArgs
    from .revival import enqueue_revival_heartbeat
    from .schedules import Schedule
    from .signal import SIGNAL_SCHEMA_VERSION, DispatchSignal, Signal
    from .store import open_store
    from .transports import NOTIFY_TIMEOUT_SECONDS, Delivery, TransportResult, asyncio_transport
    from .worker import DispatchWorker, deliver_due_dispatches

__all__ = [
    "DEFAULT_MAX_ATTEMPTS",
    "NOTIFY_TIMEOUT_SECONDS",
    "SIGNAL_SCHEMA_VERSION",
    "AckRefused",
    "ActionRefused",
    "Breaker",
    "CancelManyResult",
    "CancelResult",
    "CancelTooLate",
    "ConfigError",
    "ConnectionLostError",
    "Delivery",
    "Destination",
    "DispatchError",
    "DispatchNotFound",
    "DispatchSignal",
    "DispatchWorker",
    "EnqueueArgs",
    "EnqueueResult",
    "EnqueuedId",
    "InvalidTransition",
    "RetryResult",
    "Schedule",
    "SchemaError",
    "Signal",
    "StoreError",
    "Throttled",
    "TransactionMisuse",
    "TransportResult",
    "WorkerError",
    "__version__",
    "ack_dispatch",
    "asyncio_transport",
    "backoff_seconds",
    "cancel_dispatch",
    "cancel_dispatches",
    "deliver_due_dispatches",
    "enable_destination",
    "enqueue_dispatch",
    "enqueue_many",
    "enqueue_revival_heartbeat",
    "get_dispatch",
    "list_dispatches",
    "list_transitions",
    "open_store",
    "pause_destination",
    "prune_dispatches",
    "purge_dispatch",
    "resolve_notify_template",
    "resume_destination",
    "retry_dispatch",
    "retry_dispatches",
]

# Where each public name lives. Importing ``trio_dispatch`` (or one of its
# modules, such as ``trio_dispatch.sync``) loads only what that needs: the
# worker, YAML and the web stack load when first named.
_LAZY: dict[str, str] = {
    "ack_dispatch": ".outbox",
    "AckRefused": ".errors",
    "ActionRefused": ".errors",
    "asyncio_transport": ".transports",
    "backoff_seconds": ".backoff",
    "Breaker": ".destinations",
    "cancel_dispatch": ".outbox",
    "cancel_dispatches": ".outbox",
    "CancelManyResult": ".outbox",
    "CancelResult": ".outbox",
    "CancelTooLate": ".errors",
    "Destination": ".destinations",
    "enable_destination": ".destinations",
    "pause_destination": ".destinations",
    "resume_destination": ".destinations",
    "Throttled": ".errors",
    "ConfigError": ".errors",
    "ConnectionLostError": ".errors",
    "DEFAULT_MAX_ATTEMPTS": ".outbox",
    "deliver_due_dispatches": ".worker",
    "Delivery": ".transports",
    "DispatchError": ".errors",
    "DispatchNotFound": ".errors",
    "DispatchSignal": ".signal",
    "DispatchWorker": ".worker",
    "enqueue_dispatch": ".outbox",
    "enqueue_many": ".outbox",
    "EnqueueArgs": ".outbox.enqueue",
    "enqueue_revival_heartbeat": ".revival",
    "EnqueuedId": ".outbox",
    "EnqueueResult": ".outbox",
    "get_dispatch": ".outbox",
    "InvalidTransition": ".errors",
    "list_dispatches": ".outbox",
    "list_transitions": ".outbox",
    "NOTIFY_TIMEOUT_SECONDS": ".transports",
    "open_store": ".store",
    "prune_dispatches": ".outbox",
    "purge_dispatch": ".outbox",
    "resolve_notify_template": ".config",
    "retry_dispatch": ".outbox",
    "retry_dispatches": ".outbox",
    "RetryResult": ".outbox",
    "Schedule": ".schedules",
    "SchemaError": ".errors",
    "Signal": ".signal",
    "SIGNAL_SCHEMA_VERSION": ".signal",
    "StoreError": ".errors",
    "TransactionMisuse": ".errors",
    "TransportResult": ".transports",
    "WorkerError": ".errors",
}


if not TYPE_CHECKING:  # a type checker sees the imports above, and no catch-all

    def __getattr__(name: str) -> object:
        module = _LAZY.get(name)
        if module is None:
            raise AttributeError(f"module 'trio_dispatch' has no attribute {name!r}")
        import importlib

        value = getattr(importlib.import_module(module, __name__), name)
        globals()[name] = value
        return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
