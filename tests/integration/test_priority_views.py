"""What operators see of priority (docs/controls.md): ``ls`` (a PRI column
when a listed row has one other than 0, and ``--json``), ``show`` and its
``--json``, the dashboard's list and a dispatch's page."""

from __future__ import annotations

import json
import re
from pathlib import Path

import anyio
import pytest

from trio_dispatch import enqueue_dispatch, open_store
from trio_dispatch.store import SQLiteStore
from trio_dispatch.web import WebApp

from ..helpers import run_cli
from .test_web import serving


def _enqueue(db_path: Path, *priorities: int) -> list[str]:
    async def build() -> list[str]:
        async with open_store(db_path) as db:
            return [
                await enqueue_dispatch(db, kind=f"k{p}", deliver_to="d", priority=p)
                for p in priorities
            ]

    return anyio.run(build)


@pytest.mark.sqlite_only  # the command's own output; the engines share it
def test_ls_and_show_carry_the_priority(db_path: Path) -> None:
    [plain] = _enqueue(db_path, 0)
    header = run_cli("--db", str(db_path), "ls", "--wide").stdout.splitlines()[0].split()
    assert "PRI" not in header  # every row at 0: no column, as KEY for unkeyed rows
    urgent, low = _enqueue(db_path, 7, -3)
    lines = run_cli("--db", str(db_path), "ls", "--wide").stdout.splitlines()
    header = lines[0].split()
    assert header[:5] == ["ID", "KIND", "DELIVER_TO", "STATUS", "PRI"]
    shown = {line.split()[0]: line.split()[4] for line in lines[1:]}
    assert shown == {urgent: "+7", low: "-3", plain: "0"}
    listed = json.loads(run_cli("--db", str(db_path), "ls", "--json").stdout)["dispatches"]
    assert {row["id"]: row["priority"] for row in listed} == {urgent: 7, low: -3, plain: 0}
    text = run_cli("--db", str(db_path), "show", low).stdout
    assert re.search(r"^priority +-3$", text, re.MULTILINE), text
    document = json.loads(run_cli("--db", str(db_path), "show", urgent, "--json").stdout)
    assert document["dispatch"]["priority"] == 7
    assert "head_start" not in document["dispatch"]  # the store's bookkeeping


@pytest.mark.anyio
async def test_the_dashboard_lists_and_shows_the_priority(store: SQLiteStore) -> None:
    plain = await enqueue_dispatch(store, kind="plain", deliver_to="d")
    async with serving(WebApp(store)) as client:
        before = (await client.get("/")).text
    assert "<th>priority</th>" not in before
    urgent = await enqueue_dispatch(store, kind="urgent", deliver_to="d", priority=5)
    async with serving(WebApp(store)) as client:
        home = (await client.get("/")).text
        page = (await client.get(f"/dispatches/{urgent}")).text
    assert "<th>status</th><th>priority</th><th>attempt</th>" in home
    for dispatch_id, cell in ((urgent, "+5"), (plain, "0")):
        row = re.search(rf"<tr><td class=when>.*?/dispatches/{dispatch_id}.*?</tr>", home, re.S)
        assert row is not None and f"</td><td>{cell}</td><td>0/8</td>" in row.group(0), row
    assert "<dt>priority</dt><dd>+5</dd>" in page
