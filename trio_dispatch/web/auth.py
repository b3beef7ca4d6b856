"""Who a dashboard request comes from, and what it may do (docs/dashboard.md).

Two roles: ``viewer`` (reads everything the read-only view shows) and
``operator`` (may also act). ``http.token`` is the viewer's token,
``http.operator_token`` the operator's; without a viewer token (loopback
only) anyone is a viewer. A request proves a role with
``Authorization: Bearer <token>`` (scripts), HTTP Basic with the token as
the password (a browser's prompt, reading only), or the session cookie the
login form sets (browsers). Tokens are compared in constant time.

Sessions live in this process's memory: ``HttpOnly``, ``SameSite=Strict``,
``Secure`` over TLS, :data:`SESSION_SECONDS` long, at most
:data:`MAX_SESSIONS` per role. A POST under a session
must carry the session's CSRF token (a form field) and an ``Origin`` equal
to the server's own; a bearer POST needs neither (no browser sends a bearer
token by itself); a Basic POST is refused (a browser would resend it from
any site's form).
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import enum
import hmac
import secrets
from collections.abc import Callable, Iterable, Mapping
from typing import Final

SESSION_COOKIE: Final = "trio_dispatch_session"
SESSION_SECONDS: Final = 8 * 3600.0
MAX_SESSIONS: Final = 1024
"""Sessions kept at once per role; when a login needs room, the oldest
session of its own role goes, so a viewer's logins never end an operator's
session."""


class Role(enum.IntEnum):
    """What a request may do; a higher role may do what a lower one may."""

    VIEWER = 1
    OPERATOR = 2

    def __str__(self) -> str:
        return self.name.lower()


@dataclasses.dataclass
class Session:
    """A browser's login."""

    id: str
    role: Role
    csrf: str
    expires_at: float
    notice: str | None = None
    """What the session's last action did, shown once by the next page it
    gets (POST, redirect, GET)."""


@dataclasses.dataclass(frozen=True)
class Identity:
    """A request's proven role and how it was proven."""

    role: Role
    via: str
    """``anonymous``, ``bearer``, ``basic`` or ``cookie``."""
    session: Session | None = None


def _headers(scope: Mapping[str, object]) -> Iterable[tuple[bytes, bytes]]:
    found = scope.get("headers", ())
    return found if isinstance(found, list | tuple) else ()


def header(scope: Mapping[str, object], name: bytes) -> bytes | None:
    """The first value of header ``name`` (lower case), or None."""
    for key, value in _headers(scope):
        if key.lower() == name:
            return bytes(value)
    return None


def cookie(scope: Mapping[str, object], name: str) -> str | None:
    """The value of cookie ``name``, or None."""
    for key, value in _headers(scope):
        if key.lower() != b"cookie":
            continue
        for part in value.decode("latin-1").split(";"):
            found, _, text = part.strip().partition("=")
            if found == name:
                return text
    return None


class Auth:
    """The tokens and the live sessions of one dashboard."""

    def __init__(
        self,
        viewer_token: str | None,
        operator_token: str | None,
        clock: Callable[[], float],
    ) -> None:
        self._tokens = [
            (token.encode(), role)
            for token, role in ((operator_token, Role.OPERATOR), (viewer_token, Role.VIEWER))
            if token is not None
        ]
        self.open_to_viewers = viewer_token is None
        self.actions = operator_token is not None
        """Whether anyone may act: only with an operator token."""
        self.clock = clock
        self._sessions: dict[str, Session] = {}

    def _role_of(self, presented: bytes) -> Role | None:
        role = None
        for token, candidate in self._tokens:
            # Every token is compared, so the time taken says nothing of which matched.
            if hmac.compare_digest(presented, token) and role is None:
                role = candidate
        return role

    def identify(self, scope: Mapping[str, object]) -> Identity | None:
        """The request's identity, or None: a credential was required (or
        given) and it proves no role (answer 401)."""
        authorization = header(scope, b"authorization")
        if authorization is not None:
            kind, _, credential = authorization.strip().partition(b" ")
            if kind.lower() == b"bearer":
                role = self._role_of(credential.strip())
                return None if role is None else Identity(role, "bearer")
            if kind.lower() == b"basic":
                try:
                    decoded = base64.b64decode(credential.strip(), validate=True)
                except (binascii.Error, ValueError):
                    return None
                role = self._role_of(decoded.partition(b":")[2])
                return None if role is None else Identity(role, "basic")
            return None
        session = self.session(cookie(scope, SESSION_COOKIE))
        if session is not None:
            return Identity(session.role, "cookie", session)
        return Identity(Role.VIEWER, "anonymous") if self.open_to_viewers else None

    def session(self, session_id: str | None) -> Session | None:
        """The live session of that id, or None."""
        if not session_id:
            return None
        found = self._sessions.get(session_id)
        if found is None or found.expires_at <= self.clock():
            self._sessions.pop(session_id, None)
            return None
        return found

    def login(self, token: str) -> Session | None:
        """A new session for the role ``token`` proves, or None. With
        :data:`MAX_SESSIONS` of that role live, the oldest of them ends."""
        role = self._role_of(token.encode())
        if role is None:
            return None
        now = self.clock()
        for key in [key for key, s in self._sessions.items() if s.expires_at <= now]:
            del self._sessions[key]
        same_role = [key for key, s in self._sessions.items() if s.role == role]
        for key in same_role[: max(0, len(same_role) - MAX_SESSIONS + 1)]:  # oldest first
            del self._sessions[key]
        session = Session(
            secrets.token_urlsafe(32), role, secrets.token_urlsafe(32), now + SESSION_SECONDS
        )
        self._sessions[session.id] = session
        return session

    def logout(self, session: Session) -> None:
        """End a session."""
        self._sessions.pop(session.id, None)

    @staticmethod
    def set_cookie(session: Session | None, secure: bool) -> bytes:
        """The ``Set-Cookie`` value that starts ``session`` (None: ends it)."""
        value, age = (session.id, int(SESSION_SECONDS)) if session else ("", 0)
        text = f"{SESSION_COOKIE}={value}; Path=/; HttpOnly; SameSite=Strict; Max-Age={age}"
        return (text + ("; Secure" if secure else "")).encode()


def own_origin(scope: Mapping[str, object]) -> str | None:
    """``scheme://host[:port]`` as the client addressed this server."""
    host = header(scope, b"host")
    if not host:
        return None
    scheme = scope.get("scheme", "http")
    return f"{scheme}://{host.decode('latin-1').strip().lower()}"


def same_origin(scope: Mapping[str, object]) -> bool:
    """Whether the request's ``Origin`` is this server as the client
    addressed it (a request without one is not)."""
    origin, expected = header(scope, b"origin"), own_origin(scope)
    return (
        origin is not None and expected is not None and origin.decode("latin-1").lower() == expected
    )


def forgery(identity: Identity, scope: Mapping[str, object], form_csrf: str | None) -> str | None:
    """Why a POST must be refused as a possible cross-site forgery, or None."""
    if identity.via == "bearer":
        return None
    if identity.via == "basic":
        return "a browser's Basic login cannot act: log in with the form (/login)"
    if identity.session is None:
        return "log in first (/login)"
    if not same_origin(scope):
        return "the request's Origin is not this dashboard"
    if form_csrf is None or not hmac.compare_digest(
        form_csrf.encode(), identity.session.csrf.encode()
    ):
        return "the form's CSRF token is missing or wrong: reload the page"
    return None
