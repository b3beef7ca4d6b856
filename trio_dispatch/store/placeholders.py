"""The outbox's portable SQL in a driver's parameter style.

Statements are written with ``?`` placeholders (SQLite's ``qmark`` style).
A driver with another style gets each ``?`` rewritten -- but not a ``?``
inside a quoted literal (``'...'``, ``E'...'``, ``$tag$...$tag$``), a quoted
identifier or a comment, so a caller's own SQL means the same on every
engine.
"""

from __future__ import annotations

import functools
import re
from typing import Final, Literal

Paramstyle = Literal["qmark", "format", "pyformat", "numeric_dollar", "numeric"]
PARAMSTYLES: Final = ("qmark", "format", "pyformat", "numeric_dollar", "numeric")

_DOLLAR_TAG: Final = re.compile(r"\$(?:[A-Za-z_][A-Za-z0-9_]*)?\$")


class Typed(str):
    """A statement whose every parameter has the type the statement gives it
    (a cast, or the column it is assigned to or compared with). A driver
    with a binary wire format (PostgreSQL) sends such a statement's
    parameters in it: no quoting and escaping of each text array element,
    a tenth of a busy worker's client CPU on the delivery path."""

    __slots__ = ()


class Replanned(str):
    """A statement planned anew each time it runs (PostgreSQL: never a
    prepared statement's generic plan). For a read by a key through a
    partial index on a table that grows from empty: a generic plan made
    while the table was small scans it whole, and its cost grows with the
    table (a coalescing group's supersede went from 2 ms to 360 ms over
    3,000 enqueues)."""

    __slots__ = ()


def _placeholder(style: str, index: int, binary: bool, as_text: bool) -> str:
    """The placeholder of parameter ``index`` (from 0) in ``style``."""
    if style in ("format", "pyformat"):
        return "%b" if binary else "%s"
    if style == "numeric_dollar":
        return f"${index + 1}"
    if style == "numeric":
        return f":{index + 1}"
    return "CAST(? AS TEXT)" if as_text else "?"


@functools.lru_cache(maxsize=1024)
def to_paramstyle(
    sql: str, style: str, binary: bool = False, as_text: frozenset[int] = frozenset()
) -> str:
    """``sql`` (``?`` placeholders) in ``style``: ``qmark`` unchanged;
    ``format``/``pyformat`` ``%s`` with every other ``%`` doubled (psycopg
    reads ``%`` anywhere, literals included) -- ``%b`` with ``binary``,
    psycopg's placeholder of a parameter sent in binary; ``numeric_dollar``
    ``$1, $2, ...``; ``numeric`` ``:1, :2, ...``. ValueError for any other
    style. In ``qmark`` style, the placeholders numbered in ``as_text``
    (from 0) are written ``CAST(? AS TEXT)``: SQLite then compares the
    bytes bound there as text (see :class:`~.base.Undecodable`)."""
    if style == "qmark" and not as_text:
        return sql
    if style not in PARAMSTYLES:
        raise ValueError(f"unsupported DB-API paramstyle {style!r}")
    percent = style in ("format", "pyformat")
    out: list[str] = []
    number = 0
    i, n = 0, len(sql)
    while i < n:
        char = sql[i]
        if char in "'\"":
            escapes = (
                char == "'"
                and i > 0
                and sql[i - 1] in "Ee"
                and (i < 2 or not (sql[i - 2].isalnum() or sql[i - 2] == "_"))
            )
            j = i + 1
            while j < n:
                if escapes and sql[j] == "\\":
                    j += 2
                    continue
                if sql[j] == char:
                    if j + 1 < n and sql[j + 1] == char:  # a doubled quote
                        j += 2
                        continue
                    break
                j += 1
            end = min(j + 1, n)
        elif sql.startswith("--", i):
            newline = sql.find("\n", i)
            end = n if newline < 0 else newline + 1
        elif sql.startswith("/*", i):
            close = sql.find("*/", i + 2)
            end = n if close < 0 else close + 2
        elif (
            char == "$"
            and (tag := _DOLLAR_TAG.match(sql, i)) is not None
            and (i == 0 or not (sql[i - 1].isalnum() or sql[i - 1] == "_"))
        ):
            close = sql.find(tag.group(), tag.end())
            end = n if close < 0 else close + len(tag.group())
        else:
            if char == "?":
                out.append(_placeholder(style, number, binary, number in as_text))
                number += 1
            else:
                out.append("%%" if percent and char == "%" else char)
            i += 1
            continue
        piece = sql[i:end]
        out.append(piece.replace("%", "%%") if percent else piece)
        i = end
    return "".join(out)
