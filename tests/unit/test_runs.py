"""pegaflow.common.runs.merge_adjacent: the one "merge adjacent runs" helper."""

from __future__ import annotations

import numpy as np

from pegaflow.common.runs import merge_adjacent, merge_parts


def _slow(starts: list[list[int]], nbytes: list[int]) -> tuple[list, list]:
    out_s: list[list[int]] = [[] for _ in starts]
    out_n: list[int] = []
    for i, n in enumerate(nbytes):
        if out_n and all(
            s[i] == o[-1] + out_n[-1] for s, o in zip(starts, out_s, strict=True)
        ):
            out_n[-1] += n
        else:
            for s, o in zip(starts, out_s, strict=True):
                o.append(s[i])
            out_n.append(n)
    return out_s, out_n


def test_one_side_merges_only_exact_continuations() -> None:
    parts = [(0, 4096), (4096, 100), (4196, 4), (8192, 8), (4, 4), (8, 1)]
    assert merge_parts(parts) == [(0, 4200), (8192, 8), (4, 5)]
    assert merge_parts([]) == [] and merge_parts([(5, 1)]) == [(5, 1)]


def test_every_side_must_continue() -> None:
    """Two sides (local and remote, as process_vm_* and the kernel copy plan
    need): a piece contiguous on one side only stays apart."""
    local = np.array([0, 10, 20, 40], np.uint64)
    remote = np.array([100, 110, 200, 220], np.uint64)
    n = np.array([10, 10, 20, 5], np.uint64)
    (lo, re), m = merge_adjacent([local, remote], n)
    assert lo.tolist() == [0, 20] and re.tolist() == [100, 200]
    assert m.tolist() == [20, 25]


def test_random_plans_match_a_loop() -> None:
    rng = np.random.default_rng(7)
    for _ in range(200):
        k = int(rng.integers(1, 30))
        n = rng.integers(1, 5, k)
        sides = []
        for _ in range(int(rng.integers(1, 4))):
            gaps = rng.integers(0, 2, k) * rng.integers(1, 3, k)
            sides.append(np.cumsum(np.concatenate(([0], (n + gaps)[:-1]))))
        got_s, got_n = merge_adjacent(sides, n)
        want_s, want_n = _slow([s.tolist() for s in sides], n.tolist())
        assert [s.tolist() for s in got_s] == want_s
        assert got_n.tolist() == want_n
        assert int(got_n.sum()) == int(n.sum())
