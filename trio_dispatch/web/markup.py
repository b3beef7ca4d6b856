"""The dashboard's HTML pieces: escaped text, times, table cells and
columns, links, and the page around them. Server-rendered, no script,
every value escaped.

Outside text (a kind, a destination, an error, a payload) goes through
:func:`text`, which makes control characters visible and then escapes it
for HTML, so ``<script>alert(1)</script>`` as a kind shows as that text.

Tables have a fixed layout: a long value (an error, a destination, an id)
is cut to its column with an ellipsis, never widening the page, and its
whole text is in the cell's ``title`` (shown on hover) and on the row's
page, where long values wrap.
"""

from __future__ import annotations

import datetime
import html
from collections.abc import Mapping
from typing import Final
from urllib.parse import urlencode

from ..redact import visible
from ..times import relative_time
from .style import STYLE, WIDTHS, width_class

CELL_TEXT_LIMIT: Final = 300
"""A table cell holds at most this many characters of a value (its
``title`` and the row's page hold all of it)."""


def text(value: object) -> str:
    """Outside text, visible and escaped for HTML."""
    return html.escape(visible("" if value is None else str(value)), quote=True)


def when(seconds: object, now: float) -> str:
    """A Unix time as the CLI prints it: UTC as ISO 8601, then how long ago
    (or until), ``2026-12-01T11:34:29Z (3m05s ago)``."""
    if seconds is None:
        return "-"
    moment = float(str(seconds))
    try:
        stamp = datetime.datetime.fromtimestamp(moment, datetime.UTC)
    except (OverflowError, OSError, ValueError):  # beyond the calendar: the number itself
        return text(repr(moment))
    rel = relative_time(moment, now)
    return (
        f"<span class=stamp>{stamp:%Y-%m-%dT}<wbr>{stamp:%H:%M:%SZ}</span> "
        f'<span class="muted rel">({rel})</span>'
    )


def cut(value: object, *, classes: str = "", limit: int = CELL_TEXT_LIMIT) -> str:
    """A table cell for outside text that may be long: cut to its column
    with an ellipsis (the stylesheet), the whole text in its ``title``."""
    whole = "" if value is None else str(value)
    shown = whole if len(whole) <= limit else whole[:limit] + "…"
    kind = f' class="{classes}"' if classes else ""
    return f'<td{kind} title="{text(whole)}">{text(shown)}</td>'


def badge(label: str) -> str:
    """A status badge: a status, or :data:`~trio_dispatch.outbox.reads.AWAITING_ACK`."""
    return f'<span class="badge {text(label.replace(" ", "_"))}">{text(label)}</span>'


def columns(*widths: str) -> str:
    """The widths of a fixed-layout table's columns, each one of
    :data:`WIDTHS` (``""``: a share of what is left)."""
    unknown = [width for width in widths if width and width not in WIDTHS]
    assert not unknown, f"add {unknown} to WIDTHS"
    return (
        "<colgroup>"
        + "".join(f"<col class={width_class(width)}>" if width else "<col>" for width in widths)
        + "</colgroup>"
    )


def age(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if seconds < 60:
        return f"{seconds:.0f}s"
    if seconds < 3600:
        return f"{seconds / 60:.0f}m"
    return f"{seconds / 3600:.1f}h"


def page(title: str, body: str, store: str, *, refresh: int | None = None) -> str:
    """A whole page; with ``refresh``, one the browser reloads every that
    many seconds (a meta refresh: no script). ``store`` (the store's masked
    address) goes in the header; empty, nothing does (the login page shows
    nothing about the store before a role is proven)."""
    reload = f'<meta http-equiv=refresh content="{int(refresh)}">' if refresh else ""
    shown = f"<span class=store>{text(store)}</span>" if store else ""
    return (
        "<!doctype html><html lang=en><head><meta charset=utf-8>"
        '<meta name=viewport content="width=device-width,initial-scale=1">'
        f"{reload}"
        f"<title>{text(title)} - trio_dispatch</title><style>{STYLE}</style></head><body>"
        f'<header><a href="/">trio_dispatch</a>{shown}</header>'
        f"<main>{body}</main></body></html>"
    )


def with_notice(document: bytes, notice: str) -> bytes:
    """A rendered :func:`page` with a one-time ``notice`` (what an action
    just did) at the top of its main part."""
    shown = f"<main><p class=notice id=notice role=status>{text(notice)}</p>"
    return document.replace(b"<main>", shown.encode(), 1)


DISPATCH_PATH: Final = "/dispatches/"
"""A row's page is ``/dispatches/ID``, where its actions are too
(``/dispatches/ID/retry``); ``/dispatch/ID``, its former address, redirects."""


def dispatch_link(dispatch_id: object) -> str:
    """The (escaped) address of a row's page."""
    return text(DISPATCH_PATH + str(dispatch_id))


def link(params: Mapping[str, str | None]) -> str:
    """The (unescaped) address of the index page with these query values
    (empty ones left out)."""
    kept = {key: value for key, value in params.items() if value}
    return "/?" + urlencode(kept) if kept else "/"


def id_cell(dispatch_id: object) -> str:
    """A table cell with a row's id, linked to its page."""
    shown = text(dispatch_id)
    return f'<td class=mono title="{shown}"><a href="{dispatch_link(dispatch_id)}">{shown}</a></td>'


def text_block(value: str) -> str:
    """Multi-line outside text: each line visible and escaped."""
    return "\n".join(text(line) for line in value.split("\n"))


def not_found(path: str) -> str:
    return f"<h1>Not found</h1><p class=muted>{text(path)}</p><p><a href='/'>dashboard</a></p>"
