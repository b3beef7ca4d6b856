"""What a command works on: the configuration found in the order of docs/configuration.md, the store
(``--db``, ``--db-env`` or the configuration's), and the values read from
outside argv (``--db-env``, ``--token-stdin``). Every problem is a
:class:`~.output.UsageError` naming what was tried.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Final

from ..config import (
    CONFIG_ENV_VAR,
    DEFAULT_CONFIG_NAME,
    Config,
    find_config_path,
    load_config,
    parse_config,
)
from ..destinations.policy import Destination
from ..outbox.ordering import DEFAULT_ORDERING_POLICY, OrderingPolicy
from ..redact import register_secrets, url_secrets, visible
from ..schedules.spec import Schedule
from ..store.base import (
    DEFAULT_BUSY_TIMEOUT_SECONDS,
    DEFAULT_NETWORK_TIMEOUT_SECONDS,
    parse_target,
)
from .output import UsageError


def load_cli_config(explicit: str | None) -> Config:
    """The configuration in the order of docs/configuration.md (``--config``, then
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
    ordering: OrderingPolicy = DEFAULT_ORDERING_POLICY
    """The configuration's ``dispatch.ordering.on_dead_letter`` (``block``
    without one): which keys ``ls --blocked`` reports."""
    schedules: tuple[Schedule, ...] = ()
    """The configuration's ``schedules:`` (none with ``--db`` and no
    configuration found): what ``schedules`` lists and acts on."""
    network_timeout: float = DEFAULT_NETWORK_TIMEOUT_SECONDS
    """The configuration's ``network_timeout_seconds`` (PostgreSQL)."""
    destinations: Mapping[str, Destination] = dataclasses.field(default_factory=dict)
    """The configuration's ``destinations:`` (none without one): the
    policies ``destinations`` shows, and the names it knows."""


def resolve_store(
    db: str | None,
    config: str | None,
    busy_timeout: float | None = None,
    *,
    must_exist: bool = True,
) -> StoreChoice:
    """The store an operator command works on: ``--db``, else the ``store``
    of the configuration found (docs/configuration.md); ``busy_timeout`` is
    ``--busy-timeout``, else the ``busy_timeout_seconds`` of the
    configuration found the same way (with ``--db`` too, as the worker
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
            f"{Path.cwd() / DEFAULT_CONFIG_NAME} (not found)"
        )
    if path is not None:
        # The dashboard's tokens and webhook secrets serve no store command:
        # their variables need only be set where the worker or web runs.
        loaded = load_config(path, secrets=False)
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
            from ..store.pg_session import store_schema  # the engine's rule

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
        ordering=loaded.worker.ordering_on_dead_letter
        if loaded is not None
        else DEFAULT_ORDERING_POLICY,
        schedules=loaded.schedules if loaded is not None else (),
        network_timeout=(
            loaded.network_timeout_seconds
            if loaded is not None
            else DEFAULT_NETWORK_TIMEOUT_SECONDS
        ),
        destinations=loaded.destinations if loaded is not None else {},
    )
    if engine == "postgres":
        return choice
    if location == ":memory:":
        raise UsageError(f"{origin} is ':memory:': an operator command needs a database file")
    if must_exist and not Path(location).is_file():
        file = Path(location)
        where = "" if file.is_absolute() else f" (no file at {file.absolute()})"
        raise UsageError(f"store {location!r} ({origin}) does not exist{where}")
    return choice


ARGV_STORE_WARNING: Final = (
    "--db holds a password, which every local user can read in /proc/PID/cmdline "
    "while the command runs: give it with --db-env NAME or the configuration's store"
)


def prepare(args: argparse.Namespace) -> list[str]:
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
