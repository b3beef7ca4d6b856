"""Serving the web application with hypercorn, under trio or asyncio.

The listening socket is bound here, before hypercorn starts, so a port in
use is one clear error at start (not a traceback from inside the server)
and the bound address -- port 0 included -- is known at once. Hypercorn is
never cancelled: when the surrounding scope is, it is asked to shut down
and given a moment to close its connections.

The server shares the worker's process, and so its file descriptors: a
flood of connections must never leave the deliveries without any. At most
``max_connections`` are open at once: the listening socket closes each
connection beyond them as soon as it is accepted (it holds a descriptor for
microseconds), on trio and asyncio alike. A connection that sends no request
is closed after :data:`IDLE_TIMEOUT_SECONDS`, as is an idle keep-alive one,
and a refused request (no token) closes its connection.
"""

from __future__ import annotations

import errno
import inspect
import logging
import os
import socket
import time
from typing import TYPE_CHECKING, Any, Final

import anyio
import sniffio
from anyio.abc import TaskStatus

from ..redact import scrubbed_logger
from .binding import DEFAULT_MAX_CONNECTIONS, Listen

if TYPE_CHECKING:
    from hypercorn.config import Config as HypercornConfig
    from hypercorn.config import Sockets

SHUTDOWN_GRACE_SECONDS: Final = 1.0
IDLE_TIMEOUT_SECONDS: Final = 5.0
"""How long a connection may stay open without a request in progress
(before its first request, or between keep-alive requests)."""
REFUSED_LOG_INTERVAL_SECONDS: Final = 60.0
"""At most one warning this often while connections are being refused."""
_REFUSALS_PER_ACCEPT: Final = 256
"""Connections closed in one accept call before the event loop runs again."""

log = scrubbed_logger("trio_dispatch.web")


class ConnectionGate:
    """Counts the open connections a listening socket has handed out (by
    descriptor and inode, so a closed descriptor that is reused for
    anything else no longer counts) and admits at most ``limit``."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._open: dict[int, int] = {}
        self.refused = 0
        self._warned_at: float | None = None

    def _prune(self) -> None:
        for fd, inode in list(self._open.items()):
            try:
                alive = os.fstat(fd).st_ino == inode
            except OSError:
                alive = False
            if not alive:
                del self._open[fd]

    def admit(self, fd: int) -> bool:
        """Whether the connection just accepted on ``fd`` may stay open."""
        if len(self._open) >= self.limit:
            self._prune()
        if len(self._open) >= self.limit:
            self.refused += 1
            now = time.monotonic()
            if self._warned_at is None or now - self._warned_at >= REFUSED_LOG_INTERVAL_SECONDS:
                self._warned_at = now
                log.warning(
                    "http: %d connections open (http.max_connections); closing new ones "
                    "until some end (%d refused so far)",
                    self.limit,
                    self.refused,
                )
            return False
        self._open[fd] = os.fstat(fd).st_ino
        return True

    @property
    def open(self) -> int:
        """Connections open now."""
        self._prune()
        return len(self._open)


class CappedListeningSocket(socket.socket):
    """A listening socket whose accept closes, at once, every connection
    beyond its :class:`ConnectionGate`'s limit: asyncio's server accepts
    through ``socket.accept``, which calls ``_accept``. (Trio takes no
    socket subclass: :func:`_serve_trio` applies the same gate.)"""

    gate: ConnectionGate

    def _accept(self) -> tuple[int, Any]:
        for _ in range(_REFUSALS_PER_ACCEPT):
            fd, address = super()._accept()  # type: ignore[misc]
            if self.gate.admit(fd):
                return fd, address
            os.close(fd)  # refused: the client sees the connection closed
        raise BlockingIOError(errno.EAGAIN, "connections refused; more may be waiting")


def _capped(sock: socket.socket, gate: ConnectionGate) -> CappedListeningSocket:
    capped = CappedListeningSocket(sock.family, sock.type, sock.proto, fileno=sock.detach())
    capped.gate = gate
    capped.setblocking(False)
    return capped


def _hypercorn_config(sock: socket.socket) -> HypercornConfig:
    """A hypercorn Config that serves on ``sock`` itself (not on a socket
    it would make from a descriptor, which would not be capped)."""
    from hypercorn.config import Config, Sockets

    class _Config(Config):
        def create_sockets(self) -> Sockets:
            return Sockets(secure_sockets=[], insecure_sockets=[sock], quic_sockets=[])

    return _Config()


async def _serve_trio(
    app: Any, config: HypercornConfig, sock: socket.socket, gate: ConnectionGate, stop: anyio.Event
) -> None:
    """hypercorn's trio connection handler behind an accept loop of our own
    (trio takes no socket subclass): each connection beyond the gate's
    limit is closed as it is accepted. Shutdown as hypercorn's: stop
    accepting, tell the connections, give them the graceful timeout."""
    import trio
    from hypercorn.trio.tcp_server import TCPServer
    from hypercorn.trio.worker_context import WorkerContext
    from hypercorn.utils import wrap_app

    wrapped = wrap_app(app, config.wsgi_max_body_size, "asgi")
    context = WorkerContext(None)
    # The lifespan state argument (empty: the app keeps none) came with
    # hypercorn 0.15; pass it where the handler takes it.
    state: tuple[dict[str, Any], ...] = (
        ({},) if "state" in inspect.signature(TCPServer.__init__).parameters else ()
    )
    listener = trio.SocketListener(trio.socket.from_stdlib_socket(sock))

    async def accept(connections: trio.Nursery) -> None:
        async with listener:
            while True:
                try:
                    stream = await listener.accept()
                except OSError as exc:
                    if exc.errno not in (errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.ENOBUFS):
                        raise
                    log.warning("http: accept failed (%s); retrying in 0.1s", exc.strerror)
                    await trio.sleep(0.1)
                    continue
                if gate.admit(stream.socket.fileno()):
                    server = TCPServer(wrapped, config, context, *state, stream)  # type: ignore[arg-type, call-arg]
                    connections.start_soon(server.run)
                else:
                    stream.socket.close()  # refused: the client sees the connection closed

    async with trio.open_nursery() as connections:
        async with trio.open_nursery() as accepting:
            accepting.start_soon(accept, connections)
            await stop.wait()
            accepting.cancel_scope.cancel()
        await context.terminated.set()  # idle connections close now
        connections.cancel_scope.deadline = trio.current_time() + config.graceful_timeout


def bind(listen: Listen) -> socket.socket:
    """A listening TCP socket on ``listen``; OSError (e.g. address in use)
    as a ValueError naming the address."""
    family = socket.AF_INET6 if ":" in listen.host else socket.AF_INET
    # IPPROTO_TCP, not 0: asyncio sets TCP_NODELAY only on connections whose
    # socket says so, and without it each keep-alive answer waits ~40 ms.
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
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
    max_connections: int = DEFAULT_MAX_CONNECTIONS,
    idle_timeout: float = IDLE_TIMEOUT_SECONDS,
    logger: logging.Logger | None = None,
    task_status: TaskStatus[str] = anyio.TASK_STATUS_IGNORED,
) -> None:
    """Serve the ASGI ``app`` on ``listen`` until cancelled, with at most
    ``max_connections`` connections open at once (those beyond are closed
    as they arrive), each closed after ``idle_timeout`` seconds without a
    request in progress; signals ``task_status`` with the base URL once it
    accepts connections. An app with a ``listening_on`` method is told the
    bound address (its real port) before it serves."""
    sock = bind(listen)
    listening_on = getattr(app, "listening_on", None)
    if listening_on is not None:  # the app answers to the listener's names, port 0 resolved
        listening_on(Listen(listen.host, sock.getsockname()[1]))
    prepare = getattr(app, "prepare", None)
    if prepare is not None:
        try:
            await prepare()
        except BaseException:
            sock.close()
            raise
    url = url_of(sock)
    from hypercorn.config import Config

    gate = ConnectionGate(max_connections)
    trio_loop = sniffio.current_async_library() == "trio"
    config = Config() if trio_loop else _hypercorn_config(_capped(sock, gate))
    config.keep_alive_timeout = idle_timeout
    config.accesslog = None
    config.errorlog = logger or logging.getLogger("trio_dispatch.web")
    config.graceful_timeout = SHUTDOWN_GRACE_SECONDS
    config.include_server_header = False
    stop = anyio.Event()

    async def run() -> None:
        with anyio.CancelScope(shield=True):  # stopped by ``stop``, never cancelled
            if trio_loop:
                await _serve_trio(app, config, sock, gate, stop)
            else:
                from hypercorn.asyncio import serve

                await serve(app, config, shutdown_trigger=stop.wait)

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
