"""64-bit fingerprints of block hashes, with no Python object per hash: the
first eight bytes of each (engines' block hashes are already uniform), mixed
when a hash is shorter. The hit-rate windows (cache.hll), the ready index and
packed queries (common.keys.PackedHashes) all cut theirs here."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

_SPLITMIX = (0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB)


def splitmix64(x: np.ndarray) -> np.ndarray:
    """A bijective 64-bit mix: distinct inputs stay distinct, outputs look uniform."""
    with np.errstate(over="ignore"):
        z = x.astype(np.uint64) + np.uint64(_SPLITMIX[0])
        z = (z ^ (z >> np.uint64(30))) * np.uint64(_SPLITMIX[1])
        z = (z ^ (z >> np.uint64(27))) * np.uint64(_SPLITMIX[2])
    return z ^ (z >> np.uint64(31))


def hash64(hashes: Sequence[bytes], hash_len: int | None = None) -> np.ndarray:
    """The first eight bytes of every hash as uint64 (little-endian).

    Hashes shorter than eight bytes carry too few bits to split into index and
    rank, so they are zero-padded and spread by splitmix64 (a bijection: distinct
    short hashes stay distinct). hash_len, when the caller knows every hash has
    it, skips the length scan.
    """
    n = len(hashes)
    if n == 0:
        return np.empty(0, np.uint64)
    joined = b"".join(hashes)
    if hash_len is None:
        lengths = np.fromiter(map(len, hashes), np.int64, n)
        hash_len = int(lengths[0]) if (lengths == lengths[0]).all() else None
    if hash_len is not None:
        return packed_hash64(joined, 0, hash_len, n)
    ends = np.cumsum(lengths)
    starts = ends - lengths
    buf = np.frombuffer(joined + bytes(8), np.uint8)
    cols = np.arange(8)
    grid = buf[starts[:, None] + cols]
    grid[cols >= lengths[:, None]] = 0
    out = grid.view("<u8").ravel().copy()
    short = lengths < 8
    out[short] = splitmix64(out[short] ^ (lengths[short].astype(np.uint64) << 56))
    return out


def packed_hash64(buf: bytes, offset: int, hash_len: int, count: int) -> np.ndarray:
    """hash64 of count hashes of hash_len bytes, back to back in buf from offset."""
    if count == 0:
        return np.empty(0, np.uint64)
    if hash_len >= 8:
        # A strided view of each hash's first 8 bytes; the copy makes it dense.
        return np.ndarray((count,), "<u8", buf, offset, (hash_len,)).copy()
    grid = np.zeros((count, 8), np.uint8)
    raw = np.frombuffer(buf, np.uint8, count * hash_len, offset)
    grid[:, :hash_len] = raw.reshape(count, hash_len)
    return splitmix64(grid.view("<u8").ravel() ^ np.uint64(hash_len << 56))


def hash64_batches(
    batches: Sequence[Sequence[bytes]], hash_len: int | None = None
) -> np.ndarray:
    """hash64 of the batches' hashes, concatenated in order."""
    if hash_len is None or hash_len < 8:
        return hash64([h for batch in batches for h in batch], hash_len)
    # Batch by batch: one join of everything costs 4x more here (a fresh
    # multi-MiB buffer, page-faulted in on every flush).
    view = np.dtype({"names": ["h"], "formats": ["<u8"], "itemsize": hash_len})
    out = np.empty(sum(map(len, batches)), np.uint64)
    at = 0
    for batch in batches:
        out[at : at + len(batch)] = np.frombuffer(b"".join(batch), view)["h"]
        at += len(batch)
    return out
