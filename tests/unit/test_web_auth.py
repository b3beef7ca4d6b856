"""Roles, sessions and forgery checks of the dashboard (docs/dashboard.md), without a
server: what each credential proves."""

from __future__ import annotations

import base64

import pytest

from trio_dispatch.web.auth import SESSION_COOKIE, SESSION_SECONDS, Auth, Role, forgery
from trio_dispatch.web.throttle import (
    LOGIN_FAILURES,
    LOGIN_WINDOW_SECONDS,
    MAX_CLIENTS,
    LoginThrottle,
    client_key,
)

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


@pytest.mark.parametrize(
    "address, key",
    [
        ("203.0.113.7", "203.0.113.7"),
        ("2001:db8:1:2:3:4:5:6", "2001:db8:1:2::/64"),
        ("2001:db8:1:2:ffff::1", "2001:db8:1:2::/64"),
        ("fe80::1%eth0", "fe80::/64"),
        ("::ffff:203.0.113.7", "203.0.113.7"),
        ("unknown", "unknown"),
    ],
)
def test_a_client_is_its_address_or_its_ipv6_64(address: str, key: str) -> None:
    assert client_key(address) == key


def test_one_ipv6_host_cannot_dodge_the_throttle_by_changing_its_address() -> None:
    throttle = LoginThrottle(Clock())
    for n in range(LOGIN_FAILURES):
        throttle.failed(f"2001:db8:1:2::{n + 1:x}")
    assert throttle.retry_after("2001:db8:1:2::beef") == int(LOGIN_WINDOW_SECONDS)
    assert throttle.retry_after("2001:db8:1:3::1") is None


def test_the_throttle_keeps_at_most_max_clients_bursts() -> None:
    clock = Clock()
    throttle = LoginThrottle(clock)
    for n in range(MAX_CLIENTS + 500):
        assert throttle.failed(f"10.{n >> 16 & 255}.{n >> 8 & 255}.{n & 255}")
        clock.now += 0.001
    assert len(throttle) == MAX_CLIENTS
    # The newest bursts are kept; the oldest made room.
    newest = MAX_CLIENTS + 499
    for _ in range(LOGIN_FAILURES - 1):
        throttle.failed(f"10.{newest >> 16 & 255}.{newest >> 8 & 255}.{newest & 255}")
    assert throttle.retry_after(f"10.{newest >> 16 & 255}.{newest >> 8 & 255}.{newest & 255}")
    # Ended bursts go first when room is needed.
    clock.now += LOGIN_WINDOW_SECONDS
    assert throttle.failed("192.0.2.1")
    assert len(throttle) == 1
