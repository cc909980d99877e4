"""Per-request caps and the large-request gate (pegaflow.common.request_limits),
without a server."""

from __future__ import annotations

import asyncio
import time

import pytest

from pegaflow.cache.registration_checks import validate_layers
from pegaflow.common.errors import DeadlineExceeded, InvalidRequest
from pegaflow.common.geometry import LayerLayout, Segment
from pegaflow.common.request_limits import (
    MAX_DESCRIPTORS_PER_BLOCK,
    MIN_AVG_SEGMENT_BYTES,
    LargeRequestGate,
    RequestCaps,
    check_block_geometry,
    pool_blocks,
)


def _layers(n: int, segs: int, seg_bytes: int) -> tuple[LayerLayout, ...]:
    page = segs * seg_bytes
    one = tuple(Segment(s * seg_bytes, seg_bytes) for s in range(segs))
    return tuple(LayerLayout(0, i * page, 1, page, one) for i in range(n))


def test_one_byte_segments_refused_naming_the_layer() -> None:
    """Regression: 4096 layers x 8 one-byte segments (32768 descriptors for a
    32 KiB block) were accepted; every Save then built ~58 B of tables per byte
    moved. Refused at registration, naming the segments' field."""
    with pytest.raises(InvalidRequest, match=r"^layers\[0\]\.segments: .*average"):
        validate_layers(_layers(4096, 8, 1), [4096 * 8])
    # The same count of 512-byte segments: too many descriptors per block.
    with pytest.raises(InvalidRequest, match=r"^layers: 4096 layers .* 16384"):
        validate_layers(_layers(4096, 8, 512), [4096 * 8 * 512])
    validate_layers(_layers(2048, 8, 512), [2048 * 8 * 512])  # at the cap


def test_first_layer_below_the_average_is_named() -> None:
    """A block of big pages with one layer of tiny segments: named by index."""
    big = (Segment(0, 1 << 20),)
    tiny = tuple(Segment(i, 1) for i in range(8))
    layers = (LayerLayout(0, 0, 1, 1 << 20, big),) * 3
    check_block_geometry([1, 1, 1, 8], [1 << 20] * 3 + [8])  # averages over a block
    layers += (LayerLayout(0, 0, 1, 8, tiny),) * 1000  # 8003 rows, 3 MiB
    with pytest.raises(InvalidRequest, match=r"^layers\[3\]\.segments"):
        validate_layers(layers, [1 << 20])


def test_caps_at_their_edges() -> None:
    check_block_geometry([8] * 2048, [8 * MIN_AVG_SEGMENT_BYTES] * 2048)
    check_block_geometry([1], [MIN_AVG_SEGMENT_BYTES])
    with pytest.raises(InvalidRequest, match="^layers: "):
        check_block_geometry([MAX_DESCRIPTORS_PER_BLOCK + 1], [1 << 30])
    with pytest.raises(InvalidRequest, match=r"^layers\[0\]\.segments"):
        check_block_geometry([2], [2 * MIN_AVG_SEGMENT_BYTES - 1])


def test_request_blocks_capped_by_pool_and_config() -> None:
    # 16 slabs of 1 MiB; 32 KiB slots: 32 a slab; a 64-byte skew loses one.
    assert pool_blocks(16 << 20, 1 << 20, 32 << 10, 0) == 512
    assert pool_blocks(16 << 20, 1 << 20, 32 << 10, 64) == 496
    caps = RequestCaps(16 << 20, 1 << 20, 65536)
    caps.check((32 << 10, 0), 512, "block_ids")
    with pytest.raises(InvalidRequest, match="^block_ids: 513 blocks exceed 512"):
        caps.check((32 << 10, 0), 513, "block_ids")
    small = RequestCaps(16 << 20, 1 << 20, 100)
    with pytest.raises(InvalidRequest, match="^items: 101 blocks exceed 100"):
        small.check_load((4096, 0), [(1, 0, [0] * 60), (1, 0, [0] * 41)], True)
    with pytest.raises(InvalidRequest, match="^block_ids: 101"):
        small.check_load((4096, 0), [(1, 0, [0] * 101)], False)


def _run(coro: object) -> object:
    return asyncio.run(coro)  # type: ignore[arg-type]


def test_gate_small_requests_pass_while_full() -> None:
    async def scenario() -> None:
        gate = LargeRequestGate(1, threshold=100)
        # The one slot is taken; one at the threshold is not large: it passes.
        async with gate.admit(101), gate.admit(100):
            assert gate.waiting == 0

    _run(scenario())


def test_gate_large_requests_wait_their_turn_in_order() -> None:
    """Three large requests through one slot: they run one at a time, in
    arrival order; each releases when done."""

    async def scenario() -> list[str]:
        gate = LargeRequestGate(1, threshold=0)
        order: list[str] = []
        release = {name: asyncio.Event() for name in "abc"}

        async def request(name: str) -> None:
            async with gate.admit(1):
                order.append(name)
                await release[name].wait()

        tasks = [asyncio.create_task(request(n)) for n in "abc"]
        while gate.waiting < 2:  # a and its two followers have arrived
            await asyncio.sleep(0)
        for i, name in enumerate("abc"):
            assert order == list("abc"[: i + 1])  # one at a time
            release[name].set()
            while i < 2 and len(order) < i + 2:
                await asyncio.sleep(0)
        await asyncio.gather(*tasks)
        return order

    assert _run(scenario()) == ["a", "b", "c"]


def test_gate_deadline_while_waiting() -> None:
    """A large request behind one that never finishes: DeadlineExceeded once its
    deadline passes, and its place in the queue is gone (the slot, once freed,
    goes to the next arrival)."""

    async def scenario() -> None:
        gate = LargeRequestGate(1, threshold=0)
        async with gate.admit(1):
            with pytest.raises(DeadlineExceeded, match="^deadline: "):
                async with gate.admit(1, time.monotonic() + 0.05):
                    raise AssertionError("admitted past its deadline")
            assert gate.waiting == 0
        async with gate.admit(1, time.monotonic() + 60):
            pass

    _run(scenario())


def test_gate_refuses_a_request_already_late() -> None:
    async def scenario() -> None:
        gate = LargeRequestGate(1, threshold=10)
        with pytest.raises(DeadlineExceeded):
            async with gate.admit(1, time.monotonic() - 1):
                raise AssertionError("a late small request started")

    _run(scenario())


def test_gate_cancelled_waiter_gives_up_its_turn() -> None:
    """A waiter cancelled (its client went away) leaves the queue; the slot then
    passes to the one behind it."""

    async def scenario() -> None:
        gate = LargeRequestGate(1, threshold=0)
        hold = asyncio.Event()
        admitted = asyncio.Event()

        async def holder() -> None:
            async with gate.admit(1):
                await hold.wait()

        async def follower() -> None:
            async with gate.admit(1):
                admitted.set()

        first = asyncio.create_task(holder())
        await asyncio.sleep(0)
        doomed = asyncio.create_task(follower())
        last = asyncio.create_task(follower())
        while gate.waiting < 2:
            await asyncio.sleep(0)
        doomed.cancel()
        with pytest.raises(asyncio.CancelledError):
            await doomed
        hold.set()
        await asyncio.wait_for(last, 10)
        await first
        assert admitted.is_set() and gate.waiting == 0
        async with gate.admit(1):  # the slot came back
            pass

    _run(scenario())
