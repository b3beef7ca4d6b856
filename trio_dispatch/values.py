"""Showing a user's value in an error message, whatever the value."""

from __future__ import annotations

import reprlib

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
