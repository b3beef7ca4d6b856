"""In-process transports (docs/usage.md): an async Python callable in place of a
command, and one written for asyncio run under a trio worker through
trio-asyncio."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Final

import anyio
import sniffio

from .. import tracing
from .base import (
    TRANSPORT_TIMEOUT_SECONDS,
    BaseTransport,
    Delivery,
    TransportResult,
    check_timeout,
    must_propagate,
    raised_result,
    timeout_message,
)

TransportCallable = Callable[[Delivery], Awaitable[object]]


class CallableTransport(BaseTransport):
    """Wraps ``async def fn(delivery: Delivery) -> object`` as a transport.

    Returning ``False`` is the failure ``transport returned False``; returning
    a :class:`TransportResult` reports it as is; returning anything else is
    success. Raising :class:`~trio_dispatch.errors.Throttled` is a throttle
    (the destination asked to be left alone for its ``retry_after``
    seconds). Any other exception (not a cancellation) is a failure whose
    message is ``f"{type(exc).__name__}: {exc}"``. The call runs under ``timeout``;
    running past it is the failure ``timeout after <timeout>s``.

    Cancellation from outside propagates unchanged.
    """

    def __init__(
        self, fn: TransportCallable, *, timeout: float = TRANSPORT_TIMEOUT_SECONDS
    ) -> None:
        if not callable(fn):
            raise TypeError(f"transport callable must be callable, got {fn!r}")
        self.fn = fn
        self.timeout = check_timeout("timeout", timeout, allow_zero=False)

    def __repr__(self) -> str:
        return f"CallableTransport({self.fn!r}, timeout={self.timeout!r})"

    async def __call__(self, delivery: Delivery) -> TransportResult:
        with anyio.move_on_after(self.timeout) as scope:
            return await self.call_in_scope(delivery)
        assert scope.cancelled_caught
        return TransportResult.failure(timeout_message(self.timeout))

    async def call_in_scope(self, delivery: Delivery) -> TransportResult:
        """The call without a cancel scope of its own: for a caller whose
        scope already ends within :attr:`timeout` and reports a cut there as
        this transport's timeout (the worker: one scope an attempt, not two)."""
        try:
            outcome = await self._invoke(delivery)
        except BaseException as exc:
            if must_propagate(exc):
                raise
            if tracing.ACTIVE:
                tracing.transport_raised(exc)
            return raised_result(exc)
        if outcome is False:
            return TransportResult.failure("transport returned False")
        if isinstance(outcome, TransportResult):
            return outcome
        return TransportResult.success()

    async def _invoke(self, delivery: Delivery) -> object:
        return await self.fn(delivery)


class AsyncioCallableTransport(CallableTransport):
    """A :class:`CallableTransport` for a callable written for asyncio (one
    that uses ``asyncio.sleep``, asyncio streams or an asyncio client).

    Under asyncio it is awaited directly. Under trio it runs through
    trio-asyncio: on the loop of an enclosing ``trio_asyncio.open_loop()``
    (:class:`~trio_dispatch.worker.DispatchWorker` opens one for its whole
    run), else on a loop opened for this one call. Trio cancellation and the
    timeout reach the asyncio task as an asyncio cancellation.
    """

    needs_asyncio_loop: Final = True

    async def _invoke(self, delivery: Delivery) -> object:
        if sniffio.current_async_library() != "trio":
            return await self.fn(delivery)
        import trio_asyncio  # only where asyncio code runs under trio (~0.1 s to import)

        if trio_asyncio.current_loop.get() is not None:
            return await trio_asyncio.aio_as_trio(self.fn)(delivery)
        async with trio_asyncio.open_loop():
            return await trio_asyncio.aio_as_trio(self.fn)(delivery)


def asyncio_transport(
    fn: TransportCallable, *, timeout: float = TRANSPORT_TIMEOUT_SECONDS
) -> AsyncioCallableTransport:
    """Mark an asyncio-only async callable as a transport (docs/usage.md), so a
    trio worker runs it through trio-asyncio."""
    return AsyncioCallableTransport(fn, timeout=timeout)


def needs_asyncio_loop(transport: object) -> bool:
    """Whether ``transport`` must run inside a trio-asyncio loop under trio."""
    return bool(getattr(transport, "needs_asyncio_loop", False))
