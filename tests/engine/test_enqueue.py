"""Enqueue (docs/usage.md): ids, envelope, dedup, validation, atomicity."""

from __future__ import annotations

import json
import math
import multiprocessing
import re
import time
import uuid
from pathlib import Path
from typing import Any

import anyio
import pytest

from trio_dispatch import (
    SIGNAL_SCHEMA_VERSION,
    enqueue_dispatch,
    enqueue_many,
    get_dispatch,
    open_store,
)
from trio_dispatch.store import SQLiteStore

from ..conftest import RawDB

pytestmark = pytest.mark.anyio

HEX32 = re.compile(r"^[0-9a-f]{32}$")


async def test_ids_are_time_ordered_uuid7_hex_and_token_exists_only_when_ack_required(
    store: SQLiteStore, raw: RawDB
) -> None:
    plain = await enqueue_dispatch(store, kind="k", deliver_to="seat")
    acked = await enqueue_dispatch(store, kind="k", deliver_to="seat", ack_required=True)
    assert HEX32.match(plain) and HEX32.match(acked)
    for value in (plain, acked):
        parsed = uuid.UUID(hex=value)
        assert (parsed.version, parsed.variant) == (7, uuid.RFC_4122)
        stamp_ms = int.from_bytes(parsed.bytes[:6], "big")
        assert abs(stamp_ms / 1000 - time.time()) < 60  # its first 48 bits: Unix ms
    assert plain < acked  # made later, sorts later
    assert raw.row(plain)["ack_token"] is None
    assert raw.row(plain)["ack_required"] == 0
    token = raw.row(acked)["ack_token"]
    assert isinstance(token, str) and HEX32.match(token) and token != acked
    assert token[:12] != acked[:12]  # a secret: random, not a timestamp
    assert raw.row(acked)["ack_required"] == 1
    payload = json.loads(str(raw.row(acked)["payload"]))
    assert payload["ack_token"] == token
    assert uuid.UUID(payload["id"]).version == 7


async def test_ids_enqueued_one_after_another_sort_in_that_order(store: SQLiteStore) -> None:
    ids = [await enqueue_dispatch(store, kind="k", deliver_to="seat") for _ in range(50)]
    results = await enqueue_many(store, [{"kind": "k", "deliver_to": "s"}] * 500)
    ids += [result.id for result in results]
    assert ids == sorted(ids)


@pytest.mark.parametrize("body", [None, {}])
async def test_none_and_empty_body_both_store_an_empty_dict(
    store: SQLiteStore, raw: RawDB, body: dict[str, Any] | None
) -> None:
    dispatch_id = await enqueue_dispatch(store, kind="k", deliver_to="seat", body=body)
    assert json.loads(str(raw.row(dispatch_id)["payload"]))["body"] == {}


async def test_payload_is_the_dispatch_signal_envelope(store: SQLiteStore, raw: RawDB) -> None:
    dispatch_id = await enqueue_dispatch(
        store, kind="terminal_notify", deliver_to="seat-1", body={"n": [1, "x", None]}, now=123.5
    )
    payload = json.loads(str(raw.row(dispatch_id)["payload"]))
    assert list(payload) == [
        "id",
        "created_at",
        "metadata",
        "data",
        "emitter_role",
        "schema_version",
        "dispatch_id",
        "kind",
        "deliver_to",
        "attempt",
        "ack_token",
        "body",
    ]
    assert uuid.UUID(payload["id"]).version == 7 and str(uuid.UUID(payload["id"])) == payload["id"]
    assert isinstance(payload["created_at"], float) and payload["created_at"] > 0
    assert payload["metadata"] == {"lion_class": "trio_dispatch.signal.DispatchSignal"}
    assert payload["data"] is None and payload["emitter_role"] is None
    assert payload["schema_version"] == SIGNAL_SCHEMA_VERSION == 1
    assert payload["dispatch_id"] == dispatch_id
    assert (payload["kind"], payload["deliver_to"], payload["attempt"]) == (
        "terminal_notify",
        "seat-1",
        0,
    )
    assert payload["ack_token"] is None
    assert payload["body"] == {"n": [1, "x", None]}


async def test_enqueue_writes_the_row_and_its_initial_transition(
    store: SQLiteStore, raw: RawDB
) -> None:
    dispatch_id = await enqueue_dispatch(
        store, kind="k", deliver_to="seat", max_attempts=3, expires_at=999.0, now=100.0
    )
    row = raw.row(dispatch_id)
    assert (row["status"], row["attempt"], row["max_attempts"]) == ("pending", 0, 3)
    assert row["next_attempt_at"] == row["created_at"] == 100.0
    assert row["expires_at"] == 999.0 and row["last_error"] is None
    [transition] = raw.transitions(dispatch_id)
    assert {
        k: transition[k]
        for k in (
            "entity_type",
            "entity_id",
            "previous_status",
            "status",
            "reason_code",
            "reason_summary",
            "source",
            "actor",
            "evidence_refs",
            "metadata",
            "created_at",
        )
    } == {
        "entity_type": "dispatch",
        "entity_id": dispatch_id,
        "previous_status": None,
        "status": "pending",
        "reason_code": "dispatch.pending.enqueued",
        "reason_summary": "enqueued kind=k",
        "source": "system",
        "actor": "enqueue_dispatch",
        "evidence_refs": "[]",
        "metadata": "{}",
        "created_at": 100.0,
    }


async def test_dedup_hit_returns_the_first_id_and_writes_nothing(
    store: SQLiteStore, raw: RawDB
) -> None:
    first = await enqueue_dispatch(store, kind="a", deliver_to="seat-1", dedup_key="key")
    before = raw.counts()
    again = await enqueue_dispatch(
        store,
        kind="b",
        deliver_to="seat-2",
        body={"x": 1},
        dedup_key="key",
        ack_required=True,
        max_attempts=2,
    )
    assert again == first
    assert raw.counts() == before == (1, 1)
    row = raw.row(first)  # the first committed row keeps the key's meaning
    assert (row["kind"], row["deliver_to"], row["ack_required"], row["max_attempts"]) == (
        "a",
        "seat-1",
        0,
        8,
    )


async def test_without_a_dedup_key_every_call_creates_a_row(store: SQLiteStore, raw: RawDB) -> None:
    ids = {await enqueue_dispatch(store, kind="k", deliver_to="seat") for _ in range(3)}
    assert len(ids) == 3 and raw.counts() == (3, 3)


async def test_dedup_race_between_tasks_resolves_to_the_winner(
    store: SQLiteStore, raw: RawDB
) -> None:
    got: list[str] = []

    async def producer(i: int) -> None:
        got.append(await enqueue_dispatch(store, kind="k", deliver_to=f"s{i}", dedup_key="same"))

    async with anyio.create_task_group() as tg:
        for i in range(40):
            tg.start_soon(producer, i)
    assert raw.counts() == (1, 1)
    [row] = raw.rows("SELECT id FROM dispatch_outbox")
    assert got == [row["id"]] * 40


def _race_keys(path: str, out: str, keys: list[str], start: Any) -> None:
    async def main() -> list[str]:
        async with open_store(path) as db:
            start.wait()
            return [
                await enqueue_dispatch(db, kind="k", deliver_to="seat", dedup_key=key)
                for key in keys
            ]

    Path(out).write_text(json.dumps(anyio.run(main)))


@pytest.mark.slow
async def test_dedup_race_between_processes_resolves_to_the_winner(
    db_target: str, raw: RawDB, tmp_path: Path
) -> None:
    async with open_store(db_target):
        pass
    keys = [f"key-{i}" for i in range(100)]
    ctx = multiprocessing.get_context("spawn")
    start = ctx.Event()
    children = [
        ctx.Process(
            target=_race_keys,
            args=(db_target, str(tmp_path / f"out{k}.json"), keys if k % 2 else keys[::-1], start),
        )
        for k in range(4)
    ]
    for child in children:
        child.start()
    start.set()
    for child in children:
        await anyio.to_thread.run_sync(child.join, 60)
        assert child.exitcode == 0
    rows = raw.rows("SELECT id, dedup_key FROM dispatch_outbox")
    winners = {r["dedup_key"]: r["id"] for r in rows}
    assert len(winners) == 100 and raw.counts() == (100, 100)
    for k in range(4):
        order = keys if k % 2 else keys[::-1]
        got = json.loads((tmp_path / f"out{k}.json").read_text())
        assert got == [winners[key] for key in order]


class _Unserialisable:
    def __repr__(self) -> str:  # a stable test id (xdist workers must agree)
        return "<unserialisable>"


INVALID: list[tuple[dict[str, Any], type[Exception], str]] = [
    ({"kind": ""}, ValueError, "kind"),
    ({"kind": "   "}, ValueError, "kind"),
    ({"kind": None}, TypeError, "kind"),
    ({"kind": 5}, TypeError, "kind"),
    ({"kind": "a\x00b"}, ValueError, "kind"),
    ({"kind": "\ud800"}, ValueError, "kind"),
    ({"deliver_to": ""}, ValueError, "deliver_to"),
    ({"deliver_to": " \t "}, ValueError, "deliver_to"),
    ({"deliver_to": "seat\x00"}, ValueError, "deliver_to"),
    ({"deliver_to": "seat\n2"}, ValueError, "deliver_to"),
    ({"deliver_to": "seat\x1b[31m"}, ValueError, "deliver_to"),
    ({"deliver_to": b"seat"}, TypeError, "deliver_to"),
    ({"deliver_to": None}, TypeError, "deliver_to"),
    ({"dedup_key": ""}, ValueError, "dedup_key"),
    ({"dedup_key": 7}, TypeError, "dedup_key"),
    ({"max_attempts": 0}, ValueError, "max_attempts"),
    ({"max_attempts": -3}, ValueError, "max_attempts"),
    ({"max_attempts": 2.0}, TypeError, "max_attempts"),
    ({"max_attempts": True}, TypeError, "max_attempts"),
    ({"max_attempts": "8"}, TypeError, "max_attempts"),
    ({"expires_at": math.nan}, ValueError, "expires_at"),
    ({"expires_at": math.inf}, ValueError, "expires_at"),
    ({"expires_at": "tomorrow"}, TypeError, "expires_at"),
    ({"expires_at": True}, TypeError, "expires_at"),
    ({"ack_required": 1}, TypeError, "ack_required"),
    ({"ack_required": "yes"}, TypeError, "ack_required"),
    ({"body": [1, 2]}, TypeError, "body"),
    ({"body": "text"}, TypeError, "body"),
    ({"body": {"x": _Unserialisable()}}, ValueError, "body"),
    ({"body": {"x": math.nan}}, ValueError, "body"),
    ({"body": {"x": "\udcff"}}, ValueError, "body"),
    ({"session_id": ""}, ValueError, "session_id"),
    ({"session_id": 3}, TypeError, "session_id"),
    ({"schedule_run_id": ""}, ValueError, "schedule_run_id"),
]


@pytest.mark.parametrize("bad, error, name", INVALID, ids=[repr(b) for b, _, _ in INVALID])
async def test_invalid_arguments_raise_naming_the_value_and_write_nothing(
    store: SQLiteStore, raw: RawDB, bad: dict[str, Any], error: type[Exception], name: str
) -> None:
    await enqueue_dispatch(store, kind="k", deliver_to="seat", dedup_key="existing")
    before = raw.counts()
    args: dict[str, Any] = {"kind": "k", "deliver_to": "seat", **bad}
    with pytest.raises(error) as caught:
        await enqueue_dispatch(store, **args)
    assert name in str(caught.value)
    assert raw.counts() == before


@pytest.mark.parametrize(
    "column, table", [("session_id", "sessions"), ("schedule_run_id", "schedule_runs")]
)
async def test_unknown_provenance_is_rejected_and_known_is_linked(
    store: SQLiteStore, raw: RawDB, column: str, table: str
) -> None:
    with pytest.raises(ValueError, match=f"{column} 'ghost' does not exist"):
        ghost: dict[str, Any] = {column: "ghost"}
        await enqueue_dispatch(store, kind="k", deliver_to="seat", **ghost)
    assert raw.counts() == (0, 0)
    raw.execute(f"INSERT INTO {table} (id, created_at) VALUES ('real', 0)")
    real: dict[str, Any] = {column: "real"}
    dispatch_id = await enqueue_dispatch(store, kind="k", deliver_to="seat", **real)
    assert raw.row(dispatch_id)[column] == "real"


async def test_row_and_initial_transition_commit_together_or_not_at_all(
    store: SQLiteStore, raw: RawDB
) -> None:
    # A trigger makes the transition insert fail after the row insert ran.
    raw.refuse_transitions("history is full")
    with pytest.raises(raw.error, match="history is full"):
        await enqueue_dispatch(store, kind="k", deliver_to="seat")
    assert raw.counts() == (0, 0)
    raw.allow_transitions()
    await enqueue_dispatch(store, kind="k", deliver_to="seat")
    assert raw.counts() == (1, 1)


async def test_enqueue_many_writes_all_in_one_transaction_with_per_item_results(
    store: SQLiteStore, raw: RawDB
) -> None:
    existing = await enqueue_dispatch(store, kind="k", deliver_to="seat", dedup_key="old")
    batches = store.stats["batches"]
    results = await enqueue_many(
        store,
        [
            {"kind": "k", "deliver_to": "a"},
            {"kind": "k", "deliver_to": "b", "dedup_key": "old"},
            {"kind": "k", "deliver_to": "c", "dedup_key": "new"},
            {"kind": "k", "deliver_to": "d", "dedup_key": "new"},
        ],
    )
    assert store.stats["batches"] == batches + 1
    assert [r.dedup_hit for r in results] == [False, True, False, True]
    assert results[1].id == existing and results[3].id == results[2].id
    assert raw.row(results[0].id)["deliver_to"] == "a"
    assert raw.row(results[2].id)["deliver_to"] == "c"
    assert raw.counts() == (3, 3)
    assert await enqueue_many(store, []) == []


@pytest.mark.parametrize(
    "items, error, message",
    [
        (
            [{"kind": "k", "deliver_to": "a"}, {"kind": "k", "deliver_to": ""}],
            ValueError,
            "item 1: deliver_to",
        ),
        ([{"kind": "k", "deliver_to": "a", "colour": "red"}], TypeError, "item 0: unknown"),
        ([{"kind": "k"}], TypeError, "item 0: missing required argument 'deliver_to'"),
        ([["kind", "k"]], TypeError, "item 0 must be a mapping"),
        ({"kind": "k", "deliver_to": "a"}, TypeError, "iterable of mappings"),
    ],
)
async def test_enqueue_many_rejects_any_bad_item_before_writing(
    store: SQLiteStore, raw: RawDB, items: Any, error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=re.escape(message)):
        await enqueue_many(store, items)
    assert raw.counts() == (0, 0)


BIDI_CONTROLS = [chr(code) for code in (*range(0x202A, 0x202F), *range(0x2066, 0x206A))]
"""LRE, RLE, PDF, LRO, RLO, LRI, RLI, FSI, PDI: they reorder what is read."""


@pytest.mark.parametrize("field", ["kind", "deliver_to"])
async def test_bidirectional_controls_are_refused_in_kind_and_route_naming_the_field(
    store: SQLiteStore, raw: RawDB, field: str
) -> None:
    for char in BIDI_CONTROLS:
        args: dict[str, Any] = {"kind": "k", "deliver_to": "seat", field: f"pay{char}ment"}
        with pytest.raises(ValueError) as caught:
            await enqueue_dispatch(store, **args)
        message = str(caught.value)
        assert message.startswith(f"{field} must not contain bidirectional control")
        assert f"U+{ord(char):04X}" in message
        assert "\n" not in message and char not in message  # one line, shown escaped
        with pytest.raises(ValueError, match=f"item 1: {field} must not contain bidirectional"):
            await enqueue_many(store, [{"kind": "k", "deliver_to": "seat"}, args])
    assert raw.counts() == (0, 0)
    # The same letters without the override pass, as do other non-ASCII ones.
    await enqueue_dispatch(store, kind="paiement.reçu", deliver_to="caisse-東京")
    assert raw.counts() == (1, 1)


async def test_a_dispatch_survives_closing_and_reopening_the_store(db_target: str) -> None:
    async with open_store(db_target) as db:
        dispatch_id = await enqueue_dispatch(db, kind="k", deliver_to="seat", body={"a": 1})
    async with open_store(db_target) as db:
        row = await get_dispatch(db, dispatch_id)
    assert row is not None and row["payload"]["body"] == {"a": 1}


async def test_a_json_serialisable_body_is_stored_as_its_json(
    store: SQLiteStore, raw: RawDB
) -> None:
    body: dict[Any, Any] = {"pair": (1, 2), 3: "int key", "s": "é\u2603"}
    dispatch_id = await enqueue_dispatch(store, kind="k", deliver_to="seat", body=body)
    payload = json.loads(str(raw.row(dispatch_id)["payload"]))
    assert payload["body"] == {"pair": [1, 2], "3": "int key", "s": "é\u2603"}


@pytest.mark.parametrize("body", [None, {}, {"a": [1, {"b": None}], "é": "☃"}])
@pytest.mark.parametrize("ack", [False, True])
async def test_the_stored_envelope_is_exactly_the_dispatch_signal_json(
    store: SQLiteStore, raw: RawDB, body: dict[str, Any] | None, ack: bool
) -> None:
    from trio_dispatch.signal import DispatchSignal

    dispatch_id = await enqueue_dispatch(
        store, kind="k", deliver_to="seat", body=body, ack_required=ack
    )
    text = str(raw.row(dispatch_id)["payload"])
    stored = json.loads(text)
    signal = DispatchSignal(
        id=stored["id"],
        created_at=stored["created_at"],
        dispatch_id=dispatch_id,
        kind="k",
        deliver_to="seat",
        ack_token=raw.row(dispatch_id)["ack_token"],
        body=body or {},
    )
    assert text == json.dumps(signal.to_dict(mode="json"), ensure_ascii=False)
