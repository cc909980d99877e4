"""pegaflow.common.checksums: the values are xxh3-64's, and hashing lets other
threads run (python-xxhash's one-shot functions hold the GIL before 4.0)."""

from __future__ import annotations

import numpy as np
import pytest
import xxhash

from pegaflow.common.checksums import xxh3_64, xxh3_64_parts
from tests.gil import turns_while


@pytest.mark.parametrize("size", [0, 1, 4095, 64 << 10, (1 << 20) + 17])
def test_the_values_are_xxh3_64s(size: int) -> None:
    data = np.random.default_rng(size).integers(0, 256, size, np.uint8)
    want = xxhash.xxh3_64_intdigest(data.tobytes())
    assert xxh3_64(data) == want
    assert xxh3_64(memoryview(data)) == want
    cuts = sorted({0, size // 3, size // 2, size})
    parts = [data[a:b] for a, b in zip(cuts, cuts[1:], strict=False)]
    assert xxh3_64_parts(parts) == want
    assert xxh3_64(data[: size // 2]) == xxhash.xxh3_64_intdigest(
        data[: size // 2].tobytes()
    )  # the thread's hasher is reset between checksums


def test_hashing_lets_other_threads_run() -> None:
    """Regression (2026-12-04): slot and record checksums called xxhash's
    one-shot function, which on python-xxhash 3.x (the H200 machine's 3.6.0)
    holds the GIL for the whole buffer: the event loop waited behind every
    reader and the remote tier's hashing threads ran one at a time. With
    the switch interval raised past the test, a thread that holds the GIL
    while hashing leaves this one no turn at all until it is done."""
    data = np.ones(128 << 20, np.uint8)

    def hash_four_times() -> None:
        for _ in range(4):
            xxh3_64(data)

    turns = turns_while(hash_four_times)
    assert turns >= 10, f"{turns} turns while 512 MiB were hashed"
