"""`python -m pegaflow.demo --nodes 2`, as a user runs it: a metaserver and two
servers on loopback ports; engine B's prefix comes from node 1, byte-checked."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from tests.procs import ROOT, _env

pytestmark = pytest.mark.timeout(180)


def test_demo_two_nodes_reads_the_prefix_from_the_other_node() -> None:
    pytest.importorskip("mooncake.engine", reason="the `remote` extra")
    proc = subprocess.run(
        [sys.executable, "-m", "pegaflow.demo", "--nodes", "2", "--layers", "4",
         "--tokens", "4000", "--pool-size", "128mb"],
        capture_output=True, text=True, env=_env(), cwd=ROOT, timeout=150,
    )  # fmt: skip
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr
    assert "engine B: hit 250/250 blocks" in out, out
    read = re.search(r"node 2: read (\d+) bytes from node 1", out)
    assert read and int(read.group(1)) == 250 * 4 * (64 << 10), out
    assert "verified" in out and "all equal" in out, out
