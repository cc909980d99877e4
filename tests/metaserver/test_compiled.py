"""The metaserver's compiled loops (pegaflow.metaserver.compiled): the lookup
against its numpy rounds, on the same tables: random hashes of several
lengths (padded ones among them) in several namespaces, tombstones, rebuilds,
keys that all share one run, and queries mixing filed and unknown hashes."""

from __future__ import annotations

import numpy as np
import pytest

from pegaflow.common.keys import PackedHashes
from pegaflow.metaserver import compiled
from pegaflow.metaserver.index import BlockIndex
from pegaflow.metaserver.table import _WORDS, Keys, RowTable

pytestmark = pytest.mark.skipif(
    compiled.find() is None, reason="numba is not installed"
)


def numpy_find(table: RowTable, ns: int, keys: Keys) -> np.ndarray:
    compiled, table._compiled_find = table._compiled_find, None
    try:
        return table.find(ns, keys)
    finally:
        table._compiled_find = compiled


def packed(rng: np.random.Generator, n: int, size: int) -> Keys:
    raw = rng.integers(0, 256, (n, size), np.uint8)
    return Keys.of(PackedHashes(raw.tobytes(), size, n))


@pytest.mark.parametrize("one_run", [False, True])
def test_compiled_find_matches_the_numpy_rounds(one_run: bool) -> None:
    rng = np.random.default_rng(7 + one_run)
    for _ in range(6):
        table = RowTable()
        assert table._compiled_find is not None
        if one_run:  # every key's home is slot 0: one run holds them all
            table._mult[_WORDS + 2] = 0
        table.grow_rows(8192)
        filed: list[tuple[int, Keys]] = []
        next_row = 0
        for _ in range(8):
            size = int(rng.choice([8, 12, 20, 32, 64]))
            ns = int(rng.integers(1, 4))
            keys = packed(rng, int(rng.integers(1, 120)), size)
            rows = np.arange(next_row, next_row + keys.count)
            next_row += keys.count
            table.add(ns, keys, rows)
            filed.append((ns, keys))
            if rng.random() < 0.4:  # some rows withdrawn: tombstones in runs
                gone = rows[rng.random(len(rows)) < 0.3]
                table.discard(gone)
        hits = 0
        for ns, keys in filed:
            mixed_in = packed(rng, 30, int(keys.lens[0]))
            both = Keys(
                np.concatenate([keys.words, mixed_in.words]),
                np.concatenate([keys.lens, mixed_in.lens]),
                keys.length,
            )
            for space in (ns, ns % 3 + 1):  # its own namespace, then another
                got = table.find(space, both)
                assert (got == numpy_find(table, space, both)).all()
                hits += int((got >= 0).sum())
        assert hits > 0


def test_compiled_find_takes_the_wire_view_and_padded_words() -> None:
    rng = np.random.default_rng(9)
    table = RowTable()
    table.grow_rows(256)
    for size in (32, 20):  # a read-only view of the buffer; a padded copy
        keys = packed(rng, 50, size)
        rows = np.arange(50) + (0 if size == 32 else 100)
        table.add(5, keys, rows)
        assert not keys.words.flags.writeable or size % 8
        assert (table.find(5, keys) == rows).all()
        assert (table.find(5, keys) == numpy_find(table, 5, keys)).all()


def test_compiled_plans_match_the_numpy_plans() -> None:
    """Two indexes fed the same inserts and removes, one planning with the
    compiled loop and one in numpy: every prefix query plans the same,
    whichever node asks (its own entries are left out)."""
    rng = np.random.default_rng(12)
    fast, reference = BlockIndex(50_000), BlockIndex(50_000, compiled=False)
    assert fast._compiled_plan is not None and reference._compiled_plan is None
    chain = [bytes(h) for h in rng.integers(0, 256, (600, 32), np.uint8)]
    nodes = 7  # more than the ways a row holds: older owners are pushed out
    for step in range(400):
        start = int(rng.integers(0, 590))
        span = chain[start : start + int(rng.integers(1, 120))]
        node = int(rng.integers(0, nodes))
        insert = rng.random() < 0.8 or step < 50
        for index in (fast, reference):
            if insert:
                index.insert(b"ns", span, node, float(step))
            else:
                index.remove(b"ns", span, node)
        if step % 10 == 0:
            for asker in (-1, *range(nodes)):
                begin = int(rng.integers(0, 300))
                query = PackedHashes.pack(chain[begin : begin + 300], 32)
                got = fast.prefix(b"ns", query, asker)
                assert got == reference.prefix(b"ns", query, asker), (step, asker)
    whole = fast.prefix(b"ns", PackedHashes.pack(chain, 32), -1)
    assert len(whole) > 1  # the chain is split between owners: several segments
