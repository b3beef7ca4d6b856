"""``schedules``: the configured schedules as the store knows them, and the
operator's three acts on one (docs/schedules.md).

``schedules`` lists each schedule of the configuration (its cadence,
timezone, paused flag, newest run and next fire) on a store opened
read-only, like the other read commands: it never creates, migrates or
changes anything. ``schedules pause NAME`` and ``schedules resume NAME``
set the flag every worker reads from the store (a worker notices within
its refresh period; resumed, the missed ticks follow the schedule's
``missed``); ``schedules run NAME`` fires one extra run now, flagged
manual, and prints its dispatch id. Pause and resume also take a name the
store knows that this configuration lacks (a schedule another deploy's
workers run). A name neither holds (``run``: the configuration does not
hold) is exit 1 with one line naming it and the configured names, and
nothing is written.
"""

from __future__ import annotations

import argparse
import time
from functools import partial
from typing import Any

from ..outbox.enqueue import EnqueueCall
from ..redact import visible
from ..schedules.runs import Fired, Listing, fire_manual, listing, set_paused
from ..schedules.service import REFRESH_SECONDS
from ..schedules.spec import Schedule
from ..store.base import DEFAULT_MAX_BODY_BYTES, Store
from ..times import format_time
from .output import EXIT_OK, NotApplied, emit_json, format_table
from .target import StoreChoice

ACTIONS = ("pause", "resume", "run")
"""What ``schedules ACTION NAME`` may do; without an action it lists."""


def schedule_named(schedules: tuple[Schedule, ...], name: str) -> Schedule:
    """The configured schedule called ``name``; :class:`NotApplied` (exit 1)
    naming it and every configured name when there is none."""
    for schedule in schedules:
        if schedule.name == name:
            return schedule
    configured = ", ".join(visible(s.name) for s in schedules) or "none"
    raise NotApplied(
        f"no schedule named {visible(repr(name))} in the configuration (configured: {configured})"
    )


def is_read(args: argparse.Namespace) -> bool:
    """Whether this ``schedules`` command only reads (the listing)."""
    return getattr(args, "action", None) is None


def check_schedules_args(args: argparse.Namespace, choice: StoreChoice) -> None:
    """Before the store is opened: keep the configuration's schedules (and
    body limit) in ``args``; ``run`` of a name not configured is
    :class:`NotApplied`, the store untouched (pause and resume look in the
    store too)."""
    args.configured_schedules = choice.schedules
    args.max_body_bytes = choice.max_body_bytes or DEFAULT_MAX_BODY_BYTES
    if getattr(args, "action", None) == "run":
        schedule_named(choice.schedules, args.name)


async def cmd_schedules(db: Store, args: argparse.Namespace) -> int:
    """List the schedules, or pause, resume or run the one named (after
    :func:`check_schedules_args`)."""
    action = getattr(args, "action", None)
    if action is None:
        return await _list(db, args, args.configured_schedules)
    now = time.time()
    if action in ("pause", "resume"):
        return await _set_paused(db, args, action == "pause", now)
    schedule = schedule_named(args.configured_schedules, args.name)  # action "run"
    with EnqueueCall(args.max_body_bytes) as call:  # held to the configuration's limit
        run: Fired = await db.write(partial(fire_manual, schedule=schedule, now=now, call=call))
        call.written([run.dispatch_id])
    db.notify_enqueued()
    if args.json:
        emit_json(
            {
                "schedule": run.schedule,
                "origin": run.origin,
                "run_id": run.run_id,
                "dispatch_id": run.dispatch_id,
            }
        )
    else:
        print(f"ran schedule {visible(schedule.name)} (manual): dispatch {run.dispatch_id}")
    return EXIT_OK


async def _set_paused(db: Store, args: argparse.Namespace, paused: bool, now: float) -> int:
    """Pause or resume the schedule named: a configured one (recorded first
    if no worker has seen it), else one the store knows."""
    name: str = args.name
    configured = next((s for s in args.configured_schedules if s.name == name), None)
    changed: bool | None = await db.write(
        partial(set_paused, name=name, paused=paused, now=now, known_only=configured is None)
    )
    if changed is None:
        names = ", ".join(visible(s.name) for s in args.configured_schedules) or "none"
        raise NotApplied(
            f"no schedule named {visible(repr(name))} in the configuration "
            f"(configured: {names}) or in the store"
        )
    shown = visible(name)
    if args.json:
        emit_json({"schedule": name, "paused": paused, "changed": changed})
    elif changed and paused:
        print(f"paused schedule {shown}" + ("" if configured else " (not in this configuration)"))
    elif changed:
        follows = (
            f"its missed ticks follow missed: {configured.missed}"
            if configured is not None
            else "not in this configuration: its missed ticks follow the missed of the "
            "workers that have it"
        )
        print(
            f"resumed schedule {shown} (running workers take it up within "
            f"{REFRESH_SECONDS:g}s; {follows})"
        )
    else:
        state = "paused" if paused else "not paused"
        print(f"schedule {shown} was already {state}: nothing to do")
    return EXIT_OK


def _last(last: Any, now: float) -> tuple[str, str, str]:
    if last is None:
        return "-", "-", "-"
    return (
        format_time(float(last["scheduled_for"]), now),
        format_time(float(last["created_at"]), now),
        visible(last["origin"]),
    )


def _definition(entry: Listing) -> str:
    """Whether this configuration's definition is the one in force."""
    if entry.in_force is None:
        return "-"  # no worker has recorded one yet
    return f"differs: {entry.in_force} in force" if entry.differs else "in force"


async def _list(db: Store, args: argparse.Namespace, schedules: tuple[Schedule, ...]) -> int:
    now = time.time()
    found = await db.read(partial(listing, schedules=schedules, now=now))
    if args.json:
        emit_json({"schedules": [entry.to_dict() for entry in found]})
        return EXIT_OK
    if not found:
        print("no schedules configured (the configuration's schedules: section)")
        return EXIT_OK
    rows = []
    for entry in found:
        schedule = entry.schedule
        paused = bool(entry.state and entry.state.paused)
        tick, fired, origin = _last(entry.last_run, now)
        rows.append(
            [
                visible(schedule.name),
                visible(schedule.cadence),
                visible(schedule.timezone),
                "yes" if paused else "no",
                tick,
                fired,
                origin,
                "paused" if paused else format_time(entry.next_fire, now),
                _definition(entry),
            ]
        )
    headers = [
        "NAME", "SCHEDULE", "TIMEZONE", "PAUSED", "LAST_TICK", "FIRED_AT", "ORIGIN", "NEXT",
        "DEFINITION",
    ]  # fmt: skip
    print(format_table(headers, rows, flexible=1, wide=args.wide))
    return EXIT_OK
