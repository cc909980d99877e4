"""The soak as a CI test: benchmarks/soak.py for ~110 s with every fault kind,
real server and engine processes, every loaded byte checked."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.soak import FAULTS
from tests.procs import ROOT

SECONDS = 110
RSS_GROWTH_LIMIT = 256 << 20  # generous: the pool is 16 MiB, the server ~90 MiB


@pytest.mark.slow
@pytest.mark.timeout(SECONDS + 400)
def test_soak_with_every_fault_kind_loses_and_corrupts_nothing(
    tmp_path: Path,
) -> None:
    """Four engines save, query and load (into other block ids) blocks whose
    bytes derive from their hashes, through a pool smaller than their working
    set, for 70 s with a plain server, then 40 s with a CPU-burning thread in
    it; meanwhile an engine is SIGKILLed and replaced, the server SIGKILLed and
    restarted on its port, the server SIGSTOPped past the client timeout, and
    an engine SIGSTOPped, each at least once. No loaded block differs from what
    was saved under its hash, no hit block fails to load outside a fault, no
    process dies unasked, and the server's RSS stays bounded."""
    out = tmp_path / "soak.json"
    argv = [sys.executable, str(ROOT / "benchmarks" / "soak.py")]
    argv += ["--seconds", str(SECONDS), "--burn-phase-seconds", "40"]
    argv += ["--fault-every", "10", "--faults", ",".join(FAULTS)]
    argv += ["--json", str(out), "--log-dir", str(tmp_path / "logs")]
    proc = subprocess.run(
        argv, cwd=ROOT, capture_output=True, text=True, timeout=SECONDS + 360
    )
    assert out.exists(), f"no JSON (rc={proc.returncode}):\n{proc.stderr[-4000:]}"
    rep = json.loads(out.read_text())
    where = f"report {out}, logs {tmp_path / 'logs'}:\n{proc.stdout}"
    assert rep["wrong_blocks"] == 0, where
    assert rep["lost_blocks"] == 0, where
    assert all(rep["faults"].get(kind, 0) >= 1 for kind in FAULTS), where
    assert rep["unplanned_exits"] == {"engine_exits": 0, "server_exits": 0}, where
    assert rep["verified_bytes"] > 0, where
    assert set(rep["phases"]) == {"plain", "burn"}, where
    rss = rep["rss"]
    assert rss["rss_end"] < rss["rss_start"] + RSS_GROWTH_LIMIT, where
    assert proc.returncode == 0, where
