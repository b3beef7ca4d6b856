"""The ``trio-dispatch`` command: the worker, and operator tools that work
directly on the store with no worker running (SPEC section 6).

Exit codes: 0 applied or found, 1 not applied (conflict) or not found, 2 bad
usage or configuration. Every error is one line on stderr naming the bad
value; a user error never prints a traceback. There is no enqueue command:
producers enqueue through the library.
"""

from __future__ import annotations

import argparse
import dataclasses
import getpass
import json
import logging
import os
import re
import shutil
import signal
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any, NoReturn

import anyio

from . import lifecycle as lc
from .config import (
    CONFIG_ENV_VAR,
    DEFAULT_CONFIG_NAME,
    Config,
    ConfigError,
    find_config_path,
    load_config,
    parse_config,
)
from .outbox import (
    DEFAULT_LIST_LIMIT,
    ack_dispatch,
    dispatch_stats,
    get_dispatch,
    list_dispatches,
    list_transitions,
    prune_dispatches,
    purge_dispatch,
    retry_dispatch,
)
from .store import open_store
from .store.base import Store
from .store.sqlite import sqlite_path_from_target
from .worker import DispatchWorker

EXIT_OK = 0
EXIT_NOT_APPLIED = 1
EXIT_USAGE = 2

MASK = "<hidden: use --show-token>"

log = logging.getLogger("trio_dispatch")


class UsageError(Exception):
    """Bad usage or configuration: one line on stderr, exit 2."""


class NotApplied(Exception):
    """Not found or not applied: one line on stderr, exit 1."""


# -- configuration and store resolution -------------------------------------


def load_cli_config(explicit: str | None) -> Config:
    """The configuration by SPEC order (``--config``, then
    ``$TRIO_DISPATCH_CONFIG``, then ``./trio-dispatch.yaml``); defaults when
    none exists. A named file that is missing is an error."""
    path = find_config_path(explicit)
    return parse_config(None) if path is None else load_config(path)


def resolve_store(db: str | None, config: str | None) -> str:
    """The store an operator command works on: ``--db``, else the ``store``
    of the configuration found by SPEC order. The store must already exist:
    a read must never create an empty database. Raises :class:`UsageError`
    naming what was tried."""
    if db:
        target, origin = db, "--db"
    else:
        path = find_config_path(config)
        if path is None:
            env = os.environ.get(CONFIG_ENV_VAR)
            raise UsageError(
                "no store to work on: tried --db (not given), --config (not given), "
                f"${CONFIG_ENV_VAR} ({'empty' if env == '' else 'not set'}), "
                f"./{DEFAULT_CONFIG_NAME} (not found)"
            )
        target, origin = load_config(path).store_target(), f"store of {path}"
    if "://" in target and not target.startswith("sqlite://"):
        return target
    file = sqlite_path_from_target(target)
    if file == ":memory:":
        raise UsageError(f"{origin} is ':memory:': an operator command needs a database file")
    if not Path(file).is_file():
        raise UsageError(f"store {file!r} ({origin}) does not exist")
    return target


def configure_logging(level: str) -> None:
    logging.basicConfig(
        level=level,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )


# -- the worker --------------------------------------------------------------


async def serve(
    config: Config,
    *,
    before_start: Callable[[Store], Awaitable[None]] | None = None,
) -> None:
    """Run a worker on the configured store until SIGINT or SIGTERM, then
    shut it down gracefully (grace period, kill, release) and return."""
    async with open_store(
        config.store_target(),
        durability=config.durability,
        busy_timeout=config.busy_timeout_seconds,
    ) as db:
        worker = DispatchWorker.from_config(db, config)
        async with anyio.create_task_group() as tg:
            with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
                await tg.start(worker.run)
                log.info(
                    "worker started: store=%s concurrency=%d tick=%gs timeout=%gs",
                    db.url, worker.concurrency, worker.tick_seconds, worker.timeout_seconds,
                )
                if before_start is not None:
                    await before_start(db)
                async for signum in signals:
                    log.info("%s received: stopping", signal.Signals(signum).name)
                    tg.cancel_scope.cancel()
                    break
        log.info("worker stopped: %s", " ".join(f"{k}={v}" for k, v in worker.counts.items()))


def _cmd_worker(args: argparse.Namespace) -> int:
    config = load_cli_config(args.config)
    if args.db:
        store = args.db if "://" in args.db else os.path.abspath(args.db)
        config = dataclasses.replace(config, store=store)
    configure_logging(config.log_level)
    anyio.run(serve, config, backend="trio")
    return EXIT_OK


# -- output helpers ----------------------------------------------------------


def _emit_json(document: object) -> None:
    print(json.dumps(document, indent=2, sort_keys=True, default=str))


def relative_time(when: float | None, now: float) -> str:
    """``in 1m05s`` / ``3h02m ago`` / ``now``; ``-`` for None."""
    if when is None:
        return "-"
    delta = when - now
    if abs(delta) < 1:
        return "now"
    seconds = int(abs(delta))
    if seconds < 60:
        text = f"{seconds}s"
    elif seconds < 3600:
        text = f"{seconds // 60}m{seconds % 60:02d}s"
    elif seconds < 86400:
        text = f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
    else:
        text = f"{seconds // 86400}d{seconds % 86400 // 3600:02d}h"
    return f"in {text}" if delta > 0 else f"{text} ago"


def _cut(text: str, width: int) -> str:
    text = " ".join(text.split())
    if width <= 0:
        return ""
    return text if len(text) <= width else text[: max(0, width - 1)] + "…"


def _table(headers: Sequence[str], rows: Sequence[Sequence[str]], *, flexible: int) -> str:
    """An aligned table; column ``flexible`` is cut to fit the terminal."""
    widths = [max([len(h)] + [len(r[i]) for r in rows]) for i, h in enumerate(headers)]
    total = shutil.get_terminal_size((120, 24)).columns
    fixed = sum(w for i, w in enumerate(widths) if i != flexible) + 2 * (len(headers) - 1)
    widths[flexible] = max(len(headers[flexible]), min(widths[flexible], total - fixed))
    lines = []
    for row in [list(headers), *rows]:
        cells = [_cut(cell, widths[i]) if i == flexible else cell for i, cell in enumerate(row)]
        lines.append("  ".join(c.ljust(widths[i]) for i, c in enumerate(cells)).rstrip())
    return "\n".join(lines)


_LS_KEYS = (
    "id", "kind", "deliver_to", "status", "attempt", "max_attempts", "next_attempt_at",
    "created_at", "updated_at", "expires_at", "last_error", "dedup_key", "ack_required",
)


def _public_row(row: dict[str, Any], *, show_token: bool) -> dict[str, Any]:
    out = dict(row)
    out["ack_required"] = bool(out["ack_required"])
    if out.get("ack_token") is not None and not show_token:
        out["ack_token"] = MASK
        payload = out.get("payload")
        if isinstance(payload, dict) and payload.get("ack_token") is not None:
            out["payload"] = {**payload, "ack_token": MASK}
    return out


def _actor(command: str) -> str:
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = f"uid:{os.getuid()}"
    return f"trio-dispatch {command} ({user})"


_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhdw]?)\s*$")
_UNITS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}


def parse_duration(text: str) -> float:
    """``90``, ``45s``, ``30m``, ``12h``, ``7d``, ``2w`` -> seconds."""
    match = _DURATION.match(text)
    if not match:
        raise argparse.ArgumentTypeError(
            f"invalid duration {text!r}: use a number with s, m, h, d or w (e.g. 7d)"
        )
    return float(match.group(1)) * _UNITS[match.group(2)]


def _status_arg(text: str) -> str:
    if text not in lc.STATUSES:
        allowed = ", ".join(sorted(lc.STATUSES))
        raise argparse.ArgumentTypeError(f"invalid status {text!r} (choose from {allowed})")
    return text


# -- operator commands -------------------------------------------------------


async def _ls(db: Store, args: argparse.Namespace) -> int:
    rows = await list_dispatches(db, status=args.status, kind=args.kind, limit=args.limit)
    if args.json:
        public = [_public_row(r, show_token=False) for r in rows]
        _emit_json({"dispatches": [{k: r[k] for k in _LS_KEYS} for r in public]})
        return EXIT_OK
    if not rows:
        print("no dispatches" + (f" with status {args.status}" if args.status else ""))
        return EXIT_OK
    now = time.time()
    table = [
        [
            str(r["id"]), str(r["kind"]), str(r["deliver_to"]), str(r["status"]),
            f"{r['attempt']}/{r['max_attempts']}",
            relative_time(r["next_attempt_at"], now)
            if r["status"] in lc.DUE_STATUSES else "-",
            str(r["last_error"] or ""),
        ]
        for r in rows
    ]
    print(_table(["ID", "KIND", "DELIVER_TO", "STATUS", "ATTEMPT", "NEXT", "LAST_ERROR"],
                 table, flexible=6))
    return EXIT_OK


async def _show(db: Store, args: argparse.Namespace) -> int:
    row = await get_dispatch(db, args.id)
    if row is None:
        raise NotApplied(f"dispatch {args.id!r} not found")
    shown = _public_row(row, show_token=args.show_token)
    if args.json:
        _emit_json({"dispatch": shown})
        return EXIT_OK
    now = time.time()
    for key, value in shown.items():
        if key == "payload":
            continue
        extra = ""
        if key in ("next_attempt_at", "created_at", "updated_at", "expires_at") and value:
            extra = f"  ({relative_time(float(value), now)})"
        print(f"{key:<16}{'-' if value is None else value}{extra}")
    print("payload:")
    print(json.dumps(shown["payload"], indent=2, sort_keys=False))
    return EXIT_OK


async def _history(db: Store, args: argparse.Namespace) -> int:
    transitions = await list_transitions(db, args.id)
    if not transitions:
        raise NotApplied(f"dispatch {args.id!r} has no history")
    if args.json:
        _emit_json({"id": args.id, "transitions": transitions})
        return EXIT_OK
    rows = [
        [
            time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(t["created_at"]))),
            f"{t['previous_status'] or '-'} -> {t['status']}",
            str(t["reason_code"]), f"{t['source']}/{t['actor']}", str(t["reason_summary"]),
        ]
        for t in transitions
    ]
    print(_table(["WHEN", "CHANGE", "REASON", "BY", "SUMMARY"], rows, flexible=4))
    return EXIT_OK


async def _apply(
    db: Store, args: argparse.Namespace, verb: str, action: Callable[[], Awaitable[bool]]
) -> int:
    error: str | None = None
    try:
        applied = await action()
    except LookupError:
        applied, error = False, f"dispatch {args.id!r} not found"
    except ValueError as exc:  # token mismatch, no ack requested, InvalidTransition
        applied, error = False, str(exc)
    row = await get_dispatch(db, args.id)
    if not applied and error is None:
        error = (f"dispatch {args.id!r} not found" if row is None
                 else f"dispatch {args.id!r} changed concurrently (now {row['status']}); "
                      "nothing applied")
    if args.json:
        _emit_json({"id": args.id, "applied": applied, "error": error,
                    "status": None if row is None else row["status"]})
    elif applied:
        print(f"{verb} {args.id}" + ("" if row is None else f": now {row['status']}"))
    if error is not None:
        print(f"trio-dispatch: {error}", file=sys.stderr)
    return EXIT_OK if applied else EXIT_NOT_APPLIED


async def _ack(db: Store, args: argparse.Namespace) -> int:
    return await _apply(db, args, "acked", lambda: ack_dispatch(
        db, args.id, args.token, actor=_actor("ack")))


async def _retry(db: Store, args: argparse.Namespace) -> int:
    return await _apply(db, args, "retried", lambda: retry_dispatch(
        db, args.id, actor=_actor("retry")))


async def _purge(db: Store, args: argparse.Namespace) -> int:
    return await _apply(db, args, "purged", lambda: purge_dispatch(
        db, args.id, actor=_actor("purge")))


async def _prune(db: Store, args: argparse.Namespace) -> int:
    statuses = sorted({s for group in args.status or [] for s in group}) or None
    try:
        count = await prune_dispatches(
            db, older_than=args.older_than, statuses=statuses, dry_run=args.dry_run,
            actor=_actor("prune"),
        )
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    chosen = statuses or sorted(lc.TERMINAL_STATUSES)
    if args.json:
        _emit_json({"deleted": count, "dry_run": args.dry_run, "statuses": chosen,
                    "older_than_seconds": args.older_than})
        return EXIT_OK
    age = ("the default age (delivered/acked 7d, dead_letter/expired 30d)"
           if args.older_than is None else f"{args.older_than:g}s")
    verb = "would delete" if args.dry_run else "deleted"
    print(f"{verb} {count} dispatches ({', '.join(chosen)}) older than {age}")
    return EXIT_OK


async def _stats(db: Store, args: argparse.Namespace) -> int:
    stats = await dispatch_stats(db)
    if args.json:
        _emit_json(stats)
        return EXIT_OK
    for status in ("pending", "delivering", "delivered", "acked", "dead_letter", "expired"):
        print(f"{status:<28}{stats['counts'][status]}")
    print(f"{'total':<28}{stats['total']}")
    age = stats["oldest_due_pending_age_seconds"]
    print(f"{'oldest due pending':<28}"
          f"{'-' if age is None else relative_time(time.time() - age, time.time())}")
    print(f"{'dead letters (last 24 h)':<28}{stats['dead_letters_last_24h']}")
    return EXIT_OK


def _cmd_check_config(args: argparse.Namespace) -> int:
    path = find_config_path(args.file or args.config)
    if path is None:
        raise UsageError(
            f"no configuration file: give FILE, set ${CONFIG_ENV_VAR}, "
            f"or create ./{DEFAULT_CONFIG_NAME}"
        )
    config = load_config(path)
    template = config.dispatch.notify_template
    if args.json:
        _emit_json({
            "path": str(path), "valid": True, "store": config.store_target(),
            "durability": config.durability,
            "notify_template": None if template is None else list(template),
            "timeout_seconds": config.dispatch.timeout_seconds,
            "worker": dataclasses.asdict(config.worker),
            "log_level": config.log_level,
        })
        return EXIT_OK
    print(f"{path}: ok")
    print(f"  store: {config.store_target()} (durability {config.durability})")
    print(f"  notify_template: {list(template) if template else 'not configured'}")
    return EXIT_OK


_STORE_COMMANDS: dict[str, Callable[[Store, argparse.Namespace], Awaitable[int]]] = {
    "ls": _ls, "show": _show, "history": _history, "ack": _ack, "retry": _retry,
    "purge": _purge, "prune": _prune, "stats": _stats,
}


def _cmd_store(args: argparse.Namespace) -> int:
    target = resolve_store(args.db, args.config)
    command = _STORE_COMMANDS[args.command]

    async def run() -> int:
        async with open_store(target) as db:
            return await command(db, args)

    return anyio.run(run, backend="trio")


# -- parser ----------------------------------------------------------------------


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="trio-dispatch",
        description="Durable dispatch outbox: the worker, and operator tools that work "
        "directly on the store.",
        epilog="Exit codes: 0 applied/found, 1 not applied or not found, 2 bad usage "
        "or configuration.",
    )
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--db", metavar="PATH", help="the store (SQLite file or sqlite:/// URL)")
    where.add_argument("--config", metavar="FILE",
                       help=f"configuration file (default ${CONFIG_ENV_VAR}, "
                            f"then ./{DEFAULT_CONFIG_NAME})")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True,
                                     parser_class=_Parser)

    def command(name: str, help: str, *, data: bool = True) -> argparse.ArgumentParser:
        sub = commands.add_parser(name, help=help, description=help)
        if data:
            sub.add_argument("--json", action="store_true", help="print one JSON document")
        sub.set_defaults(handler=_cmd_store)
        return sub

    ls = command("ls", "list dispatches, newest first")
    ls.add_argument("--status", type=_status_arg, help="only this status")
    ls.add_argument("--kind", help="only this kind")
    ls.add_argument("--limit", type=_positive_int, default=DEFAULT_LIST_LIMIT,
                    help=f"at most this many (default {DEFAULT_LIST_LIMIT})")
    show = command("show", "one dispatch, whole, payload pretty-printed")
    show.add_argument("id")
    show.add_argument("--show-token", action="store_true", help="print the ack token")
    command("history", "a dispatch's status transitions, oldest first").add_argument("id")
    ack = command("ack", "acknowledge a dispatch with its token")
    ack.add_argument("id")
    ack.add_argument("token")
    command("retry", "operator retry of a dead_letter or expired dispatch").add_argument("id")
    command("purge", "delete one dispatch (recorded in its history)").add_argument("id")
    prune = command("prune", "delete finished dispatches by age (recorded)")
    prune.add_argument("--older-than", type=parse_duration, metavar="DURATION",
                       help="e.g. 7d, 12h (default: delivered/acked 7d, "
                            "dead_letter/expired 30d)")
    prune.add_argument("--status", type=_status_list, action="append", metavar="STATUS[,...]",
                       help="only these finished statuses (repeatable)")
    prune.add_argument("--dry-run", action="store_true", help="count, delete nothing")
    command("stats", "counts per status, oldest due pending, recent dead letters")
    check = command("check-config", "validate a configuration file")
    check.add_argument("file", nargs="?", metavar="FILE")
    check.set_defaults(handler=_cmd_check_config)
    worker = command("worker", "run the delivery worker until SIGINT/SIGTERM", data=False)
    worker.set_defaults(handler=_cmd_worker)
    return parser


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"invalid limit {text!r}: must be an integer >= 1")
    return value


def _status_list(text: str) -> list[str]:
    return [_status_arg(part.strip()) for part in text.split(",") if part.strip()]


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; return the exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        code: int = args.handler(args)
    except (ConfigError, UsageError) as exc:
        print(f"trio-dispatch: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except NotApplied as exc:
        if getattr(args, "json", False):
            _emit_json({"error": str(exc)})
        print(f"trio-dispatch: {exc}", file=sys.stderr)
        return EXIT_NOT_APPLIED
    except KeyboardInterrupt:  # Ctrl-C outside the worker's own signal handling
        return 130
    except BrokenPipeError:  # e.g. `trio-dispatch ls | head`: the reader left
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_OK
    return code


if __name__ == "__main__":
    raise SystemExit(main())
