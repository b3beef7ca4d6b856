"""The dashboard's one style block and the Content-Security-Policy hash
that allows it (no inline ``style`` attribute, no script)."""

from __future__ import annotations

import base64
import hashlib
from typing import Final

_BASE_STYLE: Final = (
    'body{font:14px/1.45 system-ui,-apple-system,"Segoe UI",sans-serif;margin:0;color:#1d2330;'
    "background:#f6f7f9}"
    "header{background:#1d2330;color:#fff;padding:12px 24px;display:flex;gap:16px;"
    "align-items:baseline}"
    "header a{color:#fff;text-decoration:none;font-weight:600;font-size:16px}"
    "header .store{color:#aab3c5;font-family:ui-monospace,monospace;font-size:12px;"
    "min-width:0;overflow-wrap:anywhere}"
    "main{padding:16px 24px;max-width:1400px}"
    "h1{font-size:18px;margin:8px 0 12px}"
    "h2{font-size:15px;margin:20px 0 8px}"
    ".cards{display:flex;flex-wrap:wrap;gap:10px}"
    ".card{background:#fff;border:1px solid #dde1e8;border-radius:6px;padding:8px 14px;"
    "min-width:110px}"
    ".card .n{font-size:22px;font-weight:600}"
    ".card .l{color:#5b6475;font-size:12px}"
    ".card a{color:inherit;text-decoration:none}"
    ".dead_letter .n,.blocked .n{color:#b42318}"
    ".pending .n{color:#175cd3}"
    ".delivering .n{color:#b54708}"
    "table{border-collapse:collapse;width:100%;table-layout:fixed;background:#fff;"
    "border:1px solid #dde1e8}"
    "th,td{text-align:left;padding:6px 8px;border-bottom:1px solid #eceef2;vertical-align:top;"
    "overflow:hidden;text-overflow:ellipsis;white-space:nowrap}"
    "th{background:#f0f2f5;font-weight:600;font-size:12px;color:#3b4354}"
    "td.when{font-size:12px;white-space:normal}"
    "td.when .rel{display:block}"
    "td.wrap{white-space:normal;overflow-wrap:anywhere}"
    "td.mono,.mono{font-family:ui-monospace,monospace;font-size:12px}"
    ".err{color:#b42318}"
    ".badge{display:inline-block;padding:1px 7px;border-radius:9px;font-size:12px;"
    "background:#eceef2}"
    ".badge.dead_letter{background:#fee4e2;color:#b42318}"
    ".badge.delivered,.badge.acked{background:#dcfae6;color:#067647}"
    ".badge.pending{background:#d1e9ff;color:#175cd3}"
    ".badge.delivering{background:#fef0c7;color:#b54708}"
    ".badge.expired,.badge.superseded,.badge.cancelled{background:#f2f4f7;color:#475467}"
    ".badge.awaiting_ack{background:#ebe9fe;color:#5925dc}"
    ".badge.retry{background:#fef0c7;color:#b54708}"
    ".badge.paused{background:#fef0c7;color:#b54708}"
    ".badge.active{background:#dcfae6;color:#067647}"
    ".badge.throttled,.badge.half_open{background:#fef0c7;color:#b54708}"
    ".badge.open,.badge.disabled{background:#fee4e2;color:#b42318}"
    ".notice{background:#dcfae6;border:1px solid #abefc6;padding:6px 10px;border-radius:4px}"
    "form.pause input{font:inherit}"
    "form.filter{display:flex;flex-wrap:wrap;gap:8px;align-items:center;margin:8px 0}"
    ".refresh{float:right;font-size:12px;margin-top:10px}"
    "pre{background:#fff;border:1px solid #dde1e8;padding:10px;overflow:auto;font-size:12px}"
    ".pager{margin:10px 0}"
    ".muted{color:#5b6475}"
    "dl{display:grid;grid-template-columns:max-content 1fr;gap:4px 16px;background:#fff;"
    "border:1px solid #dde1e8;padding:10px 14px;margin:0}"
    "dt{color:#5b6475}"
    "dd{margin:0;min-width:0;overflow-wrap:anywhere}"
    "form.action,form.login{display:inline-block;margin:0 8px 8px 0}"
    "form.action button{padding:4px 12px;border:1px solid #b42318;background:#fff;"
    "color:#b42318;border-radius:4px;cursor:pointer}"
    ".operator{margin:0 0 12px}.error{color:#b42318}"
)
WIDTHS: Final = (
    "5.5em", "6em", "7em", "8em", "11.5em", "9%", "10%", "12%", "14%", "16%", "18%"
)  # fmt: skip
"""Every column width the tables use, as a class each (an inline ``style``
attribute would need ``'unsafe-inline'`` in the Content-Security-Policy)."""


def width_class(width: str) -> str:
    """The class that gives a column ``width`` (one of :data:`WIDTHS`)."""
    return "w" + width.replace(".", "-").replace("%", "p")


STYLE: Final = _BASE_STYLE + "".join(f".{width_class(width)}{{width:{width}}}" for width in WIDTHS)
STYLE_HASH: Final = "sha256-" + base64.b64encode(hashlib.sha256(STYLE.encode()).digest()).decode()
"""The Content-Security-Policy source that allows the one style block."""
