"""The README's example is real code: run it as a user would."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def _python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def test_readme_library_example_delivers_through_a_real_command(tmp_path: Path) -> None:
    example = _python_blocks()[0]
    (tmp_path / "example.py").write_text(example)
    (tmp_path / "notify.py").write_text(
        "import sys\nopen('received.txt', 'w').write(sys.argv[1] + ' ' + sys.stdin.read())\n"
    )
    done = subprocess.run(
        [sys.executable, "example.py"], cwd=tmp_path, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert "'delivered': 1" in done.stdout
    received = (tmp_path / "received.txt").read_text()
    assert received.startswith("seat-1 {") and '"text": "build finished"' in received
