"""The claim's one room (:mod:`trio_dispatch.outbox.claim`), on both engines
and both backends: the claim order is named once and read from the index
that serves it, never sorted; a rule composed into the claim acts at each
of its points, inside the claim's own transaction."""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Iterable, Sequence
from typing import Any

import pytest

from trio_dispatch import enqueue_dispatch
from trio_dispatch.lifecycle import Status
from trio_dispatch.outbox import Claim, claim_due, finish_and_claim_next
from trio_dispatch.outbox.claim import (
    CLAIM_ORDER,
    Bounds,
    ClaimRule,
    ClaimRules,
    DestinationCaps,
    claim_rules,
    statements,
)
from trio_dispatch.outbox.claim.rules import Claiming
from trio_dispatch.store import SQLiteStore
from trio_dispatch.store.base import Conn, Row
from trio_dispatch.store.schema import (
    DESTINATION_INDEX,
    DUE_INDEX,
    HELD_BACK_DESTINATION_INDEX,
    HELD_BACK_INDEX,
)
from trio_dispatch.transports import TransportResult

from ..conftest import RawDB
from .test_capped_scan import fill

pytestmark = pytest.mark.anyio

T0 = 1_000_000.0
COLUMNS = "id, status, deliver_to, next_attempt_at, created_at, ordering_key"


def _plan(raw: RawDB, statement: str, params: Sequence[Any]) -> list[str]:
    """How the engine runs ``statement``: SQLite's query plan lines, or
    PostgreSQL's plan nodes (``type`` or ``type on index``), with sequential
    scans priced out so the plan shows what the indexes can serve."""
    if not str(raw.target).startswith("postgres"):
        conn = sqlite3.connect(raw.target)
        try:
            return [str(row[3]) for row in conn.execute(f"EXPLAIN QUERY PLAN {statement}", params)]
        finally:
            conn.close()
    import psycopg

    from trio_dispatch.store.pg_session import PostgresConn

    with psycopg.connect(str(raw.target)) as pg:
        found = PostgresConn(pg)
        found.execute("ANALYZE dispatch_outbox")
        found.execute("SET LOCAL enable_seqscan = off")
        [row] = found.query(f"EXPLAIN (FORMAT JSON) {statement}", params)
        pg.rollback()
    plan = row["QUERY PLAN"]
    nodes: list[str] = []

    def walk(node: dict[str, Any]) -> None:
        name = node["Node Type"]
        nodes.append(f"{name} on {node['Index Name']}" if "Index Name" in node else name)
        for child in node.get("Plans", ()):
            walk(child)

    walk((json.loads(plan) if isinstance(plan, str) else plan)[0]["Plan"])
    return nodes


async def test_the_claim_order_is_read_from_the_indexes_that_serve_it_never_sorted(
    store: SQLiteStore, raw: RawDB
) -> None:
    for destination in ("a", "b", "c"):
        fill(raw, destination, 300, T0 - 1000, step=1.0)
    # Rows due in the next 25 minutes, as retries are: the due index's range
    # past now holds them, so only the held-back index serves the second lane.
    fill(raw, "later", 300, T0 + 1, step=5.0)
    # Some rows of a negative priority, so the held-back indexes hold rows.
    raw.execute("UPDATE dispatch_outbox SET priority = -3, head_start = -900 WHERE id LIKE '%-1_'")
    postgres = str(raw.target).startswith("postgres")
    assert CLAIM_ORDER.indexes == (
        (DUE_INDEX, "status"),
        (DESTINATION_INDEX, "deliver_to"),
        (HELD_BACK_INDEX, "status"),
        (HELD_BACK_DESTINATION_INDEX, "deliver_to"),
    )
    term = claim_rules().term
    hint = "" if postgres else " INDEXED BY {}"
    # The claim's read of the due indexes, one live status (the common
    # claim): the on-time lane, then the held-back lane.
    lock = " FOR UPDATE SKIP LOCKED" if postgres else ""
    due = _plan(
        raw,
        statements.select_due(Status.PENDING, COLUMNS, lock, term, hint),
        (*CLAIM_ORDER.bound(T0, 10), 10),
    )
    point = CLAIM_ORDER.after_due(T0)
    heads = _plan(
        raw,
        statements.destination_heads("id" if postgres else "rowid", hint),
        CLAIM_ORDER.bound(T0),
    )
    # A destination's range, as a claim that leaves destinations out reads it.
    if postgres:
        from trio_dispatch.store.dialect import POSTGRES

        assert POSTGRES.arrays is not None
        ranges = _plan(
            raw,
            statements.due_of_destinations(POSTGRES.arrays, COLUMNS, term),
            (["a", "b"], [5, 5], *CLAIM_ORDER.bound(T0, *point)),
        )
        for index in (DUE_INDEX, HELD_BACK_INDEX):
            assert f"Index Scan on {index}" in due or f"Index Only Scan on {index}" in due, due
        for index in (DESTINATION_INDEX, HELD_BACK_DESTINATION_INDEX):
            assert any(index in node for node in ranges), ranges
            assert any(index in node for node in heads), heads
        for plan in (due, ranges, heads):
            assert "Sort" not in plan and "Incremental Sort" not in plan, plan
    else:
        ranges = _plan(
            raw,
            statements.due_of_destination(COLUMNS, hint, term),
            (*CLAIM_ORDER.bound(T0, *point, 5, head=("a",)), 5),
        )
        for index in (DUE_INDEX, HELD_BACK_INDEX):
            assert any(f"INDEX {index} " in line for line in due), due
        for index in (DESTINATION_INDEX, HELD_BACK_DESTINATION_INDEX):
            assert any(f"INDEX {index} " in line for line in ranges), ranges
            assert any(f"INDEX {index} " in line for line in heads), heads
        for plan in (due, ranges, heads):
            assert not any("TEMP B-TREE FOR ORDER BY" in line for line in plan), plan


class _Recorder(ClaimRule):
    """A rule of the test's own, at every point of the claim: its term
    refuses kind ``never``; its bounds leave ``paused`` out and give
    ``slow`` room for one; it does not take the row ``untaken`` and does
    not admit kind ``late``; each claim it hears of is written to the
    ``sessions`` table, in the claim's transaction."""

    term = "dispatch_outbox.kind <> 'never'"

    def __init__(self) -> None:
        self.read_in_claim: list[str] = []
        self.ended_attempts: list[tuple[str, float]] = []

    def bounds(self, conn: Conn, at: float) -> Bounds:
        return Bounds(frozenset({"paused"}), lambda destination: 1 if destination == "slow" else 9)

    def take(self, conn: Conn, rows: list[Row], claiming: Claiming) -> list[Row]:
        untaken = conn.query_one("SELECT id FROM dispatch_outbox WHERE kind = 'untaken'")
        assert untaken is not None  # read in the claim's own transaction
        return [row for row in rows if row["id"] != untaken["id"]]

    def admit(self, conn: Conn, rows: list[Row], claiming: Claiming) -> list[Row]:
        late = {r["id"] for r in conn.query("SELECT id FROM dispatch_outbox WHERE kind = 'late'")}
        return [row for row in rows if row["id"] not in late]

    def claimed(self, conn: Conn, claims: Sequence[Claim], claiming: Claiming) -> None:
        for claim in claims:
            conn.execute(
                "INSERT INTO sessions (id, created_at) VALUES (?, ?)",
                (claim.dispatch_id, claiming.at),
            )

    def ended(self, attempts: Iterable[tuple[str, float]]) -> None:
        self.ended_attempts.extend(attempts)


class _Refusing(ClaimRule):
    """A rule that fails once the claims are made."""

    def claimed(self, conn: Conn, claims: Sequence[Claim], claiming: Claiming) -> None:
        raise RuntimeError("refused after the claim")


async def _enqueue(store: SQLiteStore, kind: str, deliver_to: str) -> str:
    return await enqueue_dispatch(store, kind=kind, deliver_to=deliver_to, now=T0)


async def test_a_rule_composed_into_the_claim_acts_at_each_point_in_its_transaction(
    store: SQLiteStore, raw: RawDB
) -> None:
    plain = await _enqueue(store, "k", "d")
    never = await _enqueue(store, "never", "d")
    paused = await _enqueue(store, "k", "paused")
    slow = [await _enqueue(store, "k", "slow") for _ in range(2)]
    untaken = await _enqueue(store, "untaken", "d")
    late = await _enqueue(store, "late", "d")
    # A destination left out makes the claim read through its bounds.
    recorder = _Recorder()
    rules = ClaimRules((*claim_rules().rules, recorder))
    claims, counts = await claim_due(store, now=T0 + 1, limit=10, rules=rules)
    claimed = {claim.dispatch_id for claim in claims}
    assert claimed == {plain, slow[0]}
    # ``untaken`` was never taken (nor counted); ``late`` was taken, not admitted.
    assert counts["attempted"] == 3
    recorded = {row["id"] for row in raw.rows("SELECT id FROM sessions")}
    assert recorded == claimed
    statuses = {
        row["id"]: row["status"] for row in raw.rows("SELECT id, status FROM dispatch_outbox")
    }
    for left in (never, paused, slow[1], untaken, late):
        assert statuses[left] == "pending"
    # The claim and what its rules wrote commit together, or neither does.
    with pytest.raises(RuntimeError, match="refused after the claim"):
        await claim_due(store, now=T0 + 1, limit=10, rules=ClaimRules((_Recorder(), _Refusing())))
    assert {row["id"] for row in raw.rows("SELECT id FROM sessions")} == claimed
    assert raw.scalar("SELECT COUNT(*) FROM dispatch_outbox WHERE status = 'delivering'") == 2
    # An attempt's end reaches the rules before the slot's next claim.
    [first] = [claim for claim in claims if claim.dispatch_id == plain]
    await finish_and_claim_next(
        store,
        first,
        TransportResult(ok=True),
        lease_seconds=30,
        clock=lambda: T0 + 2,
        rules=rules,
    )
    assert recorder.ended_attempts == [(plain, first.lease_until)]


async def test_the_caps_are_a_rule_like_any_other(store: SQLiteStore, raw: RawDB) -> None:
    ids = [await _enqueue(store, "k", "hot") for _ in range(3)]
    caps = DestinationCaps(2)
    first, _ = await claim_due(store, now=T0 + 1, limit=10, rules=claim_rules(caps=caps))
    assert [claim.dispatch_id for claim in first] == ids[:2]
    assert caps.running(T0 + 1) == {"hot": 2}
    again, _ = await claim_due(store, now=T0 + 1, limit=10, rules=claim_rules(caps=caps))
    assert again == []  # at its cap: left out, its rows unread
    ClaimRules((caps,)).ended([(first[0].dispatch_id, first[0].lease_until)])
    third, _ = await claim_due(store, now=T0 + 1, limit=10, rules=claim_rules(caps=caps))
    assert [claim.dispatch_id for claim in third] == ids[2:]
