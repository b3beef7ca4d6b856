"""/metrics, /healthz and the read-only dashboard (docs/dashboard.md), served
by hypercorn on real sockets over real stores, on both anyio backends."""

from __future__ import annotations

import base64
import contextlib
import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from trio_dispatch import (
    Delivery,
    ack_dispatch,
    deliver_due_dispatches,
    enqueue_dispatch,
    enqueue_many,
)
from trio_dispatch.config import ConfigError, parse_config
from trio_dispatch.outbox import claim_due, sql
from trio_dispatch.outbox.reads import AWAITING_ACK, recent_failures
from trio_dispatch.store import SQLiteStore, open_store
from trio_dispatch.store.dialect import POSTGRES, SQLITE
from trio_dispatch.store.schema import SCHEMA_VERSION, statements
from trio_dispatch.web import WebApp, parse_listen, serve_app
from trio_dispatch.worker import DispatchWorker
from trio_dispatch.worker.metrics import DeliveryMetrics

from ..conftest import PostgresRaw, RawDB
from ..helpers import client_tls, run_cli, wait_for

pytestmark = pytest.mark.anyio

TOKEN = "s3cret-token-0123456789"
LOOPBACK = parse_listen("test", "127.0.0.1:0")


async def populate(db: Any, raw: RawDB) -> dict[str, str]:
    """One dispatch in every status (and a hostile kind), by real passes."""
    now = time.time()
    ids = {
        "delivered": await enqueue_dispatch(db, kind="<script>alert(1)</script>", deliver_to="ok"),
        "acked": await enqueue_dispatch(db, kind="order.paid", deliver_to="ok", ack_required=True),
        "dead_letter": await enqueue_dispatch(
            db, kind="order.paid", deliver_to="fail", max_attempts=1, body={"n": 1}
        ),
        "expired": await enqueue_dispatch(
            db, kind="order.paid", deliver_to="ok", expires_at=now + 0.5
        ),
    }

    async def send(delivery: Delivery) -> None:
        if delivery.deliver_to == "fail":
            raise RuntimeError("refused <b>bold</b>")

    await deliver_due_dispatches(db, transport=send, now=now + 1, timeout_seconds=5)
    token = str(raw.row(ids["acked"])["ack_token"])
    assert await ack_dispatch(db, ids["acked"], token)
    ids["delivering"] = await enqueue_dispatch(db, kind="order.paid", deliver_to="ok")
    await claim_due(db, ids=[ids["delivering"]], lease_seconds=600)
    ids["pending"] = await enqueue_dispatch(db, kind="order.paid", deliver_to="later")
    statuses = {str(raw.row(i)["status"]): name for name, i in ids.items()}
    assert set(statuses) == set(ids), statuses
    return ids


@asynccontextmanager
async def serving(app: WebApp) -> AsyncIterator[httpx.AsyncClient]:
    async with anyio.create_task_group() as tg:
        url = await tg.start(serve_app, app, LOOPBACK)
        async with httpx.AsyncClient(base_url=url, timeout=10, verify=client_tls()) as client:
            yield client
        tg.cancel_scope.cancel()


def listed(page: str) -> list[str]:
    """The dispatch ids of the page's dispatch list (not of its other panels)."""
    found = re.search(r"<table id=dispatches>.*?</table>", page, re.S)
    return re.findall(r'href="/dispatches/([0-9a-f]+)"', found.group(0)) if found else []


def rows_by_id(table: str) -> dict[str, str]:
    """A table's rows, each by the dispatch id it links to."""
    found = {}
    for row in re.findall(r"<tr>(.*?)</tr>", table, re.S):
        link = re.search(r'href="/dispatches/([0-9a-f]+)"', row)
        if link is not None:
            found[link.group(1)] = row
    return found


def metrics_of(text: str) -> dict[str, Any]:
    return {family.name: family for family in text_string_to_metric_families(text)}


def samples(family: Any) -> dict[tuple[Any, ...], float]:
    return {
        (sample.name, *sorted(sample.labels.items())): sample.value for sample in family.samples
    }


async def nothing(delivery: Delivery) -> None:
    pass


# -- /metrics ---------------------------------------------------------------------


async def test_metrics_have_the_specified_names_types_and_labels(
    store: SQLiteStore, raw: RawDB
) -> None:
    ids = await populate(store, raw)
    done: list[str] = []

    async def send(delivery: Delivery) -> bool:
        done.append(delivery.dispatch_id)
        return delivery.kind != "flaky"

    await enqueue_dispatch(store, kind="flaky", deliver_to="x")
    async with anyio.create_task_group() as tg:
        worker = DispatchWorker(store, transport=send, tick_seconds=60)
        await tg.start(worker.run)
        # The pending row and the flaky one sent, and their ends committed
        # (the transport's return comes before the write the metrics read).
        await wait_for(lambda: worker.counts["delivered"] + worker.counts["retried"] == 2)
        assert len(done) == 2
        async with serving(WebApp(store, worker=worker)) as client:
            response = await client.get("/metrics")
        tg.cancel_scope.cancel()
    assert response.status_code == 200
    assert response.headers["content-type"] == "text/plain; version=0.0.4; charset=utf-8"
    families = metrics_of(response.text)
    kinds = {
        name: families[name].type
        for name in (
            "trio_dispatch_deliveries",
            "trio_dispatch_delivery_seconds",
            "trio_dispatch_dispatches",
            "trio_dispatch_oldest_due_seconds",
            "trio_dispatch_in_flight",
            "trio_dispatch_held_ahead",
            "trio_dispatch_held_starts",
            "trio_dispatch_scan_errors",
            "trio_dispatch_lease_recoveries",
            "trio_dispatch_throttled",
            "trio_dispatch_breaker_transitions",
        )
    }
    assert kinds == {
        "trio_dispatch_deliveries": "counter",
        "trio_dispatch_delivery_seconds": "histogram",
        "trio_dispatch_dispatches": "gauge",
        "trio_dispatch_oldest_due_seconds": "gauge",
        "trio_dispatch_in_flight": "gauge",
        "trio_dispatch_held_ahead": "gauge",
        "trio_dispatch_held_starts": "gauge",
        "trio_dispatch_scan_errors": "counter",
        "trio_dispatch_lease_recoveries": "counter",
        "trio_dispatch_throttled": "counter",
        "trio_dispatch_breaker_transitions": "counter",
    }
    by_status = {
        sample.labels["status"]: sample.value
        for sample in families["trio_dispatch_dispatches"].samples
    }
    assert by_status == {
        "pending": 1.0,  # the flaky one, retrying later
        "delivering": 1.0,  # claimed for 600 s by populate()
        "delivered": 2.0,  # the hostile kind, and the pending row the worker sent
        "acked": 1.0,
        "dead_letter": 1.0,
        "expired": 1.0,
        "superseded": 0.0,  # every status is listed, these two (docs/controls.md) at 0
        "cancelled": 0.0,
    }
    deliveries = samples(families["trio_dispatch_deliveries"])
    assert (
        deliveries[
            ("trio_dispatch_deliveries_total", ("kind", "order.paid"), ("outcome", "delivered"))
        ]
        == 1
    )
    assert (
        deliveries[("trio_dispatch_deliveries_total", ("kind", "flaky"), ("outcome", "retry"))] == 1
    )
    durations = samples(families["trio_dispatch_delivery_seconds"])
    assert durations[("trio_dispatch_delivery_seconds_count", ("kind", "flaky"))] == 1
    assert (
        durations[("trio_dispatch_delivery_seconds_bucket", ("kind", "flaky"), ("le", "+Inf"))] == 1
    )
    assert samples(families["trio_dispatch_in_flight"]) == {("trio_dispatch_in_flight",): 0.0}
    assert samples(families["trio_dispatch_held_ahead"]) == {("trio_dispatch_held_ahead",): 0.0}
    assert samples(families["trio_dispatch_held_starts"]) == {("trio_dispatch_held_starts",): 0.0}
    assert ids  # every status was made for real


async def test_kind_labels_are_bounded_and_go_to_the_most_frequent_recent_kinds(
    store: SQLiteStore,
) -> None:
    for i in range(3):
        await enqueue_dispatch(store, kind="busy.kind", deliver_to=f"d{i}")
    await enqueue_dispatch(store, kind="rare.kind", deliver_to="d")
    metrics = DeliveryMetrics(max_kinds=1)
    worker = DispatchWorker(store, transport=nothing)
    worker.metrics = metrics
    await WebApp(store, worker=worker).prepare()  # labels the store's most frequent kind first
    for kind in ("rare.kind", "busy.kind", "new.kind", "other"):
        metrics.observe(kind, "delivered", 0.01)
    labels = [series.kind for series in metrics.series()]
    assert labels == ["busy.kind", "other"]
    other = metrics.series()[-1]
    assert other.outcomes == {"delivered": 3} and other.count == 3
    big = DeliveryMetrics()
    for i in range(120):
        big.observe(f"kind-{i}", "retry", 0.2)
    assert len(big.series()) == 51  # 50 kinds and "other"
    assert big.series()[-1].outcomes == {"retry": 70}


# -- /healthz ----------------------------------------------------------------------


async def test_health_is_ok_while_the_claim_loop_scans_and_503_when_it_cannot(
    engine: str, db_target: str, raw: RawDB
) -> None:
    async with open_store(db_target, busy_timeout=0.1) as db, anyio.create_task_group() as tg:
        worker = DispatchWorker(db, transport=nothing, tick_seconds=0.3)
        await tg.start(worker.run)
        async with serving(WebApp(db, worker=worker)) as client:
            ok = await health_once(client, 200)
            assert ok.json()["status"] == "ok" and ok.json()["store"] == "ok"
            assert 0 <= ok.json()["last_scan_age_seconds"] <= 0.6  # rounded to ms
            with hold_write_lock(engine, raw):  # every scan now fails on the lock
                failing = await health_once(client, 503)
                # (a loaded machine may answer 503 before the first failed
                # scan has given up on the lock)
                await wait_for(lambda: worker.statistics().scan_errors > 0)
            document = failing.json()
            assert document["status"] == "unhealthy" and document["store"] == "ok"
            assert "no completed scan" in document["reason"]
            assert "more than two ticks, 0.6s" in document["reason"]
            await health_once(client, 200)  # scans succeed again
        tg.cancel_scope.cancel()


async def health_once(
    client: httpx.AsyncClient, status: int, timeout: float = 15
) -> httpx.Response:
    """Ask ``/healthz`` until it answers ``status`` (a loaded machine may
    need a few ticks), and return that answer."""
    with anyio.fail_after(timeout):
        while True:
            answer = await client.get("/healthz")
            if answer.status_code == status:
                return answer
            await anyio.sleep(0.05)


@contextmanager
def hold_write_lock(engine: str, raw: RawDB) -> Iterator[None]:
    """Another connection holds the lock a claim needs, for the block."""
    if engine == "sqlite":
        import sqlite3

        conn = sqlite3.connect(raw.target, isolation_level=None)
        conn.execute("BEGIN IMMEDIATE")
        try:
            yield
        finally:
            conn.execute("ROLLBACK")
            conn.close()
        return
    import psycopg

    with psycopg.connect(raw.target) as locker:
        locker.execute("LOCK TABLE dispatch_outbox IN EXCLUSIVE MODE")  # reads still pass
        yield
        locker.rollback()


@pytest.mark.slow
async def test_health_is_503_when_the_store_does_not_answer(
    engine: str, db_target: str, raw: RawDB
) -> None:
    db_cm = open_store(db_target)
    db = await db_cm.__aenter__()
    try:
        app = WebApp(db)
        async with serving(app) as client:
            assert (await client.get("/healthz")).json() == {"status": "ok", "store": "ok"}
            if engine == "postgres":
                import psycopg

                with psycopg.connect(raw.target) as locker:  # reads wait behind this lock
                    locker.execute("LOCK TABLE dispatch_outbox IN ACCESS EXCLUSIVE MODE")
                    started = time.monotonic()
                    response = await client.get("/healthz")
                    assert 1.9 < time.monotonic() - started < 5
                    locker.rollback()
                assert response.json()["reason"] == "store: no answer within 2s"
            else:
                await db_cm.__aexit__(None, None, None)  # the store is gone
                response = await client.get("/healthz")
                assert "store: " in response.json()["reason"]
            assert response.status_code == 503
            assert response.json()["status"] == "unhealthy"
    finally:
        if engine == "postgres":
            await db_cm.__aexit__(None, None, None)


# -- the dashboard ---------------------------------------------------------------------


async def test_the_dashboard_lists_filters_pages_and_shows_a_dispatch_escaped(
    store: SQLiteStore, raw: RawDB
) -> None:
    ids = await populate(store, raw)
    # One call: the 55 rows share one created_at, so paging must break ties by id.
    await enqueue_many(store, [{"kind": "bulk", "deliver_to": f"seat-{i}"} for i in range(55)])
    async with serving(WebApp(store)) as client:
        home = await client.get("/")
        assert home.status_code == 200 and home.headers["content-type"].startswith("text/html")
        hostile = await client.get("/", params={"status": "delivered"})
        assert "<script>alert(1)</script>" not in hostile.text  # shown as text, never as markup
        assert "&lt;script&gt;alert(1)&lt;/script&gt;" in hostile.text
        assert "<script" not in hostile.text.lower() and "<script" not in home.text.lower()
        assert home.headers["content-security-policy"].startswith("default-src 'none'")
        first = listed(home.text)
        assert len(first) == 50  # one page, newest first
        older = re.search(r'id=older href="([^"]+)"', home.text)
        assert older is not None
        second = await client.get(older.group(1).replace("&amp;", "&"))
        rest = listed(second.text)
        assert len(rest) == 61 - 50 and not set(rest) & set(first)
        dead = await client.get("/", params={"status": "dead_letter"})
        assert listed(dead.text) == [ids["dead_letter"]]
        by_kind = await client.get("/", params={"kind": "order.paid"})
        assert len(listed(by_kind.text)) == 5
        page = await client.get(f"/dispatches/{ids['acked']}")
        token = str(raw.row(ids["acked"])["ack_token"])
        assert page.status_code == 200 and token not in page.text
        assert "dispatch.acked.consumer" in page.text and "***" in page.text
        failed = await client.get(f"/dispatches/{ids['dead_letter']}")
        assert "refused &lt;b&gt;bold&lt;/b&gt;" in failed.text
        assert (await client.get("/dispatches/no-such-id")).status_code == 404
        assert (await client.post("/")).status_code == 405
        # HEAD answers the GET's headers; relative times ("59 s ago") may
        # change the length between two requests, so one of the GETs around it.
        before = await client.get("/", params={"status": "dead_letter"})
        head = await client.head("/", params={"status": "dead_letter"})
        after = await client.get("/", params={"status": "dead_letter"})
        assert head.status_code == 200
        assert head.headers["content-length"] in (
            before.headers["content-length"],
            after.headers["content-length"],
        )


async def test_the_index_shows_recent_failures_newest_first_and_rows_awaiting_an_ack(
    store: SQLiteStore, raw: RawDB
) -> None:
    retried = await enqueue_dispatch(store, kind="k", deliver_to="flaky", max_attempts=3)
    dead = await enqueue_dispatch(store, kind="k", deliver_to="gone-seat", max_attempts=1)
    waiting = await enqueue_dispatch(store, kind="k", deliver_to="ok", ack_required=True)
    fine = await enqueue_dispatch(store, kind="k", deliver_to="ok")
    now = time.time()

    async def send(delivery: Delivery) -> None:
        if delivery.deliver_to != "ok":
            raise RuntimeError(f"refused by {delivery.deliver_to} <i>now</i>")

    await deliver_due_dispatches(store, transport=send, now=now, timeout_seconds=5)
    assert str(raw.row(retried)["status"]) == "pending"
    assert str(raw.row(waiting)["status"]) == "pending"
    async with serving(WebApp(store)) as client:
        home = (await client.get("/")).text
        panel = re.search(r"<table id=failures>.*?</table>", home, re.S)
        assert panel is not None
        failed = re.findall(r'href="/dispatches/([0-9a-f]+)"', panel.group(0))
        assert sorted(failed) == sorted([retried, dead]) and fine not in failed
        by_id = rows_by_id(panel.group(0))
        assert 'class="badge retry">retry<' in by_id[retried]
        assert 'title="flaky"' in by_id[retried]
        assert "refused by flaky &lt;i&gt;now&lt;/i&gt;" in by_id[retried]
        assert 'class="badge dead_letter">dead_letter<' in by_id[dead]
        # The time as the CLI prints it: UTC ISO 8601, then the age.
        assert re.search(
            r"\d{4}-\d\d-\d\dT(<wbr>)?\d\d:\d\d:\d\dZ</span> <span class=\"muted rel\">\(",
            by_id[dead],
        )
        # A row whose send succeeded and that waits for its ack says so, in
        # the list and on its page; a plain pending row does not.
        listing = re.search(r"<table id=dispatches>.*?</table>", home, re.S)
        assert listing is not None
        lines = rows_by_id(listing.group(0))
        assert f'class="badge awaiting_ack">{AWAITING_ACK}<' in lines[waiting]
        assert AWAITING_ACK not in lines[retried] and 'badge pending">pending<' in lines[retried]
        page = (await client.get(f"/dispatches/{waiting}")).text
        assert f'class="badge awaiting_ack">{AWAITING_ACK}<' in page
        assert AWAITING_ACK not in (await client.get(f"/dispatches/{retried}")).text
    # Another failure goes on top of the panel.
    await deliver_due_dispatches(store, transport=send, now=now + 3600, timeout_seconds=5)
    async with serving(WebApp(store)) as client:
        home = (await client.get("/")).text
    panel = re.search(r"<table id=failures>.*?</table>", home, re.S)
    assert panel is not None
    assert re.findall(r'href="/dispatches/([0-9a-f]+)"', panel.group(0))[0] == retried


async def test_recent_failures_read_the_failures_index_newest_first(
    store: SQLiteStore, raw: RawDB, engine: str
) -> None:
    now = time.time()
    ids = [
        await enqueue_dispatch(store, kind="k", deliver_to=f"seat-{i}", max_attempts=2)
        for i in range(3)
    ]

    async def send(delivery: Delivery) -> None:
        if delivery.deliver_to != "ok":
            raise RuntimeError(f"no {delivery.deliver_to}")

    async def one_at_a_time(at: float) -> None:  # oldest due first: a known history order
        for _ in ids:
            await deliver_due_dispatches(
                store, transport=send, now=at, batch_size=1, timeout_seconds=5
            )

    await one_at_a_time(now)
    # Successes in between: the history holds far more than failures.
    await enqueue_many(store, [{"kind": "k", "deliver_to": "ok"} for _ in range(40)])
    await deliver_due_dispatches(store, transport=send, now=now + 1, timeout_seconds=5)
    assert raw.scalar("SELECT COUNT(*) FROM dispatch_outbox WHERE status = 'delivered'") == 40
    await one_at_a_time(now + 3600)
    found = await recent_failures(store, limit=4)
    assert [(f["id"], f["status"]) for f in found] == [
        (ids[2], "dead_letter"),
        (ids[1], "dead_letter"),
        (ids[0], "dead_letter"),
        (ids[2], "pending"),
    ]
    assert found[0]["deliver_to"] == "seat-2" and "no seat-2" in found[0]["reason_summary"]
    assert found[3]["reason_code"] == "dispatch.pending.retry_backoff"
    assert len(await recent_failures(store)) == 6
    # The newest few come from the partial index of failures, read
    # backwards: never a scan of the whole history.
    if engine == "sqlite":
        plan = " ".join(
            r["detail"] for r in raw.rows("EXPLAIN QUERY PLAN " + sql.RECENT_FAILURES, (10,))
        )
        assert "USING INDEX ix_status_transitions_failures" in plan, plan
    else:
        with raw._connect() as conn:  # type: ignore[attr-defined]
            conn.execute("SET enable_seqscan = off")  # a few rows: it would read them all
            plan = " ".join(
                r[0]
                for r in conn.execute("EXPLAIN " + sql.RECENT_FAILURES.replace("?", "%s"), (10,))
            )
        # "Bitmap Index Scan on ix_..." or "Index Scan Backward using ix_..."
        # (tables emptied by DELETE keep their statistics): the index either way.
        assert re.search(r"Index Scan.* (on|using) ix_status_transitions_failures", plan), plan
        assert "Seq Scan on status_transitions" not in plan, plan


async def test_a_version_2_store_gains_the_failures_index_and_keeps_its_history(
    engine: str, fresh_target: str, db_path: Path
) -> None:
    raw = RawDB(db_path) if engine == "sqlite" else PostgresRaw(fresh_target)
    dialect = SQLITE if engine == "sqlite" else POSTGRES
    for statement in statements(1, 2):
        raw.execute(dialect.ddl(statement))
    raw.execute(
        "CREATE TABLE trio_dispatch_schema (version INTEGER NOT NULL, applied_at FLOAT NOT NULL)"
    )
    raw.execute("INSERT INTO trio_dispatch_schema VALUES (1, 0), (2, 0)")
    raw.execute(
        "INSERT INTO status_transitions (entity_type, entity_id, previous_status, status, "
        "reason_code, reason_summary, source, actor, created_at) VALUES "
        "('dispatch', 'old1', 'delivering', 'dead_letter', 'dispatch.dead_letter.gone', "
        "'attempt 1: gone', 'scheduler', 'x', 1), "
        "('dispatch', 'old1', 'dead_letter', 'pending', 'dispatch.pending.operator_retry', "
        "'retried', 'operator', 'x', 2)"
    )
    async with open_store(fresh_target) as db:
        found = await recent_failures(db)
    assert [(f["id"], f["reason_code"], f["deliver_to"]) for f in found] == [
        ("old1", "dispatch.dead_letter.gone", None)
    ]
    versions = raw.rows("SELECT version FROM trio_dispatch_schema ORDER BY version")
    assert [r["version"] for r in versions] == list(range(1, SCHEMA_VERSION + 1))
    index = (
        "SELECT sql AS d FROM sqlite_master WHERE name = 'ix_status_transitions_failures'"
        if engine == "sqlite"
        else "SELECT indexdef AS d FROM pg_indexes "
        "WHERE indexname = 'ix_status_transitions_failures'"
    )
    definition = str(raw.scalar(index))
    assert "dispatch.pending.retry_backoff" in definition
    assert "dispatch.pending.operator_retry" not in definition


async def test_auto_refresh_is_a_meta_refresh_within_bounds_and_a_bad_value_is_a_400(
    store: SQLiteStore,
) -> None:
    await enqueue_dispatch(store, kind="k", deliver_to="x")
    async with serving(WebApp(store)) as client:
        plain = await client.get("/", params={"status": "pending"})
        assert "http-equiv=refresh" not in plain.text
        toggle = re.search(r'<a href="([^"]*refresh=10[^"]*)">10s</a>', plain.text)
        assert toggle is not None  # a link turns it on, keeping the filter
        on = await client.get(toggle.group(1).replace("&amp;", "&"))
        assert on.status_code == 200
        assert '<meta http-equiv=refresh content="10">' in on.text
        assert "auto-refresh every 10s" in on.text
        assert '<input type=hidden name=refresh value="10">' in on.text
        stop = re.search(r'<a href="([^"]*)">stop</a>', on.text)
        assert stop is not None and stop.group(1) == "/?status=pending"
        for bounds in ("2", "3600"):
            assert (await client.get("/", params={"refresh": bounds})).status_code == 200
        for bad in ("1", "3601", "abc", "-5", "10.5", "99999999999"):
            refused = await client.get("/", params={"refresh": bad})
            assert refused.status_code == 400, bad
            assert refused.text == (
                f"refresh must be a whole number of seconds from 2 to 3600, got {bad!r}\n"
            )
        # No page runs script, refreshing or not: the policy forbids it.
        policy = on.headers["content-security-policy"]
        assert policy.startswith("default-src 'none'") and "script-src" not in policy
        assert "<script" not in on.text.lower()


async def test_with_a_token_every_request_must_carry_it(store: SQLiteStore) -> None:
    async with serving(WebApp(store, token=TOKEN)) as client:
        for path in ("/", "/metrics", "/healthz", "/dispatches/x"):
            refused = await client.get(path)
            assert refused.status_code == 401, path
            assert 'Basic realm="trio-dispatch"' in refused.headers.get_list("www-authenticate")[0]
        wrong = await client.get("/healthz", headers={"Authorization": "Bearer " + TOKEN[:-1]})
        assert wrong.status_code == 401
        bearer = await client.get("/healthz", headers={"Authorization": f"Bearer {TOKEN}"})
        assert bearer.status_code == 200
        basic = base64.b64encode(f"anyone:{TOKEN}".encode()).decode()
        browser = await client.get("/", headers={"Authorization": f"Basic {basic}"})
        assert browser.status_code == 200


def port_of(client: httpx.AsyncClient) -> int:
    port = client.base_url.port
    assert port is not None
    return port


async def test_a_request_for_another_host_reads_nothing_on_any_route(
    store: SQLiteStore, raw: RawDB, caplog: pytest.LogCaptureFixture
) -> None:
    """DNS rebinding: a page whose name resolves to this machine sends its
    own name as Host; with the loopback default and no token it must not
    read a page, a payload, the metrics or the health."""
    ids = await populate(store, raw)
    routes = [
        "/",
        "/metrics",
        "/healthz",
        "/blocked",
        "/schedules",
        f"/dispatches/{ids['dead_letter']}",
    ]
    async with serving(WebApp(store)) as client:
        port = port_of(client)
        for path in routes:
            for host in (
                f"attacker.example:{port}",
                "attacker.example",
                f"127.0.0.1.nip.io:{port}",
            ):
                refused = await client.get(path, headers={"host": host})
                assert refused.status_code == 400, (path, host)
                assert refused.text == (
                    f"Host {host!r} is not a name this dashboard answers to: "
                    "add it to http.allowed_hosts if it should be\n"
                )
                assert refused.headers["connection"] == "close"
        assert (await client.post("/", headers={"host": "attacker.example"})).status_code == 400
        # The listener's own names on its port answer, as a scraper sends them.
        for host in (
            f"127.0.0.1:{port}",
            f"localhost:{port}",
            f"[::1]:{port}",
            f"LocalHost:{port}",
        ):
            for path in routes:
                answer = await client.get(path, headers={"host": host})
                assert answer.status_code == 200, (path, host)
        # Another port is another origin.
        assert (await client.get("/", headers={"host": "127.0.0.1"})).status_code == 400
        assert (await client.get("/", headers={"host": f"localhost:{port + 1}"})).status_code == 400
        # An HTTP/1.0 request may leave Host out; it is refused too.
        with anyio.fail_after(10):
            async with await anyio.connect_tcp("127.0.0.1", port) as stream:
                await stream.send(b"GET /metrics HTTP/1.0\r\n\r\n")
                received = b""
                with contextlib.suppress(anyio.EndOfStream):
                    while True:
                        received += await stream.receive()
        head, _, body = received.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 400 ") or head.startswith(b"HTTP/1.0 400 "), head
        assert (
            body
            == b"the request has no Host header: this dashboard answers only to its own names\n"
        )
    # Refusals are logged at most once a minute, naming the host and what is allowed.
    lines = [
        r.getMessage() for r in caplog.records if "refused a request for host" in r.getMessage()
    ]
    assert lines == [
        f"http: refused a request for host 'attacker.example:{port}' from 127.0.0.1 (answers to "
        f"localhost:{port}, 127.0.0.1:{port}, [::1]:{port}; http.allowed_hosts), 1 so far"
    ]


async def test_allowed_hosts_replace_the_listeners_names(store: SQLiteStore) -> None:
    app = WebApp(store, allowed_hosts=["Dash.Example.com", "10.0.0.5:9464", "[::1]"])
    async with serving(app) as client:
        port = port_of(client)
        for host in (
            "dash.example.com",
            f"dash.example.com:{port}",
            "10.0.0.5:9464",
            f"[::1]:{port}",
        ):
            assert (await client.get("/metrics", headers={"host": host})).status_code == 200, host
        for host in (f"127.0.0.1:{port}", f"localhost:{port}", "10.0.0.5:80", "evil.example"):
            assert (await client.get("/metrics", headers={"host": host})).status_code == 400, host
    with pytest.raises(ValueError, match=re.escape("allowed_hosts: '*' is not a host name")):
        WebApp(store, allowed_hosts=["*"])


async def test_a_wildcard_listener_answers_to_ip_addresses_and_localhost_not_to_names(
    store: SQLiteStore,
) -> None:
    bearer = {"authorization": f"Bearer {TOKEN}"}
    async with anyio.create_task_group() as tg:
        url = await tg.start(serve_app, WebApp(store, token=TOKEN), parse_listen("t", "0.0.0.0:0"))
        port = int(url.rsplit(":", 1)[1])
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=10) as client:
            for host in (f"10.9.8.7:{port}", f"[2001:db8::7]:{port}", f"localhost:{port}"):
                answer = await client.get("/healthz", headers={**bearer, "host": host})
                assert answer.status_code == 200, host
            for host in (f"dash.example.com:{port}", "10.9.8.7:80"):
                answer = await client.get("/healthz", headers={**bearer, "host": host})
                assert answer.status_code == 400, host  # the token does not change that
        tg.cancel_scope.cancel()


def test_http_allowed_hosts_is_a_list_of_hosts_checked_at_load() -> None:
    assert parse_config(None).http.allowed_hosts is None
    config = parse_config(
        {"http": {"allowed_hosts": ["Dash.Example.com", "10.0.0.5:9464", "[0::1]"]}}
    )
    assert config.http.allowed_hosts == ("dash.example.com", "10.0.0.5:9464", "[::1]")
    for bad, message in (
        (
            "dash.example.com",
            "http.allowed_hosts must be a non-empty list of host names or "
            "HOST:PORT (e.g. [dash.example.com, 10.0.0.5:9464]), got 'dash.example.com'",
        ),
        ([], "http.allowed_hosts must be a non-empty list of host names or HOST:PORT"),
        (
            ["ok.example", "http://dash.example.com/"],
            "http.allowed_hosts: 'http://dash.example.com/' is not a host name or HOST:PORT",
        ),
        (["dash.example.com:99999"], "'dash.example.com:99999' is not a host name"),
        (["*"], "http.allowed_hosts: '*' is not a host name or HOST:PORT"),
        ([9464], "http.allowed_hosts: 9464 is not a host name or HOST:PORT"),
    ):
        with pytest.raises(ConfigError) as info:
            parse_config({"http": {"allowed_hosts": bad}})
        assert message in str(info.value) and "\n" not in str(info.value), bad


def test_listening_beyond_loopback_needs_a_token() -> None:
    with pytest.raises(ConfigError) as info:
        parse_config({"http": {"listen": "0.0.0.0:9464"}})
    assert "http.listen 0.0.0.0:9464 is reachable from other machines: set http.token" in str(
        info.value
    )
    config = parse_config({"http": {"listen": "0.0.0.0:9464", "token": TOKEN}})
    assert config.http.token == TOKEN and str(config.http.listen) == "0.0.0.0:9464"
    assert parse_config({"http": {"listen": 9464}}).http.listen == parse_listen(
        "x", "127.0.0.1:9464"
    )
    for bad, message in (
        ({"listen": "nowhere"}, "http.listen must be HOST:PORT"),
        ({"listen": "127.0.0.1:70000"}, "port 70000 is out of range"),
        ({"token": "short"}, "http.token (***) must be at least 16 printable characters"),
        ({"token": "env:NO_SUCH_TOKEN_VAR"}, "environment variable 'NO_SUCH_TOKEN_VAR' is not set"),
    ):
        with pytest.raises(ConfigError, match=re.escape(message)):
            parse_config({"http": bad})


def test_the_worker_refuses_a_public_address_without_a_token(tmp_path: Path) -> None:
    db = tmp_path / "o.db"
    ran = run_cli("--db", str(db), "worker", "--http", "0.0.0.0:0")
    assert ran.returncode == 2 and ran.stdout == ""
    assert ran.stderr.strip() == (
        "trio-dispatch: --http 0.0.0.0:0 is reachable from other machines: set http.token "
        "(or env:NAME) to require a bearer token, or listen on 127.0.0.1"
    )
    assert not db.exists()


# -- the commands, as real processes ---------------------------------------------------


@contextmanager
def running(
    args: list[str],
    tmp_path: Path,
    pattern: str,
    preexec_fn: Callable[[], None] | None = None,
) -> Iterator[tuple[str, subprocess.Popen[str]]]:
    """A real ``trio-dispatch`` process; yields the URL its log announces.
    ``preexec_fn`` runs in the child before it starts (e.g. to lower a limit)."""
    env = {k: v for k, v in os.environ.items() if k != "TRIO_DISPATCH_CONFIG"}
    with subprocess.Popen(
        [sys.executable, "-m", "trio_dispatch", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=tmp_path,
        preexec_fn=preexec_fn,
    ) as process:
        try:
            assert process.stderr is not None
            deadline = time.monotonic() + 30
            url = None
            while url is None and time.monotonic() < deadline:
                line = process.stderr.readline()
                if not line:
                    break
                found = re.search(pattern, line)
                url = found.group(1) if found else None
            assert url is not None, f"no URL announced (exit {process.poll()})"
            yield url, process
        finally:
            process.send_signal(signal.SIGINT)
            try:
                process.wait(timeout=20)
            finally:
                process.kill()


def test_the_worker_and_the_web_command_answer_only_to_the_configured_hosts(
    tmp_path: Path,
) -> None:
    config = tmp_path / "c.yaml"
    config.write_text(
        json.dumps(
            {
                "store": "o.db",
                "dispatch": {"notify_template": ["true"]},
                "http": {"allowed_hosts": ["dash.example.com"]},
            }
        )
    )
    commands = (
        (
            ["worker", "--http", "127.0.0.1:0"],
            r"http: metrics, health and dashboard at (http://\S+)/",
        ),
        (["web", "--listen", "127.0.0.1:0"], r"dashboard \(read-only\) at (http://\S+)/"),
    )
    for command, pattern in commands:
        with running(["--config", str(config), *command], tmp_path, pattern) as (url, _):
            named = httpx.get(url + "/healthz", headers={"host": "dash.example.com"}, timeout=10)
            assert named.status_code == 200, command
            own = httpx.get(url + "/metrics", timeout=10)  # the listener's address: not listed
            assert own.status_code == 400, command
            assert "add it to http.allowed_hosts" in own.text


def test_the_worker_serves_metrics_and_health_next_to_its_deliveries(tmp_path: Path) -> None:
    config = tmp_path / "c.yaml"
    config.write_text(json.dumps({"store": "o.db", "dispatch": {"notify_template": ["true"]}}))
    args = ["--config", str(config), "worker", "--http", "127.0.0.1:0"]
    with running(args, tmp_path, r"http: metrics, health and dashboard at (http://\S+)/") as (
        url,
        _,
    ):
        health = httpx.get(url + "/healthz", timeout=10)
        assert health.status_code == 200 and health.json()["status"] == "ok"
        families = metrics_of(httpx.get(url + "/metrics", timeout=10).text)
        assert "trio_dispatch_deliveries" in families and "trio_dispatch_in_flight" in families


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.mark.slow
def test_the_web_command_serves_a_store_without_writing_to_it(
    tmp_path: Path, anyio_backend: str
) -> None:
    db = tmp_path / "o.db"

    async def fill() -> None:
        async with open_store(str(db)) as store:
            await populate(store, RawDB(db))

    anyio.run(fill, backend=anyio_backend)
    before = _digest(db)
    args = ["--db", str(db), "web", "--listen", "127.0.0.1:0"]
    with running(args, tmp_path, r"dashboard \(read-only\) at (http://\S+)/") as (url, _):
        assert httpx.get(url + "/", timeout=10).status_code == 200
        assert httpx.get(url + "/metrics", timeout=10).status_code == 200
        assert httpx.get(url + "/healthz", timeout=10).json() == {"status": "ok", "store": "ok"}
    assert _digest(db) == before
    # A WAL reader may leave the shared-memory index behind; nothing was written.
    wal = tmp_path / "o.db-wal"
    assert not wal.exists() or wal.stat().st_size == 0


# -- in a real browser ----------------------------------------------------------------


CHROMIUM, CHROMEDRIVER = Path("/usr/bin/chromium"), Path("/usr/bin/chromedriver")


def browser(tmp_path: Path, *, width: int = 1280, height: int = 900) -> Any:
    if not (CHROMIUM.exists() and CHROMEDRIVER.exists()):
        if os.environ.get("CI") == "true":
            pytest.fail(".ci/run installs chromium and chromium-driver; they are missing")
        pytest.skip("Debian's chromium and chromium-driver are not installed")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for argument in (
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--disable-background-networking",
        "--no-first-run",
        "--disable-component-update",
        "--disable-sync",
        f"--window-size={width},{height}",
        f"--user-data-dir={tmp_path / 'profile'}",
    ):
        options.add_argument(argument)
    # As a careful operator might browse: JavaScript off. The page needs none.
    options.add_experimental_option(
        "prefs", {"profile.managed_default_content_settings.javascript": 2}
    )
    return webdriver.Chrome(service=Service(str(CHROMEDRIVER)), options=options)


@pytest.mark.slow
def test_an_operator_finds_a_dead_letter_in_a_real_browser(tmp_path: Path) -> None:
    from selenium.webdriver.common.by import By

    db = tmp_path / "o.db"
    ids: dict[str, str] = {}

    async def fill() -> None:
        async with open_store(str(db)) as store:
            ids.update(await populate(store, RawDB(db)))

    anyio.run(fill, backend="trio")
    token = str(RawDB(db).row(ids["acked"])["ack_token"])
    args = ["--db", str(db), "web", "--listen", "127.0.0.1:0"]
    driver = browser(tmp_path)
    try:
        with running(args, tmp_path, r"dashboard \(read-only\) at (http://\S+)/") as (url, _):
            driver.get(url + "/")
            cards = {
                card.find_element(By.CLASS_NAME, "l").text: card.find_element(
                    By.CLASS_NAME, "n"
                ).text
                for card in driver.find_elements(By.CLASS_NAME, "card")
            }
            for status in ("pending", "delivering", "delivered", "acked", "dead letter", "expired"):
                assert cards[status] == "1", (status, cards)
            assert cards["dead letters, last 24 h"] == "1"
            assert "<script>alert(1)</script>" in driver.find_element(By.ID, "dispatches").text
            # Filter to dead letters with the form, as a person would.
            select = driver.find_element(By.NAME, "status")
            select.find_element(By.CSS_SELECTOR, "option[value=dead_letter]").click()
            driver.find_element(By.CSS_SELECTOR, "form.filter button").click()
            wait_until(lambda: "status=dead_letter" in driver.current_url)
            links = driver.find_elements(By.CSS_SELECTOR, "#dispatches a[href^='/dispatches/']")
            assert [link.text for link in links] == [ids["dead_letter"]]
            links[0].click()
            wait_until(lambda: "/dispatches/" in driver.current_url)
            text = driver.find_element(By.TAG_NAME, "main").text
            assert "dispatch.dead_letter.max_attempts" in text
            assert "RuntimeError: refused <b>bold</b>" in text
            assert '"n": 1' in driver.find_element(By.ID, "payload").text
            driver.save_screenshot(str(tmp_path / "dead-letter.png"))
            driver.get(url + f"/dispatches/{ids['acked']}")
            assert (
                token not in driver.page_source and "dispatch.acked.consumer" in driver.page_source
            )
            driver.get(url + "/")
            driver.save_screenshot(str(tmp_path / "overview.png"))
    finally:
        driver.quit()
    assert (tmp_path / "overview.png").stat().st_size > 10_000


@pytest.mark.slow
def test_long_values_keep_every_table_within_a_1024px_window(tmp_path: Path) -> None:
    from selenium.webdriver.common.by import By

    db = tmp_path / "o.db"
    error = "E" * 100 + "".join(f"word{i} " for i in range(400))
    error = (error * 2)[:2000]
    far = "https://hooks.example.com/" + "x" * (300 - len("https://hooks.example.com/"))
    assert len(error) == 2000 and len(far) == 300
    ids: list[str] = []

    async def fill() -> None:
        async with open_store(str(db)) as store:
            ids.append(await enqueue_dispatch(store, kind="k" * 120, deliver_to=far))
            ids.append(await enqueue_dispatch(store, kind="fine", deliver_to="ok"))

            async def send(delivery: Delivery) -> None:
                if delivery.deliver_to == far:
                    raise RuntimeError(error)

            await deliver_due_dispatches(
                store, transport=send, now=time.time() + 1, timeout_seconds=5
            )

    anyio.run(fill, backend="trio")
    whole_error = str(RawDB(db).row(ids[0])["last_error"])
    assert len(whole_error) == 2000  # what the row holds, cut at its limit
    args = ["--db", str(db), "web", "--listen", "127.0.0.1:0"]
    driver = browser(tmp_path, width=1024, height=768)
    try:
        with running(args, tmp_path, r"dashboard \(read-only\) at (http://\S+)/") as (url, _):
            for path in ("/", f"/dispatches/{ids[0]}"):
                driver.get(url + path)
                inner = driver.execute_script("return window.innerWidth")
                scroll = driver.execute_script("return document.documentElement.scrollWidth")
                assert 900 <= inner <= 1024, inner
                assert scroll <= inner, (path, scroll, inner)
            driver.get(url + "/")
            link = f"#dispatches a[href='/dispatches/{ids[0]}']"
            row = driver.find_element(By.CSS_SELECTOR, link)
            cells = row.find_element(By.XPATH, "./ancestor::tr").find_elements(By.TAG_NAME, "td")
            titles = [cell.get_attribute("title") for cell in cells]
            assert whole_error in titles and far in titles and ids[0] in titles
            failure = driver.find_element(By.CSS_SELECTOR, "#failures td[title^='attempt 1']")
            assert failure.rect["width"] < 1024
            # The row's page shows every value whole.
            driver.get(url + f"/dispatches/{ids[0]}")
            page = driver.find_element(By.TAG_NAME, "main").text
            assert whole_error.split()[0] in page and far in page
            assert whole_error.split()[-1] in page
            driver.save_screenshot(str(tmp_path / "long.png"))
    finally:
        driver.quit()


def wait_until(predicate: Callable[[], bool], timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)
