"""The main job, for a newcomer: a worker on an embedded SQLite file with the
demo transport, fed a few demo dispatches. Within seconds the log shows
deliveries, a retry scheduled with backoff, and a dead letter; the flaky
route's retry is delivered 60 s later. Ctrl-C stops it cleanly.

With --webhook, the dispatches go out as signed HTTP POSTs instead, to a
small receiver started on 127.0.0.1 for the run (scripts/webhook_receiver.py)
that checks each Standard Webhooks signature; its store is
outbox-webhook.db next to the config, so the command demo's file is untouched.

    ./scripts/run                         # uses config.example.yaml
    ./scripts/run --config my.yaml
    ./scripts/run --webhook               # the webhook transport
    ./scripts/run --webhook --db /tmp/hooks.db
"""

from __future__ import annotations

import argparse
import base64
import dataclasses
import logging
import os
import secrets
import shlex
from collections.abc import Awaitable, Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import anyio
from webhook_receiver import start_receiver  # beside this script

from trio_dispatch import enqueue_many
from trio_dispatch.cli import configure_logging, serve
from trio_dispatch.config import Config, WebhookConfig, load_config
from trio_dispatch.redact import mask_url
from trio_dispatch.store.base import Store
from trio_dispatch.transports.webhook import parse_endpoints

ROOT = Path(__file__).resolve().parents[1]
WEBHOOK_STORE = "outbox-webhook.db"
log = logging.getLogger("trio_dispatch.demo")

DEMO: list[dict[str, Any]] = [
    {"kind": "build_finished", "deliver_to": "seat-1", "body": {"build": 41, "ok": True}},
    {"kind": "build_finished", "deliver_to": "seat-2", "body": {"build": 42, "ok": True}},
    {"kind": "review_requested", "deliver_to": "seat-3", "body": {"pr": 7}},
    {"kind": "build_finished", "deliver_to": "flaky-seat", "body": {"build": 43}},
    {
        "kind": "build_finished",
        "deliver_to": "offline-seat",
        "body": {"build": 44},
        "max_attempts": 1,
    },
]

WEBHOOK_DEMO: list[dict[str, Any]] = [
    {"kind": "build_finished", "deliver_to": "seat-1", "body": {"build": 41, "ok": True}},
    {"kind": "review_requested", "deliver_to": "seat-2", "body": {"pr": 7}},
    {"kind": "build_finished", "deliver_to": "retired-seat", "body": {"build": 42}},
    {"kind": "build_finished", "deliver_to": "unknown-seat", "body": {"build": 43}},
]
WEBHOOK_PATHS = {"seat-1": "/hooks/seat-1", "seat-2": "/hooks/seat-2", "retired-seat": "/gone"}
"""deliver_to -> receiver path; unknown-seat has no endpoint on purpose."""

WEBHOOK_HEADER = """\
== webhook demo
A receiver on {url} checks the Standard Webhooks signature of every
request (secret: random, made for this run, never printed) and answers 204,
410 Gone on /gone, or 401 for a bad signature. Its lines start "receiver:"
(stdout); the worker's log follows on stderr. You will see:
  seat-1, seat-2  a "receiver: ... signature ok" line, then result=delivered
  retired-seat    its endpoint answers 410: result=dead_letter at once
                  (reason dispatch.dead_letter.gone)
  unknown-seat    no endpoint for it: a recorded failure, result=retry
                  (tried again after 60 s, with backoff)
Store: {store}. Stop with Ctrl-C, then list its rows with
  .venv/bin/trio-dispatch --db {quoted} ls
"""


def make_enqueue(
    items: Sequence[Mapping[str, Any]], summary: str
) -> Callable[[Store], Awaitable[None]]:
    async def enqueue_demo(db: Store) -> None:
        results = await enqueue_many(db, items)
        log.info("enqueued %d demo dispatches: %s", len(results), summary)

    return enqueue_demo


def webhook_config(config: Config, receiver_url: str, secret: str) -> Config:
    """``config`` with the webhook transport, one endpoint per demo route."""
    spec = {
        route: {"url": receiver_url + path, "secrets": [secret], "allow_private": True}
        for route, path in WEBHOOK_PATHS.items()
    }
    endpoints = parse_endpoints("dispatch.webhook.endpoints", spec, os.environ)
    webhook = WebhookConfig(timeout_seconds=5, endpoints=endpoints)
    transports = {**config.dispatch.transports, "webhook": webhook}
    dispatch = dataclasses.replace(config.dispatch, transport="webhook", transports=transports)
    return dataclasses.replace(config, dispatch=dispatch)


def main() -> None:
    parser = argparse.ArgumentParser(
        prog="./scripts/run",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Afterwards, look at the rows: .venv/bin/trio-dispatch --db outbox.db ls "
        "(or show ID, history ID, stats). ./scripts/run creates .venv and installs the "
        "package on first use.",
    )
    parser.add_argument(
        "--config",
        metavar="FILE",
        default=str(ROOT / "config.example.yaml"),
        help="the configuration to run (default: config.example.yaml); its store and "
        "notify_template's relative paths are taken from its folder",
    )
    parser.add_argument(
        "--webhook",
        action="store_true",
        help="deliver as signed HTTP POSTs to a local receiver started for the run",
    )
    parser.add_argument(
        "--db",
        metavar="PATH",
        help="the SQLite store to use (default: the config's store; with --webhook, "
        f"{WEBHOOK_STORE} next to the config)",
    )
    args = parser.parse_args()
    config = load_config(args.config)
    if args.db:
        config = dataclasses.replace(config, store=os.path.abspath(args.db))
    elif args.webhook:
        config = dataclasses.replace(config, store=WEBHOOK_STORE)  # next to the config
    configure_logging(config.log_level)
    if not args.webhook:
        log.info("store: %s -- stop with Ctrl-C", mask_url(config.store_target()))
        enqueue = make_enqueue(
            DEMO,
            "3 deliver at once, flaky-seat retries once (after 60 s), offline-seat dead-letters",
        )
        anyio.run(lambda: serve(config, before_start=enqueue), backend="trio")
        return
    # The receiver prints a line per request; httpx's own line per request
    # (the full URL) would only repeat it.
    logging.getLogger("httpx").setLevel(logging.WARNING)
    secret = "whsec_" + base64.b64encode(secrets.token_bytes(32)).decode()
    receiver = start_receiver(secret)
    try:
        config = webhook_config(config, receiver.url, secret)
        print(
            WEBHOOK_HEADER.format(
                url=receiver.url,
                store=mask_url(config.store_target()),
                quoted=shlex.quote(config.store_target()),
            ),
            flush=True,
        )
        enqueue = make_enqueue(
            WEBHOOK_DEMO,
            "seat-1 and seat-2 deliver, retired-seat is gone (410), unknown-seat has no endpoint",
        )
        anyio.run(lambda: serve(config, before_start=enqueue), backend="trio")
    finally:
        receiver.stop()


if __name__ == "__main__":
    main()
