"""benchmarks/sharing.py: the replay is deterministic for a seed and its
accounting adds up."""

from __future__ import annotations

import dataclasses

from benchmarks import sharing
from benchmarks.sharing_trace import make_trace

TIMING = {"replay_s", "tracker_snapshot_s", "wall_s"}
SMALL = dataclasses.replace(sharing.QUICK, requests=100)


def _run(seed: int) -> dict:
    out = sharing.run(SMALL, seed, (0.1,), (0.1,), error_runs=0)
    for row in out["sharing"] + out["scan"]:
        for key in TIMING & row.keys():
            del row[key]
    del out["wall_s"]
    return out


def test_replay_is_deterministic_for_a_seed() -> None:
    first, again, other = _run(seed=3), _run(seed=3), _run(seed=4)
    assert first == again
    assert first["sharing"] != other["sharing"]
    rows = first["sharing"] + first["scan"]
    assert len(rows) == 5  # 3 layouts + LRU and TinyLFU
    for row in rows:  # hits and misses by cause cover every queried block
        total = row["block_hit_rate"] + sum(row["miss_causes"].values())
        assert abs(total - 1) < 1e-3
        # a peer pool is the only "remote" here: none for a single pool
        pooled = row.get("layout", "").startswith("isolated")
        assert (row["miss_causes"]["remote"] > 0) == pooled
        # the ceiling is the infinite cache's hit rate: a block is seen when it
        # is first saved or queried (pool-full refusals kept apart from
        # compulsory misses, so a refused block's next miss is not "new")
        assert abs(row["hll_ceiling"] - row["exact_ceiling"]) < 0.01
        assert row["hll_ceiling"] >= row["block_hit_rate"]
        assert row["exact_ceiling"] >= row["first_query_ceiling"]


def test_trace_hashes_depend_only_on_the_seed() -> None:
    a, b = make_trace(SMALL, 7), make_trace(SMALL, 7)
    assert [r.prompt for r in a] == [r.prompt for r in b]
    assert [r.instance for r in a] == [r.instance for r in b]
