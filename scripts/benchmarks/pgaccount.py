"""What one PostgreSQL delivery costs the server and the client, ours beside
pgqueuer's: round trips, statements, commits, WAL records and bytes,
fsyncs, heap tuples and index entries written, and the worker process's
CPU, per delivery of one worker process draining a queue.

Measured on a server of the run's own when ``initdb`` is installed (its
WAL is the run's alone, and it loads ``pg_stat_statements``), else on the
shared server, whose WAL counters are every database's (said in the note).
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Final

import anyio

from trio_dispatch.lifecycle import DUE_SQL

from .harness import ROOT
from .pgserver import private_postgres
from .processes import WORKER_CHILD, Drained, drain_with_processes, server_cpu_of
from .workloads import fill_ours

COUNT_TRIPS: Final = """
import contextlib, psycopg
TRIPS = [0]
_execute, _executemany = psycopg.Cursor.execute, psycopg.Cursor.executemany
_pipeline = psycopg.Connection.pipeline
def _execute_counted(self, *args, **kwargs):
    TRIPS[0] += self._conn._pipeline is None
    return _execute(self, *args, **kwargs)
def _executemany_counted(self, *args, **kwargs):
    TRIPS[0] += self._conn._pipeline is None
    return _executemany(self, *args, **kwargs)
@contextlib.contextmanager
def _pipeline_counted(self):
    outer = self._pipeline is None
    with _pipeline(self) as pipeline:
        yield pipeline
    TRIPS[0] += outer
psycopg.Cursor.execute = _execute_counted
psycopg.Cursor.executemany = _executemany_counted
psycopg.Connection.pipeline = _pipeline_counted
"""
"""Counts the round trips of every psycopg connection of the process: a
statement outside a pipeline is one, a whole pipeline one."""

OURS_COUNTED_CHILD: Final = (
    COUNT_TRIPS
    + WORKER_CHILD.replace(
        "await anyio.to_thread.run_sync(sys.stdin.readline)",
        "await anyio.to_thread.run_sync(sys.stdin.readline); TRIPS[0] = 0",
    )
    + 'print("trips", TRIPS[0], flush=True)\n'
)
"""Our worker process, counting its round trips from "go" on."""

ADMIN_READS: Final = {
    "wal": "SELECT wal_records, wal_fpi, wal_bytes, wal_write, wal_sync FROM pg_stat_wal",
    "lsn": "SELECT pg_current_wal_lsn() - '0/0'::pg_lsn",
}
DB_READS: Final = {
    "db": "SELECT xact_commit, xact_rollback FROM pg_stat_database "
    "WHERE datname = current_database()",
    "tables": "SELECT COALESCE(SUM(n_tup_ins), 0), COALESCE(SUM(n_tup_upd), 0), "
    "COALESCE(SUM(n_tup_hot_upd), 0), COALESCE(SUM(n_tup_del), 0), "
    # index entries written, at most: a partial index skips rows outside it
    "COALESCE(SUM((n_tup_ins + n_tup_upd - n_tup_hot_upd) * (SELECT COUNT(*) FROM pg_index i "
    "WHERE i.indrelid = t.relid)), 0) FROM pg_stat_user_tables t",
    "index_bytes": "SELECT COALESCE(SUM(pg_relation_size(indexrelid)), 0) "
    "FROM pg_stat_user_indexes",
}
STATEMENTS: Final = (
    "SELECT query, calls FROM pgss.pg_stat_statements "
    "WHERE dbid = (SELECT oid FROM pg_database WHERE datname = current_database()) "
    "AND query NOT ILIKE 'SELECT COUNT(*) FROM%' AND query NOT ILIKE '%pg_stat%' "
    "AND query NOT ILIKE '%pg_relation_size%' AND calls > 0 ORDER BY calls DESC"
)


@dataclass
class Account:
    """One side's drain: its counters' deltas and what its process said."""

    name: str
    n: int
    drained: Drained
    deltas: dict[str, float]
    statements: list[tuple[str, int]] = field(default_factory=list)

    def per(self, key: str) -> float:
        return self.deltas.get(key, math.nan) / self.n


def _snapshot(admin: Any, db: Any) -> dict[str, float]:
    got: dict[str, float] = {}
    wal = admin.execute(ADMIN_READS["wal"]).fetchone()
    for key, value in zip(
        ("wal_records", "wal_fpi", "wal_bytes", "wal_write", "wal_sync"), wal, strict=True
    ):
        got[key] = float(value)
    got["lsn"] = float(admin.execute(ADMIN_READS["lsn"]).fetchone()[0])
    commit, rollback = db.execute(DB_READS["db"]).fetchone()
    got["commits"], got["rollbacks"] = float(commit), float(rollback)
    ins, upd, hot, dele, entries = db.execute(DB_READS["tables"]).fetchone()
    got.update(ins=ins, upd=upd, hot=hot, dele=dele, entries=entries)
    got["index_bytes"] = float(db.execute(DB_READS["index_bytes"]).fetchone()[0])
    return {key: float(value) for key, value in got.items()}


def _statements(db: Any) -> list[tuple[str, int]] | None:
    try:
        return [(str(q), int(c)) for q, c in db.execute(STATEMENTS).fetchall()]
    except Exception:  # not loaded on this server
        db.rollback()
        return None


def measure(
    name: str,
    admin_url: str,
    url: str,
    n: int,
    fill: Callable[[], None],
    drain: Callable[[], Drained],
) -> Account:
    """``fill`` (untimed), a checkpoint, the counters, ``drain``, the
    counters again once every backend of the drain has ended."""
    import psycopg

    fill()
    with (
        psycopg.connect(admin_url, autocommit=True) as admin,
        psycopg.connect(url, autocommit=True) as db,
    ):
        admin.execute("CHECKPOINT")
        has_statements = _statements(db) is not None
        if has_statements:
            db.execute("SELECT pgss.pg_stat_statements_reset()")
        db.execute("SELECT pg_stat_force_next_flush()")
        time.sleep(1.2)  # the fill's backends report on exit
        before = _snapshot(admin, db)
        drained = drain()
        time.sleep(1.5)  # the workers' backends report their counters on exit
        after = _snapshot(admin, db)
        statements = _statements(db) if has_statements else None
    deltas = {key: after[key] - before[key] for key in before}
    # the snapshot's own transactions (3 reads on the bench database) and the polls
    deltas["commits"] -= 4 + drained.polls
    account = Account(name, n, drained, deltas, statements or [])
    if statements is not None:
        account.deltas["statements"] = float(sum(calls for _, calls in statements))
    return account


def server_cpu(admin_url: str) -> Callable[[], float] | None:
    """The server's CPU time counter where the server runs here (a private
    one: its postmaster's children are the run's alone); None elsewhere."""
    import psycopg

    if "127.0.0.1:5432/" in admin_url:  # the shared server: others' work too
        return None
    with psycopg.connect(admin_url, autocommit=True) as conn:
        pid = conn.execute("SELECT pg_backend_pid()").fetchone()[0]
    try:
        with open(f"/proc/{pid}/stat") as stat:
            postmaster = int(stat.read().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError):
        return None
    return server_cpu_of(postmaster)


def ours_account(
    admin_url: str,
    url: str,
    n: int,
    body: dict[str, Any] | None,
    root: str = str(ROOT),
    workers: int = 1,
    concurrency: int = 64,
) -> Account:
    """Ours (the source tree at ``root``), ``workers`` processes of
    ``concurrency`` slots."""

    def drain() -> Drained:
        return drain_with_processes(
            [sys.executable, "-c", OURS_COUNTED_CHILD, url, root, str(concurrency)],
            workers,
            url,
            f"SELECT COUNT(*) FROM dispatch_outbox WHERE {DUE_SQL}",
            n,
            server_cpu(admin_url),
        )

    name = f"ours at {concurrency}"
    account = measure(name, admin_url, url, n, lambda: anyio.run(fill_ours, url, n, body), drain)
    for line in account.drained.said[0].splitlines():
        if line.startswith("trips "):
            account.deltas["trips"] = float(line.split()[1])
    return account


def pgq_account(admin_url: str, url: str, n: int, child: str) -> Account:
    from .postgres import pgq_fill

    def drain() -> Drained:
        return drain_with_processes(
            [sys.executable, "-c", child, url],
            1,
            url,
            "SELECT COUNT(*) FROM pgqueuer",
            n,
            server_cpu(admin_url),
        )

    account = measure(
        "pgqueuer",
        admin_url,
        url,
        n,
        lambda: anyio.run(pgq_fill, url, n, backend="asyncio"),
        drain,
    )
    # asyncpg sends each statement with its own Sync and waits for it: one
    # round trip a statement (BEGIN and COMMIT included).
    if "statements" in account.deltas:
        account.deltas["trips"] = account.deltas["statements"]
    return account


ROWS: Final = (
    ("deliveries/s (the whole drain)", lambda a: a.drained.rate, "{:,.0f}"),
    ("round trips", lambda a: a.per("trips"), "{:.2f}"),
    ("statements", lambda a: a.per("statements"), "{:.2f}"),
    ("commits", lambda a: a.per("commits"), "{:.3f}"),
    ("WAL records", lambda a: a.per("wal_records"), "{:.2f}"),
    ("WAL bytes", lambda a: a.per("wal_bytes"), "{:,.0f}"),
    ("  of which full-page images (count)", lambda a: a.per("wal_fpi"), "{:.3f}"),
    ("WAL bytes by LSN", lambda a: a.per("lsn"), "{:,.0f}"),
    ("WAL fsyncs", lambda a: a.per("wal_sync"), "{:.3f}"),
    ("heap tuples inserted", lambda a: a.per("ins"), "{:.2f}"),
    ("heap tuples updated (of which HOT)", None, ""),
    ("heap tuples deleted", lambda a: a.per("dele"), "{:.2f}"),
    ("index entries written, at most", lambda a: a.per("entries"), "{:.2f}"),
    ("index bytes grown", lambda a: a.per("index_bytes"), "{:,.0f}"),
    ("client CPU, us", lambda a: a.drained.cpu_seconds / a.n * 1e6, "{:,.0f}"),
    ("server CPU, us", lambda a: a.drained.server_cpu_seconds / a.n * 1e6, "{:,.0f}"),
)


def account_table(accounts: list[Account]) -> list[str]:
    """The per-delivery cost account as Markdown lines, one column a side."""
    head = "| per delivery | " + " | ".join(a.name for a in accounts) + " |"
    lines = [head, "| --- |" + " ---: |" * len(accounts)]
    for label, value, fmt in ROWS:
        cells = []
        for a in accounts:
            if value is None:
                cells.append(f"{a.per('upd'):.2f} ({a.per('hot'):.2f})")
                continue
            v = value(a)
            cells.append("n/a" if math.isnan(v) else fmt.format(v))
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return lines


def statement_lines(account: Account, top: int = 12) -> list[str]:
    """The statements ``account``'s drain ran most, per delivery."""
    lines = []
    for query, calls in account.statements[:top]:
        text = " ".join(query.split())
        lines.append(f"  {calls / account.n:6.3f}  {text[:150]}")
    return lines


def other_account(name: str, admin_url: str, url: str, n: int, child: OtherChild) -> Account:
    """A peer's worker process (one) draining ``n`` jobs its ``fill`` queued."""

    def drain() -> Drained:
        return drain_with_processes(
            child.drain_argv(url), 1, url, child.remaining_sql, n, server_cpu(admin_url)
        )

    account = measure(name, admin_url, url, n, lambda: child.fill(url, n), drain)
    if "statements" in account.deltas:  # a psycopg client: one round trip a statement
        account.deltas["trips"] = account.deltas["statements"]
    return account


@dataclass(frozen=True)
class OtherChild:
    """A peer's worker program: how to queue ``n`` jobs on a database
    (untimed), the argv of a worker process on it, and the count of its
    undone jobs."""

    fill: Callable[[str, int], None]
    drain_argv: Callable[[str], list[str]]
    remaining_sql: str


def run_account(
    n: int,
    body: dict[str, Any] | None,
    pgq_child: str,
    shared: tuple[str, str] | None,
    others: tuple[tuple[str, OtherChild], ...] = (),
) -> list[str]:
    """The account of ours (at concurrency 16, the default, and 64),
    pgqueuer and the ``others`` (one process each), as note lines."""
    import psycopg

    settings = ("shared_preload_libraries=pg_stat_statements", "pg_stat_statements.max=1000")
    with private_postgres(settings) as private:
        if private is not None:
            admin, where = private, "a server of the run's own (WAL counters are its alone)"
            with psycopg.connect(admin, autocommit=True) as conn:
                conn.execute("CREATE DATABASE bench")
                url = admin.rsplit("/", 1)[0] + "/bench"
                with psycopg.connect(url, autocommit=True) as db:
                    db.execute("CREATE SCHEMA pgss")
                    db.execute("CREATE EXTENSION pg_stat_statements SCHEMA pgss")
        elif shared is not None:
            admin, url = shared
            where = "the shared server (its WAL counters count every database's writes)"
        else:
            return []
        from .pgserver import fresh_postgres

        accounts = []
        for concurrency in (16, 64):
            fresh_postgres(url)
            accounts.append(ours_account(admin, url, n, body, concurrency=concurrency))
        fresh_postgres(url)
        accounts.append(pgq_account(admin, url, n, pgq_child))
        for name, drain_child in others:
            fresh_postgres(url)
            accounts.append(other_account(name, admin, url, n, drain_child))
    lines = [
        f"postgres cost account: one worker process of each draining {n} queued no-op "
        f"deliveries, on {where}; counters' deltas per delivery (round trips: ours counted "
        "in the process, pgqueuer's = its statements; commits: pg_stat_database less the "
        "polls; index entries: (inserts + non-HOT updates) x the table's indexes):",
        *account_table(accounts),
    ]
    for account in accounts:
        if account.statements:
            lines.append(f"{account.name}: statements per delivery (pg_stat_statements)")
            lines += statement_lines(account)
    return lines
