"""The kvikio backend for real (H200 machine: `bash benchmarks/gpu_runner.sh gds`
runs the whole tests/gds suite there with PEGAFLOW_TEST_SSD_BACKEND=kvikio);
this file pins what is kvikio's own: the mode it reports, and one file format
shared with the POSIX backend both ways."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from pegaflow.gds import kvikio_io
from tests.gds.helpers import config, load, opened, spill

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _kvikio_here() -> None:
    why = kvikio_io.unavailable()
    if why is not None:
        pytest.fail(f"kvikio backend not usable on this gpu machine: {why}")


def test_kvikio_round_trip_and_restart(tmp_path: Path) -> None:
    cfg = config(tmp_path, capacity=64 << 20, files=2, backend="kvikio")
    ids = list(range(300))
    with opened(cfg) as tier:
        assert tier.mode in ("kvikio-compat", "kvikio-gds")
        assert spill(tier, ids, shards=2, slot_bytes=40960) == 300
        assert load(tier, ids, shards=2, slot_bytes=40960).all()
    with opened(cfg) as tier:
        assert tier.store.recovery.rebuilt_by == "journal"
        assert load(tier, ids, shards=2, slot_bytes=40960).all()
    os.unlink(cfg.journal_path)
    with opened(cfg) as tier:
        assert tier.store.recovery.rebuilt_by == "scan"
        assert tier.store.recovery.blocks == 300
        assert load(tier, ids, shards=2, slot_bytes=40960).all()
        st = tier.stats()
        assert st.checksum_failures == st.header_mismatches == 0


def test_posix_and_kvikio_share_one_format(tmp_path: Path) -> None:
    posix = config(tmp_path, backend="posix")
    kvikio = config(tmp_path, backend="kvikio")
    with opened(posix) as tier:
        spill(tier, list(range(20)), slot_bytes=100000)
    with opened(kvikio) as tier:
        assert load(tier, list(range(20)), slot_bytes=100000).all()
        spill(tier, list(range(20, 40)), slot_bytes=100000)
    with opened(posix) as tier:
        assert load(tier, list(range(40)), slot_bytes=100000).all()
