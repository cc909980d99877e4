"""An event-gated Save whose event already completed copies inline, without
the wait; one whose event is pending still waits on a copy thread."""

from __future__ import annotations

import asyncio
import threading

import numpy as np
import pytest

from pegaflow.config import EngineConfig, PoolConfig
from pegaflow.engine import Engine
from pegaflow.errors import InvalidRequest
from pegaflow.geometry import LayerLayout, Segment, Transfers
from pegaflow.identity import CallContext, Caller
from pegaflow.pool import HostPool
from pegaflow.registration import RegisterSpec

PAGE = 4096


class EventCopier:
    """Stand-in for the CUDA copier: an event that is done or not, and a log
    of (thread, wait_event) per gather."""

    def __init__(self, done: bool) -> None:
        self.done = done
        self.gathers: list[tuple[str, int]] = []

    def open(self, pid: int, regions: list, cuda: object = None) -> object:
        return object()

    def event_done(self, handle: object, wait_event: int) -> bool:
        if wait_event != 1:
            raise InvalidRequest(f"wait_event: {wait_event}, 1 event registered")
        return self.done

    def gather(
        self,
        handle: object,
        t: Transfers,
        wait_event: int = 0,
        deadline: float | None = None,
    ) -> None:
        self.gathers.append((threading.current_thread().name, wait_event))

    def scatter(
        self, handle: object, t: Transfers, deadline: float | None = None
    ) -> None:
        raise AssertionError("not used")

    def close(self, handle: object) -> None:
        pass


def _save(copier: EventCopier, wait_event: int) -> object:
    pool = HostPool(PoolConfig(size_bytes=4 << 20, show_progress=False))
    engine = Engine(EngineConfig(), pool, {"host": copier})
    layer = LayerLayout(0, 0, 8, PAGE, (Segment(0, PAGE),))
    spec = RegisterSpec(
        "i", "ns", 0, 1, 1, "cpu", "host", 1, ((PAGE, 8 * PAGE),), (layer,)
    )

    async def scenario() -> object:
        init = Caller("unix", 1, 0)
        ctx = CallContext(init, engine.register(spec, init).owner_token)
        hashes = [bytes([i]) * 32 for i in range(2)]
        return await engine.save("i", 0, np.arange(2), hashes, None, wait_event, ctx)

    return asyncio.run(scenario())


def test_a_completed_event_copies_inline_without_waiting() -> None:
    copier = EventCopier(done=True)
    assert _save(copier, 1).stored == 2  # type: ignore[attr-defined]
    assert copier.gathers == [("MainThread", 0)]


def test_a_pending_event_waits_on_a_copy_thread() -> None:
    copier = EventCopier(done=False)
    assert _save(copier, 1).stored == 2  # type: ignore[attr-defined]
    [(thread, wait_event)] = copier.gathers
    assert thread != "MainThread" and wait_event == 1


def test_a_bad_event_index_fails_the_save_before_any_copy() -> None:
    copier = EventCopier(done=True)
    with pytest.raises(InvalidRequest, match="wait_event"):
        _save(copier, 2)
    assert copier.gathers == []
