"""Every error the outbox raises on purpose, under one root.

``except trio_dispatch.DispatchError`` catches them all. Each also subclasses
the built-in that names its kind (``ValueError`` for a bad value,
``LookupError`` for a missing row, ``RuntimeError`` for a store or a worker
that cannot do what was asked), so code that catches the built-ins keeps
working. Bad arguments raise plain ``TypeError``/``ValueError`` naming the
argument, as the API's contract says; this module imports nothing of the
package, so every layer may raise these.
"""

from __future__ import annotations

__all__ = [
    "AckRefused",
    "ActionRefused",
    "CancelTooLate",
    "ConfigError",
    "ConnectionLostError",
    "DispatchError",
    "DispatchNotFound",
    "InvalidTransition",
    "SchemaError",
    "StoreError",
    "TransactionMisuse",
    "WorkerError",
]


class DispatchError(Exception):
    """The root of every error trio_dispatch raises on purpose."""


class DispatchNotFound(DispatchError, LookupError):
    """No dispatch has the given id (it never existed, or was pruned or
    purged)."""

    def __init__(self, dispatch_id: str) -> None:
        self.dispatch_id = dispatch_id
        super().__init__(f"dispatch {dispatch_id!r} not found")


class InvalidTransition(DispatchError, ValueError):
    """A status change that the closed lifecycle graph does not allow."""

    def __init__(self, dispatch_id: str, from_status: str, to_status: str, why: str = "") -> None:
        self.dispatch_id = dispatch_id
        self.from_status = from_status
        self.to_status = to_status
        detail = f": {why}" if why else ""
        super().__init__(
            f"dispatch {dispatch_id}: transition {str(from_status)!r} -> {str(to_status)!r} "
            f"is not allowed{detail}"
        )


class CancelTooLate(InvalidTransition):
    """A cancel that reached a running attempt after it had succeeded: the
    success stands (docs/controls.md). ``from_status`` is what the row
    became (``delivered``, or ``pending`` awaiting its ack)."""

    def __init__(self, dispatch_id: str, status: str, why: str = "") -> None:
        super().__init__(
            dispatch_id, status, "cancelled", f"too late: {why}" if why else "too late"
        )


class AckRefused(DispatchError, ValueError):
    """An acknowledgement the row cannot take: it asked for none, has no
    token, or the token does not match. The message never holds a token."""


class ActionRefused(DispatchError, ValueError):
    """An operator action the matched rows have no edge for (a bulk retry
    of ``delivered`` rows, say): nothing was changed."""


class ConfigError(DispatchError, ValueError):
    """A configuration file that cannot be used.

    The message is one line, starts with the file it concerns and names the
    offending key (as a dotted path) or the YAML position. A file with
    several bad keys is reported whole: ``problems`` holds each one (without
    the file name), and the message joins them with ``"; "``.
    """

    def __init__(self, message: str, problems: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.problems: tuple[str, ...] = problems or (message,)
        """Each problem found, one line each, in file order."""

    @classmethod
    def collected(cls, source: str, problems: list[str]) -> ConfigError:
        """One error for every problem found in ``source``."""
        return cls(f"{source}: {'; '.join(problems)}", tuple(problems))


class StoreError(DispatchError, RuntimeError):
    """A store that cannot be opened or used as asked: a missing or foreign
    database, a server that does not answer, a read-only store asked to
    write. The message is one line and never holds a password."""


class ConnectionLostError(StoreError):
    """The store's connection to its server ended under this unit of work
    (a server restart, a failover, ``pg_terminate_backend``, an idle-session
    timeout). The store reconnects by itself; whether to try the work again
    is the caller's choice, made with :attr:`outcome_unknown`."""

    def __init__(self, message: str, *, outcome_unknown: bool = False) -> None:
        super().__init__(message)
        self.outcome_unknown = outcome_unknown
        """False: nothing of the work was committed (the server rolls back a
        transaction whose session ended before its COMMIT), so running it
        again is safe. True: the connection ended while the COMMIT was on
        its way (or while a lone enqueue, one statement that commits by
        itself, ran), and the work may or may not have been committed; running
        it again may apply it twice (an enqueue with a ``dedup_key`` is safe
        to repeat)."""


class SchemaError(StoreError):
    """The database's schema cannot be used by this version: missing, older
    (run ``trio-dispatch migrate``), newer (upgrade trio_dispatch), or a
    table of the same name that is not the outbox's."""


class TransactionMisuse(DispatchError, RuntimeError):
    """A store transaction used where it cannot be: after it ended, or the
    store passed where the open transaction's handle belongs."""


class WorkerError(DispatchError, RuntimeError):
    """A worker asked to do what it cannot: run twice at once."""


class Throttled(Exception):
    """Raised by a callable transport to say its destination asks to be left
    alone for ``retry_after`` seconds (None: the row's next backoff step):
    no worker starts another attempt to that destination before then (at
    most its ``throttle_max_seconds``), the row goes back to ``pending``
    with ``dispatch.pending.throttled``, and the attempt does not count
    toward ``max_attempts`` (up to 20 per row)."""

    def __init__(self, retry_after: float | None = None, message: str | None = None) -> None:
        self.retry_after = retry_after
        super().__init__(message or "the destination asked to wait")
