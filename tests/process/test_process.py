"""A transport child never outlives its worker (docs/security.md): SIGKILL a
real worker process and its child, and the child's own children, are gone
within a second; while the worker lives, its children live as long as they
need (the spawning thread is not a pool thread that ends after 10 s)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import anyio
import pytest

import trio_dispatch.transports.process as process
from trio_dispatch import enqueue_dispatch, open_store
from trio_dispatch.transports import CommandTransport, Delivery
from trio_dispatch.transports.process import lifeline_pid

from ..conftest import RawDB
from ..helpers import process_gone, wait_for, write_config

LAUNCHERS = ["setpriv", "preexec"]


@pytest.fixture(params=LAUNCHERS)
def launcher(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """Each way a child gets its parent-death signal, on a fresh spawner,
    closed after the test."""
    if request.param == "setpriv" and process._find_setpriv() is None:
        pytest.skip("setpriv --pdeathsig is not installed")
    monkeypatch.setattr(process, "PDEATHSIG_LAUNCHER", request.param)
    monkeypatch.setattr(process, "_spawner", None)
    yield str(request.param)
    if process._spawner is not None:
        process._spawner.close()


def start_worker_with(config: Path, launcher: str) -> subprocess.Popen[str]:
    """`trio-dispatch --config CONFIG worker` in a real process whose children
    get their parent-death signal the way ``launcher`` says."""
    code = (
        "import sys, trio_dispatch.transports.process as p\n"
        f"p.PDEATHSIG_LAUNCHER = {launcher!r}\n"
        "from trio_dispatch.cli import main\n"
        "sys.exit(main(sys.argv[1:]))\n"
    )
    return subprocess.Popen(
        [sys.executable, "-c", code, "--config", str(config), "worker"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def children_of(pid: int, needle: str) -> list[int]:
    found = subprocess.run(
        ["pgrep", "-P", str(pid), "-f", needle], capture_output=True, text=True
    ).stdout.split()
    return [int(child) for child in found]


FAMILY_SCRIPT = """
import os, subprocess, sys, time
grandchild = subprocess.Popen(["sleep", "300"])
with open(sys.argv[1] + ".tmp", "w") as out:
    out.write(f"{os.getpid()} {grandchild.pid}")
os.rename(sys.argv[1] + ".tmp", sys.argv[1])
time.sleep(300)
"""


def gone_within(pid: int, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if process_gone(pid):
            return True
        time.sleep(0.01)
    return process_gone(pid)


@pytest.mark.slow
@pytest.mark.anyio
@pytest.mark.sqlite_only
@pytest.mark.parametrize("launcher", LAUNCHERS)
async def test_a_sigkilled_worker_takes_its_transport_child_and_grandchild_with_it(
    db_path: Path, raw: RawDB, tmp_path: Path, launcher: str
) -> None:
    script = tmp_path / "family.py"
    script.write_text(FAMILY_SCRIPT)
    pids_file = tmp_path / "pids"
    config = write_config(
        tmp_path, db_path, [sys.executable, str(script), str(pids_file)], timeout=60
    )
    async with open_store(db_path) as db:
        dispatch_id = await enqueue_dispatch(db, kind="k", deliver_to="seat")
    if launcher == "setpriv" and process._find_setpriv() is None:
        pytest.skip("setpriv --pdeathsig is not installed")
    with start_worker_with(config, launcher) as worker:
        try:
            await wait_for(pids_file.exists, timeout=20)
            child, grandchild = map(int, pids_file.read_text().split())
            assert not process_gone(child) and not process_gone(grandchild)
            os.kill(worker.pid, signal.SIGKILL)
            worker.wait(timeout=10)
            killed_at = time.monotonic()
            assert gone_within(child, 1.0), "the transport child outlived its SIGKILLed worker"
            # The grandchild is the lifeline's to kill: another process, which
            # must first be scheduled to see its pipe close (once it took over a
            # second on a loaded 2-core CI machine, over 5 s beside a benchmark).
            assert gone_within(grandchild, 15.0 - (time.monotonic() - killed_at)), (
                "the transport's own child outlived the SIGKILLed worker"
            )
        finally:
            worker.kill()
            for pid in (child, grandchild) if pids_file.exists() else ():
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
    assert raw.row(dispatch_id)["status"] == "delivering"  # the lease brings it back


@pytest.mark.slow
@pytest.mark.anyio
@pytest.mark.sqlite_only
@pytest.mark.parametrize("launcher", LAUNCHERS)
async def test_without_its_lifeline_the_parent_death_signal_still_kills_the_child(
    db_path: Path, tmp_path: Path, launcher: str
) -> None:
    # What each mechanism does on its own: the parent-death signal ends the
    # transport child; only the lifeline reaches the child's own children.
    if launcher == "setpriv" and process._find_setpriv() is None:
        pytest.skip("setpriv --pdeathsig is not installed")
    script = tmp_path / "family.py"
    script.write_text(FAMILY_SCRIPT)
    pids_file = tmp_path / "pids"
    config = write_config(
        tmp_path, db_path, [sys.executable, str(script), str(pids_file)], timeout=60
    )
    async with open_store(db_path) as db:
        await enqueue_dispatch(db, kind="k", deliver_to="seat")
    grandchild = 0
    with start_worker_with(config, launcher) as worker:
        try:
            await wait_for(pids_file.exists, timeout=20)
            child, grandchild = map(int, pids_file.read_text().split())
            [helper] = children_of(worker.pid, "_lifeline.py")
            os.kill(helper, signal.SIGKILL)
            await wait_for(lambda: process_gone(helper), timeout=5)
            os.kill(worker.pid, signal.SIGKILL)
            worker.wait(timeout=10)
            assert gone_within(child, 1.0), "the parent-death signal did not end the child"
            time.sleep(0.3)
            assert not process_gone(grandchild)  # as documented: the lifeline's part
        finally:
            worker.kill()
            if grandchild:
                os.kill(grandchild, signal.SIGKILL)


@pytest.mark.slow
@pytest.mark.trio
async def test_a_transport_child_outlives_the_idle_timeout_of_pool_threads(
    tmp_path: Path, launcher: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A child tied by parent-death signal to one of trio's pool threads is
    # killed when that thread retires (10 s idle), mid-send. The idle timeout
    # is cut to 0.3 s here, so a pool thread surely retires during the send.
    import threading

    import trio

    monkeypatch.setattr(trio._core._thread_cache, "IDLE_TIMEOUT", 0.3)
    pool_thread = await trio.to_thread.run_sync(threading.current_thread)
    script = tmp_path / "slow.py"
    script.write_text(
        "import time, sys\ntime.sleep(1.5)\nprint('done', file=sys.stderr)\nsys.exit(3)\n"
    )
    transport = CommandTransport([sys.executable, str(script)], timeout=30)
    delivery = Delivery(dispatch_id="d" * 32, kind="k", deliver_to="x", attempt=1, payload="{}")
    result = await transport(delivery)
    assert result.error == "done"  # it ran to its end, not killed by a signal
    assert not pool_thread.is_alive()  # a pool thread did retire meanwhile


def test_the_lifeline_helper_ends_with_its_process_and_kills_nothing_else(
    tmp_path: Path,
) -> None:
    bystander = subprocess.Popen(["sleep", "30"], start_new_session=True)
    script = tmp_path / "deliver_once.py"
    script.write_text(
        "import sys, trio\n"
        "from trio_dispatch.transports import CommandTransport, Delivery\n"
        "from trio_dispatch.transports.process import lifeline_pid\n"
        "async def main():\n"
        "    d = Delivery(dispatch_id='d' * 32, kind='k', deliver_to='x', attempt=1,"
        " payload='{}')\n"
        "    result = await CommandTransport(['true'])(d)\n"
        "    print(result.ok, lifeline_pid(), flush=True)\n"
        "trio.run(main)\n"
    )
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    ok, helper = done.stdout.split()
    assert ok == "True"
    try:
        assert gone_within(int(helper), 2.0)
        assert bystander.poll() is None  # an unrelated process group lives on
    finally:
        bystander.kill()
        bystander.wait()


@pytest.mark.anyio
async def test_an_attempt_spawns_no_process_that_stays_behind(
    tmp_path: Path, launcher: str
) -> None:
    script = tmp_path / "family.py"
    script.write_text(FAMILY_SCRIPT.replace("time.sleep(300)", "sys.exit(0)"))
    pids_file = tmp_path / "pids"
    transport = CommandTransport([sys.executable, str(script), str(pids_file)], timeout=30)
    delivery = Delivery(dispatch_id="d" * 32, kind="k", deliver_to="x", attempt=1, payload="{}")
    assert (await transport(delivery)).ok
    child, grandchild = map(int, pids_file.read_text().split())
    await wait_for(lambda: process_gone(child) and process_gone(grandchild), timeout=2)
    helper = lifeline_pid()
    assert helper is not None and not process_gone(helper)  # one helper per process


@pytest.mark.anyio
async def test_both_launchers_keep_the_error_of_a_missing_or_unrunnable_command(
    tmp_path: Path, launcher: str
) -> None:
    delivery = Delivery(dispatch_id="d" * 32, kind="k", deliver_to="x", attempt=1, payload="{}")
    missing = await CommandTransport(["no-such-command-here"])(delivery)
    assert missing.error == "cannot execute 'no-such-command-here': No such file or directory"
    script = tmp_path / "plain.txt"
    script.write_text("not executable")
    denied = await CommandTransport([str(script)])(delivery)
    assert denied.error == f"cannot execute {str(script)!r}: Permission denied"
    argv0 = await CommandTransport([sys.executable, "-c", "import sys; sys.exit(sys.argv[0])"])(
        delivery
    )
    assert argv0.error == "-c"  # the command sees its own argv, launcher or not


@pytest.mark.anyio
async def test_a_closed_spawner_leaves_no_thread_helper_or_pipe_behind(
    tmp_path: Path, launcher: str
) -> None:
    import threading

    script = tmp_path / "family.py"
    script.write_text(FAMILY_SCRIPT)
    pids_file = tmp_path / "pids"
    transport = CommandTransport([sys.executable, str(script), str(pids_file)], timeout=30)
    delivery = Delivery(dispatch_id="d" * 32, kind="k", deliver_to="x", attempt=1, payload="{}")
    async with anyio.create_task_group() as tg:
        tg.start_soon(transport, delivery)
        await wait_for(pids_file.exists, timeout=20)
        child, grandchild = map(int, pids_file.read_text().split())
        spawner = process._spawner
        assert spawner is not None
        # The group is registered (and the helper started) just after the
        # spawn returns, which a loaded machine may let the child outrun.
        await wait_for(lambda: spawner.lifeline._popen is not None, timeout=20)
        helper = spawner.lifeline._popen
        assert helper is not None and helper.stdin is not None
        spawner.close()
        assert helper.returncode is not None and helper.stdin.closed  # reaped, pipe closed
        assert spawner.lifeline.pid is None
        assert spawner.thread.ident not in {t.ident for t in threading.enumerate()}
        # A group still registered dies with the lifeline, as at the process's end.
        await wait_for(lambda: process_gone(child) and process_gone(grandchild), timeout=15)
        tg.cancel_scope.cancel()


LIFELINE_STARTED = """
import os, subprocess, sys, threading, time, trio
import trio_dispatch.transports.process as process
from trio_dispatch.transports import CommandTransport, Delivery

async def one():
    d = Delivery(dispatch_id="d" * 32, kind="k", deliver_to="x", attempt=1, payload="{}")
    assert (await CommandTransport([sys.executable, "-c", "pass"], timeout=30)(d)).ok

trio.run(one)
lifeline = process._spawner.lifeline
"""
"""A script's start: one command delivered, so the lifeline helper runs."""

FORK_SCRIPT = (
    LIFELINE_STARTED
    + """
inherited = lifeline._fd
assert inherited is not None, "no lifeline helper"
pid = os.fork()
if pid == 0:
    # The child's own file takes the number of the inherited pipe end.
    os.dup2(os.open(os.devnull, os.O_RDONLY), inherited)
    subprocess.run(["true"], check=True)  # Popen's cleanup of earlier objects
    import gc
    gc.collect()
    try:
        os.fstat(inherited)
    except OSError:
        os._exit(3)
    os._exit(0)
_, status = os.waitpid(pid, 0)
print("child", os.waitstatus_to_exitcode(status), flush=True)
"""
)


def test_a_forked_child_closes_the_inherited_lifeline_pipe_once_and_quietly(
    tmp_path: Path,
) -> None:
    # In the child the parent's helper pipe is closed at the fork; nothing
    # may close that number again later (a descriptor the child opened
    # since), nor warn that the parent's helper is "still running".
    script = tmp_path / "fork.py"
    script.write_text(FORK_SCRIPT)
    done = subprocess.run(
        [sys.executable, "-W", "error", str(script)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "child 0"
    assert "ResourceWarning" not in done.stderr and "Exception ignored" not in done.stderr, (
        done.stderr
    )


FORK_DURING_RESTART_SCRIPT = (
    LIFELINE_STARTED
    + """
started = threading.Event()
plain = subprocess.Popen

class SlowPopen(plain):  # widens the moment between the helper's start and its note
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if "-I" in args[0]:
            started.set()
            time.sleep(0.5)

subprocess.Popen = SlowPopen
os.kill(lifeline.pid, 9)
lifeline._popen.wait()
restart = threading.Thread(target=lifeline.register, args=(424242,))
restart.start()
started.wait()
read, write = os.pipe()
pid = os.fork()
if pid == 0:
    os.close(read)
    pipes = [
        os.readlink(f"/proc/self/fd/{fd}")
        for fd in map(int, os.listdir("/proc/self/fd"))
        if os.path.exists(f"/proc/self/fd/{fd}")
    ]
    os.write(write, " ".join(pipes).encode())
    os._exit(0)
os.close(write)
restart.join()
helper_pipe = os.readlink(f"/proc/self/fd/{lifeline._fd}")
held = os.read(read, 65536).decode().split()
os.waitpid(pid, 0)
print("held" if helper_pipe in held else "free", flush=True)
"""
)


def test_a_child_forked_while_the_lifeline_restarts_holds_no_end_of_its_pipe(
    tmp_path: Path,
) -> None:
    # A fork waits until the helper's pipe is noted, so the child closes it:
    # the parent's helper still sees EOF when the parent dies.
    script = tmp_path / "fork_restart.py"
    script.write_text(FORK_DURING_RESTART_SCRIPT)
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "free", done.stdout + done.stderr


def test_a_process_exiting_normally_reaps_its_lifeline_helper_and_closes_its_pipe(
    tmp_path: Path,
) -> None:
    script = tmp_path / "exit_after_one.py"
    script.write_text(
        "import atexit, trio\n"
        "import trio_dispatch.transports.process as process\n"
        "from trio_dispatch.transports import CommandTransport, Delivery\n"
        "async def main():\n"
        "    d = Delivery(dispatch_id='d' * 32, kind='k', deliver_to='x', attempt=1,"
        " payload='{}')\n"
        "    assert (await CommandTransport(['true'])(d)).ok\n"
        "trio.run(main)\n"
        "helper = process._spawner.lifeline._popen\n"
        "atexit._run_exitfuncs()  # what a normal exit runs\n"
        "print(helper.returncode is not None, helper.stdin.closed, process.lifeline_pid())\n"
    )
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["True", "True", "None"]
