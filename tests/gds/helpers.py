"""Small helpers of the SSD tier tests: random blocks in numpy arrays standing in
for pool slots, and one-call spill / load-and-check."""

from __future__ import annotations

import mmap
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from pegaflow.common.keys import namespace_digest
from pegaflow.gds import SsdConfig, SsdTier

NS = namespace_digest("model-a", (1, 2, 3))
# The I/O backend every test opens: "posix" (default, CI) or "kvikio" (the H200
# machine: benchmarks/gpu_runner.sh gds sets it); "auto" takes kvikio where usable.
BACKEND = os.environ.get("PEGAFLOW_TEST_SSD_BACKEND", "posix")
MODES = {
    "posix": ("posix-odirect", "posix-buffered"),
    "kvikio": ("kvikio-compat", "kvikio-gds"),
}.get(BACKEND, ("posix-odirect", "posix-buffered", "kvikio-compat", "kvikio-gds"))
SLOT_CRASH = 20000  # not a multiple of 4 KiB: staged
SLOT_CRASH_ALIGNED = 20480  # 5 pages: written in place from aligned memory


def config(
    tmp: Path, capacity: int = 16 << 20, files: int = 1, **kw: object
) -> SsdConfig:
    paths = tuple(str(tmp / f"cache{i}.bin") for i in range(files))
    kw.setdefault("show_progress", False)
    kw.setdefault("backend", BACKEND)
    return SsdConfig(paths=paths, capacity_bytes=capacity, **kw)  # type: ignore[arg-type]


@contextmanager
def opened(cfg: SsdConfig) -> Iterator[SsdTier]:
    tier = SsdTier(cfg)
    try:
        yield tier
    finally:
        tier.close()


def key(i: int) -> bytes:
    return b"block-%08d" % i


def block(i: int, shards: int, slot_bytes: int) -> np.ndarray:
    """Block i's bytes, [shards, slot_bytes]: random, but the same every call."""
    return np.random.default_rng(i).integers(0, 256, (shards, slot_bytes), np.uint8)


def page_aligned(arr: np.ndarray) -> np.ndarray:
    """A copy of arr in page-aligned memory, as the server's pool slots are:
    rows of a multiple of 4 KiB are then written to disk in place."""
    region = mmap.mmap(-1, max(arr.nbytes, 1))
    out = np.frombuffer(region, np.uint8)[: arr.nbytes].reshape(arr.shape)
    out[...] = arr
    return out


def addresses(arr: np.ndarray) -> list[int]:
    return [int(row.ctypes.data) for row in arr]


def spill(
    tier: SsdTier,
    ids: list[int],
    shards: int = 1,
    slot_bytes: int = 16384,
    aligned: bool = False,
) -> int:
    """Spill blocks, a queue's worth at a time, and wait until they are written;
    returns how many were queued. aligned: from page-aligned memory."""
    queued = 0
    step = tier.config.queue_blocks
    copy = page_aligned if aligned else np.ascontiguousarray
    for start in range(0, len(ids), step):
        held = [copy(block(i, shards, slot_bytes)) for i in ids[start : start + step]]
        for i, data in zip(ids[start : start + step], held, strict=True):
            queued += tier.spill(NS, key(i), addresses(data), slot_bytes)
        assert tier.flush(timeout=30)
    return queued


def load(
    tier: SsdTier, ids: list[int], shards: int = 1, slot_bytes: int = 16384
) -> np.ndarray:
    """Load blocks; every block reported ok must equal its bytes, byte for byte.
    Returns the ok mask."""
    dst = np.zeros((len(ids), shards, slot_bytes), np.uint8)
    table = np.array([addresses(d) for d in dst], np.uint64).reshape(len(ids), shards)
    res = tier.load(NS, [key(i) for i in ids], table, slot_bytes).result(timeout=30)
    for j, i in enumerate(ids):
        if res.ok[j]:
            assert np.array_equal(dst[j], block(i, shards, slot_bytes)), f"block {i}"
    assert res.nbytes == int(res.ok.sum()) * shards * slot_bytes
    return res.ok
