"""A real local HTTP/1.1 server for webhook tests: keep-alive, optional TLS,
one behaviour per path, every request recorded. It runs in a thread, so it
serves tests on either anyio backend alike."""

from __future__ import annotations

import email.utils
import http.server
import socket
import ssl
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field


@dataclass
class Received:
    path: str
    headers: dict[str, str]
    body: bytes
    client_port: int


@dataclass
class Server:
    url: str
    port: int
    requests: list[Received] = field(default_factory=list)
    script: dict[str, list[int]] = field(default_factory=dict)
    """Per path, the status codes to answer in turn (the last repeats)."""
    dropped: list[str] = field(default_factory=list)
    """The paths of requests whose client hung up before any answer came
    (``/hang`` answers none)."""

    def bodies(self, path: str) -> list[bytes]:
        return [r.body for r in self.requests if r.path == path]


def _handler(server: Server) -> type[http.server.BaseHTTPRequestHandler]:
    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: object) -> None:
            pass

        def _answer(
            self, status: int, body: bytes = b"", headers: dict[str, str] | None = None
        ) -> None:
            self.send_response(status)
            for name, value in (headers or {}).items():
                self.send_header(name, value)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_POST(self) -> None:
            length = int(self.headers.get("Content-Length", "0"))
            body = self.rfile.read(length)
            path = self.path.split("?")[0]
            server.requests.append(
                Received(
                    path,
                    {k.lower(): v for k, v in self.headers.items()},
                    body,
                    self.client_address[1],
                )
            )
            if path in server.script:
                codes = server.script[path]
                status = codes.pop(0) if len(codes) > 1 else codes[0]
                self._answer(status, f"scripted {status}".encode())
            elif path == "/ok":
                self._answer(204)
            elif path == "/close":  # answers, then hangs up: the next request reconnects
                self.close_connection = True
                self._answer(204, b"", {"Connection": "close"})
            elif path == "/fail":
                self._answer(500, b"boom\nsecond line\x1b[31m red")
            elif path == "/gone":
                self._answer(410, b"unsubscribed")
            elif path == "/busy-seconds":
                self._answer(503, b"busy", {"Retry-After": "120"})
            elif path == "/busy-date":
                when = email.utils.formatdate(time.time() + 300, usegmt=True)
                self._answer(429, b"slow down", {"Retry-After": when})
            elif path == "/busy-plain":
                self._answer(502, b"bad gateway")
            elif path == "/gateway-later":
                self._answer(502, b"bad gateway", {"Retry-After": "120"})
            elif path == "/gateway-timeout-date":
                when = email.utils.formatdate(time.time() + 300, usegmt=True)
                self._answer(504, b"gateway timeout", {"Retry-After": when})
            elif path == "/unavailable":  # 503 with no word on when to come back
                self._answer(503, b"down for maintenance")
            elif path == "/slow-down":  # 429 with no Retry-After
                self._answer(429, b"slow down")
            elif path == "/slow-down-seconds":
                self._answer(429, b"slow down", {"Retry-After": "30"})
            elif path == "/redirect":
                self._answer(302, b"", {"Location": "/ok"})
            elif path == "/big":
                self._answer(500, b"x" * (4 * 1024 * 1024))
            elif path == "/slow":
                time.sleep(3)
                self._answer(204)
            elif path == "/drip":
                self.send_response(200)
                self.send_header("Content-Length", "1000")
                self.end_headers()
                try:
                    for _ in range(1000):
                        self.wfile.write(b".")
                        self.wfile.flush()
                        time.sleep(0.1)
                except OSError:
                    pass
            elif path == "/echo-auth":  # a receiver that quotes the credential it refuses
                credential = self.headers.get("Authorization", "")
                self._answer(401, f"denied: {credential}".encode())
            elif path == "/stall-ok":  # the status line and headers, then no body at all
                self.send_response(200)
                self.send_header("Content-Length", "10")
                self.end_headers()
                self.wfile.flush()
                time.sleep(5)
            elif path == "/endless-ok":  # a chunked body that never ends
                self.send_response(200)
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                try:
                    while True:
                        self.wfile.write(b"400\r\n" + b"." * 1024 + b"\r\n")
                        self.wfile.flush()
                        time.sleep(0.001)
                except OSError:
                    pass
            elif path == "/hang":  # no answer: waits for the client to hang up
                self.connection.settimeout(120)
                try:
                    gone = self.connection.recv(1) == b""
                except OSError:
                    gone = True
                if gone:
                    server.dropped.append(path)
                self.close_connection = True
            elif path == "/drip-fail":
                self.send_response(503)
                self.send_header("Retry-After", "120")
                self.send_header("Content-Length", "1000")
                self.end_headers()
                try:
                    self.wfile.write(b"overloaded")
                    for _ in range(990):
                        self.wfile.write(b".")
                        self.wfile.flush()
                        time.sleep(0.1)
                except OSError:
                    pass
            else:
                self._answer(404, b"no such hook")

    return Handler


class _Quiet(http.server.ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request: object, client_address: object) -> None:
        pass  # a client that hangs up mid-exchange (a cut timeout) is expected


@contextmanager
def serve(tls: ssl.SSLContext | None = None, host: str = "127.0.0.1") -> Iterator[Server]:
    """A server on a free loopback port for the block."""
    httpd = _Quiet((host, 0), http.server.BaseHTTPRequestHandler)
    port = httpd.server_address[1]
    scheme = "https" if tls else "http"
    server = Server(url=f"{scheme}://{host}:{port}", port=port)
    httpd.RequestHandlerClass = _handler(server)
    if tls is not None:
        httpd.socket = tls.wrap_socket(httpd.socket, server_side=True)
    thread = threading.Thread(
        target=httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
    )
    thread.start()
    try:
        yield server
    finally:
        httpd.shutdown()
        httpd.server_close()


def closed_port() -> int:
    """A loopback port nothing listens on."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])
