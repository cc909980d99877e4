"""A batch load's per-item error lines are cut by one rule (LOAD_ITEM_ERROR_MAX,
socket_frames.load_item_error) on both transports: the socket cut its lines,
gRPC sent them whole, so the same load answered two ways and gRPC's reply had
no bound but the message's."""

from __future__ import annotations

import asyncio
import os
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest

from pegaflow.client.pegaflow_client import PegaflowClient
from pegaflow.common.results import LoadBatchResult, LoadItemResult
from pegaflow.common.socket_frames import (
    HELLO_REPLY,
    LEASE_GONE_LINE_MAX,
    LOAD_ITEM_ERROR_MAX,
    LOAD_REPLY,
    encode_hello,
    encode_load,
    load_reply_size,
    parse_load_reply,
)
from pegaflow.proto import pegaflow_pb2 as pb
from pegaflow.proto import pegaflow_pb2_grpc as pb_grpc
from pegaflow.server import socket_service
from pegaflow.server.grpc_service import PegaFlowServicer
from pegaflow.server.metrics import Metrics
from tests.kvbuf import LocalKV

# What a lease error naming a long field would say (no error of today's server
# is this long): 2-byte characters, so a byte cut can fall inside one.
LONG = "items[0].lease_id: " + "é" * 300 + " is gone"


def _socket_load(path: str, frame: bytes) -> list[str]:
    with socket.socket(socket.AF_UNIX) as sock:
        sock.settimeout(10)
        sock.connect(path)
        sock.sendall(encode_hello())
        assert sock.recv(HELLO_REPLY.size, socket.MSG_WAITALL)[0] == 0
        sock.sendall(frame)
        reply = bytearray(sock.recv(LOAD_REPLY.size, socket.MSG_WAITALL))
        assert reply[0] == 0, bytes(reply)
        while len(reply) < (size := load_reply_size(reply)):
            reply += sock.recv(size - len(reply))
    return [error for _, _, error in parse_load_reply(bytes(reply))[2]]


def _grpc_load(addr: str, req: pb.LoadRequest) -> list[str]:
    with grpc.insecure_channel(addr) as channel:
        resp = pb_grpc.PegaFlowStub(channel).Load(req, timeout=10)
    return [item.error for item in resp.items]


class StandInEngine:
    metrics = Metrics()

    async def load(self, ident, rank, items, *rest, **kw) -> LoadBatchResult:
        return LoadBatchResult(0, 0, tuple(LoadItemResult(0, 0, LONG) for _ in items))


@pytest.fixture
def stand_in(tmp_path: Path) -> Iterator[tuple[str, str]]:
    """The socket server and the gRPC servicer, in-process, over an engine
    whose every load item fails with LONG: (socket path, gRPC address)."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    engine = StandInEngine()
    path = str(tmp_path / "s.sock")
    info = socket_service.SocketServerInfo(os.getpid(), bytes(16), path)

    async def start() -> tuple[asyncio.AbstractServer, grpc.aio.Server, int]:
        unix = await socket_service.start_socket_server(path, engine, info)
        server = grpc.aio.server()
        servicer = PegaFlowServicer(engine, os.getpid(), bytes(16))
        pb_grpc.add_PegaFlowServicer_to_server(servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        return unix, server, port

    unix, server, port = asyncio.run_coroutine_threadsafe(start(), loop).result(10)
    yield path, f"127.0.0.1:{port}"
    asyncio.run_coroutine_threadsafe(server.stop(None), loop).result(10)
    loop.call_soon_threadsafe(unix.close)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)


def test_a_long_item_error_is_cut_alike_over_both_transports(stand_in) -> None:
    """Scenario: a batch load's items fail with an error line of 2-byte
    characters longer than LOAD_ITEM_ERROR_MAX. gRPC sent it whole and the
    socket cut it inside a character; now both answer the same line, cut at
    the last whole character within LOAD_ITEM_ERROR_MAX bytes."""
    path, addr = stand_in
    items = [(7, 0, np.array([1])), (8, 0, np.zeros(0, np.int64))]
    frame = encode_load("e", 0, items, True, token=bytes(16))
    assert frame is not None
    over_socket = _socket_load(path, frame)
    req = pb.LoadRequest(
        instance_id="e",
        items=[pb.LoadItem(lease_id=7, block_ids=[1]), pb.LoadItem(lease_id=8)],
        owner_token=bytes(16),
    )
    over_grpc = _grpc_load(addr, req)
    assert over_grpc == over_socket, (over_grpc, over_socket)
    line = over_grpc[0]
    assert LONG.startswith(line) and "\ufffd" not in line
    assert LOAD_ITEM_ERROR_MAX - 1 <= len(line.encode()) <= LOAD_ITEM_ERROR_MAX


def test_the_real_servers_item_errors_are_the_same_over_both_transports(
    server,
) -> None:
    """Scenario: a batch load of the most items a load may name, every lease
    gone (the last item naming the longest lease id), over the socket and
    over gRPC: the same error line for each item, the last as long as
    LEASE_GONE_LINE_MAX says."""
    kv = LocalKV(1, 8, 4096)
    with PegaflowClient(server.addr) as client:
        reg = kv.register(client, "e", "ns")
        token = client._token("e", 0)
    n = 16384
    leases = [2 * i + 3 for i in range(n - 1)] + [2**64 - 1]
    items = [(lease, 0, np.zeros(0, np.int64)) for lease in leases]
    frame = encode_load("e", 0, items, True, token=token)
    assert frame is not None
    over_socket = _socket_load(reg.socket_path, frame)
    req = pb.LoadRequest(
        instance_id="e",
        items=[pb.LoadItem(lease_id=lease) for lease in leases],
        owner_token=token,
    )
    over_grpc = _grpc_load(server.addr, req)
    assert over_grpc == over_socket
    assert over_grpc[-1].startswith(f"items[{n - 1}].lease_id: {2**64 - 1} ")
    # What the socket's backlog charges such an item (load_reply_bound).
    assert len(over_grpc[-1].encode()) == LEASE_GONE_LINE_MAX
