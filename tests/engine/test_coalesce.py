"""Coalescing (docs/controls.md) on both engines and both backends, through
the library and real rows: keep, replace and debounce (its due time and
max wait on an injected clock), rows a claim took never touched, ordering
keys, dedup first, refusals that write nothing, concurrent producers --
tasks of one process, and real processes -- leaving one waiting row, and a
caller's transaction that rolls back superseding nothing."""

from __future__ import annotations

import json
import multiprocessing
import sqlite3
from functools import partial
from pathlib import Path
from typing import Any

import anyio
import pytest

from trio_dispatch import (
    EnqueuedId,
    enqueue_dispatch,
    enqueue_many,
    get_dispatch,
    list_dispatches,
    open_store,
    retry_dispatch,
)
from trio_dispatch import sync as outbox
from trio_dispatch.lifecycle import WAITING_AT
from trio_dispatch.outbox import claim_due, finish_attempt
from trio_dispatch.outbox.enqueue import EnqueueCall
from trio_dispatch.outbox.inserts import insert_coalesced
from trio_dispatch.store import SQLiteStore
from trio_dispatch.transports import TransportResult

from ..conftest import RawDB

pytestmark = pytest.mark.anyio

T0 = 1_000_000.0


def waiting(raw: RawDB, key: str) -> list[dict[str, Any]]:
    """The key's rows pending and never claimed."""
    return raw.rows(
        "SELECT * FROM dispatch_outbox WHERE coalesce_key = ? AND status = 'pending' "
        "AND attempt = 0",
        (key,),
    )


def statuses(raw: RawDB, key: str) -> dict[str, int]:
    found: dict[str, int] = {}
    for row in raw.rows("SELECT status FROM dispatch_outbox WHERE coalesce_key = ?", (key,)):
        found[str(row["status"])] = found.get(str(row["status"]), 0) + 1
    return found


def outcome(dispatch_id: str) -> str:
    """What the enqueue that returned ``dispatch_id`` did."""
    assert isinstance(dispatch_id, EnqueuedId)
    return dispatch_id.outcome


def metadata(transition: dict[str, Any]) -> dict[str, Any]:
    meta = transition["metadata"]
    return meta if isinstance(meta, dict) else dict(json.loads(meta))


async def add(store: Any, body: dict[str, Any] | None = None, **kwargs: Any) -> Any:
    kwargs.setdefault("now", T0)
    return await enqueue_dispatch(store, kind="digest", deliver_to="seat", body=body, **kwargs)


# -- the three modes ----------------------------------------------------------------


async def test_keep_returns_the_waiting_rows_id_and_writes_nothing(
    store: SQLiteStore, raw: RawDB
) -> None:
    first = await add(store, {"n": 1}, coalesce_key="user-7")
    assert first.outcome == "inserted"
    before = raw.counts()
    again = await add(store, {"n": 2}, coalesce_key="user-7", coalesce="keep", now=T0 + 5)
    assert (again, again.outcome) == (first, "kept")
    assert raw.counts() == before
    row = raw.row(first)
    assert json.loads(str(row["payload"]))["body"] == {"n": 1}  # never rewritten
    assert (row["status"], row["updated_at"]) == ("pending", T0)


async def test_replace_supersedes_the_waiting_row_and_its_transition_names_the_new_one(
    store: SQLiteStore, raw: RawDB
) -> None:
    old = await add(store, {"n": 1}, coalesce_key="user-7", coalesce="replace")
    new = await add(store, {"n": 2}, coalesce_key="user-7", coalesce="replace", now=T0 + 3)
    assert (old.outcome, new.outcome) == ("inserted", "replaced") and new != old
    superseded, fresh = raw.row(old), raw.row(new)
    assert (superseded["status"], superseded["updated_at"]) == ("superseded", T0 + 3)
    assert json.loads(str(superseded["payload"]))["body"] == {"n": 1}
    assert (fresh["status"], fresh["next_attempt_at"], fresh["coalesce_since"]) == (
        "pending",
        T0 + 3,
        T0,
    )
    last = raw.transitions(old)[-1]
    assert (last["previous_status"], last["status"], last["reason_code"]) == (
        "pending",
        "superseded",
        "dispatch.superseded.coalesced",
    )
    assert last["reason_summary"] == f"superseded by {new}"
    assert metadata(last)["superseded_by"] == new
    assert (last["source"], last["actor"]) == ("system", "enqueue_dispatch")
    [enqueued] = raw.transitions(new)
    assert enqueued["reason_summary"] == f"enqueued kind=digest, replaces {old}"
    assert [r["id"] for r in waiting(raw, "user-7")] == [new]
    shown = await get_dispatch(store, old)
    assert shown is not None and shown["coalesce_key"] == "user-7"
    listed = await list_dispatches(store, coalesce_key="user-7")
    assert [r["id"] for r in listed] == [new, old]


async def test_debounce_is_due_its_seconds_later_and_never_past_the_max_wait(
    store: SQLiteStore, raw: RawDB
) -> None:
    rule: dict[str, Any] = {
        "coalesce_key": "digest:7",
        "coalesce": "debounce",
        "coalesce_seconds": 10,
        "coalesce_max_wait_seconds": 25,
    }
    first = await add(store, now=T0, **rule)
    assert raw.row(first)["next_attempt_at"] == T0 + 10
    # Not due before its time: a claim at T0 + 9 takes nothing.
    assert (await claim_due(store, now=T0 + 9))[0] == []
    second = await add(store, now=T0 + 8, **rule)
    assert raw.row(second)["next_attempt_at"] == T0 + 18
    third = await add(store, now=T0 + 17, **rule)
    # Pushed to T0 + 27, held to the first row's creation plus 25.
    row = raw.row(third)
    assert (row["next_attempt_at"], row["not_before"], row["coalesce_since"]) == (
        T0 + 25,
        T0 + 25,
        T0,
    )
    assert {raw.row(first)["status"], raw.row(second)["status"]} == {"superseded"}
    assert (await claim_due(store, now=T0 + 24.9))[0] == []
    [claim], _ = await claim_due(store, now=T0 + 25)
    assert claim.dispatch_id == third
    # A chain begun after the claim starts again from its own first row.
    fourth = await add(store, now=T0 + 26, **rule)
    assert (fourth.outcome, raw.row(fourth)["next_attempt_at"]) == ("inserted", T0 + 36)


async def test_debounce_without_a_max_wait_is_pushed_by_every_enqueue(
    store: SQLiteStore, raw: RawDB
) -> None:
    rule: dict[str, Any] = {"coalesce_key": "k", "coalesce": "debounce", "coalesce_seconds": 10}
    for step in range(5):
        last = await add(store, now=T0 + step * 9, **rule)
    assert raw.row(last)["next_attempt_at"] == T0 + 46
    assert statuses(raw, "k") == {"superseded": 4, "pending": 1}


async def test_a_claimed_retrying_or_awaiting_row_is_never_touched(
    store: SQLiteStore, raw: RawDB
) -> None:
    running = await add(store, coalesce_key="k", coalesce="replace")
    [claim], _ = await claim_due(store, now=T0, ids=[running], lease_seconds=600)
    new = await add(store, coalesce_key="k", coalesce="replace", now=T0 + 1)
    assert new.outcome == "inserted"
    assert raw.row(running)["status"] == "delivering"
    # The attempt fails: back to pending (attempt 1), left alone by the next enqueue,
    # which replaces the row that was waiting unclaimed.
    await finish_attempt(store, claim, TransportResult.failure("boom"), now=T0 + 2)
    assert (raw.row(running)["status"], raw.row(running)["attempt"]) == ("pending", 1)
    newer = await add(store, coalesce_key="k", coalesce="replace", now=T0 + 3)
    assert newer.outcome == "replaced"
    assert raw.row(running)["status"] == "pending" and raw.row(new)["status"] == "superseded"
    # Awaiting its ack: pending again after a send, never touched.
    acked = await add(store, coalesce_key="a", coalesce="replace", ack_required=True)
    [sent], _ = await claim_due(store, now=T0, ids=[acked])
    await finish_attempt(store, sent, TransportResult.success(), now=T0 + 1)
    assert raw.row(acked)["status"] == "pending"
    kept = await add(store, coalesce_key="a", coalesce="keep", now=T0 + 2)
    assert kept.outcome == "inserted" and raw.row(acked)["status"] == "pending"


async def test_a_row_an_operator_retried_is_not_waiting_unclaimed(
    store: SQLiteStore, raw: RawDB
) -> None:
    dead = await add(store, coalesce_key="k", max_attempts=1)
    [claim], _ = await claim_due(store, now=T0, ids=[dead])
    await finish_attempt(store, claim, TransportResult.failure("boom"), now=T0 + 1)
    assert raw.row(dead)["status"] == "dead_letter"
    fresh = await add(store, coalesce_key="k", now=T0 + 2)
    assert fresh.outcome == "inserted"
    # Its attempt reset to 0, pending again: still not a second waiting row.
    assert await retry_dispatch(store, dead, now=T0 + 3)
    assert (raw.row(dead)["status"], raw.row(dead)["attempt"]) == ("pending", 0)
    again = await add(store, coalesce_key="k", coalesce="replace", now=T0 + 4)
    assert again.outcome == "replaced"
    assert raw.row(fresh)["status"] == "superseded" and raw.row(dead)["status"] == "pending"


async def test_dedup_answers_before_coalescing(store: SQLiteStore, raw: RawDB) -> None:
    first = await add(store, dedup_key="d-1")
    waiting_row = await add(store, coalesce_key="k", coalesce="replace")
    before = raw.counts()
    hit = await add(store, dedup_key="d-1", coalesce_key="k", coalesce="replace")
    assert (hit, hit.outcome) == (first, "kept")
    assert raw.counts() == before and raw.row(waiting_row)["status"] == "pending"
    [result] = await enqueue_many(
        store,
        [{"kind": "k", "deliver_to": "x", "dedup_key": "d-1", "coalesce_key": "k"}],
    )
    assert (result.id, result.dedup_hit, result.outcome) == (first, True, "kept")


async def test_a_batch_that_repeats_a_key_keeps_its_last_item_waiting(
    store: SQLiteStore, raw: RawDB
) -> None:
    item = {"kind": "k", "deliver_to": "x", "coalesce_key": "k", "coalesce": "replace"}
    results = await enqueue_many(store, [item, item, item], now=T0)
    assert [r.outcome for r in results] == ["inserted", "replaced", "replaced"]
    assert [r["id"] for r in waiting(raw, "k")] == [results[2].id]
    # Results still unpack and compare as (id, dedup_hit).
    dispatch_id, hit = results[0]
    assert (dispatch_id, hit) == results[0] == (results[0].id, False)
    kept = await enqueue_many(store, [{**item, "coalesce": "keep"}] * 2, now=T0 + 1)
    assert [(r.id, r.outcome) for r in kept] == [(results[2].id, "kept")] * 2


# -- ordering keys ------------------------------------------------------------------


async def test_a_superseded_head_lets_its_keys_next_row_go_and_the_new_row_waits_last(
    store: SQLiteStore, raw: RawDB
) -> None:
    head = await add(store, ordering_key="order-1", coalesce_key="c", coalesce="replace")
    behind = await add(store, ordering_key="order-1", now=T0 + 1)
    assert raw.row(behind)["next_attempt_at"] == WAITING_AT
    new = await add(store, ordering_key="order-1", coalesce_key="c", coalesce="replace", now=T0 + 2)
    assert raw.row(head)["status"] == "superseded"
    assert raw.row(behind)["next_attempt_at"] == T0 + 2  # promoted: first in its key now
    assert raw.row(new)["next_attempt_at"] == WAITING_AT  # behind it
    [claim], _ = await claim_due(store, now=T0 + 3)
    assert claim.dispatch_id == behind
    await finish_attempt(store, claim, TransportResult.success(), now=T0 + 4)
    [claim], _ = await claim_due(store, now=T0 + 5)
    assert claim.dispatch_id == new


async def test_a_keyed_waiting_row_replaced_by_an_unkeyed_enqueue_lets_its_key_go_on(
    store: SQLiteStore, raw: RawDB
) -> None:
    head = await add(store, ordering_key="o", coalesce_key="c", coalesce="replace")
    behind = await add(store, ordering_key="o", now=T0 + 1)
    # The new row has no ordering key: the group path sends it one by one.
    new = await add(store, coalesce_key="c", coalesce="replace", now=T0 + 2)
    assert new.outcome == "replaced" and raw.row(head)["status"] == "superseded"
    assert raw.row(behind)["next_attempt_at"] == T0 + 2
    assert raw.row(new)["next_attempt_at"] == T0 + 2 and raw.row(new)["ordering_key"] is None


async def test_one_group_commit_of_many_keys_and_modes_acts_as_if_one_by_one(
    store: SQLiteStore, raw: RawDB
) -> None:
    stored = {key: await add(store, coalesce_key=key, coalesce="replace") for key in "abc"}
    plan = [("a", "keep"), ("a", "replace"), ("b", "replace"), ("a", "keep"), ("b", "replace")]
    plan += [("c", "keep"), ("d", "keep"), ("d", "replace"), ("d", "keep")]
    results = await enqueue_many_concurrently(store, plan)
    a0, a1, b0, a2, b1, c0, d0, d1, d2 = results
    assert (str(a0), a0.outcome) == (stored["a"], "kept")
    assert a1.outcome == "replaced" and (str(a2), a2.outcome) == (a1, "kept")
    assert (b0.outcome, b1.outcome) == ("replaced", "replaced")
    assert (str(c0), c0.outcome) == (stored["c"], "kept")
    assert (d0.outcome, d1.outcome, str(d2), d2.outcome) == ("inserted", "replaced", d1, "kept")
    for key, last in (("a", a1), ("b", b1), ("c", stored["c"]), ("d", d1)):
        assert [r["id"] for r in waiting(raw, key)] == [last]
    assert raw.row(b0)["status"] == "superseded"  # inserted and superseded in one group
    assert [t["reason_code"] for t in raw.transitions(b0)] == [
        "dispatch.pending.enqueued",
        "dispatch.superseded.coalesced",
    ]
    assert raw.transitions(b0)[-1]["reason_summary"] == f"superseded by {b1}"


async def test_a_group_of_replaces_and_debounces_acts_as_if_one_by_one(
    store: SQLiteStore, raw: RawDB
) -> None:
    # No keep in the group: on PostgreSQL each item is one statement found
    # by the waiting rows' index, all in one round trip; a waiting row with
    # an ordering key goes the long way, and its key's next row still goes.
    stored = await add(store, coalesce_key="a", coalesce="replace")
    head = await add(store, ordering_key="o", coalesce_key="k", coalesce="replace")
    behind = await add(store, ordering_key="o", now=T0 + 0.5)
    plan = [("a", "replace"), ("b", "debounce"), ("k", "replace"), ("a", "replace")]
    plan += [("b", "debounce")]
    a0, b0, k0, a1, b1 = await enqueue_many_concurrently(store, plan)
    assert [r.outcome for r in (a0, b0, k0, a1, b1)] == [
        "replaced",
        "inserted",
        "replaced",
        "replaced",
        "replaced",
    ]
    for key, last in (("a", a1), ("b", b1), ("k", k0)):
        assert [r["id"] for r in waiting(raw, key)] == [last]
    assert statuses(raw, "a") == {"superseded": 2, "pending": 1}
    assert raw.row(stored)["status"] == raw.row(a0)["status"] == "superseded"
    assert raw.transitions(a1)[0]["reason_summary"] == f"enqueued kind=k, replaces {a0}"
    assert raw.transitions(a0)[-1]["reason_summary"] == f"superseded by {a1}"
    assert metadata(raw.transitions(a0)[-1])["superseded_by"] == a1
    # The debounce chain keeps its start: both rows due 5 s after their enqueue.
    assert raw.row(b1)["coalesce_since"] == raw.row(b0)["coalesce_since"] == T0 + 1
    assert raw.row(b1)["next_attempt_at"] == raw.row(b1)["not_before"] == T0 + 6
    assert raw.row(head)["status"] == "superseded"
    assert raw.row(behind)["next_attempt_at"] == T0 + 1  # its key's head now
    assert raw.row(k0)["next_attempt_at"] == T0 + 1 and raw.row(k0)["ordering_key"] is None


async def enqueue_many_concurrently(store: SQLiteStore, plan: list[tuple[str, str]]) -> list[Any]:
    """Each (key, mode) as the enqueues of one group commit, in that order
    (what :func:`enqueue_dispatch` hands the group commit for each)."""
    call = EnqueueCall()
    items = [
        (
            call.new(
                {"kind": "k", "deliver_to": "x", "coalesce_key": key, "coalesce": mode}
                | ({"coalesce_seconds": 5} if mode == "debounce" else {})
            ),
            T0 + 1,
        )
        for key, mode in plan
    ]
    results = await store.write(partial(insert_coalesced, items=items))
    return [EnqueuedId(result.id, result.outcome) for result in results]


async def test_with_an_ordering_key_one_runs_and_one_waits(store: SQLiteStore, raw: RawDB) -> None:
    first = await add(store, ordering_key="o", coalesce_key="c", coalesce="replace")
    [claim], _ = await claim_due(store, now=T0, ids=[first])
    second = await add(store, ordering_key="o", coalesce_key="c", coalesce="replace", now=T0 + 1)
    third = await add(store, ordering_key="o", coalesce_key="c", coalesce="replace", now=T0 + 2)
    assert (second.outcome, third.outcome) == ("inserted", "replaced")
    assert raw.row(first)["status"] == "delivering" and raw.row(second)["status"] == "superseded"
    assert raw.row(third)["next_attempt_at"] == WAITING_AT
    await finish_attempt(store, claim, TransportResult.success(), now=T0 + 3)
    assert raw.row(third)["next_attempt_at"] == T0 + 3


async def test_a_debounced_row_behind_its_keys_head_still_waits_its_time(
    store: SQLiteStore, raw: RawDB
) -> None:
    head = await add(store, ordering_key="o")
    [claim], _ = await claim_due(store, now=T0, ids=[head])
    debounced = await add(
        store,
        ordering_key="o",
        coalesce_key="c",
        coalesce="debounce",
        coalesce_seconds=60,
        now=T0 + 1,
    )
    assert raw.row(debounced)["next_attempt_at"] == WAITING_AT
    await finish_attempt(store, claim, TransportResult.success(), now=T0 + 2)
    # The head left at T0 + 2; the debounce says T0 + 61.
    assert raw.row(debounced)["next_attempt_at"] == T0 + 61


# -- refusals -----------------------------------------------------------------------


BAD: list[tuple[dict[str, Any], type[Exception], str]] = [
    ({"coalesce": "replace"}, ValueError, "coalesce='replace' needs a coalesce_key"),
    ({"coalesce_seconds": 5}, ValueError, "coalesce_seconds=5 needs a coalesce_key"),
    ({"coalesce_key": "k", "coalesce": "merge"}, ValueError, "coalesce must be 'keep'"),
    ({"coalesce_key": "k", "coalesce_seconds": 5}, ValueError, "applies only to coalesce="),
    (
        {"coalesce_key": "k", "coalesce": "replace", "coalesce_max_wait_seconds": 5},
        ValueError,
        "coalesce_max_wait_seconds=5 applies only",
    ),
    ({"coalesce_key": "k", "coalesce": "debounce"}, ValueError, "needs coalesce_seconds"),
    (
        {"coalesce_key": "k", "coalesce": "debounce", "coalesce_seconds": -1},
        ValueError,
        "coalesce_seconds must be a number >= 0, got -1",
    ),
    (
        {"coalesce_key": "k", "coalesce": "debounce", "coalesce_seconds": float("nan")},
        ValueError,
        "coalesce_seconds must be a finite number",
    ),
    (
        {
            "coalesce_key": "k",
            "coalesce": "debounce",
            "coalesce_seconds": 10,
            "coalesce_max_wait_seconds": 5,
        },
        ValueError,
        "coalesce_max_wait_seconds=5 must be at least coalesce_seconds=10",
    ),
    ({"coalesce_key": ""}, ValueError, "coalesce_key must be a non-empty string"),
    ({"coalesce_key": "a\nb"}, ValueError, "coalesce_key must not contain control"),
    ({"coalesce_key": "x" * 256}, ValueError, "coalesce_key must be at most 255"),
    ({"coalesce_key": 7}, TypeError, "coalesce_key must be a str"),
]


@pytest.mark.parametrize(("args", "error", "message"), BAD)
async def test_bad_coalescing_is_one_error_naming_it_and_nothing_is_written(
    store: SQLiteStore, raw: RawDB, args: dict[str, Any], error: type[Exception], message: str
) -> None:
    waiting_row = await add(store, coalesce_key="k", coalesce="replace")
    before = raw.counts()
    with pytest.raises(error, match=message.replace("(", r"\(").replace("?", r"\?")):
        await add(store, **args)
    with pytest.raises(error, match="item 1: "):
        await enqueue_many(
            store, [{"kind": "k", "deliver_to": "x"}, {"kind": "k", "deliver_to": "x", **args}]
        )
    assert raw.counts() == before and raw.row(waiting_row)["status"] == "pending"


# -- concurrency and transactions ---------------------------------------------------


@pytest.mark.postgres_only
@pytest.mark.parametrize("mode", ["replace", "debounce"])
async def test_a_replace_waiting_on_a_claim_of_the_waiting_row_inserts_beside_it(
    store: SQLiteStore, raw: RawDB, db_target: str, mode: str
) -> None:
    # PostgreSQL's one-statement replace finds the waiting row through the
    # unique index and waits for its row lock; a claim holding that lock
    # takes the row out of waiting when it commits, and the replace then
    # inserts its row beside the claimed one instead of superseding it.
    import psycopg

    waiting_row = await add(store, coalesce_key="k", coalesce="replace")
    claim = psycopg.connect(db_target)
    try:
        claim.execute(
            "UPDATE dispatch_outbox SET status = 'delivering', attempt = 1, "
            "next_attempt_at = %s, updated_at = %s WHERE id = %s",
            (T0 + 600, T0 + 0.5, str(waiting_row)),
        )
        found: list[Any] = []

        async def replace() -> None:
            extra: dict[str, Any] = {"coalesce_seconds": 5} if mode == "debounce" else {}
            found.append(await add(store, coalesce_key="k", coalesce=mode, now=T0 + 1, **extra))

        async with anyio.create_task_group() as tg:
            tg.start_soon(replace)
            await anyio.sleep(0.3)
            assert found == []  # waiting for the claim's lock
            await anyio.to_thread.run_sync(claim.commit)
    finally:
        claim.close()
    [new] = found
    assert new.outcome == "inserted" and new != waiting_row
    assert raw.row(waiting_row)["status"] == "delivering"
    assert [r["id"] for r in waiting(raw, "k")] == [new]
    assert [t["reason_code"] for t in raw.transitions(waiting_row)] == ["dispatch.pending.enqueued"]


@pytest.mark.parametrize("mode", ["replace", "keep"])
async def test_twenty_concurrent_producers_leave_exactly_one_waiting_row(
    store: SQLiteStore, raw: RawDB, mode: str
) -> None:
    results: list[Any] = []

    async def produce(n: int) -> None:
        for step in range(5):
            results.append(
                await enqueue_dispatch(
                    store,
                    kind="k",
                    deliver_to="x",
                    body={"n": n, "step": step},
                    coalesce_key="hot",
                    coalesce=mode,  # type: ignore[arg-type]
                )
            )

    async with anyio.create_task_group() as tg:
        for n in range(20):
            tg.start_soon(produce, n)
    [left] = waiting(raw, "hot")
    found = statuses(raw, "hot")
    if mode == "keep":
        assert found == {"pending": 1} and set(results) == {left["id"]}
        assert sorted(r.outcome for r in results) == ["inserted"] + ["kept"] * 99
    else:
        assert found == {"pending": 1, "superseded": 99}
        assert sorted(r.outcome for r in results) == ["inserted"] + ["replaced"] * 99
        # Each superseded row names the row that replaced it, a chain with one end.
        successors = {
            str(t["entity_id"]): metadata(t)["superseded_by"]
            for t in raw.rows(
                "SELECT entity_id, metadata FROM status_transitions "
                "WHERE reason_code = 'dispatch.superseded.coalesced'"
            )
        }
        assert len(successors) == 99 and set(successors.values()) - set(successors) == {left["id"]}


async def test_a_transaction_that_rolls_back_supersedes_nothing(
    store: SQLiteStore, raw: RawDB
) -> None:
    kept = await add(store, coalesce_key="k", coalesce="replace")
    before = raw.counts()
    with pytest.raises(RuntimeError, match="changed my mind"):
        async with store.transaction() as tx:
            new = await enqueue_dispatch(
                tx, kind="k", deliver_to="x", coalesce_key="k", coalesce="replace"
            )
            assert outcome(new) == "replaced"
            raise RuntimeError("changed my mind")
    assert raw.counts() == before and raw.row(kept)["status"] == "pending"


def _connect(engine: str, target: str) -> Any:
    if engine == "sqlite":
        return sqlite3.connect(target)
    import psycopg

    return psycopg.connect(target)


def test_a_callers_transaction_on_its_own_connection_that_rolls_back_supersedes_nothing(
    engine: str, db_target: str, raw: RawDB
) -> None:
    """The driver's default mode; every mode and SQLAlchemy:
    ``test_coalesce_sync.py``."""
    conn = _connect(engine, db_target)
    try:
        outbox.install_schema(conn)
        conn.commit()
        first = outbox.enqueue_dispatch(
            conn, kind="k", deliver_to="x", coalesce_key="k", coalesce="replace", now=T0
        )
        conn.commit()
        before = raw.counts()
        second = outbox.enqueue_dispatch(
            conn, kind="k", deliver_to="x", coalesce_key="k", coalesce="replace", now=T0 + 1
        )
        assert outcome(second) == "replaced"
        conn.rollback()
        assert raw.counts() == before and raw.row(first)["status"] == "pending"
        # A failing enqueue after the supersede (an unknown session) leaves the
        # caller's transaction usable with nothing of it in.
        with pytest.raises(ValueError, match="session_id 'ghost'"):
            outbox.enqueue_many(
                conn,
                [
                    {"kind": "k", "deliver_to": "x", "coalesce_key": "k", "coalesce": "replace"},
                    {"kind": "k", "deliver_to": "x", "session_id": "ghost"},
                ],
            )
        third = outbox.enqueue_dispatch(
            conn, kind="k", deliver_to="x", coalesce_key="k", coalesce="replace", now=T0 + 2
        )
        conn.commit()
        assert raw.row(first)["status"] == "superseded"
        assert [r["id"] for r in waiting(raw, "k")] == [third]
    finally:
        conn.close()


def _produce_in_child(target: str, out: str, mode: str, count: int, start: Any) -> None:
    async def main() -> list[list[str]]:
        async with open_store(target) as db:
            start.wait()
            found = []
            for n in range(count):
                result = await enqueue_dispatch(
                    db,
                    kind="k",
                    deliver_to="x",
                    body={"n": n},
                    coalesce_key="hot",
                    coalesce=mode,  # type: ignore[arg-type]
                )
                found.append([str(result), outcome(result)])
            return found

    Path(out).write_text(json.dumps(anyio.run(main)))


@pytest.mark.slow  # a race between processes (4 started afresh); in the loop, 20 tasks race
@pytest.mark.parametrize("mode", ["replace", "keep"])
async def test_four_processes_enqueueing_one_key_leave_exactly_one_waiting_row(
    db_target: str, raw: RawDB, tmp_path: Path, mode: str
) -> None:
    async with open_store(db_target):
        pass
    ctx = multiprocessing.get_context("spawn")
    start = ctx.Event()
    children = [
        ctx.Process(
            target=_produce_in_child,
            args=(db_target, str(tmp_path / f"out{k}.json"), mode, 25, start),
        )
        for k in range(4)
    ]
    for child in children:
        child.start()
    start.set()
    for child in children:
        await anyio.to_thread.run_sync(child.join, 120)
        assert child.exitcode == 0
    answers = [
        (dispatch_id, outcome)
        for k in range(4)
        for dispatch_id, outcome in json.loads((tmp_path / f"out{k}.json").read_text())
    ]
    outcomes = [outcome for _, outcome in answers]
    [left] = waiting(raw, "hot")
    if mode == "keep":
        assert {dispatch_id for dispatch_id, _ in answers} == {left["id"]}
        assert statuses(raw, "hot") == {"pending": 1}
        assert sorted(outcomes) == ["inserted"] + ["kept"] * 99
    else:
        assert statuses(raw, "hot") == {"pending": 1, "superseded": 99}
        assert sorted(outcomes) == ["inserted"] + ["replaced"] * 99
    superseded = raw.scalar(
        "SELECT COUNT(*) FROM status_transitions "
        "WHERE reason_code = 'dispatch.superseded.coalesced'"
    )
    assert superseded == (99 if mode == "replace" else 0)
