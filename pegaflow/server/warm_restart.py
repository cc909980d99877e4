"""Warm restart: rebuild the block index from a kept pool file's slot rows.

At start-up (before any engine registers) every row LANDED or SEALED is
checked with numpy over the whole table (offsets, sizes, lengths), SEALED rows
against their xxh3-64 checksum (pegaflow.cache.slot_log; threads, a tqdm bar on a
terminal), and the rows of one block (namespace digest, hash) grouped, with
numpy over all rows at once: a block
whose every shard is there and agrees is claimed from the allocator and
published, ready and evictable, under a namespace known only by its digest.
The engine that later registers a namespace of that name and geometry adopts
it (Recovered.adopt): same id, so its blocks are hits at once. Every other row
is marked FREE.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
from tqdm import tqdm

from pegaflow.cache.block_store import BlockStore
from pegaflow.cache.instances import Registry
from pegaflow.cache.pool import HostPool
from pegaflow.cache.pool_file import FREE, GRANULE, LANDED, SEALED, WRITING
from pegaflow.cache.slot_log import checksums
from pegaflow.common.keys import Namespace, namespace_digest

logger = logging.getLogger(__name__)

_CHECK_THREADS = 8
# rows per task: a task hashes its rows in one call without the GIL
# (pegaflow.common.checksum_rows), so the threads hash at once whatever the slot size;
# the task's size is the progress bar's step
_CHECK_BATCH = 256


@dataclass(frozen=True, slots=True)
class RecoveryReport:
    blocks: int = 0
    bytes: int = 0
    namespaces: int = 0
    torn: int = 0  # slots whose write was in flight (WRITING): dropped
    bad_checksum: int = 0  # dropped
    unsealed: int = 0  # LANDED, not yet checksummed: kept (see pegaflow.cache.slot_log)
    incomplete: int = 0  # slots of blocks missing a shard or inconsistent
    seconds: float = 0.0


class Recovered:
    """Namespaces known only by digest, until an engine registers them."""

    def __init__(
        self,
        registry: Registry,
        digest_known: Callable[[int, bytes, int], None] | None = None,
    ) -> None:
        """digest_known(namespace id, digest, slot bytes): told of each
        placeholder, so that a tier keying blocks by digest (the SSD's spills)
        files them under the real one before an engine names the namespace."""
        self._registry = registry
        self._digest_known = digest_known
        self.waiting: dict[bytes, Namespace] = {}

    def placeholder(
        self, digest: bytes, shards: int, layers: int, slot_bytes: int
    ) -> Namespace:
        reg = self._registry
        reg._last_namespace_id += 1
        name = "\0recovered:" + digest.hex()  # not printable: no client's name
        ns = Namespace(name, reg._last_namespace_id, shards, layers, slot_bytes, ())
        reg.namespaces[name] = ns
        self.waiting[digest] = ns
        if self._digest_known is not None:
            self._digest_known(ns.id, digest, slot_bytes)
        return ns

    def adopt(self, ns: Namespace) -> Namespace:
        """A namespace just made by a registration: the recovered one of the
        same name and geometry instead, if its blocks are still resident."""
        digest = namespace_digest(ns.name, ns.signature)
        old = self.waiting.pop(digest, None)
        reg = self._registry
        if old is None or reg.namespaces.get(old.name) is not old:
            return ns  # none, or all its blocks left before anyone came
        if (old.tp_size, old.num_layers, old.slot_bytes) != (
            ns.tp_size,
            ns.num_layers,
            ns.slot_bytes,
        ):
            logger.warning("recovered namespace %s: other geometry, kept apart", ns.tag)
            return ns
        del reg.namespaces[old.name]
        old.name, old.signature, old.slot_skew = ns.name, ns.signature, ns.slot_skew
        reg.namespaces[old.name] = old
        logger.info("namespace %s adopted its recovered blocks", old.tag)
        return old


def recover(
    pool: HostPool, store: BlockStore, recovered: Recovered, progress: bool
) -> RecoveryReport:
    """Publish the blocks a kept pool file holds; mark every other row FREE."""
    start = time.perf_counter()
    if pool.file is None or pool.file.fresh:
        return RecoveryReport()
    t = pool.file.table
    state = t["state"]
    torn = int(np.count_nonzero(state == WRITING))
    rows = _plausible(t, pool)
    sealed = rows[state[rows] == SEALED]
    good = _checksums_ok(pool, sealed, progress)
    bad = int(len(sealed) - good.sum())
    unsealed = int(np.count_nonzero(state[rows] == LANDED))
    rows = np.union1d(sealed[good], rows[state[rows] == LANDED])
    kept, blocks, nbytes, spaces, incomplete = _publish(pool, store, recovered, rows)
    reset = np.ones(len(t), bool)
    reset[kept] = False
    t["state"][reset & (state != FREE)] = FREE
    report = RecoveryReport(
        blocks,
        nbytes,
        spaces,
        torn,
        bad,
        unsealed,
        incomplete,
        time.perf_counter() - start,
    )
    logger.info(
        "pool file: recovered %d blocks (%.2f GiB, %d namespaces) in %.2f s; "
        "dropped %d torn, %d failing their checksum, %d slots of incomplete "
        "blocks; %d recovered unsealed",
        report.blocks,
        report.bytes / (1 << 30),
        report.namespaces,
        report.seconds,
        torn,
        bad,
        incomplete,
        unsealed,
    )
    return report


def _plausible(t: np.ndarray, pool: HostPool) -> np.ndarray:
    """Rows LANDED or SEALED whose fields describe a slot this pool can hold."""
    idx = np.flatnonzero((t["state"] == LANDED) | (t["state"] == SEALED))
    r = t[idx]
    off, n = r["offset"], r["slot_bytes"]
    slab = np.uint64(pool.slab_bytes)
    ok = (off // np.uint64(GRANULE) == idx.astype(np.uint64)) & (n >= GRANULE)
    # Compared without a sum, which a huge n would wrap past the bound.
    ok &= n <= slab - off % slab
    size = np.uint64(pool.size)
    ok &= (off <= size) & (n <= size - np.minimum(off, size))
    ok &= (r["hash_len"] >= 1) & (r["hash_len"] <= 64)
    ok &= (r["shards"] >= 1) & (r["shard"] < r["shards"]) & (r["num_layers"] >= 1)
    return idx[ok]


def _checksums_ok(pool: HostPool, rows: np.ndarray, progress: bool) -> np.ndarray:
    assert pool.file is not None
    t, data = pool.file.table, pool.file.data
    total = int(t["slot_bytes"][rows].sum())
    bar = tqdm(
        total=total,
        unit="B",
        unit_scale=True,
        desc="checking pool",
        disable=not progress,
    )

    def check(part: np.ndarray) -> np.ndarray:
        return checksums(t, data, part) == t["checksum"][part]

    parts = [rows[i : i + _CHECK_BATCH] for i in range(0, len(rows), _CHECK_BATCH)]
    results = []
    with ThreadPoolExecutor(_CHECK_THREADS) as ex:
        for part, ok in zip(parts, ex.map(check, parts), strict=True):
            results.append(ok)
            bar.update(int(t["slot_bytes"][part].sum()))
    bar.close()
    return np.concatenate(results) if results else np.zeros(0, bool)


def _publish(
    pool: HostPool, store: BlockStore, recovered: Recovered, rows: np.ndarray
) -> tuple[np.ndarray, int, int, int, int]:
    """Group rows into blocks, claim complete ones, hand them to the store.
    Returns (rows kept, blocks, bytes, namespaces, slots dropped)."""
    t = pool.file.table if pool.file is not None else None
    assert t is not None
    spaces, dropped = _complete_blocks(t, rows)
    kept: list[np.ndarray] = []
    blocks = nbytes = 0
    for (digest, tp, layers, slot_bytes), (table, hashes) in spaces.items():
        addrs = np.uint64(pool.base) + t["offset"][table.ravel()]
        ok = np.array(pool.slabs.claim(addrs.tolist(), slot_bytes), bool).reshape(
            -1, tp
        )
        whole = ok.all(axis=1)
        partial = addrs.reshape(-1, tp)[~whole & ok.any(1)]
        if len(partial):  # claimed shards of blocks that lost another
            pool.slabs.free(partial[ok[~whole & ok.any(1)]])
        dropped += int((~whole).sum()) * tp
        if not whole.any():
            continue
        ns = recovered.placeholder(digest, tp, layers, slot_bytes)
        if pool.log is not None:
            pool.log.know(ns.id, digest)
        hs = [h for h, w in zip(hashes, whole.tolist(), strict=True) if w]
        store.adopt(ns, hs, addrs.reshape(-1, tp)[whole])
        kept.append(table[whole].ravel())
        blocks += len(hs)
        nbytes += len(hs) * tp * slot_bytes
    rows_kept = np.concatenate(kept) if kept else np.empty(0, np.int64)
    return rows_kept.astype(np.int64), blocks, nbytes, len(spaces), dropped


_KEY_BYTES = 16 + 64 + 1  # digest, hash (zeroed past its length), hash length


def _complete_blocks(
    t: np.ndarray, rows: np.ndarray
) -> tuple[dict[tuple[bytes, int, int, int], tuple[np.ndarray, list[bytes]]], int]:
    """The blocks whose every shard has a row, all agreeing on the geometry:
    per (digest, shards, layers, slot bytes), their rows as a [blocks,
    shards] table (shard order) and their hashes, blocks in the order of
    their first row. Where two rows claim one shard of a block, the later
    one counts (the other is reset FREE with every row not kept). Also how
    many rows of other blocks were dropped. Numpy over all rows at once:
    a restart's millions of rows are no Python loop."""
    empty: dict[tuple[bytes, int, int, int], tuple[np.ndarray, list[bytes]]] = {}
    if not len(rows):
        return empty, 0
    r = t[rows]
    lengths = r["hash_len"].astype(np.intp)
    key = np.zeros((len(rows), _KEY_BYTES), np.uint8)
    key[:, :16] = r["digest"]
    key[:, 16:80] = np.where(np.arange(64) < lengths[:, None], r["hash"], 0)
    key[:, 80] = lengths
    _, first, block = np.unique(
        key.view(np.dtype((np.void, _KEY_BYTES))).ravel(),
        return_index=True,
        return_inverse=True,
    )
    block = block.ravel()
    shard = r["shard"].astype(np.intp)
    # By block, then shard, then row order; of rows sharing a block's shard
    # only the last is taken.
    order = np.lexsort((np.arange(len(rows)), shard, block))
    last = np.ones(len(order), bool)
    last[:-1] = (block[order[1:]] != block[order[:-1]]) | (
        shard[order[1:]] != shard[order[:-1]]
    )
    order = order[last]
    starts = np.flatnonzero(np.r_[True, block[order[1:]] != block[order[:-1]]])
    count = np.diff(np.r_[starts, len(order)])
    geometry = [
        r[f][order].astype(np.int64) for f in ("shards", "num_layers", "slot_bytes")
    ]
    agree = np.ones(len(starts), bool)
    for g in geometry:
        agree &= np.minimum.reduceat(g, starts) == np.maximum.reduceat(g, starts)
    tp = geometry[0][starts]
    complete = agree & (count == tp)
    dropped = int(count[~complete].sum())
    # Blocks are numbered in key order; the store adopts them in row order.
    good = np.flatnonzero(complete)
    good = good[np.argsort(first[good], kind="stable")]
    ns_key = np.zeros((len(good), 16 + 24), np.uint8)
    ns_key[:, :16] = r["digest"][order[starts[good]]]
    ns_key[:, 16:] = (
        np.stack([g[starts[good]] for g in geometry], axis=1)
        .view(np.uint8)
        .reshape(-1, 24)
    )
    _, ns_first, ns_of = np.unique(
        ns_key.view(np.dtype((np.void, 40))).ravel(),
        return_index=True,
        return_inverse=True,
    )
    ns_of = ns_of.ravel()
    hash_bytes = r["hash"].tobytes()
    spaces = empty
    for ns in np.argsort(ns_first, kind="stable").tolist():
        mine = good[ns_of == ns]
        at = starts[mine]
        width = int(tp[mine[0]])
        table = rows[order[at[:, None] + np.arange(width)]]
        heads = order[at].tolist()
        hashes = [
            hash_bytes[i * 64 : i * 64 + n]
            for i, n in zip(heads, lengths[heads].tolist(), strict=True)
        ]
        digest = bytes(r["digest"][heads[0]])
        layers, slot_bytes = int(geometry[1][at[0]]), int(geometry[2][at[0]])
        spaces[(digest, width, layers, slot_bytes)] = (table, hashes)
    return spaces, dropped
