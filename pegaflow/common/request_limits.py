"""Per-request bounds tied to the pool and the registration, and a gate for the
few requests whose descriptor tables are large.

A copy is described by a table of descriptors, one per (block, layer, segment)
(pegaflow.common.geometry.Transfers: 24 B a row). Building and running one costs 58 to
~115 B a descriptor at its peak (temporaries, bounds checks, iovecs): one Save
of 16.8 M one-byte descriptors (512 blocks of 4096 layers x 8 segments) grew
the server's RSS by 932 MiB; 262144 descriptors of 512 B that do not coalesce
peaked at +28.6 MiB (tests/server/test_request_caps.py). Nothing tied that
count to the bytes moved, so one-byte segments turned a 16 MiB pool into
~1 GiB of tables. The bounds:

- a block has at most MAX_DESCRIPTORS_PER_BLOCK (layers x segments) and its
  segments average at least MIN_AVG_SEGMENT_BYTES, so
      descriptors per block <= slot_bytes / 512;
- a Save or Load moves at most as many blocks as the pool holds slots of that
  size (more cannot be stored anyway) and at most max_blocks_per_request, so
      descriptors per request <= pool_slots * slot_bytes / 512 <= pool / 512,
  i.e. tables of at most 115 / 512 = 22 % of the pool at the peak (11 % when
  pages coalesce), whatever the geometry;
- at most `slots` requests above `threshold` descriptors copy at once
  (LargeRequestGate); the others wait their turn, up to their deadline. Saves
  are bounded together anyway (each holds the pool slots it fills); loads of
  one lease are not. The gate sits in CopyDispatch.run, so it bounds the copies'
  working memory (bounds checks, iovecs, staging) and threads, but a queued
  request's table is already built: at most max_concurrent_rpcs of them,
  each under a small fraction of the pool.

gRPC messages are bounded before they are deserialised (MAX_MESSAGE_BYTES): a
message is parsed in full before any check of ours runs, so 8 refused 1M-hash
queries of 34 MiB each (then under the 64 MiB limit) cost the server
~1 GiB of RSS.

Within that bound, bodies of LARGE_BODY_BYTES or more being worked on at once
(parsed, or waiting in a Save, a Load or a query's remote lookup) share
RequestBytesBudget (--max-request-bytes-in-flight); one past it is refused
with RESOURCE_EXHAUSTED naming the limit, before it is parsed. Engines'
ordinary requests are smaller and never wait on it: their total is bounded
by max_concurrent_rpcs x LARGE_BODY_BYTES (64 MiB). Working on a body costs
up to ~2x its bytes (a query's hashes packed into one buffer; a parsed
Save's hashes), so the budget bounds that working memory to ~3x itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from .errors import DeadlineExceeded, InvalidRequest, Overloaded

# 4096 layers x 4 segments, or 2048 x 8: more than any model registers (a
# vLLM 0.33 layer is one page, an older K/V-first one two segments).
MAX_DESCRIPTORS_PER_BLOCK = 16384
# vLLM pages are KiBs (16 tokens x 1 head x 16 dims x 2 x bf16 = 1 KiB is a
# toy model's TP shard); a page cut into smaller pieces only multiplies rows.
MIN_AVG_SEGMENT_BYTES = 512

# The largest legitimate messages, with protobuf's per-field overhead (a tag
# byte, a length varint):
#   QueryPrefix / Save: 65536 hashes x (64 B + 2) = 4.1 MiB (32 B hashes:
#     2.1 MiB), plus a Save's 65536 block ids as packed varints (<= 5 B) =
#     0.3 MiB: 4.4 MiB.
#   Load: 65536 destination ids (0.3 MiB) in <= 65536 items of a lease id,
#     offset and header (<= 24 B): 1.8 MiB.
#   RegisterInstance of 4096 layers: each layer <= 4 varints (<= 40 B) and
#     <= 8 segments of 2 varints (<= 24 B each): 232 B a layer, 0.9 MiB.
# 8 MiB leaves ~1.8x headroom over the largest (a Save of 64-byte hashes).
MAX_MESSAGE_BYTES = 8 << 20
# Every engine worker holds one Session stream open for its lifetime, and each
# counts as a running RPC: the limit must sit well above the number of workers
# on one host (a few dozen) plus their in-flight calls. Past it grpc answers
# RESOURCE_EXHAUSTED instead of queueing without bound.
MAX_CONCURRENT_RPCS = 1024

# Bodies at least this large count against RequestBytesBudget: a 65536-block
# Save of 32-byte hashes is 2.5 MiB, one step's Save of a few hundred blocks
# a few KiB.
LARGE_BODY_BYTES = 64 << 10
# 32 of the largest messages, ~16 of the largest legitimate Saves of 64-byte
# hashes, at once.
MAX_REQUEST_BYTES_IN_FLIGHT = 256 << 20

# Leases one batched Load names: one a request loading this step, so a few
# hundred at most (vLLM's max_num_seqs); a frame of 8 MiB could name ~520K,
# each an object built before any other field is checked.
MAX_LOAD_ITEMS = 16384

LoadItems = Sequence[tuple[int, int, Sequence[int]]]


def check_load_items(n: int) -> None:
    if n > MAX_LOAD_ITEMS:
        raise InvalidRequest(f"items: {n} in one load, at most {MAX_LOAD_ITEMS}")


def check_block_geometry(seg_counts: Sequence[int], seg_bytes: Sequence[int]) -> None:
    """A block's descriptor count and average segment, per the bounds above.

    seg_counts[i]: layer i's segments; seg_bytes[i]: layer i's page bytes.
    """
    descriptors, total = sum(seg_counts), sum(seg_bytes)
    if total < MIN_AVG_SEGMENT_BYTES * descriptors:
        # Some layer averages below the floor when the whole block does.
        i = next(
            i
            for i, (n, b) in enumerate(zip(seg_counts, seg_bytes, strict=True))
            if b < MIN_AVG_SEGMENT_BYTES * n
        )
        raise InvalidRequest(
            f"layers[{i}].segments: {seg_counts[i]} segment(s) of "
            f"{seg_bytes[i]} bytes in all; a block's segments must average "
            f">= {MIN_AVG_SEGMENT_BYTES} bytes (it has {descriptors} segments "
            f"of {total} bytes)"
        )
    if descriptors > MAX_DESCRIPTORS_PER_BLOCK:
        raise InvalidRequest(
            f"layers: {len(seg_counts)} layers with {descriptors} segments in all "
            f"exceed {MAX_DESCRIPTORS_PER_BLOCK} segments per block"
        )


def pool_blocks(pool_bytes: int, slab_bytes: int, slot_bytes: int, skew: int) -> int:
    """How many slots of this size (and 4 KiB skew) the whole pool holds."""
    return pool_bytes // slab_bytes * ((slab_bytes - skew) // slot_bytes)


def check_request_blocks(n: int, cap: int, field: str) -> None:
    if n > cap:
        raise InvalidRequest(f"{field}: {n} blocks exceed {cap} per request")


@dataclass(frozen=True, slots=True)
class RequestCaps:
    """The block bound of a Save or Load, from the pool and the config."""

    pool_bytes: int
    slab_bytes: int
    max_blocks: int  # EngineConfig.max_blocks_per_request

    def cap(self, slot_class: tuple[int, int]) -> int:
        slot_bytes, skew = slot_class
        held = pool_blocks(self.pool_bytes, self.slab_bytes, slot_bytes, skew)
        return min(self.max_blocks, held)

    def check(self, slot_class: tuple[int, int], n: int, field: str) -> None:
        """slot_class: the namespace's (slot bytes, skew)."""
        check_request_blocks(n, self.cap(slot_class), field)

    def check_load(
        self, slot_class: tuple[int, int], items: LoadItems, batch: bool
    ) -> None:
        """Every item's destination blocks together, as one copy moves them."""
        check_load_items(len(items))
        n = sum(len(block_ids) for _, _, block_ids in items)
        check_request_blocks(n, self.cap(slot_class), "items" if batch else "block_ids")


class LargeRequestGate:
    """Admits at most `slots` requests above `threshold` descriptors at once,
    first come first served; smaller ones pass without waiting (and without
    yielding to the event loop). One event loop; not thread-safe."""

    def __init__(self, slots: int, threshold: int) -> None:
        if slots < 1:
            raise ValueError("slots: must be >= 1")
        self.slots = slots
        self.threshold = threshold
        self._free = slots
        self._waiters: deque[asyncio.Future[None]] = deque()

    @property
    def waiting(self) -> int:
        return sum(not w.done() for w in self._waiters)

    def admit(self, descriptors: int, deadline: float | None = None) -> _Admission:
        """`async with gate.admit(n, deadline):` the work. deadline:
        time.monotonic() seconds; DeadlineExceeded once it passed before the
        work could start (at once for a request already late)."""
        return _Admission(self, descriptors, deadline)

    async def _acquire(self, descriptors: int, deadline: float | None) -> None:
        if self._free and not self._waiters:
            self._free -= 1
            return
        turn = asyncio.get_running_loop().create_future()
        self._waiters.append(turn)
        timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
        try:
            await asyncio.wait({turn}, timeout=timeout)
        except BaseException:  # cancelled: pass a slot already handed to us on
            self._leave(turn)
            raise
        if not turn.done():
            self._leave(turn)
            raise DeadlineExceeded(
                f"deadline: passed while {descriptors} descriptors waited for one "
                f"of {self.slots} large-request slots"
            )

    def _leave(self, turn: asyncio.Future[None]) -> None:
        if turn.done() and not turn.cancelled():
            self._release()  # granted as we gave up: the slot goes on
            return
        turn.cancel()
        with contextlib.suppress(ValueError):
            self._waiters.remove(turn)

    def _release(self) -> None:
        while self._waiters:
            turn = self._waiters.popleft()
            if not turn.done():
                turn.set_result(None)  # the slot passes straight to the next
                return
        self._free += 1


class _Admission:
    """One request's pass through a LargeRequestGate. A class, not an
    asynccontextmanager: every save and load enters one, and the async
    generator behind that decorator cost ~5 us a request (asyncio's
    first-iteration hook; dev VM, benchmarks/bookkeeping.py)."""

    __slots__ = ("_deadline", "_descriptors", "_gate", "_held")

    def __init__(
        self, gate: LargeRequestGate, descriptors: int, deadline: float | None
    ) -> None:
        self._gate, self._descriptors, self._deadline = gate, descriptors, deadline
        self._held = False

    async def __aenter__(self) -> None:
        deadline = self._deadline
        if deadline is not None and time.monotonic() >= deadline:
            raise DeadlineExceeded("deadline: passed before the copy could start")
        if self._descriptors <= self._gate.threshold:
            return
        await self._gate._acquire(self._descriptors, deadline)
        self._held = True

    async def __aexit__(self, *exc: object) -> None:
        if self._held:
            self._held = False
            self._gate._release()


class RequestBytesBudget:
    """Bytes of large request bodies (>= LARGE_BODY_BYTES) being worked on at
    once, over every gRPC call. A body that would pass `limit` is refused,
    unless none is in progress (a lone message of any accepted size passes).
    take() and give() come from the event loop and, for a body dropped
    unanswered, from whichever thread drops it: a lock keeps the count."""

    def __init__(self, limit: int, flag: str = "--max-request-bytes-in-flight") -> None:
        self.limit = limit
        self._flag = flag
        self._used = 0
        self._lock = threading.Lock()

    @property
    def used(self) -> int:
        return self._used

    def take(self, nbytes: int) -> Overloaded | None:
        """None when charged (give() it back), else the refusal to answer."""
        with self._lock:
            if self._used and self._used + nbytes > self.limit:
                used = self._used
            else:
                self._used += nbytes
                return None
        return Overloaded(
            f"request: {nbytes} bytes, and {used} bytes of large requests are "
            f"being worked on; at most {self.limit} at once ({self._flag}); retry"
        )

    def give(self, nbytes: int) -> None:
        with self._lock:
            self._used -= nbytes
