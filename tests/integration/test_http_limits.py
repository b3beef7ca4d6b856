"""The HTTP server shares the worker's file descriptors: a flood of
connections must not starve the deliveries. At most ``http.max_connections``
stay open (the rest are closed as they arrive), a connection without a
request is closed after the idle timeout, and one refused for want of the
token is closed after its 401. Real sockets, real stores, a real worker
process under a lowered descriptor limit."""

from __future__ import annotations

import json
import resource
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import anyio
import httpx
import pytest

from trio_dispatch import enqueue_dispatch, open_store
from trio_dispatch.store import SQLiteStore
from trio_dispatch.web import WebApp, parse_listen, serve_app
from trio_dispatch.worker import DispatchWorker

from ..conftest import RawDB
from ..helpers import wait_for
from .test_web import running

LOOPBACK = parse_listen("test", "127.0.0.1:0")
TOKEN = "s3cret-token-0123456789"


def port_of(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


@contextmanager
def flood(port: int, count: int) -> Iterator[list[socket.socket]]:
    """``count`` raw connections that send nothing, closed on exit."""
    socks: list[socket.socket] = []
    try:
        for _ in range(count):
            socks.append(socket.create_connection(("127.0.0.1", port), timeout=5))
        yield socks
    finally:
        for sock in socks:
            sock.close()


def closed_by_server(sock: socket.socket, wait: float) -> bool:
    """Whether the server has closed ``sock`` (EOF or reset) within ``wait``."""
    sock.settimeout(wait)
    try:
        while True:
            if sock.recv(65536) == b"":
                return True
    except (TimeoutError, BlockingIOError):
        return False
    except ConnectionResetError:
        return True


def healthy_again(url: str, headers: dict[str, str] | None = None) -> bool:
    """Whether ``/healthz`` answers 200 within 10 s: the server closes a
    connection its client left at the idle timeout (hypercorn's way)."""
    deadline = time.monotonic() + 10
    while True:
        try:
            return httpx.get(url + "/healthz", headers=headers, timeout=5).status_code == 200
        except httpx.TransportError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def count_open(socks: list[socket.socket], cap: int) -> int:
    """How many of ``socks`` the server keeps open, once it has refused
    what it will (polled for up to 3 s while more than ``cap`` are open)."""
    deadline = time.monotonic() + 3
    still_open = list(socks)
    while True:
        still_open = [sock for sock in still_open if not closed_by_server(sock, 0.01)]
        if len(still_open) <= cap or time.monotonic() > deadline:
            return len(still_open)
        time.sleep(0.1)


@pytest.mark.slow
@pytest.mark.anyio
async def test_a_connection_flood_keeps_at_most_max_connections_open_and_deliveries_go_on(
    store: SQLiteStore, raw: RawDB
) -> None:
    worker = DispatchWorker(store, notify_template=["true"], tick_seconds=3600)
    async with anyio.create_task_group() as tg:
        await tg.start(worker.run)
        url = await tg.start(
            lambda task_status: serve_app(
                WebApp(store, worker=worker),
                LOOPBACK,
                max_connections=8,
                idle_timeout=3,  # long enough to count the flood, short for its end
                task_status=task_status,
            )
        )

        def flooded() -> int:
            with flood(port_of(url), 100) as socks:
                return count_open(socks, 8)

        with anyio.fail_after(30):
            assert await anyio.to_thread.run_sync(flooded) == 8
        # A real child process is spawned while the flood is held off.
        dispatch_id = await enqueue_dispatch(store, kind="k", deliver_to="seat")
        await wait_for(lambda: raw.row(dispatch_id)["status"] == "delivered")
        assert raw.row(dispatch_id)["attempt"] == 1
        # Once the flood is gone its slots are free again.
        assert await anyio.to_thread.run_sync(healthy_again, url)
        tg.cancel_scope.cancel()


@pytest.mark.anyio
async def test_a_connection_without_a_request_is_closed_after_the_idle_timeout(
    store: SQLiteStore,
) -> None:
    async with anyio.create_task_group() as tg:
        url = await tg.start(
            lambda task_status: serve_app(
                WebApp(store), LOOPBACK, idle_timeout=0.5, task_status=task_status
            )
        )

        def idle() -> tuple[bool, float]:
            started = time.monotonic()
            with flood(port_of(url), 1) as (sock,):
                return closed_by_server(sock, 10), time.monotonic() - started

        closed, after = await anyio.to_thread.run_sync(idle)
        tg.cancel_scope.cancel()
    assert closed and 0.4 <= after < 5, after


@pytest.mark.anyio
async def test_a_request_without_the_token_gets_401_and_its_connection_closed(
    store: SQLiteStore,
) -> None:
    async with anyio.create_task_group() as tg:
        url = await tg.start(
            lambda task_status: serve_app(
                WebApp(store, token=TOKEN), LOOPBACK, idle_timeout=60, task_status=task_status
            )
        )

        def unauthenticated() -> tuple[bytes, bool]:
            port = port_of(url)
            with flood(port, 1) as (sock,):
                sock.sendall(f"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n\r\n".encode())
                answer = b""
                sock.settimeout(5)
                while b"\r\n\r\n" not in answer:
                    answer += sock.recv(65536)
                return answer, closed_by_server(sock, 5)

        answer, closed = await anyio.to_thread.run_sync(unauthenticated)
        async with httpx.AsyncClient(base_url=url, timeout=10) as client:
            authorized = await client.get("/healthz", headers={"authorization": f"Bearer {TOKEN}"})
        tg.cancel_scope.cancel()
    assert answer.startswith(b"HTTP/1.1 401") and b"connection: close" in answer.lower()
    assert closed  # not kept alive for the 60 s idle timeout
    assert authorized.status_code == 200 and "connection" not in authorized.headers


@pytest.mark.slow
def test_a_flood_on_a_worker_with_few_descriptors_leaves_its_deliveries_working(
    tmp_path: Path,
) -> None:
    """A real worker process limited to 48 descriptors (about 18 in use at
    rest): with 16 connections at most, 200 more cannot take the ones a
    delivery's child process needs."""
    db = tmp_path / "o.db"
    config = tmp_path / "c.yaml"
    config.write_text(
        json.dumps(
            {
                "store": "o.db",
                "dispatch": {"notify_template": ["true"]},
                "worker": {"tick_seconds": 3600},
                "http": {"max_connections": 16},
            }
        )
    )
    args = ["--config", str(config), "worker", "--http", "127.0.0.1:0"]
    pattern = r"http: metrics, health and dashboard at (http://\S+)/"

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (48, 48))

    with running(args, tmp_path, pattern, preexec_fn=limit) as (url, process):
        with flood(port_of(url), 200) as socks:
            assert count_open(socks, 16) == 16

            async def enqueue() -> str:
                async with open_store(str(db)) as store:
                    return await enqueue_dispatch(store, kind="k", deliver_to="seat")

            dispatch_id = anyio.run(enqueue)
            raw = RawDB(db)
            deadline = time.monotonic() + 20
            while raw.row(dispatch_id)["status"] != "delivered":
                assert process.poll() is None, "the worker exited"
                assert time.monotonic() < deadline, raw.row(dispatch_id)
                time.sleep(0.05)
            assert raw.row(dispatch_id)["attempt"] == 1
        assert healthy_again(url)


# -- configuration -------------------------------------------------------------------
