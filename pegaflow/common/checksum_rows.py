"""xxh3-64 of many slot rows in one compiled call that runs without the GIL.

The SSD writers checksum every record they write, the SSD readers every
record they read, the pool-file sealer every slot it seals. One
python-xxhash call per record drops the GIL while it hashes and takes it
back after: a turn at the GIL per record (64 a run of 256 KiB blocks), each
one a chance to hold up the save path's threads while the hashing thread's
Python runs again. Here one numba-compiled loop (nogil) calls the xxh3
functions of the very library python-xxhash is built on (its extension
exports XXH3_64bits_reset, _update and _digest) for every row, so a whole
run hashes in one stretch without the GIL, bytes as
`pegaflow.common.checksums.xxh3_64_parts` gives.

The loop is compared with python-xxhash once, when compiled. Where that
library lacks the symbols (another build of python-xxhash), numba is absent
or the comparison fails (warned), rows() makes one xxh3_64_parts call per row.

Only warm() compiles, never a caller of rows(): importing numba and compiling
holds the GIL for about a second (ctypes' dlopen of llvmlite's 168 MB library
holds it whole), which must not land in a writer's run. A server compiles on
a thread of its own once it serves (warm_in_background): compiling first put
~1 s of a restarted server's ~1.6 s before READY (dev VM, 2026-12-06); until
the loop is ready, rows() hashes one python-xxhash call per row, the same
values.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import threading
import time
from collections.abc import Callable

import numpy as np

from .checksums import xxh3_64_parts

logger = logging.getLogger(__name__)

_FALLBACK = "xxh3 per row through python-xxhash"
_SYMBOLS = (
    "XXH3_createState",
    "XXH3_freeState",
    "XXH3_64bits_reset",
    "XXH3_64bits_update",
    "XXH3_64bits_digest",
)


class _State:
    """One thread's XXH3_state_t (reset per row), freed with the thread."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._free = lib.XXH3_freeState
        self.address = int(lib.XXH3_createState() or 0)
        if not self.address:
            raise MemoryError("XXH3_createState")

    def __del__(self) -> None:
        if self.address:
            self._free(self.address)


@functools.cache
def _native() -> tuple[ctypes.CDLL, Callable[..., None]] | None:
    """(the library, the compiled loop), or None where either is missing."""
    try:
        import xxhash._xxhash as ext

        lib = ctypes.CDLL(ext.__file__)
        if not all(hasattr(lib, name) for name in _SYMBOLS):
            raise OSError("python-xxhash's extension exports no XXH3 state API")
    except (ImportError, OSError) as exc:
        logger.info("%s (%s)", _FALLBACK, exc)
        return None
    # Pointers as 64-bit integers: the same registers on x86-64 and aarch64,
    # and numba passes uint64 array items to them without a cast.
    u64 = ctypes.c_uint64
    lib.XXH3_createState.restype, lib.XXH3_createState.argtypes = u64, []
    lib.XXH3_freeState.restype, lib.XXH3_freeState.argtypes = ctypes.c_int, [u64]
    # python-xxhash >= 4 builds xxHash's x86 dispatch (AVX2 where the CPU has
    # it) and hashes through it; the plain symbol is the SSE2 build there.
    update = getattr(lib, "XXH3_64bits_update_dispatch", lib.XXH3_64bits_update)
    reset, digest = lib.XXH3_64bits_reset, lib.XXH3_64bits_digest
    reset.restype, reset.argtypes = ctypes.c_int, [u64]
    update.restype, update.argtypes = ctypes.c_int, [u64, u64, ctypes.c_size_t]
    digest.restype, digest.argtypes = u64, [u64]

    def rows_into(
        state: int, addrs: np.ndarray, lengths: np.ndarray, out: np.ndarray
    ) -> None:
        for i in range(addrs.shape[0]):
            reset(state)
            for j in range(addrs.shape[1]):
                update(state, addrs[i, j], lengths[i, j])
            out[i] = digest(state)

    from .jit import checked_nogil

    compiled = checked_nogil(
        rows_into, lambda loop: _self_check(lib, loop), _FALLBACK, logger
    )
    return None if compiled is None else (lib, compiled)


def _self_check(lib: ctypes.CDLL, rows_into: Callable[..., None]) -> None:
    """Compile the loop and compare it with python-xxhash on rows of two
    parts of unequal lengths, short of xxh3's 240-byte mark and past its
    1 KiB stripes: a
    library whose functions do not do what this module calls them for gives
    other values, and is not used."""
    data = np.random.default_rng(0).integers(0, 256, 8192, np.uint8)
    for first, second in ((100, 60), (3000, 1700)):
        addrs = data.ctypes.data + np.array([[0, first]], np.uint64)
        lengths = np.array([[first, second]], np.uint64)
        got = np.zeros(1, np.uint64)
        rows_into(_state(lib), addrs, lengths, got)
        want = xxh3_64_parts([data[: first + second]])
        if int(got[0]) != want:
            raise ValueError(f"compiled xxh3 gave {int(got[0]):#x}, want {want:#x}")


_local = threading.local()


def _state(lib: ctypes.CDLL) -> int:
    state = getattr(_local, "state", None)
    if state is None:
        state = _local.state = _State(lib)
    return state.address


def rows(addrs: np.ndarray, lengths: int | np.ndarray) -> np.ndarray:
    """xxh3-64 of each row of `addrs` ([rows, parts] uint64 addresses of this
    process, read back to back): uint64 [rows]. `lengths` is every part's
    byte count, or one per part ([rows, parts]). The caller vouches that
    every part lies in memory it owns: nothing here can check an address."""
    return _rows(addrs, lengths)


def _rows(addrs: np.ndarray, lengths: int | np.ndarray) -> np.ndarray:
    # Writable C arrays always: numba compiles one loop per argument type, a
    # read-only array (np.broadcast_to's view of a full-shape `lengths`) is
    # another type, and a loop compiled at a caller's first run instead of at
    # warm() held the GIL for 13-24 s on a busy host (the event loop with it).
    addrs = np.require(addrs, np.uint64, ["C", "W"])
    if addrs.ndim != 2:
        raise ValueError(f"addrs: need [rows, parts], got shape {addrs.shape}")
    sizes = np.asarray(lengths)
    if sizes.ndim not in (0, 2) or (sizes.ndim == 2 and sizes.shape != addrs.shape):
        raise ValueError(
            f"lengths: need one count or one per part {addrs.shape}, "
            f"got shape {sizes.shape}"
        )
    if sizes.size and (sizes.dtype.kind not in "iu" or sizes.min() < 0):
        raise ValueError("lengths: need byte counts (integers, none negative)")
    sizes = np.array(np.broadcast_to(sizes, addrs.shape), np.uint64, order="C")
    out = np.empty(len(addrs), np.uint64)
    native = _native() if _warmed.is_set() else None  # never compiled here
    if native is not None:
        lib, rows_into = native
        rows_into(_state(lib), addrs, sizes, out)
        return out
    flat = [
        memoryview((ctypes.c_ubyte * n).from_address(a))
        for a, n in zip(addrs.ravel().tolist(), sizes.ravel().tolist(), strict=True)
    ]
    k = addrs.shape[1]
    out[:] = [xxh3_64_parts(flat[i : i + k]) for i in range(0, len(flat), k)]
    return out


_warmed = threading.Event()  # warm() compiled (or gave up on) the loop
_warming_lock = threading.Lock()
_warming: threading.Thread | None = None


def warm() -> bool:
    """Compile and check the loop now, on this thread: whether the compiled
    loop is what rows() uses from now on. One row through rows() itself, so
    the loop compiled is the one rows() calls (the check above calls it with
    arrays of its own); through _rows, so a caller's count of rows() calls
    sees only its own."""
    start = time.perf_counter()
    try:
        if _native() is None:
            return False
    finally:
        _warmed.set()
    data = np.zeros(16, np.uint8)
    _rows(np.array([[data.ctypes.data]], np.uint64), 16)
    logger.info("xxh3 row loop compiled in %.2f s", time.perf_counter() - start)
    return True


def warm_in_background() -> threading.Thread:
    """warm() on a thread of its own, started once per process (later calls
    return the same thread); rows() hashes without it until it is done."""
    global _warming
    with _warming_lock:
        if _warming is None:
            _warming = threading.Thread(
                target=warm, name="pegaflow-xxh3-warm", daemon=True
            )
            _warming.start()
        return _warming
