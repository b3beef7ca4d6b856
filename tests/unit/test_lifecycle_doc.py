"""docs/lifecycle.md is the lifecycle's statement: it says what lifecycle.py enforces."""

from __future__ import annotations

import re
from pathlib import Path

from trio_dispatch import lifecycle
from trio_dispatch.lifecycle import Reason, Status

PAGE = Path(__file__).resolve().parents[2] / "docs" / "lifecycle.md"


def _table(heading: str) -> list[list[str]]:
    """The rows of the first table under ``## heading``, cells stripped of backticks."""
    text = PAGE.read_text()
    section = text[text.index(f"\n## {heading}\n") :]
    rows = []
    for line in section.splitlines()[2:]:
        if line.startswith("## "):
            break
        if line.startswith("| ") and not line.startswith("| ---"):
            rows.append([cell.strip().strip("`") for cell in line.strip("|").split("|")])
    return rows[1:]  # without the header


def test_the_page_names_every_status_and_no_other() -> None:
    assert [row[0] for row in _table("Statuses")] == [str(status) for status in Status]


def test_the_page_names_every_reason_code_and_no_other() -> None:
    assert [row[0] for row in _table("Reason codes")] == [str(reason) for reason in Reason]
    cited = set(re.findall(r"dispatch\.[a-z_]+\.[a-z_]+", PAGE.read_text()))
    assert cited == set(lifecycle.REASON_CODES)


def test_the_page_gives_every_edge_with_the_sources_that_may_take_it() -> None:
    documented = {
        (row[0], row[1]): frozenset(name for name in re.split(r",\s*", row[2]))
        for row in _table("Edges")
    }
    enforced = {
        (str(edge[0]), str(edge[1])): frozenset(str(source) for source in sources)
        for edge, sources in lifecycle._EDGES.items()
    }
    assert documented == enforced
