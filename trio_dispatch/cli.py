"""The ``trio-dispatch`` command: the worker, and operator tools that work
directly on the store with no worker running (SPEC sections 6 and 12).

Exit codes: 0 applied or found, 1 not applied (conflict) or not found, 2 bad
usage, configuration or an unusable store. Every error is one line on
stderr naming the bad value, with passwords masked and control characters
made visible; no input prints a traceback. Read commands (``ls``, ``show``,
``history``, ``stats``) open the store read-only and never create, migrate
or change it; only ``migrate`` and ``worker`` create or migrate the schema.
There is no enqueue command: producers enqueue through the library.
"""

from __future__ import annotations

import argparse
import dataclasses
import getpass
import importlib.util
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
from typing import Any, Final, NoReturn

import anyio

from .config import (
    CONFIG_ENV_VAR,
    DEFAULT_CONFIG_NAME,
    Config,
    ConfigError,
    find_config_path,
    load_config,
    parse_config,
)
from .lifecycle import DUE_STATUSES, STATUSES, TERMINAL_STATUSES, Status
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
from .redact import (
    SecretFilter,
    known_secrets,
    mask_url,
    one_line,
    register_secrets,
    scrubbed_logger,
    url_secrets,
    visible,
)
from .store import open_store
from .store.base import (
    DEFAULT_BUSY_TIMEOUT_SECONDS,
    Store,
    StoreError,
    check_busy_timeout,
    parse_target,
    store_schema,
)
from .store.schema import SCHEMA_VERSION
from .transports import template_warnings
from .validate import INT_MAX
from .web.binding import DEFAULT_HOST, DEFAULT_PORT, Listen, check_binding, parse_listen
from .worker import DispatchWorker

EXIT_OK = 0
EXIT_NOT_APPLIED = 1
EXIT_USAGE = 2

MASK = "<hidden: use --show-token>"

READ_COMMANDS = frozenset({"ls", "show", "history", "stats"})
"""Commands that open the store read-only."""

log = scrubbed_logger("trio_dispatch")


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


@dataclasses.dataclass(frozen=True)
class StoreChoice:
    """The store an operator command works on, and how to open it."""

    target: str
    busy_timeout: float
    durability: str = "full"
    max_body_bytes: int | None = None
    schema: str | None = None


def resolve_store(
    db: str | None,
    config: str | None,
    busy_timeout: float | None = None,
    *,
    must_exist: bool = True,
) -> StoreChoice:
    """The store an operator command works on: ``--db``, else the ``store``
    of the configuration found by SPEC order; ``busy_timeout`` is
    ``--busy-timeout``, else the ``busy_timeout_seconds`` of the
    configuration found by SPEC order (with ``--db`` too, as the worker
    does). The configuration's ``schema`` goes with its ``store``: a
    ``--db`` URL names its own (``options=-csearch_path%3DNAME``). A SQLite
    store must already exist unless ``must_exist`` is False
    (``migrate``): a read must never create an empty database. Raises
    :class:`UsageError` naming what was tried."""
    loaded: Config | None = None
    path = find_config_path(config)
    if path is None and not db:
        env = os.environ.get(CONFIG_ENV_VAR)
        raise UsageError(
            "no store to work on: tried --db (not given), --config (not given), "
            f"${CONFIG_ENV_VAR} ({'empty' if env == '' else 'not set'}), "
            f"./{DEFAULT_CONFIG_NAME} (not found)"
        )
    if path is not None:
        loaded = load_config(path)
    schema: str | None = None
    if db:
        target, origin = db, "--db"
    else:
        assert loaded is not None and loaded.path is not None
        target, origin = loaded.store_target(), f"store of {loaded.path}"
        schema = loaded.schema
    register_secrets(url_secrets(target))
    try:
        engine, location = parse_target(target)
        if engine == "postgres":
            schema = store_schema(target, schema)
    except ValueError as exc:
        raise UsageError(f"{origin}: {exc}") from None
    wait = (
        busy_timeout
        if busy_timeout is not None
        else (loaded.busy_timeout_seconds if loaded is not None else DEFAULT_BUSY_TIMEOUT_SECONDS)
    )
    choice = StoreChoice(
        target,
        wait,
        durability=loaded.durability if loaded is not None else "full",
        max_body_bytes=loaded.dispatch.max_body_bytes if loaded is not None else None,
        schema=schema,
    )
    if engine == "postgres":
        return choice
    if location == ":memory:":
        raise UsageError(f"{origin} is ':memory:': an operator command needs a database file")
    if must_exist and not Path(location).is_file():
        raise UsageError(f"store {location!r} ({origin}) does not exist")
    return choice


QUIET_LOGGERS: Final = ("httpx", "httpcore", "hypercorn.access", "hypercorn.error")
"""Libraries whose INFO lines would print request URLs (a webhook URL may
carry credentials): only their warnings reach the log."""


def configure_logging(level: str) -> None:
    logging.basicConfig(
        level=level,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    for name in QUIET_LOGGERS:
        logging.getLogger(name).setLevel(max(logging.WARNING, logging.getLevelName(level)))
    for handler in logging.getLogger().handlers:  # every record, whoever logs it
        if not any(isinstance(f, SecretFilter) for f in handler.filters):
            handler.addFilter(SecretFilter())


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
        max_body_bytes=config.dispatch.max_body_bytes,
        schema=config.schema,
    ) as db:
        worker = DispatchWorker(db, **config.worker_options())
        if config.dispatch.transport == "command":
            for warning in template_warnings(config.dispatch.notify_template):
                log.warning("%s", warning)
        async with anyio.create_task_group() as tg:
            with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
                if config.http.listen is not None:  # bound first: a taken port claims nothing
                    from .web.app import WebApp
                    from .web.server import serve_app

                    app = WebApp(db, worker=worker, token=config.http.token)
                    try:
                        url = await tg.start(serve_app, app, config.http.listen)
                    except ValueError as exc:  # the address is taken, say
                        raise UsageError(str(exc)) from None
                    log.info("http: metrics, health and dashboard at %s/", url)
                await tg.start(worker.run)
                log.info(
                    "worker started: store=%s transport=%s concurrency=%d tick=%gs timeout=%gs",
                    db.url,
                    config.dispatch.transport,
                    worker.concurrency,
                    worker.tick_seconds,
                    worker.timeout_seconds,
                )
                if before_start is not None:
                    await before_start(db)
                async for signum in signals:
                    log.info("%s received: stopping", signal.Signals(signum).name)
                    tg.cancel_scope.cancel()
                    break
        log.info("worker stopped: %s", " ".join(f"{k}={v}" for k, v in worker.counts.items()))


def _http_listen(value: str | None, config: Config, option: str) -> Listen | None:
    """``--http``/``--listen`` (or the configuration's ``http.listen``),
    checked: a bad address, a missing web extra, or an address beyond
    loopback without a token is a UsageError."""
    if value is None:
        return config.http.listen
    try:
        listen = parse_listen(option, value)
        check_binding(listen, config.http.token, option)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    missing = [m for m in ("hypercorn", "prometheus_client") if importlib.util.find_spec(m) is None]
    if missing:
        raise UsageError(f"{option} needs {' and '.join(missing)}: install trio_dispatch[web]")
    return listen


def _cmd_worker(args: argparse.Namespace) -> int:
    config = load_cli_config(args.config)
    if args.http is not None:
        http = dataclasses.replace(config.http, listen=_http_listen(args.http, config, "--http"))
        config = dataclasses.replace(config, http=http)
    if args.db:
        store = args.db if "://" in args.db else os.path.abspath(args.db)
        config = dataclasses.replace(config, store=store, schema=None)  # it goes with the store
    if args.busy_timeout is not None:
        config = dataclasses.replace(config, busy_timeout_seconds=args.busy_timeout)
    register_secrets(url_secrets(config.store_target()))
    try:
        if parse_target(config.store_target())[0] == "postgres":
            schema = store_schema(config.store_target(), config.schema)
            config = dataclasses.replace(config, schema=schema)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
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
    "id",
    "kind",
    "deliver_to",
    "status",
    "attempt",
    "max_attempts",
    "next_attempt_at",
    "created_at",
    "updated_at",
    "expires_at",
    "last_error",
    "dedup_key",
    "ack_required",
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
    if text not in STATUSES:
        allowed = ", ".join(sorted(STATUSES))
        raise argparse.ArgumentTypeError(
            f"invalid status {visible(repr(text))} (choose from {allowed})"
        )
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
            visible(r["id"]),
            visible(r["kind"]),
            visible(r["deliver_to"]),
            visible(r["status"]),
            f"{r['attempt']}/{r['max_attempts']}",
            relative_time(r["next_attempt_at"], now) if r["status"] in DUE_STATUSES else "-",
            visible(r["last_error"] or ""),
        ]
        for r in rows
    ]
    print(
        _table(
            ["ID", "KIND", "DELIVER_TO", "STATUS", "ATTEMPT", "NEXT", "LAST_ERROR"],
            table,
            flexible=6,
        )
    )
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
        print(f"{key:<16}{'-' if value is None else visible(value)}{extra}")
    print("payload:")
    # JSON escapes C0 controls itself; the rest (C1, bidi, separators) is made
    # visible line by line ("\n" only: a string may hold U+2028).
    for line in json.dumps(shown["payload"], indent=2, ensure_ascii=False).split("\n"):
        print(visible(line))
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
            visible(f"{t['previous_status'] or '-'} -> {t['status']}"),
            visible(t["reason_code"]),
            visible(f"{t['source']}/{t['actor']}"),
            visible(t["reason_summary"]),
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
        error = (
            f"dispatch {args.id!r} not found"
            if row is None
            else f"dispatch {args.id!r} changed concurrently (now {row['status']}); nothing applied"
        )
    if args.json:
        _emit_json(
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


async def _ack(db: Store, args: argparse.Namespace) -> int:
    return await _apply(
        db, args, "acked", lambda: ack_dispatch(db, args.id, args.token, actor=_actor("ack"))
    )


async def _retry(db: Store, args: argparse.Namespace) -> int:
    return await _apply(
        db, args, "retried", lambda: retry_dispatch(db, args.id, actor=_actor("retry"))
    )


async def _purge(db: Store, args: argparse.Namespace) -> int:
    return await _apply(
        db, args, "purged", lambda: purge_dispatch(db, args.id, actor=_actor("purge"))
    )


async def _prune(db: Store, args: argparse.Namespace) -> int:
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
        _emit_json(
            {
                "deleted": count,
                "dry_run": args.dry_run,
                "statuses": chosen,
                "older_than_seconds": args.older_than,
            }
        )
        return EXIT_OK
    age = (
        "the default age (delivered/acked 7d, dead_letter/expired 30d)"
        if args.older_than is None
        else f"{args.older_than:g}s"
    )
    verb = "would delete" if args.dry_run else "deleted"
    print(f"{verb} {count} dispatches ({', '.join(chosen)}) older than {age}")
    return EXIT_OK


async def _stats(db: Store, args: argparse.Namespace) -> int:
    stats = await dispatch_stats(db)
    if args.json:
        _emit_json(stats)
        return EXIT_OK
    for status in Status:
        print(f"{status:<28}{stats['counts'][status]}")
    print(f"{'total':<28}{stats['total']}")
    age = stats["oldest_due_pending_age_seconds"]
    print(
        f"{'oldest due pending':<28}"
        f"{'-' if age is None else relative_time(time.time() - age, time.time())}"
    )
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
    warnings = template_warnings(template) if config.dispatch.transport == "command" else []
    store = mask_url(config.store_target())
    env = config.dispatch.env
    env_shown: dict[str, Any] = (
        {"inherit": True}
        if env.inherit
        else {"allow": list(env.allow)}
        if env.allow is not None
        else {"default": "all but secret-looking variables"}
    )
    if args.json:
        _emit_json(
            {
                "path": str(path),
                "valid": True,
                "store": store,
                "schema": config.schema,
                "durability": config.durability,
                "busy_timeout_seconds": config.busy_timeout_seconds,
                "transport": config.dispatch.transport,
                "notify_template": None if template is None else list(template),
                "timeout_seconds": config.dispatch.timeout_seconds,
                "retry_schedule": (
                    None
                    if config.dispatch.retry_schedule is None
                    else list(config.dispatch.retry_schedule)
                ),
                "webhook": config.dispatch.webhook.describe(),
                "max_body_bytes": config.dispatch.max_body_bytes,
                "env": env_shown,
                "worker": dataclasses.asdict(config.worker),
                "log_level": config.log_level,
                "warnings": warnings,
            }
        )
    else:
        print(f"{visible(path)}: ok")
        in_schema = f", schema {config.schema}" if config.schema is not None else ""
        print(f"  store: {visible(store)} (durability {config.durability}{in_schema})")
        if config.dispatch.transport == "webhook":
            hook = config.dispatch.webhook.describe()
            print(f"  transport: webhook (timeout {hook['timeout_seconds']:g}s)")
            for route, endpoint in hook["endpoints"].items():
                secrets = ", ".join(endpoint["secrets"])
                private = ", allow_private" if endpoint["allow_private"] else ""
                print(
                    f"    {visible(route)}: {visible(endpoint['url'])} "
                    f"(secrets: {visible(secrets)}{private})"
                )
        else:
            shown = visible(list(template)) if template else "not configured"
            print(f"  notify_template: {shown}")
    for warning in warnings:
        print(f"trio-dispatch: warning: {visible(warning)}", file=sys.stderr)
    return EXIT_OK


async def _migrate(db: Store, args: argparse.Namespace) -> int:
    found = getattr(db, "found_schema_version", None)
    schema: str | None = getattr(db, "schema", None)  # PostgreSQL's, when one is set
    version = SCHEMA_VERSION
    where = visible(db.url) + ("" if schema is None else f" schema {schema}")
    if args.json:
        _emit_json(
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


def _cmd_web(args: argparse.Namespace) -> int:
    """The dashboard, /metrics and /healthz alone, on a store opened
    read-only, until SIGINT or SIGTERM."""
    config = load_cli_config(args.config) if args.config or not args.db else parse_config(None)
    listen = _http_listen(args.listen, config, "--listen")
    if listen is None:
        listen = _http_listen(f"{DEFAULT_HOST}:{DEFAULT_PORT}", config, "--listen")
    assert listen is not None
    choice = resolve_store(args.db, args.config, args.busy_timeout)
    configure_logging(config.log_level)

    async def run() -> None:
        from .web.app import WebApp
        from .web.server import serve_app

        async with (
            open_store(
                choice.target,
                busy_timeout=choice.busy_timeout,
                read_only=True,
                schema=choice.schema,
            ) as db,
            anyio.create_task_group() as tg,
        ):
            with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
                try:
                    url = await tg.start(serve_app, WebApp(db, token=config.http.token), listen)
                except ValueError as exc:
                    raise UsageError(str(exc)) from None
                log.info("dashboard (read-only) at %s/ for %s", url, db.url)
                async for signum in signals:
                    log.info("%s received: stopping", signal.Signals(signum).name)
                    tg.cancel_scope.cancel()
                    break

    anyio.run(run, backend="trio")
    return EXIT_OK


_STORE_COMMANDS: dict[str, Callable[[Store, argparse.Namespace], Awaitable[int]]] = {
    "ls": _ls,
    "show": _show,
    "history": _history,
    "ack": _ack,
    "retry": _retry,
    "purge": _purge,
    "prune": _prune,
    "stats": _stats,
    "migrate": _migrate,
}


def _cmd_store(args: argparse.Namespace) -> int:
    migrating = args.command == "migrate"
    choice = resolve_store(args.db, args.config, args.busy_timeout, must_exist=not migrating)
    command = _STORE_COMMANDS[args.command]

    async def run() -> int:
        async with open_store(
            choice.target,
            busy_timeout=choice.busy_timeout,
            read_only=args.command in READ_COMMANDS,
            migrate=migrating,
            snapshot=args.command in READ_COMMANDS,
            schema=choice.schema,
        ) as db:
            return await command(db, args)

    return anyio.run(run, backend="trio")


# -- parser ----------------------------------------------------------------------


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        # argparse quotes the offending arguments: one line, escapes visible,
        # a URL's password masked.
        self.exit(EXIT_USAGE, f"{self.prog}: {visible(mask_url(message))}\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="trio-dispatch",
        description="Durable dispatch outbox: the worker, and operator tools that work "
        "directly on the store.",
        epilog="Exit codes: 0 applied/found, 1 not applied or not found, 2 bad usage "
        "or configuration.",
    )
    parser.add_argument(
        "--db",
        metavar="PATH",
        help="the store (SQLite file, sqlite:/// or postgresql:// URL); "
        "overrides the configuration's store and schema (a URL's schema: "
        "?options=-csearch_path%%3DNAME)",
    )
    parser.add_argument(
        "--config",
        metavar="FILE",
        help=f"configuration file (default ${CONFIG_ENV_VAR}, then ./{DEFAULT_CONFIG_NAME})",
    )
    parser.add_argument(
        "--busy-timeout",
        type=_busy_timeout,
        metavar="SECONDS",
        help="how long to wait for another process's lock (default: the "
        f"configuration's busy_timeout_seconds, else "
        f"{DEFAULT_BUSY_TIMEOUT_SECONDS:g})",
    )
    commands = parser.add_subparsers(
        dest="command", metavar="COMMAND", required=True, parser_class=_Parser
    )

    def command(name: str, help: str, *, data: bool = True) -> argparse.ArgumentParser:
        sub = commands.add_parser(name, help=help, description=help)
        if data:
            sub.add_argument("--json", action="store_true", help="print one JSON document")
        sub.set_defaults(handler=_cmd_store)
        return sub

    ls = command("ls", "list dispatches, newest first")
    ls.add_argument("--status", type=_status_arg, help="only this status")
    ls.add_argument("--kind", help="only this kind")
    ls.add_argument(
        "--limit",
        type=_positive_int,
        default=DEFAULT_LIST_LIMIT,
        help=f"at most this many (default {DEFAULT_LIST_LIMIT})",
    )
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
    prune.add_argument(
        "--older-than",
        type=parse_duration,
        metavar="DURATION",
        help="e.g. 7d, 12h (default: delivered/acked 7d, dead_letter/expired 30d)",
    )
    prune.add_argument(
        "--status",
        type=_status_list,
        action="append",
        metavar="STATUS[,...]",
        help="only these finished statuses (repeatable)",
    )
    prune.add_argument("--dry-run", action="store_true", help="count, delete nothing")
    command("stats", "counts per status, oldest due pending, recent dead letters")
    command("migrate", "create the outbox schema, or bring it forward to this version")
    check = command("check-config", "validate a configuration file")
    check.add_argument("file", nargs="?", metavar="FILE")
    check.set_defaults(handler=_cmd_check_config)
    worker = command("worker", "run the delivery worker until SIGINT/SIGTERM", data=False)
    worker.add_argument(
        "--http",
        metavar="HOST:PORT",
        help="also serve /metrics, /healthz and the dashboard there (default: the "
        "configuration's http.listen); beyond loopback it needs http.token",
    )
    worker.set_defaults(handler=_cmd_worker)
    web = command("web", "serve the read-only dashboard, /metrics and /healthz", data=False)
    web.add_argument(
        "--listen",
        metavar="HOST:PORT",
        help="where to listen (default: the configuration's http.listen, else "
        "127.0.0.1:9464); beyond loopback it needs http.token",
    )
    web.set_defaults(handler=_cmd_web)
    return parser


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if not 1 <= value <= INT_MAX:
        raise argparse.ArgumentTypeError(
            f"invalid limit {visible(repr(text))}: must be an integer from 1 to {INT_MAX}"
        )
    return value


def _busy_timeout(text: str) -> float:
    try:
        return check_busy_timeout(float(text), "--busy-timeout")
    except ValueError as exc:
        raise argparse.ArgumentTypeError(visible(str(exc))) from None


def _status_list(text: str) -> list[str]:
    statuses = [_status_arg(part.strip()) for part in text.split(",") if part.strip()]
    if not statuses:
        raise argparse.ArgumentTypeError(
            f"invalid status list {visible(repr(text))}: name at least one status"
        )
    return statuses


def _leaves(exc: BaseException) -> list[BaseException]:
    if isinstance(exc, BaseExceptionGroup):
        return [leaf for inner in exc.exceptions for leaf in _leaves(inner)]
    return [exc]


def _fail(message: object, code: int = EXIT_USAGE) -> int:
    print(f"trio-dispatch: {one_line(message, known_secrets())}", file=sys.stderr)
    return code


def _run(args: argparse.Namespace) -> int:
    try:
        code: int = args.handler(args)
    except BaseExceptionGroup as group:  # from a task group: report what is inside
        leaves = _leaves(group)
        if len(leaves) == 1 and isinstance(leaves[0], Exception):
            raise leaves[0] from None
        raise
    return code


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; return the exit code. Every error is one line
    on stderr (exit 1 or 2), never a traceback."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return _run(args)
    except NotApplied as exc:
        if getattr(args, "json", False):
            _emit_json({"error": one_line(exc, known_secrets())})
        return _fail(exc, EXIT_NOT_APPLIED)
    except (ConfigError, UsageError, StoreError) as exc:
        return _fail(exc)
    except KeyboardInterrupt:  # Ctrl-C outside the worker's own signal handling
        return 130
    except BrokenPipeError:  # e.g. `trio-dispatch ls | head`: the reader left
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_OK
    except (ValueError, TypeError) as exc:  # a value the library refused
        return _fail(exc)
    except Exception as exc:  # a database or OS error: still one line, never a traceback
        return _fail(f"{type(exc).__name__}: {exc}")


if __name__ == "__main__":
    raise SystemExit(main())
