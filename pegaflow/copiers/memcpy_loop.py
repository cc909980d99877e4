"""The compiled memcpy loop of pegaflow.copiers.run_copy: numba nopython code
that calls LLVM's memcpy on raw addresses (an intrinsic casts each uint64 to
a pointer), so it holds no process-specific address and numba caches it on
disk: a server compiles it once per install, not at each start. Importing
this module imports numba; run_copy imports it lazily."""

from __future__ import annotations

from typing import Any

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from pegaflow.common.jit import njit


@intrinsic
def _memcpy(typingctx: Any, dst: Any, src: Any, n: Any) -> Any:
    """memcpy(dst, src, n) for uint64 addresses and a uint64 count."""
    sig = types.void(types.uint64, types.uint64, types.uint64)

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> None:
        d, s, k = args
        ptr = ir.IntType(8).as_pointer()
        dp, sp = builder.inttoptr(d, ptr), builder.inttoptr(s, ptr)
        cgutils.raw_memcpy(builder, dp, sp, k, 1)

    return sig, codegen


@intrinsic
def _publish(typingctx: Any, address: Any, value: Any) -> Any:
    """A fence, then *address = value: every store before it (the layer's
    memcpy, non-temporal ones included) is visible to another process before
    the word is. An engine polling the word never sees it ahead of the bytes."""
    sig = types.void(types.uint64, types.uint64)

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> None:
        a, v = args
        builder.fence("seq_cst")
        word = builder.inttoptr(a, ir.IntType(64).as_pointer())
        builder.store_atomic(v, word, "release", 8)

    return sig, codegen


def _copy_runs(dst: Any, src: Any, n: Any) -> None:
    for i in range(dst.shape[0]):
        _memcpy(dst[i], src[i], n[i])


def _copy_layers(
    dst: Any, src: Any, n: Any, edges: Any, words: Any, first: Any, seq: Any
) -> None:
    # Layer first + j is runs edges[j]..edges[j + 1]; its word is written
    # after them, even for a layer with no runs (the engine waits on it).
    for j in range(edges.shape[0] - 1):
        for i in range(edges[j], edges[j + 1]):
            _memcpy(dst[i], src[i], n[i])
        _publish(words[first + j], seq)


copy_runs = njit(_copy_runs, "void(uint64[::1], uint64[::1], uint64[::1])", nogil=True)
copy_layers = njit(
    _copy_layers,
    "void(uint64[::1], uint64[::1], uint64[::1], int64[::1], uint64[::1], int64,"
    " uint64)",
    nogil=True,
)
