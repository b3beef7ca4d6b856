"""The configuration file: find it, load it safely, validate every key.

One YAML file (docs/configuration.md), read only with :func:`yaml.safe_load`, so a
tag such as ``!!python/object/apply`` is refused before any object is built.
Validation is strict: an unknown key or a value of the wrong type raises
:class:`ConfigError` with a one-line message that names the file and the
dotted key. :func:`resolve_notify_template` is the one lenient reader: it
never raises, because an absent or invalid transport template is a delivery
failure, not a crash (docs/guarantees.md).

The worker's settings are not a section of their own here: the ``worker:``
keys, ``dispatch.retry_schedule``, ``dispatch.ordering.on_dead_letter`` and
the chosen transport's timeout validate, each by the worker's own check,
into one :class:`~trio_dispatch.settings.WorkerSettings` (``Config.worker``),
the object the worker runs with (:data:`WORKER_KEYS` says where each is
written).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import re
import stat
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, Literal

from .configpath import CONFIG_ENV_VAR as CONFIG_ENV_VAR
from .configpath import DEFAULT_CONFIG_NAME as DEFAULT_CONFIG_NAME
from .configpath import find_config_path as find_config_path
from .configpath import resolve_notify_template as resolve_notify_template
from .destinations.policy import Destination, parse_destinations
from .envsecrets import left_unread, secret_environ
from .errors import ConfigError as ConfigError
from .priority import DEFAULT_PRIORITY_STEP_SECONDS
from .redact import mask_url
from .schedules.spec import Schedule, schedules_from_config
from .settings import SETTING_CHECKS, WorkerSettings
from .store.base import (
    DEFAULT_BUSY_TIMEOUT_SECONDS,
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_NETWORK_TIMEOUT_SECONDS,
    DURABILITIES,
    check_busy_timeout,
    check_network_timeout,
    parse_target,
)
from .transports import ChildEnvironment
from .transports.command import CommandOptions as CommandOptions
from .transports.plugins import (
    PluginContext,
    TransportPlugin,
    missing_modules,
    transport_plugins,
)
from .transports.webhook.plugin import WebhookConfig as WebhookConfig
from .validate import require_int
from .values import show
from .web.binding import (
    DEFAULT_MAX_CONNECTIONS,
    Listen,
    check_binding,
    parse_allowed_hosts,
    parse_listen,
    parse_max_connections,
    parse_token,
)
from .yamlfile import one_line, safe_load

MAX_CONFIG_BYTES: Final = 1024 * 1024
"""A configuration file larger than this is refused unread."""

LOG_LEVELS: Final = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


@dataclass(frozen=True)
class DispatchConfig:
    """The ``dispatch`` section: the chosen transport, the options of every
    transport (each checked by its plug-in), and what all of them share."""

    transport: str = "command"
    transports: Mapping[str, Any] = dataclasses.field(
        default_factory=lambda: {
            name: plugin.build(
                {key: option.check(key, option.default) for key, option in plugin.options.items()},
                PluginContext(None),
            )
            for name, plugin in transport_plugins().items()
        }
    )
    """Transport name -> its options object (e.g. :class:`CommandOptions`,
    :class:`WebhookConfig`)."""
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES

    @property
    def plugin(self) -> TransportPlugin:
        """The chosen transport's plug-in."""
        return transport_plugins()[self.transport]

    @property
    def options(self) -> Any:
        """The chosen transport's options."""
        return self.transports[self.transport]

    @property
    def notify_template(self) -> tuple[str, ...] | None:
        """The command transport's argv template."""
        command: CommandOptions = self.transports["command"]
        return command.notify_template

    @property
    def timeout_seconds(self) -> float:
        """The command transport's timeout (``dispatch.timeout_seconds``)."""
        command: CommandOptions = self.transports["command"]
        return command.timeout_seconds

    @property
    def env(self) -> ChildEnvironment:
        """What of the worker's environment a command's child gets."""
        command: CommandOptions = self.transports["command"]
        return command.env

    @property
    def webhook(self) -> WebhookConfig:
        """The webhook transport's options (``dispatch.webhook``)."""
        webhook: WebhookConfig = self.transports["webhook"]
        return webhook


@dataclass(frozen=True)
class HttpConfig:
    listen: Listen | None = None
    """Where the worker serves /metrics, /healthz and the dashboard; None: nowhere."""
    token: str | None = None
    """The viewer's token every request must carry (required beyond loopback)."""
    operator_token: str | None = None
    """The operator's token: with it, the dashboard can retry and purge
    (docs/dashboard.md); without it, the web view is read-only."""
    max_connections: int = DEFAULT_MAX_CONNECTIONS
    """Connections the server keeps open at once; more are closed as they arrive."""
    allowed_hosts: tuple[str, ...] | None = None
    """The ``Host`` values the server answers to (``NAME`` or ``NAME:PORT``);
    None: the listener's own names."""


@dataclass(frozen=True)
class Config:
    store: str
    durability: Literal["full", "normal"]
    busy_timeout_seconds: float
    dispatch: DispatchConfig
    worker: WorkerSettings
    """How the worker runs: the ``worker:`` section, ``dispatch.retry_schedule``,
    ``dispatch.ordering.on_dead_letter`` and the chosen transport's timeout."""
    http: HttpConfig
    log_level: str
    path: Path | None
    """The absolute path of the file this came from; None if built in memory."""
    schedules: tuple[Schedule, ...] = ()
    """The ``schedules:`` section (docs/schedules.md)."""
    destinations: Mapping[str, Destination] = dataclasses.field(default_factory=dict)
    """The ``destinations:`` section (docs/destinations.md): each ``deliver_to``
    value's (or ``"*"``'s) shared limits, throttle cap and breaker."""
    network_timeout_seconds: float = DEFAULT_NETWORK_TIMEOUT_SECONDS
    """PostgreSQL: how long past ``busy_timeout_seconds`` a round trip may go
    unanswered before its connection is dropped (a silent network)."""
    schema: str | None = None
    """PostgreSQL: the schema that holds the outbox's tables (``schema``, or
    the ``search_path`` the store URL's ``options`` set); None: the server's
    ``search_path``."""

    def store_target(self) -> str:
        """The ``target`` to pass to ``open_store``.

        URLs (``scheme://...``) and ``":memory:"`` are returned unchanged. A
        file path has ``~`` expanded, and a relative one is joined to the
        directory of the config file, so the store does not move when the
        service starts from another working directory; without a file it
        stays relative to the working directory. Never raises.
        """
        if self.store == ":memory:" or _URL.match(self.store):
            return self.store
        target = Path(os.path.expanduser(self.store))
        if self.path is not None and not target.is_absolute():
            target = self.path.parent / target
        return str(target)

    def context(self) -> PluginContext:
        """What the transports' options are read against: this file's folder."""
        folder = None if self.path is None else self.path.parent
        return PluginContext(folder, self.dispatch.env.drop)

    def worker_options(self) -> dict[str, Any]:
        """The keyword arguments of ``DispatchWorker`` this file sets: its
        ``settings`` and its transport (as the chosen plug-in builds it)."""
        dispatch = self.dispatch
        return {
            "settings": self.worker,
            "schedules": self.schedules,
            "destinations": self.destinations,
            **dispatch.plugin.worker_arguments(dispatch.options, self.context()),
        }

    def transport_warnings(self) -> list[str]:
        """What ``check-config`` and the worker's start warn about in the
        chosen transport's options (for the command transport: no template,
        a placeholder that can be read as an option, ``{payload}`` in argv,
        a program or script that does not exist where the worker will look
        for it)."""
        dispatch = self.dispatch
        return dispatch.plugin.warnings(dispatch.options, self.context())

    def worker_settings(self) -> WorkerSettings:
        """The worker's settings from this file (already checked):
        :attr:`worker`."""
        return self.worker


# --- validation table -------------------------------------------------------

_URL: Final = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")


@dataclass(frozen=True)
class _Rule:
    check: Callable[[str, Any], object]
    """``check(dotted_key, value)``: the value to use, or TypeError/ValueError
    whose message starts with the key."""
    default: object


WORKER_KEYS: Final[Mapping[str, str]] = {
    "worker.tick_seconds": "tick_seconds",
    "worker.concurrency": "concurrency",
    "worker.batch_size": "batch_size",
    "worker.grace_seconds": "grace_seconds",
    "worker.retry_jitter": "retry_jitter",
    "worker.listen": "listen",
    "worker.per_destination_concurrency": "per_destination_concurrency",
    "dispatch.retry_schedule": "retry_schedule",
    "dispatch.ordering.on_dead_letter": "ordering_on_dead_letter",
    "dispatch.priority_step_seconds": "priority_step_seconds",
}
"""Where the file writes each :class:`WorkerSettings` field it sets (dotted
key -> field); ``timeout_seconds`` is the chosen transport's own key, and
``kill_grace_seconds`` and ``lease_margin_seconds`` are the library's only."""

_SETTING_DEFAULTS: Final = {
    field.name: field.default for field in dataclasses.fields(WorkerSettings)
}


def _setting(name: str) -> _Rule:
    # The worker's own check and default (settings.py): the file accepts
    # what the worker accepts, and a key left out means what a keyword left
    # out means.
    return _Rule(SETTING_CHECKS[name], _SETTING_DEFAULTS[name])


def _worker_section() -> dict[str, _Rule]:
    prefix = "worker."
    return {
        key.removeprefix(prefix): _setting(name)
        for key, name in WORKER_KEYS.items()
        if key.startswith(prefix)
    }


def _check_store(key: str, value: object) -> str:
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"{key} must be a non-empty string, got {show(value)}")
    try:
        engine, _ = parse_target(value)
    except ValueError as exc:
        raise ValueError(f"{key}: {exc}") from None
    if engine == "postgres" and importlib.util.find_spec("psycopg") is None:
        raise ValueError(f"{key} {mask_url(value)} needs psycopg: install trio_dispatch[postgres]")
    return value


def _check_schema(key: str, value: object) -> str | None:
    if value is None:
        return None
    from .store.pg_session import check_schema_name  # the engine's rule, loaded when used

    return check_schema_name(value, key)


def _check_durability(key: str, value: object) -> str:
    if not isinstance(value, str) or value not in DURABILITIES:
        raise ValueError(f"{key} must be one of {', '.join(DURABILITIES)}, got {show(value)}")
    return value


def _check_log_level(key: str, value: object) -> str:
    if not isinstance(value, str) or value.upper() not in LOG_LEVELS:
        raise ValueError(
            f"{key} must be one of {', '.join(LOG_LEVELS)} (any case), got {show(value)}"
        )
    return value.upper()


def _check_transport(key: str, value: object) -> str:
    plugins = transport_plugins()
    if not isinstance(value, str) or value not in plugins:
        raise ValueError(f"{key} must be one of {', '.join(plugins)}, got {show(value)}")
    missing = missing_modules(plugins[value])
    if missing:
        raise ValueError(
            f"{key} {value} needs {' and '.join(missing)}: "
            f"install trio_dispatch[{plugins[value].extra}]"
        )
    return value


def _check_listen(key: str, value: object) -> Listen | None:
    if value is None:
        return None
    listen = parse_listen(key, value)
    missing = [
        name
        for name in ("hypercorn", "prometheus_client")
        if importlib.util.find_spec(name) is None
    ]
    if missing:
        raise ValueError(f"{key} needs {' and '.join(missing)}: install trio_dispatch[web]")
    return listen


_Schema = Mapping[str, "_Rule | _Schema"]


def _transport_rules() -> dict[str, _Rule | _Schema]:
    """Every transport's options, where each plug-in keeps them."""
    rules: dict[str, _Rule | _Schema] = {}
    for plugin in transport_plugins().values():
        own = {name: _Rule(option.check, option.default) for name, option in plugin.options.items()}
        if plugin.section is None:
            rules.update(own)
        else:
            rules[plugin.section] = own
    return rules


def _transport_values(plugin: TransportPlugin, dispatch: Mapping[str, Any]) -> dict[str, Any]:
    section = dispatch if plugin.section is None else dispatch[plugin.section]
    return {name: section[name] for name in plugin.options}


_SCHEMA: Final[_Schema] = {
    "store": _Rule(_check_store, "outbox.db"),
    "schema": _Rule(_check_schema, None),
    "durability": _Rule(_check_durability, "full"),
    "busy_timeout_seconds": _Rule(
        lambda key, value: check_busy_timeout(value, key), DEFAULT_BUSY_TIMEOUT_SECONDS
    ),
    "network_timeout_seconds": _Rule(
        lambda key, value: check_network_timeout(value, key), DEFAULT_NETWORK_TIMEOUT_SECONDS
    ),
    "dispatch": {
        "transport": _Rule(_check_transport, "command"),
        "max_body_bytes": _Rule(
            lambda key, value: require_int(key, value, minimum=1), DEFAULT_MAX_BODY_BYTES
        ),
        "retry_schedule": _setting("retry_schedule"),
        "ordering": {"on_dead_letter": _setting("ordering_on_dead_letter")},
        # A file says the step (300 unless it sets one): its worker records
        # it as the store's at start. The library's default leaves it alone.
        "priority_step_seconds": _Rule(
            SETTING_CHECKS["priority_step_seconds"], DEFAULT_PRIORITY_STEP_SECONDS
        ),
        **_transport_rules(),
    },
    "worker": _worker_section(),
    "http": {
        "listen": _Rule(_check_listen, None),
        "token": _Rule(lambda key, value: parse_token(key, value, secret_environ()), None),
        "operator_token": _Rule(lambda key, value: parse_token(key, value, secret_environ()), None),
        "max_connections": _Rule(parse_max_connections, DEFAULT_MAX_CONNECTIONS),
        "allowed_hosts": _Rule(parse_allowed_hosts, None),
    },
    "log_level": _Rule(_check_log_level, "INFO"),
    "schedules": _Rule(schedules_from_config, None),
    "destinations": _Rule(lambda key, value: parse_destinations(value, key), None),
}


def _check_section(
    data: object, schema: _Schema, *, prefix: str, problems: list[str]
) -> dict[str, Any]:
    """Validated values of one mapping, defaults filled in, keyed by name.
    Every problem is appended to ``problems`` (nothing raises), and a key
    whose value failed is left out of the result: the caller reports the
    file whole before building anything from it."""
    if data is None:  # an empty section ("worker:" with every key commented out)
        data = {}
    if not isinstance(data, Mapping):
        where = prefix.rstrip(".") or "top level"
        problems.append(f"{where} must be a mapping, got {type(data).__name__}")
        return {}
    for key in data:
        if key not in schema:
            try:
                label = prefix + str(key)
            except ValueError:  # an int too long to print
                label = f"{prefix}<{type(key).__name__}>"
            shown = repr(label) if len(label) <= 200 else show(label)
            problems.append(f"unknown key {shown} (allowed: {', '.join(schema)})")
    values: dict[str, Any] = {}
    for name, rule in schema.items():
        key = prefix + name
        if not isinstance(rule, _Rule):
            before = len(problems)
            section = _check_section(data.get(name), rule, prefix=key + ".", problems=problems)
            if len(problems) == before:
                values[name] = section
        elif name not in data:
            values[name] = rule.check(key, rule.default)  # defaults pass their own check
        else:
            try:
                values[name] = rule.check(key, data[name])
            except ConfigError as exc:  # a section that reports each of its problems
                problems.extend(exc.problems)
            except (TypeError, ValueError) as exc:
                problems.append(str(exc))
    return values


def _secret_variables(data: object) -> frozenset[str]:
    """The names of every ``env:NAME`` value anywhere in the file: the
    variables it reads secrets from (the dashboard token, webhook secrets),
    which a command's child must not inherit."""
    found: set[str] = set()
    pending: list[object] = [data]
    while pending:
        value = pending.pop()
        if isinstance(value, str) and value.startswith("env:") and len(value) > 4:
            found.add(value[4:])
        elif isinstance(value, Mapping):
            pending.extend(value.values())
        elif isinstance(value, list):
            pending.extend(value)
    return frozenset(found)


def _build(data: object, *, source: str, path: Path | None) -> Config:
    # Every problem of the file is collected before raising, so one run of
    # check-config (or a refused worker start) names them all. A check that
    # needs a value which itself failed is skipped.
    problems: list[str] = []
    values = _check_section(data, _SCHEMA, prefix="", problems=problems)
    if "http" in values:
        http = HttpConfig(**values["http"])
        if http.listen is not None:
            try:
                check_binding(http.listen, http.token, "http.listen")
            except ValueError as exc:
                problems.append(str(exc))
        if http.operator_token is not None and http.operator_token == http.token:
            problems.append(
                "http.operator_token must differ from http.token (the viewer's token): "
                "one token cannot prove two roles"
            )
    dispatch = values.get("dispatch")
    context = PluginContext(None if path is None else path.parent, _secret_variables(data))
    transports: dict[str, Any] = {}
    if dispatch is not None:
        for name, plugin in transport_plugins().items():
            transports[name] = plugin.build(_transport_values(plugin, dispatch), context)
        chosen = transport_plugins()[dispatch["transport"]]
        problems.extend(chosen.problems(transports[chosen.name], context))
        for schedule in values.get("schedules", ()):
            try:  # the worker's store refuses every tick of such a schedule
                schedule.check_body_size(dispatch["max_body_bytes"], "dispatch.max_body_bytes")
            except ValueError as exc:
                problems.append(str(exc))
    schema: str | None = None
    if "store" in values and "schema" in values:
        engine, _ = parse_target(values["store"])
        if engine != "postgres" and values["schema"] is not None:
            problems.append("schema applies to a PostgreSQL store only")
        elif engine == "postgres":
            from .store.pg_session import store_schema

            try:
                schema = store_schema(values["store"], values["schema"])
            except ValueError as exc:
                problems.append(f"store {mask_url(values['store'])}: {exc}")
    if problems:
        raise ConfigError.collected(source, problems)
    assert dispatch is not None
    # Any-typed values are safe here: every one passed its rule above (the
    # worker's settings each the worker's own check, under its dotted key).
    sending = DispatchConfig(
        transport=dispatch["transport"],
        transports=transports,
        max_body_bytes=dispatch["max_body_bytes"],
    )
    return Config(
        store=values["store"],
        durability=values["durability"],
        busy_timeout_seconds=values["busy_timeout_seconds"],
        network_timeout_seconds=values["network_timeout_seconds"],
        dispatch=sending,
        worker=WorkerSettings(
            **values["worker"],
            timeout_seconds=sending.plugin.timeout(sending.options),
            retry_schedule=dispatch["retry_schedule"],
            ordering_on_dead_letter=dispatch["ordering"]["on_dead_letter"],
            priority_step_seconds=dispatch["priority_step_seconds"],
        ),
        http=HttpConfig(**values["http"]),
        log_level=values["log_level"],
        schedules=values["schedules"],
        destinations=values["destinations"],
        path=path,
        schema=schema,
    )


def parse_config(data: object, *, source: str = "<config>") -> Config:
    """Validate an already-loaded YAML document and return the config.

    ``None`` (an empty file) means every default. ``source`` prefixes error
    messages. Raises :class:`ConfigError` for a non-mapping document, an
    unknown key or a value outside its rule; nothing is coerced except int to
    float for durations and upper case for ``log_level``.
    """
    return _build(data, source=source, path=None)


# --- files ------------------------------------------------------------------


def load_config(path: str | os.PathLike[str], *, secrets: bool = True) -> Config:
    """Read, safely parse and validate the config file at ``path``.
    Without ``secrets`` (a command that serves no dashboard and signs
    nothing), ``env:NAME`` secrets are left unread
    (:mod:`~trio_dispatch.envsecrets`): their variables need not be set,
    and the config holds no usable token or signing key.

    The returned ``Config.path`` is absolute. Raises :class:`ConfigError`
    (message prefixed with ``path`` as given; a missing file's names the
    absolute path looked at) if the file is missing or
    unreadable, is not valid YAML, uses a non-plain tag, or fails
    :func:`parse_config`.
    """
    source = os.fspath(path)
    file = Path(path)
    try:
        # O_NONBLOCK: opening a FIFO must not wait for a writer; the check
        # below refuses it (and a device such as /dev/zero) unread.
        fd = os.open(file, os.O_RDONLY | os.O_NONBLOCK)
        with os.fdopen(fd, "rb") as handle:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise ConfigError(f"{source}: not a regular file")
            text = handle.read(MAX_CONFIG_BYTES + 1)
    except FileNotFoundError:
        where = "" if file.is_absolute() else f" (no file at {file.absolute()})"
        raise ConfigError(f"{source}: config file not found{where}") from None
    except OSError as exc:
        raise ConfigError(
            f"{source}: cannot read config file: {one_line(exc.strerror or exc)}"
        ) from None
    if len(text) > MAX_CONFIG_BYTES:
        raise ConfigError(f"{source}: larger than {MAX_CONFIG_BYTES:,} bytes: not a config file")
    data = safe_load(text, source)
    if secrets:
        return _build(data, source=source, path=file.absolute())
    with left_unread():
        return _build(data, source=source, path=file.absolute())
