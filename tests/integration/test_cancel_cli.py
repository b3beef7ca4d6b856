"""``trio-dispatch cancel`` (docs/controls.md) on both engines: one row
(pending, running, finished, unknown, too late in a real child process),
by filters with ``--dry-run`` writing nothing, ``--json``, and the usage
refusals (one line, exit 1 or 2, nothing written)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from typing import Any

import anyio
import pytest

from trio_dispatch import deliver_due_dispatches, enqueue_dispatch, open_store
from trio_dispatch.outbox import claim_due, finish_attempt
from trio_dispatch.transports import TransportResult

from ..conftest import RawDB
from ..helpers import assert_one_line_error, dry_run, everything, json_output, refused, run_cli

T0 = 1_000_000.0


async def send_ok(delivery: Any) -> bool:
    return True


@pytest.fixture
def rows(db_target: str, raw: RawDB) -> dict[str, str]:
    """A pending row of each of two destinations, a running attempt (claimed
    with a long lease, no worker) and a delivered row."""

    async def build() -> dict[str, str]:
        async with open_store(db_target) as store:
            done = await enqueue_dispatch(store, kind="k", deliver_to="done")
            await deliver_due_dispatches(store, transport=send_ok)
            found = {
                "delivered": done,
                "running": await enqueue_dispatch(store, kind="k", deliver_to="billing"),
            }
            await claim_due(store, ids=[found["running"]], lease_seconds=600)
            found["billing"] = await enqueue_dispatch(store, kind="k", deliver_to="billing")
            found["mail"] = await enqueue_dispatch(store, kind="k", deliver_to="mail")
            return found

    return anyio.run(build, backend="trio")


def status(raw: RawDB, dispatch_id: str) -> str:
    return str(raw.row(dispatch_id)["status"])


def test_a_pending_dispatch_is_cancelled_and_said_so(
    db_target: str, raw: RawDB, rows: dict[str, str]
) -> None:
    done = run_cli("cancel", "--db", db_target, rows["billing"], "--reason", "wrong amount")
    assert done.returncode == 0, done.stderr
    assert done.stdout == f"cancelled {rows['billing']} (it was pending)\n"
    assert status(raw, rows["billing"]) == "cancelled"
    last = raw.transitions(rows["billing"])[-1]
    assert last["actor"].startswith("trio-dispatch cancel (")
    assert last["source"] == "operator"
    meta = last["metadata"] if isinstance(last["metadata"], dict) else json.loads(last["metadata"])
    assert meta["reason"] == "wrong amount"
    # Every listing shows it.
    listed = json.loads(run_cli("ls", "--db", db_target, "--status", "cancelled", "--json").stdout)
    assert [row["id"] for row in listed["dispatches"]] == [rows["billing"]]
    stats = json.loads(run_cli("stats", "--db", db_target, "--json").stdout)
    assert stats["counts"]["cancelled"] == 1
    shown = run_cli("show", "--db", db_target, rows["billing"]).stdout
    assert "status          cancelled" in shown


def test_json_says_what_the_cancel_did(db_target: str, raw: RawDB, rows: dict[str, str]) -> None:
    done = run_cli("cancel", "--db", db_target, rows["mail"], "--json")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == {
        "id": rows["mail"],
        "status": "cancelled",
        "previous": "pending",
        "attempt": 0,
        "cancelled": True,
        "requested": False,
        "applied": True,
        "error": None,
    }
    refused = run_cli("cancel", "--db", db_target, rows["delivered"], "--json")
    assert refused.returncode == 1
    document = json.loads(refused.stdout)
    assert (document["applied"], document["status"]) == (False, "delivered")
    assert "delivered" in document["error"]


def test_a_finished_or_unknown_dispatch_is_one_line_and_exit_1(
    db_target: str, raw: RawDB, rows: dict[str, str]
) -> None:
    before = everything(raw)
    done = run_cli("cancel", "--db", db_target, rows["delivered"])
    assert_one_line_error(done, 1, rows["delivered"], "'delivered'", "can be cancelled")
    unknown = run_cli("cancel", "--db", db_target, "f" * 32)
    assert_one_line_error(unknown, 1, "not found")
    assert everything(raw) == before
    assert run_cli("cancel", "--db", db_target, rows["billing"]).returncode == 0
    cancelled = everything(raw)
    again = run_cli("cancel", "--db", db_target, rows["billing"])
    assert_one_line_error(again, 1, "already cancelled")
    assert everything(raw) == cancelled


def test_a_running_attempt_with_no_worker_is_asked_to_stop(
    db_target: str, raw: RawDB, rows: dict[str, str]
) -> None:
    done = run_cli("cancel", "--db", db_target, rows["running"], "--wait", "0")
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"cancel of {rows['running']} asked for: attempt 1 is still")
    row = raw.row(rows["running"])
    assert (row["status"], row["cancel_requested_at"] is not None) == ("delivering", True)


def test_too_late_is_one_line_and_exit_1_from_a_real_process(db_target: str, raw: RawDB) -> None:
    """The command waits for the attempt's end; the attempt succeeds after
    the cancel marked it: the success stands."""

    async def claimed() -> Any:
        async with open_store(db_target) as store:
            dispatch_id = await enqueue_dispatch(store, kind="k", deliver_to="seat")
            [claim], _ = await claim_due(store, ids=[dispatch_id], lease_seconds=600)
            return claim

    claim = anyio.run(claimed, backend="trio")
    process = subprocess.Popen(
        [sys.executable, "-m", "trio_dispatch", "cancel", "--db", db_target, claim.dispatch_id],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 60
        while raw.row(claim.dispatch_id)["cancel_requested_at"] is None:
            assert process.poll() is None, process.communicate()
            assert time.monotonic() < deadline, "the command never marked the row"
            time.sleep(0.02)

        async def succeed() -> None:
            async with open_store(db_target) as store:
                await finish_attempt(store, claim, TransportResult.success())

        anyio.run(succeed, backend="trio")
        out, err = process.communicate(timeout=60)
    finally:
        process.kill()
    done = subprocess.CompletedProcess(process.args, process.returncode, out, err)
    assert_one_line_error(done, 1, claim.dispatch_id, "too late", "delivered")
    assert status(raw, claim.dispatch_id) == "delivered"


def test_by_filters_a_dry_run_writes_nothing_then_the_cancel_runs(
    db_target: str, raw: RawDB, rows: dict[str, str]
) -> None:
    args = ["cancel", "--db", db_target, "--deliver-to", "billing"]
    assert dry_run(raw, *args) == (
        "would cancel 2 dispatches (status pending or delivering, deliver_to 'billing')\n"
    )
    done = run_cli(*args, "--reason", "billing is gone", "--json")
    assert json_output(done, "matched", "cancelled", "requested", "skipped") == {
        "matched": 2,
        "cancelled": 1,
        "requested": 1,
        "skipped": 0,
    }
    assert json_output(done)["filter"]["statuses"] == ["pending", "delivering"]
    assert status(raw, rows["billing"]) == "cancelled"
    assert raw.row(rows["running"])["cancel_requested_at"] is not None
    assert status(raw, rows["mail"]) == "pending"  # another destination
    text = run_cli(*args, "--status", "pending")
    assert text.stdout.startswith("cancelled 0 and asked 0 running attempts to stop, of 0 ")


@pytest.mark.parametrize(
    ("args", "code", "words"),
    [
        (["ID", "--kind", "k"], 2, ("an id or filters, not both", "--kind")),
        ([], 2, ("needs a dispatch id, or at least one filter",)),
        (["--kind", "k", "--wait", "3"], 2, ("--wait goes with an id",)),
        (["--status", "delivered"], 1, ("cancel of delivered rows is not allowed",)),
        (["ID", "--reason", "two\nlines"], 2, ("reason", "control characters")),
        (["ID", "--wait", "-1"], 2, ("invalid seconds",)),
    ],
)
def test_usage_refusals_are_one_line_and_write_nothing(
    db_target: str, raw: RawDB, rows: dict[str, str], args: list[str], code: int, words: Any
) -> None:
    given = [rows["billing"] if arg == "ID" else arg for arg in args]
    refused(raw, code, words, "cancel", "--db", db_target, *given)
