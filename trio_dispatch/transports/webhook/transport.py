"""WebhookTransport: each attempt an HTTP POST signed per the Standard
Webhooks specification (docs/webhooks.md). Needs the ``http`` extra (httpx).

- The body is the stored payload, byte for byte. ``webhook-id`` is the
  dispatch id (the same on every attempt: the receiver's idempotency key),
  ``webhook-timestamp`` this attempt's Unix time, and ``webhook-signature``
  one ``v1,<base64 HMAC-SHA256 of "{id}.{timestamp}.{body}">`` per secret,
  space-separated, so a receiver can rotate secrets.
- The status line decides: 2xx succeeds, even when its body drips past
  the timeout (reading stops there; the outcome stands). 410 is "gone":
  dead-lettered with ``dispatch.dead_letter.gone``. 429 is a throttle
  (docs/destinations.md): the destination waits for the response's
  ``Retry-After`` (seconds or an HTTP date; absent, the row's next backoff
  step) and the attempt does not count. 503 with a readable
  ``Retry-After`` is a throttle too; 503 without one is an ordinary
  failure -- a server that is down says nothing of when to come back, and
  a throttle there would spend no attempt while the breaker never counts
  it. 502 and 504 fail with their ``Retry-After`` as the earliest next
  attempt. Any other status, a redirect (never followed), a
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
import contextlib
import importlib.metadata
import ssl
import time
from collections.abc import AsyncIterator, Callable, Mapping
from typing import TYPE_CHECKING, Any, Final

import anyio

from ... import tracing
from ...redact import (
    AMBIGUOUS_URL_ERROR,
    ambiguous_userinfo,
    known_secrets,
    scrub,
    url_secrets,
)
from ...values import show
from ..base import BaseTransport, Delivery, TransportResult, check_timeout
from .endpoints import (
    Endpoint,
    check_origins,
    credentials_conflict,
    secret_header,
    shown_url,
    wire_host,
)
from .guard import QUIET_HOST, AddressRefused, ResolutionFailed, guarded_backend
from .messages import body_text, describe_http_error
from .plugin import DEFAULT_WEBHOOK_TIMEOUT_SECONDS
from .pool import linear_pool_class
from .signing import parse_retry_after, sign
from .tls import tls_context

if TYPE_CHECKING:
    import httpx

RESPONSE_READ_LIMIT: Final = 64 * 1024
"""Bytes of a response body read at most."""
THROTTLE_STATUSES: Final = frozenset({429, 503})
"""Statuses that throttle the destination: 429 always, 503 with a
``Retry-After``."""
RETRY_AFTER_STATUSES: Final = frozenset({502, 503, 504})
"""Failures whose ``Retry-After`` delays the next attempt."""


def _version() -> str:
    try:
        return importlib.metadata.version("trio_dispatch")
    except importlib.metadata.PackageNotFoundError:  # pragma: no cover - a source checkout
        return "0"


USER_AGENT: Final = f"trio-dispatch/{_version()}"


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
    transport._pool = linear_pool_class()(  # the same pool, guarded and linear
        ssl_context=context,
        max_connections=limits.max_connections,
        max_keepalive_connections=limits.max_keepalive_connections,
        keepalive_expiry=limits.keepalive_expiry,
        http1=True,
        http2=False,
        network_backend=guarded_backend(private_ok, quiet),
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


class WebhookTransport(BaseTransport):
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
            unread = [secret.label for secret in endpoint.secrets if secret.unread]
            if unread:  # a configuration read for a command that signs nothing
                raise ValueError(f"endpoints[{route!r}]: secret {unread[0]} was never read")
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
        headers = {
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
        if tracing.ACTIVE:  # the attempt's span, as traceparent (docs/tracing.md)
            tracing.inject_headers(headers)
        return headers

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
                    # Closed on every way out, a cut included: never left to
                    # the garbage collector with its connection.
                    raw: Any = response.aiter_raw()  # an async generator: it has aclose()
                    async with contextlib.aclosing(raw) as chunks:
                        async for chunk in chunks:
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
        text = "" if encoded else self._scrub_body(body_text(received), endpoint)
        detail = f"HTTP {status}: {text}" if text else f"HTTP {status}"
        if status == 410:
            return TransportResult.failure(detail, gone=True)
        if status in THROTTLE_STATUSES or status in RETRY_AFTER_STATUSES:
            wait = parse_retry_after(retry_after_header, self._clock())
            if status == 429 or (status in THROTTLE_STATUSES and wait is not None):
                return TransportResult.throttle(detail, retry_after=wait)
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
