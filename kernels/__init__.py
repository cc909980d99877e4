"""Copy kernels: move descriptor tables (`pegaflow.common.geometry.Transfers`) between
engine KV memory and pool slots in one launch.

Two backends expose the same functions: `cpu` (numpy/numba-CPU, always
importable, the reference) and `cuda` (the copy kernel written in numba CUDA,
loaded and launched through the driver: importing it imports cuda-python,
and numba-cuda only under the simulator or to compile the kernel once, see
cubin_cache). Pick one once from config with `backend()`; never probe per
call.

    k = backend("cuda")
    engine = k.wrap(ipc_pointer, size)                  # device memory
    pool = k.wrap(pool_base, pool_size, mapped=True)    # cudaHostRegister'ed
    s = k.stream()
    k.gather(engine, pool, geometry.engine_to_slots(...), stream=s)
    k.synchronize(s)

Importing this package is cheap: no numba, no CUDA.
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Literal

from .plan import Buffer, Width

Backend = Literal["cpu", "cuda"]

__all__ = ["Backend", "Buffer", "Width", "backend"]


def backend(name: Backend) -> ModuleType:
    """The kernels module for `name` (imported on first use)."""
    if name not in ("cpu", "cuda"):
        raise ValueError(f"backend: {name!r}, need 'cpu' or 'cuda'")
    return importlib.import_module(f"{__name__}.{name}")
