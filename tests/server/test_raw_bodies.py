"""Request bodies that are not the method's message, and a server holding more
than 1024 descriptors: both through a real server process.

Issue 30 found an undecodable body (0xff x 64) to Save answered UNKNOWN with a
traceback in the log, and every host-engine registration refused with INTERNAL
("filedescriptor out of range in select()") once the server held 1024
descriptors (any local user's 1,100 TCP connections to the gRPC port)."""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Iterator

import grpc
import pytest

from pegaflow.client.pegaflow_client import PegaflowClient
from pegaflow.proto import pegaflow_pb2 as pb
from tests.kvbuf import LocalKV, hashes
from tests.procs import ServerProc, start_server

SERVICE = f"/{pb.DESCRIPTOR.services_by_name['PegaFlow'].full_name}"
METHODS = (
    "Save", "Load", "QueryPrefix", "RegisterInstance", "ReleaseLease", "Unregister",
    "ServerInfo",
)  # fmt: skip
GARBAGE = (b"\xff" * 64, b"\x0a\xff\xff\xff\xff\x0f", b"\x08" * 3)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProc]:
    proc = start_server(tmp_path_factory.mktemp("raw"), "--pool-size", "32mb")
    yield proc
    proc.stop()


@pytest.mark.parametrize("method", METHODS)
def test_an_undecodable_body_is_invalid_argument(
    server: ServerProc, method: str
) -> None:
    with grpc.insecure_channel(server.addr) as channel:
        call = channel.unary_unary(f"{SERVICE}/{method}")  # raw bytes both ways
        for body in GARBAGE:
            with pytest.raises(grpc.RpcError) as err:
                call(body, timeout=10)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (
                method,
                body,
                err.value.code(),
                err.value.details(),
            )
            assert err.value.details().startswith("request: ")
    log = server.log.read_text()
    assert "Traceback" not in log, log[-3000:]
    assert server.proc.poll() is None


def test_registrations_work_with_over_1024_descriptors_open(
    server: ServerProc,
) -> None:
    """1,100 idle TCP connections to the gRPC port push the server's own
    descriptors past 1024; a host engine then registers, saves and loads."""
    conns = []
    host, port = server.addr.rsplit(":", 1)
    try:
        for _ in range(1100):
            conns.append(socket.create_connection((host, int(port)), timeout=10))
        deadline = time.monotonic() + 30
        while _open_fds(server.pid) < 1100 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _open_fds(server.pid) >= 1100
        kv = LocalKV(layers=2, blocks=4, page=4096)
        with PegaflowClient(server.addr) as client:
            kv.register(client, "many-fds", "ns-many-fds")
            keys = hashes(2)
            assert client.save("many-fds", [0, 1], keys).stored == 2
            assert client.query("many-fds", keys).num_blocks == 2
    finally:
        for c in conns:
            c.close()


def _open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))
