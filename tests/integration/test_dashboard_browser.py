"""The dashboard's layout in a real browser (Debian's Chromium, JavaScript
off): every time on the schedules page whole on one line, at the widths an
operator uses."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from .test_web import browser, running

SCHEDULES = {
    "nightly-report-for-every-tenant": {
        "cron": "30 2 * * *",
        "timezone": "America/Argentina/Buenos_Aires",
        "kind": "report.nightly.generated",
        "deliver_to": "https://reports.example.com/hooks/nightly",
    },
    "heartbeat": {"every": "5m", "kind": "tick", "deliver_to": "ticks"},
}

# For each time cell of the schedules page: its column, the lines its stamp
# takes (1: not wrapped) and how far the cell cuts it (scrollWidth past
# clientWidth).
TIME_CELLS = """
const out = [];
for (const cell of document.querySelectorAll('#schedules td.when')) {
  const stamp = cell.querySelector('.stamp');
  if (!stamp) continue;
  const lines = new Set(Array.from(stamp.getClientRects()).map(r => Math.round(r.top)));
  out.push([cell.cellIndex, lines.size, cell.scrollWidth - cell.clientWidth]);
}
return out;
"""


@pytest.mark.slow
@pytest.mark.parametrize("width", [1280, 1024])
def test_the_schedules_page_shows_every_time_whole_on_one_line(tmp_path: Path, width: int) -> None:
    config = tmp_path / "c.yaml"
    config.write_text(
        json.dumps(
            {
                "store": "o.db",
                "dispatch": {"notify_template": ["true"]},
                "schedules": SCHEDULES,
            }
        )
    )
    done = subprocess.run([*_cli(config), "migrate"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    for name in SCHEDULES:  # a run each, so the last tick and fired-at cells hold times
        done = subprocess.run(
            [*_cli(config), "schedules", "run", name], capture_output=True, text=True, timeout=60
        )
        assert done.returncode == 0, done.stderr
    args = ["--config", str(config), "web", "--listen", "127.0.0.1:0"]
    driver = browser(tmp_path, width=width, height=800)
    try:
        with running(args, tmp_path, r"dashboard \(read-only\) at (http://\S+)/") as (url, _):
            driver.get(url + "/schedules")
            cells: list[Any] = driver.execute_script(TIME_CELLS)
            inner = driver.execute_script("return window.innerWidth")
            scroll = driver.execute_script("return document.documentElement.scrollWidth")
            driver.save_screenshot(str(tmp_path / f"schedules-{width}.png"))
    finally:
        driver.quit()
    # Per schedule: its last tick, when it fired, its next fire.
    assert len(cells) == 3 * len(SCHEDULES), cells
    assert [cell for cell in cells if cell[1] != 1 or cell[2] > 0] == [], cells
    assert scroll <= inner  # and the page still fits the window


def _cli(config: Path) -> list[str]:
    return [sys.executable, "-m", "trio_dispatch", "--config", str(config)]
