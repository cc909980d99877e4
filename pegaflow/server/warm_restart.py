"""Warm restart: rebuild the block index from a kept pool file's slot rows.

At start-up (before any engine registers) every row LANDED or SEALED is
checked with numpy over the whole table (offsets, sizes, lengths) and the rows
of one block (namespace digest, hash) grouped, with numpy over all rows at
once: a block whose every shard is there and agrees is claimed from the
allocator and put into the store under a namespace known only by its digest,
pinned and in flight until its SEALED rows passed their xxh3-64 checksum
(pegaflow.cache.slot_log). That check runs after the server serves, in the
background and first for the blocks a query asks for (pegaflow.server.pool_check):
the start-up costs a pass over the rows, not over the pool's bytes. The engine
that later registers a namespace of that name and geometry adopts it
(Recovered.adopt): same id, so its blocks are hits once checked. Every other
row is marked FREE.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import numpy as np

from pegaflow.cache.block_entry import BlockEntry
from pegaflow.cache.block_store import BlockStore
from pegaflow.cache.instances import Registry
from pegaflow.cache.pool import HostPool
from pegaflow.cache.pool_file import FREE, GRANULE, LANDED, SEALED, STATES, WRITING
from pegaflow.common.keys import RECOVERED_PREFIX, Namespace, namespace_digest

from .pool_check import Pending, PoolCheck, RecoveryReport

logger = logging.getLogger(__name__)

__all__ = ["PoolCheck", "Recovered", "RecoveryReport", "find", "recover"]


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
        name = RECOVERED_PREFIX + digest.hex()
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


def find(
    pool: HostPool, store: BlockStore, recovered: Recovered, rate: int = 0
) -> PoolCheck | None:
    """Put the blocks a kept pool file holds into the store, unchecked (blocks
    with no SEALED row, ready at once); mark every other row FREE. The check
    that publishes the rest is the PoolCheck returned (started by the
    caller); None for a new file or none. rate: its bytes a second, 0 no cap."""
    start = time.perf_counter()
    if pool.file is None or pool.file.fresh:
        return None
    t = pool.file.table
    # One strided read of the rows (a 4-byte field every 128 bytes), the
    # passes below over 4 bytes a row: 3x quicker than each pass reading
    # the table (4 GiB: 25-34 ms against 75-95, dev VM).
    state = t["state"].copy()
    torn = int(np.count_nonzero(state == WRITING))
    damaged = int(np.count_nonzero(~np.isin(state, STATES)))
    rows = _plausible(t, state, pool)
    unsealed = int(np.count_nonzero(state[rows] == LANDED))
    pending, kept, spaces, incomplete = _adopt(pool, store, recovered, rows)
    stale = state != FREE
    stale[kept] = False
    t["state"][np.flatnonzero(stale)] = FREE
    if pool.log is not None:  # kept LANDED rows: checked at the next restart
        pool.log.seal_kept(kept[state[kept] == LANDED])
    blocks = len(pending.entries) + pending.ready
    report = RecoveryReport(
        blocks,
        int(pending.nbytes.sum()) + pending.ready_bytes,
        spaces,
        torn,
        0,
        unsealed,
        incomplete,
        round(time.perf_counter() - start, 3),
        damaged=damaged,
    )
    logger.info(
        "pool file: found %d blocks (%.2f GiB, %d namespaces) in %.2f s, %d to "
        "check before they are served; dropped %d torn, %d slots of incomplete "
        "blocks, %d rows of no known state; %d recovered unsealed",
        report.blocks,
        report.bytes / (1 << 30),
        report.namespaces,
        report.seconds,
        len(pending.entries),
        torn,
        incomplete,
        damaged,
        unsealed,
    )
    if damaged:
        logger.warning(
            "pool file: %d rows held a state word that is none of the states "
            "(damaged while no server ran): dropped",
            damaged,
        )
    return PoolCheck(t, pool.file.data, store, pending, report, rate)


def recover(pool: HostPool, store: BlockStore, recovered: Recovered) -> RecoveryReport:
    """find(), then the whole check in this thread: every block published or
    dropped when it returns (tools and tests; the server checks in the
    background)."""
    check = find(pool, store, recovered)
    if check is None:
        return RecoveryReport()
    check.run_here()
    return check.outcome


def _plausible(t: np.ndarray, state: np.ndarray, pool: HostPool) -> np.ndarray:
    """Rows LANDED or SEALED (`state`: the rows' states) whose fields
    describe a slot this pool can hold."""
    idx = np.flatnonzero((state == LANDED) | (state == SEALED))
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


def _adopt(
    pool: HostPool, store: BlockStore, recovered: Recovered, rows: np.ndarray
) -> tuple[Pending, np.ndarray, int, int]:
    """Group rows into blocks, claim complete ones, adopt them unchecked.
    Returns (the blocks to check, rows kept, namespaces, slots dropped)."""
    t = pool.file.table if pool.file is not None else None
    assert t is not None
    spaces, dropped = _complete_blocks(t, rows)
    kept: list[np.ndarray] = []
    entries: list[BlockEntry] = []
    sealed: list[np.ndarray] = []  # per space: [blocks, shards] SEALED
    tables: list[np.ndarray] = []
    widths: list[np.ndarray] = []
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
        fresh = store.adopt(ns, hs, addrs.reshape(-1, tp)[whole], unchecked=True)
        assert len(fresh) == len(hs)  # a new namespace id: no key known before
        entries += fresh
        mine = table[whole]
        kept.append(mine.ravel())
        tables.append(mine)
        sealed.append(t["state"][mine] == SEALED)
        widths.append(np.full(len(mine), tp * slot_bytes, np.int64))
    rows_kept = np.concatenate(kept) if kept else np.empty(0, np.int64)
    return (
        _pending(t, store, entries, tables, sealed, widths),
        rows_kept.astype(np.int64),
        len(spaces),
        dropped,
    )


def _pending(
    t: np.ndarray,
    store: BlockStore,
    entries: list[BlockEntry],
    tables: list[np.ndarray],
    sealed: list[np.ndarray],
    widths: list[np.ndarray],
) -> Pending:
    """The blocks with a SEALED row, for the check; the others (LANDED only:
    nothing to compare) published now."""
    rows = [tb[s] for tb, s in zip(tables, sealed, strict=True)]  # block order
    counts = np.concatenate([s.sum(1) for s in sealed]) if sealed else np.empty(0)
    nbytes = np.concatenate(widths) if widths else np.empty(0, np.int64)
    flat = np.concatenate(rows).astype(np.int64) if rows else np.empty(0, np.int64)
    none = counts == 0
    if none.any():
        ids = np.flatnonzero(none).tolist()  # no one used them yet: cold
        store.finish_load([entries[i] for i in ids], none[none], cold=none[none])
    left = np.flatnonzero(~none)
    # The rows of the blocks left, still back to back in block order.
    counts = counts[left].astype(np.int64)
    offsets = np.zeros(len(left) + 1, np.int64)
    np.cumsum(counts, out=offsets[1:])
    row_bytes = t["slot_bytes"][flat].astype(np.int64)
    sizes = np.add.reduceat(row_bytes, offsets[:-1]) if len(left) else counts
    return Pending(
        [entries[i] for i in left.tolist()],
        flat,
        offsets,
        sizes,
        nbytes[left],
        int(none.sum()),
        int(nbytes[none].sum()),
    )


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
