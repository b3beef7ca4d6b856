"""Showing a user's value in an error message, whatever the value, and
replacing checked options by name."""

from __future__ import annotations

import dataclasses
import reprlib
from collections.abc import Mapping
from typing import Any

_REPR = reprlib.Repr()
_REPR.maxstring = 60
_REPR.maxother = 60
_REPR.maxlevel = 3


def show(value: object, limit: int = 80) -> str:
    """A short ``repr`` of ``value`` for an error message: cut to ``limit``
    characters, and never raising -- a value whose repr fails (an int too
    long to print, a nesting too deep, a broken ``__repr__``) is named by
    its type."""
    try:
        text = _REPR.repr(value)
    except Exception:  # the message must not fail where the value did
        return f"<{type(value).__name__} that cannot be shown>"
    return text if len(text) <= limit else f"{text[: limit - 3]}..."


def replaced(options: Any, values: Mapping[str, Any], caller: str, kind: str) -> Any:
    """The frozen dataclass ``options`` with ``values`` (field name ->
    value) in place (its own checks run again); an unknown name raises
    ``TypeError`` as a call of ``caller`` with that keyword would, listing
    the ``kind`` it takes."""
    names = {field.name for field in dataclasses.fields(options)}
    unknown = sorted(str(name) for name in set(values) - names)
    if unknown:
        raise TypeError(
            f"{caller}() got an unexpected keyword argument {unknown[0]!r} "
            f"({kind}: {', '.join(sorted(names))})"
        )
    return dataclasses.replace(options, **values) if values else options
