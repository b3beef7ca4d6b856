"""The read commands ``ls``, ``show``, ``history`` and ``stats``: they run
on a store opened read-only and print rows, never change them.
"""

from __future__ import annotations

import argparse
import json
import time

from ..lifecycle import DUE_STATUSES, Status
from ..outbox import dispatch_stats, get_dispatch, list_dispatches, list_transitions
from ..outbox.reads import awaiting_ack, last_reasons, status_label
from ..redact import visible
from ..store.base import Store
from ..times import format_time
from .output import EXIT_OK, NotApplied, emit_json, format_table, public_row

_LS_KEYS = (
    "id",
    "kind",
    "deliver_to",
    "status",
    "attempt",
    "max_attempts",
    "next_attempt_at",
    "created_at",
    "updated_at",
    "expires_at",
    "last_error",
    "dedup_key",
    "ack_required",
)


async def cmd_ls(db: Store, args: argparse.Namespace) -> int:
    rows = await list_dispatches(db, status=args.status, kind=args.kind, limit=args.limit)
    reasons = await last_reasons(db, rows)
    if args.json:
        public = [public_row(r, show_token=False) for r in rows]
        emit_json(
            {
                "dispatches": [
                    {
                        **{k: r[k] for k in _LS_KEYS},
                        "awaiting_ack": awaiting_ack(r, reasons.get(r["id"])),
                    }
                    for r in public
                ]
            }
        )
        return EXIT_OK
    if not rows:
        print("no dispatches" + (f" with status {args.status}" if args.status else ""))
        return EXIT_OK
    now = time.time()
    table = [
        [
            visible(r["id"]),
            visible(r["kind"]),
            visible(r["deliver_to"]),
            visible(status_label(r, reasons.get(r["id"]))),
            f"{r['attempt']}/{r['max_attempts']}",
            format_time(r["next_attempt_at"], now) if r["status"] in DUE_STATUSES else "-",
            visible(r["last_error"] or ""),
        ]
        for r in rows
    ]
    print(
        format_table(
            ["ID", "KIND", "DELIVER_TO", "STATUS", "ATTEMPT", "NEXT", "LAST_ERROR"],
            table,
            flexible=6,
            wide=args.wide,
        )
    )
    return EXIT_OK


async def cmd_show(db: Store, args: argparse.Namespace) -> int:
    row = await get_dispatch(db, args.id)
    if row is None:
        raise NotApplied(f"dispatch {args.id!r} not found")
    shown = public_row(row, show_token=args.show_token)
    reasons = await last_reasons(db, [row])
    waiting = awaiting_ack(row, reasons.get(row["id"]))
    if args.json:
        emit_json({"dispatch": {**shown, "awaiting_ack": waiting}})
        return EXIT_OK
    now = time.time()
    for key, value in shown.items():
        if key == "payload":
            continue
        if key in ("next_attempt_at", "created_at", "updated_at", "expires_at"):
            text = format_time(None if value is None else float(value), now)
        elif key == "status" and waiting:
            text = f"{visible(value)} (awaiting ack)"
        else:
            text = "-" if value is None else visible(value)
        print(f"{key:<16}{text}")
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
    stats = await dispatch_stats(db)
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
