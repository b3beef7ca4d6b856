"""Helpers shared between test files."""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import io
import json
import os
import ssl
import subprocess
import sys
import textwrap
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

import anyio

from trio_dispatch import Delivery
from trio_dispatch import cli as cli_module

if TYPE_CHECKING:
    from .conftest import RawDB


FULL = os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")
"""Whether this run is CI's (every tier at full size) rather than the loop a
developer runs after each change (scripts/test outside CI)."""


def size(full: int, quick: int) -> int:
    """``full`` under CI, ``quick`` in the loop after each change."""
    return full if FULL else quick


@functools.cache
def load_script(name: str) -> ModuleType:
    """``scripts/NAME.py`` (a driver the tests run small) imported as the
    module ``NAME_driver``, registered in ``sys.modules`` so that what it
    defines resolves by module name (dataclasses, pickles)."""
    path = Path(__file__).resolve().parents[1] / "scripts" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"{name}_driver", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[f"{name}_driver"] = module
    spec.loader.exec_module(module)
    return module


def client_tls() -> ssl.SSLContext:
    """One verifying TLS context for the tests' own HTTP clients: httpx loads
    the CA bundle again for each client made without one (20-40 ms), and the
    web tests make hundreds (to servers speaking plain HTTP on loopback)."""
    import httpx

    return httpx.create_ssl_context()


@dataclass(frozen=True)
class Ran:
    """What a command printed and returned."""

    returncode: int
    stdout: str
    stderr: str


@contextlib.contextmanager
def _environment(env: dict[str, str] | None, cwd: Path | None) -> Iterator[None]:
    saved_env = dict(os.environ)
    saved_cwd = os.getcwd()
    try:
        os.environ.pop("TRIO_DISPATCH_CONFIG", None)
        os.environ.update(env or {})
        if cwd is not None:
            os.chdir(cwd)
        yield
    finally:
        os.chdir(saved_cwd)
        os.environ.clear()
        os.environ.update(saved_env)


def run_cli(*args: str, env: dict[str, str] | None = None, cwd: Path | None = None) -> Ran:
    """``trio-dispatch ARGS`` in this process, through ``cli.main``: its
    exit code and what it printed (argparse's own exits included)."""
    out, err = io.StringIO(), io.StringIO()
    with (
        _environment({"COLUMNS": "200", **(env or {})}, cwd),
        contextlib.redirect_stdout(out),
        contextlib.redirect_stderr(err),
    ):
        try:
            code = cli_module.main(list(args))
        except SystemExit as exc:  # argparse: usage errors and --help
            code = exc.code if isinstance(exc.code, int) else 2
    return Ran(code, out.getvalue(), err.getvalue())


async def arun_cli(*args: str, env: dict[str, str] | None = None, cwd: Path | None = None) -> Ran:
    """:func:`run_cli` from an async test (the command runs its own event
    loop, so on a thread of its own)."""
    return await anyio.to_thread.run_sync(lambda: run_cli(*args, env=env, cwd=cwd))


def cli_process(
    *args: str, cwd: Path | None = None, env: dict[str, str] | None = None, timeout: float = 60
) -> subprocess.CompletedProcess[str]:
    """``python -m trio_dispatch ARGS`` as a real process."""
    base = {k: v for k, v in os.environ.items() if k != "TRIO_DISPATCH_CONFIG"}
    return subprocess.run(
        [sys.executable, "-m", "trio_dispatch", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=cwd,
        env={**base, "COLUMNS": "200", **(env or {})},
    )


def assert_one_line_error(
    done: Ran | subprocess.CompletedProcess[str], code: int, *words: str
) -> str:
    """The command failed with ``code`` and exactly one line on stderr,
    holding every one of ``words``; returns that line."""
    assert done.returncode == code, (done.stdout, done.stderr)
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr
    for word in words:
        assert word in lines[0], lines[0]
    return lines[0]


async def wait_for(predicate: Callable[[], object], timeout: float = 10.0) -> None:
    """Poll ``predicate`` every 10 ms until it is true; fail after ``timeout``."""
    with anyio.fail_after(timeout):
        while not predicate():
            await anyio.sleep(0.01)


def process_gone(pid: int) -> bool:
    """Whether ``pid`` has exited (a zombie counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split(") ")[1].startswith("Z")
    except FileNotFoundError:
        return True


def statuses(raw: RawDB) -> dict[str, int]:
    """How many rows the database holds in each status."""
    return {
        str(r["status"]): int(r["n"])
        for r in raw.rows("SELECT status, COUNT(*) AS n FROM dispatch_outbox GROUP BY status")
    }


def everything(raw: RawDB) -> list[list[dict[str, Any]]]:
    """Every row of both tables, in order: what a write could change."""
    return [
        raw.rows("SELECT * FROM dispatch_outbox ORDER BY id"),
        raw.rows("SELECT * FROM status_transitions ORDER BY id"),
    ]


def dry_run(raw: RawDB, *args: str) -> str:
    """``trio-dispatch ARGS --dry-run`` succeeds and writes nothing (every
    row and transition as before); what it printed."""
    before = everything(raw)
    dry = run_cli(*args, "--dry-run")
    assert dry.returncode == 0, dry.stderr
    assert everything(raw) == before
    return dry.stdout


def json_output(done: Ran | subprocess.CompletedProcess[str], *keys: str) -> dict[str, Any]:
    """The command succeeded and printed a JSON document: those ``keys`` of
    it (with none, all of it)."""
    assert done.returncode == 0, done.stderr
    document: dict[str, Any] = json.loads(done.stdout)
    return {key: document[key] for key in keys} if keys else document


def refused(raw: RawDB, code: int, words: Sequence[str], *args: str) -> Ran:
    """``trio-dispatch ARGS`` fails with ``code`` and one line holding each
    of ``words`` (:func:`assert_one_line_error`), and writes nothing."""
    before = everything(raw)
    done = run_cli(*args)
    assert_one_line_error(done, code, *words)
    assert everything(raw) == before
    return done


def row_is(raw: RawDB, dispatch_id: str, **expected: object) -> bool:
    """Whether one read of the row finds every column as ``expected`` (two
    reads could each see a different moment: ``pending`` before the claim,
    ``attempt == 1`` after it)."""
    row = raw.row(dispatch_id)
    return all(row[column] == value for column, value in expected.items())


GRANDCHILD_SCRIPT = """
import os, subprocess, sys, time
child = subprocess.Popen(["sleep", "300"])
open(sys.argv[1], "w").write(str(child.pid))
time.sleep(300)
"""
"""A transport that starts a grandchild (``sleep 300``), writes its pid to
argv[1] and hangs: for the kill-the-whole-group tests."""


def write_config(tmp_path: Path, db_path: Path, template: list[str], **worker: float) -> Path:
    config = tmp_path / "worker.yaml"
    settings = {"tick_seconds": 3600, "grace_seconds": 0.3, **worker}
    config.write_text(
        json.dumps(
            {  # JSON is YAML
                "store": str(db_path),
                "dispatch": {
                    "notify_template": template,
                    "timeout_seconds": worker.get("timeout", 30),
                },
                "worker": {k: v for k, v in settings.items() if k != "timeout"},
                "log_level": "INFO",
            }
        )
    )
    return config


def start_worker(config: Path) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "trio_dispatch", "--config", str(config), "worker"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def chattr(flag: str, *paths: Path) -> subprocess.CompletedProcess[str]:
    argv = ["chattr", flag, *map(str, paths)]
    try:
        return subprocess.run(argv, capture_output=True, text=True, check=False)
    except FileNotFoundError:
        return subprocess.CompletedProcess(argv, 127, "", "chattr is not installed")


def immutable_unavailable(directory: Path) -> str | None:
    """Why ``chattr +i`` cannot make a file read-only here, or None."""
    probe = directory / "chattr-probe"
    probe.write_bytes(b"x")
    try:
        done = chattr("+i", probe)
        if done.returncode != 0:
            return f"chattr +i failed: {done.stderr.strip() or done.returncode}"
        try:
            with open(probe, "ab") as handle:
                handle.write(b"y")
        except PermissionError:
            return None
        return "chattr +i does not block writes on this filesystem"
    finally:
        chattr("-i", probe)
        probe.unlink(missing_ok=True)


# A delivery and scripts for the transport tests.
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


# A password the hardening tests look for in every output.
PASSWORD = "S3cretPW"
MASKED = "postgres:***@"


def no_secret(*texts: str) -> None:
    for text in texts:
        assert PASSWORD not in text, text


class HeldWriter:
    """A unit of work that holds a store's writer until released: others
    queue behind it, and ``store.queued_writes`` says when they have."""

    def __init__(self) -> None:
        self._running = threading.Event()
        self._release = threading.Event()

    def unit(self, conn: object) -> None:
        self._running.set()
        self._release.wait(30)

    async def running(self) -> None:
        """Return once the unit runs on the writer."""
        await anyio.to_thread.run_sync(self._running.wait, 30)

    def release(self) -> None:
        self._release.set()


def listening_backends(raw: RawDB) -> int:
    """PostgreSQL sessions of the test's database waiting on LISTEN now."""
    return int(
        raw.scalar(
            "SELECT COUNT(*) FROM pg_stat_activity WHERE datname = current_database()"
            " AND state = 'idle' AND query ILIKE 'LISTEN%'"
        )
    )
