"""Engine RPCs from other hosts (pegaflow.service.LocalEngines): a server on a
routable address (a bridge of this host), asked by a client in another network
namespace (standing in for another host, as the remote tier's tests do) and
by clients of this host through that same address. Real server, real gRPC.

Before the gate, a routable --addr (which peers need) let any host ask
QueryPrefix of any instance: which prompt prefixes it holds, and a lease
each time, up to the instance's cap. And a caller of this host connecting to
the routable address instead of loopback was not looked up at all, so
another user's query passed the uid check that loopback callers face."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator

import grpc
import pytest

from pegaflow.proto import pegaflow_pb2 as pb
from pegaflow.proto import pegaflow_pb2_grpc as pb_grpc
from tests.kvbuf import hashes
from tests.procs import ROOT, EngineProc, ServerProc, _env, start_server
from tests.remote.netns import Netns, NetnsUnavailable, Node
from tests.server.test_trust import NOBODY, _run_as, needs_root

PROBE = (
    "import grpc\n"
    "from pegaflow.proto import pegaflow_pb2 as pb, pegaflow_pb2_grpc as pbg\n"
    "stub = pbg.PegaFlowStub(grpc.insecure_channel({addr!r}))\n"
    "for name, call, req in [\n"
    "    ('info', stub.ServerInfo, pb.ServerInfoRequest()),\n"
    "    ('query', stub.QueryPrefix, pb.QueryPrefixRequest(instance_id='tenant', "
    "block_hashes={wire!r})),\n"
    "    ('release', stub.ReleaseLease, pb.ReleaseLeaseRequest(lease_id=1)),\n"
    "]:\n"
    "    try:\n"
    "        r = call(req, timeout=10)\n"
    "        print(name, 'OK', getattr(getattr(r, 'ready', None), 'num_blocks', ''))\n"
    "    except grpc.RpcError as e:\n"
    "        print(name, e.code().name, e.details())\n"
    "session = stub.Session(iter([pb.SessionPing(instance_id='tenant')]), timeout=10)\n"
    "try:\n"
    "    print('session OK', len(list(session)))\n"
    "except grpc.RpcError as e:\n"
    "    print('session', e.code().name, e.details())\n"
)


@pytest.fixture(scope="module")
def net() -> Iterator[tuple[Netns, Node]]:
    try:
        ns = Netns()
    except NetnsUnavailable as exc:
        pytest.skip(f"cannot make network namespaces here: {exc}")
    try:
        yield ns, ns.add_node()
    finally:
        ns.close()


def _tenant(server: ServerProc) -> tuple[EngineProc, list[bytes]]:
    """root's instance 'tenant' holding four blocks; their hashes."""
    owner = EngineProc()
    owner.call("init", layout="LBNHC", layers=2, blocks=16, heads=2,
               block_size=4, head=64, seed=1)  # fmt: skip
    owner.call("register", addr=server.addr, instance="tenant", namespace="ns")
    hs = [h.hex() for h in hashes(4)]
    assert owner.call("save", block_ids=[0, 1, 2, 3], hashes=hs)["stored"] == 4
    return owner, [bytes.fromhex(h) for h in hs]


def _probe(node: Node | None, addr: str, wire: list[bytes]) -> dict[str, str]:
    code = PROBE.format(addr=addr, wire=wire)
    argv = [sys.executable, "-c", code]
    out = subprocess.run(
        node.argv(*argv) if node else argv,
        capture_output=True, text=True, env=_env(), cwd=ROOT, timeout=60,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    return dict(line.split(" ", 1) for line in out.stdout.splitlines())


def test_another_host_gets_server_info_and_nothing_else(net, tmp_path) -> None:
    ns, node = net
    server = start_server(
        tmp_path, "--pool-size", "16mb", "--addr", f"{ns.host_address}:0"
    )
    owner = None
    try:
        owner, wire = _tenant(server)
        got = _probe(node, server.addr, wire)
        assert got["info"].startswith("OK")
        for call in ("query", "release", "session"):
            assert got[call].startswith("PERMISSION_DENIED"), got
            assert "--allow-remote-engines" in got[call]
            assert f"ipv4:{node.address}:" in got[call]  # names who was refused
        # This host's own clients reach the same address as before: loopback
        # is not needed, the kernel finds their sockets in its table.
        here = _probe(None, server.addr, wire)
        assert here["query"] == "OK 4", here
        for call in ("release", "session"):  # past the gate, to the engine's own checks
            assert "--allow-remote-engines" not in here[call], here
    finally:
        if owner is not None:
            owner.close()
        server.stop()


def test_allow_remote_engines_lets_another_host_query(net, tmp_path) -> None:
    ns, node = net
    server = start_server(
        tmp_path, "--pool-size", "16mb", "--addr", f"{ns.host_address}:0",
        "--allow-remote-engines",
    )  # fmt: skip
    owner = None
    try:
        owner, wire = _tenant(server)
        got = _probe(node, server.addr, wire)
        assert got["query"] == "OK 4", got  # the operator said so
    finally:
        if owner is not None:
            owner.close()
        server.stop()


@needs_root
def test_another_user_of_this_host_is_looked_up_on_its_routable_address(
    net, tmp_path
) -> None:
    """The sixth session's uid check, reached around through the host's own
    routable address instead of loopback: looked up there too now."""
    ns, _ = net
    server = start_server(
        tmp_path, "--pool-size", "16mb", "--addr", f"{ns.host_address}:0"
    )
    owner = None
    try:
        owner, wire = _tenant(server)
        probe = (
            f"stub = pbg.PegaFlowStub(grpc.insecure_channel({server.addr!r}))\n"
            "req = pb.QueryPrefixRequest(instance_id='tenant', "
            f"block_hashes={wire!r})\n"
            "try:\n    r = stub.QueryPrefix(req, timeout=10)\n"
            "    print('ANSWERED', r.ready.num_blocks)\n"
            "except grpc.RpcError as e:\n    print(e.code().name, e.details())\n"
        )
        out = _run_as(NOBODY, probe)
        assert out.returncode == 0, out.stderr
        assert "PERMISSION_DENIED" in out.stdout, out.stdout
        assert f"the caller is uid {NOBODY}" in out.stdout
        with grpc.insecure_channel(server.addr) as channel:
            req = pb.QueryPrefixRequest(instance_id="tenant", block_hashes=wire)
            got = pb_grpc.PegaFlowStub(channel).QueryPrefix(req, timeout=10)
        assert got.ready.num_blocks == 4
    finally:
        if owner is not None:
            owner.close()
        server.stop()
