"""kernels/jit.njit: where numba finds no writable cache directory (a
read-only install run by a user without a writable HOME) the server's
compiled helpers are compiled without the cache instead of failing to load,
which stopped the server at its start."""

from __future__ import annotations

import pytest

from pegaflow.common import jit
from pegaflow.kernels import table_jit


def _add(a: int, b: int) -> int:
    return a + b


def test_no_writable_cache_directory_compiles_without_the_cache(monkeypatch) -> None:
    numba = pytest.importorskip("numba")
    from numba.core import caching

    impl = getattr(caching, "CacheImpl", None) or caching._CacheImpl  # 0.65 / older
    monkeypatch.setattr(impl, "_locator_classes", [])
    with pytest.raises(RuntimeError, match="cannot cache"):
        numba.njit(cache=True)(_add)  # what kernels/table_jit met before
    assert jit.njit(_add, "int64(int64, int64)", nogil=True)(2, 3) == 5
    assert jit.njit(_add)(4, 5) == 9  # lazily typed too
    check_into, *_ = table_jit.compiled.__wrapped__()  # the server's, afresh
    assert check_into.signatures
