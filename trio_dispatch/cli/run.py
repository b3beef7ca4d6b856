"""The long-running commands: ``worker`` (deliveries, and the HTTP
endpoints when asked) and ``web`` (the read-only dashboard alone), each
until SIGINT or SIGTERM; and the logging they set up, with secrets masked.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import logging
import os
import signal
import sys
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Final

import anyio

from ..config import Config, parse_config
from ..redact import SecretFilter, register_secrets, scrubbed_logger, url_secrets
from ..store import open_store
from ..store.base import Store, parse_target
from ..web.binding import DEFAULT_HOST, DEFAULT_PORT, Listen, check_binding, parse_listen
from ..worker import DispatchWorker
from .checkconfig import config_warnings
from .output import EXIT_OK, UsageError
from .target import load_cli_config, resolve_store

log = scrubbed_logger("trio_dispatch")


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
        network_timeout=config.network_timeout_seconds,
        max_body_bytes=config.dispatch.max_body_bytes,
        schema=config.schema,
    ) as db:
        worker = DispatchWorker(db, **config.worker_options())
        for warning in config_warnings(config):
            log.warning("%s", warning)
        async with anyio.create_task_group() as tg:
            with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
                if config.http.listen is not None:  # bound first: a taken port claims nothing
                    from ..web.app import WebApp
                    from ..web.server import serve_app

                    app = WebApp(
                        db,
                        worker=worker,
                        token=config.http.token,
                        operator_token=config.http.operator_token,
                        allowed_hosts=config.http.allowed_hosts,
                    )
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
                    worker.settings.concurrency,
                    worker.settings.tick_seconds,
                    worker.settings.timeout_seconds,
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


def cmd_worker(args: argparse.Namespace) -> int:
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
            from ..store.pg_session import store_schema  # the engine's rule

            schema = store_schema(config.store_target(), config.schema)
            config = dataclasses.replace(config, schema=schema)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    configure_logging(config.log_level)
    for warning in args.warnings:
        log.warning("%s", warning)
    anyio.run(serve, config, backend="trio")
    return EXIT_OK


def cmd_web(args: argparse.Namespace) -> int:
    """The dashboard, /metrics and /healthz alone, until SIGINT or SIGTERM:
    on a store opened read-only, or -- with ``http.operator_token`` -- for
    writing (never creating or migrating), so an operator can act."""
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
        from ..web.app import WebApp
        from ..web.server import serve_app

        acting = config.http.operator_token is not None
        async with (
            # snapshot: every request reads on a connection of its own, so an
            # idle database gets no -wal/-shm files and a later commit by
            # another process is seen by the next request (docs/security.md).
            open_store(
                choice.target,
                busy_timeout=choice.busy_timeout,
                network_timeout=choice.network_timeout,
                read_only=not acting,
                snapshot=not acting,
                migrate=False,
                schema=choice.schema,
            ) as db,
            anyio.create_task_group() as tg,
        ):
            with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
                try:
                    url = await tg.start(
                        partial(serve_app, max_connections=config.http.max_connections),
                        WebApp(
                            db,
                            token=config.http.token,
                            operator_token=config.http.operator_token,
                            ordering=choice.ordering,
                            schedules=choice.schedules,
                            allowed_hosts=config.http.allowed_hosts,
                            destinations=choice.destinations,
                        ),
                        listen,
                    )
                except ValueError as exc:
                    raise UsageError(str(exc)) from None
                mode = "operators may act" if acting else "read-only"
                log.info("dashboard (%s) at %s/ for %s", mode, url, db.url)
                async for signum in signals:
                    log.info("%s received: stopping", signal.Signals(signum).name)
                    tg.cancel_scope.cancel()
                    break

    anyio.run(run, backend="trio")
    return EXIT_OK
