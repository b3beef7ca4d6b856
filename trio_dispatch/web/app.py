"""The ASGI application behind ``/metrics``, ``/healthz`` and the dashboard
(docs/dashboard.md). It reads the store with bounded queries and
answers GET and HEAD; with an operator token it also takes the POSTs of
:mod:`.actions` (retry, cancel and purge, one row or by filter).

Roles come from :mod:`.auth`: with a viewer token every request must prove
a role -- ``Authorization: Bearer <token>``, HTTP Basic with the token as
the password, or the session cookie of ``/login`` -- compared in constant
time; a viewer's or anonymous POST is a 403 and changes nothing.

A row's page is ``/dispatches/ID``, beside its actions; a GET of its
former address ``/dispatch/ID`` is a 301 to it (a POST there acts on
nothing: 404).

``/?ordering_key=K`` lists one ordering key's rows (a key enqueue would
refuse is a 400 naming it); ``/blocked`` lists the heads of blocked keys
under the policy of the worker, or the one given.

``/destinations`` lists the destinations and their state, each one's page
holds its audit and, for an operator, pause, resume and enable
(:mod:`.destinations`).

``/schedules`` lists the schedules (those of the worker, or the ones given:
the configuration's, for ``trio-dispatch web``) with their state in the
store; the index page counts them and the paused ones.

Every request, ``/metrics`` and ``/healthz`` included, must name in its
``Host`` header a host this server answers to (:class:`~.binding.AllowedHosts`:
``allowed_hosts``, else the listener's own names); any other is a 400 with
one line, before any credential is looked at, so a page whose name an
attacker points at this machine (DNS rebinding) reads nothing.

``/?refresh=N`` reloads the index page every ``N`` seconds
(:data:`~.dashboard.REFRESH_MIN`..:data:`~.dashboard.REFRESH_MAX`, a meta
refresh: the page still runs no script); any other value is a 400 naming
it. The pages read from the store are built in :mod:`.dashboard`.
"""

from __future__ import annotations

import json
import time
from collections.abc import Awaitable, Callable, Mapping, MutableMapping, Sequence
from typing import TYPE_CHECKING, Any, Final
from urllib.parse import parse_qs, quote

from anyio.abc import TaskGroup

from ..outbox.ordering import DEFAULT_ORDERING_POLICY, OrderingPolicy, require_policy
from ..outbox.reads import WAITING, bounded_stats, frequent_kinds
from ..redact import mask_url, scrubbed_logger, visible
from ..store.base import Database
from ..values import show
from . import pages
from .actions import Actions, FormTooLarge, Reply, client, read_form
from .auth import Auth, Identity, header
from .binding import LOOPBACK_NAMES, AllowedHosts, Listen, parse_allowed_hosts
from .dashboard import BadQuery, Dashboard
from .destinations import DestinationsView
from .health import STORE_CHECK_SECONDS as STORE_CHECK_SECONDS
from .health import StoreProbes, health_document
from .metrics import CONTENT_TYPE, families, render

if TYPE_CHECKING:
    from ..destinations import Destination
    from ..schedules import Schedule
    from ..worker import DispatchWorker

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

HOST_LOG_INTERVAL_SECONDS: Final = 60.0
"""At most one warning this often while requests for other hosts are refused."""
SECURITY_HEADERS: Final = (
    (
        b"content-security-policy",
        # No script at all; the one style block by its hash; forms post
        # only here; no framing, no <base>.
        (
            f"default-src 'none'; style-src '{pages.STYLE_HASH}'; form-action 'self'; "
            "frame-ancestors 'none'; base-uri 'none'"
        ).encode(),
    ),
    (b"x-content-type-options", b"nosniff"),
    (b"x-frame-options", b"DENY"),
    # same-origin, not no-referrer: under no-referrer a browser sends
    # "Origin: null" with its form POSTs, and the forgery check needs the
    # real one; nothing goes to another site either way.
    (b"referrer-policy", b"same-origin"),
    (b"cache-control", b"no-store"),
)

log = scrubbed_logger("trio_dispatch.web")


FORMER_DISPATCH_PATH: Final = "/dispatch/"
"""Where rows' pages were before they moved to :data:`~.markup.DISPATCH_PATH`."""


def moved_to(scope: Scope) -> bytes | None:
    """Where a row's former address (``/dispatch/ID``, query kept) is now,
    for a GET's redirect; None for every other path."""
    path: str = scope["path"]
    if not path.startswith(FORMER_DISPATCH_PATH):
        return None
    rest = quote(path.removeprefix(FORMER_DISPATCH_PATH), safe="")
    query = scope.get("query_string", b"")
    return (pages.DISPATCH_PATH + rest).encode("ascii") + (b"?" + query if query else b"")


class WebApp:
    """Serve ``db`` (and, given one, a running ``worker``'s state).
    ``token`` is the viewer's token, ``operator_token`` the operator's:
    without it nothing can act. ``allowed_hosts`` (``NAME``, ``NAME:PORT``,
    ``[IPv6]:PORT``; a bad one is a ValueError naming it) are the ``Host``
    values it answers to; by default the names of the listener
    :func:`~.server.serve_app` reports (:meth:`listening_on`), else those of
    the address each connection reached."""

    def __init__(
        self,
        db: Database,
        *,
        worker: DispatchWorker | None = None,
        token: str | None = None,
        store_label: str | None = None,
        clock: Callable[[], float] = time.time,
        ordering: OrderingPolicy | None = None,
        operator_token: str | None = None,
        schedules: Sequence[Schedule] | None = None,
        allowed_hosts: Sequence[str] | None = None,
        destinations: Mapping[str, Destination] | None = None,
    ) -> None:
        self.db = db
        entries = parse_allowed_hosts("allowed_hosts", allowed_hosts)
        self.allowed_hosts: AllowedHosts | None = (
            None if entries is None else AllowedHosts.configured(entries)
        )
        """The configured ``Host`` values; None: the listeners' names."""
        self._listeners: list[AllowedHosts] = []
        self._hosts_refused = 0
        self._hosts_warned_at: float | None = None
        self.worker = worker
        # The schedules shown: the ones given, else the worker's.
        if schedules is None and worker is not None and worker.scheduler is not None:
            schedules = list(worker.scheduler.schedules.values())
        self.schedules: tuple[Schedule, ...] = tuple(schedules or ())
        # Which keys count as blocked: the worker's policy, else the one given
        # (the configuration's, for ``trio-dispatch web``), else the default.
        if ordering is None:
            ordering = worker.settings.ordering_on_dead_letter if worker is not None else None
        self.ordering: OrderingPolicy = require_policy(
            "ordering", ordering or DEFAULT_ORDERING_POLICY
        )
        self.store_label = mask_url(store_label or str(getattr(db, "url", "store")))
        self.clock = clock
        self.auth = Auth(token, operator_token, clock)
        self.actions = Actions(db, self.auth, self.store_label) if operator_token else None
        """The POST routes; None without an operator token (read-only)."""
        if destinations is None and worker is not None:  # the worker's, else the ones given
            destinations = worker.destinations
        self.destinations = DestinationsView(
            db,
            destinations or {},
            self.store_label,
            acting=self.actions is not None,
            waiting=WAITING[self.ordering],
        )
        self.dashboard = Dashboard(
            db,
            worker=worker,
            schedules=self.schedules,
            ordering=self.ordering,
            store_label=self.store_label,
            clock=clock,
            actions=self.actions,
            destinations=self.destinations,
        )
        self.started_at = clock()
        self._probes = StoreProbes(db, clock)

    def attach(self, task_group: TaskGroup) -> None:
        """Run store probes in ``task_group`` (:func:`~.server.serve_app`
        does this): a probe stuck on a lock then outlives the request that
        started it, and the request still answers after
        :data:`~.health.STORE_CHECK_SECONDS`."""
        self._probes.attach(task_group)

    def listening_on(self, listen: Listen) -> None:
        """A listener's address, its bound port included
        (:func:`~.server.serve_app` reports it): without ``allowed_hosts``,
        the app answers to the names of every listener it was told of."""
        self._listeners.append(AllowedHosts.of_listener(listen))

    def _host_refusal(self, scope: Scope) -> bytes | None:
        """The 400's line when the request's ``Host`` is not one this server
        answers to, else None."""
        if self.allowed_hosts is not None:
            allowed = [self.allowed_hosts]
        elif self._listeners:
            allowed = self._listeners
        else:  # served by another server: the address this connection reached
            server = scope.get("server")
            allowed = [
                AllowedHosts.of_listener(Listen(str(server[0]), int(server[1])))
                if server
                else AllowedHosts.configured(LOOPBACK_NAMES)
            ]
        host = header(scope, b"host")
        text = None if host is None else host.decode("latin-1")
        scheme = str(scope.get("scheme", "http"))
        if any(hosts.allows(text, scheme) for hosts in allowed):
            return None
        self._hosts_refused += 1
        now = time.monotonic()
        if (
            self._hosts_warned_at is None
            or now - self._hosts_warned_at >= HOST_LOG_INTERVAL_SECONDS
        ):
            self._hosts_warned_at = now
            log.warning(
                "http: refused a request for host %s from %s (answers to %s; "
                "http.allowed_hosts), %d so far",
                "none" if text is None else show(text),
                client(scope),
                "; ".join(map(str, allowed)),
                self._hosts_refused,
            )
        if text is None:
            return b"the request has no Host header: this dashboard answers only to its own names\n"
        return (
            f"Host {show(text)} is not a name this dashboard answers to: "
            "add it to http.allowed_hosts if it should be\n"
        ).encode()

    async def prepare(self) -> None:
        """Before serving: give the worker's kind labels to the most frequent
        kinds of the store's recent rows (a bounded read)."""
        if self.worker is not None:
            self.worker.metrics.prefer(await frequent_kinds(self.db))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        refused = self._host_refusal(scope)
        if refused is not None:
            await self._respond(
                send, 400, refused, b"text/plain; charset=utf-8", extra=((b"connection", b"close"),)
            )
            return
        method = scope["method"]
        identity = self.auth.identify(scope)
        if identity is None and not (self.actions is not None and scope["path"] == "/login"):
            await self._respond(
                send,
                401,
                b"a bearer token is required\n",
                b"text/plain; charset=utf-8",
                extra=(
                    (b"www-authenticate", b'Basic realm="trio-dispatch", charset="UTF-8"'),
                    (b"www-authenticate", b'Bearer realm="trio-dispatch"'),
                    # No keep-alive for a caller without the token: its
                    # connection is not held open for another try.
                    (b"connection", b"close"),
                ),
            )
            return
        if method == "POST" and self.actions is not None:
            await self._post(scope, receive, send, identity)
            return
        moved = moved_to(scope) if method in ("GET", "HEAD") else None
        if moved is not None:
            await self._respond(
                send, 301, b"", b"text/plain; charset=utf-8", extra=((b"location", moved),)
            )
            return
        if method not in ("GET", "HEAD"):
            allowed = b"GET, HEAD, POST" if self.actions is not None else b"GET, HEAD"
            await self._respond(
                send,
                405,
                b"GET, HEAD or POST only\n" if self.actions else b"read-only: GET and HEAD only\n",
                b"text/plain; charset=utf-8",
                extra=((b"allow", allowed),),
            )
            return
        try:
            if identity is None:  # only the login page answers without a role
                reply = self.actions.login_page() if self.actions else None
                assert reply is not None
                status, body, content_type = reply.status, reply.body, reply.content_type
            else:
                status, body, content_type = await self._route(scope, identity)
                session = identity.session
                if method == "GET" and session is not None and session.notice is not None:
                    if content_type.startswith(b"text/html"):  # shown once, then gone
                        body, session.notice = pages.with_notice(body, session.notice), None
        except Exception:
            log.exception("dashboard request failed: %s", visible(scope.get("path", "")))
            status, body, content_type = 500, b"internal error\n", b"text/plain; charset=utf-8"
        # HEAD: the same headers as GET (its Content-Length too); the server
        # leaves the body out.
        await self._respond(send, status, body, content_type)

    async def _post(
        self, scope: Scope, receive: Receive, send: Send, identity: Identity | None
    ) -> None:
        """A POST: log in (no role needed), else an action of :mod:`.actions`."""
        assert self.actions is not None
        path: str = scope["path"]
        try:
            form = await read_form(scope, receive)
        except FormTooLarge as exc:
            await self._respond(send, 413, f"{exc}\n".encode(), b"text/plain; charset=utf-8")
            return
        try:
            if path == "/login":
                reply = await self.actions.login(scope, form)
            elif identity is None:
                reply = Reply(401, b"a bearer token is required\n", b"text/plain; charset=utf-8")
            elif path == "/logout":
                reply = self.actions.logout(scope, identity, form)
            else:
                found = await self.actions.one(scope, identity, form, path)
                if found is None:
                    found = await self.actions.bulk(scope, identity, form, path)
                if found is None:
                    found = await self.destinations.act(scope, identity, form, path)
                reply = found or Reply(404, b"no such action\n", b"text/plain; charset=utf-8")
        except Exception:
            log.exception("dashboard action failed: %s", visible(path))
            reply = Reply(500, b"internal error\n", b"text/plain; charset=utf-8")
        await self._respond(send, reply.status, reply.body, reply.content_type, extra=reply.headers)

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def _respond(
        self,
        send: Send,
        status: int,
        body: bytes,
        content_type: bytes,
        extra: tuple[tuple[bytes, bytes], ...] = (),
    ) -> None:
        headers = [
            (b"content-type", content_type),
            (b"content-length", str(len(body)).encode()),
            *SECURITY_HEADERS,
            *extra,
        ]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    async def _route(self, scope: Scope, identity: Identity) -> tuple[int, bytes, bytes]:
        path: str = scope["path"]
        query = {
            key: values[-1]
            for key, values in parse_qs(scope.get("query_string", b"").decode("latin-1")).items()
        }
        html = b"text/html; charset=utf-8"
        if path == "/metrics":
            stats = await bounded_stats(self.db, ordering=self.ordering)
            metrics = families(stats, self.worker, self.clock())
            metrics += await self.destinations.metric_families()
            return 200, render(metrics), CONTENT_TYPE.encode()
        if path == "/healthz":
            status, document = await self.health()
            return status, json.dumps(document).encode() + b"\n", b"application/json"
        if path == "/":
            try:
                content = await self.dashboard.index(query, identity)
            except BadQuery as exc:
                return 400, f"{exc}\n".encode(), b"text/plain; charset=utf-8"
            return 200, content.encode(), html
        if self.actions is not None:
            if path == "/login":
                reply = self.actions.login_page()
                return reply.status, reply.body, reply.content_type
            confirm = await self.actions.confirm(scope, identity, path, query)
            if confirm is not None:
                return confirm.status, confirm.body, confirm.content_type
        shown = await self.destinations.page(path, query, identity, scope)
        if shown is not None:
            return shown.status, shown.body, shown.content_type
        if path == "/blocked":
            return 200, (await self.dashboard.blocked()).encode(), html
        if path == "/schedules":
            return 200, (await self.dashboard.schedule_list()).encode(), html
        dispatch_id = path.removeprefix(pages.DISPATCH_PATH)
        if dispatch_id != path and dispatch_id and "/" not in dispatch_id:
            status, content = await self.dashboard.dispatch(dispatch_id, identity)
            return status, content.encode(), html
        return 404, pages.page("Not found", pages.not_found(path), self.store_label).encode(), html

    async def health(self) -> tuple[int, dict[str, Any]]:
        """200 and ``{"status": "ok", ...}``, or 503 and the reason: the
        claim loop has not completed a scan within two ticks, or the store
        does not answer within :data:`STORE_CHECK_SECONDS`."""
        failure = await self._probes.check()
        return health_document(failure, self.worker, self.started_at, self.clock())
