"""L1 host pool: one mmap'd region, pre-touched in parallel, carved into slabs that
hold fixed-size slots of one size class each (one class per block size in use).

The pool only owns memory and slot accounting; which blocks live in the slots, and
which to evict, belongs to pegaflow.cache.block_store and pegaflow.cache.eviction.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import functools
import logging
import mmap
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import numpy as np
from tqdm import tqdm

from pegaflow.common.mounts import filesystem_of
from pegaflow.common.settings import PoolConfig

from .hugepages import huge_share, thp_setting
from .pin_chunks import ChunkPins, ChunkRegistrar
from .slabs import SlabAllocator

if TYPE_CHECKING:
    from .pool_file import PoolFile
    from .slot_log import SlotLog

logger = logging.getLogger(__name__)

HUGEPAGE_BYTES = 2 << 20
PREFAULT_CHUNK = 256 << 20
# A kept file's pages are mapped while the server runs, in smaller steps: the
# kernel holds the process's mmap lock through each, and every mmap (a large
# numpy array) waits for it (a 256 MiB step slowed a restart's start-up 7x).
KEPT_CHUNK = 8 << 20
MADV_POPULATE_WRITE = 23  # Linux 5.14+; faults pages in without touching them


class PoolRegistrar(Protocol):
    """Seam for the GPU data path: pins the region for DMA (cudaHostRegister)."""

    def register(self, address: int, size: int) -> None: ...
    def unregister(self, address: int) -> None: ...


class HugepagesUnavailable(RuntimeError):
    pass


class PoolTooLarge(RuntimeError):
    """--pool-size exceeds the memory this machine has available."""

    def __init__(self, size: int, available: int | None) -> None:
        have = (
            f"{_gib(available)} GiB are available (MemAvailable)"
            if available is not None
            else "the kernel refused the mapping (ENOMEM)"
        )
        hint = ""
        if available is not None and available >= 2 << 20:
            # leave a fifth for the engines, the SSD tier and the page cache
            mib = int(available * 0.8) >> 20
            size_text = f"{mib >> 10}gb" if mib >= 1024 else f"{mib}mb"
            hint = f"; pass a smaller one, e.g. --pool-size {size_text}"
        super().__init__(
            f"--pool-size: {_gib(size)} GiB does not fit in memory: {have}{hint}"
        )


def _gib(n: int) -> str:
    return f"{n / (1 << 30):.2f}"


@dataclass(frozen=True, slots=True)
class BringUp:
    seconds: float
    bytes: int

    @property
    def gb_per_s(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds else float("inf")


def _map_region(size: int, hugepages: bool) -> mmap.mmap:
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
    if not hugepages:
        # Pre-touching more than MemAvailable would swap or wake the OOM killer
        # (and mmap's ENOMEM, when it comes, says nothing about the flag).
        available = _meminfo("MemAvailable")
        if available is not None and size > available:
            raise PoolTooLarge(size, available)
        try:
            region = mmap.mmap(-1, size, flags=flags)
        except OSError as exc:
            if exc.errno != errno.ENOMEM:
                raise
            raise PoolTooLarge(size, available) from exc
        # Transparent hugepages where the kernel allows them (madvise mode): with
        # 4 KiB pages, process_vm_writev from the pool runs ~4x slower (measured).
        if hasattr(mmap, "MADV_HUGEPAGE"):
            with contextlib.suppress(OSError):
                region.madvise(mmap.MADV_HUGEPAGE)
        return region
    free_pages = _hugepages_free()
    need = size // HUGEPAGE_BYTES
    if free_pages < need:
        raise HugepagesUnavailable(
            f"--use-hugepages: need {need} free 2 MiB hugepages for the pool, "
            f"{free_pages} are free; reserve them with "
            f"'echo {need} > /proc/sys/vm/nr_hugepages' or drop --use-hugepages"
        )
    try:
        return mmap.mmap(-1, size, flags=flags | mmap.MAP_HUGETLB)
    except OSError as exc:
        raise HugepagesUnavailable(f"--use-hugepages: mmap failed: {exc}") from exc


def _hugepages_free() -> int:
    return _meminfo("HugePages_Free", scale=1) or 0


def _meminfo(key: str, scale: int = 1024) -> int | None:
    """A /proc/meminfo field (kB fields in bytes); None where it is missing."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * scale
    except OSError:
        pass
    return None


class HostPool:
    """The mmap'd region plus its slab allocator."""

    def __init__(
        self, config: PoolConfig, registrar: PoolRegistrar | None = None
    ) -> None:
        align = HUGEPAGE_BYTES if config.use_hugepages else mmap.PAGESIZE
        slab = min(config.slab_bytes, max(1 << 16, config.size_bytes // 16))
        self.slab_bytes = slab // align * align or align
        self.size = config.size_bytes // self.slab_bytes * self.slab_bytes
        self.file: PoolFile | None = None
        self.log: SlotLog | None = None
        if config.pool_file is None:
            self._mmap = _map_region(self.size, config.use_hugepages)
            self.array = np.frombuffer(self._mmap, dtype=np.uint8)
        else:
            self.file = _open_file(config, self.size, self.slab_bytes, align)
            self._mmap = self.file.mmap
            self.array = self.file.data
        self.base = int(self.array.ctypes.data)
        self._registrar = None
        self._pins: ChunkPins | None = None  # pin(): chunk by chunk
        self._touching: threading.Thread | None = None
        self._stop_touching = threading.Event()
        self.huge_share: float | None = None
        try:
            if self.file is None or self.file.fresh:
                self.bring_up = self._prefault(config)
            else:  # a kept file's pages are resident: mapping them (~0.3 s a
                # GiB on the dev VM) runs beside the restart's check instead of
                # before the server serves; its bytes are never zeroed
                self.bring_up = BringUp(0.0, 0)
                self._touching = threading.Thread(
                    target=self._touch_kept, args=(config,), name="pegaflow-touch"
                )
                self._touching.start()
            if registrar is not None:  # in chunks, in parallel (HostRegistrar)
                self._register(registrar, config)
        except BaseException:
            self.close()
            raise
        self._registrar = registrar
        self._config = config
        self.slabs = self._slabs()
        if self._touching is None:
            self.huge_share = huge_share(self.base, self.size)
            _warn_small_pages(self.huge_share, self.size, config)
        logger.info(
            "pool ready: %.2f GiB at %.2f GB/s (%d slabs of %d MiB, hugepages=%s%s)",
            self.size / (1 << 30),
            self.bring_up.gb_per_s,
            self.size // self.slab_bytes,
            self.slab_bytes >> 20,
            config.use_hugepages,
            f", file {config.pool_file}" if config.pool_file else "",
        )

    def pin(self, registrar: ChunkRegistrar, hold: bool = False) -> ChunkPins:
        """Start pinning the pool for the GPUs chunk by chunk, beside a serving
        server (pegaflow.server.cuda_bringup); the ChunkPins returned says which
        chunks are pinned. close() stops it and unpins those."""
        if not hasattr(self, "array"):  # a bring-up that outlived the stop
            raise RuntimeError("pool: closed before it was pinned")
        explain = functools.partial(_unpinnable, self._config)
        self._pins = ChunkPins(self.base, self.size, registrar, explain, hold)
        self._pins.start()
        return self._pins

    def _register(self, registrar: PoolRegistrar, config: PoolConfig) -> None:
        """Pin the whole pool for the GPUs before the start."""
        try:
            registrar.register(self.base, self.size)
        except Exception as exc:
            if (error := _unpinnable(config, exc)) is exc:
                raise
            raise error from None

    def _slabs(self) -> SlabAllocator:
        if self.file is None:
            return SlabAllocator(self.base, self.size, self.slab_bytes)
        from .slot_log import LoggedSlabs, SlotLog  # file-backed pools only

        self.log = SlotLog(self.file, self.base)
        return LoggedSlabs(self.base, self.size, self.slab_bytes, self.log)

    def _touch_kept(self, config: PoolConfig) -> None:
        """A kept file's pages mapped in, chunk by chunk, until close();
        then the share of them on 2 MiB pages (read only once mapped)."""
        start = time.perf_counter()
        touch = _touch_function(self.base, self.size, zero_ok=False)
        for offset in range(0, self.size, KEPT_CHUNK):
            if self._stop_touching.is_set():
                return
            touch(offset, min(KEPT_CHUNK, self.size - offset))
        self.huge_share = huge_share(self.base, self.size)
        _warn_small_pages(self.huge_share, self.size, config)
        logger.info("pool file: mapped in %.2f s", time.perf_counter() - start)

    def _prefault(self, config: PoolConfig) -> BringUp:
        start = time.perf_counter()
        chunks = range(0, self.size, PREFAULT_CHUNK)
        touch = _touch_function(self.base, self.size)
        bar = tqdm(
            total=self.size,
            unit="B",
            unit_scale=True,
            desc="pre-touching pool",
            disable=not config.show_progress,
        )
        with ThreadPoolExecutor(config.prefault_threads) as pool:
            sizes = [min(PREFAULT_CHUNK, self.size - off) for off in chunks]
            for done in pool.map(touch, chunks, sizes):
                bar.update(done)
        bar.close()
        return BringUp(time.perf_counter() - start, self.size)

    def view(self, address: int, size: int) -> np.ndarray:
        """A numpy view of pool bytes (tests and the demo check bytes with it)."""
        off = address - self.base
        if off < 0 or off + size > self.size:
            raise ValueError(f"address range outside the pool: {address:#x}+{size}")
        return self.array[off : off + size]

    def close(self) -> None:
        if self._touching is not None:  # it maps pages of the region
            self._stop_touching.set()
            self._touching.join()
            self._touching = None
        if self._pins is not None:  # stops it first: never mid-registration
            self._pins.unpin()
            self._pins = None
        if self._registrar is not None:
            self._registrar.unregister(self.base)
            self._registrar = None
        if self.log is not None:  # seals what is queued: it reads the slots
            self.log.close()
            self.log = None
        if not hasattr(self, "array"):
            return  # closed already (a failed start-up, then the stop path)
        del self.array
        if self.file is not None:
            self.file.close()
            return
        try:
            self._mmap.close()
        except BufferError:  # a view is still alive; the OS frees it at exit
            logger.debug("pool mmap still referenced at close")


def _unpinnable(config: PoolConfig, exc: BaseException) -> BaseException:
    """A pool file on a filesystem whose pages CUDA cannot pin (seen on the
    H200 host: a file under /tmp answered cudaErrorInvalidValue, the same file
    in /dev/shm registered) is one line naming the flag and the fix, not a
    traceback; any other failure is itself."""
    if config.pool_file is None:
        return exc
    from .pool_file import PoolFileError

    fs = filesystem_of(config.pool_file)
    return PoolFileError(
        f"--pool-file: CUDA cannot pin the pages of {config.pool_file} "
        f"({exc}; it lies on {fs}); put it on /dev/shm or a hugetlbfs "
        "mount (with --use-hugepages)"
    )


def _open_file(config: PoolConfig, size: int, slab_bytes: int, align: int) -> PoolFile:
    from .pool_file import Geometry, PoolFile

    def room() -> None:  # asked for a new pool only: a kept one is resident
        available = _meminfo("MemAvailable")
        if available is not None and size > available:
            raise PoolTooLarge(size, available)

    geometry = Geometry(size, slab_bytes, align)
    return PoolFile(config.pool_file or "", geometry, config.on_mismatch, room)


# Below this share of 2 MiB pages the start-up log warns (pegaflow.cache.hugepages).
HUGE_SHARE_WARN = 0.5


def _warn_small_pages(share: float | None, size: int, config: PoolConfig) -> None:
    """Say so when the pool got (mostly) 4 KiB pages, with the fix."""
    if share is None or share >= HUGE_SHARE_WARN or size < 64 * HUGEPAGE_BYTES:
        return
    setting = "shmem_enabled" if config.pool_file else "enabled"
    logger.warning(
        "pool: %.0f%% of its %.1f GiB on 2 MiB pages (transparent hugepages, "
        "%s: %s); host-engine copies run up to ~4x slower from 4 KiB pages. "
        "Reserve hugepages and give --use-hugepages, or allow THP there",
        100 * share,
        size / (1 << 30),
        setting,
        thp_setting(setting),
    )


def _touch_function(
    base: int, total: int, zero_ok: bool = True
) -> Callable[[int, int], int]:
    libc = ctypes.CDLL(None, use_errno=True)
    madvise = libc.madvise
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]

    def touch(offset: int, size: int) -> int:
        # ctypes drops the GIL, so chunks fault in on all threads at once.
        if madvise(base + offset, size, MADV_POPULATE_WRITE) != 0:
            if ctypes.get_errno() == errno.ENOMEM:  # memset would be OOM-killed
                raise PoolTooLarge(total, _meminfo("MemAvailable"))
            if zero_ok:  # kernels before 5.14; a kept file faults in on use
                ctypes.memset(base + offset, 0, size)
        return size

    return touch
