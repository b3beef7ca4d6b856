"""Oban's Python port (PyPI ``oban``, Python >= 3.12) beside ours in the
postgres section: a virtualenv of its own, made when the machine has a
Python 3.12 or newer and PyPI answers (skipped with a note otherwise), and
its worker processes (``oban_child.py``) draining a queue.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Final

from .harness import BODY, ROOT
from .pgaccount import OtherChild
from .processes import Drained, drain_with_processes

OBAN_VERSION: Final = "0.7.0"
VENV: Final = ROOT / ".bench-oban-venv"
CHILD: Final = Path(__file__).with_name("oban_child.py")
REMAINING_SQL: Final = (
    "SELECT COUNT(*) FROM oban_jobs WHERE state NOT IN ('completed', 'discarded', 'cancelled')"
)


def _python312() -> str | None:
    """A Python >= 3.12 interpreter that runs, or None."""
    found = [shutil.which(name) for name in ("python3.13", "python3.12")]
    found += sorted(glob.glob(os.path.expanduser("~/.pyenv/versions/3.1[2-9]*/bin/python3")))
    for candidate in found:
        if candidate is None:
            continue
        try:
            run = subprocess.run(
                [candidate, "-c", "import sys; print(sys.version_info >= (3, 12))"],
                capture_output=True,
                text=True,
                timeout=30,
            )
        except (OSError, subprocess.TimeoutExpired):
            continue
        if run.returncode == 0 and run.stdout.strip() == "True":
            return candidate
    return None


def oban_python() -> tuple[str | None, str]:
    """The virtualenv's interpreter with ``oban`` importable (made and
    installed on first use), or None and why not."""
    python = VENV / "bin" / "python"
    check = [str(python), "-c", "import oban, psycopg"]
    if python.exists() and subprocess.run(check, capture_output=True).returncode == 0:
        return str(python), ""
    base = _python312()
    if base is None:
        return None, "no Python >= 3.12 on this machine (oban needs one)"
    try:
        subprocess.run([base, "-m", "venv", str(VENV)], check=True, capture_output=True)
        subprocess.run(
            [str(python), "-m", "pip", "install", "-q", f"oban=={OBAN_VERSION}", "psycopg[binary]"],
            check=True,
            capture_output=True,
            timeout=600,
        )
    except (OSError, subprocess.SubprocessError) as exc:
        return None, f"installing oban {OBAN_VERSION} into {VENV.name} failed: {exc}"
    if subprocess.run(check, capture_output=True).returncode != 0:
        return None, f"oban {OBAN_VERSION} does not import in {VENV.name}"
    return str(python), ""


def oban_version(python: str) -> str:
    run = subprocess.run(
        [python, "-c", "import oban; print(oban.__version__)"], capture_output=True, text=True
    )
    return run.stdout.strip() or "?"


def oban_fill(python: str, url: str, n: int) -> None:
    """Oban's schema and ``n`` jobs of the payload (``enqueue_many``, 1,000
    at a time: untimed setup)."""
    subprocess.run(
        [python, str(CHILD), url, str(n), "fill", json.dumps(BODY)], check=True, timeout=600
    )


def oban_processes(python: str, url: str, n: int, workers: int, limit: int) -> Drained:
    """``workers`` Oban processes, each ``queues={"bench": limit}``,
    draining ``n`` jobs queued beforehand."""
    oban_fill(python, url, n)
    return drain_with_processes(
        [python, str(CHILD), url, str(limit), "drain"], workers, url, REMAINING_SQL, n
    )


def oban_account_child(python: str, limit: int) -> OtherChild:
    """The cost account's view of an Oban process at ``limit``."""
    return OtherChild(
        lambda url, n: oban_fill(python, url, n),
        lambda url: [python, str(CHILD), url, str(limit), "drain"],
        REMAINING_SQL,
    )
