"""The Standard Webhooks signature and the ``Retry-After`` a receiver
answers with."""

from __future__ import annotations

import base64
import email.utils
import hashlib
import hmac
import math
import re
from collections.abc import Iterable
from typing import TYPE_CHECKING, Final

if TYPE_CHECKING:
    pass

SECRET_PREFIX: Final = "whsec_"  # noqa: S105 - the format's prefix, not a secret
MIN_KEY_BYTES: Final = 24
MAX_KEY_BYTES: Final = 64


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
