"""The engine conformance suite: one contract, every way of writing a row.

Each test runs on both engines (SQLite, PostgreSQL) through every writer:
the async store on trio and on asyncio, and the synchronous adapters of
:mod:`trio_dispatch.sync` on the driver's own connection (``sqlite3`` or
psycopg) and on SQLAlchemy's ``Connection`` and ``Session``. What is checked
is the row and its history as another connection reads them, and that a
worker on the async store delivers what any writer committed. A new engine
or a new adapter is proven by adding it to :data:`WRITERS`.
"""

from __future__ import annotations

import contextlib
import sqlite3
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import anyio.from_thread
import pytest

from trio_dispatch import Delivery, deliver_due_dispatches, open_store
from trio_dispatch import enqueue_dispatch as async_enqueue
from trio_dispatch import enqueue_many as async_enqueue_many
from trio_dispatch import sync as outbox
from trio_dispatch.lifecycle import WAITING_AT

from ..conftest import RawDB

Items = Sequence[Mapping[str, Any]]


@dataclass
class Writer:
    """One way of writing rows. ``unit(steps, commit)`` runs ``steps`` (each
    given an ``enqueue`` and an ``enqueue_many`` bound to one transaction) and
    commits the transaction or rolls it back."""

    unit: Callable[[Callable[[Any, Any], Any], bool], Any]


def _store_writer(target: str, backend: str) -> Iterator[Writer]:
    with anyio.from_thread.start_blocking_portal(backend) as portal:
        with portal.wrap_async_context_manager(open_store(target)) as db:

            def unit(steps: Callable[[Any, Any], Any], commit: bool) -> Any:
                async def run() -> Any:
                    result: Any = None
                    with contextlib.suppress(_Rollback):
                        async with db.transaction() as tx:

                            def one(**args: Any) -> str:
                                return portal.call(lambda: async_enqueue(tx, **args))

                            def many(items: Items) -> list[str]:
                                found = portal.call(lambda: async_enqueue_many(tx, list(items)))
                                return [r.id for r in found]

                            result = await anyio.to_thread.run_sync(steps, one, many)
                            if not commit:
                                raise _Rollback
                    return result

                return portal.call(run)

            yield Writer(unit)


class _Rollback(Exception):
    pass


def _connection_writer(conn: Any, commit_of: Callable[[bool], None]) -> Writer:
    def unit(steps: Callable[[Any, Any], Any], commit: bool) -> Any:
        def one(**args: Any) -> str:
            return outbox.enqueue_dispatch(conn, **args)

        def many(items: Items) -> list[str]:
            return [r.id for r in outbox.enqueue_many(conn, list(items))]

        try:
            result = steps(one, many)
        except BaseException:
            commit_of(False)
            raise
        commit_of(commit)
        return result

    return Writer(unit)


def _driver_writer(engine: str, target: str) -> Iterator[Writer]:
    if engine == "sqlite":
        conn: Any = sqlite3.connect(target)
    else:
        import psycopg

        conn = psycopg.connect(target)
    try:
        outbox.install_schema(conn)
        conn.commit()
        yield _connection_writer(conn, lambda commit: conn.commit() if commit else conn.rollback())
    finally:
        conn.close()


def _sqlalchemy_url(engine: str, target: str) -> str:
    if engine == "sqlite":
        return f"sqlite+pysqlite:///{target}"
    return target.replace("postgresql://", "postgresql+psycopg://", 1)


def _sqlalchemy_writer(engine: str, target: str, *, session: bool) -> Iterator[Writer]:
    from sqlalchemy import create_engine
    from sqlalchemy.orm import Session

    sa_engine = create_engine(_sqlalchemy_url(engine, target))
    try:
        with sa_engine.connect() as conn:
            outbox.install_schema(conn)
            conn.commit()
            if session:
                with Session(sa_engine) as sa_session:
                    yield _connection_writer(
                        sa_session,
                        lambda commit: sa_session.commit() if commit else sa_session.rollback(),
                    )
            else:
                yield _connection_writer(
                    conn, lambda commit: conn.commit() if commit else conn.rollback()
                )
    finally:
        sa_engine.dispose()


WRITERS: dict[str, Callable[[str, str], Iterator[Writer]]] = {
    "store-trio": lambda engine, target: _store_writer(target, "trio"),
    "store-asyncio": lambda engine, target: _store_writer(target, "asyncio"),
    "driver": _driver_writer,
    "sqlalchemy-connection": lambda e, t: _sqlalchemy_writer(e, t, session=False),
    "sqlalchemy-session": lambda e, t: _sqlalchemy_writer(e, t, session=True),
}


@pytest.fixture(params=sorted(WRITERS))
def writer(request: pytest.FixtureRequest, engine: str, db_target: str) -> Iterator[Writer]:
    # The schema first, as the application's deployment would create it.
    with anyio.from_thread.start_blocking_portal("trio") as portal:
        portal.call(_create_schema, db_target)
    yield from WRITERS[str(request.param)](engine, db_target)


async def _create_schema(target: str) -> None:
    async with open_store(target):
        pass


def delivered_by_a_worker(target: str) -> list[Delivery]:
    """One pass of a worker on the async store; what its transport received."""
    seen: list[Delivery] = []

    async def transport(delivery: Delivery) -> None:
        seen.append(delivery)

    async def one_pass() -> None:
        async with open_store(target) as db:
            await deliver_due_dispatches(db, transport=transport)

    with anyio.from_thread.start_blocking_portal("trio") as portal:
        portal.call(one_pass)
    return seen


def test_a_committed_row_is_pending_with_its_history_and_a_worker_delivers_it(
    writer: Writer, raw: RawDB, db_target: str
) -> None:
    dispatch_id = writer.unit(
        lambda one, many: one(
            kind="order.created", deliver_to="billing", body={"order": "o-1"}, max_attempts=3
        ),
        True,
    )
    row = raw.row(dispatch_id)
    assert (row["status"], row["kind"], row["deliver_to"], row["attempt"], row["max_attempts"]) == (
        "pending",
        "order.created",
        "billing",
        0,
        3,
    )
    [enqueued] = raw.transitions(dispatch_id)
    assert (enqueued["previous_status"], enqueued["status"], enqueued["reason_code"]) == (
        None,
        "pending",
        "dispatch.pending.enqueued",
    )
    [delivery] = delivered_by_a_worker(db_target)
    assert (delivery.dispatch_id, delivery.kind, delivery.attempt) == (
        dispatch_id,
        "order.created",
        1,
    )
    assert '"order": "o-1"' in delivery.payload
    assert raw.row(dispatch_id)["status"] == "delivered"


def test_a_rollback_leaves_no_row_and_no_history(writer: Writer, raw: RawDB) -> None:
    writer.unit(lambda one, many: one(kind="k", deliver_to="d"), False)
    assert raw.counts() == (0, 0)


def test_a_repeated_dedup_key_returns_the_first_id_and_writes_nothing(
    writer: Writer, raw: RawDB
) -> None:
    first = writer.unit(lambda one, many: one(kind="k", deliver_to="d", dedup_key="x"), True)
    again = writer.unit(
        lambda one, many: (
            [
                one(kind="other", deliver_to="e", dedup_key="x"),
                *many([{"kind": "k", "deliver_to": "d", "dedup_key": "x"}]),
            ]
        ),
        True,
    )
    assert again == [first, first]
    assert raw.counts() == (1, 1)


def test_bad_arguments_raise_naming_the_value_write_nothing_and_keep_the_transaction(
    writer: Writer, raw: RawDB
) -> None:
    def steps(one: Any, many: Any) -> str:
        with pytest.raises(ValueError, match=r"max_attempts.*0"):
            one(kind="k", deliver_to="d", max_attempts=0)
        with pytest.raises(ValueError, match="kind"):
            many([{"kind": "ok", "deliver_to": "d"}, {"kind": "", "deliver_to": "d"}])
        with pytest.raises(TypeError, match="colour"):
            one(kind="k", deliver_to="d", colour="red")
        with pytest.raises(
            TypeError, match=r"^priority must be an integer from -10 to 10, got True"
        ):
            one(kind="k", deliver_to="d", priority=True)
        with pytest.raises(ValueError, match=r"^item 0: priority must be .* got 11$"):
            many([{"kind": "k", "deliver_to": "d", "priority": 11}])
        return str(one(kind="after", deliver_to="d"))

    kept = writer.unit(steps, True)
    assert [row["id"] for row in raw.rows("SELECT id FROM dispatch_outbox")] == [kept]
    assert raw.counts() == (1, 1)


def test_a_batch_keeps_its_order_and_each_row_its_own_history(
    writer: Writer, raw: RawDB, db_target: str
) -> None:
    ids = writer.unit(
        lambda one, many: many([{"kind": f"k{n}", "deliver_to": "d"} for n in range(5)]), True
    )
    assert len(set(ids)) == 5
    assert [raw.row(i)["kind"] for i in ids] == [f"k{n}" for n in range(5)]
    assert all(len(raw.transitions(i)) == 1 for i in ids)
    assert sorted(d.dispatch_id for d in delivered_by_a_worker(db_target)) == sorted(ids)


def test_keyed_rows_wait_behind_their_key_and_a_worker_delivers_them_in_order(
    writer: Writer, raw: RawDB, db_target: str
) -> None:
    ids = writer.unit(
        lambda one, many: [
            one(kind="a", deliver_to="d", ordering_key="order-7"),
            *many(
                [{"kind": f"b{n}", "deliver_to": "d", "ordering_key": "order-7"} for n in (1, 2)]
            ),
            one(kind="c", deliver_to="d", ordering_key="other"),
        ],
        True,
    )
    assert [raw.row(i)["ordering_key"] for i in ids] == ["order-7"] * 3 + ["other"]
    waiting = [raw.row(i)["next_attempt_at"] == WAITING_AT for i in ids]
    assert waiting == [False, True, True, False]
    delivered = []
    for _ in range(3):  # one row of a key per pass: each pass ends its head
        delivered += [d.dispatch_id for d in delivered_by_a_worker(db_target)]
    assert [i for i in delivered if i in ids[:3]] == ids[:3]
    assert sorted(delivered) == sorted(ids)


def test_every_writer_gives_a_priority_the_store_s_head_start_and_urgent_rows_go_first(
    writer: Writer, raw: RawDB, db_target: str
) -> None:
    # The store's step, as a worker with priority_step_seconds: 60 records it.
    raw.execute(
        "INSERT INTO dispatch_settings (name, value) VALUES ('priority_step_seconds', 60) "
        "ON CONFLICT (name) DO UPDATE SET value = excluded.value"
    )
    ids = writer.unit(
        lambda one, many: [
            one(kind="low", deliver_to="d", priority=-2),
            *many(
                [
                    {"kind": "plain", "deliver_to": "d"},
                    {"kind": "urgent", "deliver_to": "d", "priority": 3},
                ]
            ),
        ],
        True,
    )
    assert [(raw.row(i)["priority"], raw.row(i)["head_start"]) for i in ids] == [
        (-2, -120),
        (0, 0),
        (3, 180),
    ]
    ranked = raw.rows("SELECT id FROM dispatch_outbox ORDER BY next_attempt_at - head_start")
    assert [row["id"] for row in ranked] == [ids[2], ids[1], ids[0]]
    assert sorted(d.dispatch_id for d in delivered_by_a_worker(db_target)) == sorted(ids)


def test_every_writer_coalesces_a_key_to_one_waiting_row_and_a_rollback_supersedes_nothing(
    writer: Writer, raw: RawDB, db_target: str
) -> None:
    def replace(n: int) -> Callable[[Any, Any], Any]:
        return lambda one, many: one(
            kind="digest", deliver_to="d", body={"n": n}, coalesce_key="u-1", coalesce="replace"
        )

    first = writer.unit(replace(1), True)
    second, kept, batch = writer.unit(
        lambda one, many: (
            replace(2)(one, many),
            one(kind="digest", deliver_to="d", coalesce_key="u-1", coalesce="keep"),
            many([{"kind": "digest", "deliver_to": "d", "coalesce_key": "u-2"}]),
        ),
        True,
    )
    # keep returns the waiting row's id and writes nothing; replace never
    # rewrites a payload: the waiting row becomes superseded, naming its successor.
    assert kept == second != first
    writer.unit(replace(3), False)  # rolled back: nothing superseded
    statuses = {
        row["id"]: row["status"] for row in raw.rows("SELECT id, status FROM dispatch_outbox")
    }
    assert statuses == {first: "superseded", second: "pending", batch[0]: "pending"}
    last = raw.transitions(first)[-1]
    assert (last["status"], last["reason_code"], last["reason_summary"]) == (
        "superseded",
        "dispatch.superseded.coalesced",
        f"superseded by {second}",
    )
    delivered = {d.dispatch_id: d.payload for d in delivered_by_a_worker(db_target)}
    assert set(delivered) == {second, batch[0]} and '"n": 2' in delivered[second]
