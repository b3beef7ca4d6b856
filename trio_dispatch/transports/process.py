"""Transport children that never outlive their worker (docs/guarantees.md, docs/security.md).

A command transport's child is started so that it dies with the worker
process, however the worker ends:

- **Parent-death signal.** The child sets ``prctl(PR_SET_PDEATHSIG,
  SIGKILL)`` before it runs the command. Linux sends that signal when the
  *thread* that forked the child ends, not the process; so every child is
  forked by one process-wide spawner thread that never ends while the
  process lives. (trio starts processes from pool threads that end after
  10 s idle: a child set up there would be killed at 10 s while its worker
  lives.) Where util-linux's ``setpriv --pdeathsig`` exists, the child is
  ``setpriv --pdeathsig KILL -- COMMAND...``: no Python code runs between
  fork and exec, and the fork is the cheap ``vfork`` path. Elsewhere the
  child runs a ``preexec_fn`` that makes the same call and exits if its
  parent is already gone (a full ``fork``, and CPython's after-fork
  handlers run in the child: slower, and not free of the deadlock risk
  CPython documents for ``preexec_fn`` in a threaded process).
- **Lifeline.** A small helper process (``_lifeline.py``), started once per
  process, holds a pipe from it and learns each child's process group. When
  the pipe reaches EOF -- the worker exited or was SIGKILLed -- it SIGKILLs
  every group still registered, so the child's own children (grandchildren
  of the worker) in its process group die too. A grandchild that left the
  group (its own ``setsid``) is beyond reach, as it is for the worker's own
  timeout kill.

Everything else is as ``anyio.open_process``: pipes read and written
without blocking the event loop, the exit awaited through a pidfd (Linux
5.3+; elsewhere polled), under trio and asyncio alike.
"""

from __future__ import annotations

import atexit
import ctypes
import errno
import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Final

import anyio

from .._threads import ServiceThread

PR_SET_PDEATHSIG: Final = 1
_POLL_SECONDS: Final = 0.01
_LIFELINE_SCRIPT: Final = Path(__file__).with_name("_lifeline.py")

log = logging.getLogger("trio_dispatch.process")


PDEATHSIG_LAUNCHER: str = "auto"
"""How a child gets its parent-death signal: ``"setpriv"`` (util-linux),
``"preexec"`` (a ``preexec_fn``), or ``"auto"``: setpriv where it supports
``--pdeathsig``, else preexec. Read when the spawner starts."""


def _find_setpriv() -> str | None:
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        return None
    try:
        done = subprocess.run(
            [setpriv, "--help"], capture_output=True, timeout=10, stdin=subprocess.DEVNULL
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return setpriv if b"--pdeathsig" in done.stdout + done.stderr else None


def _load_prctl() -> Callable[..., int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        prctl: Callable[..., int] = libc.prctl
    except (OSError, AttributeError):  # pragma: no cover - not glibc/musl
        return None
    return prctl


_prctl: Final = _load_prctl()


def _child_setup(parent: int) -> Callable[[], None]:
    """The ``preexec_fn`` fallback: what the forked child runs before exec:
    die with the spawner thread (which lives as long as the process), and
    not at all if the parent is already gone (one resolved C call and two
    system calls)."""
    prctl = _prctl

    def setup() -> None:
        if prctl is not None:
            prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != parent:
            os._exit(127)

    return setup


_PARENTS_HELPERS: list[subprocess.Popen[bytes]] = []
"""In a forked child: the parent's lifeline helpers, held so that nothing
here finalizes them (see :meth:`_Lifeline.forget_after_fork`)."""


class _Lifeline:
    """The helper process that kills registered groups when we die."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._groups: set[int] = set()
        self._popen: subprocess.Popen[bytes] | None = None
        self._fd: int | None = None

    def _start(self) -> None:
        popen = subprocess.Popen(
            [sys.executable, "-I", "-S", str(_LIFELINE_SCRIPT)],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
            close_fds=True,
        )
        assert popen.stdin is not None
        self._popen, self._fd = popen, popen.stdin.fileno()
        os.set_blocking(self._fd, False)
        self._send(b"".join(b"+%d\n" % pgid for pgid in self._groups))

    def _send(self, data: bytes) -> None:
        if not data or self._fd is None:
            return
        try:
            written = os.write(self._fd, data)
        except (BlockingIOError, BrokenPipeError, OSError):
            written = -1
        if written != len(data):  # gone or stuck: start a fresh one with every group
            self._drop()
            self._start()

    def _drop(self) -> None:
        popen, self._popen, self._fd = self._popen, None, None
        if popen is not None:
            # Killed before its pipe closes: EOF would make a live helper
            # kill every registered group, the running transports included.
            popen.kill()
            popen.wait()
            assert popen.stdin is not None
            try:
                popen.stdin.close()
            except OSError:
                pass

    def register(self, pgid: int) -> None:
        """Remember ``pgid``. Best effort: if no helper can be started (no
        usable interpreter, no file descriptors left), the child still has
        its parent-death signal; the failure is logged, not raised."""
        with self._lock:
            self._groups.add(pgid)
            try:
                if self._popen is None or self._popen.poll() is not None:
                    self._drop()
                    self._start()  # sends every group, this one included
                else:
                    self._send(b"+%d\n" % pgid)
            except (OSError, subprocess.SubprocessError) as exc:
                self._popen = self._fd = None
                log.warning(
                    "lifeline helper unavailable (%s): a transport's own children "
                    "may outlive a killed worker",
                    exc,
                )

    def unregister(self, pgid: int) -> None:
        with self._lock:
            if pgid in self._groups:
                self._groups.discard(pgid)
                self._send(b"-%d\n" % pgid)

    @property
    def pid(self) -> int | None:
        return None if self._popen is None else self._popen.pid

    def close(self, timeout: float = 5.0) -> None:
        """End the helper as this process's own end would: its pipe closes,
        it SIGKILLs every group still registered and exits; then reap it (a
        helper that has not exited after ``timeout`` seconds is killed)."""
        with self._lock:
            popen, self._popen, self._fd = self._popen, None, None
            self._groups = set()
        if popen is None:
            return
        assert popen.stdin is not None
        try:
            popen.stdin.close()
        except OSError:
            pass
        try:
            popen.wait(timeout)
        except subprocess.TimeoutExpired:  # pragma: no cover - a stopped helper
            popen.kill()
            popen.wait()

    def forget_after_fork(self) -> None:
        """In a forked child: close the inherited pipe end (the parent's
        lifeline must still see EOF when the parent dies) without touching
        the parent's helper. Closed through its file object, once: a
        finalizer closing the number again later could close a descriptor
        the child has opened since. The helper's ``Popen`` is kept, never
        finalized here: it is the parent's child, not this process's."""
        popen = self._popen
        if popen is not None and popen.stdin is not None:
            try:
                popen.stdin.close()
            except OSError:
                pass
            _PARENTS_HELPERS.append(popen)
        elif self._fd is not None:
            try:
                os.close(self._fd)
            except OSError:
                pass
        self._popen = self._fd = None
        self._groups = set()
        self._lock = threading.Lock()


class _Spawner:
    def __init__(self) -> None:
        self.pid = os.getpid()
        self.thread = ServiceThread("trio_dispatch spawner")
        self.lifeline = _Lifeline()
        self.setpriv = _find_setpriv() if PDEATHSIG_LAUNCHER in ("auto", "setpriv") else None
        if PDEATHSIG_LAUNCHER == "setpriv" and self.setpriv is None:
            self.thread.stop()
            raise RuntimeError("setpriv with --pdeathsig is not available here")

    def close(self) -> None:
        """Stop the spawner thread and end the lifeline helper (which kills
        any transport group still registered). For a spawner that is being
        replaced; a process that simply exits needs no call."""
        self.thread.stop()
        self.lifeline.close()


_spawner: _Spawner | None = None
_spawner_lock = threading.Lock()


def _current_spawner() -> _Spawner:
    global _spawner
    with _spawner_lock:
        if _spawner is None or _spawner.pid != os.getpid():
            _spawner = _Spawner()
        return _spawner


_held_for_fork: list[threading.Lock] = []


def _before_fork() -> None:
    # No fork while another thread is between starting a lifeline helper
    # and noting its pipe: a child forked then would keep the new pipe's
    # write end without knowing it, and the helper would never see EOF. (The
    # helper's own Popen runs no fork hooks: it has no preexec_fn.)
    spawner = _spawner
    if spawner is not None:
        lock = spawner.lifeline._lock
        lock.acquire()
        _held_for_fork.append(lock)


def _after_fork_in_parent() -> None:
    while _held_for_fork:
        _held_for_fork.pop().release()


def _after_fork_in_child() -> None:
    global _spawner, _spawner_lock
    _held_for_fork.clear()  # the child's lifeline gets a lock of its own
    _spawner_lock = threading.Lock()
    if _spawner is not None:
        _spawner.lifeline.forget_after_fork()
        _spawner = None


if hasattr(os, "register_at_fork"):
    os.register_at_fork(
        before=_before_fork,
        after_in_parent=_after_fork_in_parent,
        after_in_child=_after_fork_in_child,
    )


def _close_at_exit() -> None:
    # What the helper would do once the process is gone (EOF: kill the
    # groups still registered, exit), done while we can still reap it and
    # close our end of its pipe, instead of leaving both to interpreter
    # teardown (a ResourceWarning where warnings are shown).
    spawner = _spawner
    if spawner is not None and spawner.pid == os.getpid():
        spawner.close()


atexit.register(_close_at_exit)


def lifeline_pid() -> int | None:
    """The pid of this process's lifeline helper, if one was started."""
    return None if _spawner is None or _spawner.pid != os.getpid() else _spawner.lifeline.pid


class Child:
    """A running transport child in its own process group (its pid is the
    group's id). Its pipes are non-blocking file descriptors."""

    def __init__(self, popen: subprocess.Popen[bytes], lifeline: _Lifeline) -> None:
        self.popen = popen
        self.pid = popen.pid
        self._lifeline = lifeline
        self.stdin = None if popen.stdin is None else popen.stdin.fileno()
        self.stdout = None if popen.stdout is None else popen.stdout.fileno()
        self.stderr = None if popen.stderr is None else popen.stderr.fileno()
        for fd in (self.stdin, self.stdout, self.stderr):
            if fd is not None:
                os.set_blocking(fd, False)
        self._pidfd: int | None = None
        if hasattr(os, "pidfd_open"):
            try:
                self._pidfd = os.pidfd_open(self.pid)
            except OSError:  # pragma: no cover - a kernel before 5.3
                self._pidfd = None

    @property
    def returncode(self) -> int | None:
        return self.popen.returncode

    async def wait(self) -> int:
        """Wait for the child to exit and reap it; return its exit code
        (``-signo`` when a signal killed it). Cancellable."""
        while self.popen.poll() is None:
            if self._pidfd is not None:
                await anyio.wait_readable(self._pidfd)
            else:  # pragma: no cover - without pidfd
                await anyio.sleep(_POLL_SECONDS)
        self._close_pidfd()
        return self.popen.returncode

    def _close_pidfd(self) -> None:
        if self._pidfd is not None:
            os.close(self._pidfd)
            self._pidfd = None

    def signal_group(self, signum: int) -> None:
        """Signal every process of the child's group; nothing if the group
        is empty or holds a member we may not signal."""
        try:
            os.killpg(self.pid, signum)
        except (ProcessLookupError, PermissionError):
            pass

    def group_exists(self) -> bool:
        # Zombie members count until someone reaps them, so under an init
        # that does not reap this stays true until the caller's grace ends.
        try:
            os.killpg(self.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:  # pragma: no cover - a member we may not signal
            return True
        return True

    def close(self) -> None:
        """Close the pipes and let the lifeline forget the group. Call once
        the group has been killed (or is known empty) and no task reads."""
        for stream in (self.popen.stdin, self.popen.stdout, self.popen.stderr):
            if stream is not None:
                try:
                    stream.close()
                except OSError:
                    pass
        self._close_pidfd()
        self._lifeline.unregister(self.pid)


def _check_executable(program: str, env: dict[str, str], cwd: str | None = None) -> None:
    """Raise the ``OSError`` exec would raise for ``program`` (as Popen does,
    a relative path taken from ``cwd``), so a launcher in front of it changes
    no error message."""
    if os.sep in program:
        path: str | None = program if cwd is None else os.path.join(cwd, program)
    else:
        path = shutil.which(program, path=env.get("PATH", os.defpath))
    if path is None or not os.path.exists(path):
        raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), program)
    if os.path.isdir(path) or not os.access(path, os.X_OK):
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), program)


def _start(
    argv: Sequence[str], env: dict[str, str], stdin: bool, spawner: _Spawner, cwd: str | None
) -> subprocess.Popen[bytes]:
    command = list(argv)
    options: dict[str, Any] = {}
    if spawner.setpriv is not None:
        _check_executable(command[0], env, cwd)
        command = [spawner.setpriv, "--pdeathsig", "KILL", "--", *command]
    else:
        options["preexec_fn"] = _child_setup(spawner.pid)
    popen = subprocess.Popen(
        command,
        stdin=subprocess.PIPE if stdin else subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
        close_fds=True,
        env=env,
        cwd=cwd,
        **options,
    )
    spawner.lifeline.register(popen.pid)
    return popen


async def spawn(
    argv: Sequence[str], env: dict[str, str], *, stdin: bool, cwd: str | None = None
) -> Child:
    """Start ``argv`` (no shell) in a new session with ``env``, its stdout and
    stderr piped, its stdin piped when ``stdin`` else ``/dev/null``, in the
    directory ``cwd`` (None: ours; a relative program path is taken from it).

    Raises ``OSError`` when the OS refuses the command (missing, not
    executable, argv or environment too large: ``errno.E2BIG``) and
    ``ValueError`` for an argument the OS cannot take (a NUL character).
    Cancellation while the child is being started waits for the start to
    end, kills the new group and then propagates: no child is left behind.
    """
    spawner = _current_spawner()
    started: list[subprocess.Popen[bytes]] = []

    def start() -> subprocess.Popen[bytes]:
        popen = _start(argv, env, stdin, spawner, cwd)
        started.append(popen)
        return popen

    try:
        popen = await spawner.thread.run(start)
    except BaseException:
        for popen in started:  # cancelled once the child had started: no orphan
            child = Child(popen, spawner.lifeline)
            child.signal_group(signal.SIGKILL)
            popen.wait()
            child.close()
        raise
    return Child(popen, spawner.lifeline)


def is_too_big(exc: BaseException) -> bool:
    """Whether ``exc`` is the OS refusing an argv or environment as too large
    (E2BIG): the same command fails the same way on every attempt."""
    return isinstance(exc, OSError) and exc.errno == errno.E2BIG


RESOURCE_ERRNOS: Final = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.EAGAIN})
"""What starting a command fails with when this machine, not the command,
is short of something: file descriptors (of the process, of the system),
memory, or processes (``fork`` says EAGAIN)."""


def is_resource_shortage(exc: BaseException) -> bool:
    """Whether ``exc`` is a local resource error at spawn: the command was
    never started, through no fault of the dispatch or its destination."""
    return isinstance(exc, OSError) and exc.errno in RESOURCE_ERRNOS


__all__ = [
    "RESOURCE_ERRNOS",
    "Child",
    "is_resource_shortage",
    "is_too_big",
    "lifeline_pid",
    "spawn",
]
