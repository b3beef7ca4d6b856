"""The webhook transport (``dispatch.transport: webhook``): each attempt an
HTTP POST signed per the Standard Webhooks specification. Needs the
``http`` extra (httpx), imported on first use.

One concern per module:

- :mod:`.endpoints` -- the configured endpoints: URL, secrets, headers, each
  checked when parsed;
- :mod:`.signing` -- the ``webhook-signature`` and ``Retry-After``;
- :mod:`.guard` -- the address guard every connection goes through;
- :mod:`.tls` -- the verified TLS context;
- :mod:`.pool` -- the one override of httpcore's internals (its pool's
  bookkeeping made linear), alone, with a test of the shape it needs;
- :mod:`.messages` -- what a failed exchange is called in ``last_error``;
- :mod:`.transport` -- :class:`WebhookTransport` and its client;
- :mod:`.plugin` -- its configuration (``dispatch.webhook``) as a plug-in.
"""

from __future__ import annotations

from .endpoints import Endpoint, Secret, parse_endpoints
from .guard import AddressRefused, ResolutionFailed, forbidden
from .plugin import DEFAULT_WEBHOOK_TIMEOUT_SECONDS, WebhookConfig
from .signing import parse_retry_after, sign
from .tls import tls_context
from .transport import WebhookTransport, make_client

__all__ = [
    "DEFAULT_WEBHOOK_TIMEOUT_SECONDS",
    "AddressRefused",
    "Endpoint",
    "ResolutionFailed",
    "Secret",
    "WebhookConfig",
    "WebhookTransport",
    "forbidden",
    "make_client",
    "parse_endpoints",
    "parse_retry_after",
    "sign",
    "tls_context",
]
