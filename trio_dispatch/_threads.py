"""A long-lived thread that runs blocking jobs for async callers, under trio
and asyncio alike.

A job and its result cross with one queue put and one wake-up of the
caller's event loop (trio: ``TrioToken.run_sync_soon`` rescheduling the
waiting task; asyncio: ``call_soon_threadsafe`` completing a future), with
no per-call thread-pool bookkeeping. Semantics, as ``to_thread.run_sync``:
a caller already cancelled raises at once and runs nothing; once queued,
its job runs to its end and the wait cannot be cancelled. A cancellation
that arrived meanwhile is delivered after the job ended: under asyncio as
the call returns, under trio at the caller's next checkpoint (the call
itself returns the job's result, as trio's own ``to_thread`` does). Jobs
run in the caller's context (``contextvars``).

The thread never exits while jobs may come; :meth:`ServiceThread.stop` ends
it once the queued jobs have run.
"""

from __future__ import annotations

import asyncio
import contextvars
import queue
import threading
from collections.abc import Callable
from functools import partial
from typing import Any, TypeVar

import anyio
import outcome
import sniffio
import trio

T = TypeVar("T")

_Reply = Callable[[outcome.Outcome[Any]], None]


class ServiceThread:
    """One daemon thread serving jobs in order (see the module docstring).

    A daemon, so an owner that never called :meth:`stop` cannot keep the
    interpreter alive; it holds nothing between jobs.
    """

    def __init__(self, name: str) -> None:
        self._jobs: queue.SimpleQueue[tuple[Callable[[], Any], _Reply] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self._thread.start()

    @property
    def ident(self) -> int | None:
        return self._thread.ident

    def _serve(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            fn, reply = job
            result = outcome.capture(fn)
            reply(result)
            del job, fn, reply, result

    async def run(self, fn: Callable[[], T]) -> T:
        """Run ``fn()`` on the thread and return its result (or raise its
        exception) in the caller."""
        if sniffio.current_async_library() == "trio":
            return await self._run_trio(fn)  # type: ignore[no-any-return]
        return await self._run_asyncio(fn)

    # KI-protected: a KeyboardInterrupt between queuing the job and parking
    # would leave the thread to reschedule a task that is not waiting.
    @trio.lowlevel.enable_ki_protection
    async def _run_trio(self, fn: Callable[[], T]) -> Any:
        await trio.lowlevel.checkpoint_if_cancelled()
        token = trio.lowlevel.current_trio_token()
        task = trio.lowlevel.current_task()

        def reply(result: outcome.Outcome[Any]) -> None:
            try:
                token.run_sync_soon(trio.lowlevel.reschedule, task, result)
            except trio.RunFinishedError:  # pragma: no cover - the waiter cannot leave first
                pass

        self._jobs.put((partial(contextvars.copy_context().run, fn), reply))
        return await trio.lowlevel.wait_task_rescheduled(lambda _: trio.lowlevel.Abort.FAILED)

    async def _run_asyncio(self, fn: Callable[[], T]) -> T:
        await anyio.lowlevel.checkpoint_if_cancelled()
        loop = asyncio.get_running_loop()
        done: asyncio.Future[outcome.Outcome[Any]] = loop.create_future()

        def settle(result: outcome.Outcome[Any]) -> None:
            if not done.done():
                done.set_result(result)

        def reply(result: outcome.Outcome[Any]) -> None:
            try:
                loop.call_soon_threadsafe(settle, result)
            except RuntimeError:  # pragma: no cover - the loop closed under a waiter
                pass

        self._jobs.put((partial(contextvars.copy_context().run, fn), reply))
        with anyio.CancelScope(shield=True):
            result = await _wait_uncancelled(done)
        await anyio.lowlevel.checkpoint_if_cancelled()
        return result.unwrap()  # type: ignore[no-any-return]

    def stop(self) -> None:
        """End the thread once the jobs already queued have run."""
        self._jobs.put(None)
        if threading.get_ident() != self._thread.ident:
            self._thread.join()


async def _wait_uncancelled(done: asyncio.Future[T]) -> T:
    # asyncio.shield: a native task.cancel() from outside anyio (which the
    # shielded scope cannot stop) interrupts only this wait, never the job's
    # hand-back; keep waiting and let the caller see the cancellation after.
    cancelled = False
    while True:
        try:
            result = await asyncio.shield(done)
        except asyncio.CancelledError:
            if done.cancelled():  # pragma: no cover - nothing cancels it
                raise
            cancelled = True
            continue
        if cancelled:
            task = asyncio.current_task()
            if task is not None:
                task.cancel()
        return result
