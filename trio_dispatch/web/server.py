"""Serving the web application with hypercorn, under trio or asyncio.

The listening socket is bound here, before hypercorn starts, so a port in
use is one clear error at start (not a traceback from inside the server)
and the bound address -- port 0 included -- is known at once. Hypercorn is
never cancelled: when the surrounding scope is, it is asked to shut down
and given a moment to close its connections.
"""

from __future__ import annotations

import logging
import socket
from typing import Any, Final

import anyio
import sniffio
from anyio.abc import TaskStatus

from .binding import Listen

SHUTDOWN_GRACE_SECONDS: Final = 1.0


def bind(listen: Listen) -> socket.socket:
    """A listening TCP socket on ``listen``; OSError (e.g. address in use)
    as a ValueError naming the address."""
    family = socket.AF_INET6 if ":" in listen.host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        infos = socket.getaddrinfo(listen.host, listen.port, family, socket.SOCK_STREAM)
        sock.bind(infos[0][4])
        sock.listen(128)
    except (OSError, IndexError) as exc:
        sock.close()
        reason = getattr(exc, "strerror", None) or str(exc) or type(exc).__name__
        raise ValueError(f"cannot listen on {listen}: {reason}") from None
    sock.setblocking(False)
    return sock


def url_of(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    shown = f"[{host}]" if ":" in host else host
    return f"http://{shown}:{port}"


async def serve_app(
    app: Any,
    listen: Listen,
    *,
    logger: logging.Logger | None = None,
    task_status: TaskStatus[str] = anyio.TASK_STATUS_IGNORED,
) -> None:
    """Serve the ASGI ``app`` on ``listen`` until cancelled; signals
    ``task_status`` with the base URL once it accepts connections."""
    from hypercorn.config import Config

    sock = bind(listen)
    prepare = getattr(app, "prepare", None)
    if prepare is not None:
        try:
            await prepare()
        except BaseException:
            sock.close()
            raise
    url = url_of(sock)
    config = Config()
    config.bind = [f"fd://{sock.detach()}"]
    config.accesslog = None
    config.errorlog = logger or logging.getLogger("trio_dispatch.web")
    config.graceful_timeout = SHUTDOWN_GRACE_SECONDS
    config.include_server_header = False
    stop = anyio.Event()

    async def shutdown_trigger() -> None:
        await stop.wait()

    async def run() -> None:
        with anyio.CancelScope(shield=True):  # stopped by the trigger, never cancelled
            if sniffio.current_async_library() == "trio":
                from hypercorn.trio import serve as trio_serve

                await trio_serve(app, config, shutdown_trigger=shutdown_trigger)
            else:
                from hypercorn.asyncio import serve as asyncio_serve

                await asyncio_serve(app, config, shutdown_trigger=shutdown_trigger)

    async with anyio.create_task_group() as tg:
        attach = getattr(app, "attach", None)
        if attach is not None:  # the app's background work lives as long as the server
            attach(tg)
        tg.start_soon(run)
        try:
            task_status.started(url)
            await anyio.sleep_forever()
        finally:
            stop.set()
