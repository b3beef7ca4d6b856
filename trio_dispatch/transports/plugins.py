"""Transports as plug-ins: what the configuration file and the CLI need
of a transport, declared by the transport itself.

A :class:`TransportPlugin` says which options it reads (and checks each),
where they live under ``dispatch``, what it checks across them once it is
the chosen one, how it becomes :class:`~trio_dispatch.worker.DispatchWorker`
arguments, and how ``check-config`` shows it and warns about it. The
configuration module and the CLI keep only the registry, :func:`transport_plugins`:
a new transport is its module plus one entry there.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
from collections.abc import Callable, Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any, Protocol

__all__ = ["Option", "PluginContext", "TransportPlugin", "missing_modules", "transport_plugins"]


@dataclasses.dataclass(frozen=True)
class Option:
    """One configuration key of a transport."""

    check: Callable[[str, Any], object]
    """``check(dotted_key, value)``: the value to use, or
    ``TypeError``/``ValueError`` whose message starts with the key."""
    default: object = None


@dataclasses.dataclass(frozen=True)
class PluginContext:
    """What a transport's options are read against."""

    folder: Path | None
    """The configuration file's folder (relative paths start there); None
    for a configuration built in memory (they start in the working
    directory)."""
    secret_variables: frozenset[str] = frozenset()
    """Environment variables the file reads secrets from (``env:NAME``)."""

    def relative(self, name: str) -> str:
        """``name`` with ``~`` expanded, a relative one joined to
        :attr:`folder`."""
        target = Path(name).expanduser()
        if self.folder is not None and not target.is_absolute():
            target = self.folder / target
        return str(target)


class TransportPlugin(Protocol):
    """How one transport is configured (``dispatch.transport: NAME``)."""

    @property
    def name(self) -> str:
        """What ``dispatch.transport`` says to choose it."""

    @property
    def section(self) -> str | None:
        """The mapping under ``dispatch`` that holds its options, or None:
        they are keys of ``dispatch`` itself."""

    @property
    def options(self) -> Mapping[str, Option]:
        """Its configuration keys."""

    @property
    def requires(self) -> tuple[str, ...]:
        """Modules it needs beyond the core, installed by :attr:`extra`."""

    @property
    def extra(self) -> str:
        """The ``trio_dispatch[...]`` extra that installs :attr:`requires`."""

    def build(self, values: Mapping[str, Any], context: PluginContext) -> Any:
        """Its options object from checked ``values`` (every key of
        :attr:`options`); any-typed: the transport's own dataclass."""

    def problems(self, options: Any, context: PluginContext) -> list[str]:
        """What is wrong across its options, checked only when it is the
        chosen transport (a required key missing, a file that does not
        load), one line each, naming the key."""

    def timeout(self, options: Any) -> float:
        """Seconds one attempt may take."""

    def worker_arguments(self, options: Any, context: PluginContext) -> dict[str, Any]:
        """The ``DispatchWorker`` keyword arguments that make it the worker's
        transport."""

    def describe(self, options: Any) -> dict[str, Any]:
        """``check-config --json``: its options, secrets masked."""

    def summary(self, options: Any) -> list[str]:
        """``check-config``'s text lines for it, indented two spaces."""

    def warnings(self, options: Any, context: PluginContext) -> list[str]:
        """What in valid options is likely a mistake; ``check-config``
        prints these and the worker logs them at start."""


def missing_modules(plugin: TransportPlugin) -> list[str]:
    """The modules ``plugin`` needs that are not installed."""
    return [name for name in plugin.requires if importlib.util.find_spec(name) is None]


@functools.cache
def transport_plugins() -> Mapping[str, TransportPlugin]:
    """Every transport a configuration file can name, by name (the
    registry: a new transport adds its plug-in here)."""
    from .command import COMMAND_PLUGIN
    from .webhook.plugin import WEBHOOK_PLUGIN

    return MappingProxyType({plugin.name: plugin for plugin in (COMMAND_PLUGIN, WEBHOOK_PLUGIN)})
