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
import re
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Final, Protocol

import anyio

NOTIFY_TIMEOUT_SECONDS: Final = 10.0
LAST_ERROR_LIMIT: Final = 2000
"""Characters of a failure message kept as ``last_error``."""


@dataclass(frozen=True)
class Delivery:
    """What a transport is asked to deliver: one attempt of one dispatch."""

    dispatch_id: str
    kind: str
    deliver_to: str
    attempt: int
    """The row's current attempt, after the claim incremented it."""
    payload: str
    """The stored JSON envelope text, sent as is."""


_UNSTORABLE: Final = re.compile("[\x00\ud800-\udfff]")


OUTPUT_LOG_LIMIT: Final = 200
"""Characters of a transport's own output kept for the worker's log line."""


def clean_error(text: str) -> str:
    """A failure text fit to store on every engine: NUL characters (which
    PostgreSQL text cannot hold) and lone surrogates (which no UTF-8
    database can) replaced by U+FFFD, cut to :data:`LAST_ERROR_LIMIT`
    characters."""
    return _UNSTORABLE.sub("\ufffd", text[:LAST_ERROR_LIMIT])


@dataclass(frozen=True)
class TransportResult:
    """The outcome of one attempt. ``error`` is the text to store as
    ``last_error`` for a failure: NUL characters replaced and cut to
    :data:`LAST_ERROR_LIMIT` characters, however the result was built.
    ``permanent`` marks a failure no retry can fix (the OS refusing the
    argv as too large): the dispatch is dead-lettered at once. ``gone``
    means the destination said it no longer exists (HTTP 410): dead-lettered
    at once with ``dispatch.dead_letter.gone``. ``retry_after`` is the
    destination's own "not before" (HTTP ``Retry-After``), in seconds from
    now: the next attempt waits at least that long (capped at 24 h).
    ``output`` is what the destination answered besides the verdict (the
    start of a command's stdout), for the worker's log: never stored, cut to
    :data:`OUTPUT_LOG_LIMIT` characters. ``local`` marks an attempt that
    never left this machine for want of a local resource (no file
    descriptor, no memory, no process slot when starting a command): the
    row is released, the attempt not counted, and the worker waits a little
    before claiming again (:meth:`not_sent`)."""

    ok: bool
    error: str | None = None
    permanent: bool = False
    gone: bool = False
    retry_after: float | None = None
    output: str | None = field(default=None, compare=False)
    local: bool = False

    def __post_init__(self) -> None:
        if self.error is not None:
            object.__setattr__(self, "error", clean_error(str(self.error)))
        if self.output is not None:
            output = clean_error(str(self.output)[:OUTPUT_LOG_LIMIT]).strip()
            object.__setattr__(self, "output", output or None)
        if self.retry_after is not None:
            wait = float(self.retry_after)
            object.__setattr__(self, "retry_after", max(0.0, wait) if math.isfinite(wait) else None)

    @classmethod
    def success(cls, output: str | None = None) -> TransportResult:
        return cls(ok=True, output=output)

    @classmethod
    def failure(
        cls,
        message: str,
        *,
        permanent: bool = False,
        gone: bool = False,
        retry_after: float | None = None,
    ) -> TransportResult:
        """A failure whose message is stripped and cut to the first
        :data:`LAST_ERROR_LIMIT` characters (never empty)."""
        text = clean_error(message.strip())
        return cls(
            ok=False,
            error=text or "transport failed without a message",
            permanent=permanent,
            gone=gone,
            retry_after=retry_after,
        )

    @classmethod
    def not_sent(cls, message: str) -> TransportResult:
        """An attempt this machine could not make (a local resource error):
        nothing reached the destination, so it does not count."""
        return cls(ok=False, error=clean_error(message.strip()) or "not sent", local=True)


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


def must_propagate(exc: BaseException) -> bool:
    """Whether an exception out of a transport is the caller's business
    rather than a failed attempt: a cancellation of this event loop or a
    KeyboardInterrupt, alone or inside an exception group. Everything else
    -- ``SystemExit`` and ``GeneratorExit`` included -- fails the attempt
    only (SPEC section 12)."""
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
