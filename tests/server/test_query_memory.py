"""Large QueryPrefix requests against a real server: refused ones cost no
more than their bytes, and the memory goes back (issue 30 #4).

64 concurrent requests of 240,000 hashes (7.8 MiB, under the 8 MiB cap) for
an instance that does not exist took the server from ~90 to ~1,300 MiB RSS,
and ~800 MiB stayed: each was parsed whole by protobuf (~14 MiB) and listed
(a bytes object per hash, ~20 MiB) before the instance was looked up, the
refusal (context.abort) left each call's state and request in a reference
cycle only the cyclic GC frees, and glibc kept the freed heap. Now the
request is read off its bytes and nothing per hash is built before the
instance is known, a refusal leaves no cycle, and the heap is trimmed after a
burst of large requests.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator

import grpc
import pytest

from pegaflow.client.pegaflow_client import PegaflowClient
from pegaflow.proto import pegaflow_pb2 as pb
from tests.kvbuf import LocalKV, hashes
from tests.procs import HOST_ONLY, ServerProc, start_server

MiB = 1 << 20
CALLS = 64
HASHES = 240_000  # 34 B each on the wire: 7.8 MiB


def _rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) << 10
    raise AssertionError("no VmRSS")


@pytest.fixture
def server(tmp_path) -> Iterator[ServerProc]:
    srv = start_server(tmp_path, "--pool-size", "16mb", *HOST_ONLY)
    yield srv
    srv.stop()


def _raw_query(channel: grpc.Channel) -> grpc.UnaryUnaryMultiCallable:
    """QueryPrefix taking its request as bytes: one serialized body shared by
    every call, so the test process holds 8 MiB, not 64 x 8."""
    return channel.unary_unary(
        "/pegaflow.v1.PegaFlow/QueryPrefix",
        request_serializer=None,
        response_deserializer=pb.QueryPrefixResponse.FromString,
    )


@pytest.mark.timeout(240)
def test_concurrent_large_queries_for_no_instance_cost_little(
    server: ServerProc,
) -> None:
    """Regression: 64 concurrent 7.8 MiB queries for an unknown instance are
    each refused FAILED_PRECONDITION naming instance_id; the server's RSS
    stays within 1.5x the bytes sent meanwhile (was 2.6x: +1,300 MiB) and is
    back within +200 MiB of its start within 20 s (~800 MiB stayed)."""
    body = pb.QueryPrefixRequest(
        instance_id="nobody", block_hashes=[os.urandom(32) for _ in range(HASHES)]
    ).SerializeToString()
    assert 7 * MiB < len(body) < 8 * MiB
    rss0 = _rss(server.pid)
    peak, done = [rss0], threading.Event()

    def watch() -> None:
        while not done.wait(0.02):
            peak[0] = max(peak[0], _rss(server.pid))

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    options = [("grpc.max_send_message_length", 16 * MiB)]
    with grpc.insecure_channel(server.addr, options=options) as channel:
        call = _raw_query(channel)
        futures = [call.future(body, timeout=120) for _ in range(CALLS)]
        errors = []
        for f in futures:
            with pytest.raises(grpc.RpcError) as info:
                f.result()
            errors.append(info.value)
    done.set()
    watcher.join()
    assert {e.code() for e in errors} == {grpc.StatusCode.FAILED_PRECONDITION}
    assert all("instance_id: 'nobody'" in e.details() for e in errors)
    grew = peak[0] - rss0
    # gRPC holds each request's bytes as they arrive, before any handler can
    # refuse it: how many of the 64 are held at once depends on the machine
    # (+450 to +650 MiB seen for these 499 MiB). What the fix removed is the
    # parse and the per-hash objects on top of them (2.6x the bytes).
    sent = CALLS * len(body)
    assert grew < 1.5 * sent, f"RSS peaked at +{grew // MiB} MiB ({grew / sent:.2f}x)"
    deadline = time.monotonic() + 20
    while _rss(server.pid) - rss0 > 200 * MiB and time.monotonic() < deadline:
        time.sleep(0.2)
    held = _rss(server.pid) - rss0
    assert held <= 200 * MiB, f"+{held // MiB} MiB still held after 20 s"


@pytest.mark.timeout(120)
def test_queries_read_off_the_wire_answer_as_before(server: ServerProc) -> None:
    """Guard for the decoder: a registered engine's queries over gRPC find its
    saved prefix (hashes of one length: read off the bytes; of mixed lengths:
    parsed by protobuf), an over-long request is refused naming block_hashes,
    and undecodable bytes are INVALID_ARGUMENT."""
    kv = LocalKV(layers=2, blocks=16)
    saved = hashes(8)
    with PegaflowClient(server.addr, timeout_s=30) as client:
        kv.register(client, "eng", "ns-wire")
        assert client.save("eng", list(range(8)), saved).stored == 8
        res = client.query("eng", [*saved, *hashes(4)])
        assert res.num_blocks == 8
        client.release_lease(res.lease_id)
        mixed = [*saved[:4], b"short", *saved[4:]]  # not the one-length form
        res = client.query("eng", mixed)
        assert res.num_blocks == 4
        client.release_lease(res.lease_id)
    with grpc.insecure_channel(server.addr) as channel:
        call = _raw_query(channel)
        too_many = pb.QueryPrefixRequest(
            instance_id="eng", block_hashes=[b"x" * 32] * 70_000
        ).SerializeToString()
        with pytest.raises(grpc.RpcError) as info:
            call(too_many, timeout=30)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "block_hashes: 70000 exceeds" in info.value.details()
        with pytest.raises(grpc.RpcError) as info:
            call(b"\xff" * 64, timeout=30)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "QueryPrefix" in info.value.details()
