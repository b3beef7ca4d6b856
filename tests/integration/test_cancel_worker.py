"""A running attempt cancelled while a real worker runs it
(docs/controls.md#cancel), on both engines and both backends: the cancel comes from another
store (as another process's would), the worker hears it (PostgreSQL: its
notice; SQLite: the commit watch), cuts the attempt -- a real child's
process group killed, a callable's scope cancelled, a real HTTP request
dropped -- and its fenced finish records ``cancelled``; or the success
that came first stands (too late). During a shutdown's grace too, with an
ordering key's next row let go, and counted in the metrics."""

from __future__ import annotations

import json
import os
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import pytest

from trio_dispatch import CancelTooLate, Delivery, cancel_dispatch, enqueue_dispatch, open_store
from trio_dispatch.store import SQLiteStore
from trio_dispatch.store.base import Store
from trio_dispatch.transports.webhook import WebhookTransport, parse_endpoints
from trio_dispatch.worker import DispatchWorker

from ..conftest import RawDB
from ..helpers import command, row_is, wait_for, write_script
from ..http_server import serve
from .test_webhook import SECRET

pytestmark = pytest.mark.anyio

STUCK = """
    import os, sys, time
    with open(sys.argv[1] + ".tmp", "w") as out:
        out.write(str(os.getpgid(0)))
    os.replace(sys.argv[1] + ".tmp", sys.argv[1])
    time.sleep(300)
"""
"""A command that never ends by itself; it says its process group first."""


@asynccontextmanager
async def working(
    store: SQLiteStore, transport: Any = None, **settings: Any
) -> AsyncIterator[DispatchWorker]:
    """A worker on ``store`` for the block; stopped after it."""
    options: dict[str, Any] = {"tick_seconds": 3600, "timeout_seconds": 600, **settings}
    async with anyio.create_task_group() as tg:
        worker = DispatchWorker(store, transport=transport, **options)
        await tg.start(worker.run)
        yield worker
        tg.cancel_scope.cancel()


@asynccontextmanager
async def other(raw: RawDB) -> AsyncIterator[Store]:
    """Another store on the same database: its cancel reaches the worker as
    another process's would (no in-process call)."""
    async with open_store(raw.target) as db:
        yield db


def last(raw: RawDB, dispatch_id: str) -> dict[str, Any]:
    transition = raw.transitions(dispatch_id)[-1]
    meta = transition["metadata"]
    return {**transition, "metadata": meta if isinstance(meta, dict) else json.loads(meta)}


def group_gone(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return True
    return False


async def test_a_running_commands_process_group_is_killed_and_the_row_cancelled(
    store: SQLiteStore, raw: RawDB, tmp_path: Path
) -> None:
    script = write_script(tmp_path, "stuck.py", STUCK)
    group_file = tmp_path / "group"
    template = command(script, str(group_file))
    async with working(store, notify_template=template) as worker:
        dispatch_id = await enqueue_dispatch(store, kind="k", deliver_to="seat")
        await wait_for(group_file.exists)
        pgid = int(group_file.read_text())
        assert not group_gone(pgid)
        async with other(raw) as db:
            result = await cancel_dispatch(db, dispatch_id, "stuck send")
        assert (result.cancelled, result.previous, result.attempt) == (True, "delivering", 1)
        # The group was killed (and its child reaped) before the end was recorded.
        with pytest.raises(ProcessLookupError):
            os.killpg(pgid, 0)
        assert worker.cancel_counts.snapshot() == {"cancelled": 1, "too_late": 0}
    transition = last(raw, dispatch_id)
    assert (transition["status"], transition["source"]) == ("cancelled", "scheduler")
    assert "cut by an operator's cancel" in str(transition["reason_summary"])
    assert transition["metadata"]["reason"] == "stuck send"
    assert raw.row(dispatch_id)["attempt"] == 1


async def test_a_running_callables_scope_is_cancelled(store: SQLiteStore, raw: RawDB) -> None:
    started: list[str] = []
    cut: list[str] = []

    async def send(delivery: Delivery) -> bool:
        started.append(delivery.dispatch_id)
        try:
            await anyio.sleep(300)
        except anyio.get_cancelled_exc_class():
            cut.append(delivery.dispatch_id)
            raise
        return True

    async with working(store, send):
        dispatch_id = await enqueue_dispatch(store, kind="k", deliver_to="seat")
        await wait_for(lambda: started == [dispatch_id])
        async with other(raw) as db:
            result = await cancel_dispatch(db, dispatch_id)
        assert result.cancelled
        assert cut == [dispatch_id]
    assert raw.row(dispatch_id)["status"] == "cancelled"


async def test_a_running_webhook_request_is_dropped(store: SQLiteStore, raw: RawDB) -> None:
    with serve() as server:
        hooks = parse_endpoints(
            "endpoints",
            {"hook": {"url": server.url + "/hang", "secrets": [SECRET], "allow_private": True}},
            os.environ,
        )
        async with working(store, WebhookTransport(hooks, timeout=300)):
            dispatch_id = await enqueue_dispatch(store, kind="k", deliver_to="hook")
            await wait_for(lambda: len(server.requests) == 1)
            async with other(raw) as db:
                result = await cancel_dispatch(db, dispatch_id)
            assert result.cancelled
            # The server sees its client hang up: the request was dropped.
            await wait_for(lambda: server.dropped == ["/hang"])
    assert raw.row(dispatch_id)["status"] == "cancelled"


async def test_a_success_that_beats_the_cancel_stands_and_the_cancel_is_too_late(
    store: SQLiteStore, raw: RawDB
) -> None:
    """The send completes (shielded: no cut can land in it) after the cancel
    has marked its row; the fenced finish keeps the success."""

    async def send(delivery: Delivery) -> bool:
        with anyio.CancelScope(shield=True):
            await wait_for(lambda: raw.row(delivery.dispatch_id)["cancel_requested_at"])
        return True

    async with working(store, send) as worker:
        dispatch_id = await enqueue_dispatch(store, kind="k", deliver_to="seat")
        await wait_for(lambda: row_is(raw, dispatch_id, status="delivering"))
        async with other(raw) as db:
            with pytest.raises(CancelTooLate, match="delivered") as late:
                await cancel_dispatch(db, dispatch_id)
        assert late.value.from_status == "delivered"
        await wait_for(lambda: worker.cancel_counts.snapshot()["too_late"] == 1)
    row = raw.row(dispatch_id)
    assert (row["status"], row["cancel_requested_at"]) == ("delivered", None)
    assert last(raw, dispatch_id)["metadata"]["cancel"]["too_late"] is True


async def test_a_cancel_during_the_shutdowns_grace_is_carried_out(
    store: SQLiteStore, raw: RawDB, tmp_path: Path
) -> None:
    """An hour's grace: left to the grace, the attempt would run on; the
    cancel cuts it, and the worker, with nothing left running, stops."""
    script = write_script(tmp_path, "stuck.py", STUCK)
    group_file = tmp_path / "group"
    stopped = anyio.Event()
    worker = DispatchWorker(
        store,
        notify_template=command(script, str(group_file)),
        tick_seconds=3600,
        timeout_seconds=7200,
        grace_seconds=3600,
    )

    async def run() -> None:
        with anyio.CancelScope() as scope:
            stop.append(scope)
            await worker.run()
        stopped.set()

    stop: list[anyio.CancelScope] = []
    async with anyio.create_task_group() as tg:
        tg.start_soon(run)
        await wait_for(lambda: worker.statistics().running)
        dispatch_id = await enqueue_dispatch(store, kind="k", deliver_to="seat")
        await wait_for(group_file.exists)
        pgid = int(group_file.read_text())
        stop[0].cancel()  # the shutdown begins: an hour's grace for the attempt
        await wait_for(lambda: worker.in_flight == 1 and not stopped.is_set())
        async with other(raw) as db:
            result = await cancel_dispatch(db, dispatch_id, "stop it anyway")
        assert result.cancelled
        with anyio.fail_after(30):  # a deadlock guard: without the cancel, an hour
            await stopped.wait()
    assert group_gone(pgid)
    assert raw.row(dispatch_id)["status"] == "cancelled"


async def test_a_cancelled_running_head_lets_its_keys_next_row_go(
    store: SQLiteStore, raw: RawDB
) -> None:
    sent: list[str] = []

    async def send(delivery: Delivery) -> bool:
        sent.append(delivery.dispatch_id)
        if len(sent) == 1:
            await anyio.sleep(300)
        return True

    async with working(store, send):
        head = await enqueue_dispatch(store, kind="k", deliver_to="seat", ordering_key="K")
        behind = await enqueue_dispatch(store, kind="k", deliver_to="seat", ordering_key="K")
        await wait_for(lambda: sent == [head])
        async with other(raw) as db:
            assert (await cancel_dispatch(db, head)).cancelled
        await wait_for(lambda: row_is(raw, behind, status="delivered"))
    assert sent == [head, behind]


@pytest.mark.parametrize("setting", ["listen-off", "listening"])
async def test_a_worker_without_a_listener_reads_the_cancels_itself(
    store: SQLiteStore, raw: RawDB, setting: str
) -> None:
    started = anyio.Event()

    async def send(delivery: Delivery) -> bool:
        started.set()
        await anyio.sleep(300)
        return True

    async with working(store, send, listen=setting == "listening"):
        dispatch_id = await enqueue_dispatch(store, kind="k", deliver_to="seat")
        await started.wait()
        async with other(raw) as db:
            assert (await cancel_dispatch(db, dispatch_id)).cancelled


async def test_a_cancel_from_the_workers_own_process_is_heard_through_its_store() -> None:
    """An in-memory database: no other connection, so no commit watch and
    no poll (its listener hears nothing, by design) -- only the store's own
    cancel listeners can tell the worker."""
    started = anyio.Event()

    async def send(delivery: Delivery) -> bool:
        started.set()
        await anyio.sleep(300)
        return True

    async with open_store(":memory:") as store:
        async with working(store, send) as worker:  # type: ignore[arg-type]
            dispatch_id = await enqueue_dispatch(store, kind="k", deliver_to="seat")
            await started.wait()
            result = await cancel_dispatch(store, dispatch_id, wait_seconds=20)
            assert result.cancelled
            assert worker.cancel_counts.snapshot()["cancelled"] == 1


def metric(text: str, name: str) -> Callable[[str], float]:
    def value(label: str) -> float:
        for line in text.splitlines():
            if line.startswith(f'{name}{{result="{label}"}}'):
                return float(line.rsplit(" ", 1)[1])
        raise AssertionError(f"no {name} {label} in {text}")

    return value


async def test_the_metrics_count_the_cancels_the_worker_settled(
    store: SQLiteStore, raw: RawDB
) -> None:
    from trio_dispatch.outbox.reads import bounded_stats
    from trio_dispatch.web.metrics import families, render

    started = anyio.Event()

    async def send(delivery: Delivery) -> bool:
        started.set()
        await anyio.sleep(300)
        return True

    async with working(store, send) as worker:
        dispatch_id = await enqueue_dispatch(store, kind="k", deliver_to="seat")
        await started.wait()
        async with other(raw) as db:
            await cancel_dispatch(db, dispatch_id)
        await wait_for(lambda: worker.in_flight == 0)  # its end counted, its slot free
        stats = await bounded_stats(store)
        text = render(families(stats, worker, 0.0)).decode()
    value = metric(text, "trio_dispatch_cancels_total")
    assert (value("cancelled"), value("too_late")) == (1.0, 0.0)
    assert 'trio_dispatch_dispatches{status="cancelled"} 1.0' in text
    assert 'trio_dispatch_deliveries_total{kind="k",outcome="cancelled"} 1.0' in text


async def test_a_cancel_cuts_only_its_own_attempt(store: SQLiteStore, raw: RawDB) -> None:
    """A cancel of one running attempt leaves the worker's other attempts
    running to their own ends."""
    release = anyio.Event()

    async def send(delivery: Delivery) -> bool:
        await release.wait()
        return True

    async with working(store, send, concurrency=4):
        ids = [await enqueue_dispatch(store, kind="k", deliver_to=f"s{i}") for i in range(3)]
        await wait_for(lambda: all(row_is(raw, i, status="delivering") for i in ids))
        async with other(raw) as db:
            assert (await cancel_dispatch(db, ids[1])).cancelled
        release.set()
        await wait_for(lambda: row_is(raw, ids[0], status="delivered"))
        await wait_for(lambda: row_is(raw, ids[2], status="delivered"))
    assert raw.row(ids[1])["status"] == "cancelled"
