"""The configuration file: find it, load it safely, validate every key.

One YAML file (SPEC section 8), read only with :func:`yaml.safe_load`, so a
tag such as ``!!python/object/apply`` is refused before any object is built.
Validation is strict: an unknown key or a value of the wrong type raises
:class:`ConfigError` with a one-line message that names the file and the
dotted key. :func:`resolve_notify_template` is the one lenient reader: it
never raises, because an absent or invalid transport template is a delivery
failure, not a crash (ADR D3).
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, Literal

import yaml

from .store.sqlite import DURABILITIES
from .transport import NOTIFY_TIMEOUT_SECONDS, is_valid_template
from .values import show

CONFIG_ENV_VAR: Final = "TRIO_DISPATCH_CONFIG"
DEFAULT_CONFIG_NAME: Final = "trio-dispatch.yaml"

LOG_LEVELS: Final = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


class ConfigError(ValueError):
    """A configuration file that cannot be used.

    The message is one line, starts with the file it concerns and names the
    offending key (as a dotted path) or the YAML position.
    """


@dataclass(frozen=True)
class DispatchConfig:
    notify_template: tuple[str, ...] | None
    timeout_seconds: float


@dataclass(frozen=True)
class WorkerConfig:
    tick_seconds: float
    concurrency: int
    batch_size: int
    grace_seconds: float
    retry_jitter: float
    listen: bool


@dataclass(frozen=True)
class Config:
    store: str
    durability: Literal["full", "normal"]
    busy_timeout_seconds: float
    dispatch: DispatchConfig
    worker: WorkerConfig
    log_level: str
    path: Path | None
    """The absolute path of the file this came from; None if built in memory."""

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


# --- validation table -------------------------------------------------------

_URL: Final = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")



@dataclass(frozen=True)
class _Rule:
    expected: str  # completes "<key> must be ..."
    accepts: Callable[[Any], bool]
    default: object
    convert: Callable[[Any], object] = lambda value: value


def _is_number(value: object) -> bool:
    # bool is an int subclass; "concurrency: yes" must not read as 1.
    if isinstance(value, bool) or not isinstance(value, int | float):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:  # an int too large for a float
        return False


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _positive(default: float) -> _Rule:
    return _Rule("a finite number > 0", lambda v: _is_number(v) and v > 0, default, float)


def _count(default: int) -> _Rule:
    return _Rule("an integer >= 1", _is_count, default)


_Schema = Mapping[str, "_Rule | _Schema"]

_SCHEMA: Final[_Schema] = {
    "store": _Rule(
        "a non-empty string", lambda v: isinstance(v, str) and v.strip() != "", "outbox.db"
    ),
    "durability": _Rule(
        f"one of {', '.join(DURABILITIES)}",
        lambda v: isinstance(v, str) and v in DURABILITIES,
        "full",
    ),
    "busy_timeout_seconds": _Rule(
        "a finite number >= 0", lambda v: _is_number(v) and v >= 0, 10.0, float
    ),
    "dispatch": {
        "notify_template": _Rule(
            "a non-empty list of strings or null",
            lambda v: v is None or is_valid_template(v),
            None,
            lambda v: None if v is None else tuple(v),
        ),
        "timeout_seconds": _positive(NOTIFY_TIMEOUT_SECONDS),
    },
    "worker": {
        "tick_seconds": _positive(30.0),
        "concurrency": _count(16),
        "batch_size": _count(100),
        "grace_seconds": _Rule(
            "a finite number >= 0", lambda v: _is_number(v) and v >= 0, 5.0, float
        ),
        "retry_jitter": _Rule(
            "a number between 0 and 1", lambda v: _is_number(v) and 0 <= v <= 1, 0.0, float
        ),
        "listen": _Rule("true or false", lambda v: isinstance(v, bool), True),
    },
    "log_level": _Rule(
        f"one of {', '.join(LOG_LEVELS)} (any case)",
        lambda v: isinstance(v, str) and v.upper() in LOG_LEVELS,
        "INFO",
        str.upper,
    ),
}


def _check_section(data: object, schema: _Schema, *, prefix: str, source: str) -> dict[str, Any]:
    """Validated values of one mapping, defaults filled in, keyed by name."""
    if data is None:  # an empty section ("worker:" with every key commented out)
        data = {}
    if not isinstance(data, Mapping):
        where = prefix.rstrip(".") or "top level"
        raise ConfigError(f"{source}: {where} must be a mapping, got {type(data).__name__}")
    for key in data:
        if key not in schema:
            try:
                label = prefix + str(key)
            except ValueError:  # an int too long to print
                label = f"{prefix}<{type(key).__name__}>"
            shown = repr(label) if len(label) <= 200 else show(label)
            raise ConfigError(f"{source}: unknown key {shown} (allowed: {', '.join(schema)})")
    values: dict[str, Any] = {}
    for name, rule in schema.items():
        key = prefix + name
        if not isinstance(rule, _Rule):
            values[name] = _check_section(data.get(name), rule, prefix=key + ".", source=source)
        elif name not in data:
            values[name] = rule.default
        elif rule.accepts(data[name]):
            values[name] = rule.convert(data[name])
        else:
            raise ConfigError(
                f"{source}: {key} must be {rule.expected}, got {show(data[name])}"
            )
    return values


def _build(data: object, *, source: str, path: Path | None) -> Config:
    values = _check_section(data, _SCHEMA, prefix="", source=source)
    # Any-typed values are safe here: every one passed its rule above.
    return Config(
        store=values["store"],
        durability=values["durability"],
        busy_timeout_seconds=values["busy_timeout_seconds"],
        dispatch=DispatchConfig(**values["dispatch"]),
        worker=WorkerConfig(**values["worker"]),
        log_level=values["log_level"],
        path=path,
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


def _one_line(text: object) -> str:
    return " ".join(str(text).split())


def _safe_load(text: bytes, source: str) -> object:
    """``yaml.safe_load`` with every failure turned into a one-line ConfigError."""
    try:
        return yaml.safe_load(text)
    except yaml.MarkedYAMLError as exc:
        reason = _one_line(exc.problem or exc.context or "syntax error")
        mark = exc.problem_mark or exc.context_mark
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        if isinstance(exc, yaml.constructor.ConstructorError):
            raise ConfigError(
                f"{source}: unsupported YAML{where}: {reason} "
                "(only plain mappings, lists and scalars are allowed)"
            ) from None
        context = f" ({_one_line(exc.context)})" if exc.problem and exc.context else ""
        raise ConfigError(f"{source}: not valid YAML: {reason}{where}{context}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{source}: not valid YAML: {_one_line(exc)}") from None
    except ValueError as exc:
        # A plain scalar that resolves to a tagged type can still fail to
        # build, e.g. the timestamp "2024-13-45" or "!!int abc".
        raise ConfigError(f"{source}: not valid YAML: {_one_line(exc)}") from None
    except RecursionError:
        raise ConfigError(f"{source}: not valid YAML: nested too deeply") from None


def load_config(path: str | os.PathLike[str]) -> Config:
    """Read, safely parse and validate the config file at ``path``.

    The returned ``Config.path`` is absolute. Raises :class:`ConfigError`
    (message prefixed with ``path`` as given) if the file is missing or
    unreadable, is not valid YAML, uses a non-plain tag, or fails
    :func:`parse_config`.
    """
    source = os.fspath(path)
    file = Path(path)
    try:
        text = file.read_bytes()
    except FileNotFoundError:
        raise ConfigError(f"{source}: config file not found") from None
    except OSError as exc:
        raise ConfigError(
            f"{source}: cannot read config file: {_one_line(exc.strerror or exc)}"
        ) from None
    return _build(_safe_load(text, source), source=source, path=file.absolute())


def find_config_path(
    explicit: str | os.PathLike[str] | None = None,
    *,
    environ: Mapping[str, str] | None = None,
    cwd: Path | None = None,
) -> Path | None:
    """Where the config file is, by SPEC order; None means run on defaults.

    ``explicit`` (``--config``) wins and is returned even if the file does not
    exist, so the caller reports it; then ``$TRIO_DISPATCH_CONFIG`` when set
    and non-empty (also returned unchecked); then ``<cwd>/trio-dispatch.yaml``
    if it is a file. Relative paths are taken against ``cwd`` when one is
    given. ``environ`` and ``cwd`` default to the process's own.
    """
    env = os.environ if environ is None else environ
    chosen = explicit if explicit is not None and os.fspath(explicit) else env.get(CONFIG_ENV_VAR)
    if chosen:
        return Path(chosen) if cwd is None else cwd / chosen
    candidate = (Path.cwd() if cwd is None else cwd) / DEFAULT_CONFIG_NAME
    return candidate if candidate.is_file() else None


def resolve_notify_template(project_dir: str | Path | None = None) -> list[str] | None:
    """The configured transport argv template, or None (ADR D3, SPEC 8).

    Reads ``<project_dir>/trio-dispatch.yaml`` when a directory is given, else
    the file :func:`find_config_path` finds. Returns a fresh list when
    ``dispatch.notify_template`` is a non-empty list of strings. Never raises:
    a missing, unreadable or malformed file, an invalid rest of the config, or
    an absent or invalid template all return None, and delivery then records
    a transport failure.
    """
    try:
        path = (
            Path(project_dir) / DEFAULT_CONFIG_NAME
            if project_dir is not None
            else find_config_path()
        )
        if path is None:
            return None
        data = yaml.safe_load(path.read_bytes())
    except (OSError, ValueError, RecursionError, yaml.YAMLError):
        return None
    dispatch = data.get("dispatch") if isinstance(data, Mapping) else None
    template = dispatch.get("notify_template") if isinstance(dispatch, Mapping) else None
    return list(template) if is_valid_template(template) else None
