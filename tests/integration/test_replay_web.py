"""The dashboard's bulk retry by destination and failure time (docs/destinations.md#replay;
docs/dashboard.md roles and audit) over real sockets, both engines and both
backends: the count first, then exactly those rows, each with its audit;
the form's own fields post back the same rows; refusals change nothing."""

from __future__ import annotations

import json
import logging
import re
from typing import Any

import pytest

from trio_dispatch.store import SQLiteStore
from trio_dispatch.times import iso_time
from trio_dispatch.web import WebApp

from ..conftest import RawDB
from ..engine.test_replay import T0, names, outage, retried
from ..helpers import everything
from .test_web import serving
from .test_web_actions import BEARER, OPERATOR, VIEWER, login

pytestmark = pytest.mark.anyio

JSON = {**BEARER["operator"], "accept": "application/json"}
WINDOW = {"deliver_to": "billing", "since": iso_time(T0 + 15), "until": iso_time(T0 + 30)}


def app(store: SQLiteStore) -> WebApp:
    # The dashboard's clock stands 40 s after the outage began: "15s" is T0 + 25.
    return WebApp(store, token=VIEWER, operator_token=OPERATOR, clock=lambda: T0 + 40)


def metadata(raw: RawDB, dispatch_id: str) -> dict[str, Any]:
    found = raw.transitions(dispatch_id)[-1]["metadata"]
    return found if isinstance(found, dict) else dict(json.loads(found))


async def test_a_bulk_retry_by_destination_and_time_counts_first_then_retries_exactly_those(
    store: SQLiteStore, raw: RawDB, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="trio_dispatch.web")
    ids = await outage(store, raw)
    before = everything(raw)
    async with serving(app(store)) as client:
        count = await client.get("/actions/retry", params=WINDOW, headers=JSON)
        assert count.status_code == 200
        assert count.json() == {
            "action": "retry",
            "matching": 2,
            "limit": 10_000,
            "status": "",
            "kind": "",
            "ordering_key": "",
            **WINDOW,
        }
        page = await client.get("/actions/retry", params=WINDOW, headers=BEARER["operator"])
        assert "Retry 2 rows?" in page.text
        assert "deliver_to &#x27;billing&#x27;, changed since 1970-01-12T13:46:55Z" in page.text
        assert 'id=replay method=get action="/actions/retry"' in page.text
        assert everything(raw) == before  # counting changes nothing
        answer = await client.post("/actions/retry", data=WINDOW, headers=JSON)
        assert answer.json() == {"action": "retry", "matched": 2, "applied": 2, "skipped": 0}
        again = await client.post("/actions/retry", data=WINDOW, headers=JSON)
        assert again.json() == {"action": "retry", "matched": 0, "applied": 0, "skipped": 0}
    assert names(ids, retried(raw)) == ["a20", "e25"]
    for name in ("a10", "mail20", "a30"):
        assert raw.row(ids[name])["status"] == "dead_letter", name
    last = raw.transitions(ids["a20"])[-1]
    assert (last["source"], last["actor"]) == ("operator", "web")
    meta = metadata(raw, ids["a20"])
    assert (meta["client"], meta["via"], meta["bulk"]) == ("127.0.0.1", "bearer", True)
    assert meta["filter"]["since"] == T0 + 15 and meta["filter"]["until"] == T0 + 30
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("web: bulk")]
    assert len(lines) == 2 and "retry of 2 rows (status dead_letter or expired, " in lines[0]
    assert "deliver_to 'billing'" in lines[0] and "by operator (bearer)" in lines[0]


async def test_a_duration_since_counts_back_from_the_dashboards_clock(
    store: SQLiteStore, raw: RawDB
) -> None:
    ids = await outage(store, raw)
    async with serving(app(store)) as client:
        answer = await client.post(
            "/actions/retry", data={"status": "dead_letter", "since": "25s"}, headers=JSON
        )
        assert answer.json()["applied"] == 3
    assert names(ids, retried(raw)) == ["a20", "mail20", "a30"]  # every destination


async def test_a_browser_session_posts_back_the_confirmations_own_filters(
    store: SQLiteStore, raw: RawDB
) -> None:
    ids = await outage(store, raw)
    async with serving(app(store)) as client:
        csrf = await login(client)
        home = await client.get("/")
        assert 'href="/actions/retry">Retry failed rows by destination and time' in home.text
        empty = await client.get("/actions/retry")
        assert empty.status_code == 200 and "Choose at least one filter" in empty.text
        assert "<form method=post" not in empty.text
        page = await client.get("/actions/retry", params={"deliver_to": "billing", "since": "15s"})
        assert "Retry 2 rows?" in page.text
        form = re.search(r'<form method=post action="/actions/retry".*?</form>', page.text)
        assert form is not None
        fields = dict(re.findall(r'name="([^"]+)" value="([^"]*)"', form.group(0)))
        assert fields["csrf"] == csrf and fields["since"] == iso_time(T0 + 25)
        origin = str(client.base_url).rstrip("/")
        answer = await client.post("/actions/retry", data=fields, headers={"origin": origin})
        assert answer.status_code == 303 and answer.headers["location"] == "/"
        assert "2 of 2 rows retried" in (await client.get("/")).text  # the notice
    assert names(ids, retried(raw)) == ["e25", "a30"]
    assert metadata(raw, ids["a30"])["via"] == "cookie"


@pytest.mark.parametrize(
    "role, form, code, words",
    [
        ("viewer", WINDOW, 403, "only an operator may act"),
        ("none", WINDOW, 401, ""),
        ("operator", {}, 400, "a bulk retry needs at least one filter"),
        ("operator", {"since": "soon"}, 400, "invalid since 'soon'"),
        ("operator", {"until": "2026-12-02T09:00"}, 400, "no UTC offset"),
        ("operator", {"since": "1h", "until": "2h"}, 400, "must be before until"),
        ("operator", {"deliver_to": "a\x1bb"}, 400, "control characters"),
        ("operator", {"status": "acked", "deliver_to": "billing"}, 409, "not allowed"),
        ("operator", {"status": "lost"}, 400, "status must be one of"),
    ],
)
async def test_a_refused_bulk_retry_says_why_and_changes_nothing(
    store: SQLiteStore, raw: RawDB, role: str, form: dict[str, str], code: int, words: str
) -> None:
    await outage(store, raw)
    before = everything(raw)
    async with serving(app(store)) as client:
        headers = {**BEARER[role], "accept": "application/json"}
        answer = await client.post("/actions/retry", data=form, headers=headers)
        assert answer.status_code == code
        if words:
            assert words in answer.json()["error"]
        if form and role == "operator":  # the confirmation refuses the same way
            shown = await client.get("/actions/retry", params=form, headers=headers)
            assert shown.status_code == code and words in shown.json()["error"]
    assert everything(raw) == before
