"""``destinations``: what operators see of each destination and their three
acts on one (docs/destinations.md).

``destinations`` lists each destination the configuration names (``"*"``
excepted), each with live rows and each with state in the store: its state
(``active``, ``paused``, ``throttled``, ``open``, ``half_open``,
``disabled``), until when and why, its rate and the starts it admits now,
its shared concurrency used and limit, pending rows (counted up to 10,000),
how long the oldest due row has waited, last success and failure and
failures in a row; ``destinations show NAME`` one of them whole, with its
newest audit rows. Both open the store read-only, like every read command:
they never create, migrate or change anything (an ended pause reads as
``active`` and is recorded by the next worker or operator change).

``destinations pause NAME [--for DURATION | --until TIME] [--reason TEXT]``,
``resume NAME`` and ``enable NAME`` change the state every worker reads
from the store, each with its audit row (actor ``trio-dispatch destinations
ACTION (user)``), and print one line: what it was, what it is, until when.
A resume of a destination that is not paused, or an enable of one whose
breaker is closed, changes nothing and says so (exit 0, as the schedules'
pause and resume do). A name that is neither configured, nor has live rows
nor state in the store is exit 1 naming it, and nothing is written: a
mistyped name must not pause nothing in silence.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Mapping
from functools import partial
from typing import Any, Final

from ..destinations import (
    ANY_DESTINATION,
    enable_destination,
    pause_destination,
    resume_destination,
)
from ..destinations.inputs import TIME_HELP, parse_for, parse_until
from ..destinations.listing import (
    Entry,
    known,
    list_destinations,
    policy_text,
    show_destination,
    store_now,
)
from ..destinations.policy import Destination
from ..destinations.state import Seen, State, effective, read
from ..outbox.reads import WAITING
from ..redact import visible
from ..store.base import Conn, Store
from ..times import format_time, relative_time
from ..validate import require_route
from .operate import _actor
from .output import EXIT_OK, NotApplied, emit_json, format_table
from .target import StoreChoice

ACTIONS: Final = ("show", "pause", "resume", "enable")
"""What ``destinations ACTION NAME`` may do; without an action it lists."""
WRITES: Final = frozenset({"pause", "resume", "enable"})


def destination_arg(text: str) -> str:
    """A destination's name as ``NAME`` (a ``deliver_to`` value, not
    ``"*"``); a bad one is a usage error naming it."""
    if text == ANY_DESTINATION:
        raise argparse.ArgumentTypeError(
            "'*' names the defaults of every destination, not one: name a deliver_to value"
        )
    try:
        return require_route(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(visible(str(exc))) from None


def for_arg(text: str) -> float:
    """``--for DURATION``: ``parse_duration``'s grammar, more than nothing."""
    try:
        return parse_for(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(visible(str(exc))) from None


def until_arg(text: str) -> float:
    try:
        return parse_until(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(visible(str(exc))) from None


def is_read(args: argparse.Namespace) -> bool:
    """Whether this ``destinations`` command only reads (the listing, ``show``)."""
    return getattr(args, "action", None) not in WRITES


def check_destinations_args(args: argparse.Namespace, choice: StoreChoice) -> None:
    """Before the store is opened: keep the configuration's policies in ``args``."""
    args.policies = dict(choice.destinations)


async def cmd_destinations(db: Store, args: argparse.Namespace) -> int:
    """List the destinations, show one, or pause, resume or enable one
    (after :func:`check_destinations_args`)."""
    action = getattr(args, "action", None)
    policies: dict[str, Destination] = args.policies
    if action is None:
        return await _list(db, args, policies)
    if action == "show":
        return await _show(db, args, policies)
    before = await db.read(partial(_before, policies=policies, name=args.name))
    if before is None:
        raise NotApplied(_unknown(args.name, policies))
    actor = _actor(f"destinations {action}")
    if action == "pause":
        was = await pause_destination(
            db,
            args.name,
            for_seconds=args.for_seconds,
            until=args.until,
            reason=args.reason,
            actor=actor,
        )
        stored = await db.read(partial(read, name=args.name))
        until = None if stored is None else stored["state_until"]
        return _report(args, "pause", True, was.state, State.PAUSED, until, time.time())
    if action == "resume":
        changed = await resume_destination(db, args.name, reason=args.reason, actor=actor)
    else:
        changed = await enable_destination(db, args.name, reason=args.reason, actor=actor)
    after = await db.read(partial(_before, policies=policies, name=args.name))
    to = State.ACTIVE if after is None else after.state
    return _report(
        args,
        action,
        changed,
        before.state if changed else to,
        to,
        None if after is None else after.until,
        time.time(),
    )


def _before(conn: Conn, policies: Mapping[str, Destination], name: str) -> Seen | None:
    """``name``'s state now, or None when it is not a destination
    operators can see."""
    if not known(conn, policies, name):
        return None
    return effective(read(conn, name), store_now(conn, time.time()))


def _unknown(name: str, policies: Mapping[str, Destination]) -> str:
    configured = ", ".join(visible(n) for n in sorted(policies) if n != ANY_DESTINATION)
    return (
        f"no destination named {visible(repr(name))}: not in the configuration's "
        f"destinations (configured: {configured or 'none'}), no live rows and no state "
        "in the store"
    )


def _report(
    args: argparse.Namespace,
    action: str,
    changed: bool,
    previous: State,
    state: State,
    until: float | None,
    now: float,
) -> int:
    name = args.name
    if args.json:
        emit_json(
            {
                "destination": name,
                "action": action,
                "changed": changed,
                "from": str(previous),
                "to": str(state),
                "until": until,
                "reason": args.reason,
            }
        )
        return EXIT_OK
    shown = visible(name)
    if not changed:
        why = "was not paused" if action == "resume" else "has no breaker open or disabled"
        print(f"destination {shown} {why} (it is {state}): nothing to do")
        return EXIT_OK
    verb = {"pause": "paused", "resume": "resumed", "enable": "enabled"}[action]
    end = ""
    if state is State.PAUSED:
        end = " until resumed" if until is None else f" until {format_time(until, now)}"
    elif until is not None:
        end = f" until {format_time(until, now)}"
    print(f"{verb} destination {shown}: {previous} -> {state}{end}")
    return EXIT_OK


def _age(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    return relative_time(0.0, seconds).removesuffix(" ago")


def _starts(entry: Entry) -> str:
    if entry.starts_available is None:
        return "-"
    return f"{entry.starts_available}/{entry.policy.burst}"


def _running(entry: Entry) -> str:
    limit = entry.policy.concurrency
    return f"{entry.running}/{'-' if limit is None else limit}"


async def _list(db: Store, args: argparse.Namespace, policies: dict[str, Destination]) -> int:
    found = await list_destinations(db, policies, waiting=WAITING[args.ordering])
    if args.json:
        emit_json(
            {
                "destinations": [entry.to_dict() for entry in found.entries],
                "truncated": found.truncated,
            }
        )
        return EXIT_OK
    if not found.entries:
        print("no destinations: none configured (destinations:), none with live rows")
        return EXIT_OK
    now = found.now
    rows = [
        [
            visible(entry.name),
            str(entry.state),
            relative_time(entry.seen.until, now),
            "-" if entry.policy.gcra_rate is None else str(entry.policy.gcra_rate),
            _starts(entry),
            _running(entry),
            entry.pending_text(),
            _age(entry.oldest_due_age),
            str(entry.failures),
            relative_time(entry.last_success_at, now),
            relative_time(entry.last_failure_at, now),
            visible(entry.seen.reason or ""),
        ]
        for entry in found.entries
    ]
    headers = [
        "NAME", "STATE", "UNTIL", "RATE", "STARTS", "RUNNING", "PENDING", "OLDEST_DUE",
        "FAILS", "LAST_OK", "LAST_FAIL", "REASON",
    ]  # fmt: skip
    print(format_table(headers, rows, flexible=len(headers) - 1, wide=args.wide))
    if found.truncated:
        print(f"(the first {len(found.entries)} by name: more exist; `show NAME` shows any)")
    return EXIT_OK


async def _show(db: Store, args: argparse.Namespace, policies: dict[str, Destination]) -> int:
    now, entry = await show_destination(db, policies, args.name, waiting=WAITING[args.ordering])
    if entry is None:
        raise NotApplied(_unknown(args.name, policies))
    if args.json:
        emit_json({"destination": {**entry.to_dict(), "changes": _changes(entry)}})
        return EXIT_OK
    origin = {"own": "configured", "*": 'policy of "*"', "default": "not configured: no limits"}
    state = str(entry.state)
    if entry.seen.until is not None:
        state += f" until {format_time(entry.seen.until, now)}"
    elif entry.state is State.PAUSED:
        state += " until resumed"
    if entry.seen.reason:
        state += f": {visible(entry.seen.reason)}"
    lines = [
        ("destination", f"{visible(entry.name)} ({origin[entry.policy_from]})"),
        ("state", state),
        ("policy", policy_text(entry.policy)),
        (
            "starts available",
            "- (no rate)"
            if entry.starts_available is None
            else f"{entry.starts_available} of {entry.policy.burst}"
            + (f" ({entry.starts_held} claimed ahead, not yet begun)" if entry.starts_held else ""),
        ),
        (
            "concurrency",
            f"{entry.running} running of "
            f"{'no limit' if entry.policy.concurrency is None else entry.policy.concurrency}",
        ),
        ("pending", entry.pending_text()),
        (
            "oldest due",
            "-" if entry.oldest_due_age is None else format_time(now - entry.oldest_due_age, now),
        ),
        ("throttled until", format_time(entry.throttled_until, now)),
        ("failures in a row", str(entry.failures)),
        ("last success", format_time(entry.last_success_at, now)),
        ("last failure", format_time(entry.last_failure_at, now)),
    ]
    for key, text in lines:
        print(f"{key:<20}{text}")
    if not entry.changes:
        print("changes: none")
        return EXIT_OK
    print("changes (newest first):")
    rows = [
        [
            format_time(change.at, now),
            f"{change.previous or '-'} -> {change.state}",
            format_time(change.until, now) if change.until is not None else "-",
            visible(f"{change.source}/{change.actor}"),
            visible(change.reason or ""),
        ]
        for change in entry.changes
    ]
    print(
        format_table(["WHEN", "CHANGE", "UNTIL", "BY", "REASON"], rows, flexible=4, wide=args.wide)
    )
    return EXIT_OK


def _changes(entry: Entry) -> list[dict[str, Any]]:
    return [change.to_dict() for change in entry.changes]


__all__ = [
    "ACTIONS",
    "TIME_HELP",
    "check_destinations_args",
    "cmd_destinations",
    "destination_arg",
    "for_arg",
    "is_read",
    "until_arg",
]
