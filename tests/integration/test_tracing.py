"""The trace context at the destination (docs/tracing.md): a real local
HTTP receiver gets ``traceparent``, a real command child ``TRACEPARENT``,
both the attempt's ``process`` span; and without opentelemetry importable,
enqueue and delivery work and nothing of it is imported."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from trio_dispatch import deliver_due_dispatches, enqueue_dispatch
from trio_dispatch.store import SQLiteStore
from trio_dispatch.transports.webhook import WebhookTransport

from ..conftest import RawDB
from ..engine.test_tracing import by_kind, stored_metadata, traceparent
from ..helpers import command, write_script
from ..http_server import Server, serve
from .test_webhook import endpoints, verify

pytestmark = pytest.mark.anyio

T0 = 1_000_000.0


@pytest.fixture
def server() -> Iterator[Server]:
    with serve() as running:
        yield running


async def test_the_webhook_request_carries_the_attempts_traceparent(
    store: SQLiteStore, raw: RawDB, server: Server, spans: Any
) -> None:
    dispatch_id = await enqueue_dispatch(store, kind="invoice.paid", deliver_to="billing", now=T0)
    transport = WebhookTransport(endpoints({"billing": server.url + "/fail"}))
    await deliver_due_dispatches(store, transport=transport, now=T0)
    [request] = server.requests
    [create] = by_kind(spans, "producer")
    [process] = by_kind(spans, "consumer")
    assert request.headers["traceparent"] == traceparent(process)
    assert stored_metadata(raw, dispatch_id)["traceparent"] == traceparent(create)
    assert process.links[0].context.span_id == create.context.span_id
    assert process.attributes["error.type"] == "500"
    assert verify(request)["body"] == {}  # the signature still covers the stored payload
    assert request.body == str(raw.row(dispatch_id)["payload"]).encode()


ENV_RECORDER = """
    import json, os, sys
    keys = ["TRACEPARENT", "TRACESTATE", "TRIO_DISPATCH_ID"]
    open(sys.argv[1], "w").write(json.dumps({k: os.environ.get(k) for k in keys}))
"""


async def test_the_command_child_gets_the_attempts_traceparent(
    store: SQLiteStore, tmp_path: Path, spans: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TRACEPARENT", "00-" + "1" * 32 + "-" + "2" * 16 + "-01")  # the worker's own
    record = tmp_path / "env.json"
    script = write_script(tmp_path, "env.py", ENV_RECORDER)
    dispatch_id = await enqueue_dispatch(store, kind="alert.fired", deliver_to="ops", now=T0)
    counts = await deliver_due_dispatches(
        store, notify_template=command(script, str(record)), now=T0
    )
    assert counts["delivered"] == 1
    [process] = by_kind(spans, "consumer")
    assert json.loads(record.read_text()) == {
        "TRACEPARENT": traceparent(process),
        "TRACESTATE": None,
        "TRIO_DISPATCH_ID": dispatch_id,
    }


WITHOUT_OTEL = """
    import importlib.abc, sys

    class Refuse(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name == "opentelemetry" or name.startswith("opentelemetry."):
                raise ModuleNotFoundError(f"No module named {name!r}", name=name)
            return None

    sys.meta_path.insert(0, Refuse())

    import json, sqlite3, trio
    import trio_dispatch
    from trio_dispatch import sync, tracing

    async def main():
        async with trio_dispatch.open_store(sys.argv[1]) as db:
            one = await trio_dispatch.enqueue_dispatch(db, kind="k", deliver_to="d")
            many = await trio_dispatch.enqueue_many(db, [{"kind": "k", "deliver_to": "e"}])
            conn = sqlite3.connect(sys.argv[1])
            sync.enqueue_dispatch(conn, kind="k", deliver_to="f")
            conn.commit()
            conn.close()
            check = "import os; assert 'TRACEPARENT' not in os.environ"
            command = await trio_dispatch.deliver_due_dispatches(
                db, notify_template=[sys.executable, "-c", check]
            )
            row = await trio_dispatch.get_dispatch(db, one)
            return command, row["payload"]["metadata"], len(many)

    counts, metadata, many = trio.run(main)
    print(json.dumps({
        "counts": counts,
        "metadata": metadata,
        "active": tracing.ACTIVE,
        "imported": sorted(m for m in sys.modules if m.startswith("opentelemetry")),
    }))
"""


def test_without_opentelemetry_nothing_is_imported_and_all_works(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(WITHOUT_OTEL), str(tmp_path / "o.db")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    found = json.loads(done.stdout)
    assert found == {
        "counts": {"attempted": 3, "delivered": 3, "dead_letter": 0, "expired": 0, "retried": 0},
        "metadata": {"lion_class": "trio_dispatch.signal.DispatchSignal"},
        "active": False,
        "imported": [],
    }
