"""A small local webhook receiver for the demo (standard library only).

It listens on 127.0.0.1 (a free port), checks every POST's Standard Webhooks
signature against one secret, and answers 204 when it is valid, 410 Gone
for the path /gone, and 401 when the signature (or its timestamp) is not
valid. One line per request goes to stdout; the secret is never printed.

    receiver = start_receiver(secret)    # serves in a background thread
    ...                                  # post to receiver.url + "/hooks"
    receiver.stop()
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import threading
import time
from collections.abc import Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

TOLERANCE_SECONDS = 5 * 60
"""A timestamp further than this from now is refused (replays)."""
MAX_BODY_BYTES = 1024 * 1024
SHOWN_CHARS = 80


def verify(secret: str, headers: Mapping[str, str], body: bytes, now: float) -> bool:
    """Is this request signed with ``secret`` (``whsec_<base64 key>``), recently?"""
    msg_id, timestamp = headers.get("webhook-id", ""), headers.get("webhook-timestamp", "")
    key = base64.b64decode(secret.removeprefix("whsec_"))
    mac = hmac.new(key, f"{msg_id}.{timestamp}.".encode() + body, hashlib.sha256).digest()
    expected = b"v1," + base64.b64encode(mac)
    signatures = headers.get("webhook-signature", "").split()
    if not any(hmac.compare_digest(expected, signature.encode()) for signature in signatures):
        return False
    return timestamp.isdecimal() and abs(now - float(timestamp)) <= TOLERANCE_SECONDS


def visible(text: str) -> str:
    """``text`` with control (and other unprintable) characters escaped."""
    return "".join(char if char.isprintable() else repr(char)[1:-1] for char in text)


def summary(body: bytes) -> tuple[str, str]:
    """(kind, body) of a dispatch payload, for the log line."""
    try:
        payload = json.loads(body)
        return str(payload["kind"]), json.dumps(payload["body"])
    except (ValueError, TypeError, KeyError):
        return "?", body.decode("utf-8", errors="replace")


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    secret: str
    output_lock: threading.Lock


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    protocol_version = "HTTP/1.1"  # keep-alive: every response has a length

    def do_POST(self) -> None:
        length = self.headers.get("content-length", "")
        if not (length.isascii() and length.isdigit()) or int(length) > MAX_BODY_BYTES:
            self._answer(411 if not length else 413, "a body of known length, at most 1 MiB")
            self.close_connection = True
            return
        body = self.rfile.read(int(length))
        headers = {name.lower(): value for name, value in self.headers.items()}
        webhook_id = visible(headers.get("webhook-id", ""))
        line = f"receiver: POST {visible(self.path)} webhook-id={webhook_id}"
        if not verify(self.server.secret, headers, body, time.time()):
            self._say(f"{line} signature INVALID or stale -> 401")
            self._answer(401, "invalid signature")
            return
        status = 410 if self.path == "/gone" else 204
        kind, text = summary(body)
        self._say(
            f"{line} signature ok kind={visible(kind)} -> {status} "
            f"body={visible(text[:SHOWN_CHARS])}"
        )
        self._answer(status, "gone" if status == 410 else "")

    def _answer(self, status: int, text: str) -> None:
        data = text.encode()
        self.send_response(status)
        if status != 204:
            self.send_header("content-type", "text/plain; charset=utf-8")
            self.send_header("content-length", str(len(data)))
        self.end_headers()
        if data:
            self.wfile.write(data)

    def _say(self, line: str) -> None:
        with self.server.output_lock:
            print(line, flush=True)

    def log_message(self, format: str, *args: object) -> None:
        pass  # one line per request is printed above; no access log


class Receiver:
    """A running receiver: ``url`` (http://127.0.0.1:PORT), ``stop()``."""

    def __init__(self, secret: str) -> None:
        self._server = _Server(("127.0.0.1", 0), _Handler)
        self._server.secret = secret
        self._server.output_lock = threading.Lock()
        self.port: int = self._server.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="webhook-receiver", daemon=True
        )
        self._thread.start()

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()


def start_receiver(secret: str) -> Receiver:
    return Receiver(secret)
