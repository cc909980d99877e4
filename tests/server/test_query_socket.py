"""The unix-socket fast path for queries and saves: same answers and bytes as
gRPC, clear errors for bad frames, replies in request order, and a silent
fallback to gRPC when it is unusable."""

from __future__ import annotations

import os
import socket
import stat
import struct

import grpc
import numpy as np
import pytest

from pegaflow.client.pegaflow_client import PegaflowClient
from pegaflow.common.errors import InvalidRequest, PermissionDenied, UnknownInstance
from pegaflow.common.results import LoadItemResult, QueryResult
from pegaflow.common.socket_frames import (
    HELLO_REPLY,
    QUERY_REPLY,
    SAVE_REPLY,
    decode_load,
    decode_query,
    decode_save,
    encode_hello,
    encode_load,
    encode_query,
    encode_save,
    load_reply,
    parse_load_reply,
    query_reply,
)
from pegaflow.proto import pegaflow_pb2 as pb
from pegaflow.proto import pegaflow_pb2_grpc as pb_grpc
from tests.kvbuf import LocalKV, hashes


def test_frame_round_trip() -> None:
    hs = hashes(5)
    frame = encode_query("inst-é", hs)
    assert int.from_bytes(frame[:4], "little") == len(frame) - 4
    ident, packed, size, deadline = decode_query(frame[4:])
    assert (ident, packed.list(), size, deadline) == ("inst-é", hs, 32, 0)
    assert encode_query("i", [b"a" * 32, b"b" * 8]) is None  # mixed: use gRPC
    assert encode_query("inst-é", hs, hash_len=32) == frame
    # a wrong word is caught by the total, then by the full check
    assert encode_query("i", [b"a" * 32, b"b" * 8], hash_len=32) is None
    assert encode_query("i", [b"a" * 8, b"b" * 8], hash_len=32) == encode_query(
        "i", [b"a" * 8, b"b" * 8]
    )
    ident, packed, size, _ = decode_query(encode_query("i", [], deadline_ns=7)[4:])
    assert (ident, packed.list(), size) == ("i", [], 1)
    assert decode_query(encode_query("i", hs, deadline_ns=7)[4:])[3] == 7
    with pytest.raises(InvalidRequest, match="frame"):
        decode_query(frame[4:-1])


def test_socket_answers_like_grpc(server) -> None:
    kv = LocalKV()
    with PegaflowClient(server.addr) as client:
        reg = kv.register(client, "e", "ns")
        assert reg.socket_path and os.path.exists(reg.socket_path)
        assert stat.S_IMODE(os.stat(reg.socket_path).st_mode) == 0o600
        hs = hashes(10)
        client.save("e", list(range(6)), hs[:6])
        fast = client.query("e", hs)
        stub = pb_grpc.PegaFlowStub(grpc.insecure_channel(server.addr))
        slow = stub.QueryPrefix(
            pb.QueryPrefixRequest(instance_id="e", block_hashes=hs), timeout=5
        )
        assert fast.num_blocks == slow.ready.num_blocks == 6
        assert fast.lease_id and fast.lease_id != slow.ready.lease_id
        client.load("e", fast.lease_id, list(range(20, 26)))  # the lease is real
        with pytest.raises(UnknownInstance, match="instance_id"):
            client.query("nobody", hs)
        with pytest.raises(InvalidRequest, match=r"block_hashes\[0\]"):
            client.query("e", [b"x" * 65])
    assert (
        server.metric(
            "pegaflow_rpc_seconds_count",
            'code="OK",method="QueryPrefix",transport="unix"',
        )
        >= 1
    )


def _raw(path: str, payload: bytes, hello: bool = True) -> bytes:
    """Send payload (after a hello) and read until the server closes."""
    with socket.socket(socket.AF_UNIX) as s:
        s.settimeout(5)
        s.connect(path)
        if hello:
            s.sendall(encode_hello())
            assert s.recv(HELLO_REPLY.size, socket.MSG_WAITALL)[0] == 0
        s.sendall(payload)
        s.shutdown(socket.SHUT_WR)
        out = b""
        while chunk := s.recv(65536):
            out += chunk
        return out


def test_bad_frames_get_errors_and_server_survives(server) -> None:
    kv = LocalKV()
    with PegaflowClient(server.addr) as client:
        path = kv.register(client, "e", "ns").socket_path
        body = struct.pack("<BBHIQ", 9, 32, 1, 0, 0) + b"e"
        reply = _raw(path, len(body).to_bytes(4, "little") + body)
        assert reply[0] == grpc.StatusCode.INVALID_ARGUMENT.value[0]
        assert b"frame.kind" in reply
        body = struct.pack("<BBHIQ", 1, 32, 1, 3, 0) + b"e" + b"x" * 10  # short
        assert b"header promises" in _raw(path, len(body).to_bytes(4, "little") + body)
        assert b"frame" in _raw(path, (1 << 31).to_bytes(4, "little"))  # oversized
        assert _raw(path, b"\x01\x00") == b""  # truncated: connection just closes
        body = struct.pack("<BBHIQ", 1, 32, 2, 0, 0) + b"\xff\xfe"
        assert b"instance_id" in _raw(path, len(body).to_bytes(4, "little") + body)
        hs = hashes(3)
        client.save("e", [0, 1, 2], hs)
        assert client.query("e", hs).num_blocks == 3
    assert server.get("/health")[0] == 200


def test_falls_back_to_grpc_when_socket_is_unusable(server_factory) -> None:
    kv = LocalKV()
    closed = server_factory("--pool-size", "8mb", "--query-socket", "off")
    refused = pytest.raises(PermissionDenied, match="--allow-tcp-host-engines")
    with PegaflowClient(closed.addr) as client, refused:  # needs the socket
        kv.register(client, "e", "ns")
    server = server_factory(
        "--pool-size", "8mb", "--query-socket", "off", "--allow-tcp-host-engines"
    )
    with PegaflowClient(server.addr) as client:
        assert kv.register(client, "e", "ns").socket_path == ""
        hs = hashes(2)
        client.save("e", [0, 1], hs)
        assert client.query("e", hs).num_blocks == 2
    other = server_factory("--pool-size", "8mb")
    with PegaflowClient(other.addr) as client:
        path = kv.register(client, "e", "ns").socket_path
        client.save("e", [0, 1], hs)
        assert client.query("e", hs).num_blocks == 2  # connects the socket
        os.rename(path, path + ".moved")  # new connections impossible...
        client._socket.close()  # ...and the open one gone: as after a restart
        assert client.query("e", hs).num_blocks == 2  # answered over gRPC
        os.rename(path + ".moved", path)
    assert (
        other.metric(
            "pegaflow_rpc_seconds_count",
            'code="OK",method="QueryPrefix",transport="grpc"',
        )
        >= 1
    )


def test_save_frame_round_trip() -> None:
    hs = hashes(3)
    token = bytes(range(16))
    frame = encode_save("e", 1, np.array([7, 0, 9]), hs, [2, 0], 5, 11, token)
    ident, rank, ids, got, layers, event, deadline, tok = decode_save(frame[4:])
    assert (ident, rank, got, event, deadline, tok) == ("e", 1, hs, 5, 11, token)
    assert ids.tolist() == [7, 0, 9] and layers.tolist() == [2, 0]
    assert decode_save(encode_save("e", 0, np.array([1]), hs[:1], (), 0)[4:])[4] is None
    # gRPC carries what the frame cannot: its answer names the field
    assert encode_save("e", 0, np.array([-1]), hs[:1], (), 0) is None
    assert encode_save("e", 0, np.array([1, 2]), [b"a", b"bb"], (), 0) is None
    with pytest.raises(InvalidRequest, match="frame"):
        decode_save(frame[4:-1])


def test_load_frame_round_trip() -> None:
    items = [(7, 0, np.array([3, 4])), (2**63 + 5, 9, np.array([], np.int64))]
    token = bytes(range(16))
    frame = encode_load("é", 1, items, True, 9, 12, token, done_event=5)
    ident, rank, got, batch, seq, done, deadline, tok = decode_load(frame[4:])
    assert (ident, rank, batch, seq, done, deadline, tok) == (
        "é", 1, True, 9, 5, 12, token
    )  # fmt: skip
    assert [(a, b, c.tolist()) for a, b, c in got] == [
        (7, 0, [3, 4]),
        (2**63 + 5, 9, []),
    ]
    assert encode_load("e", 0, [(1, 0, np.array([-1]))], False) is None  # gRPC names it
    assert encode_load("e", 0, [(-1, 0, np.array([1]))], False) is None
    with pytest.raises(InvalidRequest, match="frame"):
        decode_load(encode_load("e", 0, items, True)[4:-1])
    results = [
        LoadItemResult(2, 64, ""),
        LoadItemResult(0, 0, "items[1].lease_id: gone"),
    ]
    for in_flight in (False, True):  # the copy queued, not done: IN_FLIGHT
        assert parse_load_reply(load_reply(2, 64, results, in_flight)) == (
            2,
            64,
            [(2, 64, ""), (0, 0, "items[1].lease_id: gone")],
            in_flight,
        )


def test_saves_over_the_socket_land_the_same_bytes(server) -> None:
    a, b = LocalKV(seed=1), LocalKV(seed=2)
    hs = hashes(12)
    with PegaflowClient(server.addr) as client:
        a.register(client, "a", "ns")
        b.register(client, "b", "ns")
        res = client.save("a", list(range(6)), hs[:6])  # socket
        slow = PegaflowClient(server.addr)
        with slow:
            a.register(slow, "a-grpc", "ns")  # the same memory, another instance
            slow.disable_socket()  # always gRPC from here
            res2 = slow.save("a-grpc", list(range(6, 12)), hs[6:], layer_ids=[0, 1])
            again = slow.save("a-grpc", list(range(6, 12)), hs[6:], layer_ids=[2, 3])
            assert again.stored
        assert (res.stored, res2.stored) == (6, 6)
        assert client.save("a", [0, 1], hs[:2]).deduplicated == 2
        with pytest.raises(InvalidRequest, match="block_ids"):
            client.save("a", [0, 999], hashes(2))
        with pytest.raises(UnknownInstance, match="instance_id"):
            client.save("nobody", [0], hashes(1))
        hit = client.query("b", hs)
        assert hit.num_blocks == 12
        client.load("b", hit.lease_id, list(range(20, 32)))
    for i in range(12):
        assert np.array_equal(b.block(20 + i), a.block(i)), i
    assert server.metric(
        "pegaflow_rpc_seconds_count", 'code="OK",method="Save",transport="unix"'
    ) == pytest.approx(2)
    assert server.metric(
        "pegaflow_rpc_seconds_count", 'code="OK",method="Load",transport="unix"'
    ) == pytest.approx(1)


def test_pipelined_frames_are_answered_in_order(server) -> None:
    """A query sent behind a save on one connection waits for it: its answer
    already sees the saved blocks."""
    kv = LocalKV()
    with PegaflowClient(server.addr) as client:
        path = kv.register(client, "e", "ns").socket_path
        hs = hashes(40)
        token = client._token("e", 0)
        save = encode_save("e", 0, np.arange(40), hs, (), 0, 0, token)
        query = encode_query("e", hs)
        bad = (5).to_bytes(4, "little") + bytes([7, 0, 0, 0, 0])
        reply = _raw(path, save + query + bad + query)
        assert SAVE_REPLY.unpack_from(reply)[:2] == (0, 40)
        at = SAVE_REPLY.size
        assert QUERY_REPLY.unpack_from(reply, at)[:2] == (0, 40)
        at += QUERY_REPLY.size
        assert reply[at] == grpc.StatusCode.INVALID_ARGUMENT.value[0]
        assert b"frame.kind: 7" in reply
        last = len(reply) - QUERY_REPLY.size
        assert QUERY_REPLY.unpack_from(reply, last)[:2] == (0, 40)


def test_query_answers_carry_the_servers_recent_rates(server) -> None:
    """What the connector's fetch planner weighs: no L1 rate before this
    kind of engine loaded anything; after a load, the same rate over the
    socket and over gRPC. A `loading` answer's frame keeps its L1 blocks and
    the pulling tier's rate."""
    kv = LocalKV(page=1 << 16)  # 30 blocks x 4 layers: ~8 MB, timed loads
    with PegaflowClient(server.addr) as client:
        kv.register(client, "rated", "ns-rated")
        hs = hashes(30)
        client.save("rated", list(range(30)), hs)
        stub = pb_grpc.PegaFlowStub(grpc.insecure_channel(server.addr))

        def both() -> tuple[float, float]:
            fast = client.query("rated", hs)
            slow = stub.QueryPrefix(
                pb.QueryPrefixRequest(instance_id="rated", block_hashes=hs), timeout=5
            )
            client.release_lease(fast.lease_id)
            client.release_lease(slow.ready.lease_id)
            return fast.l1_gbps, slow.ready.l1_gbps

        assert both() == (0.0, 0.0)  # unknown: the connector then loads
        hit = client.query("rated", hs)
        client.load("rated", hit.lease_id, list(range(32, 62)))
        fast, slow = both()
        assert fast > 0 and fast == pytest.approx(slow, rel=1e-6)  # f32 on the wire
    pulling = QueryResult(5, 0, 0.0, True, ready_blocks=3, l1_gbps=2.5, tier_gbps=0.5)
    status, n, lease, _, ready, l1, tier = QUERY_REPLY.unpack(query_reply(pulling))
    assert (status, n, lease, ready, l1, tier) == (255, 5, 0, 3, 2.5, 0.5)


def test_a_host_engines_done_event_is_answered_done(server) -> None:
    """done_event names a GPU worker's IPC event for the server to record after
    a launched copy; a host engine's copies are never launched, so its load is
    answered once done (not in flight), every byte there."""
    a, b = LocalKV(seed=5), LocalKV(seed=6)
    hs = hashes(4)
    with PegaflowClient(server.addr) as client:
        a.register(client, "a", "ns")
        b.register(client, "b", "ns")
        assert client.save("a", list(range(4)), hs).stored == 4
        hit = client.query("b", hs)
        got = client.load("b", hit.lease_id, list(range(10, 14)), done_event=3)
        assert (got.loaded, got.in_flight) == (4, False)
    for i in range(4):
        assert np.array_equal(b.block(10 + i), a.block(i)), i
