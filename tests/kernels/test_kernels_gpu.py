"""The real CUDA kernels on a GPU (H200 test machine), against the reference
and the CPU twin. Excluded by default; run with `pytest -m gpu tests/kernels`.

Engine memory is a torch CUDA tensor (what an IPC-opened vLLM buffer is); pool
memory is pinned host memory reached zero-copy through its mapped alias, both
torch's cudaHostAlloc kind and the pool's own mmap + cudaHostRegister kind.
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Iterator
from types import ModuleType
from typing import Any

import numpy as np
import pytest

from pegaflow import kernels
from pegaflow.common.geometry import KVGeometry, Transfers
from tests.kernels.kernel_cases import (
    Alloc,
    Case,
    all_cases,
    check,
    host_alloc,
    lbnhc,
    run_case,
)

pytestmark = pytest.mark.gpu
CASES = all_cases()


@pytest.fixture(scope="module")
def torch() -> ModuleType:
    if os.environ.get("NUMBA_ENABLE_CUDASIM") == "1":
        pytest.skip("the CUDA simulator is on")
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    return torch


@pytest.fixture(scope="module")
def k(torch: ModuleType) -> ModuleType:
    return kernels.backend("cuda")


def engine_alloc(k: ModuleType, torch: ModuleType) -> Alloc:
    def alloc(init: np.ndarray) -> tuple[Any, Any]:
        t = torch.from_numpy(init.copy()).cuda()
        return k.wrap_array(t), lambda: t.cpu().numpy()

    return alloc


def pinned_alloc(k: ModuleType, torch: ModuleType) -> Alloc:
    def alloc(init: np.ndarray) -> tuple[Any, Any]:
        t = torch.from_numpy(init.copy()).pin_memory()
        return k.wrap(t.data_ptr(), t.numel(), mapped=True, owner=t), t.numpy().copy

    return alloc


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_gpu_matches_reference(case: Case, k: ModuleType, torch: ModuleType) -> None:
    check(case, run_case(k, case, engine_alloc(k, torch), pinned_alloc(k, torch)))


@pytest.fixture
def registered(k: ModuleType) -> Iterator[np.ndarray]:
    """32 MiB of mmap'd memory registered mapped, as the pool registers it."""
    from cuda.bindings import runtime

    size = 32 << 20
    mem = mmap.mmap(-1, size)
    arr = np.frombuffer(mem, np.uint8)
    flags = runtime.cudaHostRegisterMapped | runtime.cudaHostRegisterPortable
    (err,) = runtime.cudaHostRegister(arr.ctypes.data, size, flags)
    assert err == runtime.cudaError_t.cudaSuccess, err
    yield arr
    runtime.cudaHostUnregister(arr.ctypes.data)  # the mmap goes with the last ref


@pytest.mark.parametrize("width", [16, 8, 1])
def test_llama_like_round_trip(
    k: ModuleType, torch: ModuleType, registered: np.ndarray, width: int
) -> None:
    """8 layers x 32 blocks of 64 KiB pages: gather into registered pool slots,
    scatter back into a poisoned engine buffer, compare with the CPU twin."""
    layers, blocks, page = 8, 32, 64 << 10
    engine = torch.randint(-128, 128, (layers * blocks * page,), dtype=torch.int8)
    engine = engine.cuda()
    back = torch.full_like(engine, -85)  # 0xAB
    geo = KVGeometry(lbnhc(layers, blocks, page), [engine.data_ptr()])
    rng = np.random.default_rng(width)
    ids = rng.choice(blocks, 12, replace=False)
    slots = rng.choice(len(registered) // geo.slot_bytes, 12, replace=False)
    pool = k.wrap(registered.ctypes.data, len(registered), mapped=True)
    registered[:] = 0xAB
    save = geo.engine_to_slots(ids, pool.address + slots * geo.slot_bytes, np.arange(8))
    stream = k.stream()
    kw: dict[str, Any] = {"stream": stream, "width": width}
    k.gather(k.wrap_array(engine), pool, save, **kw)
    k.synchronize(stream)
    host_engine = engine.cpu().numpy().view(np.uint8)
    want = _cpu_gather(host_engine, engine.data_ptr(), save, pool)
    np.testing.assert_array_equal(registered, want)

    geo_back = KVGeometry(lbnhc(layers, blocks, page), [back.data_ptr()])
    load = geo_back.slots_to_engine(pool.address + slots * geo.slot_bytes, ids)
    k.scatter(pool, k.wrap_array(back), load, **kw)
    k.synchronize(stream)
    got = back.cpu().numpy().view(np.uint8)
    page_of = got.reshape(layers, blocks, page)
    src_of = host_engine.reshape(layers, blocks, page)
    np.testing.assert_array_equal(page_of[:, ids], src_of[:, ids])
    others = np.setdiff1d(np.arange(blocks), ids)
    assert (page_of[:, others] == 0xAB).all()


def _cpu_gather(engine: np.ndarray, base: int, t: Transfers, pool: Any) -> np.ndarray:
    """The CPU twin's answer for the same table, rebased onto host copies."""
    cpu = kernels.backend("cpu")
    src_host = host_alloc(cpu)(engine)[0]
    dst_host, read = host_alloc(cpu)(np.full(pool.nbytes, 0xAB, np.uint8))
    rebased = Transfers(
        t.src - np.uint64(base) + np.uint64(src_host.address),
        t.dst - np.uint64(pool.address) + np.uint64(dst_host.address),
        t.nbytes,
    )
    cpu.gather(src_host, dst_host, rebased, stream=None)
    return read()
