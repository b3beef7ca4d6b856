"""The ``trio-dispatch`` command.

Exit codes: 0 applied or found, 1 not applied or not found, 2 bad usage or
configuration. A user error is one line on stderr, never a traceback.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
from collections.abc import Awaitable, Callable, Sequence
from typing import NoReturn

import anyio

from .config import Config, ConfigError, find_config_path, load_config, parse_config
from .store import open_store
from .store.base import Store
from .worker import DispatchWorker

EXIT_OK = 0
EXIT_NOT_APPLIED = 1
EXIT_USAGE = 2

log = logging.getLogger("trio_dispatch")


class UsageError(Exception):
    """Bad usage or configuration: reported on one line, exit 2."""


def _fail(message: str, code: int = EXIT_USAGE) -> NoReturn:
    print(f"trio-dispatch: {message}", file=sys.stderr)
    raise SystemExit(code)


def load_cli_config(explicit: str | None) -> Config:
    """The configuration by SPEC order (``--config``, then
    ``$TRIO_DISPATCH_CONFIG``, then ``./trio-dispatch.yaml``); defaults when
    none exists. A named file that is missing is an error."""
    path = find_config_path(explicit)
    if path is None:
        return parse_config(None)
    return load_config(path)


def configure_logging(level: str) -> None:
    logging.basicConfig(
        level=level,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )


async def serve(
    config: Config,
    *,
    before_start: Callable[[Store], Awaitable[None]] | None = None,
) -> None:
    """Run a worker on the configured store until SIGINT or SIGTERM, then
    shut it down gracefully (grace period, kill, release) and return."""
    async with open_store(config.store_target(), durability=config.durability) as db:
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
    configure_logging(config.log_level)
    anyio.run(serve, config, backend="trio")
    return EXIT_OK


def _cmd_check_config(args: argparse.Namespace) -> int:
    target = args.file or args.config
    path = find_config_path(target)
    if path is None:
        _fail("no configuration file found (give one, set TRIO_DISPATCH_CONFIG, "
              "or create ./trio-dispatch.yaml)")
    config = load_config(path)
    template = config.dispatch.notify_template
    print(f"{path}: ok")
    print(f"  store: {config.store_target()} (durability {config.durability})")
    print(f"  notify_template: {list(template) if template else 'not configured'}")
    return EXIT_OK


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="trio-dispatch", description="Durable dispatch outbox: worker and operator tools."
    )
    parser.add_argument("--config", metavar="FILE", help="configuration file (YAML)")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    worker = commands.add_parser("worker", help="run the delivery worker until SIGINT/SIGTERM")
    worker.set_defaults(handler=_cmd_worker)
    check = commands.add_parser("check-config", help="validate a configuration file")
    check.add_argument("file", nargs="?", metavar="FILE")
    check.set_defaults(handler=_cmd_check_config)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        code: int = args.handler(args)
    except (ConfigError, UsageError) as exc:
        _fail(str(exc))
    except KeyboardInterrupt:  # Ctrl-C before the signal handler was installed
        return 130
    return code


if __name__ == "__main__":
    raise SystemExit(main())
