"""SSD -> GPU direct loads on a real GPU with kvikio (compat mode on the H200,
GDS where present): blocks saved from CUDA KV (one gather launch into pinned
slots), spilled to the SSD tier, then read by gds.gpu_reads straight into other
GPU blocks of the same engine buffer; every byte checked on the GPU. A record
corrupted on disk is never reported loaded, and the L1 route drops it too.

Excluded by default (marker `gpu`); on the H200 test machine:
    pytest -m gpu tests/gpu/test_gds_direct.py -o addopts="" -p no:cacheprovider
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from benchmarks.gds_direct import NS, Rig, key
from pegaflow.gds.format import HEADER_BYTES

pytestmark = pytest.mark.gpu
N = 24


@pytest.fixture
def rig(gpu: None, tmp_path: Path) -> Iterator[Rig]:
    pytest.importorskip("kvikio")
    made = Rig(tmp_path, N, layers=8, page=64 << 10, backend="posix")
    yield made
    made.close()


@pytest.mark.parametrize("m", [1, N])
def test_direct_load_byte_equal(rig: Rig, m: int) -> None:
    _, res = rig.load_direct(m)
    assert res.ok.all() and res.nbytes == m * rig.slot
    assert rig.check(m)
    _, ok = rig.load_l1(m)  # the L1 route into the same blocks, same bytes
    assert ok.all() and rig.check(m)


def test_corrupted_record_is_not_loaded(rig: Rig) -> None:
    rec = rig.tier.store.index.get(NS, key(3))
    path = rig.tier.config.paths[0]
    with open(path, "r+b") as f:  # one payload byte, in the middle of layer 2
        at = rec.offset + HEADER_BYTES + 2 * rig.page + 12345
        f.seek(at)
        byte = f.read(1)
        f.seek(at)
        f.write(bytes([byte[0] ^ 0x01]))
        f.flush()
    _, res = rig.load_direct(N)
    assert not res.ok[3] and res.ok.sum() == N - 1
    assert rig.check(N, res.ok)  # the others landed intact
    assert not rig.check(N)  # block 3 did not (the flipped byte, or zeros)
    # The L1 route, the fallback, reads and drops it: it never loads.
    slots = rig.slots[3:4]
    back = rig.tier.load(NS, [key(3)], slots, rig.slot).result(timeout=60)
    assert not back.ok.any()
    assert rig.tier.lookup(NS, [key(3)]) == 0
    assert np.flatnonzero(~res.ok).tolist() == [3]
