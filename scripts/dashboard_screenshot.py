"""Make docs/dashboard.png, docs/dashboard-actions.png and
docs/dashboard-destinations.png: a store with a realistic mix of dispatches
(failures with long errors, rows awaiting their ack among them) and of
destination states, served by `trio-dispatch web` with an operator token,
photographed in headless Chromium (Debian's chromium and chromium-driver)
at 1280 px wide: the overview as anyone on loopback sees it, then a dead
letter's page after an operator's login, with its Retry and Purge buttons,
then the destinations' page.

    .venv/bin/python scripts/dashboard_screenshot.py [OUT_DIR]
"""

from __future__ import annotations

import json
import random
import re
import sqlite3
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import anyio

from trio_dispatch import (
    Delivery,
    ack_dispatch,
    deliver_due_dispatches,
    enqueue_many,
    pause_destination,
)
from trio_dispatch.outbox import claim_due
from trio_dispatch.store import open_store

ROOT = Path(__file__).resolve().parents[1]
KINDS = ["order.paid", "order.shipped", "invoice.issued", "user.welcome", "build.finished"]
ROUTES = ["billing", "warehouse", "mailer", "seat-7", "analytics"]
PARTNER = "https://hooks.partner.example.com/v2/webhooks/inbound/7f3c9a51e2b84d06/orders"
PARTNER_ERROR = (
    "HTTP 502 from https://hooks.partner.example.com/v2/webhooks/inbound/7f3c9a51e2b84d06/"
    "orders: <html><head><title>502 Bad Gateway</title></head><body><center><h1>502 Bad "
    "Gateway</h1></center><hr><center>nginx</center></body></html> " * 4
)


async def fill(db_path: Path) -> None:
    rng = random.Random(7)
    async with open_store(str(db_path)) as db:
        items = [
            {
                "kind": rng.choice(KINDS),
                "deliver_to": rng.choice(ROUTES),
                "body": {"order": 1000 + i, "amount": rng.randint(5, 500)},
                "max_attempts": 1 if i % 11 == 0 else 8,
                "ack_required": i % 9 == 0,
            }
            for i in range(240)
        ]
        await enqueue_many(db, items)
        await enqueue_many(
            db,
            [{"kind": "order.paid", "deliver_to": PARTNER, "body": {"n": i}} for i in range(2)],
        )

        async def send(delivery: Delivery) -> None:
            if delivery.deliver_to == "analytics" and delivery.attempt == 1:
                raise RuntimeError("HTTP 503: upstream busy, try later")
            if delivery.deliver_to == "seat-7":
                raise RuntimeError("connection refused")
            if delivery.deliver_to == PARTNER:
                raise RuntimeError(PARTNER_ERROR)

        await deliver_due_dispatches(db, transport=send, batch_size=1000, timeout_seconds=5)
        for row in await _awaiting(db):
            await ack_dispatch(db, row["id"], row["ack_token"])
        # The newest: sends that wait for their ack, and a dead letter.
        await enqueue_many(
            db,
            [
                {"kind": "invoice.issued", "deliver_to": "mailer", "ack_required": True},
                {"kind": "order.paid", "deliver_to": "seat-7", "max_attempts": 1},
                {"kind": "user.welcome", "deliver_to": "mailer", "ack_required": True},
            ],
        )
        await deliver_due_dispatches(db, transport=send, timeout_seconds=5)
        await enqueue_many(
            db,
            [
                {"kind": rng.choice(KINDS), "deliver_to": rng.choice(ROUTES), "body": {"n": i}}
                for i in range(3)
            ],
        )
        await claim_due(db, limit=3, lease_seconds=600)
        await pause_destination(
            db, "warehouse", for_seconds=5400, reason="WMS migration window", actor="ops"
        )
    # What the delivery loop records of the other destinations (a 429 with
    # Retry-After, a breaker opened by refused connections, a rate in use).
    now = time.time()
    with sqlite3.connect(db_path) as conn:
        conn.executemany(
            "INSERT INTO dispatch_destinations (name, state, state_until, reason, "
            "throttled_until, rate_tat, failures, last_success_at, last_failure_at) "
            "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
            [
                ("analytics", "active", None, "HTTP 429 Retry-After: 90", now + 80, None, 0,
                 now - 40, now - 10),
                ("seat-7", "open", now + 45, "10 failures in a row: connection refused", None,
                 None, 10, now - 3600, now - 15),
                ("billing", "active", None, None, None, None, 0, now - 2, None),
            ],
        )  # fmt: skip


async def _awaiting(db: object) -> list[dict[str, str]]:
    from trio_dispatch import list_dispatches

    rows = await list_dispatches(db, status="pending", limit=1000)  # type: ignore[arg-type]
    return [r for r in rows if r["ack_token"] and r["attempt"] == 1][:10]


OPERATOR = "screenshot-operator-token-0123"
DESTINATIONS = {
    "*": {"concurrency": 8},
    "billing": {"rate": "50/s", "burst": 10, "concurrency": 4},
    "seat-7": {"breaker": {"failures": 10, "cool_down_seconds": 60}},
    "analytics": {"rate": "600/m", "burst": 20, "throttle_max_seconds": 600},
}


def main() -> None:
    folder = Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "docs"
    out, actions = folder / "dashboard.png", folder / "dashboard-actions.png"
    destinations = folder / "dashboard-destinations.png"
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common.by import By

    with tempfile.TemporaryDirectory() as tmp:
        profile = Path(tmp) / "profile"
        db = Path(tmp) / "shop.db"
        anyio.run(fill, db, backend="trio")
        config = Path(tmp) / "c.yaml"
        config.write_text(
            json.dumps(
                {
                    "store": str(db),
                    "http": {"operator_token": OPERATOR},
                    "destinations": DESTINATIONS,
                }
            )
        )
        server = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "trio_dispatch",
                "--config",
                str(config),
                "web",
                "--listen",
                "127.0.0.1:0",
            ],
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            url = None
            assert server.stderr is not None
            while url is None:
                line = server.stderr.readline()
                if not line:
                    raise SystemExit("the web command stopped before serving")
                found = re.search(r"at (http://\S+)/", line)
                url = found.group(1) if found else None
            options = webdriver.ChromeOptions()
            options.binary_location = "/usr/bin/chromium"
            for argument in (
                "--headless=new",
                "--no-sandbox",
                "--disable-gpu",
                "--disable-dev-shm-usage",
                "--disable-background-networking",
                "--no-first-run",
                "--disable-component-update",
                "--disable-sync",
                "--hide-scrollbars",
                "--window-size=1280,1500",
                f"--user-data-dir={profile}",
            ):
                options.add_argument(argument)
            driver = webdriver.Chrome(service=Service("/usr/bin/chromedriver"), options=options)
            try:
                driver.get(url + "/")
                time.sleep(0.3)
                out.parent.mkdir(parents=True, exist_ok=True)
                driver.save_screenshot(str(out))
                dead = driver.find_element(By.CSS_SELECTOR, "a[href^='/?status=dead_letter']")
                dead.click()
                time.sleep(0.3)
                first = driver.find_element(By.CSS_SELECTOR, "#dispatches a[href^='/dispatches/']")
                row_page = first.get_attribute("href")
                driver.get(url + "/login")
                driver.find_element(By.NAME, "token").send_keys(OPERATOR)
                driver.find_element(By.CSS_SELECTOR, "form.login button").click()
                time.sleep(0.3)
                driver.set_window_size(1280, 1400)
                driver.get(str(row_page))
                time.sleep(0.3)
                driver.save_screenshot(str(actions))
                driver.set_window_size(1280, 600)
                driver.get(url + "/destinations")
                time.sleep(0.3)
                driver.save_screenshot(str(destinations))
            finally:
                driver.quit()
        finally:
            server.terminate()
            server.wait(timeout=20)
    print(f"wrote {out}, {actions} and {destinations}")


if __name__ == "__main__":
    main()
