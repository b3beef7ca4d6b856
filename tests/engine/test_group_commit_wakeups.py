"""Group commit wakes each queued writer only when its batch is done or
when it is first in line to lead the next one: no writer is left waiting,
whether the others finish, fail or are cancelled."""

from __future__ import annotations

import anyio
import pytest

from trio_dispatch import enqueue_dispatch
from trio_dispatch.store import SQLiteStore

from ..conftest import RawDB
from ..helpers import HeldWriter, wait_for

pytestmark = pytest.mark.anyio


async def test_a_queued_writer_cancelled_leaves_none_waiting(
    store: SQLiteStore, raw: RawDB
) -> None:
    results: dict[str, object] = {}
    held = HeldWriter()
    first = anyio.CancelScope()

    async def producer(name: str) -> None:
        results[name] = await enqueue_dispatch(store, kind="k", deliver_to=name)

    async def cancellable() -> None:
        with first:
            await producer("a")

    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            tg.start_soon(store.write, held.unit)
            await held.running()
            tg.start_soon(cancellable)
            await wait_for(lambda: store.queued_writes == 1)
            tg.start_soon(producer, "b")
            tg.start_soon(producer, "c")
            await wait_for(lambda: store.queued_writes == 3)
            held.release()
            first.cancel()
    assert sorted(results) == ["b", "c"]
    for name, dispatch_id in results.items():
        assert raw.row(str(dispatch_id))["deliver_to"] == name
    assert raw.counts() == (2, 2)


async def test_many_writers_queued_behind_a_held_batch_all_finish(
    store: SQLiteStore, raw: RawDB
) -> None:
    held = HeldWriter()
    with anyio.fail_after(20):
        async with anyio.create_task_group() as tg:
            tg.start_soon(store.write, held.unit)
            await held.running()
            for i in range(50):
                tg.start_soon(lambda i=i: enqueue_dispatch(store, kind="k", deliver_to=f"s{i}"))
            await wait_for(lambda: store.queued_writes == 50)
            held.release()
    assert raw.counts() == (50, 50)
    assert store.stats["units"] == 51
