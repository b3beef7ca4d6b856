"""Transports as values: `as_transport`, callables' results, templates and
argv rendering, result limits; no child process starts here."""

from __future__ import annotations

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

from ..helpers import command, make_delivery, write_script


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


def test_constructor_rejects_out_of_range_limits_naming_them() -> None:
    with pytest.raises(ValueError, match="timeout"):
        CommandTransport(["true"], timeout=0)
    with pytest.raises(ValueError, match="kill_grace"):
        CommandTransport(["true"], kill_grace=-1)
    with pytest.raises(ValueError, match="output_limit"):
        CommandTransport(["true"], output_limit=-1)
    with pytest.raises(ValueError, match="timeout"):
        CallableTransport(_returns_none, timeout=-1.0)


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
