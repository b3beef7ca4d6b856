"""trio_dispatch: a durable dispatch outbox for async Python services.

A producer commits a notification as a database row (``enqueue_dispatch``);
a worker delivers it through a configured transport with leases, bounded
retries and backoff, expiry, dead-lettering and optional consumer
acknowledgement, recording every status change with a reason.
"""

from __future__ import annotations

from ._version import __version__
from .backoff import backoff_seconds
from .config import resolve_notify_template
from .lifecycle import InvalidTransition
from .outbox import (
    DEFAULT_MAX_ATTEMPTS,
    EnqueueResult,
    ack_dispatch,
    deliver_due_dispatches,
    enqueue_dispatch,
    enqueue_many,
    get_dispatch,
    list_dispatches,
    list_transitions,
    prune_dispatches,
    purge_dispatch,
    retry_dispatch,
)
from .revival import enqueue_revival_heartbeat
from .signal import SIGNAL_SCHEMA_VERSION, DispatchSignal, Signal
from .store import open_store
from .transports import NOTIFY_TIMEOUT_SECONDS, Delivery, TransportResult, asyncio_transport
from .worker import DispatchWorker

__all__ = [
    "DEFAULT_MAX_ATTEMPTS",
    "NOTIFY_TIMEOUT_SECONDS",
    "SIGNAL_SCHEMA_VERSION",
    "Delivery",
    "DispatchSignal",
    "DispatchWorker",
    "EnqueueResult",
    "InvalidTransition",
    "Signal",
    "TransportResult",
    "__version__",
    "ack_dispatch",
    "asyncio_transport",
    "backoff_seconds",
    "deliver_due_dispatches",
    "enqueue_dispatch",
    "enqueue_many",
    "enqueue_revival_heartbeat",
    "get_dispatch",
    "list_dispatches",
    "list_transitions",
    "open_store",
    "prune_dispatches",
    "purge_dispatch",
    "resolve_notify_template",
    "retry_dispatch",
]
