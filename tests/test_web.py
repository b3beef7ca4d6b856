"""/metrics, /healthz and the read-only dashboard (SPEC section 11), served
by hypercorn on real sockets over real stores, on both anyio backends."""

from __future__ import annotations

import base64
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
from trio_dispatch.outbox import claim_due
from trio_dispatch.store import SQLiteStore, open_store
from trio_dispatch.web import WebApp, parse_listen, serve_app
from trio_dispatch.worker import DispatchWorker
from trio_dispatch.worker.metrics import DeliveryMetrics

from .conftest import RawDB
from .helpers import run_cli, wait_for

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
        async with httpx.AsyncClient(base_url=url, timeout=10) as client:
            yield client
        tg.cancel_scope.cancel()


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
        await wait_for(lambda: len(done) == 2)  # the pending row and the flaky one
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
            "trio_dispatch_scan_errors",
            "trio_dispatch_lease_recoveries",
        )
    }
    assert kinds == {
        "trio_dispatch_deliveries": "counter",
        "trio_dispatch_delivery_seconds": "histogram",
        "trio_dispatch_dispatches": "gauge",
        "trio_dispatch_oldest_due_seconds": "gauge",
        "trio_dispatch_in_flight": "gauge",
        "trio_dispatch_scan_errors": "counter",
        "trio_dispatch_lease_recoveries": "counter",
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
            await anyio.sleep(0.2)
            ok = await client.get("/healthz")
            assert ok.status_code == 200
            assert ok.json()["status"] == "ok" and ok.json()["store"] == "ok"
            assert 0 <= ok.json()["last_scan_age_seconds"] < 0.6
            with hold_write_lock(engine, raw):  # every scan now fails on the lock
                await anyio.sleep(1.2)
                failing = await client.get("/healthz")
            assert failing.status_code == 503
            document = failing.json()
            assert document["status"] == "unhealthy" and document["store"] == "ok"
            assert "no completed scan" in document["reason"]
            assert "more than two ticks, 0.6s" in document["reason"]
            assert worker.statistics().scan_errors > 0
            await anyio.sleep(0.7)  # scans succeed again
            assert (await client.get("/healthz")).status_code == 200
        tg.cancel_scope.cancel()


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
        first = re.findall(r'href="/dispatch/([0-9a-f]+)"', home.text)
        assert len(first) == 50  # one page, newest first
        older = re.search(r'id=older href="([^"]+)"', home.text)
        assert older is not None
        second = await client.get(older.group(1).replace("&amp;", "&"))
        rest = re.findall(r'href="/dispatch/([0-9a-f]+)"', second.text)
        assert len(rest) == 61 - 50 and not set(rest) & set(first)
        dead = await client.get("/", params={"status": "dead_letter"})
        assert re.findall(r'href="/dispatch/([0-9a-f]+)"', dead.text) == [ids["dead_letter"]]
        by_kind = await client.get("/", params={"kind": "order.paid"})
        assert len(re.findall(r'href="/dispatch/([0-9a-f]+)"', by_kind.text)) == 5
        page = await client.get(f"/dispatch/{ids['acked']}")
        token = str(raw.row(ids["acked"])["ack_token"])
        assert page.status_code == 200 and token not in page.text
        assert "dispatch.acked.consumer" in page.text and "***" in page.text
        failed = await client.get(f"/dispatch/{ids['dead_letter']}")
        assert "refused &lt;b&gt;bold&lt;/b&gt;" in failed.text
        assert (await client.get("/dispatch/no-such-id")).status_code == 404
        assert (await client.post("/")).status_code == 405
        head = await client.head("/", params={"status": "dead_letter"})
        assert head.status_code == 200
        assert head.headers["content-length"] == dead.headers["content-length"]


async def test_with_a_token_every_request_must_carry_it(store: SQLiteStore) -> None:
    async with serving(WebApp(store, token=TOKEN)) as client:
        for path in ("/", "/metrics", "/healthz", "/dispatch/x"):
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
    process = subprocess.Popen(
        [sys.executable, "-m", "trio_dispatch", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=tmp_path,
        preexec_fn=preexec_fn,
    )
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


def browser(tmp_path: Path) -> Any:
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
        "--window-size=1280,900",
        f"--user-data-dir={tmp_path / 'profile'}",
    ):
        options.add_argument(argument)
    # As a careful operator might browse: JavaScript off. The page needs none.
    options.add_experimental_option(
        "prefs", {"profile.managed_default_content_settings.javascript": 2}
    )
    return webdriver.Chrome(service=Service(str(CHROMEDRIVER)), options=options)


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
            assert "<script>alert(1)</script>" in driver.find_element(By.TAG_NAME, "table").text
            # Filter to dead letters with the form, as a person would.
            select = driver.find_element(By.NAME, "status")
            select.find_element(By.CSS_SELECTOR, "option[value=dead_letter]").click()
            driver.find_element(By.CSS_SELECTOR, "form.filter button").click()
            wait_until(lambda: "status=dead_letter" in driver.current_url)
            links = driver.find_elements(By.CSS_SELECTOR, "table a[href^='/dispatch/']")
            assert [link.text for link in links] == [ids["dead_letter"]]
            links[0].click()
            wait_until(lambda: "/dispatch/" in driver.current_url)
            text = driver.find_element(By.TAG_NAME, "main").text
            assert "dispatch.dead_letter.max_attempts" in text
            assert "RuntimeError: refused <b>bold</b>" in text
            assert '"n": 1' in driver.find_element(By.ID, "payload").text
            driver.save_screenshot(str(tmp_path / "dead-letter.png"))
            driver.get(url + f"/dispatch/{ids['acked']}")
            assert (
                token not in driver.page_source and "dispatch.acked.consumer" in driver.page_source
            )
            driver.get(url + "/")
            driver.save_screenshot(str(tmp_path / "overview.png"))
    finally:
        driver.quit()
    assert (tmp_path / "overview.png").stat().st_size > 10_000


def wait_until(predicate: Callable[[], bool], timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)
