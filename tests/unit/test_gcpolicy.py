"""The server's GC policy: a full collection's survivors leave later ones, and
what they then drop is still freed (by reference counting)."""

from __future__ import annotations

import gc
import weakref

from pegaflow.server import gc_freeze as gcpolicy


class Node:
    __slots__ = ("next", "__weakref__")

    def __init__(self) -> None:
        self.next: object = None


def test_full_collection_survivors_are_frozen_and_still_freed() -> None:
    gc.unfreeze()
    gcpolicy.install()
    gcpolicy.install()  # idempotent
    try:
        keep = [Node() for _ in range(1000)]
        gc.collect(2)
        assert gc.get_freeze_count() >= len(keep)
        probe = weakref.ref(keep[0])
        del keep  # frozen, acyclic: refcounting frees them
        assert probe() is None
        young = Node()
        young.next = young  # a cycle among objects born after the freeze
        probe = weakref.ref(young)
        del young
        gc.collect(2)
        assert probe() is None
    finally:
        gcpolicy.uninstall()
        gc.unfreeze()
    assert gcpolicy._freeze_survivors not in gc.callbacks
