"""The dashboard's HTML: server-rendered, no script, every value escaped.

Outside text (a kind, a destination, an error, a payload) goes through
:func:`text`, which makes control characters visible and then escapes it
for HTML, so ``<script>alert(1)</script>`` as a kind shows as that text.
"""

from __future__ import annotations

import html
import json
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Final
from urllib.parse import urlencode

from ..lifecycle import STATUSES
from ..redact import MASK, visible

STATUS_ORDER: Final = ("pending", "delivering", "delivered", "acked", "dead_letter", "expired")

STYLE: Final = (
    'body{font:14px/1.45 system-ui,-apple-system,"Segoe UI",sans-serif;margin:0;color:#1d2330;'
    "background:#f6f7f9}"
    "header{background:#1d2330;color:#fff;padding:12px 24px;display:flex;gap:16px;"
    "align-items:baseline}"
    "header a{color:#fff;text-decoration:none;font-weight:600;font-size:16px}"
    "header .store{color:#aab3c5;font-family:ui-monospace,monospace;font-size:12px}"
    "main{padding:16px 24px;max-width:1400px}"
    "h1{font-size:18px;margin:8px 0 12px}"
    "h2{font-size:15px;margin:20px 0 8px}"
    ".cards{display:flex;flex-wrap:wrap;gap:10px}"
    ".card{background:#fff;border:1px solid #dde1e8;border-radius:6px;padding:8px 14px;"
    "min-width:110px}"
    ".card .n{font-size:22px;font-weight:600}"
    ".card .l{color:#5b6475;font-size:12px}"
    ".card a{color:inherit;text-decoration:none}"
    ".dead_letter .n{color:#b42318}"
    ".pending .n{color:#175cd3}"
    ".delivering .n{color:#b54708}"
    "table{border-collapse:collapse;width:100%;background:#fff;border:1px solid #dde1e8}"
    "th,td{text-align:left;padding:6px 8px;border-bottom:1px solid #eceef2;vertical-align:top}"
    "th{background:#f0f2f5;font-weight:600;font-size:12px;color:#3b4354}"
    "td.when{white-space:nowrap}"
    "td.mono,.mono{font-family:ui-monospace,monospace;font-size:12px}"
    ".err{color:#b42318}"
    "td.err{color:#b42318;max-width:420px;overflow-wrap:anywhere}"
    ".badge{display:inline-block;padding:1px 7px;border-radius:9px;font-size:12px;"
    "background:#eceef2}"
    ".badge.dead_letter{background:#fee4e2;color:#b42318}"
    ".badge.delivered,.badge.acked{background:#dcfae6;color:#067647}"
    ".badge.pending{background:#d1e9ff;color:#175cd3}"
    ".badge.delivering{background:#fef0c7;color:#b54708}"
    ".badge.expired{background:#f2f4f7;color:#475467}"
    "form.filter{display:flex;gap:8px;align-items:center;margin:8px 0}"
    "pre{background:#fff;border:1px solid #dde1e8;padding:10px;overflow:auto;font-size:12px}"
    ".pager{margin:10px 0}"
    ".muted{color:#5b6475}"
    "dl{display:grid;grid-template-columns:max-content 1fr;gap:4px 16px;background:#fff;"
    "border:1px solid #dde1e8;padding:10px 14px;margin:0}"
    "dt{color:#5b6475}"
    "dd{margin:0}"
)


def text(value: object) -> str:
    """Outside text, visible and escaped for HTML."""
    return html.escape(visible("" if value is None else str(value)), quote=True)


def when(seconds: object, now: float) -> str:
    """A Unix time as UTC, with how long ago (or until)."""
    if seconds is None:
        return "-"
    moment = float(str(seconds))
    try:
        stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(moment))
    except (OverflowError, OSError, ValueError):  # beyond the calendar: the number itself
        return text(repr(moment))
    delta = moment - now
    span = abs(delta)
    if span < 1:
        rel = "now"
    else:
        amount = (
            f"{span:.0f}s"
            if span < 60
            else f"{span / 60:.0f}m"
            if span < 3600
            else f"{span / 3600:.1f}h"
            if span < 86400
            else f"{span / 86400:.1f}d"
        )
        rel = f"in {amount}" if delta > 0 else f"{amount} ago"
    return f'<span title="{rel}">{stamp}Z</span> <span class="muted">({rel})</span>'


def age(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if seconds < 60:
        return f"{seconds:.0f}s"
    if seconds < 3600:
        return f"{seconds / 60:.0f}m"
    return f"{seconds / 3600:.1f}h"


def page(title: str, body: str, store: str) -> str:
    return (
        "<!doctype html><html lang=en><head><meta charset=utf-8>"
        '<meta name=viewport content="width=device-width,initial-scale=1">'
        f"<title>{text(title)} - trio_dispatch</title><style>{STYLE}</style></head><body>"
        f'<header><a href="/">trio_dispatch</a><span class=store>{text(store)}</span></header>'
        f"<main>{body}</main></body></html>"
    )


def _link(params: Mapping[str, str | None]) -> str:
    kept = {key: value for key, value in params.items() if value}
    return "/?" + urlencode(kept) if kept else "/"


def overview(
    stats: Mapping[str, Any],
    rows: Sequence[Mapping[str, Any]],
    *,
    status: str | None,
    kind: str | None,
    next_page: str | None,
    worker: Mapping[str, Any] | None,
    now: float,
) -> str:
    """Counts per status, oldest due age, dead letters of the last 24 h, and
    one page of the list filtered by status and kind."""
    capped = set(stats["capped"])
    cards = []
    for name in STATUS_ORDER:
        n = stats["counts"].get(name, 0)
        shown = f"{n:,}+" if name in capped else f"{n:,}"
        cards.append(
            f'<div class="card {name}"><a href="{text(_link({"status": name}))}">'
            f"<div class=n>{shown}</div><div class=l>{name.replace('_', ' ')}</div></a></div>"
        )
    dead = stats["dead_letters_last_24h"]
    dead_shown = f"{dead:,}+" if stats["dead_letters_capped"] else f"{dead:,}"
    cards.append(
        f'<div class="card dead_letter"><a href="{text(_link({"status": "dead_letter"}))}">'
        f"<div class=n>{dead_shown}</div><div class=l>dead letters, last 24 h</div></a></div>"
    )
    cards.append(
        f"<div class=card><div class=n>{age(stats['oldest_due_pending_age_seconds'])}</div>"
        "<div class=l>oldest due, waiting</div></div>"
    )
    worker_line = ""
    if worker is not None:
        worker_line = (
            f"<p class=muted>worker: {worker['in_flight']} of {worker['concurrency']} slots busy, "
            f"last scan {age(worker['last_scan_age_seconds'])} ago, "
            f"{worker['delivered']:,} delivered since start</p>"
        )
    options = ['<option value="">any status</option>'] + [
        f'<option value="{name}"{" selected" if name == status else ""}>{name}</option>'
        for name in STATUS_ORDER
    ]
    form = (
        '<form class=filter method=get action="/">'
        f"<label>status <select name=status>{''.join(options)}</select></label>"
        f'<label>kind <input name=kind value="{text(kind or "")}" placeholder="any kind"></label>'
        '<button type=submit>Filter</button> <a href="/">clear</a></form>'
    )
    heading = (
        "Dispatches"
        + (f": {text(status)}" if status else "")
        + (f", kind {text(kind)}" if kind else "")
    )
    body = (
        f"<h1>Outbox</h1><div class=cards>{''.join(cards)}</div>{worker_line}"
        f"<h2>{heading} <span class=muted>(newest first)</span></h2>{form}"
        f"{dispatch_table(rows, now)}"
    )
    if next_page:
        body += f'<div class=pager><a id=older href="{text(next_page)}">Older &rarr;</a></div>'
    return body


def dispatch_table(rows: Sequence[Mapping[str, Any]], now: float) -> str:
    if not rows:
        return "<p class=muted>No dispatches match.</p>"
    head = (
        "<tr><th>created</th><th>id</th><th>kind</th><th>deliver_to</th><th>status</th>"
        "<th>attempt</th><th>next attempt</th><th>last error</th></tr>"
    )
    lines = []
    for row in rows:
        error = str(row.get("last_error") or "")
        live = row["status"] in ("pending", "delivering")
        next_at = when(row["next_attempt_at"], now) if live else "-"
        lines.append(
            "<tr>"
            f"<td class=when>{when(row['created_at'], now)}</td>"
            f'<td class=mono><a href="/dispatch/{text(row["id"])}">{text(row["id"])}</a></td>'
            f"<td>{text(row['kind'])}</td><td>{text(row['deliver_to'])}</td>"
            f'<td><span class="badge {text(row["status"])}">{text(row["status"])}</span></td>'
            f"<td>{int(row['attempt'])}/{int(row['max_attempts'])}</td>"
            f"<td class=when>{next_at}</td>"
            f"<td class=err>{text(error[:200] + ('…' if len(error) > 200 else ''))}</td>"
            "</tr>"
        )
    return f"<table>{head}{''.join(lines)}</table>"


def masked(row: Mapping[str, Any]) -> dict[str, Any]:
    """A row fit to show: the ack token masked, in the row and its payload."""
    out = dict(row)
    if out.get("ack_token") is not None:
        out["ack_token"] = MASK
    payload = out.get("payload")
    if isinstance(payload, dict) and payload.get("ack_token") is not None:
        out["payload"] = {**payload, "ack_token": MASK}
    return out


def detail(
    row: Mapping[str, Any] | None,
    dispatch_id: str,
    history: Iterable[Mapping[str, Any]],
    now: float,
) -> str:
    """A dispatch's fields, payload (ack token masked) and history."""
    parts = [f"<h1>Dispatch <span class=mono>{text(dispatch_id)}</span></h1>"]
    if row is None:
        parts.append("<p class=muted>No such dispatch (purged or never enqueued).</p>")
    else:
        row = masked(row)
        fields = [
            ("status", f'<span class="badge {text(row["status"])}">{text(row["status"])}</span>'),
            ("kind", text(row["kind"])),
            ("deliver_to", text(row["deliver_to"])),
            ("attempt", f"{int(row['attempt'])} of {int(row['max_attempts'])}"),
            (
                "next attempt",
                when(row["next_attempt_at"], now)
                if row["status"] in ("pending", "delivering")
                else "-",
            ),
            ("created", when(row["created_at"], now)),
            ("updated", when(row["updated_at"], now)),
            ("expires", when(row["expires_at"], now)),
            ("dedup key", text(row["dedup_key"] or "-")),
            ("ack required", "yes" if row["ack_required"] else "no"),
            ("ack token", text(row["ack_token"] or "-")),
            ("last error", f"<span class=err>{text(row['last_error'] or '-')}</span>"),
        ]
        parts.append(
            "<dl>" + "".join(f"<dt>{name}</dt><dd>{value}</dd>" for name, value in fields) + "</dl>"
        )
        payload = json.dumps(row["payload"], indent=2, ensure_ascii=False, sort_keys=True)
        parts.append(f"<h2>Payload</h2><pre id=payload>{text_block(payload)}</pre>")
    rows = []
    for t in history:
        metadata = t.get("metadata")
        rows.append(
            "<tr>"
            f"<td>{when(t['created_at'], now)}</td>"
            f"<td>{text(t['previous_status'] or '-')} &rarr; {text(t['status'])}</td>"
            f"<td class=mono>{text(t['reason_code'])}</td>"
            f"<td>{text(t['source'])} / {text(t['actor'])}</td>"
            f"<td>{text(t['reason_summary'])}</td>"
            f"<td class=mono>{text(json.dumps(metadata, sort_keys=True) if metadata else '')}</td>"
            "</tr>"
        )
    parts.append("<h2>History</h2>")
    if rows:
        parts.append(
            "<table id=history><tr><th>when</th><th>change</th><th>reason</th><th>by</th>"
            f"<th>summary</th><th>metadata</th></tr>{''.join(rows)}</table>"
        )
    else:
        parts.append("<p class=muted>No history.</p>")
    parts.append('<p><a href="/">&larr; all dispatches</a></p>')
    return "".join(parts)


def text_block(value: str) -> str:
    """Multi-line outside text: each line visible and escaped."""
    return "\n".join(text(line) for line in value.split("\n"))


def not_found(path: str) -> str:
    return f"<h1>Not found</h1><p class=muted>{text(path)}</p><p><a href='/'>dashboard</a></p>"


def known_status(value: str | None) -> str | None:
    return value if value in STATUSES else None
