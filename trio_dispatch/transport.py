"""Transports: how one delivery attempt reaches its destination.

A transport is handed a :class:`Delivery` and answers with a
:class:`TransportResult`. It knows processes (or Python callables), not SQL
or statuses: the outbox turns the result into a status change.

:class:`CommandTransport` runs the configured argv template (ADR D3) as a
child process, never through a shell. The child runs in its own process
group; on timeout or cancellation the whole group gets SIGTERM, then SIGKILL
after a short grace (SPEC B6), and captured output is bounded in memory.
:class:`CallableTransport` runs an async Python callable under the same
timeout (SPEC B8).

Every failure a destination can cause -- no template, a missing executable,
a non-zero exit, a timeout, an exception from a callable -- is a failed
:class:`TransportResult`, never an exception. Cancellation from outside is
never swallowed: it propagates after the child's process group is killed.
"""

from __future__ import annotations

import functools
import inspect
import math
import os
import signal
import subprocess
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Final, Protocol, TypeGuard

import anyio
import sniffio
import trio_asyncio
from anyio.abc import ByteReceiveStream, ByteSendStream, Process

__all__ = [
    "DEFAULT_KILL_GRACE_SECONDS",
    "DEFAULT_OUTPUT_LIMIT",
    "LAST_ERROR_LIMIT",
    "NOTIFY_TIMEOUT_SECONDS",
    "CallableTransport",
    "CommandTransport",
    "Delivery",
    "Transport",
    "TransportResult",
    "as_transport",
    "is_valid_template",
    "render_argv",
]

NOTIFY_TIMEOUT_SECONDS: Final = 10.0
LAST_ERROR_LIMIT: Final = 2000
"""Characters of a failure message kept as ``last_error``."""
DEFAULT_KILL_GRACE_SECONDS: Final = 1.0
"""Seconds between SIGTERM and SIGKILL to a transport's process group."""
DEFAULT_OUTPUT_LIMIT: Final = 64 * 1024
"""Bytes kept of each of a child's stdout and stderr; the rest is discarded."""

PAYLOAD_PLACEHOLDER: Final = "{payload}"
DELIVER_TO_PLACEHOLDER: Final = "{deliver_to}"

NOT_CONFIGURED_ERROR: Final = "notify_template is not configured"

_GROUP_POLL_SECONDS: Final = 0.02
_READ_CHUNK: Final = 64 * 1024
_STDIN_CLOSED_ERRORS: Final = (
    anyio.BrokenResourceError,
    anyio.ClosedResourceError,
    BrokenPipeError,
    ConnectionResetError,
)


@dataclass(frozen=True)
class Delivery:
    """What a transport is asked to deliver: one attempt of one dispatch."""

    dispatch_id: str
    kind: str
    deliver_to: str
    attempt: int
    """The row's current attempt, after the claim incremented it."""
    payload: str
    """The stored JSON envelope text, sent as is."""


@dataclass(frozen=True)
class TransportResult:
    """The outcome of one attempt. ``error`` is the text to store as
    ``last_error`` for a failure, already cut to :data:`LAST_ERROR_LIMIT`."""

    ok: bool
    error: str | None = None

    @classmethod
    def success(cls) -> TransportResult:
        return cls(ok=True)

    @classmethod
    def failure(cls, message: str) -> TransportResult:
        """A failure whose message is stripped and cut to the first
        :data:`LAST_ERROR_LIMIT` characters (never empty)."""
        text = message.strip()[:LAST_ERROR_LIMIT]
        return cls(ok=False, error=text or "transport failed without a message")


class Transport(Protocol):
    """Delivers one attempt. Implementations report destination failures as
    a failed :class:`TransportResult` and let cancellation propagate."""

    async def __call__(self, delivery: Delivery) -> TransportResult: ...


def is_valid_template(value: object) -> TypeGuard[list[str]]:
    """True for a non-empty list of str (ADR D3). Anything else -- None, an
    empty list, a str, a list holding a non-str -- is treated as absent."""
    return (
        isinstance(value, list)
        and len(value) > 0
        and all(isinstance(element, str) for element in value)
    )


def render_argv(template: Sequence[str], delivery: Delivery) -> tuple[list[str], bytes | None]:
    """Substitute the delivery into an argv template.

    Only whole elements are substituted: an element exactly ``"{payload}"``
    becomes the payload, exactly ``"{deliver_to}"`` becomes the route; any
    other element (``"x{payload}"`` included) is passed through untouched, so
    data never becomes syntax. Returns ``(argv, stdin)``: ``stdin`` is the
    payload encoded as UTF-8 when no element is ``"{payload}"``, else None.

    Raises UnicodeEncodeError only when the payload is sent on stdin and holds
    a lone surrogate (not valid text).
    """
    argv: list[str] = []
    payload_in_argv = False
    for element in template:
        if element == PAYLOAD_PLACEHOLDER:
            argv.append(delivery.payload)
            payload_in_argv = True
        elif element == DELIVER_TO_PLACEHOLDER:
            argv.append(delivery.deliver_to)
        else:
            argv.append(element)
    stdin = None if payload_in_argv else delivery.payload.encode("utf-8")
    return argv, stdin


def _timeout_message(timeout: float) -> str:
    return f"timeout after {timeout}s"


def _check_timeout(name: str, value: float, *, allow_zero: bool) -> float:
    value = float(value)
    if math.isnan(value) or value < 0 or (value == 0 and not allow_zero):
        allowed = "a number >= 0" if allow_zero else "a number > 0"
        raise ValueError(f"{name} must be {allowed}, got {value!r}")
    return value


def _signal_group(pgid: int, signum: int) -> None:
    # The group may already be empty, or hold a member we may not signal;
    # either way there is nothing more this process can do about it.
    try:
        os.killpg(pgid, signum)
    except (ProcessLookupError, PermissionError):
        pass


def _group_exists(pgid: int) -> bool:
    # Zombie members count until someone reaps them, so under an init that
    # does not reap this stays true until the grace runs out (bounded).
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


async def _read_bounded(stream: ByteReceiveStream, limit: int, sink: bytearray) -> None:
    """Read ``stream`` to EOF, keeping the first ``limit`` bytes in ``sink``.

    The rest is read and dropped so a chatty child never blocks on a full
    pipe and memory stays bounded.
    """
    try:
        async for chunk in stream:
            room = limit - len(sink)
            if room > 0:
                sink += chunk[:room]
    except (anyio.ClosedResourceError, anyio.BrokenResourceError):
        pass


async def _feed_stdin(stream: ByteSendStream, data: bytes) -> None:
    """Write ``data`` then close the stream. A child that does not read its
    stdin (or exits first) is its own business, not a failure."""
    try:
        if data:
            await stream.send(data)
    except _STDIN_CLOSED_ERRORS:
        pass
    finally:
        try:
            await stream.aclose()
        except _STDIN_CLOSED_ERRORS:
            pass


class CommandTransport:
    """Runs the argv template as a child process. Never a shell.

    The payload goes in argv where an element is ``"{payload}"``, else on
    stdin; the route goes where an element is ``"{deliver_to}"``. The child
    gets ``env`` (default: ``os.environ`` at call time) plus
    ``TRIO_DISPATCH_ID``, ``TRIO_DISPATCH_ATTEMPT``, ``TRIO_DISPATCH_KIND``
    and ``TRIO_DISPATCH_DELIVER_TO`` (SPEC B7).

    An absent or invalid template (anything :func:`is_valid_template`
    rejects) is accepted here and reported as a failure on every call (ADR
    D3: a configuration problem is a transport failure, never a crash). A
    tuple of str is accepted as a list.

    ``timeout``, ``kill_grace`` and ``output_limit`` are checked: a value out
    of range raises ValueError naming it.
    """

    def __init__(
        self,
        template: Sequence[str] | None,
        *,
        timeout: float = NOTIFY_TIMEOUT_SECONDS,
        kill_grace: float = DEFAULT_KILL_GRACE_SECONDS,
        output_limit: int = DEFAULT_OUTPUT_LIMIT,
        env: Mapping[str, str] | None = None,
    ) -> None:
        candidate: object = list(template) if isinstance(template, tuple) else template
        self.template: list[str] | None = list(candidate) if is_valid_template(candidate) else None
        self.timeout = _check_timeout("timeout", timeout, allow_zero=False)
        self.kill_grace = _check_timeout("kill_grace", kill_grace, allow_zero=True)
        if isinstance(output_limit, bool) or not isinstance(output_limit, int) or output_limit < 0:
            raise ValueError(f"output_limit must be an int >= 0, got {output_limit!r}")
        self.output_limit = output_limit
        self.env: dict[str, str] | None = None if env is None else dict(env)

    def __repr__(self) -> str:
        return f"CommandTransport({self.template!r}, timeout={self.timeout!r})"

    def _child_env(self, delivery: Delivery) -> dict[str, str]:
        env = dict(os.environ if self.env is None else self.env)
        env["TRIO_DISPATCH_ID"] = delivery.dispatch_id
        env["TRIO_DISPATCH_ATTEMPT"] = str(delivery.attempt)
        env["TRIO_DISPATCH_KIND"] = delivery.kind
        env["TRIO_DISPATCH_DELIVER_TO"] = delivery.deliver_to
        return env

    async def __call__(self, delivery: Delivery) -> TransportResult:
        """Run one attempt and report how it went.

        Exit 0 is success. A non-zero exit is a failure carrying the stripped
        stderr (UTF-8, undecodable bytes replaced), or ``exit <code>`` when
        stderr is empty; a child killed by a signal reports ``exit -<signo>``.
        A missing template, an executable that cannot be run, or a NUL
        character in an argument or environment value is a failure too.

        The child runs in its own process group. After it exits, anything it
        left running in that group is SIGKILLed, so nothing outlives the
        attempt and the output pipes reach EOF. On ``timeout`` the group gets
        SIGTERM, then SIGKILL once ``kill_grace`` has passed with anything
        left, and the result is ``timeout after <timeout>s``.

        Cancellation: if the caller's scope is cancelled while the child runs,
        the group is killed the same way inside a shielded scope (bounded by
        ``kill_grace + 1`` seconds) and the cancellation propagates.
        """
        if self.template is None:
            return TransportResult.failure(NOT_CONFIGURED_ERROR)
        try:
            argv, stdin_data = render_argv(self.template, delivery)
        except UnicodeEncodeError as exc:
            return TransportResult.failure(f"payload is not valid text: {exc}")
        env = self._child_env(delivery)
        if any("\x00" in element for element in argv):
            return TransportResult.failure("cannot execute: an argument contains a NUL character")
        if any("\x00" in key or "\x00" in value for key, value in env.items()):
            return TransportResult.failure(
                "cannot execute: an environment value contains a NUL character"
            )

        try:
            process = await anyio.open_process(
                argv,
                stdin=subprocess.PIPE if stdin_data is not None else subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                start_new_session=True,
                env=env,
            )
        except OSError as exc:
            return TransportResult.failure(f"cannot execute {argv[0]!r}: {exc.strerror or exc}")
        except ValueError as exc:  # e.g. an environment name holding "="
            return TransportResult.failure(f"cannot execute {argv[0]!r}: {exc}")

        group_stopped = False
        try:
            stdout = bytearray()
            stderr = bytearray()
            returncode: int | None = None
            timed_out = False
            async with anyio.create_task_group() as tg:
                assert process.stdout is not None and process.stderr is not None
                tg.start_soon(_read_bounded, process.stdout, self.output_limit, stdout)
                tg.start_soon(_read_bounded, process.stderr, self.output_limit, stderr)
                if stdin_data is not None:
                    assert process.stdin is not None
                    tg.start_soon(_feed_stdin, process.stdin, stdin_data)

                with anyio.move_on_after(self.timeout):
                    returncode = await process.wait()
                if returncode is None:
                    timed_out = True
                    # Readers keep draining meanwhile, so a child writing on
                    # its way out is not stuck on a full pipe during the grace.
                    await self._stop_process_group(process)
                else:
                    # Whatever the child left behind in its group would hold
                    # our pipes open and outlive the attempt.
                    _signal_group(process.pid, signal.SIGKILL)
                group_stopped = True
                # Pipes reach EOF now, unless something escaped the group
                # (its own setsid) still holds them: stop reading after a grace.
                tg.cancel_scope.deadline = min(
                    tg.cancel_scope.deadline, anyio.current_time() + self.kill_grace
                )
        finally:
            if not group_stopped:
                with anyio.CancelScope(shield=True):
                    await self._stop_process_group(process)
            await self._close_process(process)

        if timed_out:
            return TransportResult.failure(_timeout_message(self.timeout))
        if returncode == 0:
            return TransportResult.success()
        text = stderr.decode("utf-8", errors="replace").strip()
        return TransportResult.failure(text or f"exit {returncode}")

    async def _stop_process_group(self, process: Process) -> None:
        """SIGTERM the child's group, give it ``kill_grace`` to leave, then
        SIGKILL whatever is left and reap the child. Bounded by
        ``kill_grace + 1`` seconds even for a child that cannot be killed."""
        pgid = process.pid
        with anyio.move_on_after(self.kill_grace + 1.0):
            _signal_group(pgid, signal.SIGTERM)
            with anyio.move_on_after(self.kill_grace):
                await process.wait()
                # Nothing signals "the group is empty", so poll.
                while _group_exists(pgid):  # noqa: ASYNC110
                    await anyio.sleep(_GROUP_POLL_SECONDS)
            _signal_group(pgid, signal.SIGKILL)
            await process.wait()

    @staticmethod
    async def _close_process(process: Process) -> None:
        # Process.aclose() waits for the child; only call it once the child
        # is reaped, so closing can never hang on a process we failed to kill.
        with anyio.CancelScope(shield=True):
            if process.returncode is not None:
                await process.aclose()
                return
            for stream in (process.stdin, process.stdout, process.stderr):
                if stream is not None:
                    await stream.aclose()


TransportCallable = Callable[[Delivery], Awaitable[object]]


def _describe(exc: Exception) -> str:
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


class CallableTransport:
    """Wraps ``async def fn(delivery: Delivery) -> object`` as a transport.

    Returning ``False`` is the failure ``transport returned False``; returning
    a :class:`TransportResult` reports it as is; returning anything else is
    success. An exception (not a cancellation) is a failure whose message is
    ``f"{type(exc).__name__}: {exc}"``. The call runs under ``timeout``;
    running past it is the failure ``timeout after <timeout>s``.

    Cancellation from outside propagates unchanged.
    """

    def __init__(self, fn: TransportCallable, *, timeout: float = NOTIFY_TIMEOUT_SECONDS) -> None:
        if not callable(fn):
            raise TypeError(f"transport callable must be callable, got {fn!r}")
        self.fn = fn
        self.timeout = _check_timeout("timeout", timeout, allow_zero=False)

    def __repr__(self) -> str:
        return f"CallableTransport({self.fn!r}, timeout={self.timeout!r})"

    async def __call__(self, delivery: Delivery) -> TransportResult:
        outcome: object = None
        with anyio.move_on_after(self.timeout) as scope:
            try:
                outcome = await self._invoke(delivery)
            except Exception as exc:
                return TransportResult.failure(_describe(exc))
        if scope.cancelled_caught:
            return TransportResult.failure(_timeout_message(self.timeout))
        if outcome is False:
            return TransportResult.failure("transport returned False")
        if isinstance(outcome, TransportResult):
            return outcome
        return TransportResult.success()


    async def _invoke(self, delivery: Delivery) -> object:
        return await self.fn(delivery)


class AsyncioCallableTransport(CallableTransport):
    """A :class:`CallableTransport` for a callable written for asyncio (one
    that uses ``asyncio.sleep``, asyncio streams or an asyncio client).

    Under asyncio it is awaited directly. Under trio it runs through
    trio-asyncio: on the loop of an enclosing ``trio_asyncio.open_loop()``
    (:class:`~trio_dispatch.worker.DispatchWorker` opens one for its whole
    run), else on a loop opened for this one call. Trio cancellation and the
    timeout reach the asyncio task as an asyncio cancellation.
    """

    needs_asyncio_loop: Final = True

    async def _invoke(self, delivery: Delivery) -> object:
        if sniffio.current_async_library() != "trio":
            return await self.fn(delivery)
        if trio_asyncio.current_loop.get() is not None:
            return await trio_asyncio.aio_as_trio(self.fn)(delivery)
        async with trio_asyncio.open_loop():
            return await trio_asyncio.aio_as_trio(self.fn)(delivery)


def asyncio_transport(
    fn: TransportCallable, *, timeout: float = NOTIFY_TIMEOUT_SECONDS
) -> AsyncioCallableTransport:
    """Mark an asyncio-only async callable as a transport (SPEC B8), so a
    trio worker runs it through trio-asyncio."""
    return AsyncioCallableTransport(fn, timeout=timeout)


def needs_asyncio_loop(transport: object) -> bool:
    """Whether ``transport`` must run inside a trio-asyncio loop under trio."""
    return bool(getattr(transport, "needs_asyncio_loop", False))


def _is_async_callable(value: object) -> bool:
    if not callable(value):
        return False
    return inspect.iscoroutinefunction(value) or inspect.iscoroutinefunction(type(value).__call__)


def as_transport(value: object, *, timeout: float = NOTIFY_TIMEOUT_SECONDS) -> Transport:
    """The transport for a configured value.

    - ``None``, a list or a tuple: a :class:`CommandTransport` with
      ``timeout`` (an invalid template fails at delivery time, not here);
    - an instance of a class with an ``async def __call__`` (a
      :class:`Transport`, including :class:`CommandTransport` and
      :class:`CallableTransport`): returned as is, keeping its own timeout;
    - any other async callable: wrapped in a :class:`CallableTransport` with
      ``timeout``.

    Anything else raises TypeError naming the value.
    """
    if value is None or isinstance(value, list | tuple):
        return CommandTransport(value, timeout=timeout)
    if isinstance(value, CommandTransport | CallableTransport):
        return value
    is_plain_callable = inspect.isroutine(value) or isinstance(value, functools.partial)
    if _is_async_callable(value):
        if is_plain_callable:
            return CallableTransport(value, timeout=timeout)  # type: ignore[arg-type]
        return value  # type: ignore[return-value]
    raise TypeError(
        "transport must be an argv template (a non-empty list of str), None, "
        f"or an async callable taking a Delivery; got {value!r}"
    )
