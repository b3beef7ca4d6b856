"""docs/security.md, finding by finding: what a hostile user, a careless
operator or a crash could do, and what must hold instead. Each test failed
before the rule it guards was in place."""

from __future__ import annotations

import base64
import contextlib
import hashlib
import json
import logging
import os
import signal
import sqlite3
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import anyio
import pytest

from trio_dispatch import (
    Delivery,
    DispatchWorker,
    TransportResult,
    ack_dispatch,
    deliver_due_dispatches,
    enqueue_dispatch,
    enqueue_many,
    get_dispatch,
    list_dispatches,
    list_transitions,
    open_store,
    purge_dispatch,
    retry_dispatch,
)
from trio_dispatch.store import SQLiteStore, StoreError
from trio_dispatch.store.schema import SCHEMA_VERSION
from trio_dispatch.transports import ChildEnvironment, CommandTransport

from ..conftest import RawDB
from ..helpers import (
    MASKED,
    PASSWORD,
    arun_cli,
    assert_one_line_error,
    chattr,
    cli_process,
    immutable_unavailable,
    no_secret,
    run_cli,
    start_worker,
    wait_for,
)


def with_password(url: str) -> str:
    return url.replace("postgresql://postgres@", f"postgresql://postgres:{PASSWORD}@")


def file_state(path: Path) -> tuple[str, list[str]]:
    """The file's hash and the names beside it: what a read must not change."""
    return (
        hashlib.sha256(path.read_bytes()).hexdigest(),
        sorted(p.name for p in path.parent.iterdir()),
    )


async def populate(target: str) -> str:
    async with open_store(target) as db:
        return await enqueue_dispatch(db, kind="k", deliver_to="seat")


# -- 1. secrets never leave ---------------------------------------------------------


def test_a_missing_psycopg_error_masks_the_password(tmp_path: Path) -> None:
    script = tmp_path / "no_psycopg.py"
    script.write_text(
        "import sys\n"
        "sys.modules['psycopg'] = None\n"
        "import trio\n"
        "from trio_dispatch import open_store\n"
        "async def main():\n"
        f"    async with open_store('postgresql://postgres:{PASSWORD}@127.0.0.1/x'):\n"
        "        pass\n"
        "try:\n"
        "    trio.run(main)\n"
        "except Exception as exc:\n"
        "    print(type(exc).__name__, exc)\n"
    )
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60)
    assert done.stdout.startswith("StoreError") and "psycopg" in done.stdout, done
    no_secret(done.stdout, done.stderr)
    assert MASKED in done.stdout


@pytest.mark.anyio
@pytest.mark.postgres_only
async def test_postgres_errors_and_the_store_itself_never_show_the_password(
    db_target: str, raw: RawDB
) -> None:
    url = with_password(db_target)
    async with open_store(url) as db:
        no_secret(db.url, repr(db))
        assert MASKED in db.url
    with pytest.raises(StoreError) as closed:
        await enqueue_dispatch(db, kind="k", deliver_to="seat")
    no_secret(str(closed.value))
    raw.execute("INSERT INTO trio_dispatch_schema VALUES (99, 0)")
    try:
        with pytest.raises(StoreError) as newer:
            async with open_store(url):
                pass
        no_secret(str(newer.value))
        assert "schema version 99" in str(newer.value) and MASKED in str(newer.value)
        done = await arun_cli("--db", url, "stats")
        assert_one_line_error(done, 2, "schema version 99")
        no_secret(done.stdout, done.stderr)
    finally:
        raw.execute("DELETE FROM trio_dispatch_schema WHERE version = 99")
    refused = with_password("postgresql://postgres@127.0.0.1:1/nowhere")
    with pytest.raises(StoreError) as unreachable:
        async with open_store(refused):
            pass
    no_secret(str(unreachable.value))
    done = await arun_cli("--db", refused, "ls")
    assert_one_line_error(done, 2, "127.0.0.1")
    no_secret(done.stderr)


@pytest.mark.anyio
@pytest.mark.postgres_only
async def test_the_worker_logs_its_postgres_store_with_the_password_masked(
    db_target: str, tmp_path: Path
) -> None:
    url = with_password(db_target)
    async with open_store(url):
        pass
    config = tmp_path / "w.yaml"
    config.write_text(json.dumps({"store": url, "worker": {"tick_seconds": 3600}}))
    with start_worker(config) as worker:
        try:
            with anyio.fail_after(30):
                line = ""
                assert worker.stderr is not None
                while "worker started" not in line:
                    line = await anyio.to_thread.run_sync(worker.stderr.readline)
                    assert line, "the worker ended before it started"
            worker.send_signal(signal.SIGTERM)
            rest = await anyio.to_thread.run_sync(lambda: worker.communicate(timeout=20)[1])
        finally:
            worker.kill()
    no_secret(line, rest)
    assert MASKED in line


@pytest.mark.anyio
@pytest.mark.postgres_only
async def test_a_password_in_argv_is_warned_about_and_the_environment_keeps_it_out(
    db_target: str,
) -> None:
    url = with_password(db_target)  # the server trusts the user: any password opens it
    async with open_store(url):
        pass
    done = await arun_cli("--db", url, "stats", "--json")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["total"] == 0
    (warning,) = done.stderr.splitlines()
    assert warning.startswith("trio-dispatch: warning: --db holds a password")
    assert "--db-env" in warning
    no_secret(done.stdout, done.stderr)
    quiet = await arun_cli("--db-env", "OUTBOX_URL", "stats", "--json", env={"OUTBOX_URL": url})
    assert quiet.returncode == 0 and quiet.stderr == ""
    no_secret(quiet.stdout)
    without = await arun_cli("--db", db_target, "stats")  # no password: nothing to warn about
    assert without.returncode == 0 and without.stderr == ""
    # an error stays one line: the warning is not added to it
    refused = await arun_cli("--db", with_password("postgresql://postgres@127.0.0.1:1/x"), "ls")
    assert_one_line_error(refused, 2, "127.0.0.1")
    no_secret(refused.stderr)


# -- 3. read commands never write ------------------------------------------------


def make_foreign(path: Path) -> None:
    conn = sqlite3.connect(path)
    conn.execute("CREATE TABLE customers (id INTEGER PRIMARY KEY, name TEXT)")
    conn.execute("INSERT INTO customers (name) VALUES ('ada')")
    conn.commit()
    conn.close()


@pytest.mark.parametrize(
    "command",
    [
        ["ls"],
        ["stats"],
        ["show", "x"],
        ["history", "x"],
        ["ls", "--blocked"],
        ["ls", "--ordering-key", "k"],
    ],
)
def test_read_commands_on_another_applications_database_change_nothing(
    tmp_path: Path, command: list[str]
) -> None:
    foreign = tmp_path / "app.db"
    make_foreign(foreign)
    before = file_state(foreign)
    done = run_cli("--db", str(foreign), *command)
    assert_one_line_error(done, 2, "no trio_dispatch schema", "trio-dispatch migrate")
    assert file_state(foreign) == before
    conn = sqlite3.connect(foreign)
    assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "delete"
    assert [r[0] for r in conn.execute("SELECT name FROM sqlite_master")] == ["customers"]


def test_a_read_of_an_empty_file_leaves_it_empty(tmp_path: Path) -> None:
    empty = tmp_path / "empty.db"
    empty.touch()
    assert_one_line_error(run_cli("--db", str(empty), "stats"), 2, "trio-dispatch migrate")
    assert empty.stat().st_size == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty.db"]


def test_read_commands_on_an_idle_outbox_create_no_files_and_change_no_byte(db_path: Path) -> None:
    dispatch_id = anyio.run(populate, str(db_path))
    before = file_state(db_path)
    for command in (
        ["ls"],
        ["stats"],
        ["show", dispatch_id],
        ["history", dispatch_id],
        ["ls", "--json"],
        ["ls", "--blocked"],
        ["ls", "--ordering-key", "order-1", "--json"],
    ):
        done = run_cli("--db", str(db_path), *command)
        assert done.returncode == 0, done.stderr
        assert file_state(db_path) == before, command


def _get(url: str) -> tuple[int, str]:
    import httpx

    response = httpx.get(url, timeout=30)
    return response.status_code, response.text


@pytest.mark.slow
def test_the_web_command_creates_nothing_beside_an_idle_database_and_sees_new_writes(
    db_path: Path,
) -> None:
    first = anyio.run(populate, str(db_path))
    before = file_state(db_path)
    env = {k: v for k, v in os.environ.items() if k != "TRIO_DISPATCH_CONFIG"}
    argv = ["--db", str(db_path), "web", "--listen", "127.0.0.1:0"]
    with subprocess.Popen(
        [sys.executable, "-m", "trio_dispatch", *argv],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    ) as web:
        try:
            assert web.stderr is not None
            line = ""
            deadline = time.monotonic() + 60
            while "dashboard (read-only) at " not in line and time.monotonic() < deadline:
                line = web.stderr.readline()
                assert line, f"the web command ended (exit {web.poll()})"
            url = line.split("dashboard (read-only) at ", 1)[1].split("/ ", 1)[0]
            for path in ("/", "/metrics", "/healthz", f"/dispatches/{first}"):
                status, _ = _get(url + path)
                assert status == 200, path
            assert file_state(db_path) == before  # no -wal/-shm, not a byte changed
            # a write by another process (this one) afterwards: seen at the next request
            second = anyio.run(populate, str(db_path))
            status, page = _get(url + "/")
            assert status == 200 and second in page and first in page
            # and while the writer still has the database open (its -wal/-shm exist)

            async def write_and_look() -> tuple[str, str]:
                async with open_store(str(db_path)) as db:
                    third = await enqueue_dispatch(db, kind="k", deliver_to="seat")
                    assert Path(f"{db_path}-shm").exists()
                    page = await anyio.to_thread.run_sync(lambda: _get(url + "/")[1])
                    return third, page

            third, page = anyio.run(write_and_look)
            assert third in page
            status, page = _get(url + "/")
            assert status == 200 and third in page
        finally:
            web.send_signal(signal.SIGINT)
            try:
                web.wait(timeout=30)
            finally:
                web.kill()
    assert web.returncode == 0
    assert sorted(p.name for p in db_path.parent.iterdir()) == [db_path.name]


def test_an_older_schema_is_named_and_only_migrate_brings_it_forward(db_path: Path) -> None:
    anyio.run(populate, str(db_path))
    conn = sqlite3.connect(db_path)
    conn.execute("DELETE FROM trio_dispatch_schema WHERE version > 1")
    conn.commit()
    conn.close()
    for command in (["ls"], ["retry", "x"], ["prune"]):
        assert_one_line_error(
            run_cli("--db", str(db_path), *command), 2, "schema version 1", "trio-dispatch migrate"
        )
    done = run_cli("--db", str(db_path), "migrate")
    assert done.returncode == 0, done.stderr
    assert f"from schema version 1 to {SCHEMA_VERSION}" in done.stdout
    again = run_cli("--db", str(db_path), "migrate", "--json")
    assert json.loads(again.stdout)["changed"] is False
    assert run_cli("--db", str(db_path), "ls").returncode == 0


def test_migrate_creates_the_schema_in_a_new_file(tmp_path: Path) -> None:
    fresh = tmp_path / "new.db"
    done = run_cli("--db", str(fresh), "migrate", "--json")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == {
        "store": f"sqlite:///{fresh}",
        "schema": None,
        "from_version": None,
        "version": SCHEMA_VERSION,
        "changed": True,
    }
    assert run_cli("--db", str(fresh), "stats", "--json").returncode == 0


def test_a_user_with_read_only_access_can_list(tmp_path: Path) -> None:
    # As root (CI), permission bits do not stop writes: an immutable file in
    # an immutable directory refuses every write to either, as a read-only
    # user meets them. As another user, plain permission bits do the same.
    home = tmp_path / "store"
    home.mkdir()
    db_path = home / "outbox.db"
    dispatch_id = anyio.run(populate, str(db_path))
    before = file_state(db_path)
    if os.geteuid() == 0:
        why = immutable_unavailable(tmp_path)
        if why is not None:
            pytest.skip(why)
        assert chattr("+i", db_path, home).returncode == 0
    else:
        os.chmod(db_path, 0o444)
        os.chmod(home, 0o555)
    try:
        with pytest.raises(OSError):
            (home / "probe").write_text("x")  # really read-only
        done = run_cli("--db", str(db_path), "ls", "--json")
        stats = run_cli("--db", str(db_path), "stats")
        denied = run_cli("--db", str(db_path), "purge", dispatch_id)
    finally:
        if os.geteuid() == 0:
            chattr("-i", db_path, home)
        else:
            os.chmod(home, 0o755)
            os.chmod(db_path, 0o644)
    assert done.returncode == 0, done.stderr
    assert [d["id"] for d in json.loads(done.stdout)["dispatches"]] == [dispatch_id]
    assert stats.returncode == 0, stats.stderr
    assert_one_line_error(denied, 2, "read")  # a write needs write access: one line
    assert file_state(db_path) == before


HOLD_LOCK = """
import sqlite3, sys, time
conn = sqlite3.connect(sys.argv[1], isolation_level=None)
conn.execute("BEGIN EXCLUSIVE")
print("locked", flush=True)
time.sleep(float(sys.argv[2]))
"""


@contextlib.contextmanager
def hold_lock(db_path: Path, seconds: float) -> Iterator[subprocess.Popen[str]]:
    """Another process holding the write lock while the block runs; killed
    and reaped, its pipe closed, at the end."""
    with subprocess.Popen(
        [sys.executable, "-c", HOLD_LOCK, str(db_path), str(seconds)],
        stdout=subprocess.PIPE,
        text=True,
    ) as holder:
        try:
            assert holder.stdout is not None and holder.stdout.readline().strip() == "locked"
            yield holder
        finally:
            holder.kill()


def test_stats_behind_a_held_write_lock_answers_at_once(db_path: Path) -> None:
    anyio.run(populate, str(db_path))
    with hold_lock(db_path, 30):
        started = time.monotonic()
        done = run_cli("--db", str(db_path), "stats", "--json")
        elapsed = time.monotonic() - started
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["total"] == 1
    assert elapsed < 5


@pytest.mark.parametrize("source", ["flag", "config", "environment beside --db"])
def test_every_command_waits_busy_timeout_then_fails_in_one_line(
    db_path: Path, tmp_path: Path, source: str
) -> None:
    dispatch_id = anyio.run(populate, str(db_path))
    config = tmp_path / "c.yaml"
    config.write_text(f"store: {db_path}\nbusy_timeout_seconds: 0.3\n")
    env: dict[str, str] = {}
    if source == "flag":
        where = ["--db", str(db_path), "--busy-timeout", "0.3"]
    elif source == "config":
        where = ["--config", str(config)]
    else:  # --db names the store; $TRIO_DISPATCH_CONFIG still sets the wait
        where, env = ["--db", str(db_path)], {"TRIO_DISPATCH_CONFIG": str(config)}
    with hold_lock(db_path, 30):
        started = time.monotonic()
        done = run_cli(*where, "purge", dispatch_id, env=env)
        elapsed = time.monotonic() - started
    assert_one_line_error(done, 2, "locked")
    assert 0.3 <= elapsed < 5


@pytest.mark.slow
@pytest.mark.anyio
@pytest.mark.postgres_only
async def test_postgres_read_commands_create_nothing_and_name_migrate(
    postgres_url: str, raw: RawDB
) -> None:
    import psycopg

    name = f"trio_dispatch_ro_{os.getpid()}"
    admin_url = postgres_url.rsplit("/", 1)[0] + "/postgres"
    with psycopg.connect(admin_url, autocommit=True) as admin:
        admin.execute(f'DROP DATABASE IF EXISTS "{name}"')
        admin.execute(f'CREATE DATABASE "{name}"')
    url = postgres_url.rsplit("/", 1)[0] + f"/{name}"
    try:
        done = await arun_cli("--db", url, "stats")
        assert_one_line_error(done, 2, "no trio_dispatch schema", "trio-dispatch migrate")
        with psycopg.connect(url) as conn:
            tables = conn.execute(
                "SELECT count(*) FROM pg_tables WHERE schemaname = 'public'"
            ).fetchone()
        assert tables == (0,)
        assert (await arun_cli("--db", url, "migrate")).returncode == 0
        async with open_store(url, read_only=True) as db:
            assert await get_dispatch(db, "nope") is None
            with pytest.raises(StoreError, match="read-only"):
                await enqueue_dispatch(db, kind="k", deliver_to="seat")
    finally:
        with psycopg.connect(admin_url, autocommit=True) as admin:
            admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


# -- 4. one-line errors ---------------------------------------------------------------


def test_store_problems_are_one_line_errors(tmp_path: Path, db_path: Path) -> None:
    text_file = tmp_path / "notes.db"
    text_file.write_text("these are my notes, not a database\n" * 10)
    assert_one_line_error(run_cli("--db", str(text_file), "ls"), 2, "not a SQLite database")
    assert_one_line_error(run_cli("--db", "sqlite://x.db", "ls"), 2, "sqlite:///")
    assert_one_line_error(run_cli("--db", "redis://h/0", "ls"), 2, "unsupported store URL")
    anyio.run(populate, str(db_path))
    conn = sqlite3.connect(db_path)
    conn.execute("INSERT INTO trio_dispatch_schema VALUES (99, 0)")
    conn.commit()
    conn.close()
    assert_one_line_error(
        run_cli("--db", str(db_path), "ls"), 2, "schema version 99", "upgrade trio_dispatch"
    )


def test_usage_problems_are_one_line_errors(db_path: Path) -> None:
    anyio.run(populate, str(db_path))
    assert_one_line_error(
        run_cli("--db", str(db_path), "ls", "--limit", "3000000000"), 2, "3000000000"
    )
    assert_one_line_error(
        run_cli("--db", str(db_path), "prune", "--status", ","), 2, "at least one status"
    )
    assert_one_line_error(
        run_cli("--db", str(db_path), "--busy-timeout", "1e300", "ls"), 2, "--busy-timeout"
    )
    # argparse's own messages quote the arguments: escaped, passwords masked.
    hostile = run_cli("--db", str(db_path), "ls", "a\nb\x1b[31mX", "postgresql://u:s3cret@h/d")
    assert_one_line_error(hostile, 2, "unrecognized arguments", "a\\nb\\x1b[31mX", "u:***@h")
    assert "\x1b" not in hostile.stderr and "s3cret" not in hostile.stderr


def test_a_non_utf8_id_is_not_found(db_path: Path) -> None:
    anyio.run(populate, str(db_path))
    done = subprocess.run(
        [
            sys.executable.encode(),
            b"-m",
            b"trio_dispatch",
            b"--db",
            str(db_path).encode(),
            b"show",
            b"\xff\xfe",
        ],
        capture_output=True,
        timeout=60,
    )
    assert done.returncode == 1, done.stderr
    lines = done.stderr.decode().strip().splitlines()
    assert len(lines) == 1 and "not found" in lines[0], done.stderr


def test_a_worker_whose_store_directory_is_missing_is_a_one_line_error(tmp_path: Path) -> None:
    config = tmp_path / "c.yaml"
    config.write_text(f"store: {tmp_path / 'missing' / 'outbox.db'}\n")
    done = cli_process("--config", str(config), "worker")
    assert_one_line_error(done, 2, "does not exist", "missing")


REFUSED_CONFIGS = [
    ("worker:\n  concurrency: 3000000000\n", ["worker.concurrency", "2147483647"]),
    ("worker:\n  batch_size: 2147483648\n", ["worker.batch_size"]),
    ("worker:\n  tick_seconds: 1.0e-7\n", ["worker.tick_seconds", "0.001"]),
    ("dispatch:\n  timeout_seconds: 1.0e-7\n", ["dispatch.timeout_seconds"]),
    ('store: "out\\0.db"\n', ["store", "NUL"]),
    ("store: sqlite://x.db\n", ["store", "sqlite:///"]),
    ("store: mysql://u:pw@h/db\n", ["store", "unsupported"]),
    ("busy_timeout_seconds: 3000000\n", ["busy_timeout_seconds", "2147483"]),
    ("store: a.db\nstore: b.db\n", ["duplicate key", "'store'", "line 1"]),
    ("worker:\n  concurrency: 2\n  concurrency: 3\n", ["duplicate key", "'concurrency'"]),
    ("dispatch:\n  env:\n    allow: [PATH]\n    inherit: true\n", ["dispatch.env", "not both"]),
    ("dispatch:\n  max_body_bytes: 0\n", ["dispatch.max_body_bytes"]),
    ('store: "postgresql://u:pw@127.0.0.1:5432/postgres?foo=bar"\n', ["store", "unknown"]),
    ('store: "postgresql://127.0.0.1:5432/postgres?foo=bar"\n', ["store", '"foo"']),
    ('store: "postgresql://u:pw@127.0.0.1:notaport/postgres"\n', ["store", "port"]),
    ('store: "postgresql://127.0.0.1:notaport/postgres"\n', ["store", "'notaport'"]),
    ('store: "out\\udc80.db"\n', ["store", "surrogate"]),
    ("dispatch:\n  retry_schedule: [1" + "0" * 400 + "]\n", ["dispatch.retry_schedule"]),
]
"""Configurations check-config refuses, each with the words its one line holds."""
WORKER_QUICK = {0, 8, 12}
"""The ones a real worker process also refuses in the loop after each change
(a key of the worker's, a duplicate key, a store URL); CI starts a worker
for every one (a process each, 0.7 s)."""


@pytest.mark.parametrize(("text", "words"), REFUSED_CONFIGS)
def test_check_config_refuses_what_the_worker_would_refuse(
    tmp_path: Path, text: str, words: list[str]
) -> None:
    config = tmp_path / "c.yaml"
    config.write_text(text)
    line = assert_one_line_error(run_cli("check-config", str(config)), 2, *words)
    assert "pw@" not in line


@pytest.mark.parametrize(
    ("text", "words"),
    [
        pytest.param(*refused, marks=() if n in WORKER_QUICK else pytest.mark.slow)
        for n, refused in enumerate(REFUSED_CONFIGS)
    ],
)
def test_the_worker_refuses_what_check_config_refuses(
    tmp_path: Path, text: str, words: list[str]
) -> None:
    config = tmp_path / "c.yaml"
    config.write_text(text)
    worker = cli_process("--config", str(config), "worker", timeout=30)
    assert_one_line_error(worker, 2, words[0])


def test_no_input_prints_a_traceback(tmp_path: Path) -> None:
    done = cli_process("--db", "postgresql://nobody@127.0.0.1:1/x", "ls")
    assert_one_line_error(done, 2, "cannot open store")


# -- 5, 11. failures recorded on every engine; permanent ones dead-letter ------


@pytest.mark.anyio
async def test_a_failure_text_with_nul_bytes_is_recorded_on_every_engine(
    store: SQLiteStore, raw: RawDB, tmp_path: Path
) -> None:
    script = tmp_path / "nul.py"
    script.write_text("import sys\nsys.stderr.write('bad\\x00byte')\nsys.exit(1)\n")
    dispatch_id = await enqueue_dispatch(store, kind="k", deliver_to="seat")
    counts = await deliver_due_dispatches(store, notify_template=[sys.executable, str(script)])
    assert counts["retried"] == 1
    row = raw.row(dispatch_id)
    assert row["status"] == "pending" and row["last_error"] == "bad\ufffdbyte"
    assert row["next_attempt_at"] > time.time() + 50  # its backoff, not the lease
    assert raw.transitions(dispatch_id)[-1]["reason_code"] == "dispatch.pending.retry_backoff"


@pytest.mark.anyio
async def test_a_result_built_by_hand_with_nul_is_recorded_too(
    store: SQLiteStore, raw: RawDB
) -> None:
    async def send(delivery: Delivery) -> TransportResult:
        return TransportResult(ok=False, error="nul\x00inside")

    dispatch_id = await enqueue_dispatch(store, kind="k", deliver_to="seat")
    await deliver_due_dispatches(store, transport=send)
    assert raw.row(dispatch_id)["last_error"] == "nul\ufffdinside"


@pytest.mark.anyio
async def test_a_failure_text_with_a_lone_surrogate_is_recorded_on_every_engine(
    store: SQLiteStore, raw: RawDB
) -> None:
    async def send(delivery: Delivery) -> None:
        raise ValueError("bad \udc80 text")  # e.g. undecodable bytes decoded with surrogateescape

    dispatch_id = await enqueue_dispatch(store, kind="k", deliver_to="seat")
    counts = await deliver_due_dispatches(store, transport=send)
    assert counts["retried"] == 1
    row = raw.row(dispatch_id)
    assert row["status"] == "pending" and row["last_error"] == "ValueError: bad \ufffd text"
    assert row["next_attempt_at"] > time.time() + 50  # its backoff, not the lease


@pytest.mark.anyio
async def test_an_argv_the_os_refuses_dead_letters_at_once(store: SQLiteStore, raw: RawDB) -> None:
    big = await enqueue_dispatch(store, kind="k", deliver_to="seat", body={"blob": "x" * 200_000})
    huge_kind = await enqueue_dispatch(store, kind="k" * 200_000, deliver_to="seat")
    counts = await deliver_due_dispatches(store, notify_template=["true", "{payload}"])
    assert counts["dead_letter"] == 2 and counts["retried"] == 0
    for dispatch_id in (big, huge_kind):
        row = raw.row(dispatch_id)
        assert (row["status"], row["attempt"]) == ("dead_letter", 1)
        assert "E2BIG" in str(row["last_error"])
        last = raw.transitions(dispatch_id)[-1]
        assert last["reason_code"] == "dispatch.dead_letter.max_attempts"
        assert json.loads(str(last["metadata"]))["permanent"] is True


@pytest.mark.anyio
async def test_a_body_over_the_limit_is_refused_naming_its_size_and_writes_nothing(
    db_target: str, raw: RawDB
) -> None:
    async with open_store(db_target, max_body_bytes=1000) as db:
        too_big = r"body is 1,0\d\d bytes of JSON, over the limit of 1,000 bytes"
        with pytest.raises(ValueError, match=too_big):
            await enqueue_dispatch(db, kind="k", deliver_to="seat", body={"b": "x" * 1000})
        with pytest.raises(ValueError, match="item 1: body is more than 1,000 bytes"):
            await enqueue_many(
                db,
                [
                    {"kind": "k", "deliver_to": "s"},
                    {"kind": "k", "deliver_to": "s", "body": {"b": "é" * 2000}},
                ],
            )
        async with db.transaction() as tx:
            with pytest.raises(ValueError, match="over the limit"):
                await enqueue_dispatch(tx, kind="k", deliver_to="s", body={"b": "x" * 2000})
        await enqueue_dispatch(db, kind="k", deliver_to="seat", body={"b": "x" * 900})
    assert raw.counts() == (1, 1)
    async with open_store(db_target) as db:  # the default: 1 MiB
        with pytest.raises(ValueError, match="over the limit of 1,048,576 bytes"):
            await enqueue_dispatch(db, kind="k", deliver_to="seat", body={"b": "x" * (1024 * 1024)})


# -- 6. options cannot be smuggled in; 7. the child's environment ----------------------


ARGPARSE_DESTINATION = """
import argparse, os, sys
parser = argparse.ArgumentParser()
parser.add_argument("route")
route = parser.parse_args().route
with open(os.environ["RECEIVED"], "a") as out:
    out.write(route + "\\n")
"""


@pytest.mark.anyio
async def test_a_route_like_an_option_reaches_the_destination_as_a_route(
    store: SQLiteStore, raw: RawDB, tmp_path: Path
) -> None:
    script = tmp_path / "dest.py"
    script.write_text(ARGPARSE_DESTINATION)
    received = tmp_path / "received"
    dispatch_id = await enqueue_dispatch(store, kind="k", deliver_to="--help")
    transport = CommandTransport(
        [sys.executable, str(script), "--", "{deliver_to}"],
        env={**os.environ, "RECEIVED": str(received)},
    )
    counts = await deliver_due_dispatches(store, transport=transport)
    assert counts["delivered"] == 1
    assert received.read_text() == "--help\n"
    assert raw.row(dispatch_id)["status"] == "delivered"


@pytest.mark.anyio
async def test_the_example_configuration_delivers_a_route_like_an_option_as_a_route(
    store: SQLiteStore, raw: RawDB, tmp_path: Path
) -> None:
    # The example's own template, with an argparse destination in place of the
    # demo script: without "--" it would print its help, exit 0, and the
    # dispatch would be recorded delivered though nothing was sent.
    from trio_dispatch.config import load_config

    example = Path(__file__).resolve().parents[2] / "config.example.yaml"
    template = list(load_config(example).dispatch.notify_template or ())
    script = tmp_path / "dest.py"
    script.write_text(ARGPARSE_DESTINATION)
    template[template.index("scripts/demo_transport.py")] = str(script)
    received = tmp_path / "received"
    dispatch_id = await enqueue_dispatch(store, kind="k", deliver_to="--help")
    transport = CommandTransport(template, env={**os.environ, "RECEIVED": str(received)})
    counts = await deliver_due_dispatches(store, transport=transport)
    assert counts["delivered"] == 1
    assert received.read_text() == "--help\n"
    assert raw.row(dispatch_id)["status"] == "delivered"


ENV_DUMP = "import json, os, sys\njson.dump(dict(os.environ), open(sys.argv[1], 'w'))\n"
SECRETS = {
    "AWS_SECRET_ACCESS_KEY": "aws",
    "PGPASSWORD": "pg",
    "GITHUB_TOKEN": "gh",
    "DATABASE_URL": "postgresql://app:hunter2@db/app",
    "STRIPE_API_KEY": "sk",
    "SSH_AUTH_SOCK": "/tmp/agent",
    "SERVICE_DSN": "x",
    "MY_PRIVATE_KEY": "k",
    "UPSTREAM": "https://user:pw@example.com/",
    "MY_DB": "postgresql://u@h/db?password=x",
    "GITHUB_PAT": "ghp_x",
    "STRIPE_SK": "sk_live_x",
    "DASH_BEARER": "b",
    "SLACK_WEBHOOK_URL": "https://hooks.slack.com/services/T0/B0/x",
    "OPS_WEBHOOK_URLS": "https://a.example/x",
    "MIRROR": "see https://bot:s3cr3t@git.example.com/repo.git",
    "FEED": "https://reader:pa/ss@feeds.example.com/",
}
HARMLESS = {
    "LANG": "C.UTF-8",
    "MY_SETTING": "1",
    "GIT_AUTHOR_NAME": "ada",
    "REPORT_URL": "https://example.com/report",
    "PORTAL": "https://example.com:8443/@team",
    "TASK": "nightly",
    "MY_PATH": "/opt/x",
    "PWD": "/srv",
    "OLDPWD": "/",
}


async def child_env(tmp_path: Path, environment: ChildEnvironment | None) -> dict[str, str]:
    script = tmp_path / "env.py"
    script.write_text(ENV_DUMP)
    out = tmp_path / "env.json"
    transport = CommandTransport(
        [sys.executable, str(script), str(out)],
        env={**os.environ, **SECRETS, **HARMLESS},
        child_env=environment,
    )
    delivery = Delivery(dispatch_id="d" * 32, kind="k", deliver_to="r", attempt=2, payload="{}")
    assert (await transport(delivery)).ok
    env: dict[str, str] = json.loads(out.read_text())
    return env


@pytest.mark.anyio
async def test_the_child_gets_no_secret_looking_variable_by_default(tmp_path: Path) -> None:
    env = await child_env(tmp_path, None)
    assert not set(SECRETS) & set(env)
    assert {k: env[k] for k in HARMLESS} == HARMLESS
    assert (env["TRIO_DISPATCH_ID"], env["TRIO_DISPATCH_ATTEMPT"]) == ("d" * 32, "2")


@pytest.mark.anyio
async def test_an_allow_list_passes_exactly_its_names_and_inherit_passes_all(
    tmp_path: Path,
) -> None:
    allowed = await child_env(tmp_path, ChildEnvironment(allow=("GITHUB_TOKEN", "LANG")))
    assert {k for k in allowed if not k.startswith("TRIO_DISPATCH_")} == {"GITHUB_TOKEN", "LANG"}
    everything = await child_env(tmp_path, ChildEnvironment(inherit=True))
    assert set(SECRETS) | set(HARMLESS) <= set(everything)


HOOK_KEY = "whsec_" + base64.b64encode(b"k" * 32).decode()


@pytest.mark.anyio
async def test_variables_the_configuration_reads_secrets_from_never_reach_the_child(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Names no heuristic flags: only the configuration says they are secrets.
    monkeypatch.setenv("OPS_DASH", "dashboard-bearer-0123456789")
    monkeypatch.setenv("HOOK_SIGNER", HOOK_KEY)
    monkeypatch.setenv("NOTIFY_REGION", "eu-west")
    script = tmp_path / "env.py"
    script.write_text(ENV_DUMP)
    out = tmp_path / "env.json"
    config = tmp_path / "c.yaml"
    config.write_text(
        json.dumps(
            {
                "store": str(tmp_path / "outbox.db"),
                "dispatch": {
                    "notify_template": [sys.executable, str(script), str(out)],
                    "webhook": {
                        "endpoints": {
                            "hooks": {"url": "https://h.example/in", "secrets": ["env:HOOK_SIGNER"]}
                        }
                    },
                },
                "http": {"token": "env:OPS_DASH"},
            }
        )
    )
    from trio_dispatch.config import load_config

    loaded = load_config(config)
    assert loaded.dispatch.env.drop == {"OPS_DASH", "HOOK_SIGNER"}
    async with open_store(loaded.store_target()) as db:
        await enqueue_dispatch(db, kind="k", deliver_to="seat")
        async with anyio.create_task_group() as tg:
            worker = DispatchWorker.from_config(db, loaded, tick_seconds=3600)
            await tg.start(worker.run)
            await wait_for(lambda: worker.counts["delivered"] == 1)
            tg.cancel_scope.cancel()
    env: dict[str, str] = json.loads(out.read_text())
    assert "OPS_DASH" not in env and "HOOK_SIGNER" not in env
    assert not {"dashboard-bearer-0123456789", HOOK_KEY} & set(env.values())
    assert env["NOTIFY_REGION"] == "eu-west"  # the rest of the environment is kept
    shown = await arun_cli("check-config", str(config), "--json")
    assert json.loads(shown.stdout)["env"]["dropped"] == ["HOOK_SIGNER", "OPS_DASH"]


# -- 8. terminal and log injection ---------------------------------------------------

HOSTILE_KIND = "build\n2026-01-01 00:00:00 INFO trio_dispatch: forged\x1b[31m"


@pytest.mark.anyio
async def test_a_hostile_kind_cannot_forge_a_log_line(
    store: SQLiteStore, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="trio_dispatch.worker")
    await enqueue_dispatch(store, kind=HOSTILE_KIND, deliver_to="seat")

    async def fail(delivery: Delivery) -> bool:
        return False

    async with anyio.create_task_group() as tg:
        worker = DispatchWorker(store, transport=fail, tick_seconds=3600)
        await tg.start(worker.run)
        await wait_for(lambda: worker.counts["retried"] == 1)
        tg.cancel_scope.cancel()
    messages = [record.getMessage() for record in caplog.records]
    outcome = next(m for m in messages if "result=retry" in m)
    assert "\n" not in outcome and "\x1b" not in outcome
    assert "kind=build\\n2026-01-01" in outcome


def test_ls_show_and_history_print_escapes_not_control_characters(db_path: Path) -> None:
    async def build() -> str:
        async with open_store(db_path) as db:
            dispatch_id = await enqueue_dispatch(
                db, kind=HOSTILE_KIND, deliver_to="seat", body={"t": "\x1b]0;title\x07\u2028\u202e"}
            )

            async def fail(delivery: Delivery) -> TransportResult:
                return TransportResult.failure("boom\x1b[2J\r\nnext")

            await deliver_due_dispatches(db, transport=fail)
            return dispatch_id

    dispatch_id = anyio.run(build)
    for command in (["ls"], ["show", dispatch_id], ["history", dispatch_id]):
        done = run_cli("--db", str(db_path), *command)
        assert done.returncode == 0, done.stderr
        for bad in ("\x1b", "\x07", "\r", "\u202e", "\u2028"):
            assert bad not in done.stdout, (command, bad)
    shown = run_cli("--db", str(db_path), "show", dispatch_id).stdout
    assert "build\\n2026-01-01" in shown and "\\x1b[31m" in shown and "\\u202e" in shown
    listed = run_cli("--db", str(db_path), "ls").stdout
    assert len(listed.splitlines()) == 2  # header and one row: no forged line


# -- 9. an ack needs a token ------------------------------------------------------------


@pytest.mark.anyio
async def test_an_ack_never_succeeds_against_a_missing_token(
    store: SQLiteStore, raw: RawDB
) -> None:
    dispatch_id = await enqueue_dispatch(store, kind="k", deliver_to="seat", ack_required=True)
    raw.execute("UPDATE dispatch_outbox SET ack_token = NULL WHERE id = ?", (dispatch_id,))
    for token in ("None", "", "null"):
        with pytest.raises(ValueError, match="has no ack token"):
            await ack_dispatch(store, dispatch_id, token)
    assert raw.row(dispatch_id)["status"] == "pending"
    assert len(raw.transitions(dispatch_id)) == 1


# -- 10. a callable that raises SystemExit fails its attempt only ----------------------

SYSTEM_EXIT_WORKER = """
import sys, anyio
from trio_dispatch import DispatchWorker, enqueue_dispatch, open_store, get_dispatch

async def main():
    async with open_store(sys.argv[1]) as db:
        quits = await enqueue_dispatch(db, kind="quit", deliver_to="a")
        closes = await enqueue_dispatch(db, kind="close", deliver_to="b")
        fine = await enqueue_dispatch(db, kind="fine", deliver_to="c")

        async def send(delivery):
            if delivery.kind == "quit":
                raise SystemExit(3)
            if delivery.kind == "close":
                raise GeneratorExit()

        async with anyio.create_task_group() as tg:
            worker = DispatchWorker(db, transport=send, tick_seconds=3600)
            await tg.start(worker.run)
            with anyio.fail_after(10):
                while worker.counts["delivered"] + worker.counts["retried"] < 3:
                    await anyio.sleep(0.01)
            tg.cancel_scope.cancel()
        for dispatch_id in (quits, closes, fine):
            row = await get_dispatch(db, dispatch_id)
            print(row["status"], row["last_error"])

anyio.run(main, backend=sys.argv[2])
"""


@pytest.mark.parametrize("backend", ["trio", "asyncio"])
def test_a_callable_raising_system_exit_fails_its_attempt_and_the_worker_goes_on(
    db_path: Path, tmp_path: Path, backend: str
) -> None:
    # In a child process: an escaping SystemExit would take pytest with it.
    script = tmp_path / "quit.py"
    script.write_text(SYSTEM_EXIT_WORKER)
    done = subprocess.run(
        [sys.executable, str(script), str(db_path), backend],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [
        "pending SystemExit: 3",
        "pending GeneratorExit",
        "delivered None",
    ]


# -- 12. the engines answer alike -----------------------------------------------------


@pytest.mark.anyio
async def test_a_question_mark_inside_a_quoted_literal_is_not_a_placeholder(
    store: SQLiteStore, raw: RawDB
) -> None:
    async with store.transaction() as tx:
        await tx.execute("INSERT INTO sessions (id, created_at) VALUES ('what?', ?)", (1.5,))
        await tx.execute(
            "INSERT INTO sessions (id, created_at) VALUES (? || '-50%', 2) /* why? */", ("x",)
        )
        rows = await tx.query(
            "SELECT id FROM sessions WHERE id LIKE '%?' OR id = ? ORDER BY id", ("x-50%",)
        )
    assert [r["id"] for r in rows] == ["what?", "x-50%"]
    assert raw.scalar("SELECT created_at FROM sessions WHERE id = 'what?'") == 1.5


@pytest.mark.anyio
@pytest.mark.parametrize("bad_id", ["a\x00b", "\udcff\udcfe", "x\ud800"])
async def test_an_id_no_row_can_have_is_not_found_on_every_engine(
    store: SQLiteStore, bad_id: str
) -> None:
    await enqueue_dispatch(store, kind="k", deliver_to="seat")
    assert await get_dispatch(store, bad_id) is None
    assert await list_transitions(store, bad_id) == []
    assert await retry_dispatch(store, bad_id) is False
    assert await purge_dispatch(store, bad_id) is False
    with pytest.raises(LookupError):
        await ack_dispatch(store, bad_id, "token")
    if "\x00" in bad_id:
        assert await list_dispatches(store, kind=bad_id) == []


ECHO_STDIN = "import sys\nsys.stderr.write('refused: ' + sys.stdin.read())\nsys.exit(1)\n"


@pytest.mark.anyio
async def test_an_ack_token_echoed_by_a_destination_never_reaches_error_history_or_logs(
    store: SQLiteStore, raw: RawDB, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="trio_dispatch.worker")
    script = tmp_path / "echo.py"
    script.write_text(ECHO_STDIN)
    dispatch_id = await enqueue_dispatch(store, kind="k", deliver_to="seat", ack_required=True)
    token = str(raw.row(dispatch_id)["ack_token"])
    async with anyio.create_task_group() as tg:
        worker = DispatchWorker(
            store, notify_template=[sys.executable, str(script)], tick_seconds=3600
        )
        await tg.start(worker.run)
        await wait_for(lambda: worker.counts["retried"] == 1)
        tg.cancel_scope.cancel()
    row = raw.row(dispatch_id)
    assert "refused: {" in str(row["last_error"]) and '"ack_token": "***"' in str(row["last_error"])
    history = json.dumps(raw.transitions(dispatch_id))
    assert token not in str(row["last_error"]) and token not in history
    assert token not in caplog.text
    for command in (["show", dispatch_id], ["ls", "--json"], ["history", dispatch_id, "--json"]):
        done = await arun_cli("--db", raw.target, *command)
        assert token not in done.stdout, command


# -- read-only stores that live ----------------------------------------------------------


@pytest.mark.anyio
@pytest.mark.sqlite_only
async def test_a_long_lived_read_only_store_sees_later_commits(db_path: Path) -> None:
    await populate(str(db_path))
    async with open_store(db_path, read_only=True) as reader:
        assert len(await list_dispatches(reader)) == 1
        async with open_store(db_path) as writer:
            await enqueue_many(writer, [{"kind": "k", "deliver_to": "s"}] * 50)
        assert len(await list_dispatches(reader, limit=100)) == 51


def test_a_wal_file_without_its_shm_in_a_read_only_directory_is_a_clear_error(
    tmp_path: Path,
) -> None:
    home = tmp_path / "store"
    home.mkdir()
    db_path = home / "outbox.db"
    anyio.run(populate, str(db_path))
    # A writer that died leaves -wal (with commits) and -shm; take -shm away.
    conn = sqlite3.connect(db_path)
    conn.execute("PRAGMA wal_autocheckpoint = 0")
    conn.execute("INSERT INTO sessions (id, created_at) VALUES ('s', 1)")
    conn.commit()
    wal = (home / "outbox.db-wal").read_bytes()
    conn.close()
    (home / "outbox.db-wal").write_bytes(wal)
    (home / "outbox.db-shm").unlink(missing_ok=True)
    if os.geteuid() == 0:
        why = immutable_unavailable(tmp_path)
        if why is not None:
            pytest.skip(why)
        assert chattr("+i", home).returncode == 0
    else:
        os.chmod(home, 0o555)
    try:
        done = run_cli("--db", str(db_path), "ls")
    finally:
        if os.geteuid() == 0:
            chattr("-i", home)
        else:
            os.chmod(home, 0o755)
    assert_one_line_error(done, 2, "cannot be read by this user", "-wal")
