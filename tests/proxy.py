"""A TCP proxy of the tests' own, on 127.0.0.1, that can go silent the way
a real partition does: frozen, it stops reading and forwarding in both
directions and accepts no new connection, but resets nothing -- the
kernel keeps acknowledging what fits in its buffers, so neither side's TCP
notices. Thawed, it forwards what it held, in order."""

from __future__ import annotations

import select
import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from urllib.parse import urlsplit, urlunsplit


class FreezableProxy:
    """Forwards connections to ``upstream`` (host, port) from
    :attr:`port` on 127.0.0.1, each by a thread of its own."""

    def __init__(self, upstream: tuple[str, int]) -> None:
        self.upstream = upstream
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self._listener.getsockname()[1]
        self._running = threading.Event()  # set: forwarding; clear: frozen
        self._running.set()
        self._closed = threading.Event()
        self._freeze_on: bytes | None = None
        self._lock = threading.Lock()
        self._sockets: list[socket.socket] = []
        self.froze = threading.Event()
        """Set when a pattern froze the proxy (see :meth:`freeze_on`)."""
        self._threads = [threading.Thread(target=self._accept, daemon=True)]
        self._threads[0].start()

    def url(self, url: str) -> str:
        """``url`` with its host and port replaced by this proxy's."""
        parts = urlsplit(url)
        netloc = parts.netloc.rsplit("@", 1)
        where = f"127.0.0.1:{self.port}"
        return urlunsplit(
            parts._replace(netloc=f"{netloc[0]}@{where}" if len(netloc) == 2 else where)
        )

    def freeze(self) -> None:
        self._running.clear()

    def thaw(self) -> None:
        self._freeze_on = None
        self._running.set()

    def freeze_on(self, pattern: bytes) -> None:
        """Freeze the moment a client sends bytes holding ``pattern``,
        before they are forwarded (they go out after the thaw)."""
        self.froze.clear()
        self._freeze_on = pattern

    @property
    def frozen(self) -> bool:
        return not self._running.is_set()

    def close(self) -> None:
        self._closed.set()
        self._running.set()
        self._listener.close()
        with self._lock:
            for sock in self._sockets:
                sock.close()

    def _accept(self) -> None:
        while not self._closed.is_set():
            self._running.wait()
            try:
                readable, _, _ = select.select([self._listener], [], [], 0.05)
                if not readable or not self._running.is_set():
                    continue
                client, _ = self._listener.accept()
            except (OSError, ValueError):  # closed
                return
            try:
                server = socket.create_connection(self.upstream)
            except OSError:
                client.close()
                continue
            with self._lock:
                self._sockets += [client, server]
            thread = threading.Thread(target=self._pump, args=(client, server), daemon=True)
            thread.start()

    def _pump(self, client: socket.socket, server: socket.socket) -> None:
        peer = {client: server, server: client}
        held: list[tuple[socket.socket, bytes]] = []
        try:
            while not self._closed.is_set():
                if not self._running.is_set():
                    self._running.wait(0.05)
                    continue
                for target, data in held:
                    target.sendall(data)
                held.clear()
                readable, _, _ = select.select([client, server], [], [], 0.05)
                for sock in readable:
                    data = sock.recv(65536)
                    if not data:
                        return
                    pattern = self._freeze_on
                    if sock is client and pattern is not None and pattern in data:
                        self._freeze_on = None
                        self._running.clear()
                        self.froze.set()
                        held.append((server, data))
                        continue
                    if self._running.is_set():
                        peer[sock].sendall(data)
                    else:  # frozen by another connection meanwhile
                        held.append((peer[sock], data))
        except OSError:
            return
        finally:
            client.close()
            server.close()


@contextmanager
def proxy_to(url: str) -> Iterator[FreezableProxy]:
    """A :class:`FreezableProxy` to the server ``url`` names, closed after."""
    parts = urlsplit(url)
    proxy = FreezableProxy((parts.hostname or "127.0.0.1", parts.port or 5432))
    try:
        yield proxy
    finally:
        proxy.close()
