"""The read commands ``ls``, ``show``, ``history`` and ``stats``: they run
on a store opened read-only and print rows, never change them.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any, Final

from ..lifecycle import DUE_STATUSES, Status
from ..outbox import dispatch_stats, get_dispatch, list_dispatches, list_transitions
from ..outbox.reads import (
    awaiting_ack,
    last_reasons,
    list_blocked_heads,
    status_label,
    superseded_by,
    waiting_behind,
    waiting_ids,
)
from ..redact import visible
from ..store.base import Store
from ..times import format_time
from .output import EXIT_OK, NotApplied, UsageError, emit_json, format_table, public_row

_LS_KEYS = (
    "id",
    "kind",
    "deliver_to",
    "status",
    "attempt",
    "max_attempts",
    "throttles",
    "next_attempt_at",
    "created_at",
    "updated_at",
    "expires_at",
    "last_error",
    "dedup_key",
    "ack_required",
    "ordering_key",
    "priority",
    "coalesce_key",
)
WAITING: Final = "waiting"
"""What a row waiting for its ordering key shows as its next attempt."""


KEY_COLUMN_WIDTH: Final = 24
"""On a terminal, ``ls`` cuts an ordering key to this many characters
(``--wide``, a pipe or ``show`` print it whole)."""


def _next_attempt(row: dict[str, Any], now: float, waiting: bool) -> str:
    if waiting:
        return WAITING
    return format_time(row["next_attempt_at"], now) if row["status"] in DUE_STATUSES else "-"


def _attempts(row: dict[str, Any]) -> str:
    """Counted of allowed; the throttled attempts (not counted) after."""
    throttles = int(row.get("throttles") or 0)
    counted = f"{row['attempt'] - throttles}/{row['max_attempts']}"
    return f"{counted} +{throttles} throttled" if throttles else counted


def _priority(row: dict[str, Any]) -> str:
    """Signed (``+5``, ``-3``), or ``0``."""
    priority = int(row.get("priority") or 0)
    return f"{priority:+d}" if priority else "0"


async def _listed(db: Store, args: argparse.Namespace) -> list[dict[str, Any]]:
    if not args.blocked:
        return await list_dispatches(
            db,
            status=args.status,
            kind=args.kind,
            ordering_key=args.ordering_key,
            coalesce_key=args.coalesce_key,
            limit=args.limit,
        )
    if args.status is not None or args.kind is not None or args.coalesce_key is not None:
        raise UsageError(
            "--blocked lists the heads of blocked keys: give it without --status, --kind "
            "or --coalesce-key"
        )
    return await list_blocked_heads(
        db, ordering=args.ordering, limit=args.limit, ordering_key=args.ordering_key
    )


def _nothing(args: argparse.Namespace) -> str:
    if args.blocked:
        if args.ordering == "skip":
            return "no blocked keys (dispatch.ordering.on_dead_letter is skip: no key blocks)"
        return "no blocked keys" + (
            f" with ordering key {visible(args.ordering_key)}" if args.ordering_key else ""
        )
    filters = [
        f"{name} {visible(value)}"
        for name, value in (
            ("status", args.status),
            ("kind", args.kind),
            ("ordering key", args.ordering_key),
            ("coalesce key", args.coalesce_key),
        )
        if value is not None
    ]
    return "no dispatches" + (f" with {', '.join(filters)}" if filters else "")


async def cmd_ls(db: Store, args: argparse.Namespace) -> int:
    rows = await _listed(db, args)
    reasons = await last_reasons(db, rows)
    waiting = await waiting_ids(db, rows, args.ordering)
    if args.json:
        public = [public_row(r, show_token=False) for r in rows]
        document: dict[str, Any] = {
            "dispatches": [
                {
                    **{k: r[k] for k in _LS_KEYS},
                    "awaiting_ack": awaiting_ack(r, reasons.get(r["id"])),
                    "waiting": r["id"] in waiting,
                }
                for r in public
            ]
        }
        if args.blocked:
            document["on_dead_letter"] = args.ordering
        emit_json(document)
        return EXIT_OK
    if not rows:
        print(_nothing(args))
        return EXIT_OK
    now = time.time()
    keyed = any(r.get("ordering_key") is not None for r in rows)
    # Shown when a row on the page has one other than the default, as KEY is.
    ranked = any(r.get("priority") for r in rows)
    table = [
        [
            visible(r["id"]),
            visible(r["kind"]),
            visible(r["deliver_to"]),
            visible(status_label(r, reasons.get(r["id"]))),
            *([_priority(r)] if ranked else []),
            _attempts(r),
            _next_attempt(r, now, r["id"] in waiting),
            *([visible(r["ordering_key"] or "-")] if keyed else []),
            visible(r["last_error"] or ""),
        ]
        for r in rows
    ]
    headers = ["ID", "KIND", "DELIVER_TO", "STATUS", *(["PRI"] if ranked else []), "ATTEMPT"]
    headers += ["NEXT", "KEY", "LAST_ERROR"] if keyed else ["NEXT", "LAST_ERROR"]
    print(
        format_table(
            headers,
            table,
            flexible=len(headers) - 1,
            wide=args.wide,
            capped={headers.index("KEY"): KEY_COLUMN_WIDTH} if keyed else None,
        )
    )
    return EXIT_OK


async def cmd_show(db: Store, args: argparse.Namespace) -> int:
    row = await get_dispatch(db, args.id)
    if row is None:
        raise NotApplied(f"dispatch {args.id!r} not found")
    shown = public_row(row, show_token=args.show_token)
    reasons = await last_reasons(db, [row])
    acking = awaiting_ack(row, reasons.get(row["id"]))
    waiting = row["id"] in await waiting_ids(db, [row], args.ordering)
    behind = await waiting_behind(db, row, args.ordering)
    successor = await superseded_by(db, row)
    if args.json:
        emit_json(
            {
                "dispatch": {
                    **shown,
                    "awaiting_ack": acking,
                    "waiting": waiting,
                    "waiting_behind": behind,
                    "superseded_by": successor,
                }
            }
        )
        return EXIT_OK
    now = time.time()
    for key, value in shown.items():
        if key == "payload":
            continue
        if key == "next_attempt_at" and waiting:
            text = WAITING
        elif key in (
            "next_attempt_at",
            "created_at",
            "updated_at",
            "expires_at",
            "cancel_requested_at",
            "coalesce_since",
            "not_before",
        ):
            text = format_time(None if value is None else float(value), now)
        elif key == "status" and acking:
            text = f"{visible(value)} (awaiting ack)"
        else:
            text = "-" if value is None else visible(value)
        print(f"{key + ' ':<16}{text}")  # a name of 16 or more keeps a space
    if behind is not None:
        print(f"{'waiting behind':<16}{visible(behind['id'])} ({visible(behind['status'])})")
    if successor is not None:
        print(f"{'superseded by':<16}{visible(successor)}")
    print("payload:")
    # JSON escapes C0 controls itself; the rest (C1, bidi, separators) is made
    # visible line by line ("\n" only: a string may hold U+2028).
    for line in json.dumps(shown["payload"], indent=2, ensure_ascii=False).split("\n"):
        print(visible(line))
    return EXIT_OK


async def cmd_history(db: Store, args: argparse.Namespace) -> int:
    transitions = await list_transitions(db, args.id)
    if not transitions:
        raise NotApplied(f"dispatch {args.id!r} has no history")
    if args.json:
        emit_json({"id": args.id, "transitions": transitions})
        return EXIT_OK
    now = time.time()
    rows = [
        [
            format_time(float(t["created_at"]), now),
            visible(f"{t['previous_status'] or '-'} -> {t['status']}"),
            visible(t["reason_code"]),
            visible(f"{t['source']}/{t['actor']}"),
            visible(t["reason_summary"]),
        ]
        for t in transitions
    ]
    print(
        format_table(
            ["WHEN", "CHANGE", "REASON", "BY", "SUMMARY"], rows, flexible=4, wide=args.wide
        )
    )
    return EXIT_OK


async def cmd_stats(db: Store, args: argparse.Namespace) -> int:
    stats = await dispatch_stats(db, ordering=args.ordering)
    if args.json:
        emit_json(stats)
        return EXIT_OK
    for status in Status:
        print(f"{status:<28}{stats['counts'][status]}")
    print(f"{'total':<28}{stats['total']}")
    age = stats["oldest_due_pending_age_seconds"]
    now = time.time()
    print(f"{'oldest due pending':<28}{'-' if age is None else format_time(now - age, now)}")
    print(f"{'dead letters (last 24 h)':<28}{stats['dead_letters_last_24h']}")
    return EXIT_OK
