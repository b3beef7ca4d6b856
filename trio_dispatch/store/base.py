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

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractAsyncContextManager
from typing import (
    TYPE_CHECKING,
    Any,
    ClassVar,
    Final,
    Literal,
    Protocol,
    TypedDict,
    TypeVar,
    runtime_checkable,
)

from ..errors import ConnectionLostError as ConnectionLostError
from ..errors import SchemaError as SchemaError
from ..errors import StoreError as StoreError
from ..redact import mask_url
from ..values import replaced, show


class KeyOrderConflict(StoreError):
    """A unit of a shared transaction needed an ordering key's lock out of
    the transaction's one order (a key below one it already holds) and
    another transaction held it: waiting could close a deadlock, so the
    group commit commits what ran before the unit and runs the unit first
    in a transaction of its own. Never reaches a caller."""


if TYPE_CHECKING:
    from .dialect import Dialect

T = TypeVar("T")
ItemT = TypeVar("ItemT")
ResultT = TypeVar("ResultT")

Row = dict[str, Any]


class Undecodable(str):
    """A stored text value that is not valid UTF-8 (written by something
    other than the outbox, or damaged): readable, with U+FFFD in place of
    each bad byte, so a read never fails on it; :attr:`raw` keeps the bytes.
    A row holding one cannot be delivered (:func:`undecodable_columns`)."""

    __slots__ = ("raw",)

    raw: bytes
    made: ClassVar[bool] = False
    """Whether this process has read one yet: until then no parameter can
    be one, and binding skips looking (see ``store.sqlite``)."""

    def __new__(cls, raw: bytes) -> Undecodable:
        text = super().__new__(cls, raw.decode("utf-8", "replace"))
        text.raw = raw
        Undecodable.made = True
        return text

    def __getnewargs__(self) -> tuple[bytes]:  # type: ignore[override]
        return (self.raw,)  # copy and pickle rebuild it from its bytes


def decode_text(raw: bytes) -> str:
    """A text value as read from SQLite: ``str``, or :class:`Undecodable`
    for bytes that are not valid UTF-8 (SQLite does not check what it is
    given; PostgreSQL does)."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return Undecodable(raw)


def undecodable_columns(row: Row) -> list[str]:
    """The columns of ``row`` whose stored text is not valid UTF-8."""
    if not Undecodable.made:  # none read by this process yet: none in the row
        return []
    return [column for column, value in row.items() if isinstance(value, Undecodable)]


Durability = Literal["full", "normal"]
DURABILITIES: Final = ("full", "normal")
DEFAULT_BUSY_TIMEOUT_SECONDS: Final = 10.0
MAX_BUSY_TIMEOUT_SECONDS: Final = 2_147_483.0
"""The longest wait either engine takes: SQLite's ``busy_timeout`` and
PostgreSQL's ``lock_timeout`` are both a 32-bit count of milliseconds."""
DEFAULT_NETWORK_TIMEOUT_SECONDS: Final = 5.0
"""PostgreSQL: how long the store waits for the server to answer beyond
what a lock may take (see :attr:`StoreOptions.network_timeout`)."""
MIN_NETWORK_TIMEOUT_SECONDS: Final = 0.1
DEFAULT_MAX_BODY_BYTES: Final = 1024 * 1024
"""The largest ``body`` an enqueue accepts, in bytes of JSON (docs/security.md)."""
MIGRATE_HINT: Final = "run `trio-dispatch migrate` to create it"


def check_schema_version(found: int | None, where: str, current: int, *, migrating: bool) -> None:
    """Raise :class:`SchemaError` unless a database whose recorded schema
    version is ``found`` (None: no outbox schema at all) can be used by a
    store at version ``current``; a migrating store may take an older or
    missing schema forward."""
    if found is not None and found > current:
        raise SchemaError(
            f"{where} has schema version {found}, newer than this trio_dispatch supports "
            f"({current}); upgrade trio_dispatch instead"
        )
    if migrating:
        return
    if found is None:
        raise SchemaError(f"{where} has no trio_dispatch schema: {MIGRATE_HINT}")
    if found < current:
        raise SchemaError(
            f"{where} has schema version {found}, older than this trio_dispatch uses "
            f"({current}): run `trio-dispatch migrate` to bring it forward"
        )


def check_busy_timeout(value: object, name: str = "busy_timeout") -> float:
    """``value`` as seconds, if it is a number from 0 to
    :data:`MAX_BUSY_TIMEOUT_SECONDS`; else ValueError naming it."""
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not _finite(value)
        or not 0 <= value <= MAX_BUSY_TIMEOUT_SECONDS
    ):
        raise ValueError(
            f"{name} must be a number of seconds from 0 to {MAX_BUSY_TIMEOUT_SECONDS:.0f}, "
            f"got {show(value)}"
        )
    return float(value)


def check_network_timeout(value: object, name: str = "network_timeout") -> float:
    """``value`` as seconds, if it is a number from
    :data:`MIN_NETWORK_TIMEOUT_SECONDS` to :data:`MAX_BUSY_TIMEOUT_SECONDS`;
    else ValueError naming it."""
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not _finite(value)
        or not MIN_NETWORK_TIMEOUT_SECONDS <= value <= MAX_BUSY_TIMEOUT_SECONDS
    ):
        raise ValueError(
            f"{name} must be a number of seconds from {MIN_NETWORK_TIMEOUT_SECONDS:g} to "
            f"{MAX_BUSY_TIMEOUT_SECONDS:.0f}, got {show(value)}"
        )
    return float(value)


def _finite(value: float) -> bool:
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


class StoreOptionArgs(TypedDict, total=False):
    """:class:`StoreOptions` given by name, for type checkers (``open_store``'s
    keywords); a test keeps the two the same."""

    durability: Durability
    busy_timeout: float
    network_timeout: float
    read_only: bool
    migrate: bool
    max_body_bytes: int
    snapshot: bool
    schema: str | None


@dataclasses.dataclass(frozen=True)
class StoreOptions:
    """How a store is opened, declared once: :func:`~trio_dispatch.open_store`
    takes these by name, and each engine's store is built from them. Every
    field is checked when the object is built (``ValueError`` naming it)."""

    durability: Durability = "full"
    """``"full"``: a commit survives power loss; ``"normal"``: a process
    crash (PostgreSQL: ``synchronous_commit=off``)."""
    busy_timeout: float = DEFAULT_BUSY_TIMEOUT_SECONDS
    """How long a write waits for another process's lock (PostgreSQL:
    ``lock_timeout``)."""
    network_timeout: float = DEFAULT_NETWORK_TIMEOUT_SECONDS
    """PostgreSQL: a round trip to the server that has no answer after
    ``busy_timeout + network_timeout`` seconds is abandoned and its
    connection dropped (a silent network: no reset ever comes); the server
    ends a session of the store's left idle in a transaction, or running
    one statement, a little sooner (half ``network_timeout`` before that
    deadline). Connecting waits ``network_timeout`` (at least
    2 s), and a connection dropped this way is not tried again for as long.
    SQLite ignores it."""
    read_only: bool = False
    """Open without writing anything; never create or migrate."""
    migrate: bool = True
    """Create or migrate the schema when opening (else it must be current)."""
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    """The largest enqueue ``body`` accepted, in bytes of JSON."""
    snapshot: bool = False
    """SQLite, with ``read_only``: each read opens a connection of its own."""
    schema: str | None = None
    """PostgreSQL: the schema that holds every outbox table."""

    def __post_init__(self) -> None:
        if self.durability not in DURABILITIES:
            raise ValueError(
                f"durability must be one of {DURABILITIES}, got {show(self.durability)}"
            )
        object.__setattr__(self, "busy_timeout", check_busy_timeout(self.busy_timeout))
        object.__setattr__(self, "network_timeout", check_network_timeout(self.network_timeout))
        limit = self.max_body_bytes
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
            raise ValueError(f"max_body_bytes must be an int >= 1, got {show(limit)}")

    def updated(self, values: Mapping[str, Any], caller: str = "open_store") -> StoreOptions:
        """These options with ``values`` (name -> value) in place, checked;
        an unknown name raises ``TypeError`` naming it."""
        updated: StoreOptions = replaced(self, values, caller, "options")
        return updated


Engine = Literal["sqlite", "postgres"]


def parse_target(target: str) -> tuple[Engine, str]:
    """Which engine a store target names, and its location: ``("sqlite",
    path)`` for a file path, ``":memory:"``, ``sqlite:///rel.db`` or
    ``sqlite:////abs.db``; ``("postgres", url)`` for ``postgresql://`` or
    ``postgres://``. Anything else raises ValueError whose message names the
    target with its password masked."""
    if not isinstance(target, str):
        raise TypeError(f"store target must be a str path or URL, got {show(target)}")
    if "\x00" in target:
        raise ValueError(f"store target {show(mask_url(target))} contains a NUL character")
    if not target.strip():
        raise ValueError("store target must be a path, ':memory:' or a URL, got an empty string")
    try:
        target.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError(
            f"store target {show(mask_url(target))} is not valid text (a lone surrogate)"
        ) from None
    if target.startswith(("postgresql://", "postgres://")):
        from .pg_session import check_url  # the engine's own rules, where its driver is

        check_url(target)
        return "postgres", target
    if target.startswith("sqlite:"):
        rest = target[len("sqlite:") :]
        if not rest.startswith("///"):
            raise ValueError(
                f"store URL must look like sqlite:///relative.db or sqlite:////absolute.db, "
                f"got {show(mask_url(target))}"
            )
        path = rest[3:]  # sqlite:///rel.db -> rel.db, sqlite:////abs.db -> /abs.db
        if not path:
            raise ValueError(f"store URL names no file: {show(mask_url(target))}")
        return "sqlite", path
    if "://" in target:
        raise ValueError(
            f"unsupported store URL {show(mask_url(target))}: use a file path, ':memory:', "
            "sqlite:///path or postgresql://..."
        )
    return "sqlite", target


def query_in_turn(
    conn: Conn,
    sql: str,
    rows: Sequence[Sequence[Any]],
    first: tuple[str, Sequence[Any]] | None = None,
) -> list[list[Row]]:
    """:meth:`Conn.query_each` one statement after the other, for a
    connection with no pipeline."""
    if first is not None:
        conn.query(*first)
    return [conn.query(sql, row) for row in rows]


class Conn(Protocol):
    """A connection inside an open transaction, used from a unit of work."""

    @property
    def dialect(self) -> Dialect:
        """How this connection's engine spells what differs between engines
        (row locks, row keys, bulk statements, notices)."""

    def execute(self, sql: str, params: Sequence[Any] = ()) -> int:
        """Run one statement; return the number of rows it changed."""

    def executemany(self, sql: str, rows: Sequence[Sequence[Any]]) -> int:
        """Run one statement for each parameter row; return rows changed."""

    def send(self, sql: str, params: Sequence[Any] = ()) -> None:
        """Run one statement whose result is not read. A connection may send
        it with what follows (a caller's pipelined psycopg connection: the
        enqueue's end), where its error is raised, before the transaction
        ends; elsewhere it runs at once, as :meth:`execute`."""

    def query(self, sql: str, params: Sequence[Any] = ()) -> list[Row]:
        """Run a query (or a statement with ``RETURNING``); return its rows."""

    def query_one(self, sql: str, params: Sequence[Any] = ()) -> Row | None:
        """The first row of :meth:`query`, or None."""

    def query_each(
        self,
        sql: str,
        rows: Sequence[Sequence[Any]],
        first: tuple[str, Sequence[Any]] | None = None,
    ) -> list[list[Row]]:
        """Run a statement with ``RETURNING`` once for each parameter row, in
        order (after ``first``, a statement whose result is not read); return
        each run's rows. A connection may send them all in one round trip
        (PostgreSQL's pipeline)."""

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
        self,
        many: Callable[[Conn, list[ItemT]], list[ResultT]],
        item: ItemT,
        single: bool = False,
    ) -> ResultT:
        """Like :meth:`write`, for work that is cheaper in bulk: every item
        queued at once for the same ``many`` function is handled by one call
        ``many(conn, items)``, which returns one result per item, in order.
        If that call raises, each item is run again by itself, so an error
        still reaches only its own caller. ``single`` promises that
        ``many(conn, [item])`` runs exactly one statement on an engine with
        data-modifying ``WITH`` (PostgreSQL): alone in its transaction, the
        store may send it by itself (see
        :meth:`~.batching.BatchingStore._begin_single`)."""

    def notify_enqueued(self) -> None:
        """Tell this process's listeners that a pending dispatch was added.
        A store calls them at once; a transaction calls them after it commits
        (and never, if it rolls back)."""

    def notify_enqueuing(self) -> None:
        """Tell this process's early listeners that an enqueue is about to
        be written (a store; a transaction's rows wait for its commit, and
        :meth:`notify_enqueued` then): a worker's claim that the store runs
        after it, in the same group commit, looks for its destination."""


class Transaction(Database, Protocol):
    """A caller-owned transaction (docs/usage.md): units passed to :meth:`write`
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

    def on_enqueuing(self, callback: Callable[[], None]) -> Callable[[], None]:
        """Call ``callback`` (in the event loop) before each enqueue of this
        process is written (it may still fail: a hint, never a promise);
        return a function that removes it. A worker's fair share uses it:
        on SQLite a claim written in the same group commit as the enqueue,
        after it, sees the new row, where the notice after the commit would
        reach only the claim after that one."""

    def on_cancel(self, callback: Callable[[str], None]) -> Callable[[], None]:
        """Call ``callback`` (in the event loop) with the dispatch id after
        a cancel of a running attempt committed in this process; return a
        function that removes it. A worker of this process cuts the
        attempt at once (other processes hear through :class:`Listener`)."""

    def notify_cancel(self, dispatch_id: str) -> None:
        """Tell this process's cancel listeners that the cancel of
        ``dispatch_id``'s running attempt has committed."""


@runtime_checkable
class Listener(Protocol):
    """A store that can tell this process about enqueues other processes
    commit (PostgreSQL ``LISTEN``/``NOTIFY``; SQLite: any commit). A worker
    listens when its store is one; otherwise its tick (and in-process
    wake-ups) suffice."""

    async def listen(
        self,
        callback: Callable[[], None],
        *,
        on_cancel: Callable[[str | None], None] | None = None,
    ) -> None:
        """Call ``callback`` (in the event loop) after each enqueue any
        process commits, and once when listening (re)starts, until
        cancelled; raise if notifications are unavailable (the caller then
        relies on its tick). With ``on_cancel``, also call it after a cancel
        of a running attempt commits anywhere (docs/controls.md), with the
        dispatch id, or None where the engine cannot say which (SQLite:
        after any commit), and once when listening (re)starts: what
        committed before it (after a worker's first scan, say) may have
        gone unheard."""
