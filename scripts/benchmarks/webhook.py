"""Section ``webhook``: the webhook transport posting to a local HTTP/1.1
server in a process of its own: deliveries/s beside a bare httpx loop, at
100 ms server latency beside the ideal, and a healthy endpoint's rate beside
a hung one's (per-destination caps).
"""

from __future__ import annotations

import base64
import contextlib
import functools
import os
import sqlite3
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, Final

import anyio

from trio_dispatch import (
    DispatchWorker,
    enqueue_many,
    open_store,
)
from trio_dispatch.signal import dispatch_envelope_json, uuid7_bytes

from .harness import BODY, BODY_JSON, Bench, Outcome, Pairs, median_of_turns, version_of

WEBHOOK_SERVER: Final = r"""
import asyncio, os, sys, threading

RESPONSE = b"HTTP/1.1 204 No Content\r\nServer: bench\r\n\r\n"


class Http(asyncio.Protocol):
    # HTTP/1.1 with keep-alive: reads each request's head and its
    # Content-Length body, then answers 204 after `delay` seconds (at once
    # for 0, never for a negative delay).

    def __init__(self, delay):
        self.delay = delay
        self.buffer = b""
        self.body_left = None

    def connection_made(self, transport):
        self.transport = transport

    def data_received(self, data):
        self.buffer += data
        while True:
            if self.body_left is None:
                end = self.buffer.find(b"\r\n\r\n")
                if end < 0:
                    return
                head, self.buffer = self.buffer[:end], self.buffer[end + 4:]
                self.body_left = 0
                for line in head.split(b"\r\n")[1:]:
                    name, _, value = line.partition(b":")
                    if name.strip().lower() == b"content-length":
                        self.body_left = int(value)
            if len(self.buffer) < self.body_left:
                return
            self.buffer = self.buffer[self.body_left:]
            self.body_left = None
            if self.delay == 0:
                self.transport.write(RESPONSE)
            elif self.delay > 0:
                asyncio.get_running_loop().call_later(self.delay, self.answer)

    def answer(self):
        if not self.transport.is_closing():
            self.transport.write(RESPONSE)


def watch_parent():
    sys.stdin.read()  # the parent closed our stdin, or is gone
    os._exit(0)


async def main():
    loop = asyncio.get_running_loop()
    servers = [
        await loop.create_server(lambda d=float(d): Http(d), "127.0.0.1", 0, backlog=1024)
        for d in sys.argv[1:]
    ]
    ports = [s.sockets[0].getsockname()[1] for s in servers]
    print("ports", *ports, flush=True)
    await asyncio.Event().wait()


threading.Thread(target=watch_parent, daemon=True).start()
asyncio.run(main())
"""
"""The receiving end of the webhook figures: one asyncio process, one
listening port per delay in ``argv`` (0: a 204 at once; > 0: after that
many seconds; < 0: never), HTTP/1.1 keep-alive, any number of connections.
It exits when its stdin closes."""


WEBHOOK_TIMEOUT: Final = 10.0
"""The transport timeout of figures whose server always answers."""


@contextlib.contextmanager
def webhook_server(*delays: float) -> Iterator[list[str]]:
    """The URLs of :data:`WEBHOOK_SERVER` listening with these delays; the
    process is killed when the block exits."""
    proc = subprocess.Popen(
        [sys.executable, "-c", WEBHOOK_SERVER, *map(str, delays)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        said = proc.stdout.readline().split()
        if not said or said[0] != "ports" or len(said) != len(delays) + 1:
            raise RuntimeError(f"the webhook server did not start: {said!r}")
        yield [f"http://127.0.0.1:{port}/hook" for port in said[1:]]
    finally:
        if proc.stdin is not None:
            proc.stdin.close()
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()


def webhook_transport(urls: dict[str, str], timeout: float = WEBHOOK_TIMEOUT) -> Any:
    """A :class:`WebhookTransport` posting each route to its URL, one fresh
    ``whsec_`` secret each, private addresses allowed (the server is local)."""
    from trio_dispatch.transports.webhook import WebhookTransport, parse_endpoints

    spec = {
        route: {
            "url": url,
            "secrets": ["whsec_" + base64.b64encode(os.urandom(32)).decode()],
            "allow_private": True,
        }
        for route, url in urls.items()
    }
    return WebhookTransport(parse_endpoints("endpoints", spec, os.environ), timeout=timeout)


def webhook_payload(route: str) -> bytes:
    """The bytes our worker posts for a dispatch of :data:`BODY` to ``route``:
    its stored envelope."""
    return dispatch_envelope_json(
        dispatch_id=uuid7_bytes().hex(),
        kind="bench",
        deliver_to=route,
        ack_token=None,
        body_json=BODY_JSON,
    ).encode()


async def ours_webhook(
    path: Path,
    urls: dict[str, str],
    queued: Sequence[tuple[str, int]],
    delivered: int,
    concurrency: int,
    per_destination: int | None = None,
    timeout: float = WEBHOOK_TIMEOUT,
) -> float:
    """Deliveries/s of one DispatchWorker with a :class:`WebhookTransport`
    over dispatches queued beforehand (``queued``: (route, count) in enqueue
    order, 1,000 per ``enqueue_many``: untimed), timed from the worker's
    start until ``delivered`` of them are delivered (its counter, polled
    every 5 ms). Without ``per_destination`` (figures in which every attempt
    should succeed) a failed attempt raises, naming its error."""
    transport = webhook_transport(urls, timeout)
    async with open_store(path) as db:
        for route, count in queued:
            for offset in range(0, count, 1000):
                await enqueue_many(
                    db,
                    [
                        {"kind": "bench", "deliver_to": route, "body": BODY}
                        for _ in range(min(1000, count - offset))
                    ],
                )
        worker = DispatchWorker(
            db,
            transport=transport,
            concurrency=concurrency,
            per_destination_concurrency=per_destination,
            timeout_seconds=timeout,
            tick_seconds=3600,
            grace_seconds=0.1,
        )
        async with anyio.create_task_group() as tg:
            with anyio.fail_after(300):
                start = time.perf_counter()
                await tg.start(worker.run)
                while worker.counts["delivered"] < delivered:
                    if per_destination is None and worker.counts["retried"]:
                        raise RuntimeError(f"a webhook attempt failed: {_last_error(path)}")
                    await anyio.sleep(0.005)
                elapsed = time.perf_counter() - start
            tg.cancel_scope.cancel()
    return delivered / elapsed


def _last_error(path: Path) -> str:
    conn = sqlite3.connect(path)
    try:
        row = conn.execute(
            "SELECT last_error FROM dispatch_outbox WHERE last_error IS NOT NULL LIMIT 1"
        ).fetchone()
    finally:
        conn.close()
    return str(row[0]) if row else "?"


async def bare_httpx_posts(
    url: str, n: int, concurrency: int, payload: bytes, own_client: bool = False
) -> float:
    """POSTs/s of a bare httpx loop: ``concurrency`` tasks sharing one
    ``httpx.AsyncClient`` (the limits and timeout of the transport's), each
    posting ``payload`` until ``n`` are answered; the client is made inside
    the timing, as the worker opens its own. ``own_client``: the client the
    webhook transport itself uses (its linear-time pool, address guard
    allowing loopback), so the loop measures the HTTP path alone."""
    import httpx

    from trio_dispatch.transports.webhook import make_client

    left = iter(range(n))
    start = time.perf_counter()
    parsed = httpx.URL(url)
    client_cm = (
        make_client(
            timeout=WEBHOOK_TIMEOUT,
            private_ok=frozenset({(parsed.host, parsed.port or 80)}),
        )
        if own_client
        else httpx.AsyncClient(
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=256),
            timeout=httpx.Timeout(WEBHOOK_TIMEOUT),
            trust_env=False,
            follow_redirects=False,
        )
    )
    async with client_cm as client:

        async def poster() -> None:
            for _ in left:
                response = await client.post(
                    url, content=payload, headers={"content-type": "application/json"}
                )
                if response.status_code != 204:
                    raise RuntimeError(f"the webhook server answered {response.status_code}")

        async with anyio.create_task_group() as tg:
            for _ in range(concurrency):
                tg.start_soon(poster)
        elapsed = time.perf_counter() - start
    return n / elapsed


def run_webhook(bench: Bench) -> Outcome:
    """The webhook transport against a local HTTP/1.1 server in a process of
    its own: its throughput beside a bare httpx loop, at a slow server
    beside the ideal (and the bare loop's own rate there, the floor), and a
    healthy destination's rate beside a hung one. Ours runs on trio (the
    worker's main backend), the bare loop too; the server process is killed
    when the section ends."""
    try:
        import httpx  # noqa: F401
    except ImportError:
        return Outcome(notes=["webhook section skipped: httpx is not installed (the http extra)"])
    at = bench.at
    # Twice the quick sizes in a full run (not bench.scale: at concurrency 64
    # a turn here takes seconds, and the full run has 3 rounds). A turn of
    # the first figure posts 600 or more: shorter ones flip between two
    # regimes of httpx's connection pool (one of them 3-4 times as fast) and
    # the bare loop with them.
    scale = 1 if bench.quick else 2
    turns = 3
    n_fast, n_slow, n_ok, n_hung = 600 * turns * scale, 640 * scale, 300 * scale, 1000
    slow_delay, ok_delay, timeout, cap = 0.1, 0.02, 2.0, 4
    ideal = 64 / slow_delay

    def on_trio(fn: Any, *args: Any) -> Callable[[], float]:
        return functools.partial(bench.go, fn, *args, backend="trio")

    pairs = Pairs()
    with webhook_server(0, slow_delay, ok_delay, -1) as (fast_url, slow_url, ok_url, hung_url):
        fast, slow = {"hook": fast_url}, {"hook": slow_url}
        caps = {"ok": ok_url, "hung": hung_url}
        payload = webhook_payload("hook")
        per_turn = n_fast // turns
        for i in range(bench.rounds):
            got = median_of_turns(
                {
                    "httpx": on_trio(bare_httpx_posts, fast_url, per_turn, 64, payload),
                    "client": on_trio(bare_httpx_posts, fast_url, per_turn, 64, payload, True),
                    "ours": on_trio(
                        ours_webhook, at("wh"), fast, [("hook", per_turn)], per_turn, 64
                    ),
                },
                turns,
                i,
            )
            pairs.add("fast", got["ours"], got["httpx"])
            pairs.add("fast-client", got["ours"], got["client"])
            got = median_of_turns(
                {
                    "httpx": on_trio(bare_httpx_posts, slow_url, n_slow, 64, payload, True),
                    "ours": on_trio(ours_webhook, at("whs"), slow, [("hook", n_slow)], n_slow, 64),
                },
                1,
                i,
            )
            pairs.add("slow", got["ours"], ideal)
            pairs.add("slow-floor", got["httpx"], ideal)
            got = median_of_turns(
                {
                    "alone": on_trio(
                        ours_webhook, at("who"), caps, [("ok", n_ok)], n_ok, 16, cap, timeout
                    ),
                    "hung": on_trio(
                        ours_webhook,
                        at("whh"),
                        caps,
                        [("hung", n_hung), ("ok", n_ok)],
                        n_ok,
                        16,
                        cap,
                        timeout,
                    ),
                },
                2,
                i,
            )
            pairs.add("caps", got["hung"], got["alone"])
    server = "a local HTTP/1.1 server (asyncio, keep-alive) in a process of its own, answering 204"
    ideal_name = f"ideal 64 / {slow_delay:g} s"
    figures = [
        pairs.figure(
            "fast",
            "webhook deliveries/s, local server answering at once, concurrency 64",
            "/s",
            f"{server} at once; a bare httpx {version_of('httpx')} loop on trio: 64 tasks "
            f"sharing one AsyncClient (HTTP/1.1, the transport's limits and timeout) posting "
            f"the {len(payload)}-byte envelope of the {len(BODY_JSON)}-byte payload (the "
            f"bytes ours posts); ours: one DispatchWorker (trio, concurrency 64) with a "
            f"WebhookTransport (signed per Standard Webhooks, address guard, 64 KiB read "
            f"cap) over {per_turn} dispatches queued beforehand on a fresh SQLite store "
            f"(synchronous=FULL), timed from worker start until its delivered counter "
            f"(polled every 5 ms) reads them all; each side makes its client inside the "
            f"timing; {turns} turns each taken in rotation, the median turn",
            0.8,
            "bare httpx loop",
            "webhook",
        ),
        pairs.figure(
            "slow",
            f"webhook deliveries/s with {slow_delay * 1000:g} ms server latency, concurrency 64",
            "/s",
            f"{ideal_name}: the same server answering each request {slow_delay * 1000:g} ms "
            f"after it arrives; ours as above over {n_slow} dispatches (one run per round, "
            f"taking turns with the floor below)",
            0.9,
            ideal_name,
            "webhook",
        ),
        pairs.figure(
            "slow-floor",
            f"the floor: the transport's own client in a bare loop, {slow_delay * 1000:g} ms "
            "server latency, 64 tasks",
            "/s",
            f"{ideal_name}; a bare loop on the transport's own client (make_client: the "
            f"linear-time pool, no store, no signing) posting {n_slow} times to the "
            f"{slow_delay * 1000:g} ms server: what the HTTP path alone reaches here",
            0.0,
            ideal_name,
            "webhook",
            target="(a floor)",
        ),
        pairs.figure(
            "fast-client",
            "webhook deliveries/s beside the transport's own client in a bare loop",
            "/s",
            "the loop of the first figure on the client the transport itself uses "
            "(make_client: its linear-time connection pool, the address guard): what the "
            "outbox adds -- claim, signing, recording -- to the HTTP path; same turns",
            0.0,
            "bare loop, same client",
            "webhook",
            target="(the outbox's cost)",
        ),
        pairs.figure(
            "caps",
            "per-destination caps: healthy endpoint's rate beside a hung one",
            "/s",
            f"the healthy endpoint alone: a worker with concurrency 16 and "
            f"per_destination_concurrency={cap} (at most {cap} attempts to one deliver_to "
            f"run at once in a worker, so a hung destination holds {cap} slots, not all 16), "
            f"transport timeout {timeout:g} s, over {n_ok} dispatches to 'ok' (a server "
            f"answering after {ok_delay * 1000:g} ms: at most {cap / ok_delay:.0f}/s); "
            f"ours: the same with {n_hung} dispatches to 'hung' (a server that never "
            f"answers) queued ahead of them, timed until the {n_ok} to 'ok' are delivered; "
            f"2 turns each taken in rotation, the median turn",
            0.8,
            "healthy endpoint alone",
            "webhook",
        ),
    ]
    return Outcome(figures)
