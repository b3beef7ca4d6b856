"""An operator acts from the dashboard in a real browser (Debian's Chromium,
JavaScript off): logs in, retries a dead letter from its page, bulk-purges
the delivered rows after confirming their count, replays an expired row by
its destination and failure time, and reads the history."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import anyio
import pytest

from trio_dispatch.store import open_store

from ..conftest import RawDB
from .test_web import browser, populate, running, wait_until

VIEWER = "viewer-token-0123456789"
OPERATOR = "operator-token-0123456789"


@pytest.mark.slow
def test_an_operator_logs_in_retries_bulk_purges_and_replays_in_a_real_browser(
    tmp_path: Path,
) -> None:
    from selenium.webdriver.common.by import By

    db = tmp_path / "o.db"
    ids: dict[str, str] = {}

    async def fill() -> None:
        async with open_store(str(db)) as store:
            ids.update(await populate(store, RawDB(db)))

    anyio.run(fill, backend="trio")
    config = tmp_path / "c.yaml"
    config.write_text(
        json.dumps(
            {
                "store": "o.db",
                "dispatch": {"notify_template": ["true"]},
                "http": {"token": VIEWER, "operator_token": OPERATOR},
            }
        )
    )
    args = ["--config", str(config), "web", "--listen", "127.0.0.1:0"]
    driver = browser(tmp_path)

    def status(dispatch_id: str) -> str | None:
        with sqlite3.connect(db) as conn:
            row = conn.execute(
                "SELECT status FROM dispatch_outbox WHERE id = ?", (dispatch_id,)
            ).fetchone()
        return None if row is None else str(row[0])

    try:
        with running(args, tmp_path, r"dashboard \(operators may act\) at (http://\S+)/") as (
            url,
            process,
        ):
            driver.get(url + "/login")
            driver.find_element(By.NAME, "token").send_keys(OPERATOR)
            driver.find_element(By.CSS_SELECTOR, "form.login button").click()
            wait_until(lambda: driver.current_url.rstrip("/") == url)
            assert "Log out" in driver.page_source
            # The Content-Security-Policy lets the page's one style block in by its hash.
            header = driver.find_element(By.TAG_NAME, "header")
            assert header.value_of_css_property("background-color") == "rgba(29, 35, 48, 1)"
            # Retry the dead letter from its page.
            driver.get(url + f"/dispatches/{ids['dead_letter']}")
            driver.save_screenshot(str(tmp_path / "row-actions.png"))
            driver.find_element(
                By.CSS_SELECTOR, f"form[action='/dispatches/{ids['dead_letter']}/retry'] button"
            ).click()
            # POST, redirect, GET: the row's own page, saying once what was done.
            wait_until(lambda: driver.current_url == url + f"/dispatches/{ids['dead_letter']}")
            wait_until(lambda: bool(driver.find_elements(By.ID, "notice")))
            notice = driver.find_element(By.ID, "notice").text
            assert notice == f"dispatch {ids['dead_letter']} retried: pending again"
            assert status(ids["dead_letter"]) == "pending"
            driver.refresh()
            assert driver.find_elements(By.ID, "notice") == []
            # Bulk-purge the delivered rows, after the confirmation's count.
            driver.get(url + "/?status=delivered")
            driver.find_element(By.PARTIAL_LINK_TEXT, "Purge all delivered").click()
            wait_until(lambda: "/actions/purge" in driver.current_url)
            assert "Purge 1 rows?" in driver.find_element(By.TAG_NAME, "h1").text
            assert status(ids["delivered"]) == "delivered"  # nothing before confirming
            driver.find_element(By.CSS_SELECTOR, "form[action='/actions/purge'] button").click()
            wait_until(lambda: driver.current_url.rstrip("/") == url)
            wait_until(lambda: bool(driver.find_elements(By.ID, "notice")))
            assert driver.find_element(By.ID, "notice").text == "1 of 1 rows purged"
            assert status(ids["delivered"]) is None
            assert status(ids["acked"]) == "acked"  # only the filtered rows
            # Replay: the expired row by its destination and when it failed.
            driver.get(url + "/")
            driver.find_element(By.ID, "replay-link").click()
            wait_until(lambda: "Choose at least one filter" in driver.page_source)
            driver.find_element(By.CSS_SELECTOR, "#replay input[name=deliver_to]").send_keys("ok")
            driver.find_element(By.CSS_SELECTOR, "#replay input[name=since]").send_keys("1h")
            driver.find_element(By.CSS_SELECTOR, "#replay button").click()
            wait_until(lambda: "Retry 1 rows?" in driver.page_source)
            assert status(ids["expired"]) == "expired"  # nothing before confirming
            driver.find_element(By.CSS_SELECTOR, "form[action='/actions/retry'] button").click()
            wait_until(lambda: "1 of 1 rows retried" in driver.page_source)
            assert status(ids["expired"]) == "pending"
            assert status(ids["dead_letter"]) == "pending"
            # The history keeps who did what.
            driver.get(url + f"/dispatches/{ids['delivered']}")
            text = driver.find_element(By.TAG_NAME, "main").text
            assert "dispatch.purged.operator" in text and "web" in text
            driver.get(url + f"/dispatches/{ids['dead_letter']}")
            assert (
                "dispatch.pending.operator_retry" in driver.find_element(By.TAG_NAME, "main").text
            )
    finally:
        driver.quit()
    assert process.returncode == 0
    assert (tmp_path / "row-actions.png").stat().st_size > 10_000
