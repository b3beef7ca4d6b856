"""Where the configuration file is (in the order docs/configuration.md gives), and the one
lenient reader of it: :func:`resolve_notify_template`, which never raises,
because an absent or invalid transport template is a delivery failure, not
a crash (docs/guarantees.md)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Final

import yaml

from .transports import is_valid_template

CONFIG_ENV_VAR: Final = "TRIO_DISPATCH_CONFIG"
DEFAULT_CONFIG_NAME: Final = "trio-dispatch.yaml"


def find_config_path(
    explicit: str | os.PathLike[str] | None = None,
    *,
    environ: Mapping[str, str] | None = None,
    cwd: Path | None = None,
) -> Path | None:
    """Where the config file is (docs/configuration.md); None means run on defaults.

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
    """The configured transport argv template, or None (docs/configuration.md).

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
