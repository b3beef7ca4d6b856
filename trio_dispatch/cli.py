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
from functools import partial
from pathlib import Path
from typing import Any, Final, NoReturn

import anyio

from ._version import __version__
from .config import (
    CONFIG_ENV_VAR,
    DEFAULT_CONFIG_NAME,
    Config,
    ConfigError,
    find_config_path,
    load_config,
    parse_config,
)
from .lifecycle import DUE_STATUSES, STATUSES, TERMINAL_STATUSES, InvalidTransition, Status
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
from .outbox.reads import (
    ID_PREFIX_CAP,
    MIN_ID_PREFIX,
    awaiting_ack,
    ids_with_prefix,
    is_id_prefix,
    last_reasons,
    status_label,
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
from .times import format_time as format_time
from .times import relative_time as relative_time
from .transports.plugins import transport_plugins
from .validate import INT_MAX
from .web.binding import DEFAULT_HOST, DEFAULT_PORT, Listen, check_binding, parse_listen
from .worker import DispatchWorker

EXIT_OK = 0
EXIT_NOT_APPLIED = 1
EXIT_USAGE = 2

MASK = "<hidden: use --show-token>"

READ_COMMANDS = frozenset({"ls", "show", "history", "stats"})
"""Commands that open the store read-only."""
ID_COMMANDS = frozenset({"show", "history", "ack", "retry", "purge"})
"""Commands that name one dispatch (its id, or a unique prefix of it)."""

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


ARGV_STORE_WARNING: Final = (
    "--db holds a password, which every local user can read in /proc/PID/cmdline "
    "while the command runs: give it with --db-env NAME or the configuration's store"
)


def _prepare(args: argparse.Namespace) -> list[str]:
    """Read what the command takes from outside its argv -- the store from
    ``--db-env NAME``, the ack token from ``--token-stdin`` -- into ``args``,
    and return warnings for the operator (a password in argv). Raises
    :class:`UsageError` for a missing or doubled value."""
    warnings: list[str] = []
    name = getattr(args, "db_env", None)
    if name is not None:
        if args.db:
            raise UsageError("give --db or --db-env, not both")
        value = os.environ.get(name)
        if not value:
            state = "empty" if value == "" else "not set"
            raise UsageError(f"--db-env {visible(repr(name))}: that variable is {state}")
        register_secrets(url_secrets(value))
        args.db = value
    elif args.db and url_secrets(args.db):
        register_secrets(url_secrets(args.db))
        warnings.append(ARGV_STORE_WARNING)
    if args.command == "ack":
        if args.token_stdin:
            if args.token is not None:
                raise UsageError("give TOKEN or --token-stdin, not both")
            args.token = sys.stdin.readline().rstrip("\r\n")
            if not args.token:
                raise UsageError("--token-stdin: no token on standard input")
        elif args.token is None:
            raise UsageError("ack needs the dispatch's TOKEN, or --token-stdin to read it")
    return warnings


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
        for warning in config_warnings(config):
            log.warning("%s", warning)
        async with anyio.create_task_group() as tg:
            with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
                if config.http.listen is not None:  # bound first: a taken port claims nothing
                    from .web.app import WebApp
                    from .web.server import serve_app

                    app = WebApp(db, worker=worker, token=config.http.token)
                    try:
                        url = await tg.start(
                            partial(serve_app, max_connections=config.http.max_connections),
                            app,
                            config.http.listen,
                        )
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
    for warning in args.warnings:
        log.warning("%s", warning)
    anyio.run(serve, config, backend="trio")
    return EXIT_OK


# -- output helpers ----------------------------------------------------------


def _emit_json(document: object) -> None:
    print(json.dumps(document, indent=2, sort_keys=True, default=str))


def _cut(text: str, width: int) -> str:
    text = " ".join(text.split())
    if width <= 0:
        return ""
    return text if len(text) <= width else text[: max(0, width - 1)] + "…"


def _table(
    headers: Sequence[str], rows: Sequence[Sequence[str]], *, flexible: int, wide: bool = False
) -> str:
    """An aligned table. On a terminal, column ``flexible`` is cut to fit
    its width unless ``wide``; written anywhere else (a pipe, a file) every
    value is whole, since a script or a log has no width to fit."""
    widths = [max([len(h)] + [len(r[i]) for r in rows]) for i, h in enumerate(headers)]
    cut = not wide and sys.stdout.isatty()
    if cut:
        total = shutil.get_terminal_size((120, 24)).columns
        fixed = sum(w for i, w in enumerate(widths) if i != flexible) + 2 * (len(headers) - 1)
        widths[flexible] = max(len(headers[flexible]), min(widths[flexible], total - fixed))
    lines = []
    for row in [list(headers), *rows]:
        cells = [
            _cut(cell, widths[i]) if cut and i == flexible else cell for i, cell in enumerate(row)
        ]
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
    reasons = await last_reasons(db, rows)
    if args.json:
        public = [_public_row(r, show_token=False) for r in rows]
        _emit_json(
            {
                "dispatches": [
                    {
                        **{k: r[k] for k in _LS_KEYS},
                        "awaiting_ack": awaiting_ack(r, reasons.get(r["id"])),
                    }
                    for r in public
                ]
            }
        )
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
            visible(status_label(r, reasons.get(r["id"]))),
            f"{r['attempt']}/{r['max_attempts']}",
            format_time(r["next_attempt_at"], now) if r["status"] in DUE_STATUSES else "-",
            visible(r["last_error"] or ""),
        ]
        for r in rows
    ]
    print(
        _table(
            ["ID", "KIND", "DELIVER_TO", "STATUS", "ATTEMPT", "NEXT", "LAST_ERROR"],
            table,
            flexible=6,
            wide=args.wide,
        )
    )
    return EXIT_OK


async def _show(db: Store, args: argparse.Namespace) -> int:
    row = await get_dispatch(db, args.id)
    if row is None:
        raise NotApplied(f"dispatch {args.id!r} not found")
    shown = _public_row(row, show_token=args.show_token)
    reasons = await last_reasons(db, [row])
    waiting = awaiting_ack(row, reasons.get(row["id"]))
    if args.json:
        _emit_json({"dispatch": {**shown, "awaiting_ack": waiting}})
        return EXIT_OK
    now = time.time()
    for key, value in shown.items():
        if key == "payload":
            continue
        if key in ("next_attempt_at", "created_at", "updated_at", "expires_at"):
            text = format_time(None if value is None else float(value), now)
        elif key == "status" and waiting:
            text = f"{visible(value)} (awaiting ack)"
        else:
            text = "-" if value is None else visible(value)
        print(f"{key:<16}{text}")
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
    now = time.time()
    rows = [
        [
            format_time(float(t["created_at"]), now),
            visible(f"{t['previous_status'] or '-'} -> {t['status']}"),
            visible(t["reason_code"]),
            visible(f"{t['source']}/{t['actor']}"),
            visible(t["reason_summary"]),
        ]
        for t in transitions
    ]
    print(_table(["WHEN", "CHANGE", "REASON", "BY", "SUMMARY"], rows, flexible=4, wide=args.wide))
    return EXIT_OK


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
    now = time.time()
    print(f"{'oldest due pending':<28}{'-' if age is None else format_time(now - age, now)}")
    print(f"{'dead letters (last 24 h)':<28}{stats['dead_letters_last_24h']}")
    return EXIT_OK


def config_warnings(config: Config) -> list[str]:
    """What in a valid configuration is likely a mistake: for the command
    transport, a missing ``notify_template`` (every delivery would fail)
    and a template that lets a dispatch's data be read as an option or
    leak through argv. ``check-config`` prints them; the worker logs them
    at start. Each transport's plug-in says what is suspicious in its
    options."""
    return config.transport_warnings()


def _seconds(values: Sequence[float]) -> str:
    return ", ".join(f"{value:g}s" for value in values)


def _print_config(config: Config, path: Path) -> None:
    """``check-config``'s text report: what the worker would run with."""
    print(f"{visible(path)}: ok")
    in_schema = f", schema {config.schema}" if config.schema is not None else ""
    print(
        f"  store: {visible(mask_url(config.store_target()))} "
        f"(durability {config.durability}{in_schema})"
    )
    for line in config.dispatch.plugin.summary(config.dispatch.options):
        print(line)
    schedule = config.dispatch.retry_schedule
    backoff = (
        "not set: min(30 * 2^attempt, 1800)s"
        if schedule is None
        else f"{_seconds(schedule)} (the last repeats)"
    )
    print(f"  retry_schedule: {backoff}")
    worker = config.worker
    cap = worker.per_destination_concurrency
    print(
        f"  worker: tick {worker.tick_seconds:g}s, concurrency {worker.concurrency}, "
        f"batch_size {worker.batch_size}, grace {worker.grace_seconds:g}s, "
        f"retry_jitter {worker.retry_jitter:g}, "
        f"per_destination_concurrency {'none' if cap is None else cap}, "
        f"listen {'on' if worker.listen else 'off'}"
    )
    http = config.http
    print(
        f"  http: {'off' if http.listen is None else f'listen {http.listen}'}, "
        f"token {'set' if http.token else 'none'}, max_connections {http.max_connections}"
    )


def _cmd_check_config(args: argparse.Namespace) -> int:
    path = find_config_path(args.file or args.config)
    if path is None:
        raise UsageError(
            f"no configuration file: give FILE, set ${CONFIG_ENV_VAR}, "
            f"or create ./{DEFAULT_CONFIG_NAME}"
        )
    try:
        config = load_config(path)
    except ConfigError as exc:
        if args.json:  # every problem, one entry each; stderr keeps its one line
            secrets = known_secrets()
            _emit_json(
                {
                    "path": str(path),
                    "valid": False,
                    "errors": [one_line(problem, secrets) for problem in exc.problems],
                }
            )
        raise
    warnings = config_warnings(config)
    transports: dict[str, Any] = {}
    for name, plugin in transport_plugins().items():  # each transport's options, masked
        transports.update(plugin.describe(config.dispatch.transports[name]))
    if args.json:
        _emit_json(
            {
                "path": str(path),
                "valid": True,
                "store": mask_url(config.store_target()),
                "schema": config.schema,
                "durability": config.durability,
                "busy_timeout_seconds": config.busy_timeout_seconds,
                "transport": config.dispatch.transport,
                **transports,
                "retry_schedule": (
                    None
                    if config.dispatch.retry_schedule is None
                    else list(config.dispatch.retry_schedule)
                ),
                "max_body_bytes": config.dispatch.max_body_bytes,
                "worker": dataclasses.asdict(config.worker),
                "http": {
                    "listen": None if config.http.listen is None else str(config.http.listen),
                    "token": config.http.token is not None,
                    "max_connections": config.http.max_connections,
                },
                "log_level": config.log_level,
                "warnings": warnings,
            }
        )
    else:
        _print_config(config, path)
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
    for warning in args.warnings:
        log.warning("%s", warning)

    async def run() -> None:
        from .web.app import WebApp
        from .web.server import serve_app

        async with (
            # snapshot: every request reads on a connection of its own, so an
            # idle database gets no -wal/-shm files and a later commit by
            # another process is seen by the next request (SPEC 12).
            open_store(
                choice.target,
                busy_timeout=choice.busy_timeout,
                read_only=True,
                snapshot=True,
                schema=choice.schema,
            ) as db,
            anyio.create_task_group() as tg,
        ):
            with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
                try:
                    url = await tg.start(
                        partial(serve_app, max_connections=config.http.max_connections),
                        WebApp(db, token=config.http.token),
                        listen,
                    )
                except ValueError as exc:
                    raise UsageError(str(exc)) from None
                log.info("dashboard (read-only) at %s/ for %s", url, db.url)
                async for signum in signals:
                    log.info("%s received: stopping", signal.Signals(signum).name)
                    tg.cancel_scope.cancel()
                    break

    anyio.run(run, backend="trio")
    return EXIT_OK


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
            if args.command in ID_COMMANDS:
                args.id = await _resolve_id(db, args.id, in_history=args.command == "history")
            return await command(db, args)

    return anyio.run(run, backend="trio")


# -- parser ----------------------------------------------------------------------


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        # argparse quotes the offending arguments: one line, escapes visible,
        # a URL's password masked.
        self.exit(EXIT_USAGE, f"{self.prog}: {visible(mask_url(message))}\n")


ID_HELP: Final = (
    f"the dispatch id, or a prefix of at least {MIN_ID_PREFIX} characters that only it starts with"
)


def _global_options(parser: argparse.ArgumentParser, *, after_command: bool) -> None:
    """The options every command takes, before or after its name. After
    it, an option left out keeps what was given before (SUPPRESS: no
    default of the subcommand's overwrites it)."""
    group = (
        parser.add_argument_group("global options (also accepted before the command)")
        if after_command
        else parser
    )
    default: dict[str, Any] = {"default": argparse.SUPPRESS} if after_command else {}
    group.add_argument(
        "--db",
        metavar="PATH",
        help="the store (SQLite file, sqlite:/// or postgresql:// URL; a URL's schema: "
        "?options=-csearch_path%%3DNAME); default: the configuration's store and "
        "schema. Other local users can read argv: give a URL with a "
        "password with --db-env",
        **default,
    )
    group.add_argument(
        "--db-env",
        metavar="NAME",
        help="read the store (as --db) from the environment variable NAME, out of "
        "other users' sight (default: --db, else the configuration's store)",
        **default,
    )
    group.add_argument(
        "--config",
        metavar="FILE",
        help=f"configuration file (default ${CONFIG_ENV_VAR}, then ./{DEFAULT_CONFIG_NAME})",
        **default,
    )
    group.add_argument(
        "--busy-timeout",
        type=_busy_timeout,
        metavar="SECONDS",
        help="how long to wait for another process's lock (default: the "
        f"configuration's busy_timeout_seconds, else "
        f"{DEFAULT_BUSY_TIMEOUT_SECONDS:g})",
        **default,
    )


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="trio-dispatch",
        description="Durable dispatch outbox: the worker, and operator tools that work "
        "directly on the store.",
        epilog="Exit codes: 0 applied/found, 1 not applied or not found, 2 bad usage "
        "or configuration.",
    )
    _global_options(parser, after_command=False)
    parser.add_argument(
        "--version", action="version", version=f"%(prog)s {__version__}", help="print the version"
    )
    commands = parser.add_subparsers(
        dest="command", metavar="COMMAND", required=True, parser_class=_Parser
    )

    def command(name: str, help: str, *, data: bool = True) -> argparse.ArgumentParser:
        sub = commands.add_parser(name, help=help, description=help)
        if data:
            sub.add_argument("--json", action="store_true", help="print one JSON document")
        _global_options(sub, after_command=True)
        sub.set_defaults(handler=_cmd_store)
        return sub

    def wide(sub: argparse.ArgumentParser) -> None:
        sub.add_argument(
            "--wide",
            action="store_true",
            help="never cut a column to the terminal's width (output that is not a "
            "terminal is never cut)",
        )

    ls = command("ls", "list dispatches, newest first")
    ls.add_argument("--status", type=_status_arg, help="only this status (default: every status)")
    ls.add_argument("--kind", help="only this kind (default: every kind)")
    ls.add_argument(
        "--limit",
        type=_positive_int,
        default=DEFAULT_LIST_LIMIT,
        help=f"at most this many (default {DEFAULT_LIST_LIMIT})",
    )
    wide(ls)
    show = command("show", "one dispatch, whole, payload pretty-printed")
    show.add_argument("id", help=ID_HELP)
    show.add_argument("--show-token", action="store_true", help="print the ack token")
    history = command("history", "a dispatch's status transitions, oldest first")
    history.add_argument("id", help=ID_HELP + " (purged dispatches included)")
    wide(history)
    ack = command("ack", "acknowledge a dispatch with its token")
    ack.add_argument("id", help=ID_HELP)
    ack.add_argument(
        "token",
        nargs="?",
        help="the dispatch's ack token, required unless --token-stdin (other local users "
        "can read argv: prefer --token-stdin)",
    )
    ack.add_argument(
        "--token-stdin",
        action="store_true",
        help="read the token from the first line of standard input instead",
    )
    command("retry", "operator retry of a dead_letter or expired dispatch").add_argument(
        "id", help=ID_HELP
    )
    command("purge", "delete one dispatch (recorded in its history)").add_argument(
        "id", help=ID_HELP
    )
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
        help="only these finished statuses (repeatable; default: all four)",
    )
    prune.add_argument("--dry-run", action="store_true", help="count, delete nothing")
    command("stats", "counts per status, oldest due pending, recent dead letters")
    command("migrate", "create the outbox schema, or bring it forward to this version")
    check = command("check-config", "validate a configuration file, reporting every problem")
    check.add_argument(
        "file",
        nargs="?",
        metavar="FILE",
        help=f"the file to check (default: --config, then ${CONFIG_ENV_VAR}, "
        f"then ./{DEFAULT_CONFIG_NAME})",
    )
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
    on stderr (exit 1 or 2), never a traceback. A warning (a password in
    argv) is printed after a command that succeeded, so an error stays the
    one line; the worker and the web server log it at start."""
    parser = build_parser()
    args = parser.parse_args(argv)
    warnings: list[str] = []
    try:
        warnings = _prepare(args)
        args.warnings = warnings if args.command in ("worker", "web") else []
        code = _run(args)
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
    if code == EXIT_OK and not args.warnings:
        for warning in warnings:
            print(f"trio-dispatch: warning: {warning}", file=sys.stderr)
    return code


if __name__ == "__main__":
    raise SystemExit(main())
