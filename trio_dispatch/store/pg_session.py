"""One PostgreSQL session of the store: a psycopg connection seen as a
:class:`~trio_dispatch.store.base.Conn`, how it is opened and configured,
whether it is still alive, and the deadline on each of its round trips
(see :mod:`.postgres` for the store that holds them); the same adapter
over a caller's own connection, borrowed (:class:`BorrowedPostgresConn`,
for :mod:`trio_dispatch.sync`); and every rule of a ``postgresql://`` URL
and of the schema it names (:func:`check_url`, :func:`store_schema`,
:func:`check_schema_name`), which the engine-independent modules import
from here when a target is PostgreSQL's, so they never load psycopg for
SQLite."""

from __future__ import annotations

import contextlib
import math
import re
import select
from collections.abc import Callable, Sequence
from typing import Any, Final, NoReturn

from ..redact import (
    AMBIGUOUS_URL_ERROR,
    ambiguous_userinfo,
    known_secrets,
    mask_url,
    one_line,
    url_secrets,
)
from ..values import show
from .base import ConnectionLostError, Row, StoreError
from .dialect import POSTGRES, Replanned, Typed
from .placeholders import to_paramstyle
from .watchdog import Watch, Watchdog, shut_socket

try:  # an optional dependency: `pip install trio_dispatch[postgres]`
    import psycopg
    from psycopg.pq import ConnStatus
    from psycopg.rows import dict_row
    from psycopg.types.string import TextLoader
except ImportError:  # pragma: no cover - exercised only without the extra
    psycopg = None  # type: ignore[assignment]

KEEPALIVE_COUNT: Final = 3


def connection_parameters(url: str, network_timeout: float) -> dict[str, Any]:
    """libpq parameters that bound connecting and a dead peer, from
    ``network_timeout``; a parameter the URL sets itself is left to it."""
    seconds = max(1, math.ceil(network_timeout))
    wanted: dict[str, Any] = {
        "connect_timeout": max(2, seconds),
        "keepalives": 1,
        "keepalives_idle": seconds,
        "keepalives_interval": max(1, math.ceil(network_timeout / KEEPALIVE_COUNT)),
        "keepalives_count": KEEPALIVE_COUNT,
        "tcp_user_timeout": int(network_timeout * 1000),
    }
    given = psycopg.conninfo.conninfo_to_dict(url)
    return {name: value for name, value in wanted.items() if name not in given}


def silence(seconds: float) -> str:
    """What a round trip cut by its deadline says."""
    return (
        f"no answer from the server in {seconds:g}s "
        "(busy_timeout_seconds + network_timeout_seconds); the connection was dropped"
    )


def shut(conn: psycopg.Connection[Any]) -> None:
    """Cut ``conn``'s socket under whatever call is blocked on it."""
    if conn.closed:
        return
    try:
        fd = conn.pgconn.socket
    except psycopg.OperationalError:
        return
    shut_socket(fd)


def check_url(url: str) -> None:
    """A ``postgresql://`` store URL as libpq would take it, checked before
    anything connects: a user name and password whose pieces libpq would
    split differently, an unknown parameter, a port that is not a number
    are ValueErrors naming the URL masked. Without psycopg only the first
    is checked (opening names the missing extra)."""
    if ambiguous_userinfo(url):  # not even masked: its host may be a piece of it
        raise ValueError(f"invalid store URL: {AMBIGUOUS_URL_ERROR}")
    if psycopg is None:
        return
    # libpq splits a password at its own idea of the URL's pieces and quotes
    # a piece (in "user:pa/ss@host" it reads "user:pa" as host and port):
    # with a password in the URL, libpq's text is not shown.
    has_password = bool(url_secrets(url))
    try:
        params = psycopg.conninfo.conninfo_to_dict(url)
    except psycopg.Error as exc:
        reason = (
            "libpq cannot parse it (an unknown query parameter, or a space, @, /, :, "
            "?, # or % in the user name or password that is not percent-encoded)"
            if has_password
            else " ".join(str(exc).split())
        )
        raise ValueError(f"invalid store URL {show(mask_url(url))}: {reason}") from None
    for port in str(params.get("port") or "").split(","):
        if port and not (port.isdigit() and 0 < int(port) < 65536):
            shown = "" if has_password else f" {show(port)}"
            raise ValueError(
                f"invalid store URL {show(mask_url(url))}: the port{shown} is not a number "
                "from 1 to 65535"
            )


_SCHEMA_NAME: Final = re.compile(r"[a-z_][a-z0-9_]{0,62}")


def check_schema_name(value: object, name: str = "schema") -> str:
    """``value`` if it is a PostgreSQL schema name the outbox can use as is
    (unquoted, so every spelling of it -- a URL's ``search_path``, ``SET
    search_path``, ``CREATE SCHEMA`` -- means the same schema); else
    ValueError naming it."""
    if (
        not isinstance(value, str)
        or not _SCHEMA_NAME.fullmatch(value)
        or value.startswith("pg_")  # reserved for the system's own
    ):
        raise ValueError(
            f"{name} must be a lowercase identifier (a-z, 0-9, _; not starting with a digit "
            f"or pg_; at most 63 characters), got {show(value)}"
        )
    return value


def _server_options(options: str) -> list[str]:
    """libpq's ``options``, split as the server splits them: at whitespace
    not escaped by a backslash."""
    words: list[str] = []
    word: list[str] = []
    escaped = False
    for char in options:
        if escaped:
            word.append(char)
            escaped = False
        elif char == "\\":
            escaped = True
        elif char.isspace():
            if word:
                words.append("".join(word))
            word = []
        else:
            word.append(char)
    if word:
        words.append("".join(word))
    return words


def url_search_path(url: str) -> str | None:
    """The ``search_path`` a PostgreSQL URL sets through its ``options``
    parameter (``?options=-csearch_path%3Dname``), or None."""
    try:
        from psycopg.conninfo import conninfo_to_dict
    except ImportError:  # then read the URL's query as a URL
        from urllib.parse import parse_qs, urlsplit

        options = parse_qs(urlsplit(url).query).get("options", [""])[-1]
    else:
        options = str(conninfo_to_dict(url).get("options") or "")
    words = _server_options(options)
    found: str | None = None
    for index, word in enumerate(words):
        if word == "-c" and index + 1 < len(words):
            setting = words[index + 1]
        elif word.startswith("-c") and word != "-c":
            setting = word[2:]
        elif word.startswith("--"):
            setting = word[2:]
        else:
            continue
        key, equals, value = setting.partition("=")
        if equals and key.strip().lower().replace("-", "_") == "search_path":
            found = value  # the last one wins, as on the server
    return found


def store_schema(url: str, schema: str | None) -> str | None:
    """The schema that holds a PostgreSQL store's tables: ``schema`` (the
    store option), else the first schema of the URL's ``search_path``, else
    None (the connection's own ``search_path``). Raises ValueError naming a
    name the outbox cannot use, or the two when they disagree."""
    if schema is not None:
        check_schema_name(schema)
    path = url_search_path(url)
    if path is None:
        return schema
    first = path.split(",")[0].strip()
    if first.startswith('"') and first.endswith('"') and len(first) > 1:
        first = first[1:-1]
    found = check_schema_name(first, "the URL's search_path (options=-csearch_path=...)")
    if schema is not None and schema != found:
        raise ValueError(
            f"schema {show(schema)} and the URL's search_path {show(found)} name different "
            "schemas: give one of them"
        )
    return found


def placeholders(sql: str) -> str:
    """The outbox's portable SQL (``?`` placeholders) in psycopg's style;
    a :class:`~.dialect.Typed` statement's parameters go in binary."""
    return to_paramstyle(sql, "format", isinstance(sql, Typed))


def lost(conn: psycopg.Connection[Any]) -> bool:
    """Whether ``conn``'s session has ended (libpq knows it is dead)."""
    return conn.closed or conn.broken


def alive(conn: psycopg.Connection[Any]) -> bool:
    """Whether an idle connection still has its session, without a round
    trip: a server that ended the session (terminated, shutting down) sent
    its last words and closed the socket, so an idle connection with
    something to read is read, and libpq sees the end. A session that is
    cut without a word (a network partition) looks alive until used."""
    if lost(conn):
        return False
    try:
        fd = conn.fileno()
        for _ in range(4):  # the farewell, then the end of the stream
            if not _readable(fd):
                return True
            conn.pgconn.consume_input()
            if conn.pgconn.status != ConnStatus.OK:
                return False
    except (psycopg.Error, OSError, ValueError):
        return False
    return not lost(conn)


def _readable(fd: int) -> bool:
    if hasattr(select, "poll"):
        poller = select.poll()
        poller.register(fd, select.POLLIN)
        return bool(poller.poll(0))  # POLLHUP and POLLERR count too
    return bool(select.select([fd], [], [], 0)[0])  # pragma: no cover - no poll()


def error_text(exc: BaseException) -> str:
    """A driver error as one password-free line."""
    return one_line(exc, known_secrets())


class PostgresConn:
    """A :class:`~trio_dispatch.store.base.Conn` over one psycopg connection.

    With :attr:`begin_pending` set (the store's writer, see
    :meth:`PostgresStore._begin`) the first statement carries the
    transaction's ``BEGIN`` with it: both go in one pipelined round trip.
    With :attr:`single` set (:meth:`PostgresStore._begin_single`) the one
    statement goes alone and commits by itself; a second one is refused."""

    dialect = POSTGRES

    __slots__ = ("_conn", "begin_pending", "dog", "held_keys", "seconds", "single", "where")

    def __init__(
        self,
        conn: psycopg.Connection[Any],
        where: str = "the server",
        dog: Watchdog | None = None,
        seconds: float = 0.0,
    ) -> None:
        self._conn = conn
        self.begin_pending = False
        self.single: bool | None = None  # None: not a single; False: its statement went
        self.where = where  # the masked URL, for messages
        self.dog = dog  # cuts a round trip still unanswered after ``seconds``
        self.seconds = seconds
        self.held_keys: set[str] | None = None
        """The ordering keys whose locks this transaction holds, kept where
        the group commit composes the transaction (see
        :func:`~trio_dispatch.outbox.ordering.lock_keys`); None elsewhere."""

    def watched(self) -> Watch | contextlib.nullcontext[None]:
        """Enter it around one round trip: the round trip is cut if no
        answer comes in time (no deadline without a watchdog)."""
        if self.dog is None:
            return contextlib.nullcontext()
        return self.dog.watch(self.seconds, self._cut)

    def _cut(self) -> None:
        shut(self._conn)

    def why(self, exc: BaseException, watch: Watch | None) -> str:
        """Why a round trip failed, in one password-free line."""
        return silence(self.seconds) if watch is not None and watch.fired else error_text(exc)

    def _send(self, send: Callable[[], object], pipelined: bool = True) -> None:
        single = self.single
        if single is False:
            # The first statement has committed: a second would not be
            # atomic with it. A caller's promise broken is a bug, said loudly.
            raise StoreError("a single-statement write ran a second statement")
        if single:
            self.single = False
        watch: Watch | None = None
        try:
            with self.watched() as watch:
                self._send_once(send, pipelined)
        except psycopg.OperationalError as exc:
            if not lost(self._conn):
                raise
            if single:
                raise ConnectionLostError(
                    f"the connection to {self.where} ended while its statement ran "
                    f"({self.why(exc, watch)}); the outcome is unknown: it may or may not "
                    "have been committed",
                    outcome_unknown=True,
                ) from None
            raise_lost(self.why(exc, watch), self.where)

    def _send_once(self, send: Callable[[], object], pipelined: bool) -> None:
        if not self.begin_pending:
            send()
            return
        self.begin_pending = False
        if not pipelined or not psycopg.Pipeline.is_supported():
            # A statement without parameters may hold several commands,
            # which only the simple protocol (never a pipeline) accepts; and
            # libpq before 14 has no pipeline mode.
            self._conn.execute("BEGIN")
            send()
            return
        # BEGIN and the statement in one round trip; the cursor holds the
        # statement's results once the pipeline has synced at its end.
        with self._conn.pipeline():
            self._conn.execute("BEGIN")
            send()

    def execute(self, sql: str, params: Sequence[Any] = ()) -> int:
        prepare = False if isinstance(sql, Replanned) else None
        with self._conn.cursor() as cursor:
            self._send(
                lambda: cursor.execute(placeholders(sql), tuple(params), prepare=prepare),
                bool(params),
            )
            return cursor.rowcount

    def send(self, sql: str, params: Sequence[Any] = ()) -> None:
        self.execute(sql, params)

    def executemany(self, sql: str, rows: Sequence[Sequence[Any]]) -> int:
        with self._conn.cursor() as cursor:
            self._send(lambda: cursor.executemany(placeholders(sql), [tuple(r) for r in rows]))
            return cursor.rowcount

    def query(self, sql: str, params: Sequence[Any] = ()) -> list[Row]:
        prepare = False if isinstance(sql, Replanned) else None
        with self._conn.cursor(row_factory=dict_row) as cursor:
            self._send(
                lambda: cursor.execute(placeholders(sql), tuple(params), prepare=prepare),
                bool(params),
            )
            return list(cursor.fetchall()) if cursor.description else []

    def query_one(self, sql: str, params: Sequence[Any] = ()) -> Row | None:
        rows = self.query(sql, params)
        return rows[0] if rows else None

    def query_each(
        self,
        sql: str,
        rows: Sequence[Sequence[Any]],
        first: tuple[str, Sequence[Any]] | None = None,
    ) -> list[list[Row]]:
        found: list[list[Row]] = []
        with self._conn.cursor(row_factory=dict_row) as cursor:

            def send() -> None:
                # ``first`` and every run in one round trip (with the
                # transaction's BEGIN when it has not gone yet).
                with self._conn.pipeline():
                    if first is not None:
                        self._conn.execute(placeholders(first[0]), tuple(first[1]))
                    if len(rows) == 1:
                        cursor.execute(placeholders(sql), tuple(rows[0]))
                    else:
                        cursor.executemany(
                            placeholders(sql), [tuple(r) for r in rows], returning=True
                        )

            self._send(send)
            while True:
                found.append(list(cursor.fetchall()) if cursor.description else [])
                if not cursor.nextset():
                    break
        return found

    def announce_enqueue(self) -> None:
        # Delivered to listeners when (and only if) this transaction commits.
        self.execute(POSTGRES.notify)


class BorrowedPostgresConn(PostgresConn):
    """A caller's own psycopg connection (:mod:`trio_dispatch.sync`) seen as
    the store's :class:`PostgresConn`: the same statements, placeholders and
    rows, sent as they are -- no deadline, no ``BEGIN`` of its own, a lost
    connection left as the driver's error for the caller -- and nothing of
    the connection's settings changed. Inside a pipeline (:attr:`pipeline`)
    each statement's result is synced at once, the enqueue reads it next,
    but for :meth:`send`'s, which go with what follows."""

    __slots__ = ("pipeline",)

    def __init__(self, conn: psycopg.Connection[Any], where: str) -> None:
        super().__init__(conn, where)
        self.pipeline: psycopg.Pipeline | None = None
        """The pipeline the caller's transaction runs in now, or None."""

    def send(self, sql: str, params: Sequence[Any] = ()) -> None:
        if self.pipeline is None:
            self.execute(sql, params)
            return
        # Queued: it goes out with the next statement that is read, or the
        # enqueue's RELEASE and sync, which raise its error.
        self._conn.execute(placeholders(sql), tuple(params))

    def _send(self, send: Callable[[], object], pipelined: bool = True) -> None:
        send()
        if self.pipeline is not None:
            # The statement's result -- or its error -- is wanted now: it
            # goes out with whatever was queued before it (the SAVEPOINT).
            self.pipeline.sync()


def raise_lost(reason: str, where: str) -> NoReturn:
    raise ConnectionLostError(
        f"the connection to {where} ended during this transaction ({reason}): "
        "nothing in it was committed"
    ) from None


def configure(
    conn: psycopg.Connection[Any],
    *,
    durability: str,
    lock_timeout: float,
    server_deadline: float,
    read_only: bool = False,
    schema: str | None = None,
) -> None:
    # JSON columns come back as their text, as stored (the payload is sent as is).
    conn.adapters.register_loader("json", TextLoader)
    conn.adapters.register_loader("jsonb", TextLoader)
    settings = [
        f"SET synchronous_commit = {'on' if durability == 'full' else 'off'}",
        f"SET lock_timeout = '{int(lock_timeout * 1000)}ms'",
        # A session whose client went silent lets its locks go by the
        # deadline the client gives up at, instead of holding them forever;
        # a slow statement ends on the server a little before the client's
        # deadline, as an error on a connection that lives on.
        f"SET idle_in_transaction_session_timeout = '{math.ceil(server_deadline * 1000)}ms'",
        f"SET statement_timeout = '{math.ceil(server_deadline * 1000)}ms'",
    ]
    if conn.info.server_version >= 110000:  # JIT compiled a 0.1 ms claim scan in 11 ms
        settings.append("SET jit = off")
    if schema is not None:
        # Every outbox statement names its tables unqualified: on every
        # connection of the store they resolve in this schema alone
        # (pg_catalog, always searched first, still serves the built-ins).
        # The name is a checked identifier (store_schema).
        settings.append(f'SET search_path TO "{schema}"')
    if read_only:
        settings.append("SET default_transaction_read_only = on")
    conn.execute("; ".join(settings))  # one round trip (the simple protocol)
