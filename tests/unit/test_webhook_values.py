"""Webhook values: `Retry-After` parsing and the Standard Webhooks signature
of the specification's example."""

from __future__ import annotations

import base64

from trio_dispatch.transports.webhook import (
    parse_retry_after,
    sign,
)


def test_the_signature_matches_the_specifications_example() -> None:
    # The Standard Webhooks specification's published example.
    key = base64.b64decode("MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw")
    body = b'{"test": 2432232314}'
    assert (
        sign([key], "msg_p5jXN8AQM9LWM0D4loKWxJek", 1614265330, body)
        == "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE="
    )


def test_retry_after_values() -> None:
    now = 1_700_000_000.0
    assert parse_retry_after("120", now) == 120.0
    assert parse_retry_after(" 0 ", now) == 0.0
    assert parse_retry_after("Tue, 14 Nov 2023 22:15:00 GMT", now) == 100.0
    assert parse_retry_after("Mon, 13 Nov 2023 00:00:00 GMT", now) == 0.0  # past: at once
    for unreadable in (None, "", "soon", "-5", "1e9", "Tue, 99 Nov 2023 22:14:20 GMT"):
        assert parse_retry_after(unreadable, now) is None
