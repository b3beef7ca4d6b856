"""The command transport: the configured argv template run as a child
process (docs/guarantees.md), never through a shell.

The child runs in its own process group and never outlives the worker (see
:mod:`.process`); on timeout or cancellation the whole group gets SIGTERM,
then SIGKILL after a short grace (docs/guarantees.md), and captured output is bounded in
memory. Its environment follows :class:`ChildEnvironment` (docs/security.md).
"""

from __future__ import annotations

import dataclasses
import errno
import os
import re
import shutil
import signal
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, TypeGuard

import anyio

from .. import tracing
from ..redact import looks_secret, visible
from ..validate import require_bool, require_number
from ..values import show
from .base import (
    TRANSPORT_TIMEOUT_SECONDS,
    BaseTransport,
    Delivery,
    TransportResult,
    check_timeout,
    timeout_message,
)
from .plugins import Option, PluginContext
from .process import Child, is_resource_shortage, is_too_big, spawn

DEFAULT_KILL_GRACE_SECONDS: Final = 1.0
"""Seconds between SIGTERM and SIGKILL to a transport's process group."""
DEFAULT_OUTPUT_LIMIT: Final = 64 * 1024
"""Bytes kept of each of a child's stdout and stderr; the rest is discarded."""

PAYLOAD_PLACEHOLDER: Final = "{payload}"
DELIVER_TO_PLACEHOLDER: Final = "{deliver_to}"

NOT_CONFIGURED_ERROR: Final = "notify_template is not configured"

_GROUP_POLL_SECONDS: Final = 0.02
_READ_CHUNK: Final = 64 * 1024


@dataclass(frozen=True)
class ChildEnvironment:
    """Which of the worker's environment variables a command's child gets
    (docs/security.md; configuration ``dispatch.env``).

    - default: all of them except those that :func:`looks_secret`;
    - ``allow``: exactly these names (secret-looking or not), nothing else;
    - ``inherit=True``: all of them, secrets included (the explicit opt-out).

    The ``TRIO_DISPATCH_*`` variables of the attempt are always set on top.
    """

    allow: tuple[str, ...] | None = None
    inherit: bool = False
    drop: frozenset[str] = field(default_factory=frozenset)
    """Names dropped in the default mode whatever they look like: a worker
    built from a configuration file fills it with every variable the file
    reads a secret from (``env:NAME``: the dashboard token, webhook
    secrets), so the worker's own credentials never reach a child."""

    def __post_init__(self) -> None:
        if self.allow is not None and self.inherit:
            raise ValueError(
                "dispatch.env: give either allow (a list of names) or inherit: true, not both"
            )

    def build(self, base: Mapping[str, str]) -> dict[str, str]:
        if self.inherit:
            return dict(base)
        if self.allow is not None:
            return {name: base[name] for name in self.allow if name in base}
        return {
            name: value
            for name, value in base.items()
            if name not in self.drop and not looks_secret(name, value)
        }


EX_TEMPFAIL: Final = 75
"""The exit code (sysexits.h) by which a command says its destination
asks to be left alone for a while: a throttle (docs/destinations.md)."""
_RETRY_AFTER_LINE: Final = re.compile(r"retry-after:[ \t]*([0-9]{1,10}(?:\.[0-9]{1,6})?)", re.I)


def retry_after_line(stdout: bytes | bytearray) -> float | None:
    """The delay of a throttling command: the seconds its last stdout line
    says as ``Retry-After: N`` (a non-negative number; blank lines after
    it and surrounding spaces ignored). None when the last line says
    anything else -- or when stdout ran past the bytes kept, since its last
    line was then never seen."""
    lines = stdout.decode("utf-8", errors="replace").strip().splitlines()
    if not lines:
        return None
    match = _RETRY_AFTER_LINE.fullmatch(lines[-1].strip())
    return None if match is None else float(match.group(1))


OUTPUT_BYTES: Final = 4 * 200
"""Bytes of a successful child's stdout decoded for the log line (at most
200 characters of them are kept)."""


def template_warnings(template: Sequence[str] | None) -> list[str]:
    """What in an argv template could let a dispatch's data change the
    command's meaning or leak: a placeholder not after a ``--`` element (a
    route such as ``--help`` would be read as an option) and ``{payload}``
    in argv (readable by any local user in ``/proc/<pid>/cmdline``, ack
    token included). Empty for a safe template."""
    if not template:
        return []
    warnings = []
    separated = False
    for index, element in enumerate(template):
        if index > 0 and element == "--":
            separated = True
        elif element in (PAYLOAD_PLACEHOLDER, DELIVER_TO_PLACEHOLDER) and not separated:
            warnings.append(
                f"notify_template[{index}] {element} can be read as an option by the command "
                "(a value starting with '-'): put '--' before it"
            )
    if PAYLOAD_PLACEHOLDER in template:
        warnings.append(
            "notify_template puts {payload} in argv, where any local user can read it (ack "
            "token included) in /proc/<pid>/cmdline: leave it out to send the payload on stdin"
        )
    return warnings


_INTERPRETER: Final = re.compile(r"^(python[0-9.]*|node|ruby|perl|php|bash|sh|dash|zsh)$")
_SCRIPT_SUFFIXES: Final = (".py", ".js", ".mjs", ".rb", ".pl", ".php", ".sh")


def program_warnings(
    template: Sequence[str] | None, *, cwd: str | None = None, path: str | None = None
) -> list[str]:
    """What would make every attempt fail before the command starts: its
    program (``template[0]``) missing or not executable -- a relative path is
    taken from ``cwd`` (the configuration file's folder for a worker started
    from one), a bare name looked up on ``path`` (default ``$PATH``) -- and,
    for an interpreter such as ``python3``, a script argument that does not
    exist. Empty when both are found. Never raises."""
    if not template:
        return []
    base = cwd or os.getcwd()
    where = f" (relative paths are taken from {base})"
    program = template[0]
    warnings = []
    if os.sep in program:
        full = os.path.join(base, os.path.expanduser(program))
        if not os.path.exists(full):
            warnings.append(f"notify_template[0] {program!r} does not exist{where}")
        elif os.path.isdir(full) or not os.access(full, os.X_OK):
            warnings.append(f"notify_template[0] {program!r} is not an executable file{where}")
    elif shutil.which(program, path=path or os.environ.get("PATH", os.defpath)) is None:
        warnings.append(f"notify_template[0] {program!r} is not found on PATH")
    if _INTERPRETER.match(os.path.basename(program)) and len(template) > 1:
        script = template[1]
        looks_like_script = os.sep in script or script.endswith(_SCRIPT_SUFFIXES)
        if looks_like_script and not script.startswith("-") and "{" not in script:
            if not os.path.exists(os.path.join(base, os.path.expanduser(script))):
                warnings.append(f"notify_template[1] {script!r} does not exist{where}")
    return warnings


def is_valid_template(value: object) -> TypeGuard[list[str]]:
    """True for a non-empty list of str (docs/guarantees.md). Anything else -- None, an
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


async def _read_bounded(fd: int, limit: int, sink: bytearray) -> None:
    """Read the pipe ``fd`` to EOF, keeping the first ``limit`` bytes in
    ``sink``. The rest is read and dropped so a chatty child never blocks on
    a full pipe and memory stays bounded."""
    while True:
        try:
            chunk = os.read(fd, _READ_CHUNK)
        except BlockingIOError:
            await anyio.wait_readable(fd)
            continue
        except OSError:
            return
        if not chunk:
            return
        room = limit - len(sink)
        if room > 0:
            sink += chunk[:room]


async def _feed_stdin(fd: int, data: bytes) -> None:
    """Write ``data`` to the pipe ``fd``. A child that does not read its
    stdin (or exits first) is its own business, not a failure; the caller
    closes the pipe."""
    view = memoryview(data)
    while view:
        try:
            written = os.write(fd, view)
        except BlockingIOError:
            await anyio.wait_writable(fd)
            continue
        except OSError:  # EPIPE: the child closed its end
            return
        view = view[written:]


class CommandTransport(BaseTransport):
    """Runs the argv template as a child process. Never a shell.

    The payload goes in argv where an element is ``"{payload}"``, else on
    stdin; the route goes where an element is ``"{deliver_to}"``. The child
    gets the environment :class:`ChildEnvironment` builds from ``env``
    (default: ``os.environ`` at call time) -- by default without variables
    that look like secrets -- plus ``TRIO_DISPATCH_ID``,
    ``TRIO_DISPATCH_ATTEMPT``, ``TRIO_DISPATCH_KIND`` and
    ``TRIO_DISPATCH_DELIVER_TO`` (docs/security.md). It never outlives the worker
    process (see :mod:`trio_dispatch.process`).

    An absent or invalid template (anything :func:`is_valid_template`
    rejects) is accepted here and reported as a failure on every call (a
    configuration problem is a transport failure, never a crash:
    docs/guarantees.md). A
    tuple of str is accepted as a list.

    ``timeout``, ``kill_grace`` and ``output_limit`` are checked: a value out
    of range raises ValueError naming it.
    """

    def __init__(
        self,
        template: Sequence[str] | None,
        *,
        timeout: float = TRANSPORT_TIMEOUT_SECONDS,
        kill_grace: float = DEFAULT_KILL_GRACE_SECONDS,
        output_limit: int = DEFAULT_OUTPUT_LIMIT,
        env: Mapping[str, str] | None = None,
        child_env: ChildEnvironment | None = None,
        cwd: str | os.PathLike[str] | None = None,
    ) -> None:
        candidate: object = list(template) if isinstance(template, tuple) else template
        self.template: list[str] | None = list(candidate) if is_valid_template(candidate) else None
        self.timeout = check_timeout("timeout", timeout, allow_zero=False)
        self.kill_grace = check_timeout("kill_grace", kill_grace, allow_zero=True)
        if isinstance(output_limit, bool) or not isinstance(output_limit, int) or output_limit < 0:
            raise ValueError(f"output_limit must be an int >= 0, got {output_limit!r}")
        self.output_limit = output_limit
        self.env: dict[str, str] | None = None if env is None else dict(env)
        self.child_env = child_env or ChildEnvironment()
        self.cwd: str | None = None if cwd is None else os.fspath(cwd)
        """The directory the command runs in (and a relative program path is
        taken from); None: the worker's own. A worker built from a
        configuration file runs it in that file's folder."""

    def __repr__(self) -> str:
        return f"CommandTransport({self.template!r}, timeout={self.timeout!r})"

    def _child_env(self, delivery: Delivery) -> dict[str, str]:
        env = self.child_env.build(os.environ if self.env is None else self.env)
        env["TRIO_DISPATCH_ID"] = delivery.dispatch_id
        env["TRIO_DISPATCH_ATTEMPT"] = str(delivery.attempt)
        env["TRIO_DISPATCH_KIND"] = delivery.kind
        env["TRIO_DISPATCH_DELIVER_TO"] = delivery.deliver_to
        if tracing.ACTIVE:  # the attempt's span, as TRACEPARENT (docs/tracing.md)
            tracing.inject_environment(env)
        return env

    async def __call__(self, delivery: Delivery) -> TransportResult:
        """Run one attempt and report how it went.

        Exit 0 is success. Exit 75 (EX_TEMPFAIL) is a throttle: the
        destination asks to be left alone, for the seconds a last stdout
        line ``Retry-After: N`` gives (without one: the row's next backoff
        step). Any other non-zero exit is a failure carrying the stripped
        stderr (UTF-8, undecodable bytes replaced), or ``exit <code>`` when
        stderr is empty; a child killed by a signal reports ``exit -<signo>``.
        A missing template, an executable that cannot be run, or a NUL
        character in an argument or environment value is a failure too. An
        argv or environment the OS refuses as too large (E2BIG) is a
        *permanent* failure: the same attempt can never succeed. A local
        resource error at the start (EMFILE, ENFILE, ENOMEM, EAGAIN: this
        machine is short of descriptors, memory or processes) is no failure
        of the dispatch: the result is :meth:`TransportResult.not_sent`.

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
            child = await spawn(argv, env, stdin=stdin_data is not None, cwd=self.cwd)
        except OSError as exc:
            if is_too_big(exc):
                size = sum(len(a.encode("utf-8", "surrogateescape")) + 1 for a in argv) + sum(
                    len(k) + len(v.encode("utf-8", "surrogateescape")) + 2 for k, v in env.items()
                )
                return TransportResult.failure(
                    f"cannot execute {argv[0]!r}: the OS refuses an argv and environment of "
                    f"{size:,} bytes as too large (E2BIG); no retry can succeed",
                    permanent=True,
                )
            if is_resource_shortage(exc):
                name = errno.errorcode.get(exc.errno or 0, "OSError")
                return TransportResult.not_sent(
                    f"local resource error starting {argv[0]!r}: {exc.strerror or exc} ({name}); "
                    "not sent, attempt not counted"
                )
            return TransportResult.failure(f"cannot execute {argv[0]!r}: {exc.strerror or exc}")
        except (ValueError, UnicodeEncodeError) as exc:  # "=" in a name, a lone surrogate
            return TransportResult.failure(f"cannot execute {argv[0]!r}: {exc}")

        group_stopped = False
        try:
            stdout = bytearray()
            stderr = bytearray()
            returncode: int | None = None
            timed_out = False
            async with anyio.create_task_group() as tg:
                assert child.stdout is not None and child.stderr is not None
                tg.start_soon(_read_bounded, child.stdout, self.output_limit, stdout)
                tg.start_soon(_read_bounded, child.stderr, self.output_limit, stderr)
                if stdin_data is not None:
                    assert child.stdin is not None
                    tg.start_soon(_feed_stdin_and_close, child, stdin_data)

                with anyio.move_on_after(self.timeout):
                    returncode = await child.wait()
                if returncode is None:
                    timed_out = True
                    # Readers keep draining meanwhile, so a child writing on
                    # its way out is not stuck on a full pipe during the grace.
                    await self._stop_process_group(child)
                else:
                    # Whatever the child left behind in its group would hold
                    # our pipes open and outlive the attempt.
                    child.signal_group(signal.SIGKILL)
                group_stopped = True
                # Pipes reach EOF now, unless something escaped the group
                # (its own setsid) still holds them: stop reading after a grace.
                tg.cancel_scope.deadline = min(
                    tg.cancel_scope.deadline, anyio.current_time() + self.kill_grace
                )
        finally:
            if not group_stopped:
                with anyio.CancelScope(shield=True):
                    await self._stop_process_group(child)
            child.close()

        if timed_out:
            return TransportResult.failure(timeout_message(self.timeout))
        if returncode == 0:
            return TransportResult.success(stdout[:OUTPUT_BYTES].decode("utf-8", errors="replace"))
        text = stderr.decode("utf-8", errors="replace").strip()
        if returncode == EX_TEMPFAIL:
            complete = len(stdout) < self.output_limit
            return TransportResult.throttle(
                text or f"exit {returncode} (EX_TEMPFAIL)",
                retry_after=retry_after_line(stdout) if complete else None,
            )
        return TransportResult.failure(text or f"exit {returncode}")

    async def _stop_process_group(self, child: Child) -> None:
        """SIGTERM the child's group, give it ``kill_grace`` to leave, then
        SIGKILL whatever is left and reap the child. Bounded by
        ``kill_grace + 1`` seconds even for a child that cannot be killed."""
        with anyio.move_on_after(self.kill_grace + 1.0):
            child.signal_group(signal.SIGTERM)
            with anyio.move_on_after(self.kill_grace):
                await child.wait()
                # Nothing signals "the group is empty", so poll.
                while child.group_exists():  # noqa: ASYNC110
                    await anyio.sleep(_GROUP_POLL_SECONDS)
            child.signal_group(signal.SIGKILL)
            await child.wait()


async def _feed_stdin_and_close(child: Child, data: bytes) -> None:
    assert child.stdin is not None and child.popen.stdin is not None
    try:
        await _feed_stdin(child.stdin, data)
    finally:
        try:
            child.popen.stdin.close()  # EOF for the child
        except OSError:
            pass


# -- configuration (dispatch.transport: command) ------------------------------------

_ENV_NAME: Final = re.compile(r"^[^=\x00]+$")
MIN_TIMEOUT_SECONDS: Final = 0.001


def _check_template(key: str, value: object) -> tuple[str, ...] | None:
    if value is None:
        return None
    if not is_valid_template(value):
        raise ValueError(f"{key} must be a non-empty list of strings or null, got {show(value)}")
    return tuple(value)


def _check_timeout(key: str, value: object) -> float:
    return require_number(key, value, minimum=MIN_TIMEOUT_SECONDS)


def _check_env(key: str, value: object) -> ChildEnvironment:
    if value is None:
        return ChildEnvironment()
    if not isinstance(value, Mapping):
        raise ValueError(
            f"{key} must be a mapping (allow: [NAME, ...] or inherit: true), got {show(value)}"
        )
    unknown = [str(name) for name in value if name not in ("allow", "inherit")]
    if unknown:
        raise ValueError(f"unknown key {show(key + '.' + unknown[0])} (allowed: allow, inherit)")
    allow = value.get("allow")
    inherit = require_bool(f"{key}.inherit", value.get("inherit", False))
    if allow is not None:
        if not isinstance(allow, list) or not all(
            isinstance(name, str) and _ENV_NAME.match(name) for name in allow
        ):
            raise ValueError(
                f"{key}.allow must be a list of environment variable names, got {show(allow)}"
            )
        if inherit:
            raise ValueError(
                f"{key}: give either allow (a list of names) or inherit: true, not both"
            )
        return ChildEnvironment(allow=tuple(allow))
    return ChildEnvironment(inherit=inherit)


@dataclass(frozen=True)
class CommandOptions:
    """``dispatch.notify_template``, ``dispatch.timeout_seconds`` and
    ``dispatch.env``, checked."""

    notify_template: tuple[str, ...] | None = None
    timeout_seconds: float = TRANSPORT_TIMEOUT_SECONDS
    env: ChildEnvironment = field(default_factory=ChildEnvironment)


class CommandPlugin:
    """The command transport's configuration: its keys sit in ``dispatch``
    itself (the first transport's, kept where they have always been)."""

    name = "command"
    section = None
    requires: tuple[str, ...] = ()
    extra = ""
    options: Final = {
        "notify_template": Option(_check_template, None),
        "timeout_seconds": Option(_check_timeout, TRANSPORT_TIMEOUT_SECONDS),
        "env": Option(_check_env, None),
    }

    def build(self, values: Mapping[str, Any], context: PluginContext) -> CommandOptions:
        # The variables the file reads its own secrets from never reach a child.
        env = dataclasses.replace(values["env"], drop=context.secret_variables)
        return CommandOptions(values["notify_template"], values["timeout_seconds"], env)

    def problems(self, options: CommandOptions, context: PluginContext) -> list[str]:
        return []

    def timeout(self, options: CommandOptions) -> float:
        return options.timeout_seconds

    def worker_arguments(self, options: CommandOptions, context: PluginContext) -> dict[str, Any]:
        template = options.notify_template
        return {
            "notify_template": None if template is None else list(template),
            "child_env": options.env,
            # Relative paths in the template are from the file's folder, as
            # the store's are, whatever directory the worker starts in.
            "command_cwd": None if context.folder is None else str(context.folder),
        }

    def describe(self, options: CommandOptions) -> dict[str, Any]:
        env = options.env
        shown: dict[str, Any] = (
            {"inherit": True}
            if env.inherit
            else {"allow": list(env.allow)}
            if env.allow is not None
            else {
                "default": "all but secret-looking variables",
                # The variables the file reads secrets from (env:NAME): never passed.
                "dropped": sorted(env.drop),
            }
        )
        template = options.notify_template
        return {
            "notify_template": None if template is None else list(template),
            "timeout_seconds": options.timeout_seconds,
            "env": shown,
        }

    def summary(self, options: CommandOptions) -> list[str]:
        template = options.notify_template
        shown = visible(list(template)) if template else "not configured"
        return [
            f"  transport: command (timeout {options.timeout_seconds:g}s)",
            f"  notify_template: {shown}",
        ]

    def warnings(self, options: CommandOptions, context: PluginContext) -> list[str]:
        template = options.notify_template
        if template is None:
            return [
                "dispatch.notify_template is not set: with transport: command every delivery "
                "fails (as a recorded transport failure) until it is"
            ]
        cwd = None if context.folder is None else str(context.folder)
        return template_warnings(template) + program_warnings(template, cwd=cwd)


COMMAND_PLUGIN: Final = CommandPlugin()
