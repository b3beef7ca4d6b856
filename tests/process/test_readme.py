"""The README's example is real code: run it as a user would."""

from __future__ import annotations

import base64
import json
import re
import shlex
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from trio_dispatch.transports import Delivery
from trio_dispatch.transports.webhook import WebhookTransport, parse_endpoints

from ..helpers import cli_process

README = Path(__file__).resolve().parents[2] / "README.md"


def _python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def _run(script: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, script], cwd=cwd, capture_output=True, text=True, timeout=90
    )


def _first_line(block: str) -> str:
    return next(line for line in block.splitlines() if line.strip())


@pytest.mark.slow
@pytest.mark.parametrize("index", range(len(_python_blocks())), ids=lambda i: f"block{i}")
def test_every_readme_python_block_runs_as_pasted_twice_in_an_empty_folder(
    tmp_path: Path, index: int
) -> None:
    """A newcomer pastes a block into a file in an empty folder and runs it,
    then runs it again: both runs succeed, and print the same thing where
    the block is idempotent by design (a dedup key)."""
    block = _python_blocks()[index]
    (tmp_path / "example.py").write_text(block)
    first = _run("example.py", tmp_path)
    assert first.returncode == 0, f"{_first_line(block)!r}: {first.stderr}"
    second = _run("example.py", tmp_path)
    assert second.returncode == 0, f"{_first_line(block)!r} (second run): {second.stderr}"
    if "dedup_key=" in block:
        assert second.stdout == first.stdout != ""


@pytest.mark.slow
def test_readme_library_example_delivers_through_a_real_command(tmp_path: Path) -> None:
    example = next(block for block in _python_blocks() if "deliver_due_dispatches" in block)
    assert '"--", "{deliver_to}"' in example  # the separator the Security section asks for
    (tmp_path / "example.py").write_text(example)
    for _ in range(2):
        done = _run("example.py", tmp_path)
        assert done.returncode == 0, done.stderr
        assert done.stdout.strip() == "1 delivered None"
    conn = sqlite3.connect(tmp_path / "outbox.db")
    rows = conn.execute("SELECT status, attempt, deliver_to FROM dispatch_outbox").fetchall()
    assert rows == [("delivered", 1, "seat-1")] * 2
    assert conn.execute("SELECT count(*) FROM builds").fetchone() == (2,)


def test_readme_worker_example_runs_and_delivers(tmp_path: Path) -> None:
    example = next(block for block in _python_blocks() if "DispatchWorker" in block)
    (tmp_path / "service.py").write_text(example)
    done = subprocess.run(
        [sys.executable, "service.py"], cwd=tmp_path, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("to user-42, attempt 1: {")
    rows = (
        sqlite3.connect(tmp_path / "service.db")
        .execute("SELECT status, attempt FROM dispatch_outbox")
        .fetchall()
    )
    assert rows == [("delivered", 1)]


def test_readme_commands_exist_and_ci_runs_the_test_command() -> None:
    root = README.parent
    text = README.read_text()
    for command in ("./scripts/run", "./scripts/test"):
        assert f"{command} " in text
        assert (root / command).stat().st_mode & 0o111
    assert "./scripts/test" in (root / ".ci" / "run").read_text()


@pytest.mark.slow
def test_readme_own_connection_examples_commit_the_order_and_its_dispatch_together(
    tmp_path: Path,
) -> None:
    blocks = _python_blocks()
    plain = next(block for block in blocks if "def place_order" in block)
    orm = next(block for block in blocks if "Session(engine)" in block)
    (tmp_path / "plain.py").write_text(plain)
    (tmp_path / "orm.py").write_text(orm)
    printed = []
    for script in ("plain.py", "orm.py"):
        done = subprocess.run(
            [sys.executable, script], cwd=tmp_path, capture_output=True, text=True, timeout=60
        )
        assert done.returncode == 0, done.stderr
        printed.append(done.stdout.strip())
    conn = sqlite3.connect(tmp_path / "shop.db")
    orders = [row[0] for row in conn.execute("SELECT id FROM orders ORDER BY id")]
    assert orders == ["o-1", "o-2"]
    dispatches = conn.execute(
        "SELECT id, kind, deliver_to, status, payload FROM dispatch_outbox ORDER BY created_at"
    ).fetchall()
    assert [(kind, to, status) for _, kind, to, status, _ in dispatches] == [
        ("order.placed", "billing", "pending"),
        ("order.placed", "billing", "pending"),
    ]
    assert printed[0] == dispatches[0][0]  # the sqlite3 example prints its dispatch id
    assert '"order": "o-1"' in dispatches[0][4]
    assert '"order": "o-2"' in dispatches[1][4]
    history = conn.execute(
        "SELECT entity_id, reason_code FROM status_transitions ORDER BY id"
    ).fetchall()
    assert history == [(row[0], "dispatch.pending.enqueued") for row in dispatches]
    assert conn.execute("PRAGMA journal_mode").fetchone() == ("wal",)


def test_readme_signature_check_accepts_a_real_request_and_refuses_a_forged_one() -> None:
    block = next(block for block in _python_blocks() if "def verified" in block)
    namespace: dict[str, object] = {}
    exec(block, namespace)
    verified = namespace["verified"]
    secret = "whsec_" + base64.b64encode(b"k" * 32).decode()
    body = b'{"dispatch_id": "d-1", "body": {"n": 1}}'
    endpoint = parse_endpoints("endpoints", {"d": {"url": "https://x/", "secrets": [secret]}}, {})
    delivery = Delivery("d-1", "k", "d", 1, body.decode())
    headers = WebhookTransport(endpoint).request_headers(endpoint["d"], delivery, body)
    assert verified(secret, headers, body) is True  # type: ignore[operator]
    assert verified(secret, headers, body + b" ") is False  # type: ignore[operator]
    other = "whsec_" + base64.b64encode(b"o" * 32).decode()
    assert verified(other, headers, body) is False  # type: ignore[operator]


def _section(heading: str) -> str:
    text = README.read_text()
    start = text.index(f"\n## {heading}")
    return text[start : text.index("\n## ", start + 1)]


def test_readme_destinations_example_configures_and_its_commands_run(tmp_path: Path) -> None:
    """The Destinations section's YAML is a configuration the worker takes,
    and its commands run as pasted in the folder of that configuration."""
    section = _section("Destinations")
    (yaml_block,) = re.findall(r"```yaml\n(.*?)```", section, flags=re.S)
    (sh_block,) = re.findall(r"```sh\n(.*?)```", section, flags=re.S)
    (tmp_path / "trio-dispatch.yaml").write_text(f"store: outbox.db\n{yaml_block}")
    checked = cli_process("check-config", "--json", cwd=tmp_path)
    assert checked.returncode == 0, checked.stderr
    assert set(json.loads(checked.stdout)["destinations"]) == {"*", "billing"}
    assert cli_process("migrate", cwd=tmp_path).returncode == 0
    printed = []
    for line in sh_block.strip().splitlines():
        program, *argv = shlex.split(line, comments=True)
        assert program == "trio-dispatch"
        done = cli_process(*argv, cwd=tmp_path)
        assert done.returncode == 0, (line, done.stderr)
        printed.append(done.stdout)
    assert printed[0].split()[:2] == ["NAME", "STATE"] and "billing" in printed[0]
    assert printed[1].startswith("paused destination billing: active -> paused until ")
    assert printed[2].strip() == "resumed destination billing: paused -> active"
