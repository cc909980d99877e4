"""RDMA smoke test: where this machine has an active RDMA device, two nodes on
it (loopback addresses, the RDMA transport over that device) share a prefix.
Skips, saying why, everywhere else (no RDMA here or on the H200)."""

from __future__ import annotations

import json
import secrets
import time
from pathlib import Path

import pytest

from pegaflow.tiers.remote.nics import active_devices
from tests.metaserver.conftest import start_metaserver
from tests.procs import EngineProc, start_server
from tests.remote.conftest import SHAPE, block_hashes

pytestmark = [pytest.mark.rdma, pytest.mark.timeout(180)]


def test_rdma_two_nodes_share_a_prefix(tmp_path: Path) -> None:
    pytest.importorskip("mooncake.engine", reason="the `remote` extra")
    devices = active_devices()
    if not devices:
        pytest.skip("no active RDMA device in /sys/class/infiniband")
    env = {"PEGAFLOW_PEER_TOKEN": secrets.token_hex(16)}
    meta = start_metaserver(tmp_path, "--peer-token-env", "PEGAFLOW_PEER_TOKEN",
                            env=env)  # fmt: skip
    procs = [meta]
    try:
        servers = [
            start_server(tmp_path, "--pool-size", "64mb", "--metaserver-addr",
                         f"http://{meta.addr}", "--remote-allow-loopback",
                         "--nics", devices[0], "--node-id", f"rdma-{i}",
                         "--socket", str(tmp_path / f"r{i}.sock"), env=env)
            for i in range(2)
        ]  # fmt: skip
        procs += servers
        engines = [EngineProc(), EngineProc()]
        procs += engines
        for i, e in enumerate(engines):
            e.call("init", seed=i, **SHAPE)
            e.call("register", addr=servers[i].addr, instance=f"r{i}", namespace="m")
        hashes = block_hashes("rdma", 16)
        engines[0].call("save", block_ids=list(range(16)), hashes=hashes)
        end = time.monotonic() + 20
        while (
            json.loads(servers[0].get("/stats")[1])["tiers"]["remote"]["advertised"]
            < 16
        ):
            assert time.monotonic() < end, "not advertised"
            time.sleep(0.05)
        got = engines[1].call("query", hashes=hashes, wait_s=20)
        assert got["num_blocks"] == 16, got
        engines[1].call("load", lease_id=got["lease_id"], block_ids=list(range(16)))
        want = engines[0].call("digest", block_ids=list(range(16)))
        assert engines[1].call("digest", block_ids=list(range(16))) == want
    finally:
        for proc in reversed(procs):
            (proc.close if isinstance(proc, EngineProc) else proc.stop)()
