"""What a transport is and what it answers: the contract between the outbox
and the ways a dispatch reaches its destination.

A transport is handed a :class:`Delivery` and answers with a
:class:`TransportResult`. It knows its protocol (processes, Python
callables, HTTP), never SQL or statuses: the outbox turns the result into a
status change. Every failure a destination can cause is a failed
:class:`TransportResult`, never an exception; cancellation from outside is
never swallowed.
"""

from __future__ import annotations

import abc
import contextlib
import math
from collections.abc import AsyncIterator
from typing import Any, Final, Protocol

import anyio

from ..attempt import LAST_ERROR_LIMIT as LAST_ERROR_LIMIT
from ..attempt import OUTPUT_LOG_LIMIT as OUTPUT_LOG_LIMIT
from ..attempt import Delivery as Delivery
from ..attempt import TransportResult as TransportResult
from ..attempt import clean_error as clean_error
from ..errors import Throttled

TRANSPORT_TIMEOUT_SECONDS: Final = 10.0
"""The default timeout of a transport, in seconds: what one attempt may take
before it is cut (the command and callable transports, the worker's
``timeout_seconds``; the webhook's own default is
:data:`~.webhook.DEFAULT_WEBHOOK_TIMEOUT_SECONDS`). The package's code uses
this name; :data:`NOTIFY_TIMEOUT_SECONDS` is for the public API."""
NOTIFY_TIMEOUT_SECONDS: Final = TRANSPORT_TIMEOUT_SECONDS
"""The public name of :data:`TRANSPORT_TIMEOUT_SECONDS`, kept from the
design this package implements (where the transport was a notify command)."""


class Transport(Protocol):
    """Delivers one attempt. Implementations report destination failures as
    a failed :class:`TransportResult` and let cancellation propagate.

    :meth:`opened` holds what the transport keeps between attempts (an HTTP
    client's connections) for a block: the worker keeps it open for its
    whole run, ``deliver_due_dispatches`` for one pass. Calls made outside
    it still work, each opening what it needs."""

    async def __call__(self, delivery: Delivery) -> TransportResult: ...

    def opened(self) -> contextlib.AbstractAsyncContextManager[object]: ...


class BaseTransport(abc.ABC):
    """What the built-in transports share: :meth:`opened` that holds
    nothing, for a transport with nothing to keep between attempts."""

    @abc.abstractmethod
    async def __call__(self, delivery: Delivery) -> TransportResult: ...

    @contextlib.asynccontextmanager
    async def opened(self) -> AsyncIterator[BaseTransport]:
        yield self


class Adapted(BaseTransport):
    """A caller's transport object that has ``async def __call__`` but no
    :meth:`opened`: it keeps nothing between attempts."""

    def __init__(self, transport: object) -> None:
        self.transport = transport

    def __repr__(self) -> str:
        return repr(self.transport)

    async def __call__(self, delivery: Delivery) -> TransportResult:
        call: Any = self.transport
        result: TransportResult = await call(delivery)
        return result


def timeout_message(timeout: float) -> str:
    return f"timeout after {timeout}s"


def check_timeout(name: str, value: float, *, allow_zero: bool) -> float:
    value = float(value)
    if math.isnan(value) or value < 0 or (value == 0 and not allow_zero):
        allowed = "a number >= 0" if allow_zero else "a number > 0"
        raise ValueError(f"{name} must be {allowed}, got {value!r}")
    return value


def describe_exception(exc: BaseException) -> str:
    """``Type: message`` (or just ``Type``) for a failure text."""
    try:
        text = str(exc)
    except Exception:  # a broken __str__ must not fail the attempt twice
        text = ""
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def raised_result(exc: BaseException) -> TransportResult:
    """The result of an attempt whose transport raised ``exc`` (one that
    need not propagate, :func:`must_propagate`): a
    :class:`~trio_dispatch.errors.Throttled` is a throttle for its
    ``retry_after`` seconds, anything else a failure ``Type: message``. A
    ``retry_after`` that is not a number fails the attempt, naming it."""
    if isinstance(exc, Throttled):
        try:
            return TransportResult.throttle(describe_exception(exc), retry_after=exc.retry_after)
        except (TypeError, ValueError, OverflowError):
            return TransportResult.failure(
                f"Throttled with retry_after={exc.retry_after!r}: not a number of seconds"
            )
    return TransportResult.failure(describe_exception(exc))


def must_propagate(exc: BaseException) -> bool:
    """Whether an exception out of a transport is the caller's business
    rather than a failed attempt: a cancellation of this event loop or a
    KeyboardInterrupt, alone or inside an exception group. Everything else
    -- ``SystemExit`` and ``GeneratorExit`` included -- fails the attempt
    only (docs/security.md)."""
    stop = (anyio.get_cancelled_exc_class(), KeyboardInterrupt)
    if isinstance(exc, BaseExceptionGroup):
        return exc.subgroup(lambda inner: isinstance(inner, stop)) is not None
    return isinstance(exc, stop)


def is_interrupt(exc: BaseException) -> bool:
    """Whether ``exc`` is (or holds) a ``KeyboardInterrupt``: the attempt it
    cut short is given back, and the interrupt still stops the process."""
    if isinstance(exc, BaseExceptionGroup):
        return exc.subgroup(lambda inner: isinstance(inner, KeyboardInterrupt)) is not None
    return isinstance(exc, KeyboardInterrupt)


def keyboard_interrupt(exc: BaseException) -> KeyboardInterrupt | None:
    """The first ``KeyboardInterrupt`` in ``exc`` (itself, or a leaf of an
    exception group), or None."""
    if isinstance(exc, KeyboardInterrupt):
        return exc
    if isinstance(exc, BaseExceptionGroup):
        for inner in exc.exceptions:
            found = keyboard_interrupt(inner)
            if found is not None:
                return found
    return None


@contextlib.asynccontextmanager
async def opened(transport: Transport) -> AsyncIterator[None]:
    """Keep what ``transport`` holds open for the block."""
    async with transport.opened():
        yield
