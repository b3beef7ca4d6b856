"""Reading a configuration file's YAML: the safe loader, a repeated key
refused, and every failure turned into one line naming where it is."""

from __future__ import annotations

from typing import Any

import yaml

from .errors import ConfigError
from .values import show


def one_line(text: object) -> str:
    return " ".join(str(text).split())


class _StrictLoader(yaml.SafeLoader):
    """The safe loader, refusing a mapping that repeats a key: YAML would
    keep the last value silently, and one of the two is a mistake."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, yaml.Node] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            try:
                first = seen.get(key)
            except TypeError:  # an unhashable key: the base class reports it
                break
            if first is not None:
                raise yaml.constructor.ConstructorError(
                    None,
                    None,
                    f"duplicate key {show(key)} (first at line {first.start_mark.line + 1})",
                    key_node.start_mark,
                )
            seen[key] = key_node
        return super().construct_mapping(node, deep=deep)


def safe_load(text: bytes, source: str) -> object:
    """A safe YAML load (duplicate keys refused) with every failure turned
    into a one-line ConfigError."""
    try:
        return yaml.load(text, Loader=_StrictLoader)  # noqa: S506 - a SafeLoader subclass
    except yaml.MarkedYAMLError as exc:
        reason = one_line(exc.problem or exc.context or "syntax error")
        mark = exc.problem_mark or exc.context_mark
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        if isinstance(exc, yaml.constructor.ConstructorError) and "duplicate key" in reason:
            raise ConfigError(f"{source}: {reason}{where}") from None
        if isinstance(exc, yaml.constructor.ConstructorError):
            raise ConfigError(
                f"{source}: unsupported YAML{where}: {reason} "
                "(only plain mappings, lists and scalars are allowed)"
            ) from None
        context = f" ({one_line(exc.context)})" if exc.problem and exc.context else ""
        raise ConfigError(f"{source}: not valid YAML: {reason}{where}{context}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{source}: not valid YAML: {one_line(exc)}") from None
    except ValueError as exc:
        # A plain scalar that resolves to a tagged type can still fail to
        # build, e.g. the timestamp "2024-13-45" or "!!int abc".
        raise ConfigError(f"{source}: not valid YAML: {one_line(exc)}") from None
    except RecursionError:
        raise ConfigError(f"{source}: not valid YAML: nested too deeply") from None
