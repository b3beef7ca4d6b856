"""Comments, docstrings, configuration and docs cite the project's own pages
(``docs/*.md``), never a document a reader of the repository cannot open:
no specification section numbers, no design-record decision labels. And
every page they cite, with its anchor, exists."""

from __future__ import annotations

import re
import unicodedata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"

# Where citations live: the package, the scripts, the tests, the example
# configuration, the README, the docs and the build files.
SCANNED = (
    "trio_dispatch",
    "scripts",
    "tests",
    "config.example.yaml",
    "README.md",
    "docs",
    "mkdocs.yml",
    "pyproject.toml",
)
SUFFIXES = {".py", ".md", ".yaml", ".yml", ".toml", ".sh", ".txt", ".cfg", ".ini"}

# "SPEC 17", "SPEC section 7", "SPEC B6", "ADR D3" and their bare forms
# ("section 18", "(B4)"). A numbered section of a public standard keeps its
# dot ("RFC 9562 section 6.2") and is not matched.
OUTSIDE = re.compile(r"\bSPEC\b|\bADR\b|\bsections? \d{1,2}\b(?!\.\d)|\b[BD](?:[1-9]|10)\b")
PAGE = re.compile(r"\bdocs/([a-z][a-z0-9_-]*)\.md(?:#([a-z0-9_-]+))?")


def scanned_files() -> list[Path]:
    files: list[Path] = []
    for name in SCANNED:
        path = ROOT / name
        if path.is_file():
            files.append(path)
        elif path.is_dir():
            files.extend(
                p
                for p in sorted(path.rglob("*"))
                if p.is_file() and p.suffix in SUFFIXES and "__pycache__" not in p.parts
            )
    return files


def slug(heading: str) -> str:
    """The anchor MkDocs gives a heading (Python-Markdown's toc slugify)."""
    text = unicodedata.normalize("NFKD", heading).encode("ascii", "ignore").decode()
    text = re.sub(r"[^\w\s-]", "", text).strip().lower()
    return re.sub(r"[-\s]+", "-", text)


def anchors(page: Path) -> set[str]:
    """The anchors of a page's headings, code blocks skipped."""
    found: set[str] = set()
    fenced = False
    for line in page.read_text(encoding="utf-8").splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif not fenced and (match := re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)):
            found.add(slug(match.group(1)))
    return found


def test_the_scan_reads_the_package_tests_and_docs() -> None:
    names = {p.relative_to(ROOT).as_posix() for p in scanned_files()}
    assert "trio_dispatch/lifecycle.py" in names
    assert "tests/unit/test_no_outside_citations.py" in names
    assert "docs/guarantees.md" in names
    assert "config.example.yaml" in names


def test_the_pattern_finds_each_form_of_an_outside_citation() -> None:
    for cited in (
        "(SPEC section 18)",
        "(SPEC 17, replay)",
        "(SPEC B6)",
        "(ADR D3)",
        "the ADR backoff",
        "# section 18",
        "written together (B4)",
    ):
        assert OUTSIDE.search(cited), cited
    for plain in ("RFC 9562 section 6.2", "DISPATCH_SPEC", "b0", "T0/B0/x", "docs/controls.md"):
        assert not OUTSIDE.search(plain), plain


def test_nothing_cites_a_document_outside_the_repository() -> None:
    here = Path(__file__).resolve()  # holds the pattern's examples
    found = [
        f"{path.relative_to(ROOT)}:{number}: {line.strip()}"
        for path in scanned_files()
        if path != here
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
        if OUTSIDE.search(line)
    ]
    assert not found, "cite docs/*.md instead:\n" + "\n".join(found)


def test_every_cited_page_and_anchor_exists() -> None:
    pages = {page.stem: anchors(page) for page in DOCS.glob("*.md")}
    broken = [
        f"{path.relative_to(ROOT)}:{number}: {match.group(0)}"
        for path in scanned_files()
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
        for match in PAGE.finditer(line)
        if match.group(1) not in pages
        or (match.group(2) is not None and match.group(2) not in pages[match.group(1)])
    ]
    assert not broken, "no such page or anchor:\n" + "\n".join(broken)
