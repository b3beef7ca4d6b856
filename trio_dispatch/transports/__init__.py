"""Transports: how one delivery attempt reaches its destination.

- :mod:`.base`: :class:`Delivery`, :class:`TransportResult` and the
  :class:`Transport` protocol;
- :mod:`.command`: :class:`CommandTransport`, the argv template run as a
  child process that never outlives the worker (:mod:`.process`);
- :mod:`.callables`: an async Python callable as a transport, and one written
  for asyncio run from trio;
- :mod:`.webhook`: :class:`~.webhook.WebhookTransport`, signed HTTP delivery
  (the ``http`` extra; imported on first use).
"""

from __future__ import annotations

import functools
import inspect

from ..redact import looks_secret
from .base import (
    LAST_ERROR_LIMIT,
    NOTIFY_TIMEOUT_SECONDS,
    TRANSPORT_TIMEOUT_SECONDS,
    Adapted,
    BaseTransport,
    Delivery,
    Transport,
    TransportResult,
    clean_error,
    describe_exception,
    is_interrupt,
    keyboard_interrupt,
    must_propagate,
    opened,
    raised_result,
)
from .callables import (
    AsyncioCallableTransport,
    CallableTransport,
    TransportCallable,
    asyncio_transport,
    needs_asyncio_loop,
)
from .command import (
    DEFAULT_KILL_GRACE_SECONDS,
    DEFAULT_OUTPUT_LIMIT,
    DELIVER_TO_PLACEHOLDER,
    NOT_CONFIGURED_ERROR,
    PAYLOAD_PLACEHOLDER,
    ChildEnvironment,
    CommandTransport,
    is_valid_template,
    render_argv,
    template_warnings,
)

__all__ = [
    "DEFAULT_KILL_GRACE_SECONDS",
    "DEFAULT_OUTPUT_LIMIT",
    "DELIVER_TO_PLACEHOLDER",
    "LAST_ERROR_LIMIT",
    "NOTIFY_TIMEOUT_SECONDS",
    "NOT_CONFIGURED_ERROR",
    "PAYLOAD_PLACEHOLDER",
    "TRANSPORT_TIMEOUT_SECONDS",
    "AsyncioCallableTransport",
    "BaseTransport",
    "CallableTransport",
    "ChildEnvironment",
    "CommandTransport",
    "Delivery",
    "Transport",
    "TransportCallable",
    "TransportResult",
    "as_transport",
    "asyncio_transport",
    "clean_error",
    "describe_exception",
    "is_interrupt",
    "is_valid_template",
    "keyboard_interrupt",
    "looks_secret",
    "must_propagate",
    "needs_asyncio_loop",
    "opened",
    "raised_result",
    "render_argv",
    "template_warnings",
]


def _is_async_callable(value: object) -> bool:
    if not callable(value):
        return False
    return inspect.iscoroutinefunction(value) or inspect.iscoroutinefunction(type(value).__call__)


def as_transport(value: object, *, timeout: float = TRANSPORT_TIMEOUT_SECONDS) -> Transport:
    """The transport for a configured value.

    - ``None``, a list or a tuple: a :class:`CommandTransport` with
      ``timeout`` (an invalid template fails at delivery time, not here);
    - an instance of a class with an ``async def __call__`` (a
      :class:`Transport`, including :class:`CommandTransport` and
      :class:`CallableTransport`): returned as is, keeping its own timeout;
    - any other async callable: wrapped in a :class:`CallableTransport` with
      ``timeout``.

    Anything else raises TypeError naming the value.
    """
    if value is None or isinstance(value, list | tuple):
        return CommandTransport(value, timeout=timeout)
    if isinstance(value, CommandTransport | CallableTransport):
        return value
    is_plain_callable = inspect.isroutine(value) or isinstance(value, functools.partial)
    if _is_async_callable(value):
        if is_plain_callable:
            return CallableTransport(value, timeout=timeout)  # type: ignore[arg-type]
        if callable(getattr(value, "opened", None)):
            return value  # type: ignore[return-value]
        return Adapted(value)  # keeps nothing between attempts
    raise TypeError(
        "transport must be an argv template (a non-empty list of str), None, "
        f"or an async callable taking a Delivery; got {value!r}"
    )
