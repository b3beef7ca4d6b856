"""One delivery attempt as the outbox and a transport exchange it: the
:class:`Delivery` a transport is handed and the :class:`TransportResult` it
answers with. It depends on nothing of the package, so the outbox (which
records results) and the transports (which produce them) both build on it
without either importing the other.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Final

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
    before claiming again (:meth:`not_sent`). ``throttled`` means the
    destination asked to be left alone (HTTP 429/503, a callable's
    :class:`~trio_dispatch.errors.Throttled`, a command's exit 75) for
    ``retry_after`` seconds (None: the row's next backoff step): the
    destination waits, the row goes back to ``pending`` and the attempt
    does not count toward ``max_attempts`` (:meth:`throttle`).
    ``cancelled`` marks an attempt its worker cut because an operator
    cancelled the dispatch while it ran (:meth:`cut_by_cancel`): its finish
    records ``cancelled``."""

    ok: bool
    error: str | None = None
    permanent: bool = False
    gone: bool = False
    retry_after: float | None = None
    output: str | None = field(default=None, compare=False)
    local: bool = False
    throttled: bool = False
    cancelled: bool = False

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
        if output is None and cls is TransportResult:
            return _SUCCESS  # immutable: one instance serves every plain success
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
    def throttle(
        cls, message: str, *, retry_after: float | None = None, output: str | None = None
    ) -> TransportResult:
        """The destination asked to be left alone for ``retry_after``
        seconds (None: the row's next backoff step)."""
        text = clean_error(message.strip())
        return cls(
            ok=False,
            error=text or "the destination asked to wait",
            retry_after=retry_after,
            output=output,
            throttled=True,
        )

    @classmethod
    def not_sent(cls, message: str) -> TransportResult:
        """An attempt this machine could not make (a local resource error):
        nothing reached the destination, so it does not count."""
        return cls(ok=False, error=clean_error(message.strip()) or "not sent", local=True)

    @classmethod
    def cut_by_cancel(cls) -> TransportResult:
        """The attempt was cut because an operator cancelled the dispatch
        while it ran (docs/controls.md)."""
        return cls(ok=False, error="cut by an operator's cancel", cancelled=True)


_SUCCESS: Final = TransportResult(ok=True)
"""What :meth:`TransportResult.success` returns without an output."""
