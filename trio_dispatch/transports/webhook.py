"""WebhookTransport: each attempt an HTTP POST signed per the Standard
Webhooks specification (SPEC section 10). Needs the ``http`` extra (httpx).

- The body is the stored payload, byte for byte. ``webhook-id`` is the
  dispatch id (the same on every attempt: the receiver's idempotency key),
  ``webhook-timestamp`` this attempt's Unix time, and ``webhook-signature``
  one ``v1,<base64 HMAC-SHA256 of "{id}.{timestamp}.{body}">`` per secret,
  space-separated, so a receiver can rotate secrets.
- The status line decides: 2xx succeeds, even when its body drips past
  the timeout (reading stops there; the outcome stands). 410 is "gone":
  dead-lettered with ``dispatch.dead_letter.gone``. 429, 502, 503 and 504
  fail with the response's ``Retry-After`` (seconds or an HTTP date) as the
  earliest next attempt. Any other status, a redirect (never followed), a
  refused or failed connection, a DNS or TLS failure or no status line
  within the timeout (one deadline for the whole exchange) fails the
  attempt with a short ``last_error`` that never holds the URL (it may
  carry credentials) or a secret. At most 64 KiB of a response body is
  read, and never past the deadline.
- Before connecting, every address the host resolves to is checked: a
  loopback, private, link-local, multicast or unspecified address is
  refused (a recorded failure naming the reason) unless the endpoint sets
  ``allow_private``. The connection then goes to the address that was
  checked, so a second resolution cannot swap it. TLS is verified.
- One :class:`httpx.AsyncClient` (HTTP/1.1 keep-alive) serves every attempt
  while the transport is :meth:`~WebhookTransport.opened` -- the worker
  keeps it open for its whole run; environment proxies are not used.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import dataclasses
import email.utils
import hashlib
import hmac
import importlib.metadata
import ipaddress
import math
import re
import socket
import ssl
import time
from collections.abc import AsyncIterator, Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any, Final

import anyio
import sniffio

from ..redact import (
    AMBIGUOUS_URL_ERROR,
    MASK,
    ambiguous_userinfo,
    known_secrets,
    register_secrets,
    scrub,
    url_secrets,
)
from ..values import show
from .base import Delivery, TransportResult, check_timeout

if TYPE_CHECKING:
    import httpx

DEFAULT_WEBHOOK_TIMEOUT_SECONDS: Final = 15.0
RESPONSE_READ_LIMIT: Final = 64 * 1024
"""Bytes of a response body read at most."""
ERROR_BODY_CHARS: Final = 500
"""Characters of a response body kept in ``last_error``."""
REAP_SECONDS: Final = 1.0
"""How often the client's pool looks for idle connections the server closed."""
RETRY_AFTER_STATUSES: Final = frozenset({429, 502, 503, 504})
SECRET_PREFIX: Final = "whsec_"  # noqa: S105 - the format's prefix, not a secret
MIN_KEY_BYTES: Final = 24
MAX_KEY_BYTES: Final = 64
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
_CONTROL: Final = re.compile(r"[\x00-\x1f\x7f-\x9f]")
_HEADER_VALUE: Final = re.compile(r"^[\x20-\x7e]*$")


def _version() -> str:
    try:
        return importlib.metadata.version("trio_dispatch")
    except importlib.metadata.PackageNotFoundError:  # pragma: no cover - a source checkout
        return "0"


USER_AGENT: Final = f"trio-dispatch/{_version()}"


class AddressRefused(Exception):
    """A webhook host resolved to an address the endpoint may not reach."""


class ResolutionFailed(Exception):
    """A webhook host did not resolve."""


# -- configuration ----------------------------------------------------------------


@dataclasses.dataclass(frozen=True, repr=False)
class Secret:
    """One signing secret: its HMAC key and how to show it (``env:NAME`` or
    ``whsec_***``; never the value)."""

    key: bytes
    label: str

    def __repr__(self) -> str:
        return f"Secret({self.label})"

    @classmethod
    def parse(cls, name: str, value: object, environ: Mapping[str, str]) -> Secret:
        """A secret from ``whsec_<base64>`` (or bare base64), or ``env:NAME``
        read from ``environ`` now. Errors name ``name`` and never the value."""
        if not isinstance(value, str) or not value:
            raise ValueError(f"{name} must be a whsec_... string or env:NAME, got {show(value)}")
        label = f"{SECRET_PREFIX}{MASK}"
        if value.startswith("env:"):
            variable = value[4:]
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
    def parse(cls, name: str, value: object, environ: Mapping[str, str]) -> Endpoint:
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
    from .command import looks_secret

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


def parse_endpoints(name: str, value: object, environ: Mapping[str, str]) -> dict[str, Endpoint]:
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


def sign(keys: Iterable[bytes], webhook_id: str, timestamp: int, body: bytes) -> str:
    """The ``webhook-signature`` header: ``v1,<base64 HMAC-SHA256>`` of
    ``"{id}.{timestamp}.{body}"`` for each key, space-separated."""
    message = f"{webhook_id}.{timestamp}.".encode() + body
    return " ".join(
        "v1," + base64.b64encode(hmac.new(key, message, hashlib.sha256).digest()).decode()
        for key in keys
    )


def parse_retry_after(value: str | None, now: float) -> float | None:
    """Seconds to wait from a ``Retry-After`` value: delta-seconds or an
    HTTP date (a past date is 0); None if absent or unreadable."""
    if value is None:
        return None
    text = value.strip()
    if re.fullmatch(r"[0-9]{1,10}", text):
        return float(int(text))
    if len(text) > 64:  # no HTTP date is this long
        return None
    try:
        when = email.utils.parsedate_to_datetime(text)
    except (TypeError, ValueError, IndexError, OverflowError):
        return None
    if when.tzinfo is None:  # HTTP dates are GMT
        return None
    wait = when.timestamp() - now
    return max(0.0, wait) if math.isfinite(wait) else None


# -- the address guard --------------------------------------------------------------


def forbidden(address: str) -> str | None:
    """Why an endpoint without ``allow_private`` may not connect to
    ``address``, or None: anything that is not a public unicast address
    (loopback, private, link-local, multicast, unspecified, shared/CGNAT,
    reserved...), IPv4 carried inside IPv6 (mapped, 6to4, Teredo) judged by
    the IPv4 it carries."""
    ip: ipaddress.IPv4Address | ipaddress.IPv6Address = ipaddress.ip_address(
        address.split("%", 1)[0]
    )
    if isinstance(ip, ipaddress.IPv6Address):
        inner = ip.ipv4_mapped or ip.sixtofour or (ip.teredo[1] if ip.teredo else None)
        if inner is not None:
            why = forbidden(str(inner))
            return None if why is None else f"{why} (inside {ip})"
    for kind in ("loopback", "link_local", "multicast", "unspecified", "private", "reserved"):
        if getattr(ip, f"is_{kind}"):
            return kind.replace("_", "-")
    if isinstance(ip, ipaddress.IPv6Address) and ip.is_site_local:
        return "site-local"
    if not ip.is_global:
        return "non-public"
    return None


QUIET_HOST: Final = "the endpoint's host"
"""How an error names the host of a URL that carries credentials."""


def _guarded_backend(
    private_ok: frozenset[tuple[str, int]], quiet: frozenset[tuple[str, int]] = frozenset()
) -> Any:
    import httpcore

    class GuardedBackend(httpcore.AsyncNetworkBackend):
        """Resolves the host itself, refuses forbidden addresses, then
        connects to the address it checked."""

        def _inner(self) -> httpcore.AsyncNetworkBackend:
            if sniffio.current_async_library() == "trio":
                return httpcore.TrioBackend()
            return httpcore.AnyIOBackend()

        async def connect_tcp(
            self,
            host: str,
            port: int,
            timeout: float | None = None,  # noqa: ASYNC109 - httpcore's interface
            local_address: str | None = None,
            socket_options: Iterable[Any] | None = None,
        ) -> httpcore.AsyncNetworkStream:
            # The host of a URL with credentials is not echoed: should the
            # URL have been misread, it would be a piece of the password.
            named = QUIET_HOST if (host, port) in quiet else host
            try:
                with anyio.fail_after(timeout):
                    infos = await anyio.getaddrinfo(host, port, type=socket.SOCK_STREAM)
            except socket.gaierror as exc:
                raise ResolutionFailed(
                    f"DNS failure: {named} does not resolve ({exc.strerror})"
                ) from None
            except TimeoutError:
                raise ResolutionFailed(f"DNS failure: resolving {named} timed out") from None
            addresses = list(dict.fromkeys(str(info[4][0]) for info in infos))
            if (host, port) not in private_ok:
                for address in addresses:
                    why = forbidden(address)
                    if why is not None:
                        where = named if host == address else f"{named} resolves to {address}"
                        raise AddressRefused(
                            f"refused: {where}, a {why} address (allow_private is not set)"
                        )
            failure: Exception | None = None
            for address in addresses:
                try:
                    stream: httpcore.AsyncNetworkStream = await self._inner().connect_tcp(
                        address,
                        port,
                        timeout=timeout,
                        local_address=local_address,
                        socket_options=socket_options,
                    )
                    return stream
                except (httpcore.ConnectError, httpcore.ConnectTimeout) as exc:
                    failure = exc
            assert failure is not None
            raise failure

        async def connect_unix_socket(
            self,
            path: str,
            timeout: float | None = None,  # noqa: ASYNC109 - httpcore's interface
            socket_options: Iterable[Any] | None = None,
        ) -> httpcore.AsyncNetworkStream:
            raise AddressRefused("refused: unix sockets are not webhook destinations")

        async def sleep(self, seconds: float) -> None:
            await anyio.sleep(seconds)

    return GuardedBackend()


def tls_context(verify: ssl.SSLContext | str | bool = True) -> ssl.SSLContext:
    """The TLS context: the system's CAs (``True``), the CAs of a PEM file,
    or the caller's own context. Verification is never off."""
    import httpx

    if isinstance(verify, ssl.SSLContext):
        return verify
    if verify is True:
        return httpx.create_ssl_context(trust_env=False)
    if isinstance(verify, str):
        try:
            return ssl.create_default_context(cafile=verify)
        except (OSError, ssl.SSLError) as exc:
            reason = getattr(exc, "strerror", None) or getattr(exc, "reason", None) or exc
            raise ValueError(f"CA file {verify!r} cannot be used: {reason}") from None
    raise ValueError(
        f"verify must be True, a CA file path or an ssl.SSLContext, got {show(verify)}"
    )


def _linear_pool_class() -> type[Any]:
    import httpcore

    class LinearPool(httpcore.AsyncConnectionPool):
        """httpcore's pool with its bookkeeping made linear. The stock
        version re-scans every connection for each connection (and polls
        each idle socket) whenever a request starts or ends: with 64
        connections that is milliseconds of CPU per request, the whole
        budget of a local webhook. Here each pass touches each connection
        once, and only the connection about to be reused is checked for
        expiry (an expired one is closed and the next taken)."""

        _reaped_at = 0.0

        def _assign_requests_to_connections(self) -> list[Any]:
            closing: list[Any] = []
            kept = [c for c in self._connections if not c.is_closed()]
            now = time.monotonic()
            if now - self._reaped_at >= REAP_SECONDS:  # idle sockets the server closed
                self._reaped_at = now
                for connection in [c for c in kept if c.is_idle() and c.has_expired()]:
                    kept.remove(connection)
                    closing.append(connection)
            surplus = len(kept) - self._max_keepalive_connections
            if surplus > 0:
                for connection in [c for c in kept if c.is_idle()][:surplus]:
                    kept.remove(connection)
                    closing.append(connection)
            self._connections = kept
            queued = [request for request in self._requests if request.is_queued()]
            if not queued:
                return closing
            available = [c for c in kept if c.is_available()]
            for request in queued:
                origin = request.request.url.origin
                chosen = None
                elsewhere: list[Any] = []  # another origin's: kept for its requests
                while available:
                    candidate = available.pop()
                    if not candidate.can_handle_request(origin):
                        elsewhere.append(candidate)
                        continue
                    if candidate.has_expired():
                        self._connections.remove(candidate)
                        closing.append(candidate)
                        continue
                    chosen = candidate
                    break
                available.extend(elsewhere)
                if chosen is None:
                    if len(self._connections) >= self._max_connections:
                        idle = next((c for c in self._connections if c.is_idle()), None)
                        if idle is None:
                            continue  # stays queued until a connection frees
                        self._connections.remove(idle)
                        closing.append(idle)
                    chosen = self.create_connection(origin)
                    self._connections.append(chosen)
                request.assign_to_connection(chosen)
            return closing

    return LinearPool


def make_client(
    *,
    timeout: float,
    verify: ssl.SSLContext | str | bool = True,
    private_ok: frozenset[tuple[str, int]] = frozenset(),
    max_connections: int | None = None,
    quiet: frozenset[tuple[str, int]] = frozenset(),
) -> httpx.AsyncClient:
    """The client a :class:`WebhookTransport` posts with: HTTP/1.1
    keep-alive, no redirects, no proxies from the environment, TLS
    verified, every connection through the address guard."""
    import httpx

    context = tls_context(verify)
    limits = httpx.Limits(
        max_connections=max_connections, max_keepalive_connections=max_connections or 256
    )
    transport = httpx.AsyncHTTPTransport(verify=context, limits=limits, trust_env=False)
    transport._pool = _linear_pool_class()(  # the same pool, guarded and linear
        ssl_context=context,
        max_connections=limits.max_connections,
        max_keepalive_connections=limits.max_keepalive_connections,
        keepalive_expiry=limits.keepalive_expiry,
        http1=True,
        http2=False,
        network_backend=_guarded_backend(private_ok, quiet),
    )
    return httpx.AsyncClient(
        transport=transport,
        # The transport's own deadline bounds the whole exchange; httpx's
        # per-step timeouts stay behind it as a backstop.
        timeout=httpx.Timeout(timeout * 2),
        follow_redirects=False,
        trust_env=False,
        headers={"user-agent": USER_AGENT},
    )


# -- the transport ------------------------------------------------------------------


def _body_text(data: bytes) -> str:
    text = data.decode("utf-8", errors="replace")[:ERROR_BODY_CHARS]
    return " ".join(_CONTROL.sub(" ", text).split())


def _root_causes(exc: BaseException) -> Iterable[BaseException]:
    """``exc`` and what it came from: causes, contexts, and the members of
    exception groups (trio reports each address it tried in one)."""
    seen: set[int] = set()
    pending: list[BaseException] = [exc]
    while pending:
        current = pending.pop(0)
        if id(current) in seen:
            continue
        seen.add(id(current))
        yield current
        if isinstance(current, BaseExceptionGroup):
            pending.extend(current.exceptions)
        pending.extend(e for e in (current.__cause__, current.__context__) if e is not None)


def describe_http_error(exc: BaseException, timeout: float) -> str:
    """The error kind of a failed exchange, without URL or secrets."""
    import httpx

    for cause in _root_causes(exc):
        if isinstance(cause, AddressRefused | ResolutionFailed):
            return str(cause)
    if isinstance(exc, httpx.TimeoutException):
        phase = type(exc).__name__.removesuffix("Timeout").lower() or "request"
        return f"timeout after {timeout:g}s ({phase})"
    for cause in _root_causes(exc):
        if isinstance(cause, ssl.SSLCertVerificationError):
            return f"TLS failure: {cause.verify_message or 'certificate verify failed'}"
        if isinstance(cause, ssl.SSLError):
            return f"TLS failure: {cause.reason or type(cause).__name__}"
        if isinstance(cause, ConnectionRefusedError):
            return "connection refused"
    text = " ".join(str(exc).split())
    if isinstance(exc, httpx.ConnectError):
        if "refused" in text.lower():
            return "connection refused"
        return f"connection failed: {text or type(exc).__name__}"
    if isinstance(exc, httpx.RemoteProtocolError):
        return f"protocol error: {text or 'the server broke HTTP/1.1'}"
    if isinstance(exc, httpx.ReadError | httpx.WriteError):
        return f"connection lost: {text or type(exc).__name__}"
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


class WebhookTransport:
    """Deliver each dispatch as a signed HTTP POST to the endpoint its
    ``deliver_to`` names (see the module docstring). ``endpoints`` maps
    ``deliver_to`` values to :class:`Endpoint`; ``timeout`` bounds each
    whole exchange; ``verify`` is ``True`` (the system's CAs), a CA file
    path, or an :class:`ssl.SSLContext`."""

    def __init__(
        self,
        endpoints: Mapping[str, Endpoint],
        *,
        timeout: float = DEFAULT_WEBHOOK_TIMEOUT_SECONDS,
        verify: ssl.SSLContext | str | bool = True,
        clock: Callable[[], float] = time.time,
        max_connections: int | None = None,
    ) -> None:
        try:
            import httpx  # noqa: F401
        except ImportError:
            raise ImportError(
                "the webhook transport needs httpx: install trio_dispatch[http]"
            ) from None
        if verify is False:
            raise ValueError("verify=False is not supported: TLS is always verified")
        verify = tls_context(verify)  # a bad CA file fails here, not at the first send
        for route, endpoint in endpoints.items():
            if not isinstance(endpoint, Endpoint):
                raise TypeError(f"endpoints[{route!r}] must be an Endpoint, got {show(endpoint)}")
            if ambiguous_userinfo(endpoint.url):
                raise ValueError(f"endpoints[{route!r}].url: {AMBIGUOUS_URL_ERROR}")
            conflict = credentials_conflict(endpoint.url, endpoint.headers)
            if conflict is not None:
                raise ValueError(f"endpoints[{route!r}]: {conflict}")
        check_origins(endpoints)
        self.endpoints = dict(endpoints)
        self.timeout = check_timeout("timeout", timeout, allow_zero=False)
        self._verify = verify
        self._clock = clock
        self._max_connections = max_connections
        self._private_ok = frozenset(
            endpoint.origin for endpoint in self.endpoints.values() if endpoint.allow_private
        )
        self._quiet = frozenset(
            endpoint.origin for endpoint in self.endpoints.values() if endpoint.has_credentials
        )
        self._client: httpx.AsyncClient | None = None
        self._users = 0

    def __repr__(self) -> str:
        return f"WebhookTransport(endpoints={sorted(self.endpoints)!r}, timeout={self.timeout:g})"

    def _new_client(self) -> httpx.AsyncClient:
        return make_client(
            timeout=self.timeout,
            verify=self._verify,
            private_ok=self._private_ok,
            max_connections=self._max_connections,
            quiet=self._quiet,
        )

    @contextlib.asynccontextmanager
    async def opened(self) -> AsyncIterator[WebhookTransport]:
        """Keep one client (and its connections) for the block; nested or
        concurrent blocks share it, the last one out closes it."""
        if self._client is None:
            self._client = self._new_client()
        self._users += 1
        try:
            yield self
        finally:
            self._users -= 1
            if self._users == 0:
                client, self._client = self._client, None
                with anyio.CancelScope(shield=True):
                    await client.aclose()

    async def __call__(self, delivery: Delivery) -> TransportResult:
        endpoint = self.endpoints.get(delivery.deliver_to)
        if endpoint is None:
            return TransportResult.failure(
                f"no webhook endpoint for deliver_to {show(delivery.deliver_to)} "
                f"(configured: {', '.join(sorted(self.endpoints)) or 'none'})"
            )
        async with self.opened():  # outside one: a client for this call alone
            return await self._post(endpoint, delivery)

    def request_headers(
        self, endpoint: Endpoint, delivery: Delivery, body: bytes
    ) -> dict[str, str]:
        """The headers of one attempt (signed now)."""
        timestamp = int(self._clock())
        return {
            **dict(endpoint.headers),
            "host": wire_host(endpoint.url),
            "content-type": "application/json",
            "accept-encoding": "identity",
            "webhook-id": delivery.dispatch_id,
            "webhook-timestamp": str(timestamp),
            "webhook-signature": sign(
                (secret.key for secret in endpoint.secrets), delivery.dispatch_id, timestamp, body
            ),
        }

    async def _post(self, endpoint: Endpoint, delivery: Delivery) -> TransportResult:
        import httpx

        client = self._client
        assert client is not None
        body = delivery.payload.encode()
        headers = self.request_headers(endpoint, delivery, body)
        status: int | None = None
        received = b""
        retry_after_header: str | None = None
        encoded = False
        with anyio.move_on_after(self.timeout) as deadline:
            try:
                async with client.stream(
                    "POST", endpoint.url, content=body, headers=headers
                ) as response:
                    status = response.status_code
                    retry_after_header = response.headers.get("retry-after")
                    # A body the server compressed anyway is not text to keep.
                    encoded = response.headers.get("content-encoding", "identity") != "identity"
                    async for chunk in response.aiter_raw():
                        received += chunk
                        if len(received) >= RESPONSE_READ_LIMIT:
                            received = received[:RESPONSE_READ_LIMIT]
                            break
            except (httpx.HTTPError, AddressRefused, ResolutionFailed, OSError) as exc:
                if status is None:
                    return TransportResult.failure(
                        self._scrub(describe_http_error(exc, self.timeout), endpoint)
                    )
                # The status line arrived; the body broke off: judge by the status.
        if status is None:  # no status line before the deadline
            return TransportResult.failure(
                f"timeout after {self.timeout:g}s (waiting for a response)"
            )
        # The status line decides (Standard Webhooks: a 2xx is a delivery);
        # the body is read only to keep the connection, and a body that
        # drips past the deadline is cut without changing the outcome.
        cut = deadline.cancelled_caught
        if 200 <= status < 300:
            return TransportResult.success(
                f"HTTP {status}, body cut at the {self.timeout:g}s timeout" if cut else None
            )
        text = "" if encoded else self._scrub_body(_body_text(received), endpoint)
        detail = f"HTTP {status}: {text}" if text else f"HTTP {status}"
        if status == 410:
            return TransportResult.failure(detail, gone=True)
        if status in RETRY_AFTER_STATUSES:
            wait = parse_retry_after(retry_after_header, self._clock())
            return TransportResult.failure(detail, retry_after=wait)
        return TransportResult.failure(detail)

    @staticmethod
    def _scrub_body(text: str, endpoint: Endpoint) -> str:
        """A response body goes into ``last_error`` (the database, ``ls``,
        the dashboard): a receiver that echoes the request must not put the
        endpoint's credentials there."""
        secrets = [
            *known_secrets(),
            *url_secrets(endpoint.url),
            *(text for header, text in endpoint.headers if secret_header(header, text)),
            *(base64.b64encode(secret.key).decode("ascii") for secret in endpoint.secrets),
        ]
        return scrub(text, secrets)

    @staticmethod
    def _scrub(text: str, endpoint: Endpoint) -> str:
        text = text.replace(endpoint.url, shown_url(endpoint.url))
        host = endpoint.origin[0]
        if endpoint.has_credentials and len(host) >= 4:
            text = text.replace(host, QUIET_HOST)
        return text
