"""What operators see of coalescing (docs/controls.md): ``ls --coalesce-key``
(and its refusal of a bad key), ``ls --json``, ``show`` and its ``--json``
naming the row that superseded one, the history's transition, the
dashboard's list filter and a dispatch's page."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import anyio
import pytest

from trio_dispatch import enqueue_dispatch, open_store
from trio_dispatch.store import SQLiteStore
from trio_dispatch.web import WebApp

from ..helpers import assert_one_line_error, run_cli
from .test_web import serving
from .test_web_actions import BEARER, OPERATOR, VIEWER

OPERATING = BEARER["operator"]


def _chain(db_path: Path) -> tuple[str, str, str]:
    """An unkeyed row, then a debounced key replaced once: (plain, old, new)."""

    async def build() -> tuple[str, str, str]:
        now = time.time()
        rule = {"coalesce_key": "digest:7", "coalesce": "debounce", "coalesce_seconds": 60}
        async with open_store(db_path) as db:
            plain = await enqueue_dispatch(db, kind="plain", deliver_to="d")
            old = await enqueue_dispatch(db, kind="digest", deliver_to="d", now=now, **rule)  # type: ignore[arg-type]
            new = await enqueue_dispatch(db, kind="digest", deliver_to="d", now=now + 1, **rule)  # type: ignore[arg-type]
            return plain, old, new

    return anyio.run(build)


@pytest.mark.sqlite_only  # the command's own output; the engines share it
def test_ls_filters_by_coalesce_key_and_show_names_the_successor(db_path: Path) -> None:
    plain, old, new = _chain(db_path)
    listed = run_cli("--db", str(db_path), "ls", "--coalesce-key", "digest:7", "--wide").stdout
    ids = [line.split()[0] for line in listed.splitlines()[1:]]
    assert ids == [new, old] and plain not in listed
    assert "superseded" in listed
    document = json.loads(run_cli("--db", str(db_path), "ls", "--json").stdout)
    keys = {row["id"]: row["coalesce_key"] for row in document["dispatches"]}
    assert keys == {plain: None, old: "digest:7", new: "digest:7"}
    none = run_cli("--db", str(db_path), "ls", "--coalesce-key", "other").stdout
    assert none.strip() == "no dispatches with coalesce key other"
    bad = run_cli("--db", str(db_path), "ls", "--coalesce-key", "a\tb")
    assert_one_line_error(bad, 2, "coalesce_key must not contain control characters")

    shown = run_cli("--db", str(db_path), "show", old).stdout
    assert re.search(rf"^superseded by +{new}$", shown, re.MULTILINE), shown
    assert re.search(r"^coalesce_key +digest:7$", shown, re.MULTILINE), shown
    fresh = run_cli("--db", str(db_path), "show", new).stdout
    assert re.search(r"^not_before +\S", fresh, re.MULTILINE), fresh
    assert "superseded by" not in fresh
    as_json = json.loads(run_cli("--db", str(db_path), "show", old, "--json").stdout)
    assert as_json["dispatch"]["superseded_by"] == new
    assert as_json["dispatch"]["coalesce_key"] == "digest:7"
    later = json.loads(run_cli("--db", str(db_path), "show", new, "--json").stdout)["dispatch"]
    assert later["superseded_by"] is None and later["not_before"] == later["next_attempt_at"]
    history = run_cli("--db", str(db_path), "history", old, "--wide").stdout
    assert "dispatch.superseded.coalesced" in history and f"superseded by {new}" in history


@pytest.mark.anyio
async def test_the_dashboard_filters_by_coalesce_key_and_shows_the_chain(
    store: SQLiteStore,
) -> None:
    rule = {"coalesce_key": "digest:7", "coalesce": "replace"}
    plain = await enqueue_dispatch(store, kind="plain", deliver_to="d")
    old = await enqueue_dispatch(store, kind="digest", deliver_to="d", **rule)  # type: ignore[arg-type]
    new = await enqueue_dispatch(store, kind="digest", deliver_to="d", **rule)  # type: ignore[arg-type]
    async with serving(WebApp(store)) as client:
        listed = (await client.get("/", params={"coalesce_key": "digest:7"})).text
        page = (await client.get(f"/dispatches/{old}")).text
        bad = await client.get("/", params={"coalesce_key": "a\tb"})
    assert "Dispatches, coalesce key digest:7" in listed
    assert f"/dispatches/{new}" in listed and f"/dispatches/{old}" in listed
    assert f"/dispatches/{plain}" not in listed
    assert 'name=coalesce_key value="digest:7"' in listed
    assert re.search(
        rf'<dt>superseded by</dt><dd><a class=mono id=successor href="[^"]*{new}"', page
    )
    assert "<dt>coalesce key</dt><dd><a class=mono" in page and "digest:7</a>" in page
    assert "dispatch.superseded.coalesced" in page
    assert bad.status_code == 400


@pytest.mark.anyio
async def test_a_list_filtered_by_coalesce_key_offers_no_bulk_action_beyond_it(
    store: SQLiteStore,
) -> None:
    await enqueue_dispatch(store, kind="plain", deliver_to="d")
    await enqueue_dispatch(store, kind="digest", deliver_to="d", coalesce_key="digest:7")
    app = WebApp(store, token=VIEWER, operator_token=OPERATOR)
    async with serving(app) as client:
        plain = (await client.get("/", params={"status": "pending"}, headers=OPERATING)).text
        keyed = await client.get(
            "/", params={"status": "pending", "coalesce_key": "digest:7"}, headers=OPERATING
        )
    assert "/actions/cancel?status=pending" in plain
    assert keyed.status_code == 200 and "/actions/cancel?" not in keyed.text
