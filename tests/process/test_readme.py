"""The README's and the documentation's code blocks are real: run them as a user would.

Every fenced code block of ``README.md`` and ``docs/*.md`` runs as pasted,
twice, in an empty folder of its own (the second run finds what the first
left, as a user running an example again does):

- a ```` ```python ```` block as a script, ``python example.py``;
- a ```` ```sh ```` block with ``bash -e``, the environment's ``bin`` first
  on ``PATH`` (``trio-dispatch`` and ``python3`` as after the README's
  install line).

A block that is not meant to run -- output, a fragment of a configuration
file, a command that serves until it is stopped or that runs in the
checkout -- carries the line ``<!-- not run: WHY -->`` directly above its
opening fence: an HTML comment, invisible on GitHub and on the
documentation site. A block of any other language without that line, or
the line without a reason, fails :func:`test_every_block_runs_or_says_why_not`,
so each block is run or left out on purpose. The runs are in the slow tier.

The PostgreSQL examples read their server from ``SHOP_DATABASE``; the test
points it at a database of its own on the local server (skipped without one).
"""

from __future__ import annotations

import ast
import importlib.metadata
import os
import re
import sqlite3
import subprocess
import sys
import tomllib
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from ..conftest import POSTGRES_ADMIN_URL

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
RUNNABLE = {"python", "sh"}
_MARK = re.compile(r"^\s*<!-- not run: (.*?) -->\s*$")


@dataclass(frozen=True)
class Block:
    page: Path
    line: int  # of the opening fence, 1-based
    language: str
    code: str
    not_run: str | None  # the reason given, or None when the block runs

    @property
    def name(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def blocks_of(page: Path) -> list[Block]:
    """The fenced blocks of one page, indented ones (in a list) included."""
    lines = page.read_text().splitlines()
    found: list[Block] = []
    index = 0
    while index < len(lines):
        opening = re.match(r"^(\s*)```(\S*)\s*$", lines[index])
        if not opening:
            index += 1
            continue
        indent, language = opening.groups()
        end = index + 1
        while not re.match(rf"^{indent}```\s*$", lines[end]):
            end += 1
        code = "\n".join(line.removeprefix(indent) for line in lines[index + 1 : end]) + "\n"
        mark = _MARK.match(lines[index - 1]) if index else None
        reason = mark.group(1).strip() if mark else None
        found.append(Block(page, index + 1, language, code, reason))
        index = end + 1
    return found


def all_blocks() -> list[Block]:
    return [block for page in PAGES for block in blocks_of(page)]


def run_blocks() -> list[Block]:
    return [block for block in all_blocks() if block.not_run is None]


def readme_python(containing: str) -> str:
    return next(
        b.code for b in blocks_of(README) if b.language == "python" and containing in b.code
    )


def _env(extra: dict[str, str] | None = None) -> dict[str, str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("TRIO_DISPATCH")}
    path = f"{Path(sys.executable).parent}{os.pathsep}{base.get('PATH', '')}"
    return {**base, "PATH": path, "COLUMNS": "200", **(extra or {})}


def run_block(
    block: Block, cwd: Path, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    if block.language == "python":
        (cwd / "example.py").write_text(block.code)
        argv = [sys.executable, "example.py"]
    else:
        argv = ["bash", "-e", "-c", block.code]
    return subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=90, env=_env(env))


@pytest.fixture
def shop_database() -> Iterator[str]:
    """A database of its own on the local PostgreSQL server, dropped after."""
    psycopg = pytest.importorskip("psycopg")
    name = f"trio_dispatch_docs_{uuid.uuid4().hex[:12]}"
    try:
        with psycopg.connect(POSTGRES_ADMIN_URL, autocommit=True, connect_timeout=3) as admin:
            admin.execute(f'CREATE DATABASE "{name}"')
    except psycopg.OperationalError:
        pytest.skip("no PostgreSQL server")
    yield f"{POSTGRES_ADMIN_URL.rsplit('/', 1)[0]}/{name}"
    with psycopg.connect(POSTGRES_ADMIN_URL, autocommit=True) as admin:
        admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def test_every_block_runs_or_says_why_not() -> None:
    blocks = all_blocks()
    assert len(blocks) > 30  # the parser finds them
    for block in blocks:
        if block.not_run is not None:
            assert block.not_run, f"{block.name}: say why it is not run"
        else:
            assert block.language in RUNNABLE, (
                f"{block.name}: a {block.language or 'plain'} block runs only as "
                "python or sh; mark it <!-- not run: WHY --> above its fence"
            )


@pytest.mark.slow
@pytest.mark.parametrize("block", run_blocks(), ids=lambda block: block.name)
def test_every_block_runs_as_pasted_twice_in_an_empty_folder(
    tmp_path: Path, block: Block, request: pytest.FixtureRequest
) -> None:
    """Both runs succeed, and print the same where the block is idempotent
    by design (a dedup key)."""
    env = {}
    if "SHOP_DATABASE" in block.code:
        env["SHOP_DATABASE"] = request.getfixturevalue("shop_database")
    first = run_block(block, tmp_path, env)
    assert first.returncode == 0, f"{block.name}: {first.stdout}{first.stderr}"
    second = run_block(block, tmp_path, env)
    assert second.returncode == 0, f"{block.name} (second run): {second.stdout}{second.stderr}"
    if "dedup_key=" in block.code:
        assert second.stdout == first.stdout != ""


@pytest.mark.slow
def test_readme_first_example_delivers_in_a_folder_of_its_own(tmp_path: Path) -> None:
    """Run where another outbox.db waits with due rows (the demo's, in the
    checkout), the example delivers its own row only, and leaves no file."""
    example = readme_python("deliver_due_dispatches(db, notify_template=NOTIFY)")
    assert '"--", "{deliver_to}"' in example  # the separator the Security page asks for
    (tmp_path / "example.py").write_text(example)
    (tmp_path / "outbox.db").write_bytes(b"")
    for _ in range(2):
        done = subprocess.run(
            [sys.executable, "example.py"], cwd=tmp_path, capture_output=True, text=True
        )
        assert done.returncode == 0, done.stderr
        assert done.stdout.strip() == "1 delivered None"
    assert sorted(path.name for path in tmp_path.iterdir()) == ["example.py", "outbox.db"]
    assert (tmp_path / "outbox.db").read_bytes() == b""


def test_readme_worker_example_delivers_one_keys_rows_in_order(tmp_path: Path) -> None:
    (tmp_path / "service.py").write_text(readme_python('ordering_key="order-7"'))
    for _ in range(2):
        done = subprocess.run(
            [sys.executable, "service.py"], cwd=tmp_path, capture_output=True, text=True, timeout=60
        )
        assert done.returncode == 0, done.stderr
        assert done.stdout.strip() == "['order.created', 'order.paid', 'order.shipped']"
    rows = (
        sqlite3.connect(tmp_path / "orders.db")
        .execute("SELECT kind, status, attempt FROM dispatch_outbox ORDER BY created_at, key_seq")
        .fetchall()
    )
    assert rows == [(f"order.{e}", "delivered", 1) for e in ("created", "paid", "shipped")] * 2


def test_readme_commands_exist_and_ci_runs_the_test_command() -> None:
    text = README.read_text()
    for command in ("./scripts/run", "./scripts/test"):
        assert f"{command} " in text
        assert (ROOT / command).stat().st_mode & 0o111
    ci = (ROOT / ".ci" / "run").read_text()
    assert "./scripts/test" in ci
    assert "mkdocs build --strict" in ci


def test_readme_is_read_in_ten_minutes() -> None:
    assert len(README.read_text().splitlines()) <= 300


@pytest.mark.slow
def test_readme_own_connection_example_commits_the_order_and_its_dispatch_together(
    tmp_path: Path,
) -> None:
    (tmp_path / "plain.py").write_text(readme_python("sqlite3.connect"))
    printed = []
    for _ in range(2):
        done = subprocess.run(
            [sys.executable, "plain.py"], cwd=tmp_path, capture_output=True, text=True
        )
        assert done.returncode == 0, done.stderr
        printed.append(done.stdout.strip())
    conn = sqlite3.connect(tmp_path / "shop.db")
    assert conn.execute("SELECT id FROM orders").fetchall() == [("o-1",)]
    dispatches = conn.execute("SELECT id, kind, deliver_to, status FROM dispatch_outbox").fetchall()
    assert dispatches == [(printed[0], "order.placed", "billing", "pending")]
    assert printed[1] == printed[0]  # placed again: the dedup key's no-op
    history = conn.execute("SELECT entity_id, reason_code FROM status_transitions").fetchall()
    assert history == [(printed[0], "dispatch.pending.enqueued")]


@pytest.mark.slow
def test_readme_postgres_example_keeps_the_outbox_in_its_schema_beside_the_apps_tables(
    tmp_path: Path, shop_database: str
) -> None:
    import psycopg

    (tmp_path / "pg.py").write_text(readme_python("SET search_path TO outbox, public"))
    done = subprocess.run(
        [sys.executable, "pg.py"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env=_env({"SHOP_DATABASE": shop_database}),
    )
    assert done.returncode == 0, done.stderr
    with psycopg.connect(shop_database) as conn:
        tables = conn.execute(
            "SELECT table_schema, table_name FROM information_schema.tables"
            " WHERE table_name IN ('orders', 'dispatch_outbox', 'sessions')"
        ).fetchall()
        assert sorted(tables) == [
            ("outbox", "dispatch_outbox"),
            ("outbox", "sessions"),
            ("public", "orders"),
        ]
        row = conn.execute("SELECT id, status FROM outbox.dispatch_outbox").fetchone()
    assert row == (done.stdout.strip(), "pending")


def test_webhook_signature_check_accepts_a_real_request_and_refuses_a_forged_one() -> None:
    import base64

    from trio_dispatch.transports import Delivery
    from trio_dispatch.transports.webhook import WebhookTransport, parse_endpoints

    block = next(b for b in blocks_of(ROOT / "docs" / "webhooks.md") if "def verified" in b.code)
    namespace: dict[str, object] = {}
    exec(block.code, namespace)
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


@pytest.mark.slow
def test_readme_destinations_example_pauses_and_resumes(tmp_path: Path) -> None:
    block = next(b for b in blocks_of(README) if "destinations pause billing" in b.code)
    done = run_block(block, tmp_path)
    assert done.returncode == 0, done.stderr
    printed = done.stdout
    assert "paused destination billing: active -> paused until " in printed
    assert "resumed destination billing: paused -> active" in printed
    listing = printed[printed.index("NAME") :]
    assert listing.split()[:2] == ["NAME", "STATE"] and "billing" in listing


def _requirement_names(requirements: list[str]) -> set[str]:
    return {re.split(r"[\s\[<>=!~;@]", r, maxsplit=1)[0].lower() for r in requirements}


def test_readme_install_line_brings_every_module_the_examples_import() -> None:
    """After the install line shown, no example fails with ModuleNotFoundError:
    every module a README or docs example imports is the standard library's,
    the package's, or a distribution the line installs (the core, the extras
    it names, recursively, and any package it names beside them)."""
    install = next(b for b in blocks_of(README) if "pip install" in b.code)
    words = install.code.split("#", 1)[0].split()
    spec = next(word.strip("'\"") for word in words if word.strip("'\"").startswith(".["))
    others = [w for w in words[words.index("install") + 1 :] if not w.strip("'\"").startswith(".")]
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    wanted = set(spec[2:-1].split(","))
    installed = _requirement_names(project["dependencies"]) | _requirement_names(others)
    while wanted:
        extra = wanted.pop()
        for requirement in extras[extra]:
            if requirement.startswith("trio_dispatch["):
                wanted |= set(requirement[len("trio_dispatch[") : -1].split(","))
            else:
                installed |= _requirement_names([requirement])
    providers = importlib.metadata.packages_distributions()
    for block in all_blocks():
        if block.language != "python":
            continue
        for node in ast.walk(ast.parse(block.code)):
            if isinstance(node, ast.Import):
                modules = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                modules = [node.module]
            else:
                continue
            for module in modules:
                top = module.split(".")[0]
                if top in sys.stdlib_module_names or top == "trio_dispatch":
                    continue
                dists = {name.lower() for name in providers.get(top, [])}
                assert dists & installed, f"{block.name}: {module} ({dists}) not installed"
