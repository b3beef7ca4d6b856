"""The service thread: jobs cross to one long-lived thread and back, under
trio and asyncio, with ``to_thread``'s cancellation semantics."""

from __future__ import annotations

import contextvars
import threading
import time
from collections.abc import Iterator

import anyio
import pytest

from trio_dispatch._threads import ServiceThread

pytestmark = pytest.mark.anyio

request_id: contextvars.ContextVar[str] = contextvars.ContextVar("request_id", default="-")


@pytest.fixture
def service() -> Iterator[ServiceThread]:
    thread = ServiceThread("test service")
    yield thread
    thread.stop()


async def test_a_job_runs_on_the_service_thread_in_the_callers_context(
    service: ServiceThread,
) -> None:
    request_id.set("r-7")
    seen = await service.run(lambda: (threading.get_ident(), request_id.get()))
    assert seen == (service.ident, "r-7")
    assert service.ident != threading.get_ident()


async def test_a_jobs_exception_is_raised_in_the_caller(service: ServiceThread) -> None:
    def fail() -> None:
        raise LookupError("from the thread")

    with pytest.raises(LookupError, match="from the thread"):
        await service.run(fail)
    assert await service.run(lambda: 42) == 42  # the thread lives on


async def test_an_already_cancelled_caller_runs_nothing(service: ServiceThread) -> None:
    ran: list[int] = []
    with anyio.CancelScope() as scope:
        scope.cancel()
        await service.run(lambda: ran.append(1))
    assert scope.cancelled_caught
    await service.run(lambda: None)  # anything queued before has run by now
    assert ran == []


async def test_a_caller_cancelled_mid_job_waits_for_it_then_is_cancelled(
    service: ServiceThread,
) -> None:
    finished: list[float] = []

    def slow() -> str:
        time.sleep(0.3)
        finished.append(time.monotonic())
        return "done"

    started = time.monotonic()
    with anyio.move_on_after(0.05) as scope:
        await service.run(slow)
        await anyio.sleep(10)  # trio hands the result back; the next checkpoint cancels
    assert scope.cancelled_caught
    assert finished and finished[0] - started >= 0.29  # never abandoned mid-job
    assert time.monotonic() - started < 5


async def test_jobs_from_many_tasks_run_one_at_a_time_in_order_of_arrival(
    service: ServiceThread,
) -> None:
    running = 0
    most = 0
    lock = threading.Lock()

    def job() -> None:
        nonlocal running, most
        with lock:
            running += 1
            most = max(most, running)
        time.sleep(0.001)
        with lock:
            running -= 1

    async with anyio.create_task_group() as tg:
        for _ in range(50):
            tg.start_soon(service.run, job)
    assert most == 1
