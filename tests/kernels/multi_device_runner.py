"""CudaCopyEngine serving several GPUs, on numba's CUDA simulator; prints
{name: traceback or ""} (test_multi_device_sim.py runs it in a fresh process:
NUMBA_ENABLE_CUDASIM must be set before numba.cuda is first imported).

The copy engine, its per-device state (the pool's alias, two streams per GPU,
faults), its mappings and the simulated kernels are the real ones; only the
CUDA driver calls the simulator lacks stand in (`Driver` below): device UUIDs,
IPC handles that name host buffers, and a record of which device each call
ran on. Engines' "GPU memory" is host memory, as everything under the
simulator. Tiny shapes: the simulator runs a Python thread per CUDA thread.

    python tests/kernels/multi_device_runner.py
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path

os.environ["NUMBA_ENABLE_CUDASIM"] = "1"
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import numpy as np  # noqa: E402

from pegaflow.common import cuda_driver  # noqa: E402
from pegaflow.common.errors import DeviceBroken, InvalidRequest  # noqa: E402
from pegaflow.common.geometry import KVGeometry  # noqa: E402
from pegaflow.copiers import cuda_copier  # noqa: E402
from pegaflow.copiers.copier import CudaExport  # noqa: E402
from pegaflow.copiers.path_choice import CopyPolicy  # noqa: E402
from pegaflow.kernels.plan import aligned_empty  # noqa: E402
from tests.kernels.kernel_cases import lbnhc  # noqa: E402

GPUS = 3  # ordinals 0..2: a TP 3 engine, one rank per GPU
LAYERS, BLOCKS, PAGE = 2, 4, 96  # one rank's KV: 768 bytes
SLOT = LAYERS * PAGE


class Driver:
    """The driver calls CudaCopyEngine makes, for the simulator: `handles`
    maps IPC handle bytes to (address, size) of a host buffer."""

    def __init__(self) -> None:
        self.handles: dict[bytes, tuple[int, int]] = {}
        self.current = threading.local()  # the ordinal set_device made current
        self.calls: list[tuple[str, int, object]] = []  # (call, device, what)
        self.lock = threading.Lock()

    def install(self) -> None:
        for name in ("set_device", "device_uuid", "open_ipc_memory",
                     "address_range", "close_ipc_memory", "open_ipc_event",
                     "destroy_event"):  # fmt: skip
            setattr(cuda_driver, name, getattr(self, name))

    def note(self, call: str, what: object) -> None:
        with self.lock:
            self.calls.append((call, getattr(self.current, "ordinal", -1), what))

    def set_device(self, ordinal: int) -> None:
        self.current.ordinal = ordinal

    @staticmethod
    def device_uuid(ordinal: int) -> bytes:
        return uuid(ordinal)

    def open_ipc_memory(self, handle: bytes) -> int:
        if handle not in self.handles:
            raise cuda_driver.CudaError("cudaIpcOpenMemHandle: cudaErrorInvalidValue")
        self.note("open", handle)
        return self.handles[handle][0]

    def address_range(self, pointer: int) -> tuple[int, int]:
        return next(v for v in self.handles.values() if v[0] == pointer)

    def close_ipc_memory(self, pointer: int) -> None:
        self.note("close", pointer)

    def open_ipc_event(self, handle: bytes) -> object:
        return ("event", handle)

    def destroy_event(self, event: object) -> None:
        self.note("destroy", event)


def uuid(ordinal: int) -> bytes:
    return bytes([0xC0 + ordinal]) * 16


class Rank:
    """One TP rank's KV on GPU `ordinal`: random bytes, exported by handle."""

    def __init__(self, driver: Driver, ordinal: int, seed: int, handle: bytes) -> None:
        self.kv = aligned_empty(LAYERS * BLOCKS * PAGE)
        self.kv[:] = np.random.default_rng(seed).integers(0, 256, self.kv.size)
        driver.handles[handle] = (self.kv.ctypes.data, self.kv.nbytes)
        self.export = CudaExport((handle,), uuid(ordinal), (b"e" * 64,))
        self.layers = lbnhc(LAYERS, BLOCKS, PAGE)

    def open(self, engine: cuda_copier.CudaCopyEngine) -> cuda_copier.CudaRegions:
        regions = engine.open(os.getpid(), [(0, self.kv.nbytes)], self.export)
        self.geometry = KVGeometry(self.layers, list(regions.bases))
        return regions

    def page(self, block: int, layer: int) -> np.ndarray:
        start = (layer * BLOCKS + block) * PAGE
        return self.kv[start : start + PAGE]


def built(driver: Driver) -> tuple[cuda_copier.CudaCopyEngine, np.ndarray]:
    pool = aligned_empty(GPUS * BLOCKS * SLOT)
    pool[:] = 0xAB
    engine = cuda_copier.CudaCopyEngine(
        pool.ctypes.data, pool.nbytes, list(range(GPUS)), policy=CopyPolicy("kernel")
    )
    return engine, pool


def slots(pool: np.ndarray, first: int, n: int) -> np.ndarray:
    return pool.ctypes.data + SLOT * np.arange(first, first + n, dtype=np.int64)


def each_rank_copies_on_its_own_device() -> None:
    """TP 3 on GPUs 0..2: a rank's regions are routed by its device UUID to
    that GPU's state (its own streams, the pool's alias there); each saves
    its blocks into its own slots (the pool checked byte for byte against a
    numpy reference), then loads the next rank's slots into other blocks:
    the pool is one, read through every device's alias."""
    driver = Driver()
    driver.install()
    engine, pool = built(driver)
    ranks = [Rank(driver, d, seed=10 + d, handle=bytes([d]) * 64) for d in range(GPUS)]
    regions = [r.open(engine) for r in ranks]
    assert [reg.device.ordinal for reg in regions] == list(range(GPUS))
    assert [reg.device.uuid for reg in regions] == [uuid(d) for d in range(GPUS)]
    devices = {id(reg.device) for reg in regions}
    streams = {id(s) for reg in regions for s in (reg.device.save, reg.device.load)}
    assert len(devices) == GPUS and len(streams) == 2 * GPUS
    opened_on = [dev for call, dev, _ in driver.calls if call == "open"]
    assert opened_on == list(range(GPUS)), opened_on  # each on its own device
    want = np.full_like(pool, 0xAB)
    ids = np.array([3, 0, 2], np.int64)  # out of order, 3 of 4 blocks
    for d, (rank, reg) in enumerate(zip(ranks, regions, strict=True)):
        first = d * BLOCKS
        t = rank.geometry.engine_to_slots(ids, slots(pool, first, 3), np.arange(LAYERS))
        engine.gather(reg, t)
        for i, block in enumerate(ids):
            for layer in range(LAYERS):
                at = (first + i) * SLOT + layer * PAGE
                want[at : at + PAGE] = rank.page(block, layer)
    bad = np.flatnonzero(pool != want)
    assert not bad.size, f"{bad.size} pool bytes differ, first at {bad[0]}"
    for d, (rank, reg) in enumerate(zip(ranks, regions, strict=True)):
        first = ((d + 1) % GPUS) * BLOCKS  # the next rank's slots
        before = rank.page(1, 0).copy()  # block 1 is not loaded into
        dst = np.array([0, 2, 3], np.int64)
        engine.scatter(reg, rank.geometry.slots_to_engine(slots(pool, first, 3), dst))
        for i, block in enumerate(dst):
            for layer in range(LAYERS):
                at = (first + i) * SLOT + layer * PAGE
                assert np.array_equal(rank.page(block, layer), want[at : at + PAGE])
        assert np.array_equal(rank.page(1, 0), before)
    for reg in regions:
        engine.close(reg)
    wait_for(lambda: engine.mapped_allocations == 0)
    closed_on = sorted(dev for call, dev, _ in driver.calls if call == "close")
    assert closed_on == list(range(GPUS)), closed_on  # each unmapped on its own


def a_gpu_not_served_is_refused_naming_the_flag() -> None:
    """A rank on GPU 7 of a server serving 0..2: InvalidRequest naming the
    field and --devices, and nothing opened for it."""
    driver = Driver()
    driver.install()
    engine, _ = built(driver)
    rank = Rank(driver, 7, seed=1, handle=b"\x07" * 64)
    try:
        rank.open(engine)
    except InvalidRequest as exc:
        text = str(exc)
        assert "regions.cuda.device_uuid" in text and "--devices" in text, text
        assert uuid(7).hex() in text, text
    else:
        raise AssertionError("a rank on an unserved GPU was accepted")
    assert engine.mapped_allocations == 0
    assert not [c for c in driver.calls if c[0] == "open"]


def one_handle_per_device_and_allocation() -> None:
    """The same handle bytes named on two GPUs are two mappings (a handle
    is only unique within its device); a second registration of the same
    allocation on one GPU shares the first's mapping, which is closed once,
    on its own device, when the last of them closes."""
    driver = Driver()
    driver.install()
    engine, _ = built(driver)
    handle = b"\x55" * 64
    a = Rank(driver, 0, seed=2, handle=handle)
    b = Rank(driver, 1, seed=2, handle=handle)
    b.export = CudaExport((handle,), uuid(1), ())
    again = CudaExport((handle,), uuid(0), ())
    ra, rb = a.open(engine), b.open(engine)
    rc = engine.open(os.getpid(), [(0, a.kv.nbytes)], again)
    assert engine.mapped_allocations == 2
    assert ra.device is rc.device and ra.device is not rb.device
    engine.close(ra)
    engine.close(rb)
    wait_for(lambda: engine.mapped_allocations == 1)
    assert [dev for call, dev, _ in driver.calls if call == "close"] == [1]
    engine.close(rc)
    wait_for(lambda: engine.mapped_allocations == 0)
    closes = [dev for call, dev, _ in driver.calls if call == "close"]
    assert closes == [1, 0], closes
    destroyed = [dev for call, dev, _ in driver.calls if call == "destroy"]
    assert destroyed == [0], destroyed  # a's event, on a's device


def a_broken_gpu_leaves_the_others_copying() -> None:
    """A sticky fault on GPU 1 refuses its copies (and /health, /metrics
    name it); GPUs 0 and 2 keep moving bytes."""
    driver = Driver()
    driver.install()
    engine, pool = built(driver)
    ranks = [
        Rank(driver, d, seed=20 + d, handle=bytes([0x20 + d]) * 64) for d in (0, 1, 2)
    ]
    regions = [r.open(engine) for r in ranks]
    fault = cuda_driver.CudaError("cuStreamSynchronize: cudaErrorIllegalAddress")
    engine._faults.note(1, fault)
    assert engine.faulted() == {0: False, 1: True, 2: False}
    assert list(engine.faults) == [1]
    ids = np.array([1], np.int64)
    for d, (rank, reg) in enumerate(zip(ranks, regions, strict=True)):
        t = rank.geometry.engine_to_slots(ids, slots(pool, d, 1), np.arange(LAYERS))
        if d == 1:
            try:
                engine.gather(reg, t)
            except DeviceBroken as exc:
                assert "device 1" in str(exc), exc
            else:
                raise AssertionError("a copy on the broken GPU ran")
            assert (pool[SLOT : 2 * SLOT] == 0xAB).all()
            continue
        engine.gather(reg, t)
        got = pool[d * SLOT : (d + 1) * SLOT]
        want = np.concatenate([rank.page(1, layer) for layer in range(LAYERS)])
        assert np.array_equal(got, want), d


def wait_for(done: Callable[[], bool], timeout_s: float = 60.0) -> None:
    """The reaper thread unmaps: poll it, with a deadline."""
    deadline = time.monotonic() + timeout_s
    while not done():
        assert time.monotonic() < deadline, "not done in time"
        time.sleep(0.01)


JOBS: dict[str, Callable[[], None]] = {
    f.__name__: f
    for f in (
        each_rank_copies_on_its_own_device,
        a_gpu_not_served_is_refused_naming_the_flag,
        one_handle_per_device_and_allocation,
        a_broken_gpu_leaves_the_others_copying,
    )
}


def main() -> dict[str, str]:
    from pegaflow import kernels

    assert kernels.backend("cuda").SIMULATED, "simulator not active"
    results = {}
    for name, job in JOBS.items():
        try:
            job()
            results[name] = ""
        except Exception:  # reported per case by the pytest side
            results[name] = traceback.format_exc()
    return results


if __name__ == "__main__":
    print(json.dumps(main()))
