"""The store interface the outbox is written against.

The outbox expresses every database step as a *unit of work*: a plain
synchronous function ``work(conn) -> T`` over a :class:`Conn`. An engine runs
each unit inside one transaction on a thread of its own (so the event loop
never blocks on the database) and hands the result, or the unit's exception,
back to the awaiting task. The outbox never sees an engine; an engine never
sees a status name.

SQL in units of work uses ``?`` placeholders and the subset of SQL that
SQLite and PostgreSQL share (``RETURNING``, ``ON CONFLICT ... DO NOTHING``,
``LIMIT``); an engine translates placeholders where its driver differs.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractAsyncContextManager
from typing import Any, Protocol, TypeVar

T = TypeVar("T")
ItemT = TypeVar("ItemT")
ResultT = TypeVar("ResultT")

Row = dict[str, Any]


class Conn(Protocol):
    """A connection inside an open transaction, used from a unit of work."""

    @property
    def lock_clause(self) -> str:
        """Appended to a SELECT whose rows the transaction is about to claim:
        ``" FOR UPDATE SKIP LOCKED"`` where rows lock (PostgreSQL), empty
        where the write transaction already excludes other writers (SQLite)."""

    @property
    def row_key(self) -> str:
        """The cheapest way to address a ``dispatch_outbox`` row selected
        earlier in the same write transaction: ``rowid`` on SQLite (the
        table's own b-tree, no probe of the random-uuid primary key index),
        ``id`` on PostgreSQL."""

    def execute(self, sql: str, params: Sequence[Any] = ()) -> int:
        """Run one statement; return the number of rows it changed."""

    def executemany(self, sql: str, rows: Sequence[Sequence[Any]]) -> int:
        """Run one statement for each parameter row; return rows changed."""

    def query(self, sql: str, params: Sequence[Any] = ()) -> list[Row]:
        """Run a query (or a statement with ``RETURNING``); return its rows."""

    def query_one(self, sql: str, params: Sequence[Any] = ()) -> Row | None:
        """The first row of :meth:`query`, or None."""

    def announce_enqueue(self) -> None:
        """Tell other processes, once this transaction commits, that a pending
        dispatch was added (PostgreSQL NOTIFY; nothing where unsupported)."""


class Database(Protocol):
    """What the outbox functions accept as ``db``: a store or a transaction."""

    async def read(self, work: Callable[[Conn], T]) -> T:
        """Run ``work`` on a consistent snapshot; it must not write."""

    async def write(self, work: Callable[[Conn], T]) -> T:
        """Run ``work`` atomically: all of its writes commit, or none do.

        If ``work`` raises, its writes are rolled back and the exception
        propagates to this caller alone. If the caller is cancelled before
        the unit started, it never runs; once started, it runs to completion
        and the cancellation is delivered after it committed.

        ``work`` may run more than once: if the database abandons a shared
        transaction (disk full, I/O error) because of another unit, the
        others run again in a new one. It must only touch the connection.
        """

    async def write_many(
        self, many: Callable[[Conn, list[ItemT]], list[ResultT]], item: ItemT
    ) -> ResultT:
        """Like :meth:`write`, for work that is cheaper in bulk: every item
        queued at once for the same ``many`` function is handled by one call
        ``many(conn, items)``, which returns one result per item, in order.
        If that call raises, each item is run again by itself, so an error
        still reaches only its own caller."""

    def notify_enqueued(self) -> None:
        """Tell this process's listeners that a pending dispatch was added.
        A store calls them at once; a transaction calls them after it commits
        (and never, if it rolls back)."""


class Transaction(Database, Protocol):
    """A caller-owned transaction (SPEC B1): units passed to :meth:`write`
    commit or roll back with the caller's own statements."""

    async def execute(self, sql: str, params: Sequence[Any] = ()) -> int:
        """Run one statement of the caller's own in this transaction."""

    async def query(self, sql: str, params: Sequence[Any] = ()) -> list[Row]:
        """Run one query of the caller's own in this transaction."""


class Store(Database, Protocol):
    """An open store: one engine, one database."""

    url: str

    def transaction(self) -> AbstractAsyncContextManager[Transaction]:
        """A write transaction for the caller's own statements plus outbox
        calls. It commits when the block exits normally and rolls back when it
        raises (or is cancelled). Other writers of this process wait for it,
        so keep it short and never await the outside world inside it."""

    def on_enqueue(self, callback: Callable[[], None]) -> Callable[[], None]:
        """Call ``callback`` (in the event loop) after each commit that added
        a pending dispatch in this process; return a function that removes
        it. Used by a worker to wake at once instead of waiting for a tick."""
