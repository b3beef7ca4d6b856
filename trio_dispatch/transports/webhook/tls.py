"""The TLS context webhooks are posted with: verified, always."""

from __future__ import annotations

import ssl
from typing import TYPE_CHECKING

from ...values import show

if TYPE_CHECKING:
    pass


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
