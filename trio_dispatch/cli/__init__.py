"""The ``trio-dispatch`` command: the worker, and operator tools that work
directly on the store with no worker running (docs/cli.md, docs/security.md).

Exit codes: 0 applied or found, 1 not applied (conflict) or not found, 2 bad
usage, configuration or an unusable store. Every error is one line on
stderr naming the bad value, with passwords masked and control characters
made visible; no input prints a traceback. Read commands (``ls``, ``show``,
``history``, ``stats``, ``schedules`` without an action, ``destinations``
without one or with ``show``) open the store
read-only and never create, migrate or change it; only ``migrate`` and
``worker`` create or migrate the schema. There is no enqueue command:
producers enqueue through the library.

The package, one concern per module: :mod:`.parser` (the grammar),
:mod:`.target` (which configuration and store), :mod:`.stores` (running a
store command), :mod:`.read` and :mod:`.operate` (those commands),
:mod:`.schedules` (``schedules``: list, pause, resume, run),
:mod:`.destinations` (``destinations``: list, show, pause, resume, enable),
:mod:`.checkconfig`, :mod:`.run` (``worker`` and ``web``), :mod:`.output`
(exit codes, errors, JSON and tables). This module is the entry point:
parse, run the command, and turn every error into its one line.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from ..config import ConfigError
from ..redact import known_secrets, one_line
from ..store.base import StoreError
from ..times import format_time as format_time
from ..times import relative_time as relative_time
from .checkconfig import config_warnings as config_warnings
from .output import EXIT_NOT_APPLIED as EXIT_NOT_APPLIED
from .output import EXIT_OK as EXIT_OK
from .output import EXIT_USAGE as EXIT_USAGE
from .output import NotApplied as NotApplied
from .output import UsageError as UsageError
from .output import emit_json
from .parser import build_parser as build_parser
from .parser import parse_duration as parse_duration
from .run import configure_logging as configure_logging
from .run import serve as serve
from .target import load_cli_config as load_cli_config
from .target import prepare
from .target import resolve_store as resolve_store


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
        warnings = prepare(args)
        args.warnings = warnings if args.command in ("worker", "web") else []
        code = _run(args)
    except NotApplied as exc:
        if getattr(args, "json", False):
            emit_json({"error": one_line(exc, known_secrets())})
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
