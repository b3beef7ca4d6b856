"""The drivers' child processes and their reads of the store, on either
engine: a role started and stopped, a worker run until its signal, the
rows and the ledger of sends, and the figures every driver reports of
them."""

from __future__ import annotations

import collections
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from trio_dispatch import DispatchWorker

ROOT = Path(__file__).resolve().parents[2]
"""The repository: scratch folders go under it, child processes import from it."""
sys.path.insert(0, str(ROOT))  # trio_dispatch, in every driver and its roles

TERMINAL = ("delivered", "acked", "dead_letter", "expired", "cancelled", "superseded")


def spawn(*args: str, script: str, log: Path | None = None) -> subprocess.Popen[bytes]:
    """A role of the driver ``script`` (its ``--role`` arguments) as a child
    process, its stderr appended to ``log``."""
    argv = [sys.executable, script, "--role", *args]
    if log is None:
        return subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    with open(log, "ab") as sink:  # the child holds its own copy; ours closes here
        return subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=sink)


async def run_until_signalled(worker: DispatchWorker) -> None:
    """Run a role's ``worker`` until SIGTERM or SIGINT, then stop it."""
    import anyio

    async with anyio.create_task_group() as tg:
        with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            await tg.start(worker.run)
            async for _ in signals:
                tg.cancel_scope.cancel()
                break


def stop(process: subprocess.Popen[bytes], timeout: float = 20) -> int:
    """SIGTERM a role (SIGKILL past ``timeout``); its exit code, 0 for a
    clean stop. A role that the signal ended outright (-15) got it before
    its interpreter had started it -- a role takes its signals before its
    worker claims anything -- so it stopped clean, having done nothing."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
    try:
        code = process.wait(timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        return process.wait()
    return 0 if code == -signal.SIGTERM else code


def make_schema(db: Path | str) -> None:
    """The outbox's tables in ``db``, before any role opens it."""
    import anyio

    from trio_dispatch import open_store

    async def touch() -> None:
        async with open_store(db):
            pass

    anyio.run(touch)


def is_postgres(db: Path | str) -> bool:
    return str(db).startswith(("postgresql://", "postgres://"))


def query(db: Path | str, sql: str, params: tuple[Any, ...] = ()) -> list[dict[str, Any]]:
    """Rows of a query on either engine (SQL with ? placeholders)."""
    if is_postgres(db):
        import psycopg
        from psycopg.rows import dict_row

        with psycopg.connect(str(db), autocommit=True) as conn:
            cursor = conn.cursor(row_factory=dict_row)
            cursor.execute(sql.replace("?", "%s"), params)  # type: ignore[arg-type]
            return list(cursor.fetchall()) if cursor.description else []
    conn = sqlite3.connect(db, timeout=30)
    conn.row_factory = sqlite3.Row
    try:
        rows = [dict(r) for r in conn.execute(sql, params)]
        conn.commit()
        return rows
    finally:
        conn.close()


def outbox_rows(db: Path | str) -> dict[str, dict[str, Any]]:
    """Every row's status and attempts, by id."""
    return {
        r["id"]: r
        for r in query(
            db, "SELECT id, status, attempt, max_attempts, next_attempt_at FROM dispatch_outbox"
        )
    }


def read_ledger(path: Path) -> list[tuple[str, int]]:
    """The (id, attempt) pairs a worker's transport appended, one a send."""
    if not path.exists():
        return []
    pairs = []
    for line in path.read_text().splitlines():
        parts = line.split()
        if len(parts) == 2:  # a line cut by a kill is not a send
            pairs.append((parts[0], int(parts[1])))
    return pairs


def pull_retries_forward(db: Path | str) -> None:
    """Time passing, compressed: retries scheduled minutes ahead are due now."""
    query(
        db,
        "UPDATE dispatch_outbox SET next_attempt_at = ? "
        "WHERE status = 'pending' AND next_attempt_at > ?",
        (time.time(), time.time()),
    )


def wait_terminal(db: Path | str, expected: int, timeout: float) -> bool:
    """Whether ``expected`` rows are there and all ended within ``timeout``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        rows = outbox_rows(db)
        if len(rows) >= expected and all(r["status"] in TERMINAL for r in rows.values()):
            return True
        pull_retries_forward(db)
        time.sleep(0.3)
    return False


def ledger_figures(ids: set[str], pairs: list[tuple[str, int]]) -> dict[str, int]:
    """Sends missing, (id, attempt) pairs sent twice, ids sent more than once."""
    pair_counts = collections.Counter(pairs)
    sends = collections.Counter(dispatch_id for dispatch_id, _ in pairs)
    return {
        "missing_from_ledger": len(ids - set(sends)),
        "duplicate_pairs": sum(1 for count in pair_counts.values() if count > 1),
        "repeated_ids": sum(1 for count in sends.values() if count > 1),
        "max_sends_of_one_id": max(sends.values(), default=0),
    }
