"""Running a store command: open the store as the command needs (read-only
for reads, migrating for ``migrate``), resolve a dispatch id prefix, and
call the command's function from :mod:`.read` or :mod:`.operate`.
"""

from __future__ import annotations

import argparse
from collections.abc import Awaitable, Callable

import anyio

from ..outbox.reads import ID_PREFIX_CAP, MIN_ID_PREFIX, ids_with_prefix, is_id_prefix
from ..redact import visible
from ..store import open_store
from ..store.base import Store
from .destinations import check_destinations_args, cmd_destinations
from .destinations import is_read as destinations_read
from .operate import (
    check_cancel_args,
    check_retry_args,
    cmd_ack,
    cmd_cancel,
    cmd_migrate,
    cmd_prune,
    cmd_purge,
    cmd_retry,
)
from .output import UsageError
from .read import cmd_history, cmd_ls, cmd_show, cmd_stats
from .schedules import check_schedules_args, cmd_schedules, is_read
from .target import resolve_store

READ_COMMANDS = frozenset({"ls", "show", "history", "stats"})
"""Commands that open the store read-only (and ``schedules`` with no action,
``destinations`` with none or ``show``)."""
ID_COMMANDS = frozenset({"show", "history", "ack", "retry", "cancel", "purge"})
"""Commands that name one dispatch (its id, or a unique prefix of it)."""


async def _resolve_id(db: Store, text: str, *, in_history: bool) -> str:
    """The dispatch id ``text`` names: itself, or the one id that starts
    with it (at least :data:`MIN_ID_PREFIX` hex characters; ``history``
    also finds purged dispatches). A prefix that matches nothing is
    returned as given (the command then reports it not found); one that
    matches several, or is too short to try, is a :class:`UsageError`."""
    if not is_id_prefix(text):
        return text
    shown = visible(repr(text))
    if len(text) < MIN_ID_PREFIX:
        raise UsageError(
            f"id prefix {shown} is too short: give at least {MIN_ID_PREFIX} characters of the id"
        )
    matches = await ids_with_prefix(db, text, in_history=in_history, cap=ID_PREFIX_CAP)
    if text.lower() in matches:
        return text.lower()
    if len(matches) > 1:
        count = f"{len(matches)} or more" if len(matches) >= ID_PREFIX_CAP else len(matches)
        raise UsageError(f"id prefix {shown} matches {count} dispatches: give more of the id")
    return matches[0] if matches else text


STORE_COMMANDS: dict[str, Callable[[Store, argparse.Namespace], Awaitable[int]]] = {
    "ls": cmd_ls,
    "show": cmd_show,
    "history": cmd_history,
    "ack": cmd_ack,
    "retry": cmd_retry,
    "cancel": cmd_cancel,
    "purge": cmd_purge,
    "prune": cmd_prune,
    "stats": cmd_stats,
    "migrate": cmd_migrate,
    "schedules": cmd_schedules,
    "destinations": cmd_destinations,
}


def cmd_store(args: argparse.Namespace) -> int:
    if args.command == "retry":
        check_retry_args(args)  # bad usage says so before any store is looked for
    if args.command == "cancel":
        check_cancel_args(args)
    migrating = args.command == "migrate"
    choice = resolve_store(args.db, args.config, args.busy_timeout, must_exist=not migrating)
    command = STORE_COMMANDS[args.command]
    args.ordering = choice.ordering
    reading = args.command in READ_COMMANDS
    if args.command == "schedules":
        check_schedules_args(args, choice)
        reading = is_read(args)
    if args.command in ("retry", "cancel"):
        reading = args.dry_run  # a dry run only counts: the store opens read-only
    if args.command == "destinations":
        check_destinations_args(args, choice)
        reading = destinations_read(args)

    async def run() -> int:
        async with open_store(
            choice.target,
            busy_timeout=choice.busy_timeout,
            network_timeout=choice.network_timeout,
            read_only=reading,
            migrate=migrating,
            snapshot=reading,
            schema=choice.schema,
        ) as db:
            if args.command in ID_COMMANDS and args.id is not None:
                args.id = await _resolve_id(db, args.id, in_history=args.command == "history")
            return await command(db, args)

    return anyio.run(run, backend="trio")
