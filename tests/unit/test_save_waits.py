"""Saves waiting for blocks other writers have in flight
(pegaflow.server.save_waits): each is woken by a settle of its own blocks
only. Every settle in the store woke every waiting save, which looked again
and slept again: ~9 µs of event loop per waiter per settle (a review's
measurement), and saves pile up exactly when a writer stalls."""

from __future__ import annotations

import asyncio
import time

import pytest

from pegaflow.cache.block_entry import BlockEntry
from pegaflow.cache.block_store import BlockStore
from pegaflow.cache.eviction import LRUPolicy
from pegaflow.cache.slabs import SlabAllocator
from pegaflow.server import save_waits
from pegaflow.server.save_waits import Landings

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
