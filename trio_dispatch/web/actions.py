"""Acting from the dashboard (docs/dashboard.md#acting-from-the-dashboard-roles): log in and
out, retry, cancel and purge one row, and bulk retry, cancel or purge by
filter after a confirmation (a bulk retry by destination and failure time
is the dashboard's replay; at most
:data:`~trio_dispatch.outbox.bulk.BULK_LIMIT` rows a request).

Every action is a POST, checked on the server: an operator's role (else
403), and for a browser session the CSRF token and the same ``Origin``
(:func:`~.auth.forgery`). It runs the operators' own functions and
transitions (source ``operator``, actor ``web``, the client's address in
the transition's metadata) and logs one line, never a token. An action
that applies answers JSON for ``Accept: application/json``, else a 303 to
the row's page (the list, once the row is gone), which tells a browser
session what was done, once; one that does not apply is 404 or 409 with
the reason. Wrong tokens at ``/login`` are slowed down per
client (:mod:`.throttle`): one log line per burst, then 429.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Awaitable, Callable, Mapping, MutableMapping
from typing import Any, Final
from urllib.parse import parse_qs, quote, urlencode

from ..errors import ActionRefused
from ..lifecycle import InvalidTransition
from ..outbox.bulk import BULK_LIMIT, BulkAction, Filter, apply_bulk, bulk_filter, count_matching
from ..outbox.cancel import CANCELLABLE, cancel_dispatch
from ..outbox.operator import RETRYABLE, purge_dispatch, retry_dispatch
from ..outbox.reads import get_dispatch
from ..redact import scrubbed_logger, visible
from ..store.base import Database
from ..times import read_time
from ..validate import require_reason
from . import pages
from .auth import Auth, Identity, Role, forgery, header, same_origin
from .throttle import LOGIN_FAILURES, LOGIN_WINDOW_SECONDS, LoginThrottle

MAX_FORM_BYTES: Final = 16 * 1024
"""A form body larger than this is refused unread (413)."""
ACTOR: Final = "web"
FILTER_FIELDS: Final = ("status", "deliver_to", "kind", "ordering_key", "since", "until")
"""The fields that choose the rows of a bulk action."""
_ONE: Final = re.compile(r"/dispatches/([^/]+)/(retry|cancel|purge)")
_BULK: Final = re.compile(r"/actions/(retry|cancel|purge)")
ACTION_LABELS: Final = (("retry", "Retry"), ("cancel", "Cancel"), ("purge", "Purge"))
"""The row actions, in the order their buttons show."""
CANCEL_WAIT_SECONDS: Final = 5.0
"""How long a cancel of a running attempt waits for its worker's answer
before the dashboard says it is asked for (202)."""
_DONE: Final = {"retry": "retried", "cancel": "cancelled", "purge": "purged"}
HTML: Final = b"text/html; charset=utf-8"
NO_SESSION: Final = {
    "bearer": "a bearer token has no session to end: /logout ends a browser's login "
    "(stop sending the token instead)",
    "basic": "a Basic login has no session to end: /logout ends a login made at /login "
    "(the browser forgets a Basic login when it closes)",
    "anonymous": "not logged in: there is no session to end",
}
"""Why ``POST /logout`` without a session ends nothing, by how the request
proved its role."""
JSON: Final = b"application/json"

log = scrubbed_logger("trio_dispatch.web")

Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]


@dataclasses.dataclass(frozen=True)
class Reply:
    """One answer: status, body, content type and extra headers."""

    status: int
    body: bytes
    content_type: bytes = HTML
    headers: tuple[tuple[bytes, bytes], ...] = ()


class FormTooLarge(ValueError):
    """A request body over :data:`MAX_FORM_BYTES`."""


async def read_form(scope: Mapping[str, Any], receive: Receive) -> dict[str, str]:
    """The query string's and the urlencoded body's fields (body wins)."""
    fields = {
        key: values[-1]
        for key, values in parse_qs(scope.get("query_string", b"").decode("latin-1")).items()
    }
    body = b""
    while True:
        message = await receive()
        body += message.get("body", b"")
        if len(body) > MAX_FORM_BYTES:
            raise FormTooLarge(f"the form is larger than {MAX_FORM_BYTES} bytes")
        if not message.get("more_body"):
            break
    for key, values in parse_qs(body.decode("utf-8", "replace")).items():
        fields[key] = values[-1]
    return fields


def wants_json(scope: Mapping[str, Any]) -> bool:
    accept = header(scope, b"accept") or b""
    return b"application/json" in accept.lower()


def client(scope: Mapping[str, Any]) -> str:
    """The client's address as the server saw it."""
    found = scope.get("client")
    return str(found[0]) if found else "unknown"


def offered(action: str, status: str | None) -> bool:
    """Whether a row (or a filter) of ``status`` has ``action``: retry for
    dead letters and expired rows, cancel for pending and delivering ones,
    purge for any."""
    if action == "retry":
        return status in RETRYABLE
    if action == "cancel":
        return status in CANCELLABLE
    return True


def hidden(name: str, value: str) -> str:
    return f'<input type=hidden name="{pages.text(name)}" value="{pages.text(value)}">'


def action_form(
    path: str, label: str, identity: Identity | None, fields: Mapping[str, str] | None = None
) -> str:
    """A POST button for ``path``, with the session's CSRF token; empty
    without a browser session (the caller checks the role)."""
    if identity is None or identity.session is None:
        return ""
    inputs = "".join(hidden(k, v) for k, v in (fields or {}).items() if v)
    return (
        f'<form method=post action="{pages.text(path)}" class=action>'
        f"{hidden('csrf', identity.session.csrf)}{inputs}"
        f"<button type=submit>{pages.text(label)}</button></form>"
    )


class Actions:
    """The POST routes and the pages that lead to them."""

    def __init__(self, db: Database, auth: Auth, store_label: str) -> None:
        self.db = db
        self.auth = auth
        self.store_label = store_label
        self.throttle = LoginThrottle(auth.clock)
        self.cancel_wait_seconds = CANCEL_WAIT_SECONDS
        """How long a cancel of a running attempt waits for its worker."""

    def _page(
        self,
        title: str,
        body: str,
        status: int = 200,
        headers: tuple[tuple[bytes, bytes], ...] = (),
        *,
        store: bool = True,
    ) -> Reply:
        label = self.store_label if store else ""
        return Reply(status, pages.page(title, body, label).encode(), HTML, headers)

    def _answer(
        self,
        scope: Mapping[str, Any],
        status: int,
        document: Mapping[str, Any],
        message: str,
        back: str = "/",
    ) -> Reply:
        if wants_json(scope):
            return Reply(status, json.dumps(document).encode() + b"\n", JSON)
        body = f'<p>{pages.text(message)}</p><p><a href="{pages.text(back)}">back</a></p>'
        return self._page("Done" if status < 400 else "Not applied", body, status)

    def _done(
        self,
        scope: Mapping[str, Any],
        identity: Identity,
        document: Mapping[str, Any],
        message: str,
        back: str = "/",
        *,
        status: int = 200,
    ) -> Reply:
        """An action that applied: its JSON (with ``status``) when asked, else
        a redirect to ``back`` (POST, redirect, GET: a reload asks nothing
        again), whose page says ``message`` once to a browser session."""
        if wants_json(scope):
            return Reply(status, json.dumps(document).encode() + b"\n", JSON)
        if identity.session is not None:
            identity.session.notice = message
        return Reply(303, b"", HTML, ((b"location", back.encode("ascii")),))

    def login_page(
        self, error: str = "", status: int = 200, headers: tuple[tuple[bytes, bytes], ...] = ()
    ) -> Reply:
        note = f"<p class=error>{pages.text(error)}</p>" if error else ""
        body = (
            f"<h1>Log in</h1>{note}<form method=post action=/login class=login>"
            "<label>Token <input type=password name=token autocomplete=current-password "
            "required></label> <button type=submit>Log in</button></form>"
        )
        # Nothing about the store before a role is proven: not even its name.
        return self._page("Log in", body, status, headers, store=False)

    async def login(self, scope: Mapping[str, Any], form: Mapping[str, str]) -> Reply:
        if not same_origin(scope):
            return self.login_page("the request's Origin is not this dashboard", 403)
        address = client(scope)
        wait = self.throttle.retry_after(address)
        if wait is not None:  # refused unheard: no token is compared
            return self.login_page(
                f"too many wrong tokens from your address: try again in {wait}s",
                429,
                ((b"retry-after", str(wait).encode()),),
            )
        session = self.auth.login(form.get("token", ""))
        if session is None:
            if self.throttle.failed(address):
                log.warning(
                    "web: a login from %s was refused (wrong token); more wrong tokens from it "
                    "in the next %gs go unlogged, and %d in that time make its logins wait (429)",
                    address,
                    LOGIN_WINDOW_SECONDS,
                    LOGIN_FAILURES,
                )
            return self.login_page("that token proves no role", 401)
        log.info("web: %s logged in from %s", session.role, address)
        secure = scope.get("scheme") == "https"
        return Reply(
            303,
            b"",
            HTML,
            ((b"location", b"/"), (b"set-cookie", Auth.set_cookie(session, secure))),
        )

    def logout(
        self, scope: Mapping[str, Any], identity: Identity, form: Mapping[str, str]
    ) -> Reply:
        if identity.session is None:
            message = NO_SESSION.get(identity.via, NO_SESSION["anonymous"])
            return self._answer(scope, 403, {"error": message}, message)
        refused = forgery(identity, scope, form.get("csrf"))
        if refused is not None:
            return self._answer(scope, 403, {"error": refused}, refused)
        self.auth.logout(identity.session)
        secure = scope.get("scheme") == "https"
        return Reply(
            303,
            b"",
            HTML,
            ((b"location", b"/login"), (b"set-cookie", Auth.set_cookie(None, secure))),
        )

    def _not_operator(self, scope: Mapping[str, Any]) -> Reply:
        return self._answer(
            scope, 403, {"error": "only an operator may act"}, "only an operator may act"
        )

    def _filter(
        self, scope: Mapping[str, Any], action: str, fields: Mapping[str, str]
    ) -> tuple[BulkAction, Filter] | Reply:
        """The bulk action and filter ``fields`` ask for, or the 400 (a bad
        value) or 409 (no such edge for that status) that refuses them.
        ``since``/``until`` are read as :func:`~trio_dispatch.times.read_time`
        reads them, by the dashboard's clock."""
        now = self.auth.clock()
        given = {name: fields.get(name) or None for name in FILTER_FIELDS}
        try:
            return bulk_filter(
                action,
                given["status"],
                given["kind"],
                given["ordering_key"],
                deliver_to=given["deliver_to"],
                since=None if given["since"] is None else read_time("since", given["since"], now),
                until=None if given["until"] is None else read_time("until", given["until"], now),
            )
        except ActionRefused as exc:
            return self._answer(scope, 409, {"error": str(exc)}, str(exc))
        except ValueError as exc:
            return self._answer(scope, 400, {"error": str(exc)}, str(exc))

    def _no_filter(
        self, scope: Mapping[str, Any], fields: Mapping[str, str], action: str = "retry"
    ) -> Reply | None:
        """The 400 that refuses a bulk retry or cancel nothing narrows, else None."""
        if action == "purge" or any(fields.get(name) for name in FILTER_FIELDS):
            return None
        message = f"a bulk {action} needs at least one filter: {', '.join(FILTER_FIELDS)}"
        return self._answer(scope, 400, {"error": message}, message, f"/actions/{action}")

    def _refusal(
        self, scope: Mapping[str, Any], identity: Identity, form: Mapping[str, str]
    ) -> Reply | None:
        if identity.role < Role.OPERATOR:
            return self._not_operator(scope)
        refused = forgery(identity, scope, form.get("csrf"))
        if refused is not None:
            return self._answer(scope, 403, {"error": refused}, refused)
        return None

    async def one(
        self, scope: Mapping[str, Any], identity: Identity, form: Mapping[str, str], path: str
    ) -> Reply | None:
        """``POST /dispatches/{id}/retry|cancel|purge``; None if ``path`` is not one."""
        match = _ONE.fullmatch(path)
        if match is None:
            return None
        refused = self._refusal(scope, identity, form)
        if refused is not None:
            return refused
        dispatch_id, action = match[1], match[2]
        where = {"client": client(scope), "via": identity.via}
        back = pages.DISPATCH_PATH + quote(dispatch_id, safe="")
        if action == "cancel":
            return await self._cancel(scope, identity, form, dispatch_id, where)
        try:
            if action == "retry":
                applied = await retry_dispatch(self.db, dispatch_id, actor=ACTOR, metadata=where)
            else:
                applied = await purge_dispatch(self.db, dispatch_id, actor=ACTOR, metadata=where)
        except InvalidTransition as exc:
            log.info(
                "web: %s of %s from %s refused: %s",
                action,
                visible(dispatch_id),
                where["client"],
                exc,
            )
            return self._answer(
                scope, 409, {"id": dispatch_id, "applied": False, "error": str(exc)}, str(exc), back
            )
        except ValueError as exc:  # not an id
            return self._answer(scope, 400, {"error": str(exc)}, str(exc))
        log.info(
            "web: %s of dispatch %s by %s (%s) from %s: %s",
            action,
            visible(dispatch_id),
            identity.role,
            identity.via,
            where["client"],
            "applied" if applied else "not applied",
        )
        if not applied:
            row = await get_dispatch(self.db, dispatch_id) if action == "retry" else None
            if row is None:
                message = f"no dispatch {dispatch_id}"
                return self._answer(
                    scope, 404, {"id": dispatch_id, "applied": False, "error": message}, message
                )
            message = f"dispatch {dispatch_id} changed meanwhile; it is {row['status']} now"
            return self._answer(
                scope, 409, {"id": dispatch_id, "applied": False, "error": message}, message, back
            )
        row = await get_dispatch(self.db, dispatch_id)
        status = None if row is None else row["status"]
        verb = "retried: pending again" if action == "retry" else _DONE[action]
        return self._done(
            scope,
            identity,
            {"id": dispatch_id, "action": action, "applied": True, "status": status},
            f"dispatch {dispatch_id} {verb}",
            back if action == "retry" else "/",
        )

    async def _cancel(
        self,
        scope: Mapping[str, Any],
        identity: Identity,
        form: Mapping[str, str],
        dispatch_id: str,
        where: dict[str, str],
    ) -> Reply:
        """``POST /dispatches/{id}/cancel`` (docs/controls.md): 200 cancelled; 202 a
        running attempt's cancel asked for, its worker yet to answer; 409
        too late or a status with no cancel; 404 unknown; 400 a bad
        ``reason``."""
        back = pages.DISPATCH_PATH + quote(dispatch_id, safe="")
        try:
            reason = require_reason(form.get("reason") or None)
            result = await cancel_dispatch(
                self.db,
                dispatch_id,
                reason,
                wait_seconds=self.cancel_wait_seconds,
                actor=ACTOR,
                metadata=where,
            )
        except LookupError:
            message = f"no dispatch {dispatch_id}"
            document = {"id": dispatch_id, "applied": False, "error": message}
            return self._answer(scope, 404, document, message)
        except InvalidTransition as exc:  # too late, or a status with no cancel
            log.info(
                "web: cancel of %s from %s refused: %s", visible(dispatch_id), where["client"], exc
            )
            document = {"id": dispatch_id, "applied": False, "error": str(exc)}
            return self._answer(scope, 409, document, str(exc), back)
        except ValueError as exc:  # not an id, a bad reason
            return self._answer(scope, 400, {"error": str(exc)}, str(exc))
        log.info(
            "web: cancel of dispatch %s by %s (%s) from %s: %s",
            visible(dispatch_id),
            identity.role,
            identity.via,
            where["client"],
            result.status,
        )
        document = {**result.to_dict(), "action": "cancel", "applied": True}
        if result.cancelled:
            return self._done(scope, identity, document, f"dispatch {dispatch_id} cancelled", back)
        message = (
            f"cancel of dispatch {dispatch_id} asked for: its attempt {result.attempt} is still "
            "running; its worker records the cancel when it stops it"
        )
        return self._done(scope, identity, document, message, back, status=202)

    async def confirm(
        self, scope: Mapping[str, Any], identity: Identity, path: str, query: Mapping[str, str]
    ) -> Reply | None:
        """``GET /actions/retry|cancel|purge?status=...``: how many rows the
        action would change, and the form that applies it; None if not that path.
        A retry's page also has the form that chooses its filters (replay),
        and without any filter shows only that."""
        match = _BULK.fullmatch(path)
        if match is None:
            return None
        if identity.role < Role.OPERATOR:
            return self._not_operator(scope)
        retry = match[1] == "retry"
        if retry and not wants_json(scope) and not any(query.get(n) for n in FILTER_FIELDS):
            body = (
                "<h1>Retry failed rows</h1><p>Choose at least one filter, then count "
                f"the rows it matches (at most {BULK_LIMIT:,} a request).</p>"
                f"{pages.replay_form({})}"
            )
            return self._page("Retry rows", body)
        refused = self._no_filter(scope, query, match[1])
        chosen_or_refusal = self._filter(scope, match[1], query) if refused is None else refused
        if isinstance(chosen_or_refusal, Reply):
            return chosen_or_refusal
        action, chosen = chosen_or_refusal
        count = await count_matching(self.db, chosen, BULK_LIMIT)
        fields = chosen.fields()
        if wants_json(scope):
            return Reply(
                200,
                json.dumps(
                    {"action": action, "matching": count, "limit": BULK_LIMIT, **fields}
                ).encode()
                + b"\n",
                JSON,
            )
        listed = {k: fields[k] for k in ("status", "kind", "ordering_key") if fields[k]}
        cap = f" (the first {BULK_LIMIT:,} of more)" if count >= BULK_LIMIT else ""
        button = action_form(path, f"{action.capitalize()} {count:,} rows", identity, fields)
        if not button:
            button = (
                "<p>Log in with the operator token (<a href=/login>/login</a>) "
                "to act from a browser.</p>"
            )
        body = (
            f"<h1>{pages.text(action.capitalize())} {count:,} rows?</h1>"
            f"<p>Rows with {pages.text(chosen.describe())}: {count:,}{cap}.</p>"
            f"{button if count else '<p>Nothing matches.</p>'}"
            f'<p><a href="/?{pages.text(urlencode(listed))}">back, change nothing</a></p>'
            + (f"<h2>Change the filters</h2>{pages.replay_form(fields)}" if retry else "")
        )
        return self._page(f"{action.capitalize()} rows", body)

    async def bulk(
        self, scope: Mapping[str, Any], identity: Identity, form: Mapping[str, str], path: str
    ) -> Reply | None:
        """``POST /actions/retry|cancel|purge``; None if ``path`` is not one."""
        match = _BULK.fullmatch(path)
        if match is None:
            return None
        refused = self._refusal(scope, identity, form)
        if refused is None:
            refused = self._no_filter(scope, form, match[1])
        if refused is not None:
            return refused
        chosen_or_refusal = self._filter(scope, match[1], form)
        if isinstance(chosen_or_refusal, Reply):
            return chosen_or_refusal
        action, chosen = chosen_or_refusal
        where = {"client": client(scope), "via": identity.via, "bulk": True}
        result = await apply_bulk(self.db, action, chosen, actor=ACTOR, metadata=where)
        log.info(
            "web: bulk %s of %s rows (%s) by %s (%s) from %s: %d applied, %d skipped",
            action,
            result.matched,
            visible(chosen.describe()),
            identity.role,
            identity.via,
            where["client"],
            result.applied,
            result.skipped,
        )
        verb = _DONE[action]
        if result.requested:
            verb += f" ({result.requested:,} of them running: their workers stop them)"
        more = (
            f"; at most {BULK_LIMIT:,} a request: confirm again for the rest"
            if result.matched >= BULK_LIMIT
            else ""
        )
        return self._done(
            scope,
            identity,
            result.to_dict(),
            f"{result.applied:,} of {result.matched:,} rows {verb}"
            + (f"; {result.skipped:,} had changed meanwhile" if result.skipped else "")
            + more,
        )
