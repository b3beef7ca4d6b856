"""What a failed exchange is called in ``last_error``: short, and never
the URL (it may carry credentials) or a secret."""

from __future__ import annotations

import ssl
from collections.abc import Iterable
from typing import TYPE_CHECKING, Final

from .endpoints import CONTROL_CHARS
from .guard import AddressRefused, ResolutionFailed

if TYPE_CHECKING:
    pass

ERROR_BODY_CHARS: Final = 500
"""Characters of a response body kept in ``last_error``."""


def body_text(data: bytes) -> str:
    text = data.decode("utf-8", errors="replace")[:ERROR_BODY_CHARS]
    return " ".join(CONTROL_CHARS.sub(" ", text).split())


def _root_causes(exc: BaseException) -> Iterable[BaseException]:
    """``exc`` and what it came from: causes, contexts, and the members of
    exception groups (trio reports each address it tried in one)."""
    seen: set[int] = set()
    pending: list[BaseException] = [exc]
    while pending:
        current = pending.pop(0)
        if id(current) in seen:
            continue
        seen.add(id(current))
        yield current
        if isinstance(current, BaseExceptionGroup):
            pending.extend(current.exceptions)
        pending.extend(e for e in (current.__cause__, current.__context__) if e is not None)


def describe_http_error(exc: BaseException, timeout: float) -> str:
    """The error kind of a failed exchange, without URL or secrets."""
    import httpx

    for cause in _root_causes(exc):
        if isinstance(cause, AddressRefused | ResolutionFailed):
            return str(cause)
    if isinstance(exc, httpx.TimeoutException):
        phase = type(exc).__name__.removesuffix("Timeout").lower() or "request"
        return f"timeout after {timeout:g}s ({phase})"
    for cause in _root_causes(exc):
        if isinstance(cause, ssl.SSLCertVerificationError):
            return f"TLS failure: {cause.verify_message or 'certificate verify failed'}"
        if isinstance(cause, ssl.SSLError):
            return f"TLS failure: {cause.reason or type(cause).__name__}"
        if isinstance(cause, ConnectionRefusedError):
            return "connection refused"
    text = " ".join(str(exc).split())
    if isinstance(exc, httpx.ConnectError):
        if "refused" in text.lower():
            return "connection refused"
        return f"connection failed: {text or type(exc).__name__}"
    if isinstance(exc, httpx.RemoteProtocolError):
        return f"protocol error: {text or 'the server broke HTTP/1.1'}"
    if isinstance(exc, httpx.ReadError | httpx.WriteError):
        return f"connection lost: {text or type(exc).__name__}"
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
