"""Whether this command reads the secrets a configuration names as
``env:NAME`` (the dashboard's tokens, webhook signing secrets).

A command reads only the secrets it uses: ``ls`` serves no dashboard and
signs nothing, so a configuration whose tokens come from variables set only
where the worker runs still works for it. While :func:`left_unread` is in
force, :func:`secret_environ` answers None, and each parser of such a value
leaves the reference unread (never the variable's value), keeping every
other check of the file.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping
from contextvars import ContextVar
from typing import Final

_UNREAD: Final[ContextVar[bool]] = ContextVar("trio_dispatch_secrets_unread", default=False)


def secret_environ() -> Mapping[str, str] | None:
    """The environment ``env:NAME`` secrets are read from (the process's),
    or None inside :func:`left_unread`."""
    return None if _UNREAD.get() else os.environ


@contextlib.contextmanager
def left_unread() -> Iterator[None]:
    """Inside the block (this task or thread only), ``env:NAME`` secrets are
    left unread."""
    token = _UNREAD.set(True)
    try:
        yield
    finally:
        _UNREAD.reset(token)
