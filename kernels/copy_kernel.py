"""The copy kernel's device code (numba CUDA), compiled once per GPU
architecture into a cubin that pegaflow.kernels.cuda loads through the driver
(pegaflow.kernels.cubin_cache keeps it on disk, so a restarted server loads it
without importing numba-cuda: ~4 s of a GPU engine's first hit after a
restart on the H100 host went to that import, the compile and numba's first
launch; benchmarks/RESULTS.md, "Warm restart"). Under the CUDA simulator the
same source runs as a numba kernel (pegaflow.kernels.cuda_sim).

Pointers: numba kernels cannot cast an integer to a pointer, but a kernel
compiled with an explicit signature takes `CPointer` arguments as plain
integers. The host side passes each buffer's device address (as uint8* and as
uint64*) and descriptors as byte offsets from those bases, after checking every
range against its buffer.

Kernel: each CUDA block takes one descriptor (grid-stride over the table);
small requests are cut into 16-byte-multiple pieces first so they still cover
every SM. When source and destination agree modulo 16 the body moves 16-byte
vectors (`ld/st.v2.u64`, inline PTX: numba has no vector loads), modulo 8
plain 8-byte words, otherwise bytes; head and tail bytes go byte-wise.
Consecutive threads take consecutive words, so a warp's store is one contiguous
stretch: GPU.md measured that this decides the speed over PCIe (a thread
writing two words 16 bytes apart was 10x slower). Four loads are issued before
four stores to keep more reads in flight when they cross PCIe. On the H200
(benchmarks/RESULTS.md, "copy strategies compared (issue 12)") this kernel
ran at 0.89-0.92 of one contiguous memcpy from 64 blocks up, and a
warp-per-piece kernel (since deleted; git keeps it), other thread counts,
8-byte words and capped grids did not beat it there.

numpy >= 2.5 dropped `numpy.row_stack`, which numba-cuda 0.30 still registers
at import: alias it to `vstack` (the same function) before importing numba.cuda.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

if not hasattr(np, "row_stack"):  # numpy >= 2.5 vs numba-cuda 0.30, see above
    np.row_stack = np.vstack

from numba import cuda  # noqa: E402
from numba.cuda import types  # noqa: E402
from numba.cuda.core import config  # noqa: E402

SIMULATED = bool(config.ENABLE_CUDASIM)
# Small grids are deliberate here (one block per descriptor, or an SM cap):
# numba's "grid size < 128" warning would fire on every small save.
config.CUDA_LOW_OCCUPANCY_WARNINGS = 0
PARAMS = 8  # the compiled kernel's parameters, each 8 bytes (pegaflow.kernels.cuda)


def _load16_sim(a: Any, i: int) -> tuple[int, int]:
    return a[i], a[i + 1]


def _store16_sim(a: Any, i: int, v: tuple[int, int]) -> None:
    a[i], a[i + 1] = v


def _vector_intrinsics() -> tuple[Any, Any]:
    """16-byte load/store of words i, i+1 behind a uint64 pointer, inline PTX."""
    from llvmlite import ir
    from numba.cuda import cgutils
    from numba.cuda.extending import intrinsic

    i64 = ir.IntType(64)
    pair = types.UniTuple(types.uint64, 2)

    def pointer(context: Any, builder: Any, aryty: Any, ary: Any, idx: Any) -> Any:
        return builder.gep(ary, [idx])  # the kernel only ever gets CPointers

    @intrinsic
    def load16(typingctx: Any, ary: Any, idx: Any) -> Any:
        def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
            ptr = pointer(context, builder, sig.args[0], args[0], args[1])
            fnty = ir.FunctionType(ir.LiteralStructType([i64, i64]), [ptr.type])
            asm = ir.InlineAsm(fnty, "ld.v2.u64 {$0, $1}, [$2];", "=l,=l,l", True)
            got = builder.call(asm, [ptr])
            out = cgutils.get_null_value(context.get_value_type(pair))
            for k in range(2):
                out = builder.insert_value(out, builder.extract_value(got, k), k)
            return out

        return pair(ary, idx), codegen

    @intrinsic
    def store16(typingctx: Any, ary: Any, idx: Any, val: Any) -> Any:
        def codegen(context: Any, builder: Any, sig: Any, args: Any) -> None:
            ptr = pointer(context, builder, sig.args[0], args[0], args[1])
            lo, hi = (builder.extract_value(args[2], k) for k in range(2))
            fnty = ir.FunctionType(ir.VoidType(), [ptr.type, i64, i64])
            asm = ir.InlineAsm(fnty, "st.v2.u64 [$0], {$1, $2};", "l,l,l", True)
            builder.call(asm, [ptr, lo, hi])

        return types.void(ary, idx, pair), codegen

    return load16, store16


if SIMULATED:  # the simulator runs Python: the same two words, one at a time
    load16, store16 = _load16_sim, _store16_sim
else:
    load16, store16 = _vector_intrinsics()


@cuda.jit(device=True)
def _bytes(src: Any, dst: Any, s: int, t: int, n: int, tid: int, step: int) -> None:
    for i in range(tid, n, step):
        dst[t + i] = src[s + i]


@cuda.jit(device=True)
def _words(src: Any, dst: Any, s: int, t: int, n: int, tid: int, step: int) -> None:
    i = tid
    while i + 3 * step < n:
        a = src[s + i]
        b = src[s + i + step]
        c = src[s + i + 2 * step]
        e = src[s + i + 3 * step]
        dst[t + i] = a
        dst[t + i + step] = b
        dst[t + i + 2 * step] = c
        dst[t + i + 3 * step] = e
        i += 4 * step
    while i < n:
        dst[t + i] = src[s + i]
        i += step


@cuda.jit(device=True)
def _pairs(src: Any, dst: Any, s: int, t: int, n: int, tid: int, step: int) -> None:
    """n 16-byte vectors; s and t are (even) word indexes."""
    i = tid
    while i + 3 * step < n:
        a = load16(src, s + 2 * i)
        b = load16(src, s + 2 * (i + step))
        c = load16(src, s + 2 * (i + 2 * step))
        e = load16(src, s + 2 * (i + 3 * step))
        store16(dst, t + 2 * i, a)
        store16(dst, t + 2 * (i + step), b)
        store16(dst, t + 2 * (i + 2 * step), c)
        store16(dst, t + 2 * (i + 3 * step), e)
        i += 4 * step
    while i < n:
        store16(dst, t + 2 * i, load16(src, s + 2 * i))
        i += step


def _copy_body(
    src8: Any,
    dst8: Any,
    src64: Any,
    dst64: Any,
    table: Any,
    count: int,
    cap: int,
    width: int,
) -> None:
    """table[r * cap + d]: row r (src offset, dst offset, nbytes) of descriptor d."""
    desc = cuda.shared.array(3, types.int64)
    tid = cuda.threadIdx.x
    step = cuda.blockDim.x
    d = cuda.blockIdx.x
    while d < count:  # every thread of a block shares d: no divergence
        if tid < 3:
            desc[tid] = table[tid * cap + d]  # three reads over PCIe, in parallel
        cuda.syncthreads()
        s, t, n = desc[0], desc[1], desc[2]
        cuda.syncthreads()  # all have read desc before it is overwritten
        if width > 1 and (s & 7) == (t & 7):
            head = min((8 - (s & 7)) & 7, n)
            _bytes(src8, dst8, s, t, head, tid, step)
            s, t, n = s + head, t + head, n - head
            if width == 16 and (s & 15) == (t & 15) and n >= 16:
                if s & 15:  # one word up to the 16-byte boundary
                    if tid == 0:
                        dst64[t >> 3] = src64[s >> 3]
                    s, t, n = s + 8, t + 8, n - 8
                vecs = n >> 4
                _pairs(src64, dst64, s >> 3, t >> 3, vecs, tid, step)
                s, t, n = s + 16 * vecs, t + 16 * vecs, n - 16 * vecs
            words = n >> 3
            _words(src64, dst64, s >> 3, t >> 3, words, tid, step)
            s, t, n = s + 8 * words, t + 8 * words, n - 8 * words
        _bytes(src8, dst8, s, t, n, tid, step)
        d += cuda.gridDim.x


@functools.cache
def simulated() -> Any:
    """The kernel as the simulator runs it: numba's dispatcher over arrays."""
    return cuda.jit(_copy_body)


def image() -> tuple[bytes, str]:
    """(cubin, kernel entry name) for the current context's GPU: the body
    compiled with pointer arguments (about a second)."""
    u8, u64, i64 = (types.CPointer(x) for x in (types.uint8, types.uint64, types.int64))
    sig = types.void(u8, u8, u64, u64, i64, types.int64, types.int64, types.int64)
    kernel = cuda.jit(sig)(_copy_body)
    (compiled,) = kernel.overloads.values()
    library = compiled._codelibrary  # numba-cuda 0.30: no public cubin call
    if getattr(library, "_setup_functions", None):
        raise RuntimeError("the copy kernel needs module setup: numba launches it")
    cubin = library.get_cubin()
    cubin = getattr(cubin, "code", cubin)  # newer numba-cuda: a cuda.core ObjectCode
    return bytes(cubin), str(library._entry_name)
