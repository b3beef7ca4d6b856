"""The webhook transport against real local HTTP servers (docs/webhooks.md):
every request verified by the independent ``standardwebhooks`` package,
outcomes recorded on real stores, on both anyio backends."""

from __future__ import annotations

import base64
import json
import logging
import os
import secrets
import signal
import sqlite3
import ssl
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest
import trustme
from standardwebhooks import Webhook

from trio_dispatch import Delivery, deliver_due_dispatches, enqueue_dispatch, sync
from trio_dispatch.config import ConfigError, load_config, parse_config
from trio_dispatch.settings import WorkerSettings
from trio_dispatch.store import SQLiteStore
from trio_dispatch.transports import TransportResult
from trio_dispatch.transports.webhook import (
    Endpoint,
    WebhookTransport,
    forbidden,
    parse_endpoints,
)
from trio_dispatch.worker import DispatchWorker

from ..conftest import RawDB
from ..helpers import run_cli, statuses, wait_for
from ..http_server import Server, closed_port, serve

pytestmark = pytest.mark.anyio

T0 = 1_000_000.0


def new_secret() -> str:
    return "whsec_" + base64.b64encode(secrets.token_bytes(32)).decode()


SECRET = new_secret()
ROTATED = new_secret()


def endpoints(
    routes: dict[str, str], *, allow_private: bool = True, **extra: Any
) -> dict[str, Endpoint]:
    return parse_endpoints(
        "endpoints",
        {
            route: {"url": url, "secrets": [SECRET], "allow_private": allow_private, **extra}
            for route, url in routes.items()
        },
        os.environ,
    )


@pytest.fixture
def server() -> Iterator[Server]:
    with serve() as running:
        yield running


def verify(request: Any, secret: str = SECRET) -> dict[str, Any]:
    """What the receiver library makes of a request (raises if unsigned)."""
    verified: dict[str, Any] = Webhook(secret).verify(request.body, request.headers)
    return verified


async def deliver(
    store: SQLiteStore, transport: WebhookTransport, now: float = T0
) -> dict[str, int]:
    return await deliver_due_dispatches(store, now=now, transport=transport)


def last(raw: RawDB, dispatch_id: str) -> dict[str, Any]:
    row = raw.transitions(dispatch_id)[-1]
    return {**row, "metadata": json.loads(str(row["metadata"]))}


# -- the request ------------------------------------------------------------------


async def test_a_delivery_is_a_signed_post_of_the_stored_payload(
    store: SQLiteStore, raw: RawDB, server: Server
) -> None:
    dispatch_id = await enqueue_dispatch(
        store, kind="invoice.paid", deliver_to="billing", body={"amount": 12, "note": "é"}, now=T0
    )
    transport = WebhookTransport(
        endpoints({"billing": server.url + "/ok"}, headers={"X-Team": "payments"})
    )
    counts = await deliver(store, transport)
    assert counts["delivered"] == 1
    [request] = server.requests
    assert request.body == str(raw.row(dispatch_id)["payload"]).encode()  # byte for byte
    assert verify(request)["body"] == {"amount": 12, "note": "é"}
    headers = request.headers
    assert headers["webhook-id"] == dispatch_id
    assert abs(int(headers["webhook-timestamp"]) - time.time()) < 60
    assert headers["content-type"] == "application/json"
    assert headers["user-agent"].startswith("trio-dispatch/")
    assert headers["x-team"] == "payments"
    assert raw.row(dispatch_id)["status"] == "delivered"


async def test_every_secret_signs_so_a_receiver_can_rotate(
    store: SQLiteStore, server: Server
) -> None:
    await enqueue_dispatch(store, kind="k", deliver_to="billing", now=T0)
    both = parse_endpoints(
        "endpoints",
        {
            "billing": {
                "url": server.url + "/ok",
                "secrets": [SECRET, ROTATED],
                "allow_private": True,
            }
        },
        os.environ,
    )
    await deliver(store, WebhookTransport(both))
    [request] = server.requests
    assert len(request.headers["webhook-signature"].split(" ")) == 2
    verify(request, SECRET)  # receivers on the old secret and on the new one both accept it
    verify(request, ROTATED)
    with pytest.raises(Exception, match="No matching signature"):
        verify(request, new_secret())


async def test_the_id_stays_across_retries_and_the_timestamp_is_each_attempts(
    store: SQLiteStore, raw: RawDB, server: Server
) -> None:
    server.script["/flaky"] = [500, 204]
    dispatch_id = await enqueue_dispatch(store, kind="k", deliver_to="d", now=T0)
    moments = iter([time.time() - 120, time.time()])
    stamps: list[float] = []

    def clock() -> float:
        stamps.append(next(moments))
        return stamps[-1]

    transport = WebhookTransport(endpoints({"d": server.url + "/flaky"}), clock=clock)
    assert (await deliver(store, transport, T0))["retried"] == 1
    assert (await deliver(store, transport, T0 + 61))["delivered"] == 1
    first, second = server.requests
    assert first.headers["webhook-id"] == second.headers["webhook-id"] == dispatch_id
    assert [int(r.headers["webhook-timestamp"]) for r in (first, second)] == [
        int(stamp) for stamp in stamps
    ]
    assert first.headers["webhook-signature"] != second.headers["webhook-signature"]
    verify(first)
    verify(second)
    assert raw.row(dispatch_id)["attempt"] == 2


# -- outcomes ---------------------------------------------------------------------


async def test_gone_dead_letters_at_once(store: SQLiteStore, raw: RawDB, server: Server) -> None:
    dispatch_id = await enqueue_dispatch(store, kind="k", deliver_to="d", max_attempts=8, now=T0)
    counts = await deliver(store, WebhookTransport(endpoints({"d": server.url + "/gone"})))
    assert counts["dead_letter"] == 1
    row = raw.row(dispatch_id)
    assert (row["status"], row["attempt"], row["last_error"]) == (
        "dead_letter",
        1,
        "HTTP 410: unsubscribed",
    )
    assert last(raw, dispatch_id)["reason_code"] == "dispatch.dead_letter.gone"


@pytest.mark.parametrize(
    ("path", "status", "wait"),
    [("/gateway-later", 502, 120.0), ("/gateway-timeout-date", 504, 300.0)],
    ids=["seconds", "http-date"],
)
async def test_retry_after_of_a_failure_sets_the_earliest_next_attempt(
    store: SQLiteStore, raw: RawDB, server: Server, path: str, status: int, wait: float
) -> None:
    # 502 and 504 are failures that count; 429 and 503 with Retry-After
    # throttle instead (tests/engine/test_throttle.py).
    dispatch_id = await enqueue_dispatch(store, kind="k", deliver_to="d", now=T0)
    before = time.time()
    counts = await deliver_due_dispatches(
        store, transport=WebhookTransport(endpoints({"d": server.url + path}))
    )
    assert counts["retried"] == 1
    row = raw.row(dispatch_id)
    assert str(row["last_error"]).startswith(f"HTTP {status}: ")
    metadata = last(raw, dispatch_id)["metadata"]
    assert metadata["retry_after_seconds"] == pytest.approx(wait, abs=3)
    assert float(row["next_attempt_at"]) >= before + wait - 3  # not the 60 s backoff


@pytest.mark.parametrize("path", ["/busy-plain", "/unavailable"])
async def test_a_retryable_status_without_retry_after_keeps_the_schedule(
    store: SQLiteStore, raw: RawDB, server: Server, path: str
) -> None:
    # 503 without Retry-After included: an ordinary failure, not a throttle.
    dispatch_id = await enqueue_dispatch(store, kind="k", deliver_to="d", now=T0)
    await deliver(store, WebhookTransport(endpoints({"d": server.url + path})))
    row = raw.row(dispatch_id)
    assert (row["next_attempt_at"], row["throttles"]) == (T0 + 60, 0)
    found = last(raw, dispatch_id)
    assert found["reason_code"] == "dispatch.pending.retry_backoff"
    assert "retry_after_seconds" not in found["metadata"]


@pytest.mark.parametrize(
    ("path", "expected"),
    [
        ("/fail", "HTTP 500: boom second line [31m red"),
        ("/redirect", "HTTP 302"),
        ("/missing", "HTTP 404: no such hook"),
    ],
)
async def test_other_statuses_fail_with_the_status_and_the_start_of_the_body(
    store: SQLiteStore, raw: RawDB, server: Server, path: str, expected: str
) -> None:
    dispatch_id = await enqueue_dispatch(store, kind="k", deliver_to="d", now=T0)
    counts = await deliver(store, WebhookTransport(endpoints({"d": server.url + path})))
    assert counts["retried"] == 1
    assert raw.row(dispatch_id)["last_error"] == expected
    assert [r.path for r in server.requests] == [path]  # a redirect is not followed


async def test_a_huge_error_body_is_read_only_in_part(
    store: SQLiteStore, raw: RawDB, server: Server
) -> None:
    dispatch_id = await enqueue_dispatch(store, kind="k", deliver_to="d", now=T0)
    started = time.monotonic()
    await deliver(store, WebhookTransport(endpoints({"d": server.url + "/big"}), timeout=5))
    assert time.monotonic() - started < 4
    error = str(raw.row(dispatch_id)["last_error"])
    assert error.startswith("HTTP 500: xxxx") and len(error) <= 2000


async def test_connection_refused_dns_failure_and_a_missing_endpoint_are_recorded(
    store: SQLiteStore, raw: RawDB
) -> None:
    refused = await enqueue_dispatch(store, kind="k", deliver_to="refused", now=T0)
    unknown_host = await enqueue_dispatch(store, kind="k", deliver_to="nowhere", now=T0)
    no_endpoint = await enqueue_dispatch(store, kind="k", deliver_to="unconfigured", now=T0)
    transport = WebhookTransport(
        endpoints(
            {
                "refused": f"http://127.0.0.1:{closed_port()}/hook",
                "nowhere": "http://no-such-host.invalid/hook",
            }
        ),
        timeout=5,
    )
    counts = await deliver(store, transport)
    assert counts["retried"] == 3
    assert raw.row(refused)["last_error"] == "connection refused"
    assert str(raw.row(unknown_host)["last_error"]).startswith(
        "DNS failure: no-such-host.invalid does not resolve"
    )
    assert raw.row(no_endpoint)["last_error"] == (
        "no webhook endpoint for deliver_to 'unconfigured' (configured: nowhere, refused)"
    )


async def test_a_silent_server_is_cut_at_the_timeout_and_retried(
    store: SQLiteStore, raw: RawDB, server: Server
) -> None:
    silent = await enqueue_dispatch(store, kind="k", deliver_to="slow", now=T0)
    transport = WebhookTransport(endpoints({"slow": server.url + "/slow"}), timeout=0.25)
    started = time.monotonic()
    counts = await deliver(store, transport)
    assert time.monotonic() - started < 2.5
    assert counts["retried"] == 1
    assert raw.row(silent)["last_error"] == "timeout after 0.25s (waiting for a response)"


@pytest.mark.slow
async def test_the_status_line_decides_and_a_slow_or_endless_body_is_cut_at_the_timeout(
    store: SQLiteStore, raw: RawDB, server: Server
) -> None:
    routes = {
        "drip": "/drip",  # 200, then one byte every 100 ms
        "stall": "/stall-ok",  # 200, then nothing
        "endless": "/endless-ok",  # 200, a body that never ends
        "busy": "/drip-fail",  # 503 + Retry-After, then a dripping body
    }
    ids = {
        route: await enqueue_dispatch(store, kind="k", deliver_to=route, now=T0) for route in routes
    }
    transport = WebhookTransport(
        endpoints({route: server.url + path for route, path in routes.items()}), timeout=1
    )
    started = time.monotonic()
    counts = await deliver(store, transport)
    elapsed = time.monotonic() - started
    assert elapsed < 5  # four attempts, none read past its 1 s deadline
    assert (counts["delivered"], counts["retried"]) == (3, 0)  # the 503 throttles
    for route in ("drip", "stall", "endless"):
        row = raw.row(ids[route])
        assert (row["status"], row["attempt"]) == ("delivered", 1), route
    busy = raw.row(ids["busy"])
    assert busy["status"] == "pending"
    assert str(busy["last_error"]).startswith("HTTP 503: overloaded")  # judged by its status
    busy_end = last(raw, ids["busy"])
    assert busy_end["reason_code"] == "dispatch.pending.throttled"
    assert busy_end["metadata"]["retry_after_seconds"] == 120  # it counts
    # Each posted once: a 2xx with a slow body is never sent again.
    assert sorted(r.path for r in server.requests) == sorted(routes.values())


# -- the address guard -------------------------------------------------------------


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost"])
async def test_a_private_address_is_refused_unless_the_endpoint_allows_it(
    store: SQLiteStore, raw: RawDB, server: Server, host: str
) -> None:
    dispatch_id = await enqueue_dispatch(store, kind="k", deliver_to="d", now=T0)
    url = f"http://{host}:{server.port}/ok"
    counts = await deliver(store, WebhookTransport(endpoints({"d": url}, allow_private=False)))
    assert counts["retried"] == 1 and server.requests == []  # nothing reached the server
    error = str(raw.row(dispatch_id)["last_error"])
    assert (
        error.startswith("refused: ") and "a loopback address (allow_private is not set)" in error
    )
    if host == "localhost":
        assert "localhost resolves to 127.0.0.1" in error or "localhost resolves to ::1" in error
    # The same endpoint with allow_private delivers.
    await deliver(store, WebhookTransport(endpoints({"d": url}, allow_private=True)), T0 + 61)
    assert raw.row(dispatch_id)["status"] == "delivered"


def test_what_counts_as_private() -> None:
    for address, kind in [
        ("127.0.0.1", "loopback"),
        ("::1", "loopback"),
        ("10.1.2.3", "private"),
        ("172.16.0.1", "private"),
        ("192.168.1.1", "private"),
        ("169.254.169.254", "link-local"),  # cloud metadata
        ("fe80::1", "link-local"),
        ("224.0.0.1", "multicast"),
        ("0.0.0.0", "unspecified"),
        ("::ffff:127.0.0.1", "loopback (inside ::ffff:7f00:1)"),  # IPv4-mapped
        ("2002:7f00:1::1", "loopback (inside 2002:7f00:1::1)"),  # 6to4 around 127.0.0.1
        ("fd00::1", "private"),
        ("fec0::1", "site-local"),
        ("100.100.100.200", "non-public"),  # shared address space (CGNAT), a metadata host
    ]:
        assert forbidden(address) == kind, address
    for public in ("93.184.216.34", "2606:4700::1111", "8.8.8.8"):
        assert forbidden(public) is None


# -- TLS --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ca() -> trustme.CA:
    return trustme.CA()


@pytest.fixture
def tls_server(ca: trustme.CA) -> Iterator[Server]:
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("127.0.0.1", "localhost").configure_cert(context)
    with serve(tls=context) as running:
        yield running


async def test_tls_is_verified_against_the_given_cas(
    store: SQLiteStore, raw: RawDB, tls_server: Server, ca: trustme.CA, tmp_path: Path
) -> None:
    assert tls_server.url.startswith("https://")
    untrusted = await enqueue_dispatch(store, kind="k", deliver_to="d", now=T0)
    await deliver(store, WebhookTransport(endpoints({"d": tls_server.url + "/ok"})))
    error = str(raw.row(untrusted)["last_error"])
    assert error.startswith("TLS failure: ") and "certificate" in error
    assert tls_server.requests == []
    # Trusting the test CA (a PEM file, as dispatch.webhook.ca_file gives it):
    ca_file = tmp_path / "ca.pem"
    ca.cert_pem.write_to_path(str(ca_file))
    transport = WebhookTransport(endpoints({"d": tls_server.url + "/ok"}), verify=str(ca_file))
    await deliver(store, transport, T0 + 61)
    assert raw.row(untrusted)["status"] == "delivered"
    [request] = tls_server.requests
    verify(request)


# -- the worker --------------------------------------------------------------------


async def test_a_worker_reuses_one_connection_and_keeps_secrets_out_of_everything(
    store: SQLiteStore, raw: RawDB, server: Server, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    for i in range(20):
        await enqueue_dispatch(store, kind="k", deliver_to="ok" if i % 2 else "bad")
    transport = WebhookTransport(endpoints({"ok": server.url + "/ok", "bad": server.url + "/fail"}))
    async with anyio.create_task_group() as tg:
        worker = DispatchWorker(store, transport=transport, concurrency=1, tick_seconds=60)
        await tg.start(worker.run)
        await wait_for(lambda: statuses(raw) == {"delivered": 10, "pending": 10})
        tg.cancel_scope.cancel()
    assert len(server.requests) == 20
    assert len({r.client_port for r in server.requests}) == 1  # one kept-alive connection
    for request in server.requests:
        verify(request)
    text = json.dumps(
        [raw.rows("SELECT * FROM dispatch_outbox"), raw.rows("SELECT * FROM status_transitions")],
        default=str,
    ) + "\n".join(record.getMessage() for record in caplog.records)
    key = SECRET.removeprefix("whsec_")
    assert key not in text and SECRET not in text
    assert repr(transport).startswith("WebhookTransport(endpoints=['bad', 'ok']")
    assert key not in repr(transport.endpoints)


async def test_ordinary_header_values_stay_readable_in_the_log_and_credentials_are_masked(
    store: SQLiteStore, raw: RawDB, server: Server, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="trio_dispatch")
    credential = "Bearer letmein-secret-42"
    dispatch_id = await enqueue_dispatch(store, kind="payments.refund", deliver_to="team")
    transport = WebhookTransport(
        endpoints(
            {"team": server.url + "/echo-auth"},
            headers={"X-Team": "payments", "X-Region": "eu", "Authorization": credential},
        )
    )
    async with anyio.create_task_group() as tg:
        worker = DispatchWorker(store, transport=transport, tick_seconds=3600)
        await tg.start(worker.run)
        await wait_for(lambda: worker.counts["retried"] == 1)
        tg.cancel_scope.cancel()
    assert server.requests[0].headers["authorization"] == credential  # it was sent
    [line] = [r.getMessage() for r in caplog.records if dispatch_id in r.getMessage()]
    assert "kind=payments.refund" in line and "***" not in line.split("error=")[0]
    assert "error='HTTP 401: denied: ***'" in line
    assert "letmein-secret-42" not in line
    # Nor in what is stored and shown by ls, show and the dashboard.
    stored = raw.row(dispatch_id)["last_error"]
    assert "letmein-secret-42" not in stored and "HTTP 401: denied" in stored
    history = raw.rows(
        "SELECT reason_summary FROM status_transitions WHERE entity_id = ?", (dispatch_id,)
    )
    assert all("letmein-secret-42" not in str(h["reason_summary"]) for h in history)


def test_only_pieces_of_a_password_long_enough_not_to_be_words_are_secrets() -> None:
    from trio_dispatch.redact import scrub, url_secrets

    found = url_secrets("postgresql://app:correct horse Tr0ub4dor&3xyz@db.example/app")
    assert "correct horse Tr0ub4dor&3xyz" in found and "Tr0ub4dor&3xyz" in found
    assert not {"correct", "horse"} & set(found)
    line = "kind=horse.correct error=auth failed for Tr0ub4dor&3xyz"
    assert scrub(line, found) == "kind=horse.correct error=auth failed for ***"


async def test_concurrent_deliveries_share_a_bounded_set_of_reused_connections(
    store: SQLiteStore, raw: RawDB, server: Server
) -> None:
    for i in range(60):
        await enqueue_dispatch(store, kind="k", deliver_to="ok" if i % 4 else "closing")
    transport = WebhookTransport(
        endpoints({"ok": server.url + "/ok", "closing": server.url + "/close"})
    )
    async with anyio.create_task_group() as tg:
        worker = DispatchWorker(store, transport=transport, concurrency=8, tick_seconds=60)
        await tg.start(worker.run)
        await wait_for(lambda: statuses(raw) == {"delivered": 60})
        tg.cancel_scope.cancel()
    kept_alive = {r.client_port for r in server.requests if r.path == "/ok"}
    assert len(server.requests) == 60
    assert len(kept_alive) <= 8 + 15  # at most one per slot, plus those a hang-up replaced
    for request in server.requests:
        verify(request)


async def test_a_transport_used_outside_a_worker_opens_and_closes_its_own_client(
    server: Server,
) -> None:
    transport = WebhookTransport(endpoints({"d": server.url + "/ok"}))
    delivery = Delivery("019a0000-0000-7000-8000-000000000000", "k", "d", 1, '{"a": 1}')
    assert await transport(delivery) == TransportResult.success()
    assert transport._client is None  # that call's own client is closed again
    async with transport.opened(), transport.opened():  # nested: one client
        client = transport._client
        for _ in range(3):
            assert await transport(delivery) == TransportResult.success()
        assert transport._client is client
    assert transport._client is None
    assert len(server.requests) == 4
    assert len({r.client_port for r in server.requests[1:]}) == 1  # one kept-alive connection


# -- configuration -------------------------------------------------------------------


def _config(webhook: dict[str, Any], **dispatch: Any) -> dict[str, Any]:
    return {"dispatch": {"transport": "webhook", "webhook": webhook, **dispatch}}


def _endpoint(url: str = "https://x.example/", **extra: Any) -> dict[str, Any]:
    return {"endpoints": {"b": {"url": url, "secrets": [SECRET], **extra}}}


HOP_BY_HOP = (
    "Expect",
    "TE",
    "Upgrade",
    "Proxy-Authorization",
    "Connection",
    "Keep-Alive",
    "Transfer-Encoding",
    "Trailer",
    "Host",
    "Content-Length",
    "proxy-connection",
)


@pytest.mark.parametrize(
    ("webhook", "message"),
    [
        (_endpoint("https://x.example:0/"), "endpoints.b.url: port 0 is out of range (1 to 65535)"),
        (_endpoint("http://x.example:65536/"), "endpoints.b.url: port 65536 is out of range"),
        (_endpoint("https://x.example:99999/h"), "endpoints.b.url: port 99999 is out of range"),
        (
            _endpoint("https://xn--zz.example/"),
            "endpoints.b.url: the host is not a valid internationalised domain name",
        ),
        (
            _endpoint("https://\U0001f4a9.example/"),
            "endpoints.b.url: the host is not a valid internationalised domain name",
        ),
        (_endpoint("https://a..example/"), "endpoints.b.url: the host is not a valid domain name"),
        *(
            (
                _endpoint(headers={name: "100-continue"}),
                f"dispatch.webhook.endpoints.b.headers.{name}: ",
            )
            for name in HOP_BY_HOP
        ),
    ],
    ids=["port-0", "port-65536", "port-99999", "bad-a-label", "emoji", "empty-label"]
    + [f"header-{name}" for name in HOP_BY_HOP],
)
def test_a_bad_endpoint_port_host_or_header_is_refused_naming_the_key(
    webhook: dict[str, Any], message: str
) -> None:
    with pytest.raises(ConfigError) as info:
        parse_config(_config(webhook))
    text = str(info.value)
    assert message in text and "\n" not in text
    assert "cannot be configured" in text or "header" not in message


def test_idna_names_in_their_ascii_form_and_every_valid_port_are_accepted() -> None:
    for url in (
        "https://xn--ls8h.la/hook",  # a UTS 46 name that IDNA 2008 refuses to decode
        "https://xn--bcher-kva.example/",
        "https://b\u00fccher.example/",
        "https://x.example:1/",
        "https://x.example:65535/",
        "https://a_b.example./",
    ):
        config = parse_config(_config(_endpoint(url)))
        assert config.dispatch.webhook.endpoints is not None, url
    shown = parse_config(_config(_endpoint("https://xn--ls8h.la/hook"))).dispatch.webhook
    assert shown.describe()["endpoints"]["b"]["url"] == "https://xn--ls8h.la/hook"


async def test_a_delivery_to_an_idna_host_reaches_the_resolver(
    store: SQLiteStore, raw: RawDB
) -> None:
    # .invalid never resolves (RFC 2606): the attempt gets as far as DNS.
    dispatch_id = await enqueue_dispatch(store, kind="k", deliver_to="d", now=T0)
    transport = WebhookTransport(endpoints({"d": "http://xn--ls8h.invalid/hook"}), timeout=5)
    assert (await deliver(store, transport))["retried"] == 1
    assert str(raw.row(dispatch_id)["last_error"]).startswith("DNS failure: xn--ls8h.invalid")


@pytest.mark.parametrize(
    ("webhook", "message"),
    [
        ({}, "dispatch.webhook.endpoints is required when dispatch.transport is webhook"),
        (
            {"endpoints": {"b": {"url": "ftp://x/y", "secrets": [SECRET]}}},
            "dispatch.webhook.endpoints.b.url must be an http:// or https:// URL",
        ),
        (
            {"endpoints": {"b": {"url": "https://x/y", "secrets": []}}},
            "dispatch.webhook.endpoints.b.secrets must be a non-empty list",
        ),
        (
            {"endpoints": {"b": {"url": "https://x/y", "secrets": ["whsec_%%%"]}}},
            "dispatch.webhook.endpoints.b.secrets[0] (whsec_***) is not a whsec_ secret",
        ),
        (
            {"endpoints": {"b": {"url": "https://x/y", "secrets": ["env:NO_SUCH_VARIABLE_X"]}}},
            "environment variable 'NO_SUCH_VARIABLE_X' is not set",
        ),
        (
            {"endpoints": {"b": {"url": "https://x/y", "secrets": ["whsec_" + "QUJD"]}}},
            "decodes to 3 bytes; Standard Webhooks keys are 24 to 64 bytes",
        ),
        (
            {
                "endpoints": {
                    "b": {"url": "https://x/", "secrets": [SECRET], "headers": {"webhook-id": "x"}}
                }
            },
            "dispatch.webhook.endpoints.b.headers.webhook-id: set by the transport itself",
        ),
        (
            {
                "endpoints": {
                    "b": {"url": "https://x/", "secrets": [SECRET], "headers": {"X-A": "é"}}
                }
            },
            "dispatch.webhook.endpoints.b.headers.X-A must be printable ASCII",
        ),
        (
            {
                "endpoints": {
                    "b": {"url": "https://x/", "secrets": [SECRET], "headers": {"X-A": "v "}}
                }
            },
            "without leading or trailing spaces",
        ),
        (
            {"endpoints": {"b": {"url": "https://x/", "secrets": [SECRET], "colour": "red"}}},
            "unknown key 'dispatch.webhook.endpoints.b.colour'",
        ),
        (
            {
                "endpoints": {
                    "a": {"url": "https://x/1", "secrets": [SECRET], "allow_private": True},
                    "b": {"url": "https://x:443/2", "secrets": [SECRET]},
                }
            },
            "endpoints.a and dispatch.webhook.endpoints.b share x:443 but not allow_private",
        ),
    ],
)
def test_bad_webhook_configuration_is_one_line_naming_the_key_without_the_secret(
    webhook: dict[str, Any], message: str
) -> None:
    with pytest.raises(ConfigError) as info:
        parse_config(_config(webhook))
    text = str(info.value)
    assert message in text and "\n" not in text
    assert SECRET.removeprefix("whsec_") not in text


def test_url_credentials_with_an_authorization_header_are_refused_naming_the_endpoint(
    tmp_path: Path,
) -> None:
    webhook = {
        "endpoints": {
            "billing": {
                "url": "https://svc:hunter22@billing.example.com/hooks",
                "secrets": [SECRET],
                "headers": {"authorization": "Bearer letmein-42"},
            },
            # Either alone is fine.
            "ops": {"url": "https://svc:pw@ops.example.com/", "secrets": [SECRET]},
            "crm": {
                "url": "https://crm.example.com/",
                "secrets": [SECRET],
                "headers": {"Authorization": "Bearer letmein-43"},
            },
        }
    }
    (tmp_path / "c.yaml").write_text(json.dumps(_config(webhook)))
    done = run_cli("check-config", str(tmp_path / "c.yaml"))
    assert done.returncode == 2 and done.stdout == ""
    [line] = done.stderr.strip().splitlines()
    assert "dispatch.webhook.endpoints.billing: url has credentials (user:password@) and " in line
    assert "hunter22" not in line and "letmein-42" not in line
    with pytest.raises(ValueError, match=r"endpoints\['billing'\]: url has credentials"):
        WebhookTransport(
            {"billing": Endpoint("https://a:b@x.example/", (), (("Authorization", "Basic x"),))}
        )


AMBIGUOUS_PASSWORD = "Hunter2@Secret-Host-Part/Tail"
"""Unencoded: read naively, ``Secret-Host-Part`` would be the host."""
PASSWORD_FRAGMENTS = ("Hunter2", "Secret-Host-Part", "Tail@", "hunter2", "secret-host-part")


def test_an_ambiguous_url_is_refused_by_check_config_naming_the_key_not_the_value(
    tmp_path: Path,
) -> None:
    config = tmp_path / "c.yaml"
    config.write_text(
        json.dumps(
            {
                "store": f"postgresql://app:{AMBIGUOUS_PASSWORD}@db.example/app",
                **_config(
                    {
                        "endpoints": {
                            "billing": {
                                "url": f"https://svc:{AMBIGUOUS_PASSWORD}@hooks.example/in",
                                "secrets": [SECRET],
                            },
                        }
                    }
                ),
            }
        )
    )
    text = run_cli("check-config", str(config))
    assert text.returncode == 2 and text.stdout == ""
    [line] = text.stderr.strip().splitlines()
    assert "store: invalid store URL: its user name or password holds an unencoded" in line
    assert "dispatch.webhook.endpoints.billing.url: its user name or password" in line
    document = run_cli("check-config", str(config), "--json")
    assert document.returncode == 2
    assert len(json.loads(document.stdout)["errors"]) == 2
    for fragment in (*PASSWORD_FRAGMENTS, "db.example", "hooks.example"):
        assert fragment not in text.stderr + document.stdout + document.stderr, fragment
    # No password, but an "@" after a "/": as ambiguous to a reader.
    with pytest.raises(ValueError, match=r"^e\.crm\.url: its user name or password"):
        parse_endpoints("e", {"crm": {"url": "https://crm.example/x@y", "secrets": [SECRET]}}, {})
    done = run_cli("--db", f"postgresql://app:{AMBIGUOUS_PASSWORD}@127.0.0.1:1/app", "ls")
    assert done.returncode == 2
    assert done.stderr.startswith("trio-dispatch: --db: invalid store URL: its user name")
    for fragment in PASSWORD_FRAGMENTS:
        assert fragment not in done.stdout + done.stderr
    with pytest.raises(ValueError, match=r"^endpoints\['b'\]\.url: its user name or password"):
        WebhookTransport({"b": Endpoint(f"https://svc:{AMBIGUOUS_PASSWORD}@h.example/", ())})


async def test_a_delivery_error_never_names_the_host_of_a_url_with_credentials(
    store: SQLiteStore, raw: RawDB, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="trio_dispatch")  # what the worker logs
    url = "http://svc:Secret-Pass-Word@secret-host-part.invalid/hook"
    dispatch_id = await enqueue_dispatch(store, kind="k", deliver_to="d", now=T0)
    transport = WebhookTransport(endpoints({"d": url}), timeout=5)
    async with anyio.create_task_group() as tg:
        worker = DispatchWorker(store, transport=transport, tick_seconds=3600)
        await tg.start(worker.run)
        await wait_for(lambda: worker.counts["retried"] == 1)
        tg.cancel_scope.cancel()
    error = str(raw.row(dispatch_id)["last_error"])
    assert error.startswith("DNS failure: the endpoint's host does not resolve")
    text = json.dumps(
        [raw.rows("SELECT * FROM dispatch_outbox"), raw.transitions(dispatch_id)], default=str
    ) + "\n".join(record.getMessage() for record in caplog.records)
    assert "result=retry" in text  # the worker's log line is in it
    for fragment in ("Secret-Pass-Word", "secret-host-part"):
        assert fragment not in text, fragment
    assert "Secret-Pass-Word" not in repr(transport.endpoints)
    # A URL without credentials is named as before.
    plain = WebhookTransport(endpoints({"d": "http://plain-host.invalid/hook"}), timeout=5)
    result = await plain(Delivery("e" * 32, "k", "d", 1, "{}"))
    assert result.error is not None and "plain-host.invalid" in result.error


def test_a_webhook_configuration_builds_the_worker_transport(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("BILLING_WEBHOOK_SECRET", ROTATED)
    config = parse_config(
        {
            **_config(
                {
                    "timeout_seconds": 7,
                    "endpoints": {
                        "billing": {
                            "url": "https://user:pw@billing.example.com/hooks?token=abc",
                            "secrets": ["env:BILLING_WEBHOOK_SECRET", SECRET],
                        }
                    },
                },
                retry_schedule=[5, 300],
            ),
            "worker": {"per_destination_concurrency": 4},
        }
    )
    options = config.worker_options()
    transport = options["transport"]
    assert isinstance(transport, WebhookTransport)
    settings = options["settings"]
    assert transport.timeout == 7 and settings.timeout_seconds == 7  # the lease follows it
    assert settings.retry_schedule == (5.0, 300.0)
    assert settings.per_destination_concurrency == 4
    assert WorkerSettings.from_config(config) == settings
    assert "notify_template" not in options
    assert config.dispatch.webhook.describe()["endpoints"]["billing"] == {
        "url": "https://***@billing.example.com/hooks?***",
        "secrets": ["env:BILLING_WEBHOOK_SECRET", "whsec_***"],
        "headers": {},
        "allow_private": False,
    }


def test_a_ca_file_that_cannot_be_used_is_refused_by_the_file_too(tmp_path: Path) -> None:
    webhook = {
        "ca_file": "missing-ca.pem",
        "endpoints": {"b": {"url": "https://x/", "secrets": [SECRET]}},
    }
    (tmp_path / "c.yaml").write_text(json.dumps(_config(webhook)))
    with pytest.raises(ConfigError) as info:
        load_config(tmp_path / "c.yaml")
    assert str(info.value) == (
        f"{tmp_path / 'c.yaml'}: dispatch.webhook.ca_file: CA file "
        f"'{tmp_path / 'missing-ca.pem'}' cannot be used: No such file or directory"
    )


def test_check_config_shows_endpoints_with_secrets_and_credentials_masked(tmp_path: Path) -> None:
    url = "https://svc:hunter22@billing.example.com/hooks?token=abc123"
    webhook = {
        "endpoints": {
            "billing": {
                "url": url,
                "secrets": ["env:HOOK_SECRET", SECRET],
                "headers": {"X-Api-Key": "letmein-42", "X-Team": "payments"},
            }
        }
    }
    (tmp_path / "c.yaml").write_text(json.dumps(_config(webhook)))
    env = {"HOOK_SECRET": ROTATED}
    text = run_cli("check-config", str(tmp_path / "c.yaml"), env=env)
    document = run_cli("check-config", "--json", str(tmp_path / "c.yaml"), env=env)
    assert text.returncode == document.returncode == 0
    assert (
        "billing: https://***@billing.example.com/hooks?*** (secrets: env:HOOK_SECRET, whsec_***)"
        in text.stdout
    )
    shown = json.loads(document.stdout)
    assert shown["transport"] == "webhook"
    assert shown["webhook"]["endpoints"]["billing"]["secrets"] == ["env:HOOK_SECRET", "whsec_***"]
    everything = text.stdout + text.stderr + document.stdout + document.stderr
    assert shown["webhook"]["endpoints"]["billing"]["headers"] == {
        "X-Api-Key": "***",
        "X-Team": "payments",
    }
    for secret in (
        "hunter22",
        "abc123",
        "letmein-42",
        SECRET.removeprefix("whsec_"),
        ROTATED.removeprefix("whsec_"),
    ):
        assert secret not in everything
    missing = run_cli("check-config", str(tmp_path / "c.yaml"))  # HOOK_SECRET unset
    assert missing.returncode == 2 and missing.stdout == ""
    assert missing.stderr.strip().endswith(
        "billing.secrets[0]: environment variable 'HOOK_SECRET' is not set"
    )


def test_the_worker_command_delivers_through_the_configured_webhook(
    tmp_path: Path, server: Server
) -> None:
    webhook = {
        "endpoints": {
            "billing": {
                "url": server.url.replace("://", "://svc:hunter22@") + "/ok?token=qwerty123",
                "secrets": ["env:HOOK_SECRET"],
                "allow_private": True,
            }
        }
    }
    config = {
        **_config(webhook),
        "store": str(tmp_path / "o.db"),
        "worker": {"tick_seconds": 0.2},
        "log_level": "DEBUG",
    }
    (tmp_path / "c.yaml").write_text(json.dumps(config))
    with sqlite3.connect(tmp_path / "o.db") as conn:  # a producer with its own connection
        sync.install_schema(conn)
        sync.enqueue_dispatch(conn, kind="invoice.paid", deliver_to="billing", body={"n": 1})
    env = {k: v for k, v in os.environ.items() if k != "TRIO_DISPATCH_CONFIG"}
    worker = subprocess.Popen(
        [sys.executable, "-m", "trio_dispatch", "--config", str(tmp_path / "c.yaml"), "worker"],
        env={**env, "HOOK_SECRET": SECRET},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 30
        while not server.requests and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.3)
    finally:
        worker.send_signal(signal.SIGINT)
        out, err = worker.communicate(timeout=20)
    assert worker.returncode == 0, err
    [request] = server.requests
    assert verify(request)["body"] == {"n": 1}
    assert "transport=webhook" in err and "result=delivered" in err
    for secret in (SECRET.removeprefix("whsec_"), "hunter22", "qwerty123"):
        assert secret not in out + err  # at DEBUG, whoever logs
