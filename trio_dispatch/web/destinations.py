"""The dashboard's destinations (docs/dashboard.md, docs/destinations.md): ``/destinations``
lists what ``trio-dispatch destinations`` lists, ``/destinations/detail?name=NAME``
shows one whole with its audit, and an operator pauses (for a duration or
until a time, with a reason), resumes and enables one there:
``POST /destinations/pause``, ``/destinations/resume``,
``/destinations/enable`` with the form field ``name`` (and ``for``,
``until``, ``reason``).

Actions follow docs/dashboard.md: the operator role only (a viewer's POST is a 403
and changes nothing), a browser session's CSRF token and own ``Origin`` on
every POST, the library's own functions with actor ``web`` in the audit
row, one log line each. A browser lands back on the destination's page
with a notice; ``Accept: application/json`` gets JSON. A change that does
not apply (resume of a destination not paused, enable with no breaker open)
is a 409 with the reason, an unknown name a 404, a bad value a 400 naming
it, and none of them writes.

The names travel in the query or the form, never the path: a ``deliver_to``
may hold ``/`` or ``?``, which a path could not carry both ways unchanged.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, Final
from urllib.parse import urlencode

from prometheus_client.core import GaugeMetricFamily, Metric

from ..destinations import enable_destination, pause_destination, resume_destination
from ..destinations.inputs import DURATION_HELP, TIME_HELP, parse_for, parse_until
from ..destinations.listing import (
    Entry,
    Listing,
    list_destinations,
    policy_text,
    show_destination,
)
from ..destinations.policy import ANY_DESTINATION, Destination
from ..destinations.state import State
from ..redact import scrubbed_logger, visible
from ..store.base import Database
from ..times import relative_time
from ..validate import require_route
from . import pages
from .actions import ACTOR, HTML, JSON, Reply, action_form, client, hidden, wants_json
from .auth import Identity, Role, forgery

ACTIONS: Final = ("pause", "resume", "enable")
LIST_PATH: Final = "/destinations"
DETAIL_PATH: Final = "/destinations/detail"
MAX_STATE_LABELS: Final = 50
"""``trio_dispatch_destination_state`` labels at most this many
destinations: those the configuration names first, then those not active,
then the rest, each group by name (``deliver_to`` is outside input)."""
BREAKER_STATES: Final = (State.OPEN, State.HALF_OPEN, State.DISABLED)
DONE: Final = {
    "pause": "Paused: its rows stay pending and consume no attempt; attempts already "
    "running finish.",
    "resume": "Resumed: workers take its rows again.",
    "enable": "Enabled: its breaker is closed and its failures are counted afresh.",
}
"""The notice after each action, by the ``done`` query value (a closed set:
a link cannot make the page say anything else)."""

log = scrubbed_logger("trio_dispatch.web")


def detail_link(name: str, **extra: str) -> str:
    return f"{DETAIL_PATH}?{urlencode({'name': name, **extra})}"


def _html(title: str, body: str, store: str, status: int = 200) -> Reply:
    return Reply(status, pages.page(title, body, store).encode(), HTML)


def _json(status: int, document: Mapping[str, Any]) -> Reply:
    return Reply(status, json.dumps(document).encode() + b"\n", JSON)


class DestinationsView:
    """The destinations' pages, their actions and their metric, over ``db``
    with the configuration's ``policies``; ``acting``: an operator token is
    configured (else the pages show no form and nothing posts here)."""

    def __init__(
        self,
        db: Database,
        policies: Mapping[str, Destination],
        store_label: str,
        *,
        acting: bool,
        waiting: str = "",
    ) -> None:
        self.db = db
        self.policies = dict(policies)
        self.store_label = store_label
        self.acting = acting
        self.waiting = waiting
        """The rows left out of each one's oldest due (the ordering keys')."""

    # -- reads --------------------------------------------------------------

    async def listing(self, *, counts: bool = True) -> Listing:
        return await list_destinations(self.db, self.policies, counts=counts, waiting=self.waiting)

    async def summary(self) -> dict[str, int]:
        """The index page's card: how many destinations, how many not active."""
        found = await self.listing(counts=False)
        return {
            "count": len(found.entries),
            "not_active": sum(1 for entry in found.entries if entry.state is not State.ACTIVE),
        }

    async def metric_families(self) -> list[Metric]:
        """``trio_dispatch_destination_state``: a Prometheus state set, 1 for
        each destination's state now and 0 for the others."""
        found = await self.listing(counts=False)
        gauge = GaugeMetricFamily(
            "trio_dispatch_destination_state",
            "Each destination's state (1) and the states it is not in (0): active, paused, "
            "throttled, open, half_open, disabled; at most "
            f"{MAX_STATE_LABELS} destinations, configured first, then those not active.",
            labels=["deliver_to", "state"],
        )
        for entry in labelled(found.entries):
            for state in State:
                gauge.add_metric([entry.name, str(state)], 1.0 if entry.state is state else 0.0)
        return [gauge]

    async def page(
        self, path: str, query: Mapping[str, str], identity: Identity, scope: Mapping[str, Any]
    ) -> Reply | None:
        """``GET /destinations`` and ``/destinations/detail``; None for any
        other path."""
        if path == LIST_PATH:
            found = await self.listing()
            if wants_json(scope):
                return _json(
                    200,
                    {
                        "destinations": [entry.to_dict() for entry in found.entries],
                        "truncated": found.truncated,
                    },
                )
            return _html("Destinations", listing_body(found), self.store_label)
        if path == DETAIL_PATH:
            notice = DONE.get(query.get("done", ""), "")
            return await self._detail(scope, query.get("name", ""), identity, notice)
        return None

    async def _detail(
        self,
        scope: Mapping[str, Any],
        name: str,
        identity: Identity,
        notice: str = "",
        status: int = 200,
        error: bool = False,
    ) -> Reply:
        now, entry = await show_destination(self.db, self.policies, name, waiting=self.waiting)
        if wants_json(scope) and status == 200:
            if entry is None:
                return _json(404, {"error": f"no destination named {name!r}"})
            return _json(200, {"destination": entry.to_dict()})
        if entry is None:
            body = (
                f"<h1>Destination <span class=mono>{pages.text(name)}</span></h1>"
                "<p class=muted>No such destination: not configured, no live rows and no "
                "state in the store.</p>" + _back()
            )
            return _html("Not found", body, self.store_label, 404)
        forms = self._forms(entry, identity)
        body = detail_body(entry, now, forms, notice, error)
        return _html(f"Destination {name}", body, self.store_label, status)

    def _forms(self, entry: Entry, identity: Identity) -> str:
        """The operator's buttons for a browser session; a note for an
        operator without one; nothing for a viewer."""
        if not self.acting or identity.role < Role.OPERATOR:
            return ""
        if identity.session is None:
            return "<p class=note>Log in (<a href=/login>/login</a>) to act from here.</p>"
        csrf = hidden("csrf", identity.session.csrf)
        name = hidden("name", entry.name)
        pause = (
            '<form method=post action="/destinations/pause" class="action pause" id=pause>'
            f"{csrf}{name}"
            '<label>for <input name=for size=6 placeholder="30m" '
            f'title="{pages.text(DURATION_HELP)}"></label> '
            f'<label>or until <input name=until size=22 placeholder="YYYY-MM-DDTHH:MM:SSZ" '
            f'title="{pages.text(TIME_HELP)}"></label> '
            "<label>reason <input name=reason size=28 maxlength=500></label> "
            "<button type=submit>Pause</button></form>"
        )
        forms = [pause]
        if entry.state is State.PAUSED:
            forms.append(
                action_form("/destinations/resume", "Resume", identity, {"name": entry.name})
            )
        if entry.state in BREAKER_STATES:
            forms.append(
                action_form("/destinations/enable", "Enable", identity, {"name": entry.name})
            )
        return f"<div class='actions destination'>{''.join(forms)}</div>"

    # -- actions ------------------------------------------------------------

    async def act(
        self,
        scope: Mapping[str, Any],
        identity: Identity,
        form: Mapping[str, str],
        path: str,
    ) -> Reply | None:
        """``POST /destinations/pause|resume|enable``; None for any other path."""
        action = path.removeprefix(LIST_PATH + "/") if path.startswith(LIST_PATH + "/") else ""
        if action not in ACTIONS:
            return None
        if identity.role < Role.OPERATOR:
            return self._refused(scope, 403, "only an operator may act")
        refused = forgery(identity, scope, form.get("csrf"))
        if refused is not None:
            return self._refused(scope, 403, refused)
        name = form.get("name", "")
        try:
            if name == ANY_DESTINATION:
                raise ValueError("'*' names the defaults of every destination, not one")
            require_route(name)
            for_seconds = parse_for(form["for"]) if form.get("for", "").strip() else None
            until = parse_until(form["until"]) if form.get("until", "").strip() else None
            if for_seconds is not None and until is not None:
                raise ValueError("give a duration (for) or a time (until), not both")
        except (TypeError, ValueError) as exc:
            return await self._not_applied(scope, identity, name, 400, str(exc))
        _, entry = await show_destination(self.db, self.policies, name, waiting=self.waiting)
        if entry is None:
            message = f"no destination named {name!r}"
            if wants_json(scope):
                return _json(404, {"destination": name, "applied": False, "error": message})
            return await self._detail(scope, name, identity)
        reason = form.get("reason") or None
        where = client(scope)
        before = entry.state
        try:
            if action == "pause":
                was = await pause_destination(
                    self.db, name, for_seconds=for_seconds, until=until, reason=reason, actor=ACTOR
                )
                applied, before = True, was.state
            elif action == "resume":
                applied = await resume_destination(self.db, name, reason=reason, actor=ACTOR)
            else:
                applied = await enable_destination(self.db, name, reason=reason, actor=ACTOR)
        except (TypeError, ValueError) as exc:  # refused before anything was written
            return await self._not_applied(scope, identity, name, 400, str(exc))
        log.info(
            "web: %s of destination %s by %s (%s) from %s: %s",
            action,
            visible(name),
            identity.role,
            identity.via,
            where,
            "applied" if applied else "not applied",
        )
        if not applied:
            message = (
                f"{name} was not paused (it is {before}): nothing to do"
                if action == "resume"
                else f"{name} has no breaker open or disabled (it is {before}): nothing to do"
            )
            return await self._not_applied(scope, identity, name, 409, message)
        if wants_json(scope):
            _, after = await show_destination(self.db, self.policies, name, waiting=self.waiting)
            return _json(
                200,
                {
                    "destination": name,
                    "action": action,
                    "applied": True,
                    "from": str(before),
                    "to": None if after is None else str(after.state),
                    "until": None if after is None else after.seen.until,
                },
            )
        return Reply(303, b"", HTML, ((b"location", detail_link(name, done=action).encode()),))

    def _refused(self, scope: Mapping[str, Any], status: int, message: str) -> Reply:
        if wants_json(scope):
            return _json(status, {"error": message})
        body = f"<h1>Not applied</h1><p class=error>{pages.text(message)}</p>{_back()}"
        return _html("Not applied", body, self.store_label, status)

    async def _not_applied(
        self,
        scope: Mapping[str, Any],
        identity: Identity,
        name: str,
        status: int,
        message: str,
    ) -> Reply:
        """A refusal on the destination's own page (or as JSON)."""
        if wants_json(scope):
            return _json(status, {"destination": name, "applied": False, "error": message})
        reply = await self._detail(scope, name, identity, message, status, error=True)
        if reply.status == 404:
            return self._refused(scope, status, message)
        return reply


def labelled(entries: tuple[Entry, ...]) -> list[Entry]:
    """The destinations that get a label, at most :data:`MAX_STATE_LABELS`."""
    ranked = sorted(entries, key=lambda e: (not e.configured, e.state is State.ACTIVE, e.name))
    return sorted(ranked[:MAX_STATE_LABELS], key=lambda e: e.name)


# -- HTML ---------------------------------------------------------------------------


def _back(*, listing: bool = False) -> str:
    dashboard = '<a href="/">&larr; all dispatches</a>'
    if listing:
        return f"<p>{dashboard}</p>"
    return f'<p><a href="{LIST_PATH}">&larr; all destinations</a> &middot; {dashboard}</p>'


def _state_cell(entry: Entry, now: float, *, whole: bool = False) -> str:
    """The state's badge and its end: how far away in a table, the time
    too on a destination's page (``whole``)."""
    badge = pages.badge(str(entry.state))
    until = entry.seen.until
    if until is not None and whole:
        return f"{badge} until {pages.when(until, now)}"
    if until is not None:
        return f"{badge} <span class=muted>ends {pages.text(relative_time(until, now))}</span>"
    if entry.state is State.PAUSED:
        return f"{badge} <span class=muted>until resumed</span>"
    return badge


def _rate(entry: Entry) -> str:
    rate = entry.policy.gcra_rate
    if rate is None:
        return "-"
    return f"{rate} &middot; {entry.starts_available}/{entry.policy.burst}"


def _running(entry: Entry) -> str:
    limit = entry.policy.concurrency
    return f"{entry.running}/{'-' if limit is None else limit}"


def listing_body(found: Listing) -> str:
    """Every destination listed: its state (and until when), why, rate and
    starts free, concurrency used/limit, pending, oldest due, failures in a
    row, last success and failure; each name links its page."""
    parts = ["<h1>Destinations</h1>"]
    if not found.entries:
        parts.append(
            "<p class=muted>No destinations: none configured (the configuration's "
            "<span class=mono>destinations:</span> section) and none with live rows.</p>"
        )
        parts.append(_back(listing=True))
        return "".join(parts)
    now = found.now
    lines = []
    for entry in found.entries:
        link = detail_link(entry.name)
        lines.append(
            "<tr>"
            f'<td class=mono title="{pages.text(entry.name)}">'
            f'<a href="{pages.text(link)}">{pages.text(entry.name)}</a></td>'
            f"<td class=wrap>{_state_cell(entry, now)}</td>"
            f"<td>{_rate(entry)}</td>"
            f"<td>{_running(entry)}</td>"
            f"<td>{pages.text(entry.pending_text())}</td>"
            f"<td>{pages.age(entry.oldest_due_age)}</td>"
            f"<td>{entry.failures}</td>"
            f"<td>{pages.text(relative_time(entry.last_success_at, now))}</td>"
            f"<td>{pages.text(relative_time(entry.last_failure_at, now))}</td>"
            f"{pages.cut(entry.seen.reason or '')}"
            "</tr>"
        )
    parts.append(
        "<table id=destinations>"
        + pages.columns("10%", "16%", "10%", "6em", "6em", "7em", "6em", "7em", "7em", "")
        + "<tr><th>name</th><th>state</th><th title='the rate, and the starts it admits now "
        "of its burst'>rate &middot; free</th><th>running</th><th>pending</th>"
        "<th>oldest due</th><th>failures</th><th>last success</th><th>last failure</th>"
        "<th>why</th></tr>" + "".join(lines) + "</table>"
    )
    if found.truncated:
        parts.append(f"<p class=muted>The first {len(found.entries):,} by name: more exist.</p>")
    parts.append(_back(listing=True))
    return "".join(parts)


def detail_body(entry: Entry, now: float, forms: str, notice: str, error: bool) -> str:
    """One destination whole: its state, policy and counters, the operator's
    forms, and its audit, newest first."""
    origin = {
        "own": "configured",
        "*": 'the policy of "*"',
        "default": "not configured: no limits",
    }[entry.policy_from]
    note = ""
    if notice:
        note = f"<p class={'error' if error else 'notice'} id=notice>{pages.text(notice)}</p>"
    fields = [
        ("state", _state_cell(entry, now, whole=True)),
        ("why", pages.text(entry.seen.reason or "-")),
        ("policy", f"{pages.text(policy_text(entry.policy))} <span class=muted>({origin})</span>"),
        (
            "starts available",
            "- (no rate)"
            if entry.starts_available is None
            else f"{entry.starts_available} of {entry.policy.burst}"
            + (f" ({entry.starts_held} claimed ahead, not yet begun)" if entry.starts_held else ""),
        ),
        ("concurrency", f"{_running(entry)} running"),
        ("pending", pages.text(entry.pending_text())),
        (
            "oldest due",
            "-" if entry.oldest_due_age is None else pages.when(now - entry.oldest_due_age, now),
        ),
        ("throttled until", pages.when(entry.throttled_until, now)),
        ("failures in a row", str(entry.failures)),
        ("last success", pages.when(entry.last_success_at, now)),
        ("last failure", pages.when(entry.last_failure_at, now)),
    ]
    parts = [
        f"<h1>Destination <span class=mono>{pages.text(entry.name)}</span></h1>",
        note,
        forms,
        "<dl id=destination>"
        + "".join(f"<dt>{name}</dt><dd>{value}</dd>" for name, value in fields)
        + "</dl>",
        "<h2>Changes <span class=muted>(newest first)</span></h2>",
    ]
    if entry.changes:
        rows = [
            "<tr>"
            f"<td class=when>{pages.when(change.at, now)}</td>"
            f"<td class=wrap>{pages.text(change.previous or '-')} &rarr; "
            f"{pages.text(change.state)}</td>"
            f"<td class=when>{pages.when(change.until, now)}</td>"
            f"<td class=wrap>{pages.text(change.source)} / {pages.text(change.actor)}</td>"
            f"<td class=wrap>{pages.text(change.reason or '')}</td>"
            "</tr>"
            for change in entry.changes
        ]
        parts.append(
            "<table id=changes>"
            + pages.columns("11.5em", "14%", "11.5em", "18%", "")
            + "<tr><th>when</th><th>change</th><th>until</th><th>by</th><th>why</th></tr>"
            + "".join(rows)
            + "</table>"
        )
    else:
        parts.append("<p class=muted>No changes recorded.</p>")
    parts.append(_back())
    return "".join(parts)
