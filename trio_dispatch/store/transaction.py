"""A caller-owned write transaction on a store's writer connection
(:meth:`~.batching.BatchingStore.transaction`): each statement one hop to
the writer's thread, ``BEGIN`` riding with the first, the commit one more."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from ..errors import TransactionMisuse
from .base import Conn, ItemT, ResultT, Row, StoreError, T

if TYPE_CHECKING:
    from .batching import BatchingStore


class BatchingTransaction:
    """A caller-owned write transaction on the store's writer connection.
    SQL of the caller's own uses ``?`` placeholders on every engine."""

    def __init__(self, store: BatchingStore, conn: Conn) -> None:
        self._store = store
        self._conn = conn
        self._closed = False
        self._begun = False  # BEGIN rides with the first statement's hop
        self._enqueued = False
        self._lost: StoreError | None = None

    @property
    def max_body_bytes(self) -> int:
        """The store's limit on an enqueue's ``body`` (bytes of JSON)."""
        return self._store.max_body_bytes

    async def _run(self, fn: Callable[[], T]) -> T:
        if self._closed:
            raise TransactionMisuse("the transaction has ended")
        return await self._store._in_writer(self._guarded, fn)

    def _guarded(self, fn: Callable[[], T]) -> T:
        # If the database rolled the transaction back by itself (disk full,
        # I/O error), running on would commit statements one by one, outside
        # the caller's transaction.
        if self._lost is not None:
            raise self._lost
        if not self._begun:
            self._store._begin()  # waits for other processes' writers as the engine allows
            self._store._keys_wait()
            self._begun = True
        try:
            return fn()
        finally:
            if not self._store._in_transaction():
                self._lost = StoreError(
                    "the transaction was rolled back by the database after an error; "
                    "nothing in it was committed"
                )

    def _finish(self) -> None:
        if self._lost is not None:
            raise self._lost
        try:
            self._store._commit()
        except BaseException:
            self._store._rollback()
            raise

    async def execute(self, sql: str, params: Sequence[Any] = ()) -> int:
        return await self._run(lambda: self._conn.execute(sql, params))

    async def query(self, sql: str, params: Sequence[Any] = ()) -> list[Row]:
        return await self._run(lambda: self._conn.query(sql, params))

    async def read(self, work: Callable[[Conn], T]) -> T:
        return await self._run(lambda: work(self._conn))

    async def write(self, work: Callable[[Conn], T]) -> T:
        conn, store = self._conn, self._store

        def in_savepoint() -> T:
            conn.execute("SAVEPOINT unit")
            try:
                result = work(conn)
            except BaseException:
                if store._in_transaction():
                    conn.execute("ROLLBACK TO SAVEPOINT unit")
                    conn.execute("RELEASE SAVEPOINT unit")
                raise
            conn.execute("RELEASE SAVEPOINT unit")
            return result

        return await self._run(in_savepoint)

    async def write_many(
        self,
        many: Callable[[Conn, list[ItemT]], list[ResultT]],
        item: ItemT,
        single: bool = False,
    ) -> ResultT:
        return await self.write(lambda conn: many(conn, [item])[0])

    def notify_enqueued(self) -> None:
        self._enqueued = True

    def notify_enqueuing(self) -> None:
        """Nothing: the rows are seen once the caller commits (then
        :meth:`notify_enqueued`)."""
