"""``check-config``: validate a configuration file, report every problem,
and show what the worker would run with (secrets masked); also the warnings
about a valid configuration that the worker logs at start.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from ..config import (
    CONFIG_ENV_VAR,
    DEFAULT_CONFIG_NAME,
    WORKER_KEYS,
    Config,
    ConfigError,
    HttpConfig,
    find_config_path,
    load_config,
)
from ..destinations.listing import policy_text
from ..destinations.policy import ANY_DESTINATION, Destination
from ..redact import known_secrets, mask_url, one_line, visible
from ..schedules.runs import iso
from ..schedules.spec import Schedule
from ..times import format_time
from ..transports.plugins import transport_plugins
from ..web.binding import AllowedHosts
from .output import EXIT_OK, UsageError, emit_json


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


def _schedule_document(schedule: Schedule, now: float) -> dict[str, Any]:
    fire = schedule.next_fire(now)
    return {
        **schedule.describe(),
        "next_fire": None if fire is None else iso(fire),
    }


def _print_schedules(schedules: Sequence[Schedule], now: float) -> None:
    if not schedules:
        print("  schedules: none")
        return
    print(f"  schedules: {len(schedules)}")
    for schedule in schedules:
        print(
            f"    {visible(schedule.name)}: {visible(schedule.cadence)} "
            f"({visible(schedule.timezone)}), "
            f"kind {visible(schedule.kind)} to {visible(schedule.deliver_to)}, "
            f"missed {schedule.missed} (catch-up {schedule.catch_up_seconds:g}s), "
            f"{_coalescing(schedule)}"
            f"next fire {format_time(schedule.next_fire(now), now)}"
        )


def _coalescing(schedule: Schedule) -> str:
    """How a schedule's dispatches coalesce (docs/controls.md), or nothing."""
    if schedule.coalesce_key is None:
        return ""
    mode = schedule.coalesce or "keep"
    said = f"coalesce {mode} by key {visible(schedule.coalesce_key)}"
    if mode == "debounce":
        said += f" ({schedule.coalesce_seconds:g}s"
        wait = schedule.coalesce_max_wait_seconds
        said += ")" if wait is None else f", at most {wait:g}s)"
    return said + ", "


def _by_name(policies: Mapping[str, Destination]) -> list[tuple[str, Destination]]:
    """The policies, ``"*"`` (the defaults) first, then by name."""
    return sorted(policies.items(), key=lambda item: (item[0] != ANY_DESTINATION, item[0]))


def _print_destinations(policies: Mapping[str, Destination]) -> None:
    if not policies:
        print("  destinations: none (no shared limits)")
        return
    print(f"  destinations: {len(policies)}")
    for name, policy in _by_name(policies):
        label = '"*" (every other deliver_to)' if name == ANY_DESTINATION else visible(name)
        print(f"    {label}: {policy_text(policy)}")


def _worker_document(config: Config) -> dict[str, Any]:
    """The ``worker:`` section as the worker runs with it (``--json``)."""
    return {
        key.removeprefix("worker."): getattr(config.worker, name)
        for key, name in WORKER_KEYS.items()
        if key.startswith("worker.")
    }


def _allowed_hosts(http: HttpConfig) -> str:
    """The ``Host`` values the server would answer to, for people."""
    if http.allowed_hosts is not None:
        return ", ".join(http.allowed_hosts)
    if http.listen is None or http.listen.port == 0:
        return "the listener's own names on its port"
    return f"the listener's own: {AllowedHosts.of_listener(http.listen)}"


def _print_config(config: Config, path: Path) -> None:
    """``check-config``'s text report: what the worker would run with."""
    print(f"{visible(path)}: ok")
    in_schema = f", schema {config.schema}" if config.schema is not None else ""
    target = config.store_target()
    waits = f", busy timeout {config.busy_timeout_seconds:g}s"
    if target.startswith(("postgresql://", "postgres://")):
        waits += (
            f", a round trip unanswered after "
            f"{config.busy_timeout_seconds + config.network_timeout_seconds:g}s is dropped"
        )
    print(
        f"  store: {visible(mask_url(target))} (durability {config.durability}{in_schema}{waits})"
    )
    for line in config.dispatch.plugin.summary(config.dispatch.options):
        print(line)
    worker = config.worker
    schedule = worker.retry_schedule
    backoff = (
        "not set: min(30 * 2^attempt, 1800)s"
        if schedule is None
        else f"{_seconds(schedule)} (the last repeats)"
    )
    print(f"  retry_schedule: {backoff}")
    print(f"  ordering: on_dead_letter {worker.ordering_on_dead_letter}")
    step = worker.priority_step_seconds
    print(
        "  priority_step_seconds: "
        + (
            "null: the store's, as it is"
            if step is None
            else f"{step:g}s (a row of priority p goes as if due p x {step:g}s sooner; "
            "the worker records it in the store)"
        )
    )
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
        f"token {'set' if http.token else 'none'}, "
        f"operator_token {'set' if http.operator_token else 'none'} "
        f"({'operators may act' if http.operator_token else 'read-only'}), "
        f"max_connections {http.max_connections}, allowed_hosts {_allowed_hosts(http)}"
    )
    _print_schedules(config.schedules, time.time())
    _print_destinations(config.destinations)


def cmd_check_config(args: argparse.Namespace) -> int:
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
            emit_json(
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
        emit_json(
            {
                "path": str(path),
                "valid": True,
                "store": mask_url(config.store_target()),
                "schema": config.schema,
                "durability": config.durability,
                "busy_timeout_seconds": config.busy_timeout_seconds,
                "network_timeout_seconds": config.network_timeout_seconds,
                "transport": config.dispatch.transport,
                **transports,
                "retry_schedule": (
                    None
                    if config.worker.retry_schedule is None
                    else list(config.worker.retry_schedule)
                ),
                "max_body_bytes": config.dispatch.max_body_bytes,
                "ordering": {"on_dead_letter": config.worker.ordering_on_dead_letter},
                "priority_step_seconds": config.worker.priority_step_seconds,
                "worker": _worker_document(config),
                "http": {
                    "listen": None if config.http.listen is None else str(config.http.listen),
                    "token": config.http.token is not None,
                    "operator_token": config.http.operator_token is not None,
                    "max_connections": config.http.max_connections,
                    "allowed_hosts": (
                        None
                        if config.http.allowed_hosts is None
                        else list(config.http.allowed_hosts)
                    ),
                },
                "log_level": config.log_level,
                "schedules": [_schedule_document(s, time.time()) for s in config.schedules],
                "destinations": {
                    name: policy.to_dict() for name, policy in _by_name(config.destinations)
                },
                "warnings": warnings,
            }
        )
    else:
        _print_config(config, path)
    for warning in warnings:
        print(f"trio-dispatch: warning: {visible(warning)}", file=sys.stderr)
    return EXIT_OK
