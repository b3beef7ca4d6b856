"""Deadlines on blocking database calls made in threads.

A session cut without a word (a network partition; a NAT, pooler or load
balancer that stops forwarding while the kernel keeps acknowledging) leaves
a blocking driver call waiting for an answer that never comes: TCP
keepalives and ``tcp_user_timeout`` do not notice, since the peer they
talk to is alive. A :class:`Watchdog` gives each such call a deadline: a
thread of its own cuts the calls whose deadline has passed -- for a socket,
a ``shutdown`` that makes the blocked call fail at once, as a reset would.
The thread starts with the first watched call and wakes a few times a
second from then on (a lock and a look at a set: nothing measurable), until
:meth:`Watchdog.stop`.

Arming and disarming a :class:`Watch` costs a lock and a set operation (no
thread is woken); a cut runs under the same lock, so it never touches a
call that has already ended (whose socket number may have been reused).
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Callable
from types import TracebackType
from typing import Final

GRANULARITY_SECONDS: Final = 0.25
"""How often the watchdog looks at the calls it watches (at most; a
shorter deadline is looked at a tenth as often as it lasts)."""


class Watch:
    """One watched call: enter it around the call. If the call is still
    running ``seconds`` after it was entered, ``cut`` is called (from the
    watchdog's thread, once) and :attr:`fired` is set."""

    __slots__ = ("_cut", "_dog", "_seconds", "deadline", "fired")

    def __init__(self, dog: Watchdog, seconds: float, cut: Callable[[], None]) -> None:
        self._dog = dog
        self._seconds = seconds
        self._cut = cut
        self.deadline = 0.0
        self.fired = False

    def __enter__(self) -> Watch:
        self.deadline = time.monotonic() + self._seconds
        self._dog._arm(self)
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self._dog._disarm(self)


class Watchdog:
    """Cuts watched calls that outlive their deadline (see the module
    docstring). ``on_cut(seconds)`` is called just before each cut, under
    the watchdog's lock (so whoever the cut fails sees what it recorded),
    with the deadline's length. The thread starts on first use and ends
    with :meth:`stop`."""

    def __init__(self, name: str, on_cut: Callable[[float], None] | None = None) -> None:
        self._name = name
        self._on_cut = on_cut
        self._lock = threading.Lock()
        self._armed: set[Watch] = set()
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self._interval = GRANULARITY_SECONDS

    def watch(self, seconds: float, cut: Callable[[], None]) -> Watch:
        """A :class:`Watch` of ``seconds`` that calls ``cut`` when it fires."""
        return Watch(self, seconds, cut)

    def _arm(self, watch: Watch) -> None:
        with self._lock:
            self._armed.add(watch)
            self._interval = min(self._interval, max(0.01, watch._seconds / 10))
            if self._thread is None and not self._stopping.is_set():
                self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                self._thread.start()

    def _disarm(self, watch: Watch) -> None:
        with self._lock:
            self._armed.discard(watch)

    def _run(self) -> None:
        while not self._stopping.wait(self._interval):
            now = time.monotonic()
            with self._lock:
                for watch in [w for w in self._armed if w.deadline <= now]:
                    self._armed.discard(watch)
                    watch.fired = True
                    if self._on_cut is not None:
                        self._on_cut(watch._seconds)
                    watch._cut()  # under the lock: the call is still running

    def stop(self) -> None:
        """End the thread (calls still watched are no longer cut)."""
        self._stopping.set()
        thread, self._thread = self._thread, None
        if thread is not None and thread is not threading.current_thread():
            thread.join()


def shut_socket(fd: int) -> None:
    """Shut down both directions of the socket ``fd`` without closing the
    number (its owner does that): a call blocked on it fails at once."""
    try:
        dup = socket.socket(fileno=os.dup(fd))
    except OSError:
        return
    try:
        dup.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass  # already shut or not connected: nothing left to cut
    finally:
        dup.close()
