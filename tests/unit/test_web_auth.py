"""Roles, sessions and forgery checks of the dashboard (SPEC 15), without a
server: what each credential proves."""

from __future__ import annotations

import base64

import pytest

from trio_dispatch.web.auth import SESSION_COOKIE, SESSION_SECONDS, Auth, Role, forgery

VIEWER = "viewer-token-0123456789"
OPERATOR = "operator-token-0123456789"


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def scope(*headers: tuple[str, str]) -> dict[str, object]:
    return {
        "scheme": "http",
        "headers": [(k.encode(), v.encode()) for k, v in (("host", "dash:9464"), *headers)],
    }


def basic(token: str) -> str:
    return "Basic " + base64.b64encode(f"user:{token}".encode()).decode()


@pytest.mark.parametrize(
    "viewer, headers, expected",
    [
        (VIEWER, (), None),
        (None, (), (Role.VIEWER, "anonymous")),
        (VIEWER, (("authorization", f"Bearer {VIEWER}"),), (Role.VIEWER, "bearer")),
        (VIEWER, (("authorization", f"Bearer {OPERATOR}"),), (Role.OPERATOR, "bearer")),
        (None, (("authorization", f"Bearer {OPERATOR}"),), (Role.OPERATOR, "bearer")),
        (VIEWER, (("authorization", "Bearer wrong-token-0123456789"),), None),
        (None, (("authorization", "Bearer wrong-token-0123456789"),), None),
        (VIEWER, (("authorization", basic(OPERATOR)),), (Role.OPERATOR, "basic")),
        (VIEWER, (("authorization", "Basic !!!"),), None),
        (VIEWER, (("cookie", f"{SESSION_COOKIE}=made-up"),), None),
    ],
)
def test_each_credential_proves_its_role_and_nothing_else(
    viewer: str | None, headers: tuple[tuple[str, str], ...], expected: tuple[Role, str] | None
) -> None:
    identity = Auth(viewer, OPERATOR, Clock()).identify(scope(*headers))
    assert (None if identity is None else (identity.role, identity.via)) == expected


def test_a_login_session_holds_its_role_until_it_expires_or_logs_out() -> None:
    clock = Clock()
    auth = Auth(VIEWER, OPERATOR, clock)
    assert auth.login("not-a-token-at-all-xx") is None
    session = auth.login(OPERATOR)
    assert session is not None and session.role is Role.OPERATOR
    identity = auth.identify(scope(("cookie", f"a=b; {SESSION_COOKIE}={session.id}")))
    assert identity is not None and (identity.role, identity.via) == (Role.OPERATOR, "cookie")
    clock.now += SESSION_SECONDS
    assert auth.identify(scope(("cookie", f"{SESSION_COOKIE}={session.id}"))) is None
    again = auth.login(VIEWER)
    assert again is not None and again.role is Role.VIEWER
    auth.logout(again)
    assert auth.session(again.id) is None
    cookie = Auth.set_cookie(again, secure=True).decode()
    for part in (
        "HttpOnly",
        "SameSite=Strict",
        "Secure",
        "Path=/",
        f"Max-Age={int(SESSION_SECONDS)}",
    ):
        assert part in cookie


def test_a_cookie_post_needs_the_csrf_token_and_the_servers_own_origin() -> None:
    auth = Auth(VIEWER, OPERATOR, Clock())
    session = auth.login(OPERATOR)
    assert session is not None
    jar = ("cookie", f"{SESSION_COOKIE}={session.id}")

    def check(*headers: tuple[str, str], csrf: str | None = session.csrf) -> str | None:
        request = scope(jar, *headers)
        identity = auth.identify(request)
        assert identity is not None
        return forgery(identity, request, csrf)

    assert check(("origin", "http://dash:9464")) is None
    assert "Origin" in str(check())
    assert "Origin" in str(check(("origin", "http://evil.example")))
    assert "CSRF" in str(check(("origin", "http://dash:9464"), csrf=None))
    assert "CSRF" in str(check(("origin", "http://dash:9464"), csrf="x" * 43))
    bearer = scope(("authorization", f"Bearer {OPERATOR}"))
    identity = auth.identify(bearer)
    assert identity is not None and forgery(identity, bearer, None) is None
    browser = scope(("authorization", basic(OPERATOR)), ("origin", "http://dash:9464"))
    identity = auth.identify(browser)
    assert identity is not None and "Basic" in str(forgery(identity, browser, None))
