"""SSD → GPU direct loads (gds.gpu_reads) on the CPU: records a real SsdTier
wrote, read by DirectReads into an engine-shaped buffer through a POSIX
stand-in for kvikio's CuFile that treats device addresses as host ones (the
null backend: the same plan, batch, header and checksum checks; the real
kvikio + GPU run is tests/gpu/test_gds_direct.py). Byte-checked; a corrupted
record is never reported loaded."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from pegaflow.common.errors import DeadlineExceeded, InternalError
from pegaflow.common.geometry import KVGeometry, LayerLayout, Segment
from pegaflow.gds import gpu_reads
from pegaflow.gds.format import HEADER_BYTES
from pegaflow.gds.gpu_reads import DirectReads
from pegaflow.gds.io import host_view
from tests.gds.helpers import NS, block, config, key, opened, spill

LAYERS, BLOCKS, PAGE = 4, 16, 4096
SLOT = LAYERS * PAGE


class _Done:
    def __init__(self, n: int) -> None:
        self.n = n

    def get(self) -> int:
        return self.n


class HostFile:
    """kvikio CuFile's pread over os.preadv; 'device' memory is host memory."""

    def __init__(self, path: str) -> None:
        self.fd = os.open(path, os.O_RDONLY)
        self.calls = 0

    def pread(self, buf: object, size: int, file_offset: int) -> _Done:
        cai = getattr(buf, "__cuda_array_interface__", None)
        addr = cai["data"][0] if cai else np.asarray(buf).ctypes.data
        self.calls += 1
        return _Done(os.preadv(self.fd, [host_view(addr, size)], file_offset))

    def close(self) -> None:
        os.close(self.fd)


def fetch(src: np.ndarray, nbytes: np.ndarray, total: int) -> memoryview:
    out = bytearray(total)
    at = 0
    for a, n in zip(src.tolist(), nbytes.tolist(), strict=True):
        out[at : at + n] = host_view(a, n)
        at += n
    return memoryview(out)


def engine(kind: str) -> tuple[np.ndarray, KVGeometry]:
    """An engine's KV buffer (layer-major as vLLM 0.33, or block-major)."""
    kv = np.zeros(LAYERS * BLOCKS * PAGE, np.uint8)
    base = kv.ctypes.data
    if kind == "layer_major":
        layers = [
            LayerLayout(0, i * BLOCKS * PAGE, BLOCKS, PAGE, (Segment(0, PAGE),))
            for i in range(LAYERS)
        ]
    else:
        layers = [
            LayerLayout(0, i * PAGE, BLOCKS, SLOT, (Segment(0, PAGE),))
            for i in range(LAYERS)
        ]
    return kv, KVGeometry(tuple(layers), [base])


def engine_block(kv: np.ndarray, geo: KVGeometry, b: int) -> np.ndarray:
    """Block b's pages in slot order, read out of the engine buffer."""
    base = kv.ctypes.data
    rows = [
        kv[int(o) + b * int(s) - base :][: int(n)]
        for o, s, n in zip(
            geo.engine_offset, geo.block_stride, geo.seg_bytes, strict=True
        )
    ]
    return np.concatenate(rows)


def _flip(path: str, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x40]))


@pytest.mark.parametrize("kind", ["layer_major", "block_major"])
def test_direct_load_lands_every_byte(tmp_path: Path, kind: str) -> None:
    cfg = config(tmp_path, files=2)
    ids = list(range(12))
    with opened(cfg) as tier:
        spill(tier, ids, slot_bytes=SLOT, aligned=True)
        kv, geo = engine(kind)
        files = [HostFile(p) for p in cfg.paths]
        reads = DirectReads(tier, files)
        try:
            dest = np.random.default_rng(1).permutation(BLOCKS)[: len(ids) + 1]
            hashes = [key(i) for i in ids] + [b"not-on-the-ssd"]
            regions = [(kv.ctypes.data, kv.nbytes)]
            res = reads.load(NS, hashes, dest, geo, regions, fetch)
        finally:
            reads.close()
        assert res.ok.tolist() == [True] * len(ids) + [False]
        assert res.nbytes == len(ids) * SLOT
        for i, b in zip(ids, dest.tolist(), strict=False):
            np.testing.assert_array_equal(
                engine_block(kv, geo, b), block(i, 1, SLOT)[0]
            )
        # Every read of the load issued before any wait: one per header page,
        # and the payload pages (merged where contiguous on both sides).
        pages = len(ids) * LAYERS
        assert res.reads <= pages
        assert sum(f.calls for f in files) == len(ids) + res.reads
        assert not tier.store.index.get(NS, key(0)).readers  # unpinned


def test_corrupted_records_are_not_loaded_and_the_rest_are(tmp_path: Path) -> None:
    """A flipped payload byte (checksum) and a flipped header byte: both False
    straight from the GPU route, and dropped from the store (a query must not
    lease them again), as the L1 route drops them."""
    cfg = config(tmp_path)
    ids = list(range(6))
    with opened(cfg) as tier:
        spill(tier, ids, slot_bytes=SLOT, aligned=True)
        recs = [tier.store.index.get(NS, key(i)) for i in (2, 4)]
        _flip(cfg.paths[0], recs[0].offset + HEADER_BYTES + 5000)
        _flip(cfg.paths[0], recs[1].offset + 40)
        kv, geo = engine("layer_major")
        reads = DirectReads(tier, [HostFile(cfg.paths[0])])
        try:
            res = reads.load(
                NS,
                [key(i) for i in ids],
                np.arange(len(ids)),
                geo,
                [(kv.ctypes.data, kv.nbytes)],
                fetch,
            )
        finally:
            reads.close()
        assert res.ok.tolist() == [True, True, False, True, False, True]
        for i in (0, 1, 3, 5):
            np.testing.assert_array_equal(
                engine_block(kv, geo, i), block(i, 1, SLOT)[0]
            )
        assert tier.lookup(NS, [key(2)]) == tier.lookup(NS, [key(4)]) == 0
        assert tier.lookup(NS, [key(i) for i in (0, 1)]) == 2  # the good stay
        counts = tier.store.counters
        assert counts.checksum_failures == 1 and counts.header_mismatches == 1


def test_destination_outside_registered_memory_reads_nothing(tmp_path: Path) -> None:
    cfg = config(tmp_path)
    with opened(cfg) as tier:
        spill(tier, [0, 1], slot_bytes=SLOT, aligned=True)
        kv, geo = engine("layer_major")
        files = [HostFile(cfg.paths[0])]
        reads = DirectReads(tier, files)
        try:
            small = [(kv.ctypes.data, kv.nbytes - PAGE)]  # the last page is out
            with pytest.raises(InternalError, match="leaves the worker's registered"):
                reads.load(
                    NS, [key(0), key(1)], np.array([0, BLOCKS - 1]), geo, small, fetch
                )
        finally:
            reads.close()
        assert files[0].calls == 0
        assert not kv.any()
        assert not tier.store.index.get(NS, key(0)).readers


def test_a_failed_read_loads_nothing(tmp_path: Path) -> None:
    class Failing(HostFile):
        def pread(self, buf: object, size: int, file_offset: int) -> _Done:
            if self.calls == 3:
                raise OSError(5, "injected")
            return super().pread(buf, size, file_offset)

    cfg = config(tmp_path)
    with opened(cfg) as tier:
        spill(tier, [0, 1, 2], slot_bytes=SLOT, aligned=True)
        kv, geo = engine("block_major")
        reads = DirectReads(tier, [Failing(cfg.paths[0])])
        try:
            res = reads.load(
                NS,
                [key(i) for i in range(3)],
                np.arange(3),
                geo,
                [(kv.ctypes.data, kv.nbytes)],
                fetch,
            )
        finally:
            reads.close()
        assert not res.ok.any() and res.nbytes == 0


def test_no_read_is_issued_past_the_deadline(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Regression: the deadline was checked once, before any read was
    issued. It passes after the third read is issued here: no fourth one is,
    the load fails with DeadlineExceeded (nothing of it reported loaded) and
    its records are unpinned."""
    clock = [0.0]

    class Slow(HostFile):
        def pread(self, buf: object, size: int, file_offset: int) -> _Done:
            done = super().pread(buf, size, file_offset)
            if self.calls == 3:
                clock[0] = float("inf")  # the deadline passes meanwhile
            return done

    deadline = time.monotonic() + 3600.0  # the check before planning passes
    monkeypatch.setattr(
        gpu_reads,
        "time",
        SimpleNamespace(perf_counter=time.perf_counter, monotonic=lambda: clock[0]),
    )
    cfg = config(tmp_path)
    with opened(cfg) as tier:
        spill(tier, [0, 1, 2], slot_bytes=SLOT, aligned=True)
        kv, geo = engine("block_major")
        files = [Slow(cfg.paths[0])]
        reads = DirectReads(tier, files)
        try:
            with pytest.raises(DeadlineExceeded, match="after 3 of"):
                reads.load(
                    NS,
                    [key(i) for i in range(3)],
                    np.arange(3),
                    geo,
                    [(kv.ctypes.data, kv.nbytes)],
                    fetch,
                    deadline,
                )
        finally:
            reads.close()
        assert files[0].calls == 3
        assert all(not tier.store.index.get(NS, key(i)).readers for i in range(3))


def test_device_fetch_on_the_simulator() -> None:
    """The fetch-back that checks direct reads on the GPU, on numba's simulator."""
    script = Path(__file__).with_name("fetch_back_sim.py")
    env = {**os.environ, "NUMBA_ENABLE_CUDASIM": "1"}
    out = subprocess.run(
        [sys.executable, str(script)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]
