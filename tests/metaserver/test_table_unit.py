"""The index's hash table against a dict reference: random inserts, removes,
node drops, expiries and queries over hashes built to collide (shared first
8 bytes, several lengths, several namespaces), through rebuilds."""

from __future__ import annotations

import random

import numpy as np

from pegaflow.common.keys import PackedHashes
from pegaflow.metaserver.index import BlockIndex
from pegaflow.metaserver.meta_config import OWNERS_PER_BLOCK
from pegaflow.metaserver.table import Keys, RowTable

SPACES = [b"ns-a", b"ns-b", b"ns-c"]


def _pool(rng: random.Random) -> list[bytes]:
    """Hashes sharing their first 8 bytes by the dozen, equal but for their
    length (b"x" vs b"x\\0"), and of lengths 3, 8, 12, 32 and 64."""
    head = rng.randbytes(8)
    out = [head + rng.randbytes(24) for _ in range(40)]
    out += [rng.randbytes(n) for n in (3, 8, 12, 32, 64) for _ in range(30)]
    out += [b"\x07", b"\x07\x00", b"\x07\x00\x00", head, head + b"\x00" * 24]
    return out


def _sample(rng: random.Random, pool: list[bytes]) -> list[bytes] | PackedHashes:
    """Mixed lengths as a list, or one length packed as the wire sends it."""
    if rng.random() < 0.5:
        return rng.sample(pool, rng.randrange(1, 60))
    size = rng.choice([8, 12, 32, 64])
    same = [h for h in pool if len(h) == size]
    chosen = [rng.choice(same) for _ in range(rng.randrange(1, 40))]  # repeats too
    return PackedHashes.pack(chosen, size)


def _listed(hashes: list[bytes] | PackedHashes) -> list[bytes]:
    return hashes.list() if isinstance(hashes, PackedHashes) else hashes


def test_index_matches_a_dict_reference() -> None:
    rng = random.Random(11)
    for _ in range(12):
        pool = _pool(rng)
        index = BlockIndex(100_000)
        model: dict[tuple[bytes, bytes], dict[int, float]] = {}
        now = 0.0
        for _ in range(120):
            now += 1.0
            ns, op = rng.choice(SPACES), rng.random()
            hashes = _sample(rng, pool)
            node = rng.randrange(OWNERS_PER_BLOCK + 2)  # more nodes than ways
            if op < 0.5:
                index.insert(ns, hashes, node, now)
                for h in dict.fromkeys(_listed(hashes)):
                    owners = model.setdefault((ns, h), {})
                    if node not in owners and len(owners) == OWNERS_PER_BLOCK:
                        del owners[min(owners, key=owners.__getitem__)]
                    owners[node] = now
            elif op < 0.75:
                index.remove(ns, hashes, node)
                for h in _listed(hashes):
                    owners = model.get((ns, h), {})
                    owners.pop(node, None)
                    if not owners:
                        model.pop((ns, h), None)
            elif op < 0.8:
                index.drop_node(node, "stale_node")
                for key in list(model):
                    model[key].pop(node, None)
                    if not model[key]:
                        del model[key]
            elif op < 0.85:
                cutoff = now - rng.randrange(5, 40)
                index.expire(cutoff)
                for key in list(model):
                    model[key] = {n: t for n, t in model[key].items() if t >= cutoff}
                    if not model[key]:
                        del model[key]
            else:
                exclude = rng.choice([-1, node])
                listed = _listed(hashes)
                plan = index.prefix(ns, hashes, exclude)
                holders = [set(model.get((ns, h), {})) - {exclude} for h in listed]
                covered = next((i for i, h in enumerate(holders) if not h), len(listed))
                assert sum(count for _, count in plan) == covered
                at = 0
                for owner, count in plan:
                    assert all(owner in held for held in holders[at : at + count])
                    at += count
            assert index.entries == sum(map(len, model.values()))
            assert index.blocks == len(model)
            assert index.namespaces == len({ns for ns, _ in model})
            assert int(index.node_entries.sum()) == index.entries


def test_equal_keys_are_told_apart_by_the_whole_hash() -> None:
    """With the fold's multipliers zeroed every hash of a length shares one
    key: one long run, through rebuilds and tombstones, each found only by
    itself."""
    rng = np.random.default_rng(3)
    table = RowTable()
    table._mult[:-1] = 0  # every key equal but for the home multiplier
    table.grow_rows(4096)
    hashes = [bytes(h) for h in rng.integers(0, 256, (600, 32), np.uint8)]
    keys = Keys.of(hashes)
    rows = np.arange(600)
    for part in range(0, 600, 100):  # incremental placing, then rebuilds
        table.add(1, keys.take(np.arange(part, part + 100)), rows[part : part + 100])
    assert (table.find(1, keys) == rows).all()
    assert (table.find(2, keys) == -1).all()  # another namespace
    gone = rows[::3]
    table.discard(gone)
    want = rows.copy()
    want[gone] = -1
    assert (table.find(1, keys) == want).all()
    other = Keys.of([bytes(h) for h in rng.integers(0, 256, (50, 32), np.uint8)])
    assert (table.find(1, other) == -1).all()
    short = Keys.of([b"\x07", b"\x07\x00", b"\x07\x00\x00"])  # words equal
    table.add(1, short.take(np.arange(2)), np.array([700, 701]))
    assert table.find(1, short).tolist() == [700, 701, -1]


def test_hashes_differing_in_words_top_bits_get_distinct_keys() -> None:
    """The table's key was a sum of the hash's words times secret odd
    multipliers: flipping the top bit of any even number of words left it
    unchanged, so anyone could make 2^(words-1) hashes (128 of 64 bytes) share
    one key without the secret, a run of their own size on every probe, under
    the directory's lock. The fold is no longer linear: they spread."""
    rng = np.random.default_rng(4)
    base = np.frombuffer(rng.bytes(64), "<u8").copy()
    top = np.uint64(1 << 63)
    variants = []
    for mask in range(256):
        if bin(mask).count("1") % 2 == 0:  # an even number of words flipped
            words = base.copy()
            words[[i for i in range(8) if mask >> i & 1]] ^= top
            variants.append(words.tobytes())
    assert len(variants) == 128
    keys = RowTable()._key(3, Keys.of(PackedHashes.pack(variants, 64)))
    assert len(set(keys.tolist())) == 128
    padded = Keys.of([variants[0][:40], variants[1]])  # 40 bytes padded to 64
    alone = Keys.of([variants[0][:40]])
    table = RowTable()
    assert table._key(3, padded)[0] == table._key(3, alone)[0]  # padding is inert
