"""An operator pauses and resumes a destination in a real browser (Debian's
Chromium, JavaScript off), as docs/dashboard.md and docs/destinations.md say: logs in, finds
the destination on ``/destinations``, pauses it from its page for a while
with a reason, sees it paused (and the audit row), then resumes it."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import anyio
import pytest

from trio_dispatch import enqueue_many
from trio_dispatch.store import open_store

from .test_web import browser, running, wait_until

VIEWER = "viewer-token-0123456789"
OPERATOR = "operator-token-0123456789"


@pytest.mark.slow
def test_an_operator_pauses_and_resumes_a_destination_in_a_real_browser(
    tmp_path: Path,
) -> None:
    from selenium.webdriver.common.by import By

    db = tmp_path / "o.db"

    async def fill() -> None:
        async with open_store(str(db)) as store:
            rows = [{"kind": "invoice.issued", "deliver_to": "billing"} for _ in range(3)]
            await enqueue_many(store, [*rows, {"kind": "user.welcome", "deliver_to": "mailer"}])

    anyio.run(fill, backend="trio")
    config = tmp_path / "c.yaml"
    config.write_text(
        json.dumps(
            {
                "store": "o.db",
                "dispatch": {"notify_template": ["true"]},
                "http": {"token": VIEWER, "operator_token": OPERATOR},
                "destinations": {"billing": {"rate": "50/s", "burst": 10, "concurrency": 4}},
            }
        )
    )
    args = ["--config", str(config), "web", "--listen", "127.0.0.1:0"]
    driver = browser(tmp_path, height=1000)

    def stored() -> tuple[str, ...]:
        with sqlite3.connect(db) as conn:
            row = conn.execute(
                "SELECT state, reason FROM dispatch_destinations WHERE name = 'billing'"
            ).fetchone()
        return () if row is None else tuple(row)

    def audit() -> list[tuple[str, str, str]]:
        with sqlite3.connect(db) as conn:
            return conn.execute(
                "SELECT previous_state, state, actor FROM dispatch_destination_changes ORDER BY id"
            ).fetchall()

    try:
        with running(args, tmp_path, r"dashboard \(operators may act\) at (http://\S+)/") as (
            url,
            process,
        ):
            driver.get(url + "/login")
            driver.find_element(By.NAME, "token").send_keys(OPERATOR)
            driver.find_element(By.CSS_SELECTOR, "form.login button").click()
            wait_until(lambda: driver.current_url.rstrip("/") == url)
            # From the index's card to the list, then the destination's page.
            driver.find_element(By.CSS_SELECTOR, "#destinations-card a").click()
            wait_until(lambda: driver.current_url.endswith("/destinations"))
            table = driver.find_element(By.ID, "destinations").text
            assert "billing" in table and "mailer" in table
            driver.find_element(By.LINK_TEXT, "billing").click()
            wait_until(lambda: "name=billing" in driver.current_url)
            # Pause it for 30 minutes, with a reason.
            pause = driver.find_element(By.ID, "pause")
            pause.find_element(By.NAME, "for").send_keys("30m")
            pause.find_element(By.NAME, "reason").send_keys("partner maintenance")
            pause.find_element(By.TAG_NAME, "button").click()
            wait_until(lambda: "done=pause" in driver.current_url)
            notice = driver.find_element(By.ID, "notice").text
            assert notice.startswith("Paused: its rows stay pending")
            state = driver.find_element(By.ID, "destination").text
            assert "paused until" in state and "partner maintenance" in state
            assert stored() == ("paused", "partner maintenance")
            changes = driver.find_element(By.ID, "changes").text
            assert "active → paused" in changes and "operator / web" in changes
            driver.save_screenshot(str(tmp_path / "destination-paused.png"))
            # The list shows it paused too.
            driver.get(url + "/destinations")
            assert "paused" in driver.find_element(By.ID, "destinations").text
            # Resume it from its page.
            driver.find_element(By.LINK_TEXT, "billing").click()
            wait_until(lambda: "name=billing" in driver.current_url)
            driver.find_element(
                By.CSS_SELECTOR, "form[action='/destinations/resume'] button"
            ).click()
            wait_until(lambda: "done=resume" in driver.current_url)
            assert driver.find_element(By.ID, "notice").text.startswith("Resumed")
            assert stored()[0] == "active"
            assert (
                driver.find_elements(By.CSS_SELECTOR, "form[action='/destinations/resume']") == []
            )
    finally:
        driver.quit()
    assert process.returncode == 0
    assert audit() == [("active", "paused", "web"), ("paused", "active", "web")]
    assert (tmp_path / "destination-paused.png").stat().st_size > 10_000
