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


def _copy_runs(dst: Any, src: Any, n: Any) -> None:
    for i in range(dst.shape[0]):
        _memcpy(dst[i], src[i], n[i])


copy_runs = njit(_copy_runs, "void(uint64[::1], uint64[::1], uint64[::1])", nogil=True)
