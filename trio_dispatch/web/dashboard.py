"""The dashboard's pages read from the store (docs/dashboard.md): the index
with its list and filters, the blocked keys, the schedules and a row's
page, each with an operator's buttons (:mod:`.actions`). :mod:`.app`
routes the requests here.

``/?refresh=N`` reloads the index page every ``N`` seconds
(:data:`REFRESH_MIN`..:data:`REFRESH_MAX`, a meta refresh: the page still
runs no script); any other value is a 400 naming it (:class:`BadQuery`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from functools import partial
from typing import TYPE_CHECKING, Final
from urllib.parse import urlencode

from ..outbox.coalesce import require_coalesce
from ..outbox.ordering import OrderingPolicy, require_ordering_key
from ..outbox.reads import (
    DEFAULT_LIST_LIMIT,
    bounded_stats,
    get_dispatch,
    list_blocked_heads,
    list_page,
    list_transitions,
    recent_failures,
    status_label,
    status_labels,
    waiting_behind,
    waiting_ids,
)
from ..schedules.runs import listing, states
from ..store.base import Database
from ..values import show
from . import pages
from .actions import ACTION_LABELS, Actions, action_form, offered
from .auth import Identity, Role
from .destinations import DestinationsView
from .markup import link

if TYPE_CHECKING:
    from ..schedules import Schedule
    from ..worker import DispatchWorker

PAGE_SIZE: Final = DEFAULT_LIST_LIMIT
BLOCKED_PAGE: Final = 100
"""The blocked keys' page lists at most this many heads, oldest first."""
REFRESH_MIN: Final = 2
REFRESH_MAX: Final = 3600
"""Bounds of ``?refresh=N``, in seconds."""


class BadQuery(ValueError):
    """A query parameter the page cannot use: a 400, its one line."""


def refresh_seconds(value: str | None) -> int | None:
    """``?refresh=N`` as whole seconds, None when absent; a value that is
    not a whole number in bounds raises :class:`BadQuery` naming it."""
    if value is None:
        return None
    seconds = int(value) if value.isascii() and value.isdigit() and len(value) <= 6 else None
    if seconds is None or not REFRESH_MIN <= seconds <= REFRESH_MAX:
        raise BadQuery(
            f"refresh must be a whole number of seconds from {REFRESH_MIN} to {REFRESH_MAX}, "
            f"got {show(value)}"
        )
    return seconds


@dataclasses.dataclass(eq=False)
class Dashboard:
    """The pages of :class:`~.app.WebApp` over ``db``: the rows of ``db``,
    a running ``worker``'s state (given one), the ``schedules`` shown,
    which keys count as blocked (``ordering``), the ``destinations``' card,
    and, with ``actions`` (an operator token configured), the buttons
    that post to them."""

    db: Database
    _: dataclasses.KW_ONLY
    worker: DispatchWorker | None
    schedules: Sequence[Schedule]
    ordering: OrderingPolicy
    store_label: str
    clock: Callable[[], float]
    actions: Actions | None
    destinations: DestinationsView

    async def index(self, query: Mapping[str, str], identity: Identity) -> str:
        """The index page (``/``) of this query: counts, recent failures
        and one page of the list; a query value it cannot use raises
        :class:`BadQuery`."""
        now = self.clock()
        refresh = refresh_seconds(query.get("refresh"))
        status = pages.known_status(query.get("status"))
        kind = query.get("kind") or None
        try:
            ordering_key = require_ordering_key(query.get("ordering_key") or None)
            rule = require_coalesce(query.get("coalesce_key") or None)
            coalesce_key = None if rule is None else rule.key
        except ValueError as exc:
            raise BadQuery(str(exc)) from None
        before: tuple[float, str] | None = None
        if "before" in query:
            created, _, last_id = query["before"].partition(",")
            try:
                before = (float(created), last_id)
            except ValueError:
                before = None
        stats = await bounded_stats(self.db, now=now, ordering=self.ordering)
        rows = await list_page(
            self.db,
            status=status,
            kind=kind,
            ordering_key=ordering_key,
            coalesce_key=coalesce_key,
            before=before,
            limit=PAGE_SIZE + 1,
        )
        filters = {
            "status": status,
            "kind": kind,
            "ordering_key": ordering_key,
            "coalesce_key": coalesce_key,
        }
        next_page = None
        if len(rows) > PAGE_SIZE:
            rows = rows[:PAGE_SIZE]
            last = rows[-1]
            next_page = link(
                {
                    **filters,
                    "before": f"{float(last['created_at'])!r},{last['id']}",
                    "refresh": str(refresh) if refresh else None,
                }
            )
        worker = None
        if self.worker is not None:
            statistics = self.worker.statistics()
            worker = {
                "in_flight": statistics.in_flight,
                "held_ahead": statistics.held_ahead,
                "concurrency": statistics.concurrency,
                "delivered": statistics.delivered,
                "last_scan_age_seconds": None
                if statistics.last_scan_at is None
                else max(0.0, now - statistics.last_scan_at),
            }
        schedules = None
        if self.schedules:
            names = [schedule.name for schedule in self.schedules]
            known = await self.db.read(partial(states, names=names))
            schedules = {
                "count": len(names),
                "paused": sum(1 for state in known.values() if state.paused),
            }
        here = {
            key: value
            for key, value in {
                **filters,
                "before": query.get("before") if before is not None else None,
            }.items()
            if value
        }
        body = pages.overview(
            stats,
            rows,
            status=status,
            kind=kind,
            ordering_key=ordering_key,
            coalesce_key=coalesce_key,
            next_page=next_page,
            worker=worker,
            now=now,
            labels=await status_labels(self.db, rows),
            failures=await recent_failures(self.db),
            refresh=refresh,
            here=here,
            schedules=schedules,
            destinations=await self.destinations.summary(),
            waiting=await waiting_ids(self.db, rows, self.ordering),
        )
        body = await self._toolbar(identity, status, kind, ordering_key, coalesce_key) + body
        return pages.page("Outbox", body, self.store_label, refresh=refresh)

    async def _toolbar(
        self,
        identity: Identity,
        status: str | None,
        kind: str | None,
        ordering_key: str | None,
        coalesce_key: str | None = None,
    ) -> str:
        """For an operator: the bulk actions of the listed filter, the
        replay's form, a blocked key's head with its retry and purge, and the
        session's logout. A list filtered by coalesce key offers no bulk
        action: they take no such filter, and would act beyond the list."""
        if self.actions is None:
            return ""
        parts = [action_form("/logout", "Log out", identity)]
        if identity.role < Role.OPERATOR:
            return f"<section class=operator>{parts[0]}</section>" if parts[0] else ""
        if ordering_key is not None:
            heads = await list_blocked_heads(
                self.db, ordering=self.ordering, limit=1, ordering_key=ordering_key
            )
            for head in heads:
                head_id = str(head["id"])
                parts.append(
                    "<p class=blocked>Key blocked by its head "
                    f'<a href="{pages.dispatch_link(head_id)}">'
                    f"{pages.text(head_id)}</a> ({pages.text(head['status'])}).</p>"
                    + self._row_actions(head_id, str(head["status"]), identity)
                )
        links = []
        if status is not None and coalesce_key is None:
            fields = {"status": status, "kind": kind, "ordering_key": ordering_key}
            query = urlencode({k: v for k, v in fields.items() if v})
            links = [
                f'<a href="/actions/{action}?{pages.text(query)}">{label} all {pages.text(status)}'
                f"{' of this filter' if kind or ordering_key else ''}...</a>"
                for action, label in ACTION_LABELS
                if offered(action, status)
            ]
        links.append(
            '<a id=replay-link href="/actions/retry">'
            "Retry failed rows by destination and time...</a>"
        )
        parts.append(f"<p class=actions>{' · '.join(links)}</p>")
        joined = "".join(parts)
        return f"<section class=operator>{joined}</section>" if joined else ""

    async def blocked(self) -> str:
        """The heads of blocked keys (``/blocked``), oldest first."""
        rows = await list_blocked_heads(self.db, ordering=self.ordering, limit=BLOCKED_PAGE)
        body = pages.blocked(rows, self.ordering, BLOCKED_PAGE, self.clock())
        return pages.page("Blocked keys", body, self.store_label)

    async def schedule_list(self) -> str:
        """The schedules and their state in the store (``/schedules``)."""
        now = self.clock()
        found = await self.db.read(partial(listing, schedules=self.schedules, now=now))
        body = pages.schedules(found, now)
        return pages.page("Schedules", body, self.store_label)

    async def dispatch(self, dispatch_id: str, identity: Identity) -> tuple[int, str]:
        """A row's page, with the buttons ``identity`` may use; 404 when
        neither the row nor any history of it is there."""
        now = self.clock()
        try:
            row = await get_dispatch(self.db, dispatch_id)
            history = await list_transitions(self.db, dispatch_id)
        except ValueError:  # not an id at all
            row, history = None, []
        status = 200 if row is not None or history else 404
        # The newest transition says whether the row waits for an ack.
        label = behind = None
        buttons = ""
        waiting = False
        if row is not None:
            label = status_label(row, str(history[-1]["reason_code"]) if history else None)
            behind = await waiting_behind(self.db, row, self.ordering)
            waiting = row["id"] in await waiting_ids(self.db, [row], self.ordering)
            buttons = self._row_actions(str(row["id"]), str(row["status"]), identity)
        body = pages.detail(row, dispatch_id, history, now, label, behind, buttons, waiting)
        return status, pages.page(f"Dispatch {dispatch_id}", body, self.store_label)

    def _row_actions(self, dispatch_id: str, status: str, identity: Identity) -> str:
        """Retry (a dead letter or expired row), cancel (a pending or
        delivering one) and purge buttons for an operator's browser
        session; a note for others who could act."""
        if self.actions is None or identity.role < Role.OPERATOR:
            return ""
        forms = "".join(
            action_form(f"/dispatches/{dispatch_id}/{action}", label, identity)
            for action, label in ACTION_LABELS
            if offered(action, status)
        )
        if not forms:
            return "<p class=note>Log in (<a href=/login>/login</a>) to act from here.</p>"
        return f"<div class=actions>{forms}</div>"
