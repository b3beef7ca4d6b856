"""How a command reports: its exit codes, the two errors it turns into one
line on stderr (:class:`UsageError`, exit 2; :class:`NotApplied`, exit 1),
one JSON document, and aligned tables cut to a terminal's width.
"""

from __future__ import annotations

import json
import shutil
import sys
from collections.abc import Mapping, Sequence
from typing import Any

EXIT_OK = 0
EXIT_NOT_APPLIED = 1
EXIT_USAGE = 2

MASK = "<hidden: use --show-token>"


class UsageError(Exception):
    """Bad usage or configuration: one line on stderr, exit 2."""


class NotApplied(Exception):
    """Not found or not applied: one line on stderr, exit 1."""


def emit_json(document: object) -> None:
    print(json.dumps(document, indent=2, sort_keys=True, default=str))


def _cut(text: str, width: int) -> str:
    text = " ".join(text.split())
    if width <= 0:
        return ""
    return text if len(text) <= width else text[: max(0, width - 1)] + "…"


def format_table(
    headers: Sequence[str],
    rows: Sequence[Sequence[str]],
    *,
    flexible: int,
    wide: bool = False,
    capped: Mapping[int, int] | None = None,
) -> str:
    """An aligned table. On a terminal, column ``flexible`` is cut to fit
    its width, and each column of ``capped`` to at most its width there,
    unless ``wide``; written anywhere else (a pipe, a file) every value is
    whole, since a script or a log has no width to fit."""
    widths = [max([len(h)] + [len(r[i]) for r in rows]) for i, h in enumerate(headers)]
    cut = not wide and sys.stdout.isatty()
    limits = dict(capped or {})
    if cut:
        for column, most in limits.items():
            widths[column] = max(len(headers[column]), min(widths[column], most))
        total = shutil.get_terminal_size((120, 24)).columns
        fixed = sum(w for i, w in enumerate(widths) if i != flexible) + 2 * (len(headers) - 1)
        widths[flexible] = max(len(headers[flexible]), min(widths[flexible], total - fixed))
    lines = []
    for row in [list(headers), *rows]:
        cells = [
            _cut(cell, widths[i]) if cut and (i == flexible or i in limits) else cell
            for i, cell in enumerate(row)
        ]
        lines.append("  ".join(c.ljust(widths[i]) for i, c in enumerate(cells)).rstrip())
    return "\n".join(lines)


def public_row(row: dict[str, Any], *, show_token: bool) -> dict[str, Any]:
    out = dict(row)
    out["ack_required"] = bool(out["ack_required"])
    if out.get("ack_token") is not None and not show_token:
        out["ack_token"] = MASK
        payload = out.get("payload")
        if isinstance(payload, dict) and payload.get("ack_token") is not None:
            out["payload"] = {**payload, "ack_token": MASK}
    return out
