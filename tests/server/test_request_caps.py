"""Bounded requests against a real server process: a registration cannot make
one Save build tables far larger than the pool, oversized messages are refused
by grpc before they are parsed, and the server keeps serving byte-exact.

Memory is read from /proc/<server pid>/status: the pool is pre-touched at
start, so its pages are in the baseline and growth is tables and messages.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import numpy as np
import pytest

from pegaflow.client.pegaflow_client import PegaflowClient
from pegaflow.common.errors import InvalidRequest
from pegaflow.common.geometry import LayerLayout, Segment
from pegaflow.proto import pegaflow_pb2 as pb
from pegaflow.proto import pegaflow_pb2_grpc as pb_grpc
from tests.kvbuf import LocalKV, hashes
from tests.procs import HOST_ONLY, ServerProc, start_server

TIMEOUT_S = 60.0
POOL = 128 << 20  # slabs of 8 MiB: one slot each for the 8 MiB blocks below
MiB = 1 << 20


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProc]:
    srv = start_server(
        tmp_path_factory.mktemp("caps"), "--pool-size", str(POOL), *HOST_ONLY
    )
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server: ServerProc) -> Iterator[PegaflowClient]:
    c = PegaflowClient(server.addr, timeout_s=TIMEOUT_S)
    yield c
    c.close()


def status_kib(pid: int, key: str) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    raise AssertionError(f"{key} not in /proc/{pid}/status")


def rss(server: ServerProc) -> int:
    return status_kib(server.pid, "VmRSS") << 10


def split_pages(layers: int, segs: int, seg: int, blocks: int) -> list[LayerLayout]:
    """Per layer [segment][block][seg bytes]: no two segments of a block touch,
    so none of a block's descriptors coalesce (the worst case for a copy)."""
    per_layer = segs * blocks * seg
    one = tuple(Segment(s * blocks * seg, seg) for s in range(segs))
    return [LayerLayout(0, i * per_layer, blocks, seg, one) for i in range(layers)]


def test_one_byte_segments_refused(server: ServerProc, client: PegaflowClient) -> None:
    """Regression (amplification probe): a host engine registers 4096 layers x 8
    one-byte segments (a 32 KiB block of 32768 descriptors). It was accepted,
    and one Save of a pool's worth of such blocks grew the server's RSS by ~58x
    the pool. Now the registration is refused, naming the segments' field, and
    the server stays as it was."""
    blocks = 64
    buf = np.zeros(4096 * 8 * blocks, np.uint8)
    layers = split_pages(4096, 8, 1, blocks)
    before = rss(server)
    with pytest.raises(InvalidRequest, match=r"layers\[0\]\.segments: .*average"):
        client.register_host(
            "probe", "ns-probe", os.getpid(), [(buf.ctypes.data, buf.nbytes)], layers
        )
    assert rss(server) - before < 16 * MiB
    status, _ = server.get("/health")
    assert status == 200


def test_large_legal_save_bounded(server: ServerProc, client: PegaflowClient) -> None:
    """A registration at the caps (2048 layers x 8 segments of 512 B: 16384
    descriptors for an 8 MiB block) saves as many blocks as the pool holds:
    the server's peak memory grows by a small fraction of the pool, not a
    multiple of it; two blocks then load back byte for byte."""
    blocks = POOL // (8 * MiB)  # 16: one block per 8 MiB slab fills the pool
    layers = split_pages(2048, 8, 512, blocks)
    buf = np.random.default_rng(5).integers(0, 256, POOL, np.uint8)
    client.register_host(
        "big", "ns-big", os.getpid(), [(buf.ctypes.data, buf.nbytes)], layers
    )
    before = rss(server)
    hs = hashes(blocks)
    assert client.save("big", range(blocks), hs).stored == blocks
    peak = (status_kib(server.pid, "VmHWM") << 10) - before
    grown = rss(server) - before
    # 16 x 16384 descriptors: ~15 MiB of tables at their peak.
    assert peak < POOL // 2, f"peak +{peak / MiB:.0f} MiB on a 128 MiB pool"
    assert grown < POOL // 4, f"RSS +{grown / MiB:.0f} MiB on a 128 MiB pool"

    want = buf.copy()
    buf[:] = 0
    hit = client.query("big", hs[:2])
    assert hit.num_blocks == 2
    assert client.load("big", hit.lease_id, [0, 1]).loaded == 2
    span = blocks * 512
    kv = buf.reshape(2048 * 8, span)[:, : 2 * 512]  # blocks 0, 1 of each segment
    np.testing.assert_array_equal(kv, want.reshape(2048 * 8, span)[:, : 2 * 512])
    assert not buf.reshape(2048 * 8, span)[:, 2 * 512 :].any()  # nothing else
    client.unregister("big")


def oversized_query(n: int) -> bytes:
    """A serialised QueryPrefixRequest of n 32-byte hashes (1M: 34 MiB)."""
    head = b"\x0a\x04good"  # instance_id = "good"
    rows = np.empty((n, 34), np.uint8)
    rows[:, 0], rows[:, 1] = 0x12, 32  # field 2, 32 bytes
    rows[:, 2:] = np.frombuffer(os.urandom(32 * n), np.uint8).reshape(n, 32)
    return head + rows.tobytes()


def test_oversized_queries_refused_before_parsing(
    server: ServerProc, client: PegaflowClient
) -> None:
    """Regression: 8 concurrent QueryPrefix calls of 1M hashes (34 MiB each)
    were parsed in full (the limit was 64 MiB), refused by our count check,
    and left the server ~1 GiB larger. grpc now refuses them by size
    (RESOURCE_EXHAUSTED, its own message); RSS grows < 100 MiB."""
    kv = LocalKV(seed=3)  # a registered instance: the count check is reached
    kv.register(client, "good", "ns-good")
    body = oversized_query(1 << 20)
    before = rss(server)
    channel = grpc.insecure_channel(server.addr)
    call = channel.unary_unary("/pegaflow.v1.PegaFlow/QueryPrefix")

    def one(_: int) -> grpc.RpcError:
        with pytest.raises(grpc.RpcError) as info:
            call(body, timeout=TIMEOUT_S)
        return info.value

    try:
        with ThreadPoolExecutor(8) as pool:
            errors = list(pool.map(one, range(8)))
    finally:
        channel.close()
    for err in errors:
        assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, err.details()
        assert "larger than max" in err.details()
    grown = rss(server) - before
    assert grown < 100 * MiB, f"RSS +{grown / MiB:.0f} MiB"
    assert server.proc.poll() is None
    client.unregister("good")


def test_concurrent_rpcs_bounded(tmp_path: Path) -> None:
    """Regression: the server admitted any number of concurrent RPCs. With
    --max-concurrent-rpcs 4, four open session streams (as four engine workers
    hold) fill it: a fifth call gets RESOURCE_EXHAUSTED; once the streams end,
    calls are served again. The sessions are real (each answered its first
    ping), so the streams surely run on the server when the fifth call comes."""
    srv = start_server(tmp_path, "--max-concurrent-rpcs", "4", "--pool-size", "8mb")
    channel = grpc.insecure_channel(srv.addr)
    stub = pb_grpc.PegaFlowStub(channel)
    kv = LocalKV(1, 8, 4096)

    def info_code() -> grpc.StatusCode:
        try:
            stub.ServerInfo(pb.ServerInfoRequest(), timeout=TIMEOUT_S)
        except grpc.RpcError as err:
            return err.code()
        return grpc.StatusCode.OK

    with PegaflowClient(srv.addr, timeout_s=TIMEOUT_S) as client:
        for i in range(4):  # registrations first: they need a free RPC
            kv.register(client, f"s{i}", "ns")
        sessions = [client.open_session(f"s{i}", interval_s=60) for i in range(4)]
        try:
            assert info_code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        finally:
            for session in sessions:
                session.close()
    assert poll(info_code, grpc.StatusCode.OK, seconds=60)
    channel.close()
    srv.stop()


def poll(get: Callable[[], object], want: object, seconds: float = 20.0) -> bool:
    """Whether get() returns `want` before the deadline."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if get() == want:
            return True
        time.sleep(0.05)
    return False


def test_still_serves_byte_exact(server: ServerProc, client: PegaflowClient) -> None:
    """Runs last: after the refusals, a save + query + load of a few blocks
    between two engines moves every byte."""
    src, dst = LocalKV(seed=21), LocalKV(seed=22)
    src.register(client, "rt-src", "ns-rt")
    dst.register(client, "rt-dst", "ns-rt")
    ids, hs = [3, 5, 7, 11], hashes(4)
    assert client.save("rt-src", ids, hs).stored == 4
    hit = client.query("rt-dst", hs)
    assert hit.num_blocks == 4
    into = [60, 40, 20, 0]
    assert client.load("rt-dst", hit.lease_id, into).loaded == 4
    for s, d in zip(ids, into, strict=True):
        np.testing.assert_array_equal(dst.block(d), src.block(s))
    client.unregister("rt-src")
    client.unregister("rt-dst")
    assert server.get("/health")[0] == 200
