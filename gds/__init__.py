"""L3 SSD tier (issue 5): spill cold blocks from L1 to local SSD, read them back,
and keep them across server restarts.

Layout
    format.py    superblock and record header (magic, version, store id, namespace
                 digest, block hash, seq, payload length, 64-bit checksum and
                 its algorithm id, CRC); the payload checksums
    ring.py      bookkeeping: records, one FIFO ring per file, the key index
    journal.py   append-only index journal (per-entry CRC), replay, snapshots
    scan.py      index rebuild from the record headers (journal lost or damaged)
    files.py     start-up: path checks, reuse / reinitialise / refuse, prealloc
    private.py   the files' privacy: created 0600, opened only as private
                 regular files of the server's user, never through a link
    io.py        FileIO interface, POSIX backend (O_DIRECT where allowed)
    kvikio_io.py kvikio backend (GDS or compat mode), imported lazily
    recovery.py  start-up: journal replay or header scan, journal reopened
    records.py   one request's bytes: a run's write parts, a piece read + verified
    store.py     files + rings + index + journal behind one lock
    tier.py      SsdTier: the seam the server calls
    config.py    SsdConfig (moves to pegaflow/common/settings.py when wired in)
    gpu_plan.py  SSD -> GPU direct loads: records -> (file, offset, device, bytes)
                 reads, merged, bounds-checked (pure numpy)
    gpu_reads.py DirectReads: one kvikio batch per load, checksums verified
                 on a fetch-back (pegaflow.copiers.fetch_back)
    gpu_route.py when that route would be taken (auto: where GDS is present)

The seam (all of it; the server needs nothing else)
    tier = SsdTier(SsdConfig(paths=(...,), capacity_bytes=...))
        Opens or creates the files, rebuilds the index from the journal (tqdm bar
        past 100k entries) or, where the journal is missing, foreign, unreadable,
        damaged before its tail or names space the store never wrote, by
        scanning the record headers (a chunk that fails to read is skipped; tqdm bar;
        torn and damaged records dropped), starts the writer threads and the
        reader pool. Raises
        SsdError with a clear message for a missing directory, an unwritable path,
        too little free space, a foreign file at a path, a cache file or journal
        that other users could read or change (mode, owner, symbolic link, a
        second hard link), a file another server holds, O_DIRECT refused with
        direct_io="on", or mismatched files with on_mismatch="refuse".
        `tier.store.recovery` says what was recovered, how (journal / scan)
        and how long it took.
        Beside paths[0] it keeps `<path>.journal` (the index); files and journal
        are created 0600. Each file is flock'ed while the tier runs: a second
        server on any of them, by whatever name, is refused. Payload checksum
        (SsdConfig.checksum): "auto" = xxh3-64 (~25 GB/s a core against
        blake3's 3.6 and blake2b's 0.5); each record names its own, so files
        written with blake3 or blake2b (the defaults before) still load, and
        records naming a checksum this server does not know make it refuse or
        reinitialise the files (on_mismatch), as for a format change.

    tier.spill(ns_digest, block_hash, slots, slot_bytes, release=None) -> bool
        Event-loop safe, never blocks (one short lock, no I/O). Queues the block
        whose payload is `slot_bytes` at each address in `slots` (one per TP shard).
        True: `release()` will be called exactly once from a writer thread when
        the slot bytes have been written (or copied out, or the spill failed);
        the caller must not reuse the slots before then. False: not queued
        (already on SSD or queued, not admitted, queue full -> counted in
        spills_dropped, or closed); release is not called, the caller frees the
        slots at once. A writer
        takes the spills queued behind its next one (up to 16 MiB) and writes
        them back to back in one request: page-aligned slots of a multiple of
        4 KiB straight from the pool (one gather pwritev, no copy), others
        through a staging copy. A block over 1 GiB (format.MAX_PAYLOAD_BYTES, all
        shards) is never written (counted in no_space, as one larger than a file).

    tier.spill_many(ns_digest, hashes, slots, slot_bytes, release=None) -> list[int]
        spill() of a save's blocks at once ([n, shards] slot addresses): one
        lock round and one queue entry (gds/spill_queue.py), cut to the
        queue's room (the rest dropped, counted). Returns the indices queued;
        release(lo, hi) comes once per written slice of them, never per block.

    tier.queue_room() -> int
        Lock-free hint: blocks the queue could take now (only the writers
        make room, so it can only be low). A caller offers spill_many no more
        than that and hands the rest to
    tier.refuse_many(ns_digest, hashes) -> None
        the counts a full queue gives (skipped, not admitted, dropped),
        queueing nothing: under a save burst the disk cannot absorb, no slot
        table is built for blocks the queue would drop.

    tier.lookup(ns_digest, hashes) -> int
        Event-loop safe, lock-free: the length of the prefix of hashes on SSD.

    tier.load(ns_digest, hashes, slots, slot_bytes) -> Future[SsdLoadResult]
        Event-loop safe, never blocks: reads block i into the addresses in
        slots[i] (array [n, shards] or [n]) on the reader pool. The
        concurrent.futures.Future (await it with asyncio.wrap_future) gives
        SsdLoadResult(ok: bool array, nbytes, seconds). A record that is gone,
        damaged (checksum / header mismatch: counted, dropped) or of another
        geometry is False; its slots hold garbage and go back to the pool.
        A reader pins up to 16 MiB of its blocks at a time (READ_RUN_BYTES) and
        reads each stretch of them that lies back to back on disk in one
        request: records whose slots are all 4 KiB-aligned in address and
        length straight into the slots (one scatter preadv: header pages into
        a small aligned buffer, payloads into the slots, checksum over the
        slots in place), others into a bounce buffer, verified there and
        copied out. Both kinds mix in one request.

    tier.flush(timeout=None) -> bool     wait for queued spills (tests, shutdown)
    tier.stats() -> SsdStats             counters snapshot for /metrics
    tier.close()                          write what is queued, sync, close
    tier.mode                             "posix-odirect" | "posix-buffered" |
                                          "kvikio-gds" | "kvikio-compat"
    (a namespace's on-disk key: pegaflow.common.keys.namespace_digest)

Wired into the server by pegaflow/tiers/ssd_link.py (SsdLink): with --ssd-write-on seal,
BlockStore.finish_save hands the blocks it makes ready to spill_many() (write-behind);
BlockStore._remove hands evicted ready blocks not yet on SSD to spill() (slots
freed on release, marshalled to the event loop), Engine.query answers
`loading` and runs one load per missing prefix,
pegaflow/server/cli.py builds SsdConfig into ServerConfig.ssd (--ssd-* flags),
pegaflow/server/assembly.py closes the tier after the engine and before the pool, and
pegaflow/server/metrics.py (SsdCollector) exports tier.stats().
"""

from __future__ import annotations

from .config import SsdConfig
from .io import SsdError
from .tier import SsdClosed, SsdLoadResult, SsdStats, SsdTier

__all__ = [
    "SsdClosed",
    "SsdLoadResult",
    "SsdConfig",
    "SsdError",
    "SsdStats",
    "SsdTier",
]
