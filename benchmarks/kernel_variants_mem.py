"""Memory for benchmarks/kernel_variants.py: engine KV, a poisonable copy of
it to load into, and a pool of slots, with byte checks against the source.

`GpuMem`: the H200 shape. Engine KV is one int8 torch CUDA buffer in vLLM 0.33
layout (per layer, a 64 KiB page per block), the pool is mmap'd memory
registered mapped (as pegaflow's pool), checks run on the GPU. `SimMem`: the
same over numpy arrays for numba's CUDA simulator, tiny shapes, checks in numpy.
Both expose the same attributes, so every variant and check is written once.
"""

from __future__ import annotations

import mmap
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Literal

import numpy as np

from pegaflow.common.cuda_driver import check
from pegaflow.common.geometry import KVGeometry, LayerLayout, Segment, Transfers
from pegaflow.kernels.plan import aligned_empty

POISON = 0xAB


@dataclass(frozen=True)
class Shape:
    layers: int
    page: int
    blocks: int  # engine blocks
    slots: int  # pool slots

    def layout(self) -> tuple[LayerLayout, ...]:
        span = self.blocks * self.page
        seg = (Segment(0, self.page),)
        return tuple(
            LayerLayout(0, i * span, self.blocks, self.page, seg)
            for i in range(self.layers)
        )


LLAMA = Shape(32, 64 << 10, 4096, 3072)  # 8 GiB engine, 6 GiB pool
TINY = Shape(2, 256, 12, 10)


class Mem:
    """What both kinds share: buffers, geometry, transfers and the checks.
    Subclasses supply the arrays (`engine_v`, `back_v`, `pool_v()`), `index`
    and the poison / copy primitives."""

    k: ModuleType
    shape: Shape
    eng: Any
    eng_back: Any
    pool: Any

    def _geometry(self, engine_ptr: int, back_ptr: int) -> None:
        self.geo = KVGeometry(self.shape.layout(), [engine_ptr])
        self.geo_back = KVGeometry(self.shape.layout(), [back_ptr])
        self.slot_bytes = self.geo.slot_bytes

    def save_t(self, ids: np.ndarray, slots: np.ndarray) -> Transfers:
        addrs = self.pool.address + slots * self.slot_bytes
        return self.geo.engine_to_slots(ids, addrs, np.arange(self.shape.layers))

    def load_t(self, ids: np.ndarray, slots: np.ndarray) -> Transfers:
        addrs = self.pool.address + slots * self.slot_bytes
        return self.geo_back.slots_to_engine(addrs, ids)

    def _rest(self, n: int, *used: np.ndarray) -> Any:
        mask = np.ones(n, bool)
        for u in used:
            mask[u] = False
        return self.index(mask)

    def check_gather(self, ids: np.ndarray, slots: np.ndarray) -> bool:
        """Saved slots hold the engine's pages, every other slot is poison."""
        pool = self.pool_v()
        want = self.engine_v[:, self.index(ids)].swapaxes(0, 1)
        if not bool((pool[self.index(slots)] == want).all()):
            return False
        return bool((pool[self._rest(self.shape.slots, slots)] == POISON).all())

    def check_scatter(self, ids: np.ndarray, slots: np.ndarray) -> bool:
        """Loaded blocks hold the pool's slots, every other block is poison."""
        pool = self.pool_v()
        got = self.back_v
        want = pool[self.index(slots)].swapaxes(0, 1)
        if not bool((got[:, self.index(ids)] == want).all()):
            return False
        return bool((got[:, self._rest(self.shape.blocks, ids)] == POISON).all())

    def check_both(
        self, save: tuple[np.ndarray, np.ndarray], load: tuple[np.ndarray, np.ndarray]
    ) -> bool:
        """A save (ids, slots) and a load (ids, slots) ran at once: each
        destination holds its source, untouched bytes are poison (the load's
        slots were filled before, so they are not poison)."""
        pool = self.pool_v()
        (ia, sa), (ib, sb) = save, load
        want_a = self.engine_v[:, self.index(ia)].swapaxes(0, 1)
        ok = bool((pool[self.index(sa)] == want_a).all())
        ok = ok and bool((pool[self._rest(self.shape.slots, sa, sb)] == POISON).all())
        want_b = pool[self.index(sb)].swapaxes(0, 1)
        ok = ok and bool((self.back_v[:, self.index(ib)] == want_b).all())
        rest = self._rest(self.shape.blocks, ib)
        return ok and bool((self.back_v[:, rest] == POISON).all())

    def check_flat(self, op: str, nbytes: int, pool_at: int = 0) -> bool:
        """The ceiling's copy: `nbytes` of the pool from `pool_at` agree with
        the first `nbytes` of the engine (gather) or of the load target."""
        pool = self.pool_v().reshape(-1)[pool_at : pool_at + nbytes]
        side = self.engine_v if op == "gather" else self.back_v
        return bool((side.reshape(-1)[:nbytes] == pool).all())

    # -- subclass primitives -----------------------------------------------------
    engine_v: Any  # [layers, blocks, page] uint8 / int8 view of the engine
    back_v: Any

    def index(self, a: np.ndarray) -> Any:
        raise NotImplementedError

    def pool_v(self) -> Any:
        """[slots, layers, page], after the copies in flight finished."""
        raise NotImplementedError

    def poison_pool(self) -> None:
        raise NotImplementedError

    def poison_back(self) -> None:
        raise NotImplementedError

    def randomize_pool(self) -> None:
        raise NotImplementedError

    def ceiling(self, op: str, nbytes: int, stream: Any, pool_at: int = 0) -> None:
        """One contiguous copy of `nbytes`: engine -> pool or pool -> back,
        at byte `pool_at` of the pool."""
        raise NotImplementedError


class SimMem(Mem):
    def __init__(self, k: ModuleType, shape: Shape = TINY) -> None:
        self.k, self.shape = k, shape
        rng = np.random.default_rng(0)
        n = shape.layers * shape.blocks * shape.page
        self._engine = aligned_empty(n)
        self._engine[:] = rng.integers(0, 256, n, dtype=np.uint8)
        self._back = aligned_empty(n)
        self._pool = aligned_empty(shape.slots * shape.layers * shape.page)
        self.eng = k.wrap_array(self._engine)
        self.eng_back = k.wrap_array(self._back)
        self.pool = k.wrap_array(self._pool)
        dims = (shape.layers, shape.blocks, shape.page)
        self.engine_v = self._engine.reshape(dims)
        self.back_v = self._back.reshape(dims)
        self._geometry(self.eng.address, self.eng_back.address)

    def index(self, a: np.ndarray) -> Any:
        return a

    def pool_v(self) -> Any:
        s = self.shape
        return self._pool.reshape(s.slots, s.layers, s.page)

    def poison_pool(self) -> None:
        self._pool[:] = POISON

    def poison_back(self) -> None:
        self._back[:] = POISON

    def randomize_pool(self) -> None:
        rng = np.random.default_rng(1)
        self._pool[:] = rng.integers(0, 256, len(self._pool), dtype=np.uint8)

    def ceiling(self, op: str, nbytes: int, stream: Any, pool_at: int = 0) -> None:
        at = slice(pool_at, pool_at + nbytes)
        if op == "gather":
            self._pool[at] = self._engine[:nbytes]
        else:
            self._back[:nbytes] = self._pool[at]


PoolKind = Literal["plain", "thp", "hugetlb"]
MAP_HUGETLB = getattr(mmap, "MAP_HUGETLB", 0x40000)  # Python < 3.13 lacks it


def pool_memory(size: int, kind: PoolKind) -> mmap.mmap:
    """The pool's pages, private anonymous memory as pegaflow's pool maps it:
    4 KiB ("plain"), transparent 2 MiB pages where the kernel gives them
    ("thp", what pegaflow's pool asks for), or hugetlbfs pages ("hugetlb",
    --use-hugepages; needs vm.nr_hugepages). Python's default mmap is shared
    memory, whose THP obeys shmem_enabled instead (2026-12-03, call 2: every
    run of that call had 4 KiB pages for this reason)."""
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
    if kind == "hugetlb":
        return mmap.mmap(-1, size, flags=flags | MAP_HUGETLB)
    region = mmap.mmap(-1, size, flags=flags)
    region.madvise(mmap.MADV_HUGEPAGE if kind == "thp" else mmap.MADV_NOHUGEPAGE)
    return region


class GpuMem(Mem):
    def __init__(
        self, k: ModuleType, shape: Shape = LLAMA, pool: PoolKind = "plain"
    ) -> None:
        import torch
        from cuda.bindings import driver, runtime

        self.k, self.shape, self.torch, self.driver = k, shape, torch, driver
        n = shape.layers * shape.blocks * shape.page
        self.engine = torch.randint(-128, 128, (n,), dtype=torch.int8, device="cuda")
        self.back = torch.empty_like(self.engine)
        size = shape.slots * shape.layers * shape.page
        self._mmap = pool_memory(size, pool)
        host = np.frombuffer(self._mmap, np.uint8)
        host[::4096] = 0  # fault every page in before registering
        flags = runtime.cudaHostRegisterMapped | runtime.cudaHostRegisterPortable
        check(runtime.cudaHostRegister(host.ctypes.data, size, flags), "register")
        self._host = host
        self.pool_t = torch.from_numpy(host).view(torch.int8)
        self.pool = k.wrap(host.ctypes.data, size, mapped=True, owner=host)
        self.eng = k.wrap_array(self.engine)
        self.eng_back = k.wrap_array(self.back)
        dims = (shape.layers, shape.blocks, shape.page)
        self.engine_v = self.engine.view(dims).view(torch.uint8)
        self.back_v = self.back.view(dims).view(torch.uint8)
        self._geometry(self.engine.data_ptr(), self.back.data_ptr())

    def index(self, a: np.ndarray) -> Any:
        return self.torch.as_tensor(a, device="cuda")

    def pool_v(self) -> Any:
        self.torch.cuda.synchronize()
        s = self.shape
        dev = self.pool_t.cuda().view(self.torch.uint8)
        return dev.view(s.slots, s.layers, s.page)

    def _memset(self, address: int, nbytes: int) -> None:
        d = self.driver
        self.torch.cuda.synchronize()
        stream = d.CUstream(0)
        check(
            d.cuMemsetD8Async(d.CUdeviceptr(address), POISON, nbytes, stream), "memset"
        )
        self.torch.cuda.synchronize()

    def poison_pool(self) -> None:
        self._memset(self.pool.device_address, self.pool.nbytes)

    def poison_back(self) -> None:
        self._memset(self.back.data_ptr(), self.back.numel())

    def randomize_pool(self) -> None:
        torch = self.torch
        n = self.pool.nbytes
        rand = torch.randint(-128, 128, (n,), dtype=torch.int8, device="cuda")
        self.pool_t.copy_(rand)
        torch.cuda.synchronize()

    def ceiling(self, op: str, nbytes: int, stream: Any, pool_at: int = 0) -> None:
        d = self.driver
        if op == "gather":
            to, frm = self.pool.address + pool_at, self.engine.data_ptr()
        else:
            to, frm = self.back.data_ptr(), self.pool.address + pool_at
        ptr = d.CUdeviceptr
        check(d.cuMemcpyAsync(ptr(to), ptr(frm), nbytes, stream.handle), "memcpy")
