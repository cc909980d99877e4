"""Start-up of the SSD store: rebuild the rings and the index from the journal,
or by scanning the record headers where the journal is missing, foreign,
unreadable, damaged before its tail or naming space this store cannot have
written; then reopen the journal or rewrite it as a snapshot. Records naming a
checksum this server does not know raise `files.Mismatch` (the store refuses
or reinitialises the files)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Literal

import numpy as np

from . import journal, scan
from .config import SsdConfig
from .files import Mismatch
from .format import unknown_checksums
from .io import FileIO, SsdError
from .ring import Index, Ring

logger = logging.getLogger(__name__)

RebuiltBy = Literal["new", "journal", "scan"]
# More journal entries than this cut off before the end is damage, not a crash
# mid-append (which tears at most the last entry): scan the headers instead.
DAMAGED_JOURNAL_ENTRIES = 2


@dataclass(frozen=True, slots=True)
class Recovery:
    blocks: int
    # writes a crash interrupted (journal), or records found torn, damaged or
    # overwritten (scan): dropped
    torn_records: int
    torn_entries: int  # journal entries cut off or corrupt at the tail: dropped
    seconds: float
    reinitialised: str  # why the files were (re)initialised, "" when reused
    rebuilt_by: RebuiltBy  # "new": fresh files, nothing to rebuild
    unreadable_bytes: int = 0  # scan: record area that failed to read, skipped


@dataclass(frozen=True, slots=True)
class Recovered:
    """What `recover` rebuilt into the rings and index it was given."""

    journal: journal.Journal  # open for appending
    torn_records: int
    torn_entries: int
    next_seq: int
    rebuilt_by: RebuiltBy
    unreadable_bytes: int = 0


def log_ready(rec: Recovery, files: int, file_bytes: int, mode: str) -> None:
    logger.info(
        "ssd cache ready: %d file(s), %.2f GiB, %s, %d block(s) recovered "
        "(%s) in %.2f s (%d torn write(s), %d torn journal entr(ies) dropped)",
        files,
        file_bytes * files / (1 << 30),
        mode,
        rec.blocks,
        rec.rebuilt_by,
        rec.seconds,
        rec.torn_records,
        rec.torn_entries,
    )


def journal_limit(cfg: SsdConfig, rings: list[Ring]) -> int:
    """Entries past which the journal holds so many more than the live records
    need that it is worth rewriting as a snapshot."""
    live = sum(len(r.records) for r in rings)
    return cfg.journal_slack * max(live, 4096) + 64


def journal_bloated(cfg: SsdConfig, rings: list[Ring], entries: int) -> bool:
    return entries > journal_limit(cfg, rings)


def _load(
    cfg: SsdConfig, store_id: bytes, rings: list[Ring]
) -> tuple[journal.Loaded | None, int]:
    """(the journal's entries, or None where it is missing, foreign, unreadable
    or damaged before its tail or in its fields; the entries found torn or
    corrupt in it)."""
    try:
        loaded = journal.load(cfg.journal_path, store_id)
    except OSError as exc:
        logger.warning("ssd journal %s unreadable: %s", cfg.journal_path, exc)
        return None, 0
    if loaded is None:
        return None, 0
    if loaded.torn > DAMAGED_JOURNAL_ENTRIES:
        logger.warning(
            "ssd journal %s: damaged %d entries before its end",
            cfg.journal_path,
            loaded.torn,
        )
        return None, loaded.torn
    if bad := journal.first_invalid(loaded.entries, rings):
        logger.warning(
            "ssd journal %s: entry %d names %s; not written by this store",
            cfg.journal_path,
            *bad,
        )
        return None, loaded.torn
    return loaded, loaded.torn


def recover(
    cfg: SsdConfig,
    io: FileIO,
    rings: list[Ring],
    index: Index,
    store_id: bytes,
    fresh: bool,
) -> Recovered:
    """Rebuild `rings` and `index` (journal replay, else a header scan unless
    the files are fresh) and open the journal for appending."""
    loaded, torn_entries = (None, 0) if fresh else _load(cfg, store_id, rings)
    torn, next_seq, unreadable = 0, 1, 0
    rebuilt_by: RebuiltBy = "new"
    if loaded is not None:
        _check_checksums(loaded.entries)
        done = journal.replay(loaded.entries, rings, index, cfg.show_progress)
        torn, next_seq = done.torn_records, max(1, done.next_seq)
        rebuilt_by = "journal"
    elif not fresh:
        logger.warning(
            "ssd cache: no usable journal at %s; rebuilding the index by "
            "scanning %.2f GiB of record headers",
            cfg.journal_path,
            sum(r.end - r.start for r in rings) / (1 << 30),
        )
        found = scan.scan(
            io, rings, index, store_id, cfg.read_threads, cfg.show_progress
        )
        if reason := unknown_checksums(found.checksum_ids):
            raise Mismatch(reason)
        torn, next_seq = found.dropped, max(1, found.next_seq)
        unreadable = found.unreadable_bytes
        rebuilt_by = "scan"
    journal.remove_leftovers(cfg.journal_path)  # a crash mid-snapshot's
    try:
        if (
            loaded is not None
            and not loaded.torn
            and not journal_bloated(cfg, rings, len(loaded.entries))
        ):
            log = journal.Journal.reopen(cfg.journal_path, len(loaded.entries))
        else:
            log = journal.Journal.rewrite(
                cfg.journal_path, store_id, journal.snapshot(rings)
            )
    except OSError as exc:
        raise SsdError(
            f"--ssd-cache-path: cannot write the journal {cfg.journal_path}: {exc}; "
            "free space there or make its folder writable"
        ) from exc
    return Recovered(log, torn, torn_entries, next_seq, rebuilt_by, unreadable)


def _check_checksums(entries: np.ndarray) -> None:
    """Raise Mismatch where a committed record names an unknown checksum."""
    commits = entries["checksum_id"][entries["kind"] == journal.Kind.COMMIT]
    if reason := unknown_checksums(np.unique(commits).tolist()):
        raise Mismatch(reason)
