"""The main job, for a newcomer: a worker on an embedded SQLite file with the
demo transport, fed a few demo dispatches. Within seconds the log shows
deliveries, a retry scheduled with backoff, and a dead letter; the flaky
route's retry is delivered 60 s later. Ctrl-C stops it cleanly.

    ./scripts/run                         # uses config.example.yaml
    ./scripts/run --config my.yaml
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

import anyio

from trio_dispatch import enqueue_many
from trio_dispatch.cli import configure_logging, serve
from trio_dispatch.config import load_config
from trio_dispatch.redact import mask_url
from trio_dispatch.store.base import Store

ROOT = Path(__file__).resolve().parents[1]
log = logging.getLogger("trio_dispatch.demo")

DEMO = [
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


async def enqueue_demo(db: Store) -> None:
    results = await enqueue_many(db, DEMO)
    log.info(
        "enqueued %d demo dispatches: 3 deliver at once, flaky-seat retries once "
        "(after 60 s), offline-seat dead-letters",
        len(results),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=str(ROOT / "config.example.yaml"))
    args = parser.parse_args()
    config = load_config(args.config)
    configure_logging(config.log_level)
    log.info("store: %s -- stop with Ctrl-C", mask_url(config.store_target()))
    anyio.run(lambda: serve(config, before_start=enqueue_demo), backend="trio")


if __name__ == "__main__":
    main()
