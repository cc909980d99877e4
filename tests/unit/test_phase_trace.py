"""benchmarks/phase_trace.py: a real server run under the tracer, a host
engine saving and loading through it; the JSON written when the server stops
counts the traced calls."""

from __future__ import annotations

import json

from benchmarks import phase_trace
from pegaflow.demo.spawn import spawn_server
from tests.kvbuf import hashes
from tests.procs import EngineProc

TRANSFER = "pegaflow.copiers.host_copier:transfer"  # the copy syscalls, a sync call


def test_a_traced_server_counts_each_request(tmp_path) -> None:
    out = tmp_path / "trace.json"
    proc, addr = spawn_server(
        "--pool-size", "16mb", "--devices", "none", "--no-progress",
        "--log-level", "warning", "--no-http",
        python_args=phase_trace.python_args(
            None, str(out), (*phase_trace.TARGETS, TRANSFER), switch_ms=1.0
        ),
    )  # fmt: skip
    engine = EngineProc()
    try:
        engine.call("init", layout="LBNHC", layers=2, blocks=16, heads=2,
                    block_size=4, head=64, seed=3)  # fmt: skip
        engine.call("register", addr=addr, instance="traced", namespace="ns")
        for i in range(3):  # three saves of two fresh blocks
            hs = [h.hex() for h in hashes(2)]
            assert (
                engine.call("save", block_ids=[2 * i, 2 * i + 1], hashes=hs)["stored"]
                == 2
            )
    finally:
        engine.close()
        proc.terminate()
        proc.wait(timeout=60)
    got = json.loads(out.read_text())
    save = got["pegaflow.server.engine:Engine.save"]
    assert save["calls"] == 3 and save["threads"] == ["MainThread"]
    assert 0 < save["min_us"] <= save["p50_us"] <= save["p90_us"]
    assert got["pegaflow.server.copy_dispatch:CopyDispatch.run"]["calls"] == 3
    assert "pegaflow.server.engine:Engine.load" not in got  # only what ran is listed
    # Sync calls also carry their time off the CPU; coroutines cannot.
    copy = got[TRANSFER]
    assert copy["calls"] >= 3 and 0.0 <= copy["offcpu_share"] <= 1.0
    assert 0.0 <= copy["offcpu_p50_us"] <= copy["offcpu_p90_us"]
    assert "offcpu_share" not in save
