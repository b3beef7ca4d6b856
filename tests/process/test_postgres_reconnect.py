"""The PostgreSQL store outlives its connections: backends terminated under
it, and a server restart (on a private server the test starts itself, never
the shared one)."""

from __future__ import annotations

import glob
import logging
import os
import shutil
import socket
import subprocess
import tempfile
import threading
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import anyio
import httpx
import pytest

from trio_dispatch import DispatchWorker, enqueue_dispatch
from trio_dispatch.store import ConnectionLostError, open_store
from trio_dispatch.transports import Delivery
from trio_dispatch.web import WebApp, parse_listen, serve_app

from ..conftest import PostgresRaw, RawDB
from ..helpers import wait_for

pytestmark = [pytest.mark.anyio, pytest.mark.postgres_only]

LOOPBACK = parse_listen("test", "127.0.0.1:0")
RECONNECTED = "reconnected ("
LISTENING_AGAIN = "listening again ("


def terminate_backends(raw: RawDB, only_sleeping: bool = False) -> int:
    """End every session on the test's own database but the asking one (and
    wait for them to be gone); how many there were."""
    sleeping = " AND wait_event = 'PgSleep'" if only_sleeping else ""
    return int(
        raw.scalar(
            "SELECT COUNT(*) FILTER (WHERE pg_terminate_backend(pid, 5000)) FROM pg_stat_activity "
            f"WHERE datname = current_database() AND pid <> pg_backend_pid(){sleeping}"
        )
    )


def sleeping_backends(raw: RawDB) -> int:
    return int(
        raw.scalar(
            "SELECT COUNT(*) FROM pg_stat_activity WHERE datname = current_database() "
            "AND wait_event = 'PgSleep'"
        )
    )


def open_transactions(raw: RawDB) -> int:
    return int(
        raw.scalar(
            "SELECT COUNT(*) FROM pg_stat_activity WHERE datname = current_database() "
            "AND pid <> pg_backend_pid() AND state LIKE 'idle in transaction%'"
        )
    )


def reconnect_lines(caplog: pytest.LogCaptureFixture, text: str) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == "trio_dispatch.store" and text in r.getMessage()
    ]


# -- one unit of work at a time ------------------------------------------------------


async def test_an_idle_connection_the_server_ended_is_replaced_before_any_work_uses_it(
    db_target: str, raw: RawDB, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="trio_dispatch.store")
    async with open_store(db_target) as db:
        await enqueue_dispatch(db, kind="k", deliver_to="first")
        assert terminate_backends(raw) >= 1  # waits until the sessions are gone
        await enqueue_dispatch(db, kind="k", deliver_to="group-committed")
        assert terminate_backends(raw) >= 1
        async with db.transaction() as tx:
            await tx.execute("INSERT INTO sessions (id, created_at) VALUES (?, ?)", ("s", 1.0))
            await enqueue_dispatch(tx, kind="k", deliver_to="in-a-transaction", session_id="s")
        assert raw.counts() == (3, 3)
        assert cast(Any, db).reconnects["writer"] == 2
    lines = reconnect_lines(caplog, RECONNECTED)
    assert len(lines) == 2
    assert all(cast(Any, db).url in line for line in lines)


async def test_units_on_the_wire_fail_alone_and_their_batch_runs_on_a_new_connection(
    db_target: str, raw: RawDB
) -> None:
    async with open_store(db_target) as db:
        gate = threading.Event()
        results: dict[str, object] = {}
        slept: list[bool] = []

        async def run(name: str, work: Callable[[], Awaitable[object]]) -> None:
            try:
                results[name] = await work()
            except ConnectionLostError as exc:
                results[name] = exc

        def before(conn: Any) -> str:
            conn.execute("INSERT INTO sessions (id, created_at) VALUES (?, ?)", ("before", 1.0))
            return "before"

        def on_the_wire(conn: Any, names: list[str]) -> list[str]:
            for name in names:
                conn.execute("INSERT INTO sessions (id, created_at) VALUES (?, ?)", (name, 1.0))
            if not slept:  # once: the statement running when the session ends
                slept.append(True)
                conn.query("SELECT pg_sleep(30)")
            return names

        async with anyio.create_task_group() as tg:
            # The units queue behind a held batch, so they run as the next
            # one, in this order: one plain unit; two items coalesced into
            # one step, on the wire when the session ends; an enqueue.
            tg.start_soon(db.write, lambda conn: gate.wait(10))
            await wait_for(lambda: cast(Any, db)._busy)
            tg.start_soon(run, "before", lambda: db.write(before))
            await wait_for(lambda: len(cast(Any, db)._queue) == 1)
            for name in ("wire1", "wire2"):
                tg.start_soon(run, name, lambda n=name: db.write_many(on_the_wire, n))
            await wait_for(lambda: len(cast(Any, db)._queue) == 3)
            tg.start_soon(run, "after", lambda: enqueue_dispatch(db, kind="k", deliver_to="after"))
            await wait_for(lambda: len(cast(Any, db)._queue) == 4)
            gate.set()
            await wait_for(lambda: sleeping_backends(raw) == 1)
            assert terminate_backends(raw, only_sleeping=True) == 1

        for name in ("wire1", "wire2"):  # which of the two the server saw is unknown
            wire = results[name]
            assert isinstance(wire, ConnectionLostError) and not wire.outcome_unknown
            assert "nothing in it was committed" in str(wire)
        assert results["before"] == "before"  # ran again, on the new connection
        after = results["after"]
        assert isinstance(after, str)
        assert {r["id"] for r in raw.rows("SELECT id FROM sessions")} == {"before"}
        assert raw.row(after)["deliver_to"] == "after"
        assert raw.counts() == (1, 1)
        assert open_transactions(raw) == 0
        assert cast(Any, db).reconnects["writer"] == 1
        await enqueue_dispatch(db, kind="k", deliver_to="later")  # it writes on
        assert raw.counts() == (2, 2)


async def test_a_connection_that_ends_during_the_commit_says_the_outcome_is_unknown(
    db_target: str, raw: RawDB
) -> None:
    # A deferred constraint trigger runs at COMMIT: it holds the COMMIT on
    # the server while the test ends the session.
    raw.execute("CREATE TABLE IF NOT EXISTS slow_commit (id int)")
    raw.execute(
        "CREATE OR REPLACE FUNCTION slow_commit() RETURNS trigger AS $$ BEGIN "
        "PERFORM pg_sleep(30); RETURN NULL; END $$ LANGUAGE plpgsql"
    )
    raw.execute(
        "CREATE CONSTRAINT TRIGGER slow_commit AFTER INSERT ON slow_commit "
        "DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION slow_commit()"
    )
    try:
        async with open_store(db_target) as db:
            gate = threading.Event()
            errors: list[ConnectionLostError] = []

            async def expect_lost(work: Callable[[], Awaitable[object]]) -> None:
                with pytest.raises(ConnectionLostError) as caught:
                    await work()
                errors.append(caught.value)

            async with anyio.create_task_group() as tg:
                tg.start_soon(db.write, lambda conn: gate.wait(10))
                await wait_for(lambda: cast(Any, db)._busy)
                tg.start_soon(
                    expect_lost,
                    lambda: db.write(
                        lambda conn: conn.execute("INSERT INTO slow_commit VALUES (1)")
                    ),
                )
                await wait_for(lambda: len(cast(Any, db)._queue) == 1)
                tg.start_soon(expect_lost, lambda: enqueue_dispatch(db, kind="k", deliver_to="x"))
                await wait_for(lambda: len(cast(Any, db)._queue) == 2)
                gate.set()
                await wait_for(lambda: sleeping_backends(raw) == 1)
                assert terminate_backends(raw, only_sleeping=True) == 1

            assert len(errors) == 2
            for error in errors:  # both were in the transaction being committed
                assert error.outcome_unknown
                assert "may or may not have been committed" in str(error)
            # Here the session ended before the commit was done: nothing is there.
            assert raw.counts() == (0, 0)
            assert open_transactions(raw) == 0
            await enqueue_dispatch(db, kind="k", deliver_to="later")
            assert raw.counts() == (1, 1)
    finally:
        raw.execute("DROP TABLE IF EXISTS slow_commit")
        raw.execute("DROP FUNCTION IF EXISTS slow_commit()")


async def test_a_lone_enqueue_whose_connection_ends_mid_statement_says_the_outcome_is_unknown(
    db_target: str, raw: RawDB
) -> None:
    # A lone plain enqueue is one statement that commits by itself: a
    # session ended while it runs may have committed it or not.
    async with open_store(db_target) as db:
        raw.execute(
            "CREATE OR REPLACE FUNCTION slow_insert() RETURNS trigger AS $$ BEGIN "
            "PERFORM pg_sleep(30); RETURN NULL; END $$ LANGUAGE plpgsql"
        )
        raw.execute(
            "CREATE TRIGGER slow_insert AFTER INSERT ON dispatch_outbox "
            "FOR EACH ROW EXECUTE FUNCTION slow_insert()"
        )
        try:
            errors: list[ConnectionLostError] = []

            async def enqueue() -> None:
                with pytest.raises(ConnectionLostError) as caught:
                    await enqueue_dispatch(db, kind="k", deliver_to="x")
                errors.append(caught.value)

            async with anyio.create_task_group() as tg:
                tg.start_soon(enqueue)
                await wait_for(lambda: sleeping_backends(raw) == 1)
                assert terminate_backends(raw, only_sleeping=True) == 1
            assert errors[0].outcome_unknown
            assert "may or may not have been committed" in str(errors[0])
        finally:
            raw.execute("DROP TRIGGER IF EXISTS slow_insert ON dispatch_outbox")
            raw.execute("DROP FUNCTION IF EXISTS slow_insert()")
        assert raw.counts() == (0, 0)  # ended before it finished: rolled back
        await enqueue_dispatch(db, kind="k", deliver_to="later")
        assert raw.counts() == (1, 1)
        assert open_transactions(raw) == 0


async def test_the_listener_listens_again_after_its_connection_ends(
    db_target: str, raw: RawDB, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="trio_dispatch.store")
    calls: list[int] = []
    async with open_store(db_target) as listening, open_store(db_target) as other:
        async with anyio.create_task_group() as tg:
            await tg.start(cast(Any, listening).listen, lambda: calls.append(1))
            await wait_for(lambda: len(calls) == 1)  # listening began: look once
            await enqueue_dispatch(other, kind="k", deliver_to="before")
            await wait_for(lambda: len(calls) == 2)
            assert terminate_backends(raw) >= 1
            # Once listening again it calls back once: what was sent
            # meanwhile is lost, so its worker scans.
            await wait_for(lambda: len(calls) == 3)
            await enqueue_dispatch(other, kind="k", deliver_to="after")
            await wait_for(lambda: len(calls) == 4)
            tg.cancel_scope.cancel()
    assert cast(Any, listening).reconnects["listener"] == 1
    assert len(reconnect_lines(caplog, LISTENING_AGAIN)) == 1


async def test_reads_drop_dead_pooled_connections_without_failing(
    db_target: str, raw: RawDB
) -> None:
    async with open_store(db_target) as db:

        async def slow_read() -> None:
            await db.read(lambda conn: conn.query("SELECT pg_sleep(0.2)"))

        async with anyio.create_task_group() as tg:  # the pool grows to several connections
            for _ in range(3):
                tg.start_soon(slow_read)
        assert terminate_backends(raw) >= 2
        for _ in range(4):
            assert await db.read(lambda conn: conn.query_one("SELECT 1 AS one")) == {"one": 1}
        assert open_transactions(raw) == 0


# -- producers and a worker through the outage ---------------------------------------


@dataclass
class Traffic:
    """What the producers were told, and what the worker sent."""

    committed: dict[str, str] = field(default_factory=dict)  # deliver_to -> id
    failed: dict[str, ConnectionLostError] = field(default_factory=dict)  # deliver_to -> error
    committed_after: int = 0  # enqueues committed once the outage was over
    delivered: set[str] = field(default_factory=set)


async def run_through_outage(
    target: str, raw: RawDB, outage: Callable[[], Awaitable[None]]
) -> Traffic:
    """Three producers on one store and a worker on another (so only
    NOTIFY and its tick tell it of the enqueues) run while ``outage``
    happens; returns once everything committed was sent, and ``/healthz``
    answers 200 again."""
    traffic = Traffic()

    async def record(delivery: Delivery) -> None:
        traffic.delivered.add(delivery.dispatch_id)

    async with open_store(target) as producers, open_store(target) as worker_db:
        worker = DispatchWorker(
            worker_db,
            transport=record,
            tick_seconds=1.0,
            timeout_seconds=2.0,
            lease_margin_seconds=1.5,
            concurrency=16,
        )
        over = anyio.Event()
        stop = anyio.Event()

        async def produce(p: int) -> None:
            n = 0
            while not stop.is_set():
                marker = f"p{p}-{n}"
                n += 1
                try:
                    traffic.committed[marker] = await enqueue_dispatch(
                        producers, kind="k", deliver_to=marker
                    )
                except ConnectionLostError as exc:  # anything else fails the test
                    traffic.failed[marker] = exc
                    continue
                if over.is_set():
                    traffic.committed_after += 1
                await anyio.sleep(0.005)

        async with anyio.create_task_group() as tg:
            await tg.start(worker.run)
            url = await tg.start(serve_app, WebApp(worker_db, worker=worker), LOOPBACK)
            async with httpx.AsyncClient(base_url=url, timeout=10) as client:
                for p in range(3):
                    tg.start_soon(produce, p)
                await wait_for(lambda: len(traffic.delivered) >= 30, timeout=20)
                await outage()
                over.set()
                await wait_for(lambda: traffic.committed_after >= 60, timeout=20)
                stop.set()

                async def healthy() -> bool:
                    return (await client.get("/healthz")).status_code == 200

                with anyio.fail_after(20):
                    while not await healthy():
                        await anyio.sleep(0.1)
                # Nothing committed is lost: every id a producer was given is sent.
                await wait_for(
                    lambda: set(traffic.committed.values()) <= traffic.delivered, timeout=20
                )
                # An enqueue that failed left no row, unless the COMMIT went
                # unanswered; a row it left is sent like any other.
                left = {
                    r["deliver_to"]: r["id"]
                    for r in raw.rows("SELECT id, deliver_to FROM dispatch_outbox")
                    if r["deliver_to"] in traffic.failed
                }
                for marker in left:
                    assert traffic.failed[marker].outcome_unknown, marker
                await wait_for(lambda: set(left.values()) <= traffic.delivered, timeout=20)
                # ... and recorded as sent (a finish that failed is tried again).
                await wait_for(
                    lambda: (
                        raw.scalar(
                            "SELECT COUNT(*) FROM dispatch_outbox WHERE status <> 'delivered'"
                        )
                        == 0
                    ),
                    timeout=20,
                )
                assert raw.scalar("SELECT COUNT(*) FROM dispatch_outbox") == len(
                    traffic.committed
                ) + len(left)
                # None left open: a running worker's own transactions pass
                # through "idle in transaction" between their round trips, a
                # leaked one stays there.
                await wait_for(lambda: open_transactions(raw) == 0, timeout=5)
            tg.cancel_scope.cancel()
        for store in (producers, worker_db):
            assert cast(Any, store).reconnects["writer"] >= 1
        assert cast(Any, worker_db).reconnects["listener"] >= 1
    return traffic


@pytest.mark.slow
async def test_producers_and_a_worker_go_on_after_their_backends_are_terminated(
    db_target: str, raw: RawDB, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="trio_dispatch.store")

    async def terminate() -> None:
        assert terminate_backends(raw) >= 3  # two writers, a listener, readers

    traffic = await run_through_outage(db_target, raw, terminate)
    # One line per reconnect, naming the store by its masked URL.
    assert len(reconnect_lines(caplog, RECONNECTED)) == 2  # the two writers
    assert len(reconnect_lines(caplog, LISTENING_AGAIN)) == 1
    print(
        f"terminated: {len(traffic.committed)} committed, {len(traffic.failed)} failed "
        f"({sum(e.outcome_unknown for e in traffic.failed.values())} with an unknown outcome)"
    )


# -- a server restart, on a private server -------------------------------------------


@dataclass(frozen=True)
class PrivateServer:
    url: str
    restart: Callable[[], None]


def _postgres_bin() -> Path | None:
    for found in sorted(glob.glob("/usr/lib/postgresql/*/bin"), reverse=True):
        if (Path(found) / "initdb").exists() and (Path(found) / "pg_ctl").exists():
            return Path(found)
    return None


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@pytest.fixture(scope="module")
def private_server() -> Iterator[PrivateServer]:
    """A PostgreSQL server of this module's own, on a free port, that a test
    may restart (the shared server is never restarted)."""
    bindir = _postgres_bin()
    if bindir is None:
        pytest.skip("no initdb/pg_ctl under /usr/lib/postgresql/*/bin to start a private server")
    as_root = os.geteuid() == 0
    if as_root and shutil.which("runuser") is None:
        pytest.skip("running as root without runuser to start PostgreSQL as its own user")
    root = Path(tempfile.mkdtemp(prefix="trio_dispatch_pg_"))
    data, logfile, port = root / "data", root / "server.log", _free_port()
    if as_root:
        shutil.chown(root, "postgres", "postgres")
    prefix = ["runuser", "-u", "postgres", "--"] if as_root else []

    def pg_ctl(*args: str) -> None:
        subprocess.run(
            [
                *prefix,
                str(bindir / "pg_ctl"),
                "-D",
                str(data),
                "-l",
                str(logfile),
                "-w",
                "-t",
                "30",
                *args,
            ],
            check=True,
            capture_output=True,
        )

    subprocess.run(
        [*prefix, str(bindir / "initdb"), "-D", str(data), "-A", "trust", "-U", "postgres",
         "-E", "UTF8", "--no-sync"],
        check=True,
        capture_output=True,
    )  # fmt: skip
    options = f"-p {port} -k {root} -c listen_addresses=127.0.0.1 -c fsync=off"
    pg_ctl("-o", options, "start")
    try:
        yield PrivateServer(
            url=f"postgresql://postgres@127.0.0.1:{port}/postgres",
            restart=lambda: pg_ctl("-m", "fast", "restart"),
        )
    finally:
        pg_ctl("-m", "immediate", "stop")
        shutil.rmtree(root, ignore_errors=True)


@pytest.mark.slow
async def test_producers_and_a_worker_go_on_after_a_server_restart(
    private_server: PrivateServer, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="trio_dispatch.store")
    raw = PostgresRaw(private_server.url)
    raw.empty()

    async def restart() -> None:
        await anyio.to_thread.run_sync(private_server.restart)

    traffic = await run_through_outage(private_server.url, raw, restart)
    assert len(reconnect_lines(caplog, RECONNECTED)) >= 2
    assert len(reconnect_lines(caplog, LISTENING_AGAIN)) >= 1
    print(
        f"restarted: {len(traffic.committed)} committed, {len(traffic.failed)} failed "
        f"({sum(e.outcome_unknown for e in traffic.failed.values())} with an unknown outcome)"
    )
