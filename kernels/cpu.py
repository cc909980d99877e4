"""CPU twin of kernels/cuda.py: the same functions over host memory.

It is the reference the CUDA kernels are tested against and the backend of
machines without a GPU. Copies are synchronous; `stream` and `max_blocks` are
accepted for signature parity and ignored, `width` too (memmove picks its own).
The descriptor loop runs under numba's CPU JIT when numba is installed (it is
not a base dependency), else as a plain loop of numpy slice copies.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from collections.abc import Callable
from typing import Any

import numpy as np

from pegaflow.common.errors import InternalError
from pegaflow.common.jit import njit

from .base import CopyKernels
from .plan import Buffer, aligned_empty, check_buffer

logger = logging.getLogger(__name__)

__all__ = [
    "copy_descriptors",
    "gather",
    "scatter",
    "staging_buffer",
    "stream",
    "synchronize",
    "wrap",
    "wrap_array",
]


def _copy_table_py(src: np.ndarray, dst: np.ndarray, table: np.ndarray) -> None:
    for k in range(table.shape[1]):
        s, d, n = table[0, k], table[1, k], table[2, k]
        dst[d : d + n] = src[s : s + n]


@functools.cache
def _copy_table() -> Callable[[np.ndarray, np.ndarray, np.ndarray], None]:
    try:
        import numba  # noqa: F401 - only whether it is there
    except ImportError:
        logger.info("numba missing: CPU copies loop in Python")
        return _copy_table_py
    return njit(_copy_table_py, nogil=True)


def wrap(
    address: int, nbytes: int, *, mapped: bool = False, owner: Any = None
) -> Buffer:
    """A buffer over `nbytes` of host memory at `address` (`mapped` is moot here)."""
    check_buffer(address, address, nbytes)
    raw = (ctypes.c_uint8 * nbytes).from_address(address)
    data = np.frombuffer(raw, np.uint8)
    return Buffer(address, address, nbytes, data, None, (owner, raw))


def wrap_array(obj: np.ndarray) -> Buffer:
    """A buffer over a C-contiguous numpy array's bytes."""
    if not isinstance(obj, np.ndarray) or not obj.flags.c_contiguous:
        raise InternalError("array: need a C-contiguous numpy array")
    return wrap(obj.ctypes.data, obj.nbytes, owner=obj)


def staging_buffer(nbytes: int) -> Buffer:
    """`nbytes` of scratch memory to copy within (plain host memory here)."""
    return wrap_array(aligned_empty(nbytes))


def stream() -> None:
    """Copies are synchronous on the CPU: there is no stream to make."""
    return None


def synchronize(stream: Any) -> None:
    """Nothing is ever in flight on the CPU."""


class CpuKernels(CopyKernels):
    """The hook is a synchronous descriptor loop."""

    def _launch(
        self,
        src: Buffer,
        dst: Buffer,
        table: np.ndarray,
        stream: Any,
        max_blocks: int | None,
        width: int,
        before_launch: Callable[[], None] | None = None,
    ) -> None:
        if before_launch is not None:
            before_launch()
        if table.shape[1]:
            _copy_table()(src.data, dst.data, table)


_kernels = CpuKernels()
copy_descriptors = _kernels.copy_descriptors
gather = _kernels.gather
scatter = _kernels.scatter
