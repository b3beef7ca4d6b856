"""The dashboard's destinations (docs/dashboard.md, docs/destinations.md) over real sockets
and real stores, both engines and both backends: the page and each
destination's page for every role, an operator's pause, resume and enable
(bearer and browser session, its CSRF token and Origin), the audit rows
they write, refusals that write nothing, and the state gauge of
``/metrics``."""

from __future__ import annotations

import logging
import time
from typing import Any

import httpx
import pytest

from trio_dispatch import pause_destination
from trio_dispatch.destinations import parse_destinations
from trio_dispatch.store import SQLiteStore
from trio_dispatch.web import WebApp
from trio_dispatch.web import destinations as web_destinations

from ..conftest import RawDB
from .test_web import metrics_of, samples, serving
from .test_web_actions import BEARER, OPERATOR, VIEWER, login

pytestmark = pytest.mark.anyio

POLICIES = parse_destinations(
    {"*": {"concurrency": 2}, "billing": {"rate": "50/s", "burst": 10, "concurrency": 4}}
)
JSON = {"accept": "application/json"}
HOSTILE = "<script>alert(1)</script>"


def app(store: SQLiteStore, **options: Any) -> WebApp:
    return WebApp(store, token=VIEWER, operator_token=OPERATOR, destinations=POLICIES, **options)


def add_row(raw: RawDB, dispatch_id: str, deliver_to: str, due: float) -> None:
    raw.execute(
        "INSERT INTO dispatch_outbox (id, kind, deliver_to, payload, status, attempt, "
        "next_attempt_at, created_at, updated_at) VALUES (?, 'k', ?, '{}', 'pending', 0, ?, ?, ?)",
        (dispatch_id, deliver_to, due, due, due),
    )


def audit(raw: RawDB) -> list[tuple[Any, ...]]:
    return [
        (row["destination"], row["previous_state"], row["state"], row["reason"], row["actor"])
        for row in raw.rows(
            "SELECT destination, previous_state, state, reason, actor "
            "FROM dispatch_destination_changes ORDER BY id"
        )
    ]


def stored(raw: RawDB) -> list[Any]:
    return [raw.rows("SELECT * FROM dispatch_destinations ORDER BY name"), audit(raw)]


async def test_every_role_reads_the_destinations_and_only_an_operator_acts(
    store: SQLiteStore, raw: RawDB
) -> None:
    add_row(raw, "m1", "mailer", time.time() - 30)
    add_row(raw, "h1", HOSTILE, time.time())
    async with serving(app(store)) as client:
        for path in ("/destinations", "/destinations/detail?name=billing"):
            assert (await client.get(path)).status_code == 401
        listing = await client.get("/destinations", headers=BEARER["viewer"])
        assert listing.status_code == 200
        assert 'href="/destinations/detail?name=billing"' in listing.text
        assert 'href="/destinations/detail?name=mailer"' in listing.text
        assert HOSTILE not in listing.text and "&lt;script&gt;" in listing.text
        page = await client.get("/destinations/detail?name=billing", headers=BEARER["viewer"])
        assert page.status_code == 200 and "rate 50/s burst 10" in page.text
        assert "<form" not in page.text
        overview = await client.get("/", headers=BEARER["viewer"])
        assert 'href="/destinations"' in overview.text and "destinations, 0 not active" in (
            overview.text
        )
        before = stored(raw)
        for path in ("/destinations/pause", "/destinations/resume", "/destinations/enable"):
            for role, status in (("none", 401), ("viewer", 403)):
                answer = await client.post(path, data={"name": "billing"}, headers=BEARER[role])
                assert answer.status_code == status, (path, role)
        assert stored(raw) == before
        document = (await client.get("/destinations", headers={**BEARER["viewer"], **JSON})).json()
        assert [entry["name"] for entry in document["destinations"]] == [
            HOSTILE,
            "billing",
            "mailer",
        ]
        assert document["destinations"][2]["pending"] == 1


async def test_an_operator_pauses_resumes_and_enables_with_a_bearer_token(
    store: SQLiteStore, raw: RawDB, caplog: pytest.LogCaptureFixture
) -> None:
    headers = {**BEARER["operator"], **JSON}
    caplog.set_level(logging.INFO, "trio_dispatch")
    async with serving(app(store)) as client:
        paused = await client.post(
            "/destinations/pause",
            data={"name": "billing", "for": "30m", "reason": "partner maintenance"},
            headers=headers,
        )
        assert paused.status_code == 200, paused.text
        document = paused.json()
        assert (document["applied"], document["from"], document["to"]) == (
            True,
            "active",
            "paused",
        )
        assert time.time() + 1790 < document["until"] <= time.time() + 1800
        resumed = await client.post(
            "/destinations/resume", data={"name": "billing", "reason": "back"}, headers=headers
        )
        assert resumed.json()["to"] == "active"
        again = await client.post("/destinations/resume", data={"name": "billing"}, headers=headers)
        assert again.status_code == 409
        assert again.json()["error"] == "billing was not paused (it is active): nothing to do"
        raw.execute(
            "UPDATE dispatch_destinations SET state = 'disabled', reason = 'open 3600s' "
            "WHERE name = 'billing'"
        )
        enabled = await client.post(
            "/destinations/enable", data={"name": "billing"}, headers=headers
        )
        assert enabled.status_code == 200 and enabled.json()["from"] == "disabled"
        not_open = await client.post(
            "/destinations/enable", data={"name": "billing"}, headers=headers
        )
        assert not_open.status_code == 409
    assert audit(raw) == [
        ("billing", "active", "paused", "partner maintenance", "web"),
        ("billing", "paused", "active", "back", "web"),
        ("billing", "disabled", "active", None, "web"),
    ]
    assert raw.scalar("SELECT DISTINCT source FROM dispatch_destination_changes") == "operator"
    lines = [r.getMessage() for r in caplog.records if r.name == "trio_dispatch.web"]
    assert "web: pause of destination billing by operator (bearer) from 127.0.0.1: applied" in (
        lines
    )


@pytest.mark.parametrize(
    ("form", "status", "words"),
    [
        ({"name": "billing", "for": "soon"}, 400, "invalid duration 'soon'"),
        ({"name": "billing", "until": "2001-01-01T00:00:00Z"}, 400, "not in the future"),
        ({"name": "billing", "until": "2030-01-01T00:00"}, 400, "no UTC offset"),
        (
            {"name": "billing", "for": "1h", "until": "2099-01-01T00:00:00Z"},
            400,
            "not both",
        ),
        ({"name": "*"}, 400, "'*' names the defaults"),
        ({"name": "bad\x1bname"}, 400, "control characters"),
        ({"name": "nowhere"}, 404, "no destination named 'nowhere'"),
        ({}, 400, "deliver_to must be a non-empty string"),
    ],
)
async def test_a_refused_action_says_why_and_writes_nothing(
    store: SQLiteStore, raw: RawDB, form: dict[str, str], status: int, words: str
) -> None:
    async with serving(app(store)) as client:
        before = stored(raw)
        answer = await client.post(
            "/destinations/pause", data=form, headers={**BEARER["operator"], **JSON}
        )
        assert answer.status_code == status, answer.text
        assert words in answer.json()["error"]
        page = await client.post("/destinations/pause", data=form, headers=BEARER["operator"])
        assert page.status_code == status and "<!doctype html>" in page.text
        assert stored(raw) == before


async def test_a_browser_session_acts_with_its_csrf_token_and_lands_on_the_page(
    store: SQLiteStore, raw: RawDB
) -> None:
    async with serving(app(store)) as client:
        csrf = await login(client)
        origin = str(client.base_url).rstrip("/")
        page = await client.get("/destinations/detail?name=billing")
        assert 'action="/destinations/pause"' in page.text and f'value="{csrf}"' in page.text
        assert "/destinations/resume" not in page.text  # not paused: nothing to resume
        form = {"name": "billing", "for": "1h", "reason": "maintenance window"}
        for fields, headers in [
            (form, {"origin": origin}),  # no CSRF token
            ({**form, "csrf": "x" * len(csrf)}, {"origin": origin}),  # a wrong one
            ({**form, "csrf": csrf}, {"origin": "http://evil.example"}),  # a foreign Origin
            ({**form, "csrf": csrf}, {}),  # no Origin
        ]:
            answer = await client.post("/destinations/pause", data=fields, headers=headers)
            assert answer.status_code == 403, (fields, headers)
            assert raw.scalar("SELECT COUNT(*) FROM dispatch_destinations") == 0
        answer = await client.post(
            "/destinations/pause", data={**form, "csrf": csrf}, headers={"origin": origin}
        )
        assert answer.status_code == 303
        location = answer.headers["location"]
        assert location == "/destinations/detail?name=billing&done=pause"
        landed = await client.get(location)
        assert "<p class=notice id=notice>Paused: its rows stay pending" in landed.text
        assert 'class="badge paused">paused</span> until' in landed.text
        assert "maintenance window" in landed.text and "operator / web" in landed.text
        assert 'action="/destinations/resume"' in landed.text
        # Resume, then resume again: the second says why on the same page.
        answer = await client.post(
            "/destinations/resume",
            data={"name": "billing", "csrf": csrf},
            headers={"origin": origin},
        )
        assert answer.headers["location"] == "/destinations/detail?name=billing&done=resume"
        again = await client.post(
            "/destinations/resume",
            data={"name": "billing", "csrf": csrf},
            headers={"origin": origin},
        )
        assert again.status_code == 409
        assert "<p class=error id=notice>billing was not paused (it is active)" in again.text
        assert "<h1>Destination <span class=mono>billing</span></h1>" in again.text
        # A link cannot make the page say anything but its own notices.
        forged = await client.get("/destinations/detail?name=billing&done=all+is+well")
        assert "id=notice" not in forged.text
    assert audit(raw) == [
        ("billing", "active", "paused", "maintenance window", "web"),
        ("billing", "paused", "active", None, "web"),
    ]


async def test_a_viewer_session_sees_no_form_and_its_post_is_refused(
    store: SQLiteStore, raw: RawDB
) -> None:
    await pause_destination(store, "billing", reason="held")
    async with serving(app(store)) as client:
        csrf = await login(client, VIEWER)
        page = await client.get("/destinations/detail?name=billing")
        assert (
            page.status_code == 200 and '<form method=post action="/destinations' not in page.text
        )
        answer = await client.post(
            "/destinations/resume",
            data={"name": "billing", "csrf": csrf},
            headers={"origin": str(client.base_url).rstrip("/")},
        )
        assert answer.status_code == 403
    assert audit(raw) == [("billing", "active", "paused", "held", "destinations")]


async def test_without_an_operator_token_the_pages_only_read(
    store: SQLiteStore, raw: RawDB
) -> None:
    async with serving(WebApp(store, token=VIEWER, destinations=POLICIES)) as client:
        page = await client.get("/destinations/detail?name=billing", headers=BEARER["viewer"])
        assert page.status_code == 200 and "<form" not in page.text
        answer = await client.post(
            "/destinations/pause", data={"name": "billing"}, headers=BEARER["viewer"]
        )
        assert answer.status_code == 405
        missing = await client.get("/destinations/detail?name=nowhere", headers=BEARER["viewer"])
        assert missing.status_code == 404
    assert stored(raw) == [[], []]


async def test_metrics_give_each_destination_s_state_as_a_state_set(
    store: SQLiteStore, raw: RawDB, monkeypatch: pytest.MonkeyPatch
) -> None:
    await pause_destination(store, "billing", for_seconds=600)
    raw.execute("INSERT INTO dispatch_destinations (name, state) VALUES ('zeta', 'disabled')")
    for name in ("alpha", "beta"):
        add_row(raw, f"{name}-1", name, time.time())
    async with serving(app(store)) as client:
        text = (await client.get("/metrics", headers=BEARER["viewer"])).text
        family = metrics_of(text)["trio_dispatch_destination_state"]
        assert family.type == "gauge"
        values = {
            (sample.labels["deliver_to"], sample.labels["state"]): sample.value
            for sample in family.samples
        }
        assert {name for name, _ in values} == {"alpha", "beta", "billing", "zeta"}
        states = ("active", "paused", "throttled", "open", "half_open", "disabled")
        for name, current in (("billing", "paused"), ("zeta", "disabled"), ("alpha", "active")):
            assert [values[(name, state)] for state in states] == [
                1.0 if state == current else 0.0 for state in states
            ]
        assert sum(samples(family).values()) == 4  # one state each
        # The label cap: the configured destination first, then the ones not active.
        monkeypatch.setattr(web_destinations, "MAX_STATE_LABELS", 2)
        capped = metrics_of((await client.get("/metrics", headers=BEARER["viewer"])).text)
        names = {s.labels["deliver_to"] for s in capped["trio_dispatch_destination_state"].samples}
        assert names == {"billing", "zeta"}


async def test_the_worker_s_policies_are_the_pages_policies(store: SQLiteStore) -> None:
    from trio_dispatch.worker import DispatchWorker

    from .test_web import nothing

    worker = DispatchWorker(store, transport=nothing, destinations={"billing": {"concurrency": 3}})
    async with serving(WebApp(store, worker=worker)) as client:
        answer = await client.get("/destinations", headers=JSON)
        (entry,) = answer.json()["destinations"]
        assert (entry["name"], entry["concurrency_limit"], entry["configured"]) == (
            "billing",
            3,
            True,
        )


async def test_the_page_links_every_destination_even_an_awkward_name(
    store: SQLiteStore, raw: RawDB
) -> None:
    name = "https://hooks.example.com/a?b=c&d=e#f"
    add_row(raw, "w1", name, time.time())
    async with serving(app(store)) as client:
        listing = await client.get("/destinations", headers=BEARER["viewer"])
        (link,) = [
            found.split('"', 1)[0]
            for found in listing.text.split('href="/destinations/detail?')[1:]
            if "hooks" in found.split('"', 1)[0]
        ]
        page = await client.get(
            "/destinations/detail?" + link.replace("&amp;", "&"), headers=BEARER["viewer"]
        )
        assert page.status_code == 200 and "pending</dt><dd>1</dd>" in page.text
        answer = await client.post(
            "/destinations/pause",
            data={"name": name},
            headers={**BEARER["operator"], **JSON},
        )
        assert answer.json()["applied"] is True
    assert audit(raw) == [(name, "active", "paused", None, "web")]


async def test_an_operator_without_a_session_is_told_to_log_in(store: SQLiteStore) -> None:
    async with serving(app(store)) as client:
        page = await client.get("/destinations/detail?name=billing", headers=BEARER["operator"])
        assert "Log in (<a href=/login>/login</a>) to act from here." in page.text
        async with httpx.AsyncClient(base_url=client.base_url) as other:
            assert (await other.get("/destinations")).status_code == 401
