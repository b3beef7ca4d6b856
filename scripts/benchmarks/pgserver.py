"""Throwaway databases on the local PostgreSQL server
(``TRIO_DISPATCH_TEST_POSTGRES``, by default ``postgres@127.0.0.1:5432``)
for the sections that measure PostgreSQL (none when no server answers), and a
private server of the run's own for the counters that are server-wide.
"""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
import socket
import subprocess
import tempfile
import uuid
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path


def postgres_database() -> tuple[str, Callable[[], None]] | None:
    """A throwaway database on the local PostgreSQL server, or None."""
    try:
        import psycopg
    except ImportError:
        return None
    admin = os.environ.get(
        "TRIO_DISPATCH_TEST_POSTGRES", "postgresql://postgres@127.0.0.1:5432/postgres"
    )
    name = f"trio_dispatch_bench_{uuid.uuid4().hex[:8]}"
    try:
        with psycopg.connect(admin, autocommit=True, connect_timeout=3) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
    except psycopg.OperationalError:
        return None

    def drop() -> None:
        with psycopg.connect(admin, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')

    return f"{admin.rsplit('/', 1)[0]}/{name}", drop


def fresh_postgres(url: str) -> str:
    """Empty the database (its ``public`` schema) and return its URL."""
    import psycopg

    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("DROP SCHEMA public CASCADE")
        conn.execute("CREATE SCHEMA public")
    return url


def _postgres_bin() -> Path | None:
    for found in sorted(glob.glob("/usr/lib/postgresql/*/bin"), reverse=True):
        if (Path(found) / "initdb").exists() and (Path(found) / "pg_ctl").exists():
            return Path(found)
    return None


@contextlib.contextmanager
def private_postgres(settings: Sequence[str] = ()) -> Iterator[str | None]:
    """The URL of a PostgreSQL server of the run's own (initdb in a
    temporary directory, a free port, ``settings`` as ``-c`` options, fsync
    and synchronous_commit on: the WAL and fsync counts are the run's
    alone), stopped and removed afterwards; None when no ``initdb`` is
    installed. The shared server is never restarted."""
    bindir = _postgres_bin()
    as_root = os.geteuid() == 0
    if bindir is None or (as_root and shutil.which("runuser") is None):
        yield None
        return
    root = Path(tempfile.mkdtemp(prefix="trio_dispatch_bench_pg_"))
    data = root / "data"
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = int(probe.getsockname()[1])
    if as_root:
        shutil.chown(root, "postgres", "postgres")
    prefix = ["runuser", "-u", "postgres", "--"] if as_root else []
    ctl = [*prefix, str(bindir / "pg_ctl"), "-D", str(data), "-l", str(root / "log"), "-w"]
    try:
        subprocess.run(
            [*prefix, str(bindir / "initdb"), "-D", str(data), "-A", "trust", "-U", "postgres"],
            check=True,
            capture_output=True,
        )
        options = " ".join(
            [f"-p {port} -k {root} -c listen_addresses=127.0.0.1"]
            + [f"-c {setting}" for setting in settings]
        )
        subprocess.run([*ctl, "-o", options, "start"], check=True, capture_output=True)
    except (OSError, subprocess.CalledProcessError):
        shutil.rmtree(root, ignore_errors=True)
        yield None
        return
    try:
        yield f"postgresql://postgres@127.0.0.1:{port}/postgres"
    finally:
        subprocess.run([*ctl, "-m", "fast", "stop"], capture_output=True)
        shutil.rmtree(root, ignore_errors=True)
