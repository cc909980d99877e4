"""A restart groups a kept pool file's rows into blocks with numpy over all
rows at once (pegaflow.server.warm_restart._complete_blocks): the same blocks, tables
and drops as grouping row by row, whatever the rows claim."""

from __future__ import annotations

from collections import defaultdict

import numpy as np
import pytest

from pegaflow.cache.pool_file import ROW
from pegaflow.server.warm_restart import _complete_blocks


def _row_by_row(t: np.ndarray, rows: np.ndarray) -> tuple[dict, int]:
    """The reference: a dict per block, a row at a time, the later row of a
    shard winning; a block kept when every shard is there and all agree."""
    groups: dict[tuple[bytes, bytes], dict[int, int]] = defaultdict(dict)
    for row in rows.tolist():
        r = t[row]
        key = (r["digest"].tobytes(), r["hash"].tobytes()[: int(r["hash_len"])])
        groups[key][int(r["shard"])] = row
    spaces: dict = {}
    dropped = 0
    for (digest, h), shards in groups.items():
        geo = {
            (int(t[x]["shards"]), int(t[x]["num_layers"]), int(t[x]["slot_bytes"]))
            for x in shards.values()
        }
        if len(geo) != 1 or len(shards) != next(iter(geo))[0]:
            dropped += len(shards)
            continue
        tp, layers, slot = next(iter(geo))
        table, hashes = spaces.setdefault((digest, tp, layers, slot), ([], []))
        table.append([shards[s] for s in range(tp)])
        hashes.append(h)
    return {k: (np.array(v[0]), v[1]) for k, v in spaces.items()}, dropped


def _table(rng: np.random.Generator, n: int) -> np.ndarray:
    """Rows of a few namespaces and hashes, shards of 1-3, some geometry
    disagreeing, some shards missing or doubled, stale bytes past each
    hash's length (which must not split a block)."""
    t = np.zeros(n, ROW)
    digests = rng.integers(0, 256, (3, 16), np.uint8)
    hashes = rng.integers(0, 256, (n // 3 + 1, 64), np.uint8)
    block = rng.integers(0, len(hashes), n)
    t["digest"] = digests[rng.integers(0, 3, n)]
    t["hash_len"] = 16 + block % 3 * 8
    t["hash"] = hashes[block]
    stale = np.arange(64) >= t["hash_len"][:, None]
    t["hash"] = np.where(stale, rng.integers(0, 256, (n, 64)), t["hash"])
    t["shards"] = 1 + block % 3
    t["shards"][rng.random(n) < 0.03] += 1  # a row that disagrees
    t["shard"] = rng.integers(0, 3, n) % t["shards"]
    t["num_layers"] = 4
    t["slot_bytes"] = 4096 * (1 + block % 2)
    t["offset"] = np.arange(n) * 8192
    return t


@pytest.mark.parametrize("seed", range(6))
def test_the_same_blocks_as_grouping_row_by_row(seed: int) -> None:
    rng = np.random.default_rng(seed)
    t = _table(rng, 600)
    rows = np.sort(rng.choice(len(t), 500, replace=False))
    want, want_dropped = _row_by_row(t, rows)
    got, dropped = _complete_blocks(t, rows)
    assert dropped == want_dropped
    assert list(got) == list(want)  # namespaces in the order of their first row
    for key, (table, hashes) in want.items():
        assert got[key][0].tolist() == table.tolist(), key
        assert got[key][1] == hashes, key


def test_the_cases_one_by_one() -> None:
    """Block 1 (2 shards) whole; block 2 missing shard 1; block 3 whose
    shards disagree on layers; block 4 (1 shard) saved twice, the later row
    kept; none at all."""
    t = np.zeros(7, ROW)
    t["hash_len"], t["num_layers"], t["slot_bytes"] = 8, 4, 4096
    for row, (h, shard, shards) in enumerate(
        [(1, 1, 2), (2, 0, 2), (1, 0, 2), (3, 0, 2), (3, 1, 2), (4, 0, 1), (4, 0, 1)]
    ):
        t["hash"][row, 0], t["shard"][row], t["shards"][row] = h, shard, shards
    t["num_layers"][4] = 5
    got, dropped = _complete_blocks(t, np.arange(7))
    assert dropped == 1 + 2
    digest = bytes(16)
    two, one = got[(digest, 2, 4, 4096)], got[(digest, 1, 4, 4096)]
    assert two[0].tolist() == [[2, 0]] and two[1] == [bytes([1]) + bytes(7)]
    assert one[0].tolist() == [[6]] and one[1] == [bytes([4]) + bytes(7)]
    assert _complete_blocks(t, np.arange(0)) == ({}, 0)
    assert _complete_blocks(t, np.array([1, 3, 4])) == ({}, 3)  # nothing whole
