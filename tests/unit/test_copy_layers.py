"""pegaflow.copiers.run_copy.copy_layers: each layer's runs, then its word,
for the compiled loop and its Python twin, against numpy on random runs."""

from __future__ import annotations

import time

import numpy as np
import pytest

from pegaflow.common.errors import DeadlineExceeded
from pegaflow.copiers import run_copy
from pegaflow.copiers.memcpy_loop import copy_layers as compiled


def _case(seed: int, layers: int = 5, runs: int = 40):
    rng = np.random.default_rng(seed)
    src = rng.integers(0, 256, 1 << 16, np.uint8)
    dst = np.zeros(1 << 16, np.uint8)
    size = (1 << 16) // runs
    n = rng.integers(0, size, runs).astype(np.uint64)  # some empty
    s = rng.integers(0, len(src) - size, runs).astype(np.uint64)
    d = np.arange(runs, dtype=np.uint64) * np.uint64(size)  # disjoint targets
    cuts = np.sort(rng.integers(0, runs + 1, layers - 1))
    edges = np.concatenate(([0], cuts, [runs])).astype(np.int64)
    return src, dst, s, d, n, edges


@pytest.mark.parametrize("loop", [compiled, run_copy._python_layers])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_each_layer_and_its_word(loop, seed: int) -> None:
    src, dst, s, d, n, edges = _case(seed)
    words = np.zeros(len(edges) + 1, np.uint64)
    at = words.ctypes.data + 8 * np.arange(len(words), dtype=np.uint64)
    loop(dst.ctypes.data + d, src.ctypes.data + s, n, edges, at, 1, np.uint64(9))
    want = np.zeros_like(dst)
    for a, b, k in zip(d.tolist(), s.tolist(), n.tolist(), strict=True):
        want[a : a + k] = src[b : b + k]
    assert np.array_equal(dst, want)
    layers = len(edges) - 1
    assert words.tolist() == [0] + [9] * layers + [0]  # only its own words


def test_groups_of_layers_and_the_deadline(monkeypatch) -> None:
    """Groups of at most CHUNK_RUNS runs, the deadline checked before each:
    past it, no layer is copied and no word written."""
    monkeypatch.setattr(run_copy, "CHUNK_RUNS", 8)
    src, dst, s, d, n, edges = _case(3, layers=6, runs=60)
    words = np.zeros(6, np.uint64)
    at = words.ctypes.data + 8 * np.arange(6, dtype=np.uint64)
    args = (dst.ctypes.data + d, src.ctypes.data + s, n, edges, at, 4)
    with pytest.raises(DeadlineExceeded):
        run_copy.copy_layers(*args, "scatter", time.monotonic() - 1)
    assert not words.any() and not dst.any()
    run_copy.copy_layers(*args, "scatter", time.monotonic() + 60)
    assert (words == 4).all()
