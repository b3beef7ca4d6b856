"""Transport behaviour against real child processes (no mocks).

Child scripts are written into ``tmp_path`` and run with ``sys.executable``;
assertions are on the result and on files the children wrote.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import anyio
import pytest

from trio_dispatch.transports import (
    LAST_ERROR_LIMIT,
    CommandTransport,
    TransportResult,
)

from ..helpers import command, make_delivery, write_script

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


# -- configuration and spawning failures --------------------------------------


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


# -- callable transports -------------------------------------------------------


# -- as_transport ----------------------------------------------------------------
