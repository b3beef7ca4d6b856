"""Validation of what users pass in (docs/usage.md): every check runs before
anything is written, and every error names the value and what is allowed.

These are the checks of the library and of the configuration file alike, so
``check-config`` accepts exactly what the worker accepts.
"""

from __future__ import annotations

import json
import math
import re
import time
from collections.abc import Callable
from typing import Final

from .store.base import DEFAULT_MAX_BODY_BYTES
from .values import show


def require_text(name: str, value: object) -> str:
    if not isinstance(value, str):
        raise TypeError(f"{name} must be a str, got {type(value).__name__} {show(value)}")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError(f"{name} is not valid Unicode text: {show(value)}") from None
    return value


def require_non_empty(name: str, value: object) -> str:
    text = require_text(name, value)
    if not text.strip():
        raise ValueError(f"{name} must be a non-empty string, got {show(value)}")
    if "\x00" in text:
        raise ValueError(f"{name} must not contain NUL characters, got {show(value)}")
    return text


_CONTROL: Final = re.compile("[\x00-\x1f\x7f-\x9f]")
"""Unicode category Cc: the C0 controls, DEL and the C1 controls."""


_BIDI: Final = re.compile("[\u202a-\u202e\u2066-\u2069]")
"""The bidirectional embeddings, overrides and isolates (LRE..RLO, LRI..PDI):
they reorder what an operator reads (``ls``, logs, the dashboard) without
showing themselves (Trojan Source, CVE-2021-42574)."""


def _refuse_bidi(name: str, text: str) -> None:
    found = _BIDI.search(text)
    if found is not None:
        raise ValueError(
            f"{name} must not contain bidirectional control characters "
            f"(found U+{ord(found.group()):04X}), got {show(text)}"
        )


def require_kind(value: object) -> str:
    text = require_non_empty("kind", value)
    _refuse_bidi("kind", text)
    return text


def require_route(value: object) -> str:
    text = require_non_empty("deliver_to", value)
    found = _CONTROL.search(text)
    if found is not None:
        raise ValueError(
            f"deliver_to must not contain control characters "
            f"(found {found.group()!r}), got {show(value)}"
        )
    _refuse_bidi("deliver_to", text)
    return text


def require_optional_id(name: str, value: object) -> str | None:
    if value is None:
        return None
    return require_non_empty(name, value)


INT_MAX: Final = 2**31 - 1
"""The largest value an INTEGER column holds on every engine."""


def require_int(name: str, value: object, *, minimum: int, maximum: int = INT_MAX) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an integer >= {minimum}, got {show(value)}")
    if not minimum <= value <= maximum:
        raise ValueError(
            f"{name} must be an integer from {minimum} to {maximum}, got {show(value)}"
        )
    return value


def require_number(
    name: str, value: object, *, minimum: float | None = None, maximum: float | None = None
) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"{name} must be a finite number, got {show(value)}")
    try:
        number = float(value)
    except OverflowError:
        number = math.inf
    if not math.isfinite(number):
        raise ValueError(f"{name} must be a finite number, got {show(value)}")
    if minimum is not None and number < minimum:
        raise ValueError(f"{name} must be a number >= {minimum:g}, got {show(value)}")
    if maximum is not None and number > maximum:
        raise ValueError(f"{name} must be a number <= {maximum:g}, got {show(value)}")
    return number


def require_bool(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {show(value)}")
    return value


def require_body(body: object, limit: int = DEFAULT_MAX_BODY_BYTES) -> str:
    """The JSON text of a JSON-serialisable dict (None means ``{}``) of at
    most ``limit`` bytes. It is stored as JSON, so tuples read back as lists
    and non-str keys as strings."""
    if body is None or body == {}:
        return "{}"
    if not isinstance(body, dict):
        raise TypeError(f"body must be a dict or None, got {type(body).__name__} {show(body)}")
    try:
        text = json.dumps(body, allow_nan=False, ensure_ascii=False)
    except (TypeError, ValueError, RecursionError) as exc:
        raise ValueError(f"body is not JSON-serialisable ({exc}): {show(body)}") from None
    if len(text) > limit and not text.isascii():  # every character is at least one byte
        raise ValueError(
            f"body is more than {limit:,} bytes of JSON ({len(text):,} characters), over the "
            f"limit of {limit:,} bytes (max_body_bytes)"
        )
    try:
        size = len(text) if text.isascii() else len(text.encode("utf-8"))
    except UnicodeEncodeError as exc:
        raise ValueError(f"body is not JSON-serialisable ({exc}): {show(body)}") from None
    require_body_size(size, limit)
    return text


def require_body_size(size: int, limit: int, setting: str = "max_body_bytes") -> None:
    """Raise ``ValueError`` naming ``setting`` when a body of ``size`` bytes
    of JSON is over ``limit``: the one body limit, for an enqueue and for a
    schedule checked ahead of its ticks."""
    if size > limit:
        raise ValueError(
            f"body is {size:,} bytes of JSON, over the limit of {limit:,} bytes ({setting})"
        )


def require_dispatch_id(value: object) -> str:
    if not isinstance(value, str):
        raise TypeError(f"dispatch_id must be a str, got {show(value)}")
    return value


def findable(value: str) -> bool:
    """Whether a row could hold this id (or kind): one holding a NUL or a lone
    surrogate was never written (every engine would refuse it), so a look-up
    answers "not found" without asking the database -- the same answer on
    SQLite and PostgreSQL."""
    if "\x00" in value:
        return False
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def clock_from(now: float | None) -> Callable[[], float]:
    """A wall clock: ``time.time``, or -- given ``now`` (a finite number) -- a
    clock stopped at it (for replaying a pass at a chosen time)."""
    if now is None:
        return time.time
    fixed = require_number("now", now)
    return lambda: fixed


MAX_REASON_LENGTH: Final = 500
"""Longest operator's reason an action records (a replay, a cancel)."""


def require_reason(value: object) -> str | None:
    """None, or an operator's reason: non-empty, one line, at most
    :data:`MAX_REASON_LENGTH` characters; else a ``ValueError`` naming it."""
    if value is None:
        return None
    text = require_non_empty("reason", value)
    if len(text) > MAX_REASON_LENGTH:
        raise ValueError(
            f"reason must be at most {MAX_REASON_LENGTH} characters, got {len(text)}: "
            f"{show(text[:40])}..."
        )
    if any(ord(char) < 32 or 127 <= ord(char) < 160 for char in text):
        raise ValueError(f"reason must not contain control characters, got {show(value)}")
    return text
