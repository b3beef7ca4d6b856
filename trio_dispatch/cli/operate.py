"""The commands that change the store: ``ack``, ``retry`` (one row, or a
replay of every failed row filters match), ``cancel`` (one row, or every
waiting or running row filters match), ``purge``, ``prune`` (through
the outbox's operator functions, each recorded with the operator's name)
and ``migrate``. A change not applied (a conflict, a wrong
token, a missing row) is exit 1 with one line on stderr.
"""

from __future__ import annotations

import argparse
import getpass
import os
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any, Final

from ..errors import ActionRefused
from ..lifecycle import TERMINAL_STATUSES, InvalidTransition, Status
from ..outbox import (
    CancelResult,
    ack_dispatch,
    cancel_dispatch,
    cancel_dispatches,
    get_dispatch,
    prune_dispatches,
    purge_dispatch,
    retry_dispatch,
    retry_dispatches,
)
from ..outbox.bulk import BulkAction, Filter, bulk_filter, require_reason
from ..outbox.cancel import DEFAULT_CANCEL_WAIT_SECONDS
from ..redact import known_secrets, one_line, visible
from ..store.base import Store
from ..store.schema import SCHEMA_VERSION
from .output import EXIT_NOT_APPLIED, EXIT_OK, NotApplied, UsageError, emit_json


def _actor(command: str) -> str:
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = f"uid:{os.getuid()}"
    return f"trio-dispatch {command} ({user})"


async def _apply(
    db: Store, args: argparse.Namespace, verb: str, action: Callable[[], Awaitable[bool]]
) -> int:
    error: str | None = None
    try:
        applied = await action()
    except LookupError:
        applied, error = False, f"dispatch {args.id!r} not found"
    except InvalidTransition as exc:
        # A second ack is the common case: say so, not which edge is missing.
        already = args.command == "ack" and exc.from_status == Status.ACKED
        applied, error = False, f"dispatch {args.id!r} is already acked" if already else str(exc)
    except ValueError as exc:  # token mismatch, no ack requested, InvalidTransition
        applied, error = False, str(exc)
    row = await get_dispatch(db, args.id)
    if not applied and error is None:
        error = (
            f"dispatch {args.id!r} not found"
            if row is None
            else f"dispatch {args.id!r} changed concurrently (now {row['status']}); nothing applied"
        )
    if args.json:
        emit_json(
            {
                "id": args.id,
                "applied": applied,
                "error": error,
                "status": None if row is None else row["status"],
            }
        )
    elif applied:
        print(f"{verb} {visible(args.id)}" + ("" if row is None else f": now {row['status']}"))
    if error is not None:
        print(f"trio-dispatch: {one_line(error, known_secrets())}", file=sys.stderr)
    return EXIT_OK if applied else EXIT_NOT_APPLIED


async def cmd_ack(db: Store, args: argparse.Namespace) -> int:
    return await _apply(
        db, args, "acked", lambda: ack_dispatch(db, args.id, args.token, actor=_actor("ack"))
    )


REPLAY_FILTERS: Final = ("deliver_to", "status", "since", "until", "kind", "ordering_key")
"""The options of ``retry`` and ``cancel`` that choose rows instead of an id."""
REPLAY_OPTIONS: Final = (*REPLAY_FILTERS, "dry_run", "expires_in", "reason")
CANCEL_MANY_OPTIONS: Final = (*REPLAY_FILTERS, "dry_run")
"""The options of ``cancel`` that only filters take (``--reason`` goes with both)."""


def _option(name: str) -> str:
    return "--" + name.replace("_", "-")


def check_retry_args(args: argparse.Namespace) -> None:
    """Before the store opens: ``retry ID`` takes no filter, a replay takes
    at least one; ``args.replay`` is the checked filter (None for one id).
    A bad value is a :class:`UsageError` (exit 2); a status that retry does
    not apply to, :class:`NotApplied` (exit 1)."""
    args.replay = _check_filters(args, "retry", REPLAY_OPTIONS)


def check_cancel_args(args: argparse.Namespace) -> None:
    """Before the store opens, as :func:`check_retry_args`: ``cancel ID``
    takes no filter (``--wait`` only with an id), a bulk cancel at least one;
    ``args.replay`` is the checked filter (None for one id)."""
    args.replay = _check_filters(args, "cancel", CANCEL_MANY_OPTIONS)
    if args.replay is not None and args.wait is not None:
        raise UsageError("--wait goes with an id: a cancel by filters does not wait")


def _check_filters(
    args: argparse.Namespace, action: BulkAction, options: tuple[str, ...]
) -> Filter | None:
    given = [
        name
        for name in options
        if getattr(args, name) is not None and getattr(args, name) is not False
    ]
    if args.id is not None:
        if given:
            raise UsageError(
                f"{action} takes an id or filters, not both (got {_option(given[0])} with an id)"
            )
        try:
            require_reason(args.reason)
        except (TypeError, ValueError) as exc:
            raise UsageError(str(exc)) from None
        return None
    if not any(getattr(args, name) is not None for name in REPLAY_FILTERS):
        raise UsageError(
            f"{action} needs a dispatch id, or at least one filter: "
            + ", ".join(_option(name) for name in REPLAY_FILTERS)
        )
    try:
        _, chosen = bulk_filter(
            action,
            args.status,
            args.kind,
            args.ordering_key,
            deliver_to=args.deliver_to,
            since=args.since,
            until=args.until,
        )
        require_reason(args.reason)
    except ActionRefused as exc:
        raise NotApplied(str(exc)) from None
    except (TypeError, ValueError) as exc:
        raise UsageError(str(exc)) from None
    return chosen


async def cmd_retry(db: Store, args: argparse.Namespace) -> int:
    if args.replay is None:
        return await _apply(
            db, args, "retried", lambda: retry_dispatch(db, args.id, actor=_actor("retry"))
        )
    chosen: Filter = args.replay
    # Without --expires-in each row keeps its own expiry (the library's default).
    renew: dict[str, Any] = (
        {} if args.expires_in is None else {"expires_at": time.time() + args.expires_in}
    )
    result = await retry_dispatches(
        db,
        **chosen.terms(),
        dry_run=args.dry_run,
        actor=_actor("retry"),
        reason=args.reason,
        **renew,
    )
    if args.json:
        emit_json({**result.to_dict(), "filter": chosen.to_dict()})
        return EXIT_OK
    what = visible(chosen.describe())
    if result.dry_run:
        print(f"would retry {result.matched} dispatches ({what})")
    else:
        skipped = f"; {result.skipped} had changed meanwhile" if result.skipped else ""
        print(f"retried {result.retried} of {result.matched} matching dispatches ({what}){skipped}")
    return EXIT_OK


async def cmd_cancel(db: Store, args: argparse.Namespace) -> int:
    if args.replay is not None:
        return await _cancel_many(db, args, args.replay)
    wait = DEFAULT_CANCEL_WAIT_SECONDS if args.wait is None else args.wait
    result: CancelResult | None = None
    error: str | None = None
    try:
        result = await cancel_dispatch(
            db, args.id, args.reason, wait_seconds=wait, actor=_actor("cancel")
        )
    except LookupError:
        error = f"dispatch {args.id!r} not found"
    except InvalidTransition as exc:  # too late, or a status with no cancel
        error = str(exc)
    if result is None:
        row = await get_dispatch(db, args.id)
        if args.json:
            status = None if row is None else row["status"]
            emit_json({"id": args.id, "applied": False, "error": error, "status": status})
        print(f"trio-dispatch: {one_line(error, known_secrets())}", file=sys.stderr)
        return EXIT_NOT_APPLIED
    if args.json:
        emit_json({**result.to_dict(), "applied": True, "error": None})
    elif result.cancelled and result.previous == Status.DELIVERING:
        print(f"cancelled {visible(args.id)}: its attempt {result.attempt} was stopped")
    elif result.cancelled:
        print(f"cancelled {visible(args.id)} (it was pending)")
    else:
        print(
            f"cancel of {visible(args.id)} asked for: attempt {result.attempt} is still running "
            f"after {wait:g}s; its worker records it when it stops the attempt, or the next "
            "claim once the attempt's lease ends (unless the attempt succeeds first)"
        )
    return EXIT_OK


async def _cancel_many(db: Store, args: argparse.Namespace, chosen: Filter) -> int:
    result = await cancel_dispatches(
        db,
        **chosen.terms(),
        dry_run=args.dry_run,
        actor=_actor("cancel"),
        reason=args.reason,
    )
    if args.json:
        emit_json({**result.to_dict(), "filter": chosen.to_dict()})
        return EXIT_OK
    what = visible(chosen.describe())
    if result.dry_run:
        print(f"would cancel {result.matched} dispatches ({what})")
        return EXIT_OK
    skipped = f"; {result.skipped} had changed meanwhile" if result.skipped else ""
    print(
        f"cancelled {result.cancelled} and asked {result.requested} running attempts to stop, "
        f"of {result.matched} matching dispatches ({what}){skipped}"
    )
    return EXIT_OK


async def cmd_purge(db: Store, args: argparse.Namespace) -> int:
    return await _apply(
        db, args, "purged", lambda: purge_dispatch(db, args.id, actor=_actor("purge"))
    )


async def cmd_prune(db: Store, args: argparse.Namespace) -> int:
    statuses = sorted({s for group in args.status or [] for s in group}) or None
    try:
        count = await prune_dispatches(
            db,
            older_than=args.older_than,
            statuses=statuses,
            dry_run=args.dry_run,
            actor=_actor("prune"),
        )
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    chosen = statuses or sorted(TERMINAL_STATUSES)
    if args.json:
        emit_json(
            {
                "deleted": count,
                "dry_run": args.dry_run,
                "statuses": chosen,
                "older_than_seconds": args.older_than,
            }
        )
        return EXIT_OK
    age = (
        "the default age (delivered/acked/superseded 7d, dead_letter/expired/cancelled 30d)"
        if args.older_than is None
        else f"{args.older_than:g}s"
    )
    verb = "would delete" if args.dry_run else "deleted"
    print(f"{verb} {count} dispatches ({', '.join(chosen)}) older than {age}")
    return EXIT_OK


async def cmd_migrate(db: Store, args: argparse.Namespace) -> int:
    found = getattr(db, "found_schema_version", None)
    schema: str | None = getattr(db, "schema", None)  # PostgreSQL's, when one is set
    version = SCHEMA_VERSION
    where = visible(db.url) + ("" if schema is None else f" schema {schema}")
    if args.json:
        emit_json(
            {
                "store": db.url,
                "schema": schema,
                "from_version": found,
                "version": version,
                "changed": found != version,
            }
        )
    elif found is None:
        print(f"created the trio_dispatch schema (version {version}) in {where}")
    elif found != version:
        print(f"migrated {where} from schema version {found} to {version}")
    else:
        print(f"{where} is at schema version {version}: nothing to do")
    return EXIT_OK
