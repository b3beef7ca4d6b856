"""`open_store`'s argument checks: bad targets and durability refused by name,
before anything is opened."""

from __future__ import annotations

from pathlib import Path

import pytest

from trio_dispatch import open_store

pytestmark = pytest.mark.anyio


@pytest.mark.parametrize(
    "target, message",
    [
        ("mysql://host/db", "unsupported store URL"),
        ("sqlite://relative.db", "sqlite:///"),
        ("sqlite:///", "names no file"),
        ("", "store target"),
    ],
)
async def test_open_store_rejects_bad_targets_naming_them(
    tmp_path: Path, target: str, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        async with open_store(target):
            pass
    assert list(tmp_path.iterdir()) == []


async def test_open_store_rejects_bad_durability(db_path: Path) -> None:
    with pytest.raises(ValueError, match="'fast'"):
        async with open_store(db_path, durability="fast"):  # type: ignore[arg-type]
            pass
    assert not db_path.exists()
