"""A griffe extension for the documentation site: the docstrings' Sphinx roles
(``:class:`~pkg.Name```, ``:func:`name```, ...) rendered as inline code.

mkdocstrings reads the reST field lists (``:param x:``) but shows inline roles
literally; here each becomes the code span a reader expects: the last
component after ``~``, the whole target otherwise, an explicit title
(``:class:`title <target>```) as its title. A reST literal block (a
paragraph ending in ``::`` and the indented lines after it) becomes a fenced
Python block.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

_ROLE = re.compile(r":(?:py:)?(?:attr|class|data|exc|func|meth|mod|obj|const):`([^`]+)`")


def _code(match: re.Match[str]) -> str:
    target = match.group(1).strip()
    titled = re.fullmatch(r"(.+?)\s*<(.+)>", target)
    if titled:
        return f"`{titled.group(1)}`"
    if target.startswith("~"):
        target = target[1:].rsplit(".", 1)[-1]
    return f"`{target}`"


_LITERAL = re.compile(r"::\n\n((?:(?:[ ]{4}.*)?\n)+)")


def _fenced(match: re.Match[str]) -> str:
    lines = match.group(1).rstrip("\n").split("\n")
    code = "\n".join(line.removeprefix("    ") for line in lines)
    return f":\n\n```python\n{code}\n```\n"


class SphinxRoles(griffe.Extension):
    """Rewrite the roles of every docstring griffe loads."""

    def on_instance(self, *, node: Any, obj: griffe.Object, agent: Any, **kwargs: Any) -> None:
        if obj.docstring is not None:
            text = _ROLE.sub(_code, obj.docstring.value)
            obj.docstring.value = _LITERAL.sub(_fenced, text + "\n").rstrip("\n")
