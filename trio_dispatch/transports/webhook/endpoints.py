"""Webhook endpoints as configured: the URL, its signing secrets and
headers, each checked when parsed (errors name the key, never a secret)."""

from __future__ import annotations

import base64
import binascii
import dataclasses
import ipaddress
import re
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any, Final

from ...redact import (
    AMBIGUOUS_URL_ERROR,
    MASK,
    ambiguous_userinfo,
    looks_secret,
    register_secrets,
    url_secrets,
)
from ...values import show
from .signing import MAX_KEY_BYTES, MIN_KEY_BYTES, SECRET_PREFIX

if TYPE_CHECKING:
    pass

RESERVED_HEADERS: Final = frozenset(
    {
        "content-type",
        "content-length",
        "transfer-encoding",
        "host",
        "connection",
        "user-agent",
        "accept-encoding",
        "webhook-id",
        "webhook-timestamp",
        "webhook-signature",
    }
)
"""Headers an endpoint's ``headers`` may not set: the transport owns them."""
HOP_BY_HOP_HEADERS: Final = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-connection",
        "proxy-authorization",
        "proxy-authenticate",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
        "expect",
        "host",
        "content-length",
    }
)
"""Headers that describe one connection or the message framing (RFC 9110
7.6.1, 7.2, 8.6, 10.1.1), not the request: configured, they would break
the exchange (``Expect: 100-continue``, ``Upgrade``) or go to a proxy."""

_TOKEN: Final = re.compile(r"^[!#$%&'*+.^_`|~0-9A-Za-z-]+$")  # RFC 9110 field-name
CONTROL_CHARS: Final = re.compile(r"[\x00-\x1f\x7f-\x9f]")
_HEADER_VALUE: Final = re.compile(r"^[\x20-\x7e]*$")


@dataclasses.dataclass(frozen=True, repr=False)
class Secret:
    """One signing secret: its HMAC key and how to show it (``env:NAME`` or
    ``whsec_***``; never the value)."""

    key: bytes
    label: str

    def __repr__(self) -> str:
        return f"Secret({self.label})"

    @property
    def unread(self) -> bool:
        """An ``env:NAME`` secret a command that signs nothing left unread:
        it has no key, and a transport refuses it."""
        return not self.key

    @classmethod
    def parse(cls, name: str, value: object, environ: Mapping[str, str] | None) -> Secret:
        """A secret from ``whsec_<base64>`` (or bare base64), or ``env:NAME``
        read from ``environ`` now -- left :attr:`unread` when ``environ`` is
        None (:mod:`~trio_dispatch.envsecrets`). Errors name ``name`` and
        never the value."""
        if not isinstance(value, str) or not value:
            raise ValueError(f"{name} must be a whsec_... string or env:NAME, got {show(value)}")
        label = f"{SECRET_PREFIX}{MASK}"
        if value.startswith("env:"):
            variable = value[4:]
            if environ is None:
                return cls(b"", value)
            if variable not in environ:
                raise ValueError(f"{name}: environment variable {variable!r} is not set")
            label, value = value, environ[variable]
        encoded = value.removeprefix(SECRET_PREFIX)
        try:
            key = base64.b64decode(encoded, validate=True)
        except (binascii.Error, ValueError):
            raise ValueError(
                f"{name} ({label}) is not a whsec_ secret: the part after whsec_ must be base64"
            ) from None
        if not MIN_KEY_BYTES <= len(key) <= MAX_KEY_BYTES:
            raise ValueError(
                f"{name} ({label}) decodes to {len(key)} bytes; Standard Webhooks keys are "
                f"{MIN_KEY_BYTES} to {MAX_KEY_BYTES} bytes"
            )
        register_secrets([value, encoded])
        return cls(key, label)


def shown_url(url: str) -> str:
    """A webhook URL fit to print: credentials and query string masked, the
    host as it goes on the wire (an IDNA name in its ``xn--`` form)."""
    import httpx

    parsed = httpx.URL(url)
    userinfo = f"{MASK}@" if parsed.userinfo else ""
    port = f":{parsed.port}" if parsed.port is not None else ""
    query = f"?{MASK}" if parsed.query else ""
    raw_host = parsed.raw_host.decode("ascii")
    host = f"[{raw_host}]" if ":" in raw_host else raw_host
    return f"{parsed.scheme}://{userinfo}{host}{port}{parsed.path}{query}"


def wire_host(url: str) -> str:
    """The ``Host`` header of ``url``: its ASCII host (and port when not the
    scheme's default). Given explicitly, so httpx never decodes an IDNA name
    that the stricter IDNA 2008 tables refuse (``xn--ls8h.la``)."""
    import httpx

    return httpx.URL(url).netloc.decode("ascii")


@dataclasses.dataclass(frozen=True, repr=False)
class Endpoint:
    """Where one ``deliver_to`` value is posted, and how it is signed."""

    url: str
    secrets: tuple[Secret, ...]
    headers: tuple[tuple[str, str], ...] = ()
    allow_private: bool = False

    def __repr__(self) -> str:
        return (
            f"Endpoint(url={shown_url(self.url)!r}, secrets={list(self.secrets)!r}, "
            f"headers={[name for name, _ in self.headers]!r}, allow_private={self.allow_private})"
        )

    @property
    def has_credentials(self) -> bool:
        """Whether the URL carries a user name or password."""
        import httpx

        return bool(httpx.URL(self.url).userinfo)

    @property
    def origin(self) -> tuple[str, int]:
        """(host as the connection sees it, port)."""
        import httpx

        parsed = httpx.URL(self.url)
        port = parsed.port or (443 if parsed.scheme == "https" else 80)
        return parsed.raw_host.decode("ascii"), port

    def describe(self) -> dict[str, Any]:
        """What ``check-config`` shows: no secret, no credentials (a header
        that carries one is masked, an ordinary one shown)."""
        return {
            "url": shown_url(self.url),
            "secrets": [secret.label for secret in self.secrets],
            "headers": {
                name: MASK if secret_header(name, value) else value for name, value in self.headers
            },
            "allow_private": self.allow_private,
        }

    @classmethod
    def parse(cls, name: str, value: object, environ: Mapping[str, str] | None) -> Endpoint:
        """An endpoint from its configuration mapping; errors name the key."""
        import httpx

        if not isinstance(value, Mapping):
            raise ValueError(
                f"{name} must be a mapping (url, secrets, headers, allow_private), "
                f"got {show(value)}"
            )
        unknown = [
            str(key) for key in value if key not in ("url", "secrets", "headers", "allow_private")
        ]
        if unknown:
            raise ValueError(
                f"unknown key {show(name + '.' + unknown[0])} "
                "(allowed: url, secrets, headers, allow_private)"
            )
        url = value.get("url")
        if not isinstance(url, str) or not url:
            raise ValueError(f"{name}.url must be an http:// or https:// URL, got {show(url)}")
        if ambiguous_userinfo(url):  # not even masked: its host may be a piece of it
            register_secrets(url_secrets(url))
            raise ValueError(f"{name}.url: {AMBIGUOUS_URL_ERROR}")
        try:
            parsed = httpx.URL(url)
        except (httpx.InvalidURL, ValueError) as exc:  # idna's errors are ValueErrors too
            if isinstance(exc, UnicodeError) or "IDNA" in str(exc):
                raise ValueError(
                    f"{name}.url: the host is not a valid internationalised domain name "
                    "(give it in its xn-- form)"
                ) from None
            raise ValueError(f"{name}.url is not a valid URL") from None
        if parsed.scheme not in ("http", "https") or not parsed.raw_host:
            raise ValueError(
                f"{name}.url must be an http:// or https:// URL with a host, "
                f"got {show(shown_url(url) if parsed.raw_host else parsed.scheme + '://...')}"
            )
        if parsed.port is not None and not 1 <= parsed.port <= MAX_PORT:
            raise ValueError(f"{name}.url: port {parsed.port} is out of range (1 to {MAX_PORT})")
        problem = host_problem(parsed.raw_host)
        if problem is not None:
            raise ValueError(f"{name}.url: the host {problem}")
        if parsed.fragment:
            raise ValueError(f"{name}.url must not have a #fragment")
        # Credentials and query tokens in the URL are secrets too: scrubbed
        # from any log line that might quote the URL.
        register_secrets([*url_secrets(url), parsed.query.decode("ascii", "replace")])
        secrets = value.get("secrets")
        if not isinstance(secrets, list) or not secrets:
            raise ValueError(
                f"{name}.secrets must be a non-empty list of whsec_... values or env:NAME"
            )
        parsed_secrets = tuple(
            Secret.parse(f"{name}.secrets[{index}]", item, environ)
            for index, item in enumerate(secrets)
        )
        headers = value.get("headers") or {}
        if not isinstance(headers, Mapping):
            raise ValueError(f"{name}.headers must be a mapping of header names to strings")
        checked: list[tuple[str, str]] = []
        for header, text in headers.items():
            if not isinstance(header, str) or not _TOKEN.match(header):
                raise ValueError(f"{name}.headers: {show(header)} is not a valid header name")
            if header.lower() in RESERVED_HEADERS:
                raise ValueError(
                    f"{name}.headers.{header}: set by the transport itself, cannot be configured"
                )
            if header.lower() in HOP_BY_HOP_HEADERS:
                raise ValueError(
                    f"{name}.headers.{header}: a hop-by-hop header (it concerns one "
                    "connection, not the request), cannot be configured"
                )
            if not isinstance(text, str) or not _HEADER_VALUE.match(text) or text != text.strip():
                raise ValueError(
                    f"{name}.headers.{header} must be printable ASCII without leading or "
                    "trailing spaces"
                )
            checked.append((header, text))
        # Only credentials are secrets: an ordinary value ("X-Team: payments")
        # registered as one would be masked in every log line that holds it.
        register_secrets([text for header, text in checked if secret_header(header, text)])
        conflict = credentials_conflict(url, checked)
        if conflict is not None:
            raise ValueError(f"{name}: {conflict}")
        allow_private = value.get("allow_private", False)
        if not isinstance(allow_private, bool):
            raise ValueError(
                f"{name}.allow_private must be true or false, got {show(allow_private)}"
            )
        return cls(url, parsed_secrets, tuple(checked), allow_private)


_CREDENTIAL_HEADERS: Final = frozenset({"authorization", "cookie", "proxy-authorization"})
_CREDENTIAL_SCHEME: Final = re.compile(r"^(Bearer|Basic|Token|Digest|Bot)\s", re.IGNORECASE)


def secret_header(name: str, value: str) -> bool:
    """Whether a configured header carries a credential: ``Authorization``
    or ``Cookie``, a name that says so (``X-Api-Key``, ``X-Auth-Token``,
    ``X-Signature``...), or a value in an authorization scheme
    (``Bearer ...``)."""
    lowered = name.lower()
    return (
        lowered in _CREDENTIAL_HEADERS
        or "signature" in lowered
        or looks_secret(name.upper().replace("-", "_"), value)
        or _CREDENTIAL_SCHEME.match(value) is not None
    )


MAX_PORT: Final = 65535
_LABEL: Final = re.compile(r"^[A-Za-z0-9_](?:[A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?$")


def host_problem(raw_host: bytes) -> str | None:
    """What is wrong with a URL's host as it goes on the wire, or None. An
    IP address passes; a name must be dot-separated labels of letters,
    digits, ``-`` and ``_`` (at most 63 characters each, 253 in all). An
    ``xn--`` label is checked as Punycode only: UTS 46 names that IDNA 2008
    refuses (``xn--ls8h.la``) resolve, so they are accepted. The message
    never quotes the host."""
    host = raw_host.decode("ascii", "replace").rstrip(".")
    try:
        ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        pass
    else:
        return None
    if not host or len(host) > 253:
        return "is not a valid domain name (empty or longer than 253 characters)"
    for index, label in enumerate(host.split("."), 1):
        if not _LABEL.match(label):
            return f"is not a valid domain name (label {index} is empty or not letters, digits, -)"
        if label[:4].lower() == "xn--":
            try:
                label[4:].encode("ascii").decode("punycode")
            except UnicodeError:
                return f"is not a valid internationalised domain name (label {index})"
    return None


def credentials_conflict(url: str, headers: Iterable[tuple[str, str]]) -> str | None:
    """Why ``url`` and ``headers`` cannot go together, or None: httpx turns
    credentials in a URL (``user:password@``) into a Basic ``Authorization``
    header that silently replaces the configured one."""
    import httpx

    if not httpx.URL(url).userinfo:
        return None
    if any(header.lower() == "authorization" for header, _ in headers):
        return (
            "url has credentials (user:password@) and headers sets Authorization: the URL's "
            "Basic credentials would replace the header; keep one of them"
        )
    return None


def parse_endpoints(
    name: str, value: object, environ: Mapping[str, str] | None
) -> dict[str, Endpoint]:
    """The ``endpoints`` mapping (``deliver_to`` value -> endpoint); two
    endpoints on one host and port must agree on ``allow_private``."""
    if not isinstance(value, Mapping) or not value:
        raise ValueError(
            f"{name} must map each deliver_to value to an endpoint (url, secrets, ...), "
            f"got {show(value)}"
        )
    endpoints: dict[str, Endpoint] = {}
    for route, spec in value.items():
        if not isinstance(route, str) or not route:
            raise ValueError(f"{name}: {show(route)} is not a deliver_to value")
        endpoints[route] = Endpoint.parse(f"{name}.{route}", spec, environ)
    check_origins(endpoints, name)
    return endpoints


def check_origins(endpoints: Mapping[str, Endpoint], name: str = "endpoints") -> None:
    """Refuse two endpoints on one host and port that disagree on
    ``allow_private`` (connections are shared per host and port)."""
    seen: dict[tuple[str, int], tuple[str, bool]] = {}
    for route, endpoint in endpoints.items():
        origin = endpoint.origin
        if origin in seen and seen[origin][1] != endpoint.allow_private:
            raise ValueError(
                f"{name}.{seen[origin][0]} and {name}.{route} share {origin[0]}:{origin[1]} "
                "but not allow_private: give both the same value"
            )
        seen.setdefault(origin, (route, endpoint.allow_private))


# -- signing ----------------------------------------------------------------------
