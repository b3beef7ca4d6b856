"""Throttling and the circuit breaker's bookkeeping (docs/destinations.md), the
finish side: each transport's throttle (a webhook's 429 and 503 with
``Retry-After``, a callable's ``Throttled``, a command's exit 75) ends its
attempt back in ``pending`` without spending it, and throttles the
destination in the same transaction; a breaker counts failures, opens,
probes and closes. Real transports (a local HTTP server, callables, child
processes) on real stores, both engines, both anyio backends."""

from __future__ import annotations

import base64
import functools
import json
import logging
import secrets
import sys
import time
from collections.abc import Iterator
from typing import Any, Final

import anyio
import pytest

from trio_dispatch import (
    Breaker,
    Delivery,
    Destination,
    Throttled,
    deliver_due_dispatches,
    enable_destination,
    enqueue_dispatch,
    pause_destination,
    retry_dispatch,
)
from trio_dispatch.destinations.outcomes import DestinationBook, Effects
from trio_dispatch.destinations.policy import MAX_THROTTLES_PER_ROW
from trio_dispatch.outbox import Claim, Outcome, claim_due, finish_attempt, release_attempt
from trio_dispatch.outbox.claim import ClaimRules, OrderingKeys
from trio_dispatch.outbox.delivery import finish_and_claim_many
from trio_dispatch.store import SQLiteStore
from trio_dispatch.transports import CommandTransport, TransportResult
from trio_dispatch.transports.webhook import WebhookTransport, parse_endpoints
from trio_dispatch.web.metrics import destination_families, render
from trio_dispatch.worker import DispatchWorker

from ..conftest import RawDB
from ..helpers import wait_for
from ..http_server import Server, serve

pytestmark = pytest.mark.anyio

T0 = 1_000_000.0
BACKOFF_1 = 60.0
"""``backoff_seconds`` after attempt 1: a throttle without a delay waits it."""


@pytest.fixture
def server() -> Iterator[Server]:
    with serve() as running:
        yield running


SECRET = "whsec_" + base64.b64encode(secrets.token_bytes(32)).decode()


def webhook(server: Server, path: str, route: str = "d") -> WebhookTransport:
    return WebhookTransport(
        parse_endpoints(
            "endpoints",
            {route: {"url": server.url + path, "secrets": [SECRET], "allow_private": True}},
            {},
        )
    )


def destination(raw: RawDB, name: str) -> dict[str, Any] | None:
    found = raw.rows("SELECT * FROM dispatch_destinations WHERE name = ?", (name,))
    return found[0] if found else None


def audit(raw: RawDB, name: str) -> list[tuple[Any, ...]]:
    return [
        (c["previous_state"], c["state"], c["reason"], c["source"], c["until_at"])
        for c in raw.rows(
            "SELECT * FROM dispatch_destination_changes WHERE destination = ? ORDER BY id",
            (name,),
        )
    ]


def last(raw: RawDB, dispatch_id: str) -> dict[str, Any]:
    row = raw.transitions(dispatch_id)[-1]
    return {**row, "metadata": json.loads(str(row["metadata"]))}


def assert_throttled(
    raw: RawDB, dispatch_id: str, due: float, *, route: str = "d", tolerance: float = 0.0
) -> None:
    """The row is back in pending, due at ``due``, its attempt kept and not
    counted; the destination waits as long; one audit row says so."""
    row = raw.row(dispatch_id)
    assert (row["status"], row["attempt"], row["throttles"]) == ("pending", 1, 1)
    assert float(row["next_attempt_at"]) == pytest.approx(due, abs=tolerance)
    end = last(raw, dispatch_id)
    assert (end["previous_status"], end["status"], end["reason_code"]) == (
        "delivering",
        "pending",
        "dispatch.pending.throttled",
    )
    assert (end["source"], end["actor"]) == ("scheduler", "dispatch_delivery_loop")
    throttle = end["metadata"]["throttle"]
    assert throttle["until"] == row["next_attempt_at"] and throttle["throttles"] == 1
    assert throttle["delay_seconds"] == pytest.approx(due - T0, abs=tolerance)
    assert end["metadata"]["attempt"] == 1
    state = destination(raw, route)
    assert state is not None and state["state"] == "active"
    assert state["throttled_until"] == row["next_attempt_at"]
    [(previous, now, reason, source, until)] = audit(raw, route)
    assert (previous, now, source) == ("active", "throttled", "scheduler")
    assert until == row["next_attempt_at"]
    assert reason == row["last_error"]


# -- every transport's throttle -------------------------------------------------


@pytest.mark.parametrize(
    ("path", "wait", "answer"),
    [
        ("/slow-down-seconds", 30.0, "HTTP 429: slow down"),
        ("/busy-date", 300.0, "HTTP 429: slow down"),
        ("/busy-seconds", 120.0, "HTTP 503: busy"),
        ("/slow-down", BACKOFF_1, "HTTP 429: slow down"),
    ],
    ids=["429-seconds", "429-http-date", "503-seconds", "429-no-retry-after"],
)
async def test_a_webhook_429_or_503_with_retry_after_throttles_row_and_destination(
    store: SQLiteStore, raw: RawDB, server: Server, path: str, wait: float, answer: str
) -> None:
    dispatch_id = await enqueue_dispatch(store, kind="k", deliver_to="d", max_attempts=1, now=T0)
    counts = await deliver_due_dispatches(store, now=T0, transport=webhook(server, path))
    assert counts == {"attempted": 1, "delivered": 0, "dead_letter": 0, "expired": 0, "retried": 0}
    # An HTTP date is read against the transport's clock (the real one), in whole seconds.
    assert_throttled(raw, dispatch_id, T0 + wait, tolerance=3 if "date" in path else 0)
    assert raw.row(dispatch_id)["last_error"] == answer


async def test_a_callable_raising_throttled_throttles(store: SQLiteStore, raw: RawDB) -> None:
    timed = await enqueue_dispatch(store, kind="k", deliver_to="d", max_attempts=1, now=T0)
    bare = await enqueue_dispatch(store, kind="k", deliver_to="e", max_attempts=1, now=T0)

    async def busy(delivery: Delivery) -> None:
        raise Throttled(retry_after=45 if delivery.deliver_to == "d" else None)

    await deliver_due_dispatches(store, now=T0, transport=busy)
    assert_throttled(raw, timed, T0 + 45)
    assert_throttled(raw, bare, T0 + BACKOFF_1, route="e")
    assert raw.row(timed)["last_error"] == "Throttled: the destination asked to wait"


async def test_a_throttle_asking_no_wait_spends_nothing_and_holds_nothing(
    store: SQLiteStore, raw: RawDB
) -> None:
    dispatch_id = await enqueue_dispatch(store, kind="k", deliver_to="d", max_attempts=1, now=T0)

    async def busy(delivery: Delivery) -> None:
        raise Throttled(retry_after=0)

    await deliver_due_dispatches(store, now=T0, transport=busy)
    row = raw.row(dispatch_id)
    assert (row["status"], row["throttles"], row["next_attempt_at"]) == ("pending", 1, T0)
    state = destination(raw, "d")
    assert state is None or state["throttled_until"] is None
    assert audit(raw, "d") == []


async def test_a_throttled_with_a_bad_delay_is_an_ordinary_failure(
    store: SQLiteStore, raw: RawDB
) -> None:
    dispatch_id = await enqueue_dispatch(store, kind="k", deliver_to="d", now=T0)

    async def confused(delivery: Delivery) -> None:
        raise Throttled(retry_after="soon")  # type: ignore[arg-type]

    await deliver_due_dispatches(store, now=T0, transport=confused)
    row = raw.row(dispatch_id)
    assert (row["status"], row["throttles"]) == ("pending", 0)
    assert "retry_after='soon'" in str(row["last_error"])
    assert last(raw, dispatch_id)["reason_code"] == "dispatch.pending.retry_backoff"
    assert destination(raw, "d") is None


@pytest.mark.parametrize(
    ("stdout", "wait"),
    [
        ("working\nRetry-After: 42\n\n", 42.0),
        ("Retry-After: 2.5", 2.5),
        ("", BACKOFF_1),
        ("Retry-After: 42\nthen something else\n", BACKOFF_1),  # not the last line
        ("Retry-After: -3\n", BACKOFF_1),  # not a non-negative number
    ],
    ids=["last-line", "fraction", "silent", "not-last", "negative"],
)
async def test_a_command_exiting_75_throttles_for_its_last_retry_after_line(
    store: SQLiteStore, raw: RawDB, stdout: str, wait: float
) -> None:
    dispatch_id = await enqueue_dispatch(store, kind="k", deliver_to="d", max_attempts=1, now=T0)
    code = f"import sys; sys.stdout.write({stdout!r}); sys.exit(75)"
    transport = CommandTransport([sys.executable, "-c", code])
    await deliver_due_dispatches(store, now=T0, transport=transport)
    assert_throttled(raw, dispatch_id, T0 + wait)
    assert raw.row(dispatch_id)["last_error"] == "exit 75 (EX_TEMPFAIL)"


async def test_the_wait_is_capped_by_the_destination_policy(store: SQLiteStore, raw: RawDB) -> None:
    capped = await enqueue_dispatch(store, kind="k", deliver_to="d", now=T0)
    default = await enqueue_dispatch(store, kind="k", deliver_to="e", now=T0)
    book = DestinationBook({"d": Destination(throttle_max_seconds=100)})
    claims, _ = await claim_due(store, now=T0)
    for claim in claims:
        result = TransportResult.throttle("HTTP 429", retry_after=86400)
        assert await finish_attempt(store, claim, result, now=T0, destinations=book) is (
            Outcome.THROTTLED
        )
    assert_throttled(raw, capped, T0 + 100)
    assert_throttled(raw, default, T0 + 3600, route="e")  # the default throttle_max_seconds


# -- the row's budget -------------------------------------------------------------


async def throttle_again(store: SQLiteStore, at: float) -> Claim:
    """Claim the one due row at ``at`` and end its attempt throttled for 1 s."""
    [claim], _ = await claim_due(store, now=at)
    result = TransportResult.throttle("HTTP 429", retry_after=1)
    await finish_attempt(store, claim, result, now=at)
    return claim


@pytest.mark.parametrize(
    ("max_attempts", "status", "reason"),
    [(1, "dead_letter", "dispatch.dead_letter.max_attempts"), (3, "pending", "retry_backoff")],
)
async def test_twenty_throttles_spend_nothing_and_the_21st_counts_as_a_failure(
    store: SQLiteStore, raw: RawDB, max_attempts: int, status: str, reason: str
) -> None:
    dispatch_id = await enqueue_dispatch(
        store, kind="k", deliver_to="d", max_attempts=max_attempts, now=T0
    )
    at = T0
    for _ in range(MAX_THROTTLES_PER_ROW):
        await throttle_again(store, at)
        at += 2
    row = raw.row(dispatch_id)
    assert (row["status"], row["attempt"], row["throttles"]) == ("pending", 20, 20)
    claim = await throttle_again(store, at)  # the 21st
    assert (claim.attempt, claim.throttles, claim.counted) == (21, 20, 1)
    row = raw.row(dispatch_id)
    assert (row["status"], row["attempt"], row["throttles"]) == (status, 21, 20)
    end = last(raw, dispatch_id)
    assert end["reason_code"].endswith(reason)
    assert "throttled past its 20 uncounted throttles" in end["reason_summary"]
    assert "throttle" not in end["metadata"]
    # The destination still waits: it asked to.
    state = destination(raw, "d")
    assert state is not None and state["throttled_until"] == at + 1


async def test_a_lease_that_ends_during_the_last_counted_attempt_spends_it_after_throttles(
    store: SQLiteStore, raw: RawDB
) -> None:
    last_one = await enqueue_dispatch(store, kind="k", deliver_to="d", max_attempts=1, now=T0)
    one_left = await enqueue_dispatch(store, kind="k", deliver_to="e", max_attempts=2, now=T0)
    claims, _ = await claim_due(store, now=T0)
    for claim in claims:
        await finish_attempt(store, claim, TransportResult.throttle("busy", retry_after=5), now=T0)
    claims, _ = await claim_due(store, now=T0 + 5)  # attempt 2, the first counted
    assert sorted((c.attempt, c.counted) for c in claims) == [(2, 1), (2, 1)]
    # Both leases (15 s) run out; the next scan finds them.
    recovered, counts = await claim_due(store, now=T0 + 25)
    assert counts["dead_letter"] == 1
    spent = raw.row(last_one)
    assert (spent["status"], spent["attempt"]) == ("dead_letter", 2)
    assert last(raw, last_one)["reason_summary"] == "lease expired during attempt 1 of 1"
    [claim] = recovered  # one counted attempt left: claimed again, not spent
    assert (claim.dispatch_id, claim.attempt, claim.counted) == (one_left, 3, 2)


async def test_a_shutdown_release_after_throttles_keeps_a_row_with_attempts_left(
    store: SQLiteStore, raw: RawDB
) -> None:
    dispatch_id = await enqueue_dispatch(store, kind="k", deliver_to="d", max_attempts=2, now=T0)
    await throttle_again(store, T0)
    [claim], _ = await claim_due(store, now=T0 + 2)
    assert await release_attempt(store, claim, now=T0 + 3) is Outcome.RELEASED
    row = raw.row(dispatch_id)
    assert (row["status"], row["attempt"], row["throttles"]) == ("pending", 2, 1)


async def test_an_operator_retry_forgets_the_throttles(store: SQLiteStore, raw: RawDB) -> None:
    dispatch_id = await enqueue_dispatch(store, kind="k", deliver_to="d", max_attempts=1, now=T0)
    await throttle_again(store, T0)
    [claim], _ = await claim_due(store, now=T0 + 2)
    await finish_attempt(store, claim, TransportResult.failure("boom"), now=T0 + 2)
    assert raw.row(dispatch_id)["status"] == "dead_letter"
    assert await retry_dispatch(store, dispatch_id, now=T0 + 3)
    row = raw.row(dispatch_id)
    assert (row["status"], row["attempt"], row["throttles"]) == ("pending", 0, 0)


# -- the destination's wait ---------------------------------------------------------


async def test_rows_already_claimed_coming_back_throttled_extend_it_without_audit_rows(
    store: SQLiteStore, raw: RawDB
) -> None:
    ids = [await enqueue_dispatch(store, kind="k", deliver_to="d", now=T0) for _ in range(4)]
    claims, _ = await claim_due(store, now=T0)
    assert len(claims) == 4
    first, second, *together = claims
    throttle = TransportResult.throttle
    await finish_attempt(store, first, throttle("429", retry_after=30), now=T0 + 1)
    await finish_attempt(store, second, throttle("429", retry_after=10), now=T0 + 2)
    state = destination(raw, "d")
    assert state is not None and state["throttled_until"] == T0 + 31  # never moved back
    async with anyio.create_task_group() as tg:  # one group commit, likely
        for claim in together:
            tg.start_soon(
                functools.partial(
                    finish_attempt, store, claim, throttle("429", retry_after=100), now=T0 + 3
                )
            )
    state = destination(raw, "d")
    assert state is not None and state["throttled_until"] == T0 + 103
    assert [change[:2] for change in audit(raw, "d")] == [("active", "throttled")]
    assert {raw.row(i)["throttles"] for i in ids} == {1}
    # Once it ran out, the next throttle is a new one: audited.
    [again], _ = await claim_due(store, now=time.time() + 1000, ids=[ids[0]])
    await finish_attempt(store, again, throttle("429", retry_after=5), now=time.time() + 1000)
    assert [change[:2] for change in audit(raw, "d")] == [("active", "throttled")] * 2


async def test_a_throttle_on_a_paused_destination_keeps_the_pause_and_writes_no_audit(
    store: SQLiteStore, raw: RawDB
) -> None:
    dispatch_id = await enqueue_dispatch(store, kind="k", deliver_to="d", now=T0)
    [claim], _ = await claim_due(store, now=T0)
    await pause_destination(store, "d", reason="maintenance", now=T0 + 1)
    throttle = TransportResult.throttle("429", retry_after=30)
    await finish_attempt(store, claim, throttle, now=T0 + 2)
    assert raw.row(dispatch_id)["status"] == "pending"
    state = destination(raw, "d")
    assert state is not None
    assert (state["state"], state["reason"], state["throttled_until"]) == (
        "paused",
        "maintenance",
        T0 + 32,
    )
    assert [change[:2] for change in audit(raw, "d")] == [("active", "paused")]


async def test_a_throttle_end_fenced_out_writes_nothing_to_row_or_destination(
    store: SQLiteStore, raw: RawDB
) -> None:
    dispatch_id = await enqueue_dispatch(store, kind="k", deliver_to="d", now=T0)
    [stale], _ = await claim_due(store, now=T0)
    [current], _ = await claim_due(store, now=T0 + 20)  # the lease ran out: recovered
    history = len(raw.transitions(dispatch_id))
    book = DestinationBook({"d": Destination(breaker=Breaker(failures=1, min_span_seconds=0))})
    for result in (TransportResult.throttle("429", retry_after=30), TransportResult.failure("x")):
        outcome = await finish_attempt(store, stale, result, now=T0 + 21, destinations=book)
        assert outcome is Outcome.CONFLICT
    row = raw.row(dispatch_id)
    assert (row["status"], row["attempt"], row["throttles"]) == ("delivering", 2, 0)
    assert len(raw.transitions(dispatch_id)) == history
    assert destination(raw, "d") is None and audit(raw, "d") == []
    assert current.attempt == 2


async def test_a_destination_without_a_policy_pays_no_write_for_its_deliveries(
    store: SQLiteStore, raw: RawDB
) -> None:
    book = DestinationBook()
    for i, result in enumerate([TransportResult.success(), TransportResult.failure("boom")] * 3):
        await enqueue_dispatch(store, kind="k", deliver_to="plain", now=T0 + i)
        [claim], _ = await claim_due(store, now=T0 + i)
        await finish_attempt(store, claim, result, now=T0 + i, destinations=book)
    assert destination(raw, "plain") is None
    # Once it has a row (a throttle made one), its last success and failure are
    # kept there, at most once a second.
    await enqueue_dispatch(store, kind="k", deliver_to="plain", now=T0 + 10)
    [claim], _ = await claim_due(store, now=T0 + 10)
    throttle = TransportResult.throttle("429", retry_after=1)
    await finish_attempt(store, claim, throttle, now=T0 + 10, destinations=book)
    for at in (T0 + 20, T0 + 20.5):
        dispatch_id = await enqueue_dispatch(store, kind="k", deliver_to="plain", now=at)
        [claim], _ = await claim_due(store, now=at, ids=[dispatch_id])
        await finish_attempt(store, claim, OK, now=at, destinations=book)
    state = destination(raw, "plain")
    assert state is not None
    assert (state["last_success_at"], state["failures"]) == (T0 + 20, 0)


async def test_one_finish_of_many_destinations_notes_health_only_where_a_row_is(
    store: SQLiteStore, raw: RawDB
) -> None:
    """A batch of ends to many destinations without a policy (the worker's
    finisher writes them in one transaction) asks once which have a row:
    those get their last success or failure, the others stay rowless."""
    book = DestinationBook()
    # "kept" has a row: a throttle made one.
    await enqueue_dispatch(store, kind="k", deliver_to="kept", now=T0)
    [claim], _ = await claim_due(store, now=T0)
    throttle = TransportResult.throttle("429", retry_after=1)
    await finish_attempt(store, claim, throttle, now=T0, destinations=book)
    names = ["a", "kept", "b", "c"]
    ids = [await enqueue_dispatch(store, kind="k", deliver_to=name, now=T0 + 10) for name in names]
    claims, _ = await claim_due(store, now=T0 + 10, limit=10, ids=ids)
    assert sorted(claim.deliver_to for claim in claims) == sorted(names)
    ends = [(claim, FAIL if claim.deliver_to == "b" else OK, Effects()) for claim in claims]
    outcomes, more, _ = await finish_and_claim_many(
        store,
        ends,
        want=0,
        lease_seconds=15,
        rules=ClaimRules(),
        clock=lambda: T0 + 20,
        destinations=book,
    )
    assert len(outcomes) == 4 and more == []
    state = destination(raw, "kept")
    assert state is not None and state["last_success_at"] == T0 + 20
    assert all(destination(raw, name) is None for name in ("a", "b", "c"))


# -- the breaker --------------------------------------------------------------------

BREAKER = Breaker(
    failures=3,
    min_span_seconds=60,
    cool_down_seconds=10,
    max_cool_down_seconds=25,
    disable_after_seconds=100,
)


CLAIMED_BEFORE: Final = ClaimRules((OrderingKeys(),))
"""A claim that does not look at its destination's state: an attempt
claimed before the breaker's state it ends in (what an end does is this
file's; what the claim lets through is test_destination_admission.py's)."""


def breaker_book(**changes: Any) -> DestinationBook:
    fields = {**BREAKER.__dict__, **changes}
    return DestinationBook({"b": Destination(breaker=Breaker(**fields))})


async def attempt(
    store: SQLiteStore,
    at: float,
    result: TransportResult,
    book: DestinationBook,
    *,
    probe: RawDB | None = None,
    effects: Effects | None = None,
) -> Claim:
    """One attempt of a new row to "b" at ``at`` that ends with ``result``;
    with ``probe``, the claim side first made it the half-open breaker's
    probe (what the claim writes when it lets the probe go)."""
    dispatch_id = await enqueue_dispatch(store, kind="k", deliver_to="b", now=at)
    [claim], _ = await claim_due(store, now=at, ids=[dispatch_id], rules=CLAIMED_BEFORE)
    if probe is not None:
        probe.execute(
            "UPDATE dispatch_destinations SET state = 'half_open', probe_id = ?, probe_until = ? "
            "WHERE name = 'b'",
            (claim.dispatch_id, claim.lease_until),
        )
    await finish_attempt(store, claim, result, now=at, destinations=book, effects=effects)
    return claim


FAIL = TransportResult.failure("HTTP 500: boom")
OK = TransportResult.success()


async def test_the_breaker_opens_after_its_failures_span_min_span_not_on_throttles_or_gone(
    store: SQLiteStore, raw: RawDB, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="trio_dispatch.destinations")
    book = breaker_book()
    for at in (T0, T0 + 10, T0 + 20):  # three in a row, but over 20 s only
        await attempt(store, at, FAIL, book)
    await attempt(store, T0 + 30, TransportResult.throttle("429", retry_after=5), book)
    await attempt(store, T0 + 40, TransportResult.failure("HTTP 410: gone", gone=True), book)
    await attempt(store, T0 + 45, TransportResult.not_sent("EMFILE"), book)
    state = destination(raw, "b")
    assert state is not None
    assert (state["state"], state["failures"], state["first_failure_at"]) == ("active", 3, T0)
    assert state["last_failure_at"] == T0 + 20
    effects = Effects()
    await attempt(store, T0 + 70, FAIL, book, effects=effects)  # 4 over 70 s: open
    state = destination(raw, "b")
    assert state is not None
    assert (state["state"], state["state_until"], state["cool_down"], state["opened_at"]) == (
        "open",
        T0 + 80,
        10,
        T0 + 70,
    )
    assert state["reason"] == "4 failed attempts in a row over 70s; last: HTTP 500: boom"
    assert audit(raw, "b")[-1] == ("active", "open", state["reason"], "scheduler", T0 + 80)
    assert effects.transitions == [("b", "open")]
    [warning] = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert "destination b: active -> open until" in warning.getMessage()


async def test_a_success_sets_the_failures_back_writing_only_what_changed(
    store: SQLiteStore, raw: RawDB
) -> None:
    book = breaker_book()
    await attempt(store, T0, OK, book)  # the first: the row made, its success kept
    state = destination(raw, "b")
    assert state is not None and state["last_success_at"] == T0
    await attempt(store, T0 + 0.5, OK, book)  # nothing changed within the second: no write
    assert destination(raw, "b") == state
    await attempt(store, T0 + 1, FAIL, book)
    await attempt(store, T0 + 2, FAIL, book)
    await attempt(store, T0 + 2.5, OK, book)
    state = destination(raw, "b")
    assert state is not None
    assert (state["failures"], state["first_failure_at"], state["last_success_at"]) == (
        0,
        None,
        T0 + 2.5,
    )
    assert audit(raw, "b") == []


async def test_a_failed_probe_doubles_the_cool_down_to_its_cap_then_disables(
    store: SQLiteStore, raw: RawDB, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="trio_dispatch.destinations")
    book = breaker_book(failures=1, min_span_seconds=0)
    await attempt(store, T0, FAIL, book)  # opened at T0 for 10 s
    for at, cool_down in ((T0 + 10, 20), (T0 + 30, 25), (T0 + 55, 25)):
        effects = Effects()
        await attempt(store, at, FAIL, book, probe=raw, effects=effects)
        state = destination(raw, "b")
        assert state is not None
        assert (state["state"], state["cool_down"], state["state_until"]) == (
            "open",
            cool_down,
            at + cool_down,
        )
        assert (state["opened_at"], state["probe_id"], state["probe_until"]) == (T0, None, None)
        assert audit(raw, "b")[-1][:3] == ("half_open", "open", "probe failed: HTTP 500: boom")
        assert effects.transitions == [("b", "open")]
    effects = Effects()
    await attempt(store, T0 + 100, FAIL, book, probe=raw, effects=effects)  # open 100 s
    state = destination(raw, "b")
    assert state is not None
    assert (state["state"], state["state_until"], state["probe_id"]) == ("disabled", None, None)
    assert audit(raw, "b")[-1][:3] == (
        "half_open",
        "disabled",
        "open for 100s (disable_after_seconds 100)",
    )
    assert effects.transitions == [("b", "disabled")]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 5 and "b: half_open -> disabled" in warnings[-1]
    assert await enable_destination(store, "b", now=T0 + 200)
    state = destination(raw, "b")
    assert state is not None and (state["state"], state["failures"]) == ("active", 0)


async def test_the_probe_succeeding_closes_the_breaker_and_no_other_success_does(
    store: SQLiteStore, raw: RawDB
) -> None:
    book = breaker_book(failures=1, min_span_seconds=0)
    await attempt(store, T0, FAIL, book)
    # Another row's success while the probe runs, and the probe's own row
    # under an older lease, leave it half-open.
    probe = await attempt(store, T0 + 10, FAIL, book, probe=raw)  # re-opened for 20 s
    raw.execute(
        "UPDATE dispatch_destinations SET state = 'half_open', probe_id = 'someone-else', "
        "probe_until = ? WHERE name = 'b'",
        (T0 + 60,),
    )
    await attempt(store, T0 + 31, OK, book)
    state = destination(raw, "b")
    assert state is not None and (state["state"], state["failures"]) == ("half_open", 0)
    raw.execute(
        "UPDATE dispatch_destinations SET probe_id = ?, probe_until = ? WHERE name = 'b'",
        (probe.dispatch_id, probe.lease_until + 1),
    )
    [again], _ = await claim_due(store, now=T0 + 200, ids=[probe.dispatch_id], rules=CLAIMED_BEFORE)
    await finish_attempt(store, again, OK, now=T0 + 200, destinations=book)
    state = destination(raw, "b")
    assert state is not None and state["state"] == "half_open"  # not this lease's probe
    effects = Effects()
    await attempt(store, T0 + 300, OK, book, probe=raw, effects=effects)
    state = destination(raw, "b")
    assert state is not None
    assert (state["state"], state["cool_down"], state["opened_at"], state["probe_id"]) == (
        "active",
        None,
        None,
        None,
    )
    assert (state["failures"], state["last_success_at"]) == (0, T0 + 300)
    assert audit(raw, "b")[-1][:3] == ("half_open", "active", "probe succeeded")
    assert effects.transitions == [("b", "active")]


async def test_a_probe_that_is_throttled_or_gone_lets_another_probe_go(
    store: SQLiteStore, raw: RawDB
) -> None:
    book = breaker_book(failures=1, min_span_seconds=0)
    await attempt(store, T0, FAIL, book)
    for at, result in (
        (T0 + 10, TransportResult.throttle("429", retry_after=5)),
        (T0 + 20, TransportResult.failure("HTTP 410", gone=True)),
    ):
        await attempt(store, at, result, book, probe=raw)
        state = destination(raw, "b")
        assert state is not None
        assert (state["state"], state["probe_id"], state["failures"]) == ("half_open", None, 1)


# -- the worker -----------------------------------------------------------------------


async def test_a_worker_logs_a_throttle_as_such_and_counts_it(
    store: SQLiteStore, raw: RawDB, server: Server, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="trio_dispatch")
    dispatch_id = await enqueue_dispatch(store, kind="k", deliver_to="d")
    worker = DispatchWorker(
        store,
        transport=webhook(server, "/slow-down-seconds"),
        destinations={"d": {"throttle_max_seconds": 10}},
        tick_seconds=3600,
    )
    started = time.time()
    async with anyio.create_task_group() as tg:
        await tg.start(worker.run)
        await wait_for(lambda: raw.row(dispatch_id)["throttles"] == 1)
        tg.cancel_scope.cancel()
    row = raw.row(dispatch_id)
    assert started + 10 <= float(row["next_attempt_at"]) <= time.time() + 10  # 30 s, capped
    [line] = [r for r in caplog.records if dispatch_id in r.getMessage()]
    message = line.getMessage()
    assert line.levelno == logging.INFO
    assert "result=throttled" in message and "throttled_until=" in message
    assert "next_in=10s" in message and "answer='HTTP 429: slow down'" in message
    assert "error=" not in message
    assert worker.destination_metrics.throttled_counts() == {"d": 1}
    assert worker.counts["retried"] == 0
    text = render(destination_families(worker)).decode()
    assert 'trio_dispatch_throttled_total{deliver_to="d"} 1.0' in text


async def test_a_worker_counts_the_breaker_changes_its_finishes_make(
    store: SQLiteStore, raw: RawDB
) -> None:
    await enqueue_dispatch(store, kind="k", deliver_to="b")

    async def down(delivery: Delivery) -> bool:
        return False

    worker = DispatchWorker(
        store,
        transport=down,
        destinations={"b": {"breaker": {"failures": 1, "min_span_seconds": 0}}},
        tick_seconds=3600,
    )
    async with anyio.create_task_group() as tg:
        await tg.start(worker.run)
        await wait_for(lambda: worker.counts["retried"] == 1)
        tg.cancel_scope.cancel()
    state = destination(raw, "b")
    assert state is not None and state["state"] == "open"
    assert worker.destination_metrics.transition_counts() == {("b", "open"): 1}
    text = render(destination_families(worker)).decode()
    assert 'trio_dispatch_breaker_transitions_total{deliver_to="b",to="open"} 1.0' in text
