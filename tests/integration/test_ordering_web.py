"""What the dashboard and /metrics show of ordering keys (docs/ordering.md):
a row's key and the row it waits behind, the list's key column and filter,
the blocked keys' count (bounded) and page, and ``trio_dispatch_blocked_keys``
-- on rows real passes put in those states, on both engines."""

from __future__ import annotations

import re
import time
from typing import Any

import pytest

from trio_dispatch import Delivery, deliver_due_dispatches, enqueue_dispatch
from trio_dispatch.lifecycle import WAITING_AT
from trio_dispatch.outbox import ordering
from trio_dispatch.outbox.reads import bounded_stats
from trio_dispatch.store import SQLiteStore
from trio_dispatch.store.schema import HEADS_INDEX
from trio_dispatch.web import WebApp
from trio_dispatch.worker import DispatchWorker

from ..conftest import RawDB
from .test_web import listed, metrics_of, nothing, serving

pytestmark = pytest.mark.anyio

HOSTILE_KEY = "<b>order</b>-&-1"


async def keyed_rows(db: Any) -> dict[str, str]:
    """``head`` retrying with ``behind`` waiting after it (a hostile key);
    ``dead`` dead-lettered, blocking ``blocked``; an unkeyed row."""
    now = time.time()
    ids = {
        "head": await enqueue_dispatch(
            db, kind="order.created", deliver_to="flaky", ordering_key=HOSTILE_KEY
        ),
        "dead": await enqueue_dispatch(
            db, kind="order.created", deliver_to="gone", ordering_key="order-2", max_attempts=1
        ),
        "unkeyed": await enqueue_dispatch(db, kind="k", deliver_to="later", now=now + 3600),
    }
    ids["behind"] = await enqueue_dispatch(
        db, kind="order.paid", deliver_to="ok", ordering_key=HOSTILE_KEY
    )
    ids["blocked"] = await enqueue_dispatch(
        db, kind="order.paid", deliver_to="ok", ordering_key="order-2"
    )

    async def send(delivery: Delivery) -> bool:
        return delivery.deliver_to == "ok"

    await deliver_due_dispatches(db, transport=send, now=now + 1)
    await deliver_due_dispatches(db, transport=send, now=now + 2)
    return ids


async def test_the_row_page_names_the_key_and_links_the_row_it_waits_behind(
    store: SQLiteStore, raw: RawDB
) -> None:
    ids = await keyed_rows(store)
    assert raw.row(ids["behind"])["next_attempt_at"] == WAITING_AT
    async with serving(WebApp(store)) as client:
        page = (await client.get(f"/dispatches/{ids['behind']}")).text
        head = (await client.get(f"/dispatches/{ids['head']}")).text
        blocked = (await client.get(f"/dispatches/{ids['blocked']}")).text
    assert "&lt;b&gt;order&lt;/b&gt;-&amp;-1" in page and "<b>order" not in page
    assert f'id=behind href="/dispatches/{ids["head"]}"' in page
    assert "<dt>next attempt</dt><dd>waiting</dd>" in page
    assert "1e+15" not in page and "31690" not in page
    assert "id=behind" not in head
    assert f'id=behind href="/dispatches/{ids["dead"]}"' in blocked and "dead_letter" in blocked


async def test_the_row_behind_a_blocked_head_is_waiting_and_not_the_oldest_due(
    store: SQLiteStore, raw: RawDB
) -> None:
    ids = await keyed_rows(store)
    # Promoted when its head died, the claim rule holds it; ten minutes ago.
    assert raw.row(ids["blocked"])["next_attempt_at"] < WAITING_AT
    raw.execute(
        "UPDATE dispatch_outbox SET next_attempt_at = ? WHERE id = ?",
        (time.time() - 600, ids["blocked"]),
    )
    async with serving(WebApp(store)) as client:
        page = (await client.get(f"/dispatches/{ids['blocked']}")).text
        one = (await client.get("/", params={"ordering_key": "order-2"})).text
        metrics = metrics_of((await client.get("/metrics")).text)
        destination = (
            await client.get("/destinations/detail?name=ok", headers={"accept": "application/json"})
        ).json()["destination"]
    assert destination["pending"] == 2  # the blocked row and "behind"; neither is due
    assert destination["oldest_due_age_seconds"] is None
    gauge = metrics["trio_dispatch_oldest_due_seconds"].samples[0].value
    assert "<dt>next attempt</dt><dd>waiting</dd>" in page
    row = next(line for line in one.split("<tr>") if ids["blocked"] in line)
    assert "<td class=when>waiting</td>" in row
    assert gauge == 0  # nothing else is due for a minute (the retrying head's backoff)


async def test_the_list_shows_and_filters_by_ordering_key(store: SQLiteStore, raw: RawDB) -> None:
    ids = await keyed_rows(store)
    async with serving(WebApp(store)) as client:
        home = (await client.get("/")).text
        one = await client.get("/", params={"ordering_key": HOSTILE_KEY})
        none = (await client.get("/", params={"ordering_key": "order-9"})).text
        unkeyed = (await client.get("/", params={"kind": "k"})).text
        bad = await client.get("/", params={"ordering_key": "a\x01b"})
    assert "<th>ordering key</th>" in home and "1e+15" not in home
    row = re.search(rf"<tr><td class=when>.*?/dispatches/{ids['behind']}.*?</tr>", home, re.S)
    assert row is not None and "<td class=when>waiting</td>" in row.group(0)
    assert one.status_code == 200
    assert listed(one.text) == [ids["behind"], ids["head"]]
    assert 'value="&lt;b&gt;order&lt;/b&gt;-&amp;-1"' in one.text  # the filter keeps it, escaped
    assert listed(none) == []
    assert "<th>ordering key</th>" not in unkeyed  # no keyed row listed: no column
    assert bad.status_code == 400 and "ordering_key" in bad.text


async def test_blocked_keys_are_counted_listed_and_measured(store: SQLiteStore, raw: RawDB) -> None:
    ids = await keyed_rows(store)
    async with serving(WebApp(store)) as client:
        home = (await client.get("/")).text
        page = (await client.get("/blocked")).text
        metrics = metrics_of((await client.get("/metrics")).text)
    card = re.search(r'id=blocked-keys><a href="/blocked"><div class=n>([^<]*)</div>', home)
    assert card is not None and card.group(1) == "1"
    table = re.search(r"<table id=blocked>.*?</table>", page, re.S)
    assert table is not None
    assert re.findall(r'href="/dispatches/([0-9a-f]+)"', table.group(0)) == [ids["dead"]]
    assert "order-2" in table.group(0)
    family = metrics["trio_dispatch_blocked_keys"]
    assert family.type == "gauge" and [s.value for s in family.samples] == [1.0]
    async with serving(WebApp(store, ordering="skip")) as client:
        skip_home = (await client.get("/")).text
        skip_page = (await client.get("/blocked")).text
        skip_metrics = metrics_of((await client.get("/metrics")).text)
    assert ">0</div><div class=l>blocked keys" in skip_home
    assert "on_dead_letter is skip" in skip_page and ids["dead"] not in skip_page
    assert [s.value for s in skip_metrics["trio_dispatch_blocked_keys"].samples] == [0.0]


async def test_the_worker_s_policy_decides_what_the_dashboard_counts_as_blocked(
    store: SQLiteStore, raw: RawDB
) -> None:
    await keyed_rows(store)
    worker = DispatchWorker(store, transport=nothing, ordering_on_dead_letter="skip")
    assert WebApp(store, worker=worker).ordering == "skip"
    assert WebApp(store).ordering == "block"


async def test_the_blocked_count_stops_at_its_cap(
    store: SQLiteStore, raw: RawDB, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def fail(delivery: Delivery) -> bool:
        return False

    now = time.time()
    for n in range(4):
        for _ in range(2):
            await enqueue_dispatch(
                store, kind="k", deliver_to="gone", ordering_key=f"key-{n}", max_attempts=1
            )
    for step in range(2):
        await deliver_due_dispatches(store, transport=fail, now=now + 1 + step)
    assert (await bounded_stats(store))["blocked_keys"] == 4
    monkeypatch.setattr("trio_dispatch.outbox.reads.BLOCKED_KEYS_CAP", 3)
    stats = await bounded_stats(store)
    assert stats["blocked_keys"] == 3 and stats["blocked_keys_capped"] is True
    async with serving(WebApp(store)) as client:
        home = (await client.get("/")).text
    assert ">3+</div><div class=l>blocked keys" in home


@pytest.mark.sqlite_only
async def test_the_blocked_count_reads_the_heads_index_not_the_table(
    store: SQLiteStore, raw: RawDB
) -> None:
    await keyed_rows(store)
    statement = ordering.BLOCKED_HEADS.format(key="")
    plan = [
        str(row["detail"]) for row in raw.rows(f"EXPLAIN QUERY PLAN {statement}".replace("?", "50"))
    ]
    assert plan[0] == f"SCAN h USING INDEX {HEADS_INDEX}", plan
    assert not any("TEMP B-TREE" in step for step in plan), plan
