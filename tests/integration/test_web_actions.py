"""Acting from the dashboard (docs/dashboard.md) over real sockets and real stores,
both engines and both backends: every route under each role, the login
session's forgery checks, bulk actions, 404/409 with reasons, the audit
trail and the logs."""

from __future__ import annotations

import base64
import hashlib
import json
import logging
import time
from typing import Any

import httpx
import pytest

from trio_dispatch.store import SQLiteStore
from trio_dispatch.web import WebApp
from trio_dispatch.web.throttle import LOGIN_FAILURES, LOGIN_WINDOW_SECONDS

from ..conftest import RawDB
from ..helpers import size
from .test_web import listed, populate, serving

pytestmark = pytest.mark.anyio

VIEWER = "viewer-token-0123456789"
OPERATOR = "operator-token-0123456789"
BEARER = {"none": {}, "viewer": {"authorization": f"Bearer {VIEWER}"}}
BEARER["operator"] = {"authorization": f"Bearer {OPERATOR}"}


def state(raw: RawDB) -> list[Any]:
    """Everything an action could change."""
    rows = raw.rows("SELECT id, status, attempt, updated_at FROM dispatch_outbox ORDER BY id")
    history = raw.rows("SELECT COUNT(*) AS n FROM status_transitions")
    return [rows, history]


def routes(ids: dict[str, str]) -> list[tuple[str, str, dict[str, str]]]:
    dead, done = ids["dead_letter"], ids["delivered"]
    return [
        ("GET", "/", {}),
        ("GET", "/blocked", {}),
        ("GET", f"/dispatches/{dead}", {}),
        ("GET", "/metrics", {}),
        ("GET", "/schedules", {}),
        ("GET", "/actions/retry?status=dead_letter", {}),
        ("POST", f"/dispatches/{dead}/retry", {}),
        ("POST", f"/dispatches/{done}/purge", {}),
        ("POST", "/actions/retry", {"status": "dead_letter"}),
        ("POST", "/actions/purge", {"status": "delivered"}),
    ]


EXPECTED = {
    # role -> status of each route above, in order
    "none": [401, 401, 401, 401, 401, 401, 401, 401, 401, 401],
    "viewer": [200, 200, 200, 200, 200, 403, 403, 403, 403, 403],
    # an action that applied: to the row's page, or the list (POST, redirect, GET)
    "operator": [200, 200, 200, 200, 200, 200, 303, 303, 303, 303],
}


@pytest.mark.parametrize("role", ["none", "viewer", "operator"])
async def test_every_route_under_each_role_and_only_an_operator_changes_anything(
    store: SQLiteStore, raw: RawDB, role: str
) -> None:
    ids = await populate(store, raw)
    app = WebApp(store, token=VIEWER, operator_token=OPERATOR)
    got = []
    async with serving(app) as client:
        for method, path, form in routes(ids):
            before = state(raw)
            answer = await client.request(method, path, data=form or None, headers=BEARER[role])
            got.append(answer.status_code)
            if method == "POST" and role != "operator":
                assert state(raw) == before, (role, path)
                assert answer.status_code in (401, 403)
    assert got == EXPECTED[role]


async def test_without_an_operator_token_the_view_is_read_only_for_everyone(
    store: SQLiteStore, raw: RawDB
) -> None:
    ids = await populate(store, raw)
    before = state(raw)
    async with serving(WebApp(store, token=VIEWER)) as client:
        for role in ("viewer", "none"):
            answer = await client.post(
                f"/dispatches/{ids['dead_letter']}/retry", headers=BEARER[role]
            )
            assert answer.status_code == (405 if role == "viewer" else 401)
        # An operator token that is not configured proves nothing.
        answer = await client.post("/actions/purge?status=delivered", headers=BEARER["operator"])
        assert answer.status_code == 401
        page = await client.get(f"/dispatches/{ids['dead_letter']}", headers=BEARER["viewer"])
        assert "<form method=post" not in page.text
        assert (await client.get("/login", headers=BEARER["viewer"])).status_code == 404
    assert state(raw) == before


async def login(client: httpx.AsyncClient, token: str = OPERATOR) -> str:
    origin = str(client.base_url).rstrip("/")
    answer = await client.post("/login", data={"token": token}, headers={"origin": origin})
    assert answer.status_code == 303, answer.text
    cookie = answer.headers["set-cookie"]
    for part in ("HttpOnly", "SameSite=Strict", "Path=/"):
        assert part in cookie
    page = await client.get("/")
    assert page.status_code == 200 and "Log out" in page.text
    found = page.text.split('name="csrf" value="', 1)[1].split('"', 1)[0]
    assert len(found) > 30
    return found


async def test_a_browser_session_acts_only_with_its_csrf_token_and_its_own_origin(
    store: SQLiteStore, raw: RawDB
) -> None:
    ids = await populate(store, raw)
    path = f"/dispatches/{ids['dead_letter']}/retry"
    async with serving(WebApp(store, token=VIEWER, operator_token=OPERATOR)) as client:
        csrf = await login(client)
        origin = str(client.base_url).rstrip("/")
        before = state(raw)
        for form, headers in [
            ({}, {"origin": origin}),  # no CSRF token
            ({"csrf": "x" * len(csrf)}, {"origin": origin}),  # a wrong one
            ({"csrf": csrf}, {"origin": "http://evil.example"}),  # a foreign Origin
            ({"csrf": csrf}, {}),  # no Origin
        ]:
            answer = await client.post(path, data=form, headers=headers)
            assert answer.status_code == 403, (form, headers)
            assert state(raw) == before
        answer = await client.post(path, data={"csrf": csrf}, headers={"origin": origin})
        assert answer.status_code == 303, answer.text
        assert raw.row(ids["dead_letter"])["status"] == "pending"
        history = raw.rows(
            "SELECT source, actor, metadata FROM status_transitions WHERE entity_id = ? "
            "ORDER BY id DESC",
            (ids["dead_letter"],),
        )[0]
        meta = history["metadata"]
        meta = meta if isinstance(meta, dict) else json.loads(meta)
        assert (history["source"], history["actor"]) == ("operator", "web")
        assert meta["client"] == "127.0.0.1" and meta["via"] == "cookie"
        # Logged out, the cookie proves nothing.
        await client.post("/logout", data={"csrf": csrf}, headers={"origin": origin})
        assert (await client.get("/")).status_code == 401
    # A viewer's session reads, and its POSTs are refused.
    async with serving(WebApp(store, token=VIEWER, operator_token=OPERATOR)) as client:
        csrf = await login(client, VIEWER)
        page = await client.get(f"/dispatches/{ids['expired']}")
        assert page.status_code == 200
        assert f"/dispatches/{ids['expired']}/retry" not in page.text
        answer = await client.post(
            f"/dispatches/{ids['expired']}/retry",
            data={"csrf": csrf},
            headers={"origin": str(client.base_url).rstrip("/")},
        )
        assert answer.status_code == 403 and raw.row(ids["expired"])["status"] == "expired"


@pytest.mark.parametrize("role", ["viewer", "operator"])
async def test_a_bearer_logout_is_refused_with_the_reason_and_ends_nothing(
    store: SQLiteStore, raw: RawDB, role: str
) -> None:
    async with serving(WebApp(store, token=VIEWER, operator_token=OPERATOR)) as client:
        answer = await client.post(
            "/logout", headers={**BEARER[role], "accept": "application/json"}
        )
        assert answer.status_code == 403
        error = answer.json()["error"]
        assert error.startswith("a bearer token has no session to end: /logout ends a browser")
        page = await client.post("/logout", headers=BEARER[role])
        assert page.status_code == 403 and "a bearer token has no session to end" in page.text
        assert (await client.get("/", headers=BEARER[role])).status_code == 200


@pytest.mark.sqlite_only  # sessions live in the server's memory, not in the store
async def test_a_flood_of_viewer_logins_never_logs_an_operator_out(
    store: SQLiteStore, raw: RawDB, monkeypatch: pytest.MonkeyPatch
) -> None:
    from trio_dispatch.web import auth
    from trio_dispatch.web.auth import SESSION_COOKIE

    # The real cap under CI; outside it a smaller one (1,030 logins take 4 s).
    cap = size(auth.MAX_SESSIONS, 64)
    monkeypatch.setattr(auth, "MAX_SESSIONS", cap)
    ids = await populate(store, raw)
    async with serving(WebApp(store, token=VIEWER, operator_token=OPERATOR)) as operator:
        csrf = await login(operator)
        origin = str(operator.base_url).rstrip("/")
        viewer_sessions = []
        async with httpx.AsyncClient(base_url=operator.base_url, timeout=10) as viewer:
            for _ in range(cap + 6):
                answer = await viewer.post(
                    "/login", data={"token": VIEWER}, headers={"origin": origin}
                )
                assert answer.status_code == 303
                viewer_sessions.append(answer.cookies[SESSION_COOKIE])
            # The viewers' own cap still holds: their oldest sessions ended.
            viewer.cookies.clear()
            first = await viewer.get(
                "/", headers={"cookie": f"{SESSION_COOKIE}={viewer_sessions[0]}"}
            )
            assert first.status_code == 401
            last = await viewer.get(
                "/", headers={"cookie": f"{SESSION_COOKIE}={viewer_sessions[-1]}"}
            )
            assert last.status_code == 200
        page = await operator.get("/")
        assert page.status_code == 200 and "Log out" in page.text
        answer = await operator.post(
            f"/dispatches/{ids['dead_letter']}/retry",
            data={"csrf": csrf},
            headers={"origin": origin},
        )
        assert answer.status_code == 303, answer.text
    assert raw.row(ids["dead_letter"])["status"] == "pending"


async def test_a_login_needs_a_token_that_proves_a_role_and_this_origin(
    store: SQLiteStore, raw: RawDB
) -> None:
    async with serving(WebApp(store, token=VIEWER, operator_token=OPERATOR)) as client:
        origin = str(client.base_url).rstrip("/")
        form = (await client.get("/login")).text
        assert "type=password name=token" in form
        wrong = await client.post("/login", data={"token": "x" * 20}, headers={"origin": origin})
        assert wrong.status_code == 401 and "set-cookie" not in wrong.headers
        foreign = await client.post(
            "/login", data={"token": OPERATOR}, headers={"origin": "http://evil.example"}
        )
        assert foreign.status_code == 403 and "set-cookie" not in foreign.headers


class Clock:
    """A wall clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = time.time()

    def __call__(self) -> float:
        return self.now


def login_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.levelno >= logging.WARNING and "login" in r.getMessage()
    ]


@pytest.mark.sqlite_only  # the throttle lives in the server's memory, not in the store
async def test_wrong_tokens_at_the_login_form_are_throttled_per_client(
    store: SQLiteStore, raw: RawDB
) -> None:
    clock = Clock()
    async with serving(WebApp(store, token=VIEWER, operator_token=OPERATOR, clock=clock)) as client:
        origin = str(client.base_url).rstrip("/")

        async def attempt(token: str, http: httpx.AsyncClient = client) -> httpx.Response:
            return await http.post("/login", data={"token": token}, headers={"origin": origin})

        burst = size(300, 30)  # 300 requests take a second
        answers = [await attempt(f"wrong-token-{n:010d}") for n in range(burst)]
        statuses = [answer.status_code for answer in answers]
        assert statuses == [401] * LOGIN_FAILURES + [429] * (burst - LOGIN_FAILURES)
        assert answers[-1].headers["retry-after"] == str(int(LOGIN_WINDOW_SECONDS))
        assert "too many wrong tokens from your address: try again in 60s" in answers[-1].text
        # While it waits, even the right token is not heard: no session.
        right = await attempt(OPERATOR)
        assert right.status_code == 429 and "set-cookie" not in right.headers
        # Bearer requests and other clients are not slowed down.
        assert (await client.get("/", headers=BEARER["operator"])).status_code == 200
        other = httpx.AsyncHTTPTransport(local_address="127.0.0.2")
        async with httpx.AsyncClient(
            base_url=client.base_url, transport=other, timeout=10
        ) as neighbour:
            assert (await attempt(OPERATOR, neighbour)).status_code == 303
        # The burst over, the client is heard again.
        clock.now += LOGIN_WINDOW_SECONDS - 1
        waiting = await attempt(OPERATOR)
        assert waiting.status_code == 429 and waiting.headers["retry-after"] == "1"
        clock.now += 1
        assert (await attempt(OPERATOR)).status_code == 303


@pytest.mark.sqlite_only  # the throttle lives in the server's memory, not in the store
async def test_a_burst_of_wrong_tokens_logs_one_line_without_a_token(
    store: SQLiteStore, raw: RawDB, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="trio_dispatch.web")
    clock = Clock()
    async with serving(WebApp(store, token=VIEWER, operator_token=OPERATOR, clock=clock)) as client:
        origin = str(client.base_url).rstrip("/")

        async def attempt(token: str) -> int:
            answer = await client.post("/login", data={"token": token}, headers={"origin": origin})
            return answer.status_code

        for n in range(size(300, 30)):  # 300 requests take a second
            assert await attempt(f"wrong-token-{n:010d}") in (401, 429)
        lines = login_warnings(caplog)
        assert len(lines) == 1, lines[:3]
        assert lines[0].startswith("web: a login from 127.0.0.1 was refused (wrong token)")
        # A burst after this one is one more line.
        clock.now += LOGIN_WINDOW_SECONDS
        assert await attempt("wrong-token-again-0123") == 401
        assert len(login_warnings(caplog)) == 2
    assert not any("wrong-token-" in r.getMessage() for r in caplog.records)


async def test_actions_answer_404_and_409_with_the_reason_and_json_when_asked(
    store: SQLiteStore, raw: RawDB
) -> None:
    ids = await populate(store, raw)
    headers = {**BEARER["operator"], "accept": "application/json"}
    async with serving(WebApp(store, token=VIEWER, operator_token=OPERATOR)) as client:
        missing = await client.post("/dispatches/" + "0" * 32 + "/retry", headers=headers)
        assert missing.status_code == 404 and "no dispatch" in missing.json()["error"]
        gone = await client.post("/dispatches/" + "0" * 32 + "/purge", headers=headers)
        assert gone.status_code == 404
        wrong = await client.post(f"/dispatches/{ids['delivered']}/retry", headers=headers)
        assert wrong.status_code == 409 and "dead_letter or expired" in wrong.json()["error"]
        refused = await client.post("/actions/retry", data={"status": "acked"}, headers=headers)
        assert refused.status_code == 409 and "not allowed" in refused.json()["error"]
        bad = await client.post("/actions/purge", data={"status": "lost"}, headers=headers)
        assert bad.status_code == 400 and "status must be one of" in bad.json()["error"]
        done = await client.post(f"/dispatches/{ids['dead_letter']}/retry", headers=headers)
        assert done.json() == {
            "id": ids["dead_letter"],
            "action": "retry",
            "applied": True,
            "status": "pending",
        }
        purged = await client.post(
            f"/dispatches/{ids['expired']}/purge", headers=BEARER["operator"]
        )
        assert purged.status_code == 303 and purged.headers["location"] == "/"
        html = await client.get(purged.headers["location"], headers=BEARER["operator"])
        assert html.headers["content-type"].startswith("text/html")
        assert html.headers["content-security-policy"].startswith("default-src 'none'")
        assert html.headers["x-content-type-options"] == "nosniff"
        policy = html.headers["content-security-policy"]
        style = html.text.split("<style>", 1)[1].split("</style>", 1)[0]
        digest = base64.b64encode(hashlib.sha256(style.encode()).digest()).decode()
        assert f"style-src 'sha256-{digest}'" in policy and "unsafe" not in policy
        assert "script-src" not in policy and "frame-ancestors 'none'" in policy
        assert " style=" not in html.text and "<script" not in html.text
        assert raw.rows("SELECT id FROM dispatch_outbox WHERE id = ?", (ids["expired"],)) == []


async def test_a_bulk_action_confirms_its_count_then_applies_exactly_the_filtered_rows(
    store: SQLiteStore, raw: RawDB, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="trio_dispatch.web")
    ids = await populate(store, raw)
    headers = BEARER["operator"]
    async with serving(WebApp(store, token=VIEWER, operator_token=OPERATOR)) as client:
        confirm = await client.get(
            "/actions/purge?status=delivered&kind=<b>x</b>",
            headers={**headers, "accept": "application/json"},
        )
        assert confirm.json()["matching"] == 0
        page = await client.get(
            "/actions/purge?status=delivered&kind=%3Cb%3Ex%3C%2Fb%3E", headers=headers
        )
        assert "&lt;b&gt;x&lt;/b&gt;" in page.text and "<b>x</b>" not in page.text
        count = await client.get("/actions/purge?status=delivered", headers=headers)
        assert "Purge 1 rows?" in count.text
        before = {
            row["id"]: row["status"] for row in raw.rows("SELECT id, status FROM dispatch_outbox")
        }
        answer = await client.post(
            "/actions/purge",
            data={"status": "delivered"},
            headers={**headers, "accept": "application/json"},
        )
        assert answer.json() == {"action": "purge", "matched": 1, "applied": 1, "skipped": 0}
    after = {row["id"]: row["status"] for row in raw.rows("SELECT id, status FROM dispatch_outbox")}
    assert set(before) - set(after) == {ids["delivered"]}
    assert all(after[key] == before[key] for key in after)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("web: bulk")]
    assert lines and "purge of 1 rows" in lines[0] and "by operator (bearer)" in lines[0]
    assert not any(OPERATOR in r.getMessage() or VIEWER in r.getMessage() for r in caplog.records)


async def test_a_blocked_keys_page_shows_its_head_with_retry_and_purge(
    store: SQLiteStore, raw: RawDB
) -> None:
    from trio_dispatch import deliver_due_dispatches, enqueue_many
    from trio_dispatch.attempt import Delivery

    async def refuse(delivery: Delivery) -> None:
        raise RuntimeError("down")

    head, behind = (
        result.id
        for result in await enqueue_many(
            store,
            [
                {"kind": "k", "deliver_to": "d", "ordering_key": "order-7", "max_attempts": 1},
                {"kind": "k", "deliver_to": "d", "ordering_key": "order-7"},
            ],
        )
    )
    await deliver_due_dispatches(store, transport=refuse)
    assert raw.row(head)["status"] == "dead_letter"

    async def accept(delivery: Delivery) -> None:
        pass

    blocked = await deliver_due_dispatches(store, transport=accept)
    assert blocked["attempted"] == blocked["delivered"] == 0  # it waits for an operator
    async with serving(WebApp(store, token=VIEWER, operator_token=OPERATOR)) as client:
        csrf = await login(client)
        page = (await client.get("/?ordering_key=order-7")).text
        assert "Key blocked by its head" in page and f"/dispatches/{head}" in page
        assert f'action="/dispatches/{head}/retry"' in page
        assert f'action="/dispatches/{head}/purge"' in page
        origin = str(client.base_url).rstrip("/")
        answer = await client.post(
            f"/dispatches/{head}/purge", data={"csrf": csrf}, headers={"origin": origin}
        )
        assert answer.status_code == 303
        assert (await deliver_due_dispatches(store, transport=accept))["delivered"] == 1
        assert raw.row(behind)["status"] == "delivered"  # the key went on
        assert "Key blocked" not in (await client.get("/?ordering_key=order-7")).text


async def test_an_action_ends_on_the_row_s_page_which_says_once_what_was_done(
    store: SQLiteStore, raw: RawDB
) -> None:
    ids = await populate(store, raw)
    dead = ids["dead_letter"]
    async with serving(WebApp(store, token=VIEWER, operator_token=OPERATOR)) as client:
        csrf = await login(client)
        origin = str(client.base_url).rstrip("/")
        answer = await client.post(
            f"/dispatches/{dead}/retry", data={"csrf": csrf}, headers={"origin": origin}
        )
        assert answer.status_code == 303 and answer.headers["location"] == f"/dispatches/{dead}"
        assert answer.content == b"" and raw.row(dead)["status"] == "pending"
        page = await client.get(answer.headers["location"])
        notice = f"<p class=notice id=notice role=status>dispatch {dead} retried: pending again"
        assert page.status_code == 200 and notice in page.text
        assert "dispatch.pending.operator_retry" in page.text  # the row's own page
        again = await client.get(answer.headers["location"])  # a reload: nothing to repeat
        assert again.status_code == 200 and "id=notice" not in again.text
        # A purged row has no page left: the list says it.
        purged = await client.post(
            f"/dispatches/{ids['delivered']}/purge", data={"csrf": csrf}, headers={"origin": origin}
        )
        assert purged.status_code == 303 and purged.headers["location"] == "/"
        home = (await client.get("/")).text
        assert f"dispatch {ids['delivered']} purged" in home and ids["delivered"] not in listed(
            home
        )
        # What does not apply still says why, at once.
        refused = await client.post(
            f"/dispatches/{ids['acked']}/retry", data={"csrf": csrf}, headers={"origin": origin}
        )
        assert refused.status_code == 409 and "dead_letter or expired" in refused.text
        assert "id=notice" not in (await client.get("/")).text


async def test_a_row_s_former_address_redirects_and_acts_on_nothing(
    store: SQLiteStore, raw: RawDB
) -> None:
    ids = await populate(store, raw)
    dead = ids["dead_letter"]
    async with serving(WebApp(store, token=VIEWER, operator_token=OPERATOR)) as client:
        assert (await client.get(f"/dispatch/{dead}")).status_code == 401  # a role first
        viewer = BEARER["viewer"]
        for method in ("GET", "HEAD"):
            moved = await client.request(method, f"/dispatch/{dead}?x=1", headers=viewer)
            assert moved.status_code == 301, method
            assert moved.headers["location"] == f"/dispatches/{dead}?x=1"
        hostile = await client.get("/dispatch/a b%0d%0aSet-Cookie:%20x", headers=viewer)
        assert hostile.headers["location"] == "/dispatches/a%20b%0D%0ASet-Cookie%3A%20x"
        assert "x" not in hostile.cookies
        page = await client.get(f"/dispatches/{dead}", headers=viewer)
        assert page.status_code == 200 and "dispatch.dead_letter" in page.text
        home = (await client.get("/", headers=viewer)).text
        assert dead in listed(home) and 'href="/dispatch/' not in home
        assert (await client.get(f"/dispatches/{dead}/x", headers=viewer)).status_code == 404
        before = state(raw)
        for path in (f"/dispatch/{dead}/retry", f"/dispatch/{dead}"):
            refused = await client.post(path, headers=BEARER["operator"])
            assert refused.status_code == 404, path
        assert state(raw) == before


async def test_the_login_page_shows_nothing_of_the_store(store: SQLiteStore, raw: RawDB) -> None:
    label = "postgresql://app@db.internal.example/orders"
    app = WebApp(store, token=VIEWER, operator_token=OPERATOR, store_label=label)
    async with serving(app) as client:
        origin = str(client.base_url).rstrip("/")
        for answer in (
            await client.get("/login"),
            await client.post("/login", data={"token": "wrong"}, headers={"origin": origin}),
        ):
            assert answer.status_code in (200, 401) and "Log in" in answer.text
            assert "db.internal" not in answer.text and "class=store" not in answer.text
        await login(client)
        assert "db.internal.example/orders" in (await client.get("/")).text  # once a role is proven
