"""Index recovery of 100k records from the journal (timed in benchmarks/ssd.py;
here only counted and checked)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

from pegaflow.gds import journal
from pegaflow.gds.format import record_bytes
from pegaflow.gds.ring import Record, State
from tests.gds.helpers import NS, config, key, load, opened, spill

N = 100_000
PAYLOAD = 4096


def test_recover_100k_records(tmp_path: Path) -> None:
    """A journal of 100k committed records (their data never written, so loads
    must fail cleanly); a restart rebuilds all of them."""
    length = record_bytes(PAYLOAD)
    cfg = config(tmp_path, capacity=(N + 16) * length + (1 << 20))
    with opened(cfg) as tier:
        store_id = tier.store.store_id
        start = tier.store.rings[0].start

    def entries() -> Iterator[bytes]:
        for i in range(N):
            rec = Record(0, start + i * length, length, i + 1, NS, key(i))
            rec.payload_len, rec.checksum_id, rec.state = PAYLOAD, 1, State.LIVE
            yield journal.entry(journal.Kind.RESERVE, rec)
            yield journal.entry(journal.Kind.COMMIT, rec)

    journal.Journal.rewrite(cfg.journal_path, store_id, entries()).close()
    began = time.perf_counter()
    with opened(cfg) as tier:
        seconds = time.perf_counter() - began
        assert tier.store.recovery.blocks == N
        assert tier.lookup(NS, [key(i) for i in range(N)]) == N
        assert not load(tier, [0, N - 1], slot_bytes=PAYLOAD).any()  # no data
        assert tier.stats().header_mismatches == 2
        spill(tier, [N], slot_bytes=PAYLOAD)  # appends after the replayed head
        assert load(tier, [N], slot_bytes=PAYLOAD).all()
        assert tier.lookup(NS, [key(i) for i in range(1, N - 1)]) == N - 2
    print(f"recovered {N} records in {seconds:.2f} s")
