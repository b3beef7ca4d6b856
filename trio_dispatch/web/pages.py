"""The dashboard's pages: the index (counts, recent failures, the list),
the blocked keys, the schedules, a dispatch's own page, and the replay's
form; built of the pieces of :mod:`.markup` (every value escaped there),
whose names are imported from here too.
"""

from __future__ import annotations

import json
from collections.abc import Collection, Iterable, Mapping, Sequence
from typing import Any, Final

from ..lifecycle import STATUSES, Reason, Status
from ..outbox.reads import AWAITING_ACK
from ..redact import MASK
from .markup import CELL_TEXT_LIMIT as CELL_TEXT_LIMIT
from .markup import DISPATCH_PATH as DISPATCH_PATH
from .markup import age as age
from .markup import badge as badge
from .markup import columns as columns
from .markup import cut as cut
from .markup import dispatch_link as dispatch_link
from .markup import id_cell, link
from .markup import not_found as not_found
from .markup import page as page
from .markup import text as text
from .markup import text_block as text_block
from .markup import when as when
from .markup import with_notice as with_notice
from .style import STYLE as STYLE
from .style import STYLE_HASH as STYLE_HASH

STATUS_ORDER: Final = tuple(str(status) for status in Status)
"""The index page's cards and status choices, in the lifecycle's order."""


REFRESH_CHOICES: Final = (5, 10, 30, 60)
"""The auto-refresh periods the index page offers as links, in seconds."""


def overview(
    stats: Mapping[str, Any],
    rows: Sequence[Mapping[str, Any]],
    *,
    status: str | None,
    kind: str | None,
    next_page: str | None,
    worker: Mapping[str, Any] | None,
    ordering_key: str | None = None,
    coalesce_key: str | None = None,
    now: float,
    labels: Sequence[str] | None = None,
    failures: Sequence[Mapping[str, Any]] = (),
    refresh: int | None = None,
    here: Mapping[str, str] | None = None,
    schedules: Mapping[str, int] | None = None,
    destinations: Mapping[str, int] | None = None,
    waiting: Collection[str] = (),
) -> str:
    """Counts per status, oldest due age, dead letters of the last 24 h,
    blocked ordering keys, the recent failures, and one page of the list
    filtered by status, kind and ordering key (``labels``: each row's status
    label, "awaiting ack" included; ``waiting``: the ids of the rows waiting
    for their ordering key). With ``here`` (the page's query), a
    link that turns auto-refresh on or off; with ``schedules`` (``count``
    and ``paused``), a card linking to the schedules' page; with
    ``destinations`` (``count`` and ``not_active``), one linking to theirs."""
    capped = set(stats["capped"])
    cards = []
    for name in STATUS_ORDER:
        n = stats["counts"].get(name, 0)
        shown = f"{n:,}+" if name in capped else f"{n:,}"
        cards.append(
            f'<div class="card {name}"><a href="{text(link({"status": name}))}">'
            f"<div class=n>{shown}</div><div class=l>{name.replace('_', ' ')}</div></a></div>"
        )
    dead = stats["dead_letters_last_24h"]
    dead_shown = f"{dead:,}+" if stats["dead_letters_capped"] else f"{dead:,}"
    cards.append(
        f'<div class="card dead_letter"><a href="{text(link({"status": "dead_letter"}))}">'
        f"<div class=n>{dead_shown}</div><div class=l>dead letters, last 24 h</div></a></div>"
    )
    cards.append(
        f"<div class=card><div class=n>{age(stats['oldest_due_pending_age_seconds'])}</div>"
        "<div class=l>oldest due, unclaimed</div></div>"
    )
    if "blocked_keys" in stats:
        blocked_n = int(stats["blocked_keys"])
        blocked_shown = f"{blocked_n:,}+" if stats["blocked_keys_capped"] else f"{blocked_n:,}"
        cards.append(
            f'<div class="card blocked" id=blocked-keys><a href="/blocked">'
            f"<div class=n>{blocked_shown}</div><div class=l>blocked keys</div></a></div>"
        )
    if schedules is not None:
        cards.append(
            '<div class="card schedules" id=schedules-card><a href="/schedules">'
            f"<div class=n>{int(schedules['count']):,}</div>"
            f"<div class=l>schedules, {int(schedules['paused']):,} paused</div></a></div>"
        )
    if destinations is not None:
        cards.append(
            '<div class="card destinations" id=destinations-card><a href="/destinations">'
            f"<div class=n>{int(destinations['count']):,}</div>"
            f"<div class=l>destinations, {int(destinations['not_active']):,} not active</div>"
            "</a></div>"
        )
    worker_line = ""
    if worker is not None:
        worker_line = (
            f"<p class=muted>worker: {worker['in_flight']} of {worker['concurrency']} slots busy, "
            f"{worker['held_ahead']} rows held ahead, "
            f"last scan {age(worker['last_scan_age_seconds'])} ago, "
            f"{worker['delivered']:,} delivered since start</p>"
        )
    options = ['<option value="">any status</option>'] + [
        f'<option value="{name}"{" selected" if name == status else ""}>{name}</option>'
        for name in STATUS_ORDER
    ]
    kept = f'<input type=hidden name=refresh value="{int(refresh)}">' if refresh else ""
    form = (
        '<form class=filter method=get action="/">'
        f"{kept}"
        f"<label>status <select name=status>{''.join(options)}</select></label>"
        f'<label>kind <input name=kind value="{text(kind or "")}" placeholder="any kind"></label>'
        f'<label>ordering key <input name=ordering_key value="{text(ordering_key or "")}" '
        'placeholder="any key"></label>'
        f'<label>coalesce key <input name=coalesce_key value="{text(coalesce_key or "")}" '
        'placeholder="any key"></label>'
        '<button type=submit>Filter</button> <a href="/">clear</a></form>'
    )
    heading = (
        "Dispatches"
        + (f": {text(status)}" if status else "")
        + (f", kind {text(kind)}" if kind else "")
        + (f", ordering key {text(ordering_key)}" if ordering_key else "")
        + (f", coalesce key {text(coalesce_key)}" if coalesce_key else "")
    )
    body = (
        f"{refresh_links(here or {}, refresh)}"
        f"<h1>Outbox</h1><div class=cards>{''.join(cards)}</div>{worker_line}"
        f"<h2>Recent failures <span class=muted>(newest first)</span></h2>"
        f"{failures_table(failures, now)}"
        f"<h2>{heading} <span class=muted>(newest first)</span></h2>{form}"
        f"{dispatch_table(rows, now, labels, waiting)}"
    )
    if next_page:
        body += f'<div class=pager><a id=older href="{text(next_page)}">Older &rarr;</a></div>'
    return body


REPLAY_STATUSES: Final = (
    ("", "dead_letter or expired"),
    ("dead_letter", "dead_letter"),
    ("expired", "expired"),
)


def replay_form(fields: Mapping[str, str]) -> str:
    """The bulk retry's filters (docs/destinations.md#replay) as a GET form that counts
    what they match: status, destination, kind, ordering key, and the
    window of each row's last change (when it failed)."""
    chosen = fields.get("status", "")
    options = "".join(
        f'<option value="{value}"{" selected" if value == chosen else ""}>{label}</option>'
        for value, label in REPLAY_STATUSES
    )
    inputs = "".join(
        f'<label>{label} <input name={name} value="{text(fields.get(name, ""))}" '
        f'placeholder="{placeholder}"></label>'
        for name, label, placeholder in (
            ("deliver_to", "destination", "any destination"),
            ("kind", "kind", "any kind"),
            ("ordering_key", "ordering key", "any key"),
            ("since", "failed since", "2h or 2026-12-02T09:00Z"),
            ("until", "before", "now"),
        )
    )
    return (
        '<form class=filter id=replay method=get action="/actions/retry">'
        f"<label>status <select name=status>{options}</select></label>{inputs}"
        "<button type=submit>Count</button></form>"
        "<p class=muted>Times: ISO 8601 with an offset or Z, or a duration before now "
        "(30m, 2h, 7d); they compare when each row last changed (when it failed), "
        "since &le; changed &lt; before. Rows go back in id order, so ordering keys "
        "keep their order.</p>"
    )


def refresh_links(here: Mapping[str, str], refresh: int | None) -> str:
    """Auto-refresh on (each of :data:`REFRESH_CHOICES`) or off: links to
    this page with or without ``refresh``."""
    rest = {key: value for key, value in here.items() if key != "refresh"}
    if refresh:
        return (
            f"<p class=refresh id=refresh>auto-refresh every {int(refresh)}s &middot; "
            f'<a href="{text(link(rest))}">stop</a></p>'
        )
    choices = " ".join(
        f'<a href="{text(link({**rest, "refresh": str(seconds)}))}">{seconds}s</a>'
        for seconds in REFRESH_CHOICES
    )
    return f"<p class=refresh id=refresh>auto-refresh: off &middot; every {choices}</p>"


def next_attempt(row: Mapping[str, Any], now: float, waiting: bool = False) -> str:
    """A row's next attempt: "waiting" for a row ``waiting`` for its
    ordering key (:func:`~trio_dispatch.outbox.reads.waiting_term`: its
    ``next_attempt_at`` is not a time to read), else its time while live,
    else "-"."""
    if waiting:
        return "waiting"
    live = row["status"] in (Status.PENDING, Status.DELIVERING)
    return when(row["next_attempt_at"], now) if live else "-"


def attempts_cell(row: Mapping[str, Any]) -> str:
    """A row's attempts in a list: counted of allowed, and the throttled
    ones (not counted, docs/destinations.md) after a "+"."""
    throttles = int(row.get("throttles") or 0)
    counted = f"{int(row['attempt']) - throttles}/{int(row['max_attempts'])}"
    if not throttles:
        return f"<td>{counted}</td>"
    return f'<td title="{throttles} throttled, not counted">{counted} +{throttles}</td>'


def priority_text(row: Mapping[str, Any]) -> str:
    """A row's priority, signed (``+5``, ``0``, ``-3``)."""
    priority = int(row.get("priority") or 0)
    return f"{priority:+d}" if priority else "0"


def priority_cell(row: Mapping[str, Any]) -> str:
    """A row's priority in a list."""
    return f"<td>{priority_text(row)}</td>"


def attempts_text(row: Mapping[str, Any]) -> str:
    """A row's attempts on its page: counted of allowed, and the throttled
    ones."""
    throttles = int(row.get("throttles") or 0)
    shown = f"{int(row['attempt']) - throttles} of {int(row['max_attempts'])}"
    if throttles:
        shown += f" <span class=muted>(and {throttles} throttled, not counted)</span>"
    return shown


def dispatch_table(
    rows: Sequence[Mapping[str, Any]],
    now: float,
    labels: Sequence[str] | None = None,
    waiting: Collection[str] = (),
) -> str:
    """One page of the list; a column of priorities when a row has one
    other than 0, of ordering keys when a row is keyed; ``waiting``: the
    ids of the rows waiting for their ordering key."""
    if not rows:
        return "<p class=muted>No dispatches match.</p>"
    keyed = any(row.get("ordering_key") is not None for row in rows)
    ranked = any(row.get("priority") for row in rows)
    widths = ["11.5em", "10%", "10%", "12%", "8em"]
    names = ["created", "id", "kind", "deliver_to", "status"]
    if ranked:
        widths.append("5.5em")
        names.append("priority")
    widths += ["5.5em", "11.5em"]
    names += ["attempt", "next attempt"]
    if keyed:
        widths.append("10%")
        names.append("ordering key")
    head = (
        columns(*widths, "")
        + "<tr>"
        + "".join(f"<th>{name}</th>" for name in names)
        + "<th>last error</th></tr>"
    )
    shown = labels if labels is not None else [str(row["status"]) for row in rows]
    lines = []
    for row, label in zip(rows, shown, strict=True):
        key = row.get("ordering_key")
        key_cell = "" if not keyed else cut(key) if key is not None else "<td>-</td>"
        lines.append(
            "<tr>"
            f"<td class=when>{when(row['created_at'], now)}</td>"
            f"{id_cell(row['id'])}{cut(row['kind'])}{cut(row['deliver_to'])}"
            f"<td>{badge(label)}</td>"
            f"{priority_cell(row) if ranked else ''}"
            f"{attempts_cell(row)}"
            f"<td class=when>{next_attempt(row, now, row['id'] in waiting)}</td>"
            f"{key_cell}"
            f"{cut(row.get('last_error') or '', classes='err')}"
            "</tr>"
        )
    return f"<table id=dispatches>{head}{''.join(lines)}</table>"


def blocked(rows: Sequence[Mapping[str, Any]], ordering: str, limit: int, now: float) -> str:
    """The heads of blocked ordering keys, oldest first (at most ``limit``):
    each a ``dead_letter`` or ``expired`` row with rows of its key waiting
    behind it until an operator retries or purges it."""
    parts = ["<h1>Blocked keys</h1>"]
    if ordering == "skip":
        parts.append(
            "<p class=muted>No key blocks: dispatch.ordering.on_dead_letter is skip, so "
            "a dead head lets the next row of its key go.</p>"
        )
    elif not rows:
        parts.append("<p class=muted>No blocked keys.</p>")
    else:
        parts.append(
            f"<p class=muted>The first {limit:,} heads, oldest first: retry or purge a head "
            "to let its key go on.</p>"
            if len(rows) >= limit
            else "<p class=muted>Retry or purge a head to let its key go on.</p>"
        )
        lines = [
            "<tr>"
            f"{cut(row['ordering_key'])}{id_cell(row['id'])}"
            f"<td>{badge(str(row['status']))}</td>{cut(row['kind'])}{cut(row['deliver_to'])}"
            f"<td class=when>{when(row['updated_at'], now)}</td>"
            f"{cut(row.get('last_error') or '', classes='err')}"
            "</tr>"
            for row in rows
        ]
        parts.append(
            "<table id=blocked>"
            + columns("14%", "10%", "8em", "10%", "12%", "11.5em", "")
            + "<tr><th>ordering key</th><th>head</th><th>status</th><th>kind</th>"
            "<th>deliver_to</th><th>since</th><th>last error</th></tr>"
            + "".join(lines)
            + "</table>"
        )
    parts.append('<p><a href="/">&larr; all dispatches</a></p>')
    return "".join(parts)


def schedules(entries: Sequence[Any], now: float) -> str:
    """Every schedule (:class:`~trio_dispatch.schedules.Listing`): its
    cadence, timezone, what it enqueues, paused or not, its newest run (the
    tick, when it fired, what made it) and its next fire."""
    parts = ["<h1>Schedules</h1>"]
    if not entries:
        parts.append(
            "<p class=muted>No schedules configured (the configuration's "
            "<span class=mono>schedules:</span> section).</p>"
        )
    else:
        lines = []
        for entry in entries:
            schedule, last = entry.schedule, entry.last_run
            paused = bool(entry.state and entry.state.paused)
            lines.append(
                "<tr>"
                f"{cut(schedule.name, classes='mono wrap')}"
                f"{cut(schedule.cadence, classes='mono wrap')}"
                f"{cut(schedule.timezone, classes='wrap')}{cut(schedule.kind, classes='wrap')}"
                f"{cut(schedule.deliver_to, classes='wrap')}"
                f"<td>{badge('paused' if paused else 'active')}"
                f"{' ' + badge('other definition') if entry.differs else ''}</td>"
                f"<td class=when>{when(None if last is None else last['scheduled_for'], now)}</td>"
                f"<td class=when>{when(None if last is None else last['created_at'], now)}</td>"
                f"<td>{text('-' if last is None else last['origin'])}</td>"
                f"<td class=when>{'-' if paused else when(entry.next_fire, now)}</td>"
                "</tr>"
            )
        parts.append(
            "<table id=schedules>"
            # Every time column as wide as its stamp (the next fire took what
            # was left, and wrapped and cut it); the text columns share the
            # rest and wrap (a few rows: nothing is cut).
            + columns("", "", "", "", "", "6em", "11.5em", "11.5em", "6em", "11.5em")
            + "<tr><th>name</th><th>schedule</th><th>timezone</th><th>kind</th>"
            "<th>deliver_to</th><th>state</th><th>last tick</th><th>fired at</th>"
            "<th>origin</th><th>next fire</th></tr>" + "".join(lines) + "</table>"
        )
    parts.append('<p><a href="/">&larr; all dispatches</a></p>')
    return "".join(parts)


def failures_table(failures: Sequence[Mapping[str, Any]], now: float) -> str:
    """The recent failed attempts: when, which dispatch, its destination,
    retried or dead-lettered, and the reason (cut; whole on hover)."""
    if not failures:
        return "<p class=muted id=failures>No failed attempts.</p>"
    head = (
        columns("11.5em", "10%", "14%", "8em", "")
        + "<tr><th>when</th><th>id</th><th>deliver_to</th><th>outcome</th><th>reason</th></tr>"
    )
    lines = []
    for failure in failures:
        retried = failure["status"] == Status.PENDING
        deliver_to = failure["deliver_to"]
        lines.append(
            "<tr>"
            f"<td class=when>{when(failure['created_at'], now)}</td>"
            f"{id_cell(failure['id'])}"
            + (cut(deliver_to) if deliver_to is not None else "<td class=muted>(purged)</td>")
            + f"<td>{badge('retry' if retried else str(failure['status']))}</td>"
            f"{cut(failure['reason_summary'], classes='err')}"
            "</tr>"
        )
    return f"<table id=failures>{head}{''.join(lines)}</table>"


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
    label: str | None = None,
    behind: Mapping[str, str] | None = None,
    actions: str = "",
    waiting: bool = False,
) -> str:
    """A dispatch's fields, payload (ack token masked) and history, every
    value whole (long ones wrap); ``label``: its status label ("awaiting
    ack" included), by default its status; ``behind``: the ``id`` and
    ``status`` of the row it waits behind in its ordering key; ``waiting``:
    whether it waits for its key; ``actions``: the operator's buttons
    (HTML), under the heading."""
    parts = [f"<h1>Dispatch <span class=mono>{text(dispatch_id)}</span></h1>{actions}"]
    if row is None:
        parts.append("<p class=muted>No such dispatch (purged or never enqueued).</p>")
    else:
        row = masked(row)
        status = badge(label or str(row["status"]))
        if label == AWAITING_ACK:
            status += f" <span class=muted>(status {text(row['status'])})</span>"
        fields = [
            ("status", status),
            ("kind", text(row["kind"])),
            ("deliver_to", text(row["deliver_to"])),
            ("attempt", attempts_text(row)),
            ("next attempt", next_attempt(row, now, waiting)),
            ("created", when(row["created_at"], now)),
            ("updated", when(row["updated_at"], now)),
            ("expires", when(row["expires_at"], now)),
            ("dedup key", text(row["dedup_key"] or "-")),
            ("ordering key", text(row.get("ordering_key") or "-")),
            ("priority", priority_text(row)),
            ("coalesce key", coalescing_text(row, now)),
            ("ack required", "yes" if row["ack_required"] else "no"),
            ("ack token", text(row["ack_token"] or "-")),
            ("last error", f"<span class=err>{text(row['last_error'] or '-')}</span>"),
        ]
        successor = superseded_by(history) if row["status"] == "superseded" else None
        if successor is not None:
            fields.append(
                (
                    "superseded by",
                    f'<a class=mono id=successor href="{dispatch_link(successor)}">'
                    f"{text(successor)}</a>",
                )
            )
        if behind is not None:
            fields.append(
                (
                    "waiting behind",
                    f'<a class=mono id=behind href="{dispatch_link(behind["id"])}">'
                    f"{text(behind['id'])}</a> {badge(behind['status'])}",
                )
            )
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
            f"<td class=when>{when(t['created_at'], now)}</td>"
            f"<td class=wrap>{text(t['previous_status'] or '-')} &rarr; {text(t['status'])}</td>"
            f'<td class="mono wrap">{text(t["reason_code"])}</td>'
            f"<td class=wrap>{text(t['source'])} / {text(t['actor'])}</td>"
            f"<td class=wrap>{text(t['reason_summary'])}</td>"
            f'<td class="mono wrap">'
            f"{text(json.dumps(metadata, sort_keys=True) if metadata else '')}</td>"
            "</tr>"
        )
    parts.append("<h2>History</h2>")
    if rows:
        parts.append(
            "<table id=history>"
            + columns("11.5em", "14%", "18%", "14%", "", "16%")
            + "<tr><th>when</th><th>change</th><th>reason</th><th>by</th>"
            f"<th>summary</th><th>metadata</th></tr>{''.join(rows)}</table>"
        )
    else:
        parts.append("<p class=muted>No history.</p>")
    parts.append('<p><a href="/">&larr; all dispatches</a></p>')
    return "".join(parts)


def coalescing_text(row: Mapping[str, Any], now: float) -> str:
    """A row's coalesce key (docs/controls.md) linked to the list of its
    rows, with when its chain began and a debounce's due time; ``-``."""
    key = row.get("coalesce_key")
    if key is None:
        return "-"
    said = f'<a class=mono href="{text(link({"coalesce_key": str(key)}))}">{text(key)}</a>'
    since = row.get("coalesce_since")
    if since is not None and since != row.get("created_at"):
        said += f" <span class=muted>(replacing rows since {when(since, now)})</span>"
    if row.get("not_before") is not None:
        said += f" <span class=muted>debounced: not before {when(row['not_before'], now)}</span>"
    return said


def superseded_by(history: Iterable[Mapping[str, Any]]) -> str | None:
    """The id the history's supersede names (its summary), or None."""
    for t in history:
        summary = str(t.get("reason_summary") or "")
        if t.get("reason_code") == Reason.COALESCED and summary.startswith("superseded by "):
            return summary.rsplit(" ", 1)[-1]
    return None


def known_status(value: str | None) -> str | None:
    return value if value in STATUSES else None
