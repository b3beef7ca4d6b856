"""`scripts/demo.py --webhook` as a real process: its receiver verifies and
logs the signed deliveries, the store records each outcome, and SIGINT
stops it cleanly -- without the secret ever reaching the output."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def outcomes(db: Path) -> dict[str, dict[str, object]]:
    """deliver_to -> the row's id, status, attempt, last_error and latest
    transition reason; empty until the store has its tables."""
    if not db.exists():
        return {}
    with contextlib.closing(sqlite3.connect(db, timeout=5)) as conn:
        conn.row_factory = sqlite3.Row
        try:
            rows = conn.execute(
                "SELECT o.id, o.deliver_to, o.status, o.attempt, o.last_error,"
                " (SELECT t.reason_code FROM status_transitions t"
                "  WHERE t.entity_id = o.id ORDER BY t.id DESC LIMIT 1) AS reason"
                " FROM dispatch_outbox o"
            ).fetchall()
        except sqlite3.OperationalError:  # not created yet
            return {}
    return {row["deliver_to"]: dict(row) for row in rows}


def settled(rows: dict[str, dict[str, object]], stdout: str) -> bool:
    delivered = all(
        route in rows
        and rows[route]["status"] == "delivered"
        and f"webhook-id={rows[route]['id']} signature ok" in stdout
        for route in ("seat-1", "seat-2")
    )
    gone = rows.get("retired-seat", {}).get("reason") == "dispatch.dead_letter.gone"
    failed = rows.get("unknown-seat", {}).get("attempt") == 1
    return delivered and gone and failed


@pytest.mark.slow
def test_the_webhook_demo_delivers_signed_posts_and_stops_on_sigint(tmp_path: Path) -> None:
    config = tmp_path / "config.yaml"
    shutil.copy(ROOT / "config.example.yaml", config)
    db = tmp_path / "outbox-webhook.db"  # the demo's webhook store, next to its config
    out, err = tmp_path / "stdout", tmp_path / "stderr"
    with out.open("wb") as stdout_file, err.open("wb") as stderr_file:
        demo = subprocess.Popen(
            [sys.executable, "scripts/demo.py", "--webhook", "--config", str(config)],
            cwd=ROOT,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
            stdin=subprocess.DEVNULL,
            stdout=stdout_file,
            stderr=stderr_file,
        )
    try:
        deadline = time.monotonic() + 30
        rows = outcomes(db)
        while not settled(rows, out.read_text()) and demo.poll() is None:
            assert time.monotonic() < deadline, (rows, out.read_text(), err.read_text())
            time.sleep(0.2)
            rows = outcomes(db)
        assert demo.poll() is None, (demo.returncode, out.read_text(), err.read_text())
        demo.send_signal(signal.SIGINT)
        returncode = demo.wait(timeout=15)
    finally:
        if demo.poll() is None:
            demo.kill()
            demo.wait()
    stdout, stderr = out.read_text(), err.read_text()
    assert returncode == 0, (stdout, stderr)
    assert rows["retired-seat"]["status"] == "dead_letter"
    assert f"webhook-id={rows['retired-seat']['id']} signature ok" in stdout
    assert rows["unknown-seat"]["status"] == "pending"
    assert "no webhook endpoint for deliver_to 'unknown-seat'" in str(
        rows["unknown-seat"]["last_error"]
    )
    assert "INVALID" not in stdout
    assert "SIGINT received: stopping" in stderr
    assert "whsec_" not in stdout + stderr
