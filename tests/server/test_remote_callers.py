"""Engine RPCs from other hosts (pegaflow.server.grpc_service.LocalEngines): a
server on a routable address (a bridge of this host), asked by a client in
another network namespace (standing in for another host, as the remote tier's
tests do) and by clients of this host through that same address. Real server, real gRPC.

Before the gate, a routable --addr (which peers need) let any host ask
QueryPrefix of any instance: which prompt prefixes it holds, and a lease
each time, up to the instance's cap. And a caller of this host connecting to
the routable address instead of loopback was not looked up at all, so
another user's query passed the uid check that loopback callers face."""

from __future__ import annotations

import contextlib
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.procs import ROOT, ServerProc, _env, start_server
from tests.remote.netns import Netns, NetnsUnavailable, Node
from tests.server.test_trust import assert_only_the_owner_queries, needs_root, tenant

PROBE = (
    "import faulthandler, grpc, threading\n"
    # A hang shows where: every thread's stack on stderr, then exit 1.
    "faulthandler.dump_traceback_later(45, exit=True)\n"
    "from pegaflow.proto import pegaflow_pb2 as pb, pegaflow_pb2_grpc as pbg\n"
    "def probe(channel):\n"
    "    stub = pbg.PegaFlowStub(channel)\n"
    "    for name, call, req in [\n"
    "        ('info', stub.ServerInfo, pb.ServerInfoRequest()),\n"
    "        ('query', stub.QueryPrefix, pb.QueryPrefixRequest(instance_id='tenant', "
    "block_hashes={wire!r})),\n"
    "        ('release', stub.ReleaseLease, pb.ReleaseLeaseRequest(lease_id=1)),\n"
    "    ]:\n"
    "        try:\n"
    "            r = call(req, timeout=10)\n"
    "            ready = getattr(getattr(r, 'ready', None), 'num_blocks', '')\n"
    "            print(name, 'OK', ready)\n"
    "        except grpc.RpcError as e:\n"
    "            print(name, e.code().name, e.details())\n"
    "    session = stub.Session(iter([pb.SessionPing(instance_id='tenant')]), "
    "timeout=10)\n"
    "    try:\n"
    "        print('session OK', len(list(session)))\n"
    "    except grpc.RpcError as e:\n"
    "        print('session', e.code().name, e.details())\n"
    # Every call object and grpc thread ends before the interpreter does: a
    # stream's __del__ at exit waited forever on a lock that one of grpc's
    # daemon threads took as finalization began (CI, 2026-12-06; ~1 in 1,500
    # probes on a loaded 2-core VM).
    "with grpc.insecure_channel({addr!r}) as channel:\n"
    "    probe(channel)\n"
    "for thread in threading.enumerate():\n"
    "    if thread is not threading.main_thread():\n"
    "        thread.join(30)\n"
)

# Many refused Session streams from another host, each after a refused unary
# call, with grpc's asyncio client (its own bound over each call): prints
# how many ended other than PERMISSION_DENIED, and the first few.
REFUSED_SESSIONS = (
    "import asyncio, grpc, sys\n"
    "from pegaflow.proto import pegaflow_pb2 as pb, pegaflow_pb2_grpc as pbg\n"
    "async def session(stub):\n"
    "    call = stub.Session(iter([pb.SessionPing(instance_id='tenant')]), "
    "timeout=10)\n"
    "    try:\n"
    "        return 'OK %d' % len([r async for r in call])\n"
    "    except grpc.RpcError as e:\n"
    "        return f'{{e.code().name}} {{e.details()}}'\n"
    "async def main(n):\n"
    "    other = []\n"
    "    async with grpc.aio.insecure_channel({addr!r}) as channel:\n"
    "        stub = pbg.PegaFlowStub(channel)\n"
    "        for _ in range(n):\n"
    "            try:\n"
    "                await stub.ReleaseLease(pb.ReleaseLeaseRequest(lease_id=1), "
    "timeout=10)\n"
    "            except grpc.RpcError:\n"
    "                pass\n"
    "            got = await asyncio.wait_for(session(stub), 15)\n"
    "            if not got.startswith('PERMISSION_DENIED'):\n"
    "                other.append(got)\n"
    "    print(len(other), other[:3])\n"
    "asyncio.run(main(int(sys.argv[1])))\n"
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


def _probe(node: Node | None, addr: str, wire: list[bytes]) -> dict[str, str]:
    code = PROBE.format(addr=addr, wire=wire)
    argv = [sys.executable, "-c", code]
    out = subprocess.run(
        node.argv(*argv) if node else argv,
        capture_output=True, text=True, env=_env(), cwd=ROOT, timeout=60,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    return dict(line.split(" ", 1) for line in out.stdout.splitlines())


@contextlib.contextmanager
def routable_server(ns: Netns, tmp_path: Path, *args: str) -> Iterator[ServerProc]:
    """A server on the bridge's address: routable, not loopback."""
    server = start_server(
        tmp_path, "--pool-size", "16mb", "--addr", f"{ns.host_address}:0", *args
    )
    try:
        yield server
    finally:
        server.stop()


def test_another_host_gets_server_info_and_nothing_else(net, tmp_path) -> None:
    ns, node = net
    with routable_server(ns, tmp_path) as server, tenant(server) as wire:
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
        for call in ("release", "session"):  # past the gate, to the engine's checks
            assert "--allow-remote-engines" not in here[call], here


def test_refused_session_streams_end_with_permission_denied(net, tmp_path) -> None:
    """Regression (2026-12-04, a CI run): the gate refused another host's
    Session stream before reading it, so the stream ended while the client
    was still sending its ping; ~7 % of 2,000 such refusals reached the
    client as INTERNAL ("Internal error from Core"), and a sync client's
    refused Session hung past its 10 s deadline once. The gate now reads
    what the client sends first (bounded): 500 refusals in a row, every one
    PERMISSION_DENIED."""
    ns, node = net
    with routable_server(ns, tmp_path) as server, tenant(server):
        code = REFUSED_SESSIONS.format(addr=server.addr)
        out = subprocess.run(
            node.argv(sys.executable, "-c", code, "500"),
            capture_output=True, text=True, env=_env(), cwd=ROOT, timeout=120,
        )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("0 []"), out.stdout


def test_allow_remote_engines_lets_another_host_query(net, tmp_path) -> None:
    ns, node = net
    with (
        routable_server(ns, tmp_path, "--allow-remote-engines") as server,
        tenant(server) as wire,
    ):
        assert _probe(node, server.addr, wire)["query"] == "OK 4"  # the operator's call


@needs_root
def test_another_user_of_this_host_is_looked_up_on_its_routable_address(
    net, tmp_path
) -> None:
    """The sixth session's uid check, reached around through the host's own
    routable address instead of loopback: looked up there too now."""
    ns, _ = net
    with routable_server(ns, tmp_path) as server, tenant(server) as wire:
        assert_only_the_owner_queries(server.addr, wire)
