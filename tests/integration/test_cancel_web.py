"""The dashboard's cancel (docs/dashboard.md, docs/controls.md) over real sockets and
real stores, both engines and both backends: only an operator cancels, a
browser session only with its CSRF token and its own origin; 200, 202,
404 and 409 with their reasons; the bulk cancel after its confirmation;
the buttons each row's status offers."""

from __future__ import annotations

import json
from typing import Any

import pytest

from trio_dispatch.store import SQLiteStore
from trio_dispatch.web import WebApp

from ..conftest import RawDB
from .test_web import populate, serving
from .test_web_actions import BEARER, OPERATOR, VIEWER, login, state

pytestmark = pytest.mark.anyio
JSON = {"accept": "application/json"}


def meta(transition: dict[str, Any]) -> dict[str, Any]:
    found = transition["metadata"]
    return found if isinstance(found, dict) else dict(json.loads(found))


async def test_only_an_operator_cancels_and_the_transition_names_the_dashboard(
    store: SQLiteStore, raw: RawDB
) -> None:
    ids = await populate(store, raw)
    path = f"/dispatches/{ids['pending']}/cancel"
    async with serving(WebApp(store, token=VIEWER, operator_token=OPERATOR)) as client:
        before = state(raw)
        for role, code in (("none", 401), ("viewer", 403)):
            answer = await client.post(path, headers=BEARER[role])
            assert answer.status_code == code
            assert state(raw) == before
        answer = await client.post(
            path, data={"reason": "duplicate"}, headers={**BEARER["operator"], **JSON}
        )
        assert answer.status_code == 200, answer.text
        assert answer.json() == {
            "id": ids["pending"],
            "status": "cancelled",
            "previous": "pending",
            "attempt": 0,
            "cancelled": True,
            "requested": False,
            "action": "cancel",
            "applied": True,
        }
    assert raw.row(ids["pending"])["status"] == "cancelled"
    last = raw.transitions(ids["pending"])[-1]
    assert (last["source"], last["actor"], last["reason_code"]) == (
        "operator",
        "web",
        "dispatch.cancelled.operator",
    )
    assert meta(last)["client"] == "127.0.0.1" and meta(last)["reason"] == "duplicate"


async def test_a_browser_session_cancels_only_with_its_csrf_token_and_origin(
    store: SQLiteStore, raw: RawDB
) -> None:
    ids = await populate(store, raw)
    async with serving(WebApp(store, token=VIEWER, operator_token=OPERATOR)) as client:
        csrf = await login(client)
        origin = str(client.base_url).rstrip("/")
        page = await client.get(f"/dispatches/{ids['pending']}")
        assert f'action="/dispatches/{ids["pending"]}/cancel"' in page.text
        finished = await client.get(f"/dispatches/{ids['delivered']}")
        assert "/cancel" not in finished.text  # a delivered row offers no cancel
        path = f"/dispatches/{ids['pending']}/cancel"
        before = state(raw)
        for form, headers in [
            ({}, {"origin": origin}),
            ({"csrf": csrf}, {"origin": "http://evil.example"}),
        ]:
            assert (await client.post(path, data=form, headers=headers)).status_code == 403
            assert state(raw) == before
        answer = await client.post(path, data={"csrf": csrf}, headers={"origin": origin})
        assert answer.status_code == 303  # to the row's page, which says it once
        assert answer.headers["location"] == f"/dispatches/{ids['pending']}"
        shown = await client.get(answer.headers["location"])
        assert "cancelled" in shown.text
    assert raw.row(ids["pending"])["status"] == "cancelled"
    assert meta(raw.transitions(ids["pending"])[-1])["via"] == "cookie"


async def test_refusals_say_why_and_a_running_attempt_is_asked_to_stop(
    store: SQLiteStore, raw: RawDB
) -> None:
    ids = await populate(store, raw)
    app = WebApp(store, token=VIEWER, operator_token=OPERATOR)
    assert app.actions is not None
    app.actions.cancel_wait_seconds = 0  # no worker runs the claimed row: answer at once
    headers = {**BEARER["operator"], **JSON}
    async with serving(app) as client:
        before = state(raw)
        done = await client.post(f"/dispatches/{ids['delivered']}/cancel", headers=headers)
        assert done.status_code == 409 and "'delivered'" in done.json()["error"]
        unknown = await client.post(f"/dispatches/{'e' * 32}/cancel", headers=headers)
        assert unknown.status_code == 404
        bad = await client.post(
            f"/dispatches/{ids['pending']}/cancel", data={"reason": "x" * 501}, headers=headers
        )
        assert bad.status_code == 400 and "reason" in bad.json()["error"]
        assert state(raw) == before
        running = await client.post(f"/dispatches/{ids['delivering']}/cancel", headers=headers)
        assert running.status_code == 202, running.text
        assert (running.json()["requested"], running.json()["status"]) == (True, "delivering")
    row = raw.row(ids["delivering"])
    assert (row["status"], row["cancel_requested_at"] is not None) == ("delivering", True)


async def test_a_bulk_cancel_is_confirmed_with_its_count_then_applied(
    store: SQLiteStore, raw: RawDB
) -> None:
    ids = await populate(store, raw)
    headers = BEARER["operator"]
    async with serving(WebApp(store, token=VIEWER, operator_token=OPERATOR)) as client:
        listing = await client.get("/?status=pending", headers=headers)
        assert 'href="/actions/cancel?status=pending"' in listing.text
        page = await client.get("/actions/cancel?status=pending", headers=headers)
        assert page.status_code == 200 and "Cancel 1 rows?" in page.text
        before = state(raw)
        nothing = await client.post("/actions/cancel", headers={**headers, **JSON})
        assert nothing.status_code == 400 and "at least one filter" in nothing.json()["error"]
        refused = await client.post(
            "/actions/cancel", data={"status": "dead_letter"}, headers={**headers, **JSON}
        )
        assert refused.status_code == 409
        assert state(raw) == before
        answer = await client.post(
            "/actions/cancel", data={"status": "pending"}, headers={**headers, **JSON}
        )
        assert answer.json() == {
            "action": "cancel",
            "matched": 1,
            "applied": 1,
            "requested": 0,
            "skipped": 0,
        }
    assert raw.row(ids["pending"])["status"] == "cancelled"
    assert meta(raw.transitions(ids["pending"])[-1])["bulk"] is True
