"""`freeze_startup_heap`: what startup left is exempt from later collections; garbage made
before the call and after it is still collected."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator

import pytest

from infercloud.startup_heap import freeze_startup_heap


class Node:
    def __init__(self) -> None:
        self.self_ref = self  # a cycle: only the collector frees it


@pytest.fixture
def unfreeze() -> Iterator[None]:
    yield
    gc.unfreeze()


def test_freeze_keeps_collecting_garbage(unfreeze: None) -> None:
    before = Node()
    dead_before = weakref.ref(before)
    del before
    kept = Node()
    frozen = freeze_startup_heap()
    assert dead_before() is None  # collected by the call, not frozen with the heap
    assert frozen == gc.get_freeze_count() > 0
    tracked = len(gc.get_objects())
    assert tracked < frozen  # a full collection now walks only what came after the freeze
    after = Node()
    dead_after = weakref.ref(after)
    del after
    gc.collect()
    assert dead_after() is None
    assert kept.self_ref is kept
