"""Kill -9 a process with spills in flight, reopen its files: every block it had
flushed hits, torn writes are gone, and nothing wrong is ever loaded."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.gds.helpers import SLOT_CRASH, SLOT_CRASH_ALIGNED, config, load, opened

ROOT = Path(__file__).resolve().parents[2]


def _spill_then_kill(folder: Path, start: int, until: int, aligned: bool) -> int:
    """Run the writer until it reports `until` durable blocks, then SIGKILL it
    while its next batch is in flight; returns the last durable count."""
    # Keep the caller's path too: kvikio may live in a --target folder there.
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": path}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tests.gds.spill_child",
            str(folder),
            str(start),
            *(["aligned"] if aligned else []),
        ],
        stdout=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        env=env,
    )
    durable = start
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            durable = int(line.split()[1])
            if durable >= until:
                break
        # Land the kill inside a later batch: spills queued, writes in flight.
        time.sleep(random.uniform(0.005, 0.06))
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL
    return durable


@pytest.mark.parametrize("slots", ["staged", "in_place"])
@pytest.mark.parametrize("rebuild", ["journal", "scan"])
def test_kill_9_mid_spill_then_reopen(tmp_path: Path, rebuild: str, slots: str) -> None:
    """rebuild="scan": the journal is lost with the crash too; the index comes
    back from the record headers, torn writes dropped by their checksums.
    slots="in_place": page-aligned slots, written to disk without a copy."""
    aligned = slots == "in_place"
    slot = SLOT_CRASH_ALIGNED if aligned else SLOT_CRASH
    cfg = config(tmp_path, capacity=64 << 20, queue_blocks=16)
    must: list[int] = []  # blocks some writer had flushed before its kill
    start = 0
    for until in (160, 400):
        durable = _spill_then_kill(tmp_path, start, until, aligned)
        must += range(start, durable)
        if rebuild == "scan":
            os.unlink(cfg.journal_path)
        with opened(cfg) as tier:
            assert tier.store.recovery.rebuilt_by == rebuild
            tables = tier.store.index.tables.values()
            found = sorted(int(h[len(b"block-") :]) for t in tables for h in t)
            assert len(found) == tier.store.recovery.blocks
            assert set(must) <= set(found)
            assert load(tier, found, slot_bytes=slot).all()  # every byte
            st = tier.stats()
            assert st.checksum_failures == 0 and st.header_mismatches == 0
        start = found[-1] + 64  # the next writer starts past anything torn
