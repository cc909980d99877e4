"""The slot header rows of a file-backed pool (pegaflow.cache.pool_file), kept as the
store allocates, publishes and frees slots, so that a restarted server knows
which slots hold which blocks and which can be trusted.

A row's state word:
    FREE     nothing (a new file, a freed slot)
    WRITING  allocated to a block whose bytes are being copied in: not trusted
    LANDED   the block was published: every copy into it had finished (the
             flip runs on the loop after the copy's thread or stream joined)
    SEALED   LANDED, and the checksum (xxh3-64 over the rest of the row and
             the slot's bytes) is written: a restart checks it

The checksum is xxh3-64 since pool format 2 (format 1 used blake3; such a file
is refused or reinitialised, never read: pegaflow.cache.pool_file). It guards against
accidental damage, not tampering: whoever can write the file (mode 0600, the
server's user) can rewrite a row's checksum as well, whatever the hash. xxh3
runs at ~25 GB/s a core on the dev VM (blake3: ~3.6), so a restart's check
pass is mostly memory bandwidth and Python per row (benchmarks/RESULTS.md,
warm restart).

It is still computed off the save path, by one sealer thread: against a host
save path of ~9 GB/s, hashing at seal time would cost ~25 % of a save's
throughput. A torn write is caught by the state word alone (a slot still
WRITING is dropped); the checksum catches bytes or rows changed while no server
ran. A slot freed or reused while the sealer hashed it has a new generation,
and the sealer's result is discarded.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from pegaflow.common import checksum_rows
from pegaflow.common.checksums import xxh3_64_parts
from pegaflow.common.keys import Namespace

from .pool_file import FREE, GRANULE, LANDED, META_OFFSET, SEALED, WRITING
from .slabs import SlabAllocator

if TYPE_CHECKING:
    from .block_entry import BlockEntry
    from .pool_file import PoolFile

logger = logging.getLogger(__name__)

_STOP = None


def checksums(
    table: np.ndarray, data: np.ndarray, idx: np.ndarray, per_row: bool = False
) -> np.ndarray:
    """The checksums rows `idx` of `table` describe: xxh3-64 of each row's
    meta bytes (from META_OFFSET on), then its slot's bytes in `data`; the
    rows' fields read at once, then every row hashed in one call without
    the GIL (pegaflow.common.checksum_rows). A row whose slot is not inside `data`
    is refused (ValueError) before anything is read: its offset and size
    are the file's claim.

    per_row: one python-xxhash call per row instead (each drops the GIL while
    it hashes): as fast for slots of 64 KiB and more, and it needs no compiled
    loop, which takes ~1.3 s to build (never cached: pegaflow.common.jit) — a
    restarted server checks its first blocks without waiting for it."""
    if data.dtype != np.uint8 or data.ndim != 1 or not data.flags.c_contiguous:
        raise ValueError("data: need the pool's bytes as one contiguous uint8 array")
    idx = np.asarray(idx, np.intp)
    # Copies (a row changed meanwhile is caught by its gen), the meta bytes
    # through a plain byte view: a structured copy (table[idx]) would leave
    # the rows' padding bytes uninitialised, and the checksum covers them.
    raw = table.view(np.uint8).reshape(len(table), table.itemsize)
    meta = np.ascontiguousarray(raw[idx, META_OFFSET:])
    offs = table["offset"][idx].astype(np.uint64)
    sizes = table["slot_bytes"][idx].astype(np.uint64)
    end = np.uint64(data.nbytes)
    # Compared without a sum, which a huge size would wrap past the bound.
    outside = (offs > end) | (sizes > end - np.minimum(offs, end))
    if outside.any():
        row = int(idx[np.argmax(outside)])
        raise ValueError(f"pool row {row}: its slot lies outside the pool's data")
    if per_row:
        ends = (offs + sizes).tolist()
        parts = zip(meta, offs.tolist(), ends, strict=True)
        got = [xxh3_64_parts((m, data[a:b])) for m, a, b in parts]
        return np.array(got, np.uint64).reshape(len(idx))
    addrs = np.empty((len(idx), 2), np.uint64)
    lengths = np.empty((len(idx), 2), np.uint64)
    addrs[:, 0] = np.uint64(meta.ctypes.data) + np.arange(
        len(idx), dtype=np.uint64
    ) * np.uint64(meta.shape[1])
    addrs[:, 1] = np.uint64(data.ctypes.data) + offs
    lengths[:, 0], lengths[:, 1] = meta.shape[1], sizes
    return checksum_rows.rows(addrs, lengths)


class SlotLog:
    """Writes the rows (on the event loop) and seals them (on its own thread);
    a lock orders the two."""

    def __init__(self, file: PoolFile, base: int) -> None:
        self._file = file
        self._table = file.table
        self._data = file.data
        self._base = base
        self._lock = threading.Lock()
        self._digests: dict[int, bytes] = {}  # namespace id -> digest
        self._queue: queue.SimpleQueue[tuple[np.ndarray, np.ndarray] | None] = (
            queue.SimpleQueue()
        )
        self._pending = 0  # rows queued for sealing, not yet sealed or dropped
        self._idle = threading.Condition(self._lock)
        self.sealed = 0
        # Compiled on a thread of its own, never in the sealer's run: in
        # the sealer's first run (a loop compiled there for another argument
        # type) numba's import and compile held the GIL on a busy host for
        # 13 s, with an engine's first saves on the event loop (a PP 2
        # engine's saves timed out). Not before the server serves either: a
        # restart's first answer waited ~1 s for it. Until it is ready the
        # sealer hashes a python-xxhash call per slot.
        checksum_rows.warm_in_background()
        self._thread = threading.Thread(
            target=self._seal_forever, name="pegaflow-sealer", daemon=True
        )
        self._thread.start()

    # -- rows, on the event loop ------------------------------------------------
    def know(self, ns_id: int, digest: bytes) -> None:
        """A namespace known by digest only (its blocks were recovered)."""
        self._digests[ns_id] = digest

    def _digest(self, ns: Namespace) -> bytes:
        got = self._digests.get(ns.id)
        if got is None:
            got = self._digests[ns.id] = ns.digest
        return got

    def _rows(self, slots: np.ndarray) -> np.ndarray:
        return (np.asarray(slots, np.uint64) - np.uint64(self._base)) // np.uint64(
            GRANULE
        )

    def writing(
        self, ns: Namespace, hashes: Sequence[bytes], shard: int, slots: np.ndarray
    ) -> None:
        """Slots just allocated to these blocks (shard `shard` of each)."""
        if not len(slots) or ns.slot_bytes < GRANULE:
            return
        slots = np.asarray(slots, np.uint64)
        idx = self._rows(slots)
        lengths = set(map(len, hashes))
        with self._lock:
            t = self._table
            t["state"][idx] = WRITING
            t["gen"][idx] += 1
            t["offset"][idx] = slots - np.uint64(self._base)
            t["slot_bytes"][idx] = ns.slot_bytes
            t["digest"][idx] = np.frombuffer(self._digest(ns), np.uint8)
            t["shard"][idx] = shard
            t["shards"][idx] = ns.tp_size
            t["num_layers"][idx] = ns.num_layers
            if len(lengths) == 1:
                (n,) = lengths
                packed = np.frombuffer(b"".join(hashes), np.uint8).reshape(-1, n)
                t["hash"][idx, :n] = packed
                t["hash"][idx, n:] = 0
                t["hash_len"][idx] = n
            else:
                for row, h in zip(idx.tolist(), hashes, strict=True):
                    t["hash"][row] = np.frombuffer(h.ljust(64, b"\0"), np.uint8)
                    t["hash_len"][row] = len(h)

    def landed(self, entries: list[BlockEntry]) -> None:
        """These blocks were published: their slots flip to LANDED now, and
        queue for sealing."""
        slots = [s for e in entries for s in e.slots if s]
        if not slots:
            return
        idx = self._rows(np.asarray(slots, np.uint64))
        with self._lock:
            t = self._table
            idx = idx[t["state"][idx] == WRITING]  # small slots have no row
            if not len(idx):
                return
            t["state"][idx] = LANDED
            gens = t["gen"][idx].copy()
            self._pending += len(idx)
        self._queue.put((idx, gens))

    def seal_kept(self, rows: np.ndarray) -> None:
        """Rows a restart kept as LANDED (published, never hashed: the last
        server stopped first): sealed now, so the next restart checks them."""
        if not len(rows):
            return
        idx = np.asarray(rows, np.int64)
        with self._lock:
            gens = self._table["gen"][idx].copy()
            self._pending += len(idx)
        self._queue.put((idx, gens))

    def freed(self, slots: np.ndarray) -> None:
        if not len(slots):
            return
        idx = self._rows(slots)
        with self._lock:
            t = self._table
            # Only rows a slot of this size owns: a smaller slot's row may be
            # a neighbour's (they are never recorded, see writing()).
            mine = t["offset"][idx] == np.asarray(slots, np.uint64) - np.uint64(
                self._base
            )
            t["state"][idx[mine]] = FREE

    # -- sealing, on the sealer thread ------------------------------------------
    def _seal_forever(self) -> None:
        while (job := self._queue.get()) is not _STOP:
            idx, gens = job
            try:
                sums = checksums(self._table, self._data, idx)
            except Exception:  # a background loop: log, leave the rows LANDED
                logger.exception("sealing %d pool slots failed", len(idx))
                sums = None
            with self._lock:
                if sums is not None:
                    t = self._table
                    ok = (t["gen"][idx] == gens) & (t["state"][idx] == LANDED)
                    t["checksum"][idx[ok]] = sums[ok]
                    t["state"][idx[ok]] = SEALED
                    self.sealed += int(ok.sum())
                self._pending -= len(idx)
                if self._pending == 0:
                    self._idle.notify_all()

    @property
    def pending(self) -> int:
        return self._pending

    def drain(self, timeout_s: float) -> bool:
        """Wait until every published slot is sealed; False at the timeout."""
        with self._idle:
            return self._idle.wait_for(lambda: self._pending == 0, timeout_s)

    def close(self, timeout_s: float = 30.0) -> None:
        """Seal what is queued (a SIGTERM leaves every slot checked), then stop."""
        if not self.drain(timeout_s):
            logger.warning("pool file: %d slots left unsealed at exit", self._pending)
        self._queue.put(_STOP)
        self._thread.join(timeout_s)


class LoggedSlabs(SlabAllocator):
    """A SlabAllocator whose frees mark the slots' rows FREE."""

    def __init__(self, base: int, size: int, slab_bytes: int, log: SlotLog) -> None:
        super().__init__(base, size, slab_bytes)
        self.log = log

    def free(self, addresses: np.ndarray) -> None:
        addresses = np.asarray(addresses, np.uint64)
        self.log.freed(addresses)
        super().free(addresses)
