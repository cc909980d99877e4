"""The CUDA copy engine's start-up warm-up (cuda_copier.warm_up), run on
the CPU kernels: it compiles the kernel without touching the pool."""

from __future__ import annotations

from types import ModuleType, SimpleNamespace
from typing import Any

import numpy as np

from pegaflow import kernels
from pegaflow.copiers.cuda_copier import warm_up


def _counting(k: ModuleType, calls: list[Any]) -> SimpleNamespace:
    """The kernels module, copy_descriptors counted."""

    def copy_descriptors(src: Any, dst: Any, t: Any, **kw: Any) -> None:
        calls.append(t)
        k.copy_descriptors(src, dst, t, **kw)

    names = ("staging_buffer", "synchronize", "wrap", "wrap_array")
    return SimpleNamespace(
        copy_descriptors=copy_descriptors, **{n: getattr(k, n) for n in names}
    )


def test_warm_up_leaves_the_pool_bytes_alone() -> None:
    """Regression (issue 13: every H200 restart served one acknowledged block
    fewer than it had): the warm-up copied the pool's first 16 bytes onto the
    next 16, inside the first slot of a kept --pool-file, whose checksum then
    failed at recovery. The pool here holds random bytes; after a warm-up
    that did launch a copy, every byte is the same."""
    pool = np.frombuffer(np.random.default_rng(5).bytes(1 << 16), np.uint8).copy()
    want = pool.copy()
    calls: list[Any] = []
    cpu = kernels.backend("cpu")
    cpu.wrap_array(pool)  # the pool is wrapped, as the copy engine does first
    warm_up(_counting(cpu, calls), None)
    assert len(calls) == 1
    assert np.array_equal(pool, want)
