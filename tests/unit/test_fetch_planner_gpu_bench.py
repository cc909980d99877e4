"""benchmarks/fetch_planner_gpu.py end to end on this host (`--device cpu`:
host KV in a memfd, a small CPU model): a real server with an SSD tier,
restarted so one set of prefixes is on the SSD only, and the three policies.
Decisions depend on this host's timings, so only what holds on any host is
checked: every load byte-equal, never-load loads nothing, always-load loads
every hit, and each policy served both sets."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from benchmarks.fetch_planner_gpu import BLOCK

ROOT = Path(__file__).resolve().parents[2]


def test_runs_on_a_cpu_host_with_every_load_byte_equal(tmp_path: Path) -> None:
    out = tmp_path / "out"
    cmd = [
        sys.executable, "benchmarks/fetch_planner_gpu.py", "--device", "cpu",
        "--shape", "tiny", "--tokens", "256", "--prompts", "2", "--out", str(out),
        "--ssd-dir", str(tmp_path), "--budget-s", "120",
    ]  # fmt: skip
    got = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert got.returncode == 0, got.stdout[-2000:] + got.stderr[-2000:]
    report = json.loads((out / "fetch_planner_gpu.json").read_text())
    rows = report["prompts"]
    assert report["extra"]["prompts_served"] == report["extra"]["prompts_planned"]
    assert {(r["policy"], r["set"]) for r in rows} == {
        (p, s) for p in ("planner", "always", "never") for s in ("ssd", "l1")
    }
    blocks = report["extra"]["blocks_per_prefix"]
    for r in rows:
        assert r["bytes_ok"] in (True, None), r  # None: nothing loaded
        if r["policy"] == "never":
            assert r["loaded_tokens"] == 0 and r["decision"] == "recompute", r
        if r["policy"] == "always":
            assert r["loaded_tokens"] == blocks * BLOCK and r["bytes_ok"], r
