"""Transport behaviour against real child processes (no mocks).

Child scripts are written into ``tmp_path`` and run with ``sys.executable``;
assertions are on the result and on files the children wrote.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import textwrap
import time
from collections.abc import Sequence
from pathlib import Path

import anyio
import pytest

from trio_dispatch.transports import (
    LAST_ERROR_LIMIT,
    BaseTransport,
    CallableTransport,
    CommandTransport,
    Delivery,
    Transport,
    TransportResult,
    as_transport,
    is_valid_template,
    render_argv,
)

PAYLOAD = '{"schema_version": 1, "kind": "ping", "body": {"text": "h\\u00e9llo"}}'


def make_delivery(
    *,
    payload: str = PAYLOAD,
    deliver_to: str = "ops/alerts",
    attempt: int = 3,
    kind: str = "ping",
    dispatch_id: str = "0123456789abcdef0123456789abcdef",
) -> Delivery:
    return Delivery(
        dispatch_id=dispatch_id,
        kind=kind,
        deliver_to=deliver_to,
        attempt=attempt,
        payload=payload,
    )


def write_script(tmp_path: Path, name: str, body: str) -> Path:
    script = tmp_path / name
    script.write_text(textwrap.dedent(body))
    return script


def command(script: Path, *extra: str) -> list[str]:
    return [sys.executable, str(script), *extra]


# Writes its pid (atomically) to argv[1], spawns `sleep 300` that inherits our
# pipes, writes that pid to argv[2], then does what argv[3] says.
SPAWNING_CHILD = """
    import os, signal, subprocess, sys, time

    def publish(path, value):
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            f.write(str(value))
        os.replace(tmp, path)

    mode = sys.argv[3]
    if mode == "ignore-term":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    grandchild = subprocess.Popen(["sleep", "300"])
    publish(sys.argv[2], grandchild.pid)
    publish(sys.argv[1], os.getpid())
    if mode == "exit":
        sys.exit(0)
    time.sleep(300)
"""


def process_gone(pid: int) -> bool:
    """Dead counts as gone: an orphan may stay a zombie until init reaps it."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return True
    except OSError:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        return False
    state = stat.rsplit(")", 1)[1].split()[0]
    return state in ("Z", "X")


async def wait_until_gone(pid: int, within: float = 3.0) -> bool:
    with anyio.move_on_after(within):
        while not process_gone(pid):
            await anyio.sleep(0.02)
    return process_gone(pid)


def read_pid(path: Path) -> int:
    return int(path.read_text())


# -- pure functions -----------------------------------------------------------


def test_render_argv_substitutes_whole_elements_only() -> None:
    delivery = make_delivery()
    argv, stdin = render_argv(
        ["notify", "{deliver_to}", "{payload}", "x{payload}", "{deliver_to}/y", "{PAYLOAD}"],
        delivery,
    )
    assert argv == [
        "notify",
        delivery.deliver_to,
        delivery.payload,
        "x{payload}",
        "{deliver_to}/y",
        "{PAYLOAD}",
    ]
    assert stdin is None


def test_render_argv_sends_payload_on_stdin_when_no_payload_element() -> None:
    delivery = make_delivery(payload='{"text": "h\u00e9llo \u2603"}')
    argv, stdin = render_argv(["notify", "{deliver_to}", "x{payload}"], delivery)
    assert argv == ["notify", delivery.deliver_to, "x{payload}"]
    assert stdin == delivery.payload.encode("utf-8")


@pytest.mark.parametrize(
    ("value", "valid"),
    [
        (["notify"], True),
        (["notify", "{deliver_to}", "{payload}"], True),
        (None, False),
        ([], False),
        ("notify {payload}", False),
        (("notify",), False),
        (["notify", 1], False),
        (["notify", None], False),
        ({"cmd": "notify"}, False),
    ],
)
def test_is_valid_template_accepts_only_non_empty_list_of_str(value: object, valid: bool) -> None:
    assert is_valid_template(value) is valid


def test_transport_result_failure_strips_and_cuts_to_limit() -> None:
    assert TransportResult.success() == TransportResult(ok=True, error=None)
    assert TransportResult.failure("  boom \n") == TransportResult(ok=False, error="boom")
    long = TransportResult.failure("\n" + "e" * (LAST_ERROR_LIMIT + 500))
    assert long.error == "e" * LAST_ERROR_LIMIT


# -- configuration and spawning failures --------------------------------------


@pytest.mark.anyio
@pytest.mark.parametrize(
    "template",
    [None, [], "echo {payload}", ["echo", 1], ["echo", None], {"cmd": "echo"}],
    ids=["none", "empty", "str", "int-element", "none-element", "dict"],
)
async def test_missing_or_invalid_template_is_a_failure_not_an_exception(
    template: object,
) -> None:
    transport = CommandTransport(template)  # type: ignore[arg-type]
    result = await transport(make_delivery())
    assert result == TransportResult(ok=False, error="notify_template is not configured")


@pytest.mark.anyio
async def test_missing_executable_is_a_recorded_failure(tmp_path: Path) -> None:
    result = await CommandTransport(["nosuchcmd-trio-dispatch", "{payload}"])(make_delivery())
    assert result == TransportResult(
        ok=False, error="cannot execute 'nosuchcmd-trio-dispatch': No such file or directory"
    )

    not_executable = tmp_path / "plain.txt"
    not_executable.write_text("not a program")
    result = await CommandTransport([str(not_executable)])(make_delivery())
    assert result == TransportResult(
        ok=False, error=f"cannot execute {str(not_executable)!r}: Permission denied"
    )


@pytest.mark.anyio
async def test_nul_character_in_argv_or_environment_is_a_failure(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    script = write_script(tmp_path, "touch.py", "import sys; open(sys.argv[1], 'w').close()\n")
    transport = CommandTransport(command(script, str(marker), "{payload}"))

    in_argv = await transport(make_delivery(payload="a\x00b"))
    assert not in_argv.ok
    assert in_argv.error is not None and "NUL" in in_argv.error

    # The route always reaches the environment, even when not in argv.
    in_env = await transport(make_delivery(deliver_to="ops\x00alerts"))
    assert not in_env.ok
    assert in_env.error is not None and "NUL" in in_env.error
    assert not marker.exists()


# -- exit status and output ---------------------------------------------------


@pytest.mark.anyio
async def test_exit_zero_is_success(tmp_path: Path) -> None:
    script = write_script(tmp_path, "ok.py", "print('delivered')\n")
    result = await CommandTransport(command(script, "{payload}"))(make_delivery())
    assert result == TransportResult(ok=True, error=None)
    assert result.output == "delivered"  # kept for the worker's log line, not stored


@pytest.mark.anyio
async def test_nonzero_exit_reports_stripped_stderr(tmp_path: Path) -> None:
    script = write_script(
        tmp_path,
        "fail.py",
        """
        import sys
        print("noise on stdout")
        sys.stderr.write("\\n  destination refused: 503  \\n\\n")
        sys.exit(4)
        """,
    )
    result = await CommandTransport(command(script))(make_delivery())
    assert result == TransportResult(ok=False, error="destination refused: 503")


@pytest.mark.anyio
async def test_nonzero_exit_without_stderr_reports_exit_code(tmp_path: Path) -> None:
    script = write_script(
        tmp_path, "quiet.py", "import sys; sys.stderr.write(' \\n'); sys.exit(3)\n"
    )
    result = await CommandTransport(command(script))(make_delivery())
    assert result == TransportResult(ok=False, error="exit 3")


@pytest.mark.anyio
async def test_child_killed_by_signal_reports_negative_exit(tmp_path: Path) -> None:
    script = write_script(
        tmp_path, "die.py", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    result = await CommandTransport(command(script))(make_delivery())
    assert result == TransportResult(ok=False, error=f"exit -{int(signal.SIGKILL)}")


@pytest.mark.anyio
async def test_long_stderr_is_cut_to_last_error_limit(tmp_path: Path) -> None:
    script = write_script(
        tmp_path, "long.py", "import sys; sys.stderr.write('x' * 5000 + 'TAIL'); sys.exit(1)\n"
    )
    result = await CommandTransport(command(script))(make_delivery())
    assert result == TransportResult(ok=False, error="x" * LAST_ERROR_LIMIT)


@pytest.mark.anyio
async def test_stderr_is_kept_only_up_to_output_limit(tmp_path: Path) -> None:
    script = write_script(
        tmp_path, "limit.py", "import sys; sys.stderr.write('abcdefghijklmnop'); sys.exit(1)\n"
    )
    result = await CommandTransport(command(script), output_limit=10)(make_delivery())
    assert result == TransportResult(ok=False, error="abcdefghij")


@pytest.mark.anyio
async def test_undecodable_stderr_is_replaced_not_an_error(tmp_path: Path) -> None:
    script = write_script(
        tmp_path,
        "bytes.py",
        "import sys; sys.stderr.buffer.write(b'bad \\xff\\xfe bytes'); sys.exit(1)\n",
    )
    result = await CommandTransport(command(script))(make_delivery())
    assert result == TransportResult(ok=False, error="bad \ufffd\ufffd bytes")


@pytest.mark.anyio
async def test_huge_output_on_both_pipes_is_drained_with_bounded_error(tmp_path: Path) -> None:
    script = write_script(
        tmp_path,
        "flood.py",
        """
        import sys, threading
        chunk = b"y" * (1024 * 1024)
        def flood(stream):
            for _ in range(50):
                stream.write(chunk)
            stream.flush()
        t = threading.Thread(target=flood, args=(sys.stderr.buffer,))
        t.start()
        flood(sys.stdout.buffer)
        t.join()
        sys.exit(1)
        """,
    )
    started = time.monotonic()
    result = await CommandTransport(command(script), timeout=15.0)(make_delivery())
    assert result.ok is False
    assert result.error == "y" * LAST_ERROR_LIMIT
    assert time.monotonic() - started < 10.0


# -- no shell, argv and stdin data ---------------------------------------------


@pytest.mark.anyio
async def test_shell_metacharacters_in_payload_and_route_are_inert(tmp_path: Path) -> None:
    canary = tmp_path / "CANARY"
    payload = f'"; touch {canary} #'
    route = f"$(touch {canary}) `touch {canary}` | touch {canary} && touch {canary}; '"
    record = tmp_path / "argv.json"
    script = write_script(
        tmp_path,
        "record_argv.py",
        "import json, sys\nopen(sys.argv[1], 'w').write(json.dumps(sys.argv[2:]))\n",
    )
    transport = CommandTransport(
        command(script, str(record), "{deliver_to}", "{payload}", "x{payload}")
    )
    result = await transport(make_delivery(payload=payload, deliver_to=route))
    assert result.ok, result.error
    assert json.loads(record.read_text()) == [route, payload, "x{payload}"]
    assert not canary.exists()


@pytest.mark.anyio
async def test_payload_goes_to_stdin_when_no_payload_element(tmp_path: Path) -> None:
    canary = tmp_path / "CANARY"
    payload = json.dumps(
        {"text": f"$(touch {canary}) `touch {canary}` h\u00e9llo \u2603"}, ensure_ascii=False
    )
    record = tmp_path / "stdin.bin"
    script = write_script(
        tmp_path,
        "record_stdin.py",
        "import sys\nopen(sys.argv[1], 'wb').write(sys.stdin.buffer.read())\n",
    )
    result = await CommandTransport(command(script, str(record)))(make_delivery(payload=payload))
    assert result.ok, result.error
    assert record.read_bytes() == payload.encode("utf-8")
    assert not canary.exists()


@pytest.mark.anyio
async def test_stdin_is_empty_when_payload_is_in_argv(tmp_path: Path) -> None:
    record = tmp_path / "stdin.bin"
    script = write_script(
        tmp_path,
        "record_stdin.py",
        "import sys\nopen(sys.argv[1], 'wb').write(sys.stdin.buffer.read())\n",
    )
    result = await CommandTransport(command(script, str(record), "{payload}"))(make_delivery())
    assert result.ok, result.error
    assert record.read_bytes() == b""


@pytest.mark.anyio
async def test_child_that_ignores_stdin_neither_hangs_nor_fails(tmp_path: Path) -> None:
    script = write_script(tmp_path, "deaf.py", "import sys; sys.stdin.close(); sys.exit(0)\n")
    big_payload = json.dumps({"blob": "z" * (4 * 1024 * 1024)})
    started = time.monotonic()
    result = await CommandTransport(command(script), timeout=5.0)(
        make_delivery(payload=big_payload)
    )
    assert result == TransportResult(ok=True, error=None)
    assert time.monotonic() - started < 4.0


# -- environment ---------------------------------------------------------------


ENV_RECORDER = """
    import json, os, sys
    keys = ["TRIO_DISPATCH_ID", "TRIO_DISPATCH_ATTEMPT", "TRIO_DISPATCH_KIND",
            "TRIO_DISPATCH_DELIVER_TO", "TD_TEST_INHERITED", "TD_TEST_GIVEN"]
    open(sys.argv[1], "w").write(json.dumps({k: os.environ.get(k) for k in keys}))
"""


@pytest.mark.anyio
async def test_child_environment_carries_dispatch_identity(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TD_TEST_INHERITED", "from-parent")
    record = tmp_path / "env.json"
    script = write_script(tmp_path, "env.py", ENV_RECORDER)
    delivery = make_delivery(attempt=5, kind="alert.fired", deliver_to="team:ops")
    result = await CommandTransport(command(script, str(record)))(delivery)
    assert result.ok, result.error
    assert json.loads(record.read_text()) == {
        "TRIO_DISPATCH_ID": delivery.dispatch_id,
        "TRIO_DISPATCH_ATTEMPT": "5",
        "TRIO_DISPATCH_KIND": "alert.fired",
        "TRIO_DISPATCH_DELIVER_TO": "team:ops",
        "TD_TEST_INHERITED": "from-parent",
        "TD_TEST_GIVEN": None,
    }


@pytest.mark.anyio
async def test_given_env_replaces_parent_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TD_TEST_INHERITED", "from-parent")
    record = tmp_path / "env.json"
    script = write_script(tmp_path, "env.py", ENV_RECORDER)
    transport = CommandTransport(command(script, str(record)), env={"TD_TEST_GIVEN": "given"})
    result = await transport(make_delivery(attempt=1))
    assert result.ok, result.error
    recorded = json.loads(record.read_text())
    assert recorded["TD_TEST_GIVEN"] == "given"
    assert recorded["TD_TEST_INHERITED"] is None
    assert recorded["TRIO_DISPATCH_ATTEMPT"] == "1"


# -- process group: timeout, cancellation, leftovers ---------------------------


@pytest.mark.anyio
async def test_timeout_kills_grandchild_in_process_group(tmp_path: Path) -> None:
    child_pid, grandchild_pid = tmp_path / "child.pid", tmp_path / "grandchild.pid"
    script = write_script(tmp_path, "spawner.py", SPAWNING_CHILD)
    transport = CommandTransport(
        command(script, str(child_pid), str(grandchild_pid), "sleep"), timeout=0.5, kill_grace=0.3
    )
    started = time.monotonic()
    result = await transport(make_delivery())
    assert result == TransportResult(ok=False, error="timeout after 0.5s")
    assert time.monotonic() - started < 3.0
    assert await wait_until_gone(read_pid(grandchild_pid))
    assert await wait_until_gone(read_pid(child_pid))


@pytest.mark.anyio
async def test_timeout_sends_sigterm_before_sigkill(tmp_path: Path) -> None:
    marker = tmp_path / "got-sigterm"
    script = write_script(
        tmp_path,
        "polite.py",
        f"""
        import signal, sys, time
        def on_term(signo, frame):
            open({str(marker)!r}, "w").close()
            sys.exit(0)
        signal.signal(signal.SIGTERM, on_term)
        time.sleep(300)
        """,
    )
    transport = CommandTransport(command(script), timeout=0.5, kill_grace=2.0)
    started = time.monotonic()
    result = await transport(make_delivery())
    elapsed = time.monotonic() - started
    assert result == TransportResult(ok=False, error="timeout after 0.5s")
    assert marker.exists()
    # It left on SIGTERM, so the grace was not waited out.
    assert elapsed < 2.0


@pytest.mark.anyio
async def test_child_ignoring_sigterm_is_killed_after_grace(tmp_path: Path) -> None:
    child_pid, grandchild_pid = tmp_path / "child.pid", tmp_path / "grandchild.pid"
    script = write_script(tmp_path, "stubborn.py", SPAWNING_CHILD)
    transport = CommandTransport(
        command(script, str(child_pid), str(grandchild_pid), "ignore-term"),
        timeout=0.5,
        kill_grace=0.5,
    )
    started = time.monotonic()
    result = await transport(make_delivery())
    elapsed = time.monotonic() - started
    assert result == TransportResult(ok=False, error="timeout after 0.5s")
    assert 0.9 <= elapsed < 3.0
    assert await wait_until_gone(read_pid(child_pid))
    assert await wait_until_gone(read_pid(grandchild_pid))


@pytest.mark.anyio
async def test_cancellation_kills_process_group_and_propagates(tmp_path: Path) -> None:
    child_pid, grandchild_pid = tmp_path / "child.pid", tmp_path / "grandchild.pid"
    script = write_script(tmp_path, "spawner.py", SPAWNING_CHILD)
    transport = CommandTransport(
        command(script, str(child_pid), str(grandchild_pid), "sleep"), timeout=10.0, kill_grace=0.3
    )
    results: list[TransportResult] = []
    started = time.monotonic()
    with anyio.move_on_after(0.5) as scope:
        results.append(await transport(make_delivery()))
    assert scope.cancelled_caught
    assert results == []
    assert time.monotonic() - started < 3.0
    assert await wait_until_gone(read_pid(child_pid))
    assert await wait_until_gone(read_pid(grandchild_pid))


@pytest.mark.anyio
async def test_leftover_background_child_is_killed_after_normal_exit(tmp_path: Path) -> None:
    child_pid, grandchild_pid = tmp_path / "child.pid", tmp_path / "grandchild.pid"
    script = write_script(tmp_path, "leaver.py", SPAWNING_CHILD)
    transport = CommandTransport(
        command(script, str(child_pid), str(grandchild_pid), "exit"), timeout=10.0
    )
    started = time.monotonic()
    result = await transport(make_delivery())
    # The grandchild held stdout/stderr open; reading must not wait for it.
    assert result == TransportResult(ok=True, error=None)
    assert time.monotonic() - started < 3.0
    assert await wait_until_gone(read_pid(grandchild_pid))


def test_constructor_rejects_out_of_range_limits_naming_them() -> None:
    with pytest.raises(ValueError, match="timeout"):
        CommandTransport(["true"], timeout=0)
    with pytest.raises(ValueError, match="kill_grace"):
        CommandTransport(["true"], kill_grace=-1)
    with pytest.raises(ValueError, match="output_limit"):
        CommandTransport(["true"], output_limit=-1)
    with pytest.raises(ValueError, match="timeout"):
        CallableTransport(_returns_none, timeout=-1.0)


# -- callable transports -------------------------------------------------------


async def _returns_none(delivery: Delivery) -> None:
    await anyio.sleep(0)


@pytest.mark.anyio
async def test_callable_returning_anything_but_false_is_success() -> None:
    seen: list[Delivery] = []

    async def record(delivery: Delivery) -> object:
        seen.append(delivery)
        return {"status": 202}

    delivery = make_delivery()
    assert await CallableTransport(record)(delivery) == TransportResult(ok=True, error=None)
    assert await CallableTransport(_returns_none)(delivery) == TransportResult(ok=True, error=None)
    assert seen == [delivery]


@pytest.mark.anyio
async def test_callable_returning_false_is_failure() -> None:
    async def refuse(delivery: Delivery) -> bool:
        return False

    result = await CallableTransport(refuse)(make_delivery())
    assert result == TransportResult(ok=False, error="transport returned False")


@pytest.mark.anyio
async def test_callable_returning_transport_result_is_reported_as_is() -> None:
    async def explicit(delivery: Delivery) -> TransportResult:
        return TransportResult.failure("queue full")

    result = await CallableTransport(explicit)(make_delivery())
    assert result == TransportResult(ok=False, error="queue full")


@pytest.mark.anyio
async def test_callable_exception_is_failure_with_type_and_message() -> None:
    async def explode(delivery: Delivery) -> None:
        raise ConnectionRefusedError(f"connection refused by {delivery.deliver_to}")

    result = await CallableTransport(explode)(make_delivery(deliver_to="hooks.example"))
    assert result == TransportResult(
        ok=False, error="ConnectionRefusedError: connection refused by hooks.example"
    )


@pytest.mark.anyio
async def test_callable_running_past_timeout_is_timeout_failure() -> None:
    async def slow(delivery: Delivery) -> None:
        await anyio.sleep(30)

    started = time.monotonic()
    result = await CallableTransport(slow, timeout=0.2)(make_delivery())
    assert result == TransportResult(ok=False, error="timeout after 0.2s")
    assert time.monotonic() - started < 2.0


@pytest.mark.anyio
async def test_callable_cancellation_propagates() -> None:
    finished: list[str] = []

    async def slow(delivery: Delivery) -> None:
        try:
            await anyio.sleep(30)
        finally:
            finished.append("cleanup ran")

    results: list[TransportResult] = []
    with anyio.move_on_after(0.2) as scope:
        results.append(await CallableTransport(slow, timeout=10.0)(make_delivery()))
    assert scope.cancelled_caught
    assert results == []
    assert finished == ["cleanup ran"]


# -- as_transport ----------------------------------------------------------------


class _EchoTransport(BaseTransport):
    async def __call__(self, delivery: Delivery) -> TransportResult:
        return TransportResult.success()


def _sync_notify(delivery: Delivery) -> None:
    return None


@pytest.mark.parametrize("value", [None, ["notify", "{payload}"], ("notify", "{payload}")])
def test_as_transport_wraps_templates_and_none_in_command_transport(value: object) -> None:
    transport = as_transport(value)
    assert isinstance(transport, CommandTransport)
    assert transport.template == (None if value is None else ["notify", "{payload}"])


def test_as_transport_returns_transport_instances_as_is() -> None:
    command_transport = CommandTransport(["notify"])
    callable_transport = CallableTransport(_returns_none)
    custom = _EchoTransport()
    assert as_transport(command_transport) is command_transport
    assert as_transport(callable_transport) is callable_transport
    assert as_transport(custom) is custom


@pytest.mark.anyio
async def test_a_transport_object_without_opened_is_adapted_and_still_delivers() -> None:
    class Bare:
        async def __call__(self, delivery: Delivery) -> TransportResult:
            return TransportResult.failure(f"bare saw {delivery.deliver_to}")

    bare = Bare()
    transport = as_transport(bare)
    assert transport is not bare  # type: ignore[comparison-overlap]
    assert repr(transport) == repr(bare)
    async with transport.opened():  # holds nothing, and is there
        assert await transport(make_delivery()) == TransportResult.failure("bare saw ops/alerts")


@pytest.mark.anyio
async def test_as_transport_wraps_async_function_in_callable_transport() -> None:
    transport = as_transport(_returns_none)
    assert isinstance(transport, CallableTransport)
    assert await transport(make_delivery()) == TransportResult(ok=True, error=None)


def test_as_transport_applies_timeout_to_what_it_builds_only() -> None:
    built_command = as_transport(["notify"], timeout=2.5)
    built_callable = as_transport(_returns_none, timeout=2.5)
    assert isinstance(built_command, CommandTransport) and built_command.timeout == 2.5
    assert isinstance(built_callable, CallableTransport) and built_callable.timeout == 2.5
    given = CommandTransport(["notify"], timeout=7.0)
    assert as_transport(given, timeout=2.5) is given
    assert given.timeout == 7.0


@pytest.mark.parametrize("value", [_sync_notify, 42, "notify {payload}"])
def test_as_transport_rejects_other_values_naming_them(value: object) -> None:
    with pytest.raises(TypeError, match="async callable") as excinfo:
        as_transport(value)
    assert repr(value) in str(excinfo.value)


def _uses_transport_protocol(transports: Sequence[Transport]) -> int:
    return len(transports)


def test_transport_implementations_satisfy_the_protocol() -> None:
    # Checked by mypy: every implementation is usable where a Transport is expected.
    assert (
        _uses_transport_protocol(
            [CommandTransport(None), CallableTransport(_returns_none), _EchoTransport()]
        )
        == 3
    )
