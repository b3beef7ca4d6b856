"""A silent network between a worker and PostgreSQL: a TCP proxy of the
test's own on 127.0.0.1 stops forwarding without resetting anything (as a
partition, a NAT or a pooler that hangs does), right as the worker's claim
sends its COMMIT. The worker notices within its deadline and says so once,
the server lets the stuck session's row lock go, SIGTERM stops the worker
within its grace plus that deadline, and a claim whose COMMIT comes back
after its lease is never sent."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import anyio
import pytest

from trio_dispatch import enqueue_dispatch, open_store
from trio_dispatch.outbox import claim_due

from ..conftest import RawDB
from ..helpers import wait_for
from ..proxy import FreezableProxy, proxy_to

pytestmark = [pytest.mark.anyio, pytest.mark.postgres_only, pytest.mark.slow]

SILENCE = "no answer from the server in 2s; its connection is dropped"
RECORDER = """
import sys, time
with open(sys.argv[1], "a") as out:
    out.write(f"{time.time()} {sys.argv[3]}\\n")
"""


def start(tmp_path: Path, store: str, **settings: Any) -> tuple[subprocess.Popen[str], Path, Path]:
    """A worker process on ``store`` whose transport records each call
    (time, destination) in a file; its log goes to a file too."""
    script = tmp_path / "record.py"
    script.write_text(RECORDER)
    sent = tmp_path / "sent.txt"
    config = tmp_path / "worker.yaml"
    config.write_text(
        json.dumps(
            {
                "store": store,
                "busy_timeout_seconds": settings.pop("busy_timeout_seconds"),
                "network_timeout_seconds": settings.pop("network_timeout_seconds"),
                "dispatch": {
                    "notify_template": [
                        sys.executable,
                        str(script),
                        str(sent),
                        "--",
                        "{deliver_to}",
                    ],
                    "timeout_seconds": settings.pop("timeout_seconds", 5),
                },
                "worker": {"tick_seconds": 3600, "grace_seconds": 0.5, **settings},
                "log_level": "INFO",
            }
        )
    )
    log = tmp_path / "worker.log"
    with log.open("w") as stderr:
        worker = subprocess.Popen(
            [sys.executable, "-m", "trio_dispatch", "--config", str(config), "worker"],
            stdout=subprocess.DEVNULL,
            stderr=stderr,
            text=True,
        )
    return worker, log, sent


async def listening(raw: RawDB, log: Path) -> None:
    """Until the worker's listener is registered on the server and its
    first scan (a write transaction, found nothing) has committed: the next
    COMMIT the worker sends is then the claim's."""

    def ready() -> bool:
        sessions = raw.rows(
            "SELECT state, query FROM pg_stat_activity WHERE datname = current_database() "
            "AND pid <> pg_backend_pid()"
        )
        listens = any(str(s["query"]).startswith("LISTEN") for s in sessions)
        scanned = any(s["state"] == "idle" and s["query"] == "COMMIT" for s in sessions)
        return listens and scanned

    await wait_for(ready, timeout=20)


async def freeze_at_the_claims_commit(proxy: FreezableProxy, target: str, where: str) -> str:
    proxy.freeze_on(b"COMMIT")
    async with open_store(target) as db:
        dispatch_id = await enqueue_dispatch(db, kind="k", deliver_to=where)
    await wait_for(proxy.froze.is_set, timeout=20)
    return dispatch_id


async def test_a_silent_network_is_noticed_the_lock_let_go_and_sigterm_obeyed_in_bounded_time(
    db_target: str, raw: RawDB, tmp_path: Path
) -> None:
    async with open_store(db_target):
        pass  # the schema, made on a direct connection
    deadline = 1.0 + 1.0  # busy_timeout_seconds + network_timeout_seconds
    with proxy_to(db_target) as proxy:
        worker, log, sent = start(
            tmp_path, proxy.url(db_target), busy_timeout_seconds=1.0, network_timeout_seconds=1.0
        )
        try:
            await listening(raw, log)
            dispatch_id = await freeze_at_the_claims_commit(proxy, db_target, "seat-1")
            frozen_at = time.monotonic()

            # 1. The worker notices within its deadline and says so.
            await wait_for(lambda: SILENCE in log.read_text(), timeout=deadline + 5)
            noticed = time.monotonic() - frozen_at
            assert noticed <= deadline + 1.5, noticed

            # 2. The server dropped the stuck session: its row lock is gone
            # and another claimant takes the row (attempt 1: the first
            # claim's UPDATE was never committed).
            async with open_store(db_target) as db:

                async def claimed() -> bool:
                    claims, _ = await claim_due(db, lease_seconds=60, actor="other")
                    return bool(claims)

                started = time.monotonic()
                while not await claimed():
                    assert time.monotonic() - started < deadline + 5, "the row stayed locked"
                    await anyio.sleep(0.1)
            row = raw.row(dispatch_id)
            assert (row["status"], row["attempt"]) == ("delivering", 1)

            # 3. SIGTERM while the network is still silent: the worker stops
            # within its grace plus one deadline.
            assert proxy.frozen
            stop = time.monotonic()
            worker.send_signal(signal.SIGTERM)
            code = await anyio.to_thread.run_sync(lambda: worker.wait(timeout=30))
            took = time.monotonic() - stop
        finally:
            proxy.thaw()
            worker.kill()
            worker.wait()
    assert code == 0, log.read_text()
    assert took <= 0.5 + deadline + 2.0, took
    text = log.read_text()
    assert text.count(SILENCE) == 1, text  # said once for the outage
    assert not sent.exists()  # the worker never sent the row it lost
    claims = [t for t in raw.transitions(dispatch_id) if t["status"] == "delivering"]
    assert [t["actor"] for t in claims] == ["other"]


async def test_a_claim_that_commits_after_its_lease_ended_is_never_sent(
    db_target: str, raw: RawDB, tmp_path: Path
) -> None:
    async with open_store(db_target):
        pass
    with proxy_to(db_target) as proxy:
        # A 5.5 s lease (0.5 s timeout + the 5 s margin) and a deadline far
        # longer than the silence: the claim commits 7 s late.
        worker, log, sent = start(
            tmp_path,
            proxy.url(db_target),
            busy_timeout_seconds=10.0,
            network_timeout_seconds=10.0,
            timeout_seconds=0.5,
        )
        try:
            await listening(raw, log)
            dispatch_id = await freeze_at_the_claims_commit(proxy, db_target, "seat-2")
            await anyio.sleep(7.0)
            proxy.thaw()
            await wait_for(lambda: raw.row(dispatch_id)["status"] == "delivered", timeout=30)
        finally:
            worker.send_signal(signal.SIGTERM)
            try:
                await anyio.to_thread.run_sync(lambda: worker.wait(timeout=20))
            finally:
                worker.kill()
    history = raw.transitions(dispatch_id)
    given_back = [t for t in history if "not sent" in t["reason_summary"]]
    assert len(given_back) == 1, history
    assert given_back[0]["status"] == "pending"
    calls = [float(line.split()[0]) for line in sent.read_text().splitlines()]
    assert len(calls) == 1, calls  # the one send came after the give-back
    assert calls[0] > float(given_back[0]["created_at"]), (calls, given_back)
    assert raw.row(dispatch_id)["attempt"] == 1  # the unsent claim was not counted
