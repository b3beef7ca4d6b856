"""Dispatch ids: UUIDv7, distinct across threads and across a fork."""

from __future__ import annotations

import multiprocessing
import os
import threading
import uuid
from typing import Any

import pytest

from trio_dispatch.signal import uuid7_bytes


def _ids_in_child(conn: Any) -> None:
    conn.send([uuid7_bytes().hex() for _ in range(64)])
    conn.close()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_never_reuses_its_parents_random_ids() -> None:
    uuid7_bytes()  # the parent's pool now holds bytes a child would inherit
    parent_end, child_end = multiprocessing.get_context("fork").Pipe()
    child = multiprocessing.get_context("fork").Process(target=_ids_in_child, args=(child_end,))
    child.start()
    in_child = set(parent_end.recv())
    child.join(timeout=30)
    in_parent = {uuid7_bytes().hex() for _ in range(64)}
    assert len(in_child) == len(in_parent) == 64
    assert not in_child & in_parent


def test_ids_drawn_on_many_threads_are_all_distinct_uuid7() -> None:
    found: list[str] = []

    def draw() -> None:
        found.extend(uuid7_bytes().hex() for _ in range(2000))

    threads = [threading.Thread(target=draw) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(set(found)) == len(found) == 16000
    assert {(uuid.UUID(hex=v).version, uuid.UUID(hex=v).variant) for v in found} == {
        (7, uuid.RFC_4122)
    }
