"""Saves waiting for blocks other writers have in flight
(pegaflow.server.save_waits): each is woken by a settle of its own blocks
only. Every settle in the store woke every waiting save, which looked again
and slept again: ~9 µs of event loop per waiter per settle (a review's
measurement), and saves pile up exactly when a writer stalls."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest

from pegaflow.cache.block_entry import BlockEntry
from pegaflow.cache.block_store import BlockStore
from pegaflow.cache.eviction import LRUPolicy
from pegaflow.cache.registration_checks import RegisterSpec
from pegaflow.cache.slabs import SlabAllocator
from pegaflow.common.errors import CopyFailed, Overloaded
from pegaflow.common.geometry import LayerLayout, Segment, Transfers
from pegaflow.common.identity import CallContext, Caller
from pegaflow.common.pidfds import ProcessChanged
from pegaflow.server import save_waits
from pegaflow.server.save_waits import Landings
from tests.unit.host_engine import PAGE, host_engine
from tests.unit.stand_in_engine import ENGINE_PID

SLOT = 1 << 16


def test_a_waiting_save_is_woken_by_its_own_blocks_only(monkeypatch) -> None:
    store = BlockStore(SlabAllocator(1 << 30, 64 * SLOT, SLOT), LRUPolicy())
    landings = Landings(store)
    mine, other = (BlockEntry((1, bytes([i]) * 32), [0], in_flight=1) for i in (1, 2))
    for entry in (mine, other):
        store.entries[entry.key] = entry
    waits = 0
    real_wait = asyncio.wait

    async def counted(*args, **kwargs):
        nonlocal waits
        waits += 1
        return await real_wait(*args, **kwargs)

    monkeypatch.setattr(save_waits.asyncio, "wait", counted)

    async def scenario() -> list[bool]:
        waiter = asyncio.ensure_future(landings.wait([mine], 1, None))
        await asyncio.sleep(0)
        for _ in range(100):  # other writers' blocks land
            other.in_flight, other.landed = 0, 1
            store.on_settle([other])
            await asyncio.sleep(0)
        assert not waiter.done() and waits == 1
        mine.in_flight, mine.landed = 0, 1
        store.on_settle([mine])
        return (await asyncio.wait_for(waiter, 5)).tolist()

    assert asyncio.run(scenario()) == [False]  # it landed
    assert waits == 1 and not landings._waiting


def test_a_waiting_save_gives_up_at_its_deadline() -> None:
    store = BlockStore(SlabAllocator(1 << 30, 64 * SLOT, SLOT), LRUPolicy())
    landings = Landings(store)
    stuck = BlockEntry((1, b"s" * 32), [0], in_flight=1)
    store.entries[stuck.key] = stuck

    async def scenario() -> list[bool]:
        deadline = time.monotonic() + 0.05  # the server's deadlines' clock
        return (await landings.wait([stuck], 1, deadline)).tolist()

    assert asyncio.run(scenario()) == [True]  # still in flight: not landed
    assert not landings._waiting


@pytest.mark.parametrize("gone", ["failed", "evicted"])
def test_a_waiter_learns_its_block_did_not_land(gone: str) -> None:
    store = BlockStore(SlabAllocator(1 << 30, 64 * SLOT, SLOT), LRUPolicy())
    landings = Landings(store)
    entry = BlockEntry((1, b"f" * 32), [0], in_flight=1)
    store.entries[entry.key] = entry

    async def scenario() -> list[bool]:
        waiter = asyncio.ensure_future(landings.wait([entry], 1, None))
        await asyncio.sleep(0)
        entry.in_flight = 0
        if gone == "evicted":
            del store.entries[entry.key]
        store.on_settle([entry])
        return (await asyncio.wait_for(waiter, 5)).tolist()

    assert asyncio.run(scenario()) == [True]


class FailsSecond:
    """A host copier whose first gather copies and whose next ones fail with
    `error` (any PegaflowError a copy can end with)."""

    def __init__(self, error: Exception) -> None:
        self.error, self.gathers = error, 0

    def open(self, pid: int, regions: list, cuda: object = None) -> object:
        return object()

    def event_done(self, handle: object, wait_event: int) -> bool:
        return True

    def gather(self, handle: object, t: Transfers, wait_event: int = 0,
               deadline: float | None = None) -> None:  # fmt: skip
        self.gathers += 1
        if self.gathers > 1:
            raise self.error

    def close(self, handle: object) -> None:
        pass


@pytest.mark.parametrize(
    "error",
    [
        CopyFailed("process_vm_readv: EFAULT"),
        ProcessChanged("pid 1: executed another program since it registered"),
        Overloaded("too many copies wait"),
    ],
    ids=lambda e: type(e).__name__,
)
def test_a_save_again_that_fails_reports_what_the_save_stored(error) -> None:
    """Scenario: engine "i" saves A1, A2, B while another writer has A1 and
    A2 in flight: B is copied, the save waits for A1, A2. That writer fails;
    a third stores A1 before the save looks again, so its second reservation
    finds A1 resident and copies A2 only, which fails. The answer: B stored,
    A1 deduplicated (it is served), A2 rejected. A failure other than
    CopyFailed or DeadlineExceeded once ended the whole save in an error
    (B stored, never acknowledged), and A1 was counted rejected though
    resident."""
    engine = host_engine(FailsSecond(error))
    layer = LayerLayout(0, 0, 8, PAGE, (Segment(0, PAGE),))
    spec = RegisterSpec(
        "i", "ns", 0, 1, 1, "cpu", "host", ENGINE_PID, ((PAGE, 8 * PAGE),), (layer,)
    )
    a1, a2, b = (bytes([i]) * 32 for i in (1, 2, 3))
    store = engine.store

    async def scenario() -> object:
        init = Caller("unix", ENGINE_PID, 0)
        ctx = CallContext(init, engine.register(spec, init).owner_token)
        ns = engine.registry.worker("i", 0).namespace
        layers = np.arange(1)
        other = store.reserve_save(ns, 0, [a1, a2], layers)
        assert len(other.keys) == 2
        save = asyncio.ensure_future(
            engine.save("i", 0, np.arange(3), [a1, a2, b], None, 0, ctx)
        )
        while not engine.landings._waiting:  # B copied; waiting for A1, A2
            assert not save.done(), save.result()
            await asyncio.sleep(0)
        store.finish_save(other, False)
        third = store.reserve_save(ns, 0, [a1], layers)
        store.finish_save(third, True)
        got = await asyncio.wait_for(save, 5)
        assert [len(store.longest_prefix(ns, [h])) for h in (a1, a2, b)] == [1, 0, 1]
        return got

    got = asyncio.run(scenario())
    assert (got.stored, got.deduplicated, got.rejected) == (1, 1, 1)
    assert engine.store.slabs.used_bytes == 2 * PAGE  # A1 and B: A2's slot went back
