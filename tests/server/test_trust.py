"""The server acts only for the process that is really asking (issue: trust).

Each test reproduces one probe that succeeded against the server before the
trust work: registering another process's memory, a thread id, a hijacked
instance id. The server runs as its own process; the "victims" are real
processes whose memory must stay untouched.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import threading
from collections.abc import Iterator

import grpc
import numpy as np
import pytest

from pegaflow.client.pegaflow_client import PegaflowClient
from pegaflow.common.errors import PegaflowError, PermissionDenied
from pegaflow.common.geometry import LayerLayout, Segment
from pegaflow.common.socket_frames import encode_register
from pegaflow.proto import pegaflow_pb2 as pb
from pegaflow.proto import pegaflow_pb2_grpc as pb_grpc
from tests.kvbuf import LocalKV, hashes
from tests.procs import ROOT, EngineProc, ServerProc, _env, start_server

PAGE, BLOCKS = 4096, 16
VICTIM = """
import sys
import numpy as np
secret = np.full({size}, 0x5A, np.uint8)
print(secret.ctypes.data, flush=True)
sys.stdin.read()  # live until the test closes our stdin
assert (secret == 0x5A).all(), "memory was written"
"""


@pytest.fixture
def server(tmp_path) -> Iterator[ServerProc]:
    proc = start_server(tmp_path, "--pool-size", "16mb")
    yield proc
    proc.stop()


class Victim:
    """Another process of this host holding a buffer of 0x5A bytes."""

    def __init__(self, user: int | None = None) -> None:
        code = VICTIM.format(size=PAGE * BLOCKS)
        self.proc = subprocess.Popen(
            [sys.executable, "-c", code],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=_env(),
            cwd=ROOT,
            user=user,
        )
        self.address = int(self.proc.stdout.readline())
        self.pid = self.proc.pid

    def close(self) -> int:
        """Exit code: nonzero if its buffer was written."""
        self.proc.stdin.close()
        return self.proc.wait(10)


def _layers() -> list[LayerLayout]:
    return [LayerLayout(0, 0, BLOCKS, PAGE, (Segment(0, PAGE),))]


def _host_request(instance: str, pid: int, address: int) -> pb.RegisterInstanceRequest:
    return pb.RegisterInstanceRequest(
        instance_id=instance,
        namespace="ns",
        tp_size=1,
        world_size=1,
        device="cpu",
        regions=[
            pb.MemoryRegion(
                host=pb.HostRegion(pid=pid, address=address, size=PAGE * BLOCKS)
            )
        ],
        layers=[
            pb.LayerLayout(
                num_blocks=BLOCKS,
                block_stride=PAGE,
                segments=[pb.Segment(offset=0, size=PAGE)],
            )
        ],
    )


def _grpc_code(server: ServerProc, request: object) -> tuple[grpc.StatusCode, str]:
    with grpc.insecure_channel(server.addr) as channel:
        try:
            pb_grpc.PegaFlowStub(channel).RegisterInstance(request, timeout=10)
        except grpc.RpcError as exc:
            return exc.code(), exc.details()
    return grpc.StatusCode.OK, ""


def test_registering_another_process_is_refused(server) -> None:
    """Scenario: a local client names another process's pid as its engine, to
    read that process's memory with a save and write it with a load. Refused on
    the socket (the kernel names the caller) and over TCP (no caller known)."""
    victim = Victim()
    try:
        with PegaflowClient(server.addr) as client:
            regions = [(victim.address, PAGE * BLOCKS)]
            with pytest.raises(PermissionDenied, match="not the calling process"):
                client.register_host("thief", "ns", victim.pid, regions, _layers())
        request = _host_request("thief", victim.pid, victim.address)
        code, details = _grpc_code(server, request)
        assert code == grpc.StatusCode.PERMISSION_DENIED
        assert (
            "over TCP is refused" in details and "--allow-tcp-host-engines" in details
        )
    finally:
        assert victim.close() == 0


def test_thread_ids_are_refused(server) -> None:
    """Scenario: registering a thread id (ours, or one of the server's own
    threads) passed the old "not the server's pid" check; through a server
    thread an outsider read and overwrote the pool."""
    kv = LocalKV(1, BLOCKS, PAGE)
    stop = threading.Event()
    thread = threading.Thread(target=stop.wait)
    thread.start()
    server_threads = [
        int(t) for t in os.listdir(f"/proc/{server.pid}/task") if int(t) != server.pid
    ]
    try:
        with PegaflowClient(server.addr) as client:
            tid = thread.native_id
            with pytest.raises(PermissionDenied, match="is a thread of process"):
                client.register_host("t", "ns", tid, kv.mem.regions, kv.mem.layers)
            with pytest.raises(PermissionDenied, match="the server itself"):
                client.register_host(
                    "t", "ns", server_threads[0], kv.mem.regions, kv.mem.layers
                )
            with pytest.raises(PermissionDenied, match="the server itself"):
                client.register_host(
                    "t", "ns", server.pid, kv.mem.regions, kv.mem.layers
                )
    finally:
        stop.set()
        thread.join()


def test_layer_signals_of_another_process_are_refused(server) -> None:
    """Scenario: the server writes load progress into layer_signals; naming
    another process there would let a client scribble into its memory."""
    victim = Victim()
    kv = LocalKV(1, BLOCKS, PAGE)
    try:
        with PegaflowClient(server.addr) as client:
            client.register_host("own", "ns", os.getpid(), *_mine(kv))
            req = _host_request("sig", os.getpid(), kv.mem.regions[0][0])
            req.layer_signals.pid = victim.pid
            req.layer_signals.address = victim.address
            frame = encode_register(req.SerializeToString(), 0)
            with pytest.raises(PermissionDenied, match="layer_signals.pid"):
                client._socket.connection().register(frame, 10)
    finally:
        assert victim.close() == 0


def _mine(kv: LocalKV) -> tuple:
    return kv.mem.regions, kv.mem.layers


def test_instance_ids_cannot_be_hijacked(server) -> None:
    """Scenario: a second process registered an instance id that a live engine
    holds, silently taking its saves and loads over; or unregistered it. Now
    the second registration is refused naming the holder, and saves, loads and
    unregisters of someone else's instance are refused; the owner is untouched."""
    owner = EngineProc()
    try:
        owner.call("init", layout="LBNHC", layers=2, blocks=16, heads=2,
                   block_size=4, head=64, seed=1)  # fmt: skip
        owner.call("register", addr=server.addr, instance="shared", namespace="ns")
        kv = LocalKV(2, 16, 1024, seed=5)
        hs = [h.hex() for h in hashes(4)]
        with PegaflowClient(server.addr) as intruder:
            with pytest.raises(PegaflowError, match=f"pid {owner.proc.pid}") as err:
                kv.register(intruder, "shared", "ns")
            assert err.value.args[0].startswith("FAILED_PRECONDITION")
            with pytest.raises(PermissionDenied, match="owner_token"):
                intruder.unregister("shared")
            kv.register(intruder, "mine", "ns-mine")
            intruder._tokens[("shared", 0)] = intruder._token("mine", 0)
            with pytest.raises(PermissionDenied):
                intruder.save("shared", [0, 1], [bytes.fromhex(h) for h in hs[:2]])
        assert owner.call("save", block_ids=[0, 1, 2, 3], hashes=hs)["stored"] == 4
        hit = owner.call("query", hashes=hs)
        assert hit["num_blocks"] == 4
        assert owner.call("load", lease_id=hit["lease_id"], block_ids=[8, 9, 10, 11])
        src = owner.call("digest", block_ids=[0, 1, 2, 3])["digests"]
        assert owner.call("digest", block_ids=[8, 9, 10, 11])["digests"] == src
    finally:
        owner.close()


def _run_as(uid: int, code: str) -> subprocess.CompletedProcess:
    """Python code run by a process that imported our packages as root, then
    dropped to `uid` (the interpreter itself lives under /root here), and made
    dumpable again as a process that user started would be (the kernel marks
    one that changed its uid not dumpable)."""
    # Everything the attack touches is imported while still root: the checkout
    # may be unreadable for the other uid (a 0700 temp dir in CI). The channel
    # object exists too, but connects only at its first call, as `uid`.
    prelude = (
        "import os, grpc, socket, numpy as np, pegaflow.proto.pegaflow_pb2 as pb, "
        "pegaflow.proto.pegaflow_pb2_grpc as pbg\n"
        "import grpc._channel, grpc._interceptor, grpc._utilities\n"
        "_warm = grpc.insecure_channel('127.0.0.1:1'); _warm.close()\n"
        f"os.setgroups([]); os.setgid({uid}); os.setuid({uid})\n"
        "import ctypes; ctypes.CDLL(None).prctl(4, 1)  # PR_SET_DUMPABLE\n"
    )
    return subprocess.run(
        [sys.executable, "-c", prelude + code],
        capture_output=True,
        text=True,
        env=_env(),
        cwd=ROOT,
        timeout=60,
    )


NOBODY = 65534
needs_root = pytest.mark.skipif(
    os.geteuid() != 0, reason="needs root to run a process as uid 65534"
)


@pytest.mark.skipif(
    os.geteuid() != 0, reason="needs root to run a process as uid 65534"
)
def test_another_user_cannot_register_a_root_process(tmp_path) -> None:
    """Scenario: user nobody, talking to a server running as root, registered a
    root process's pid as its engine and read a secret out of its memory. Now:
    the socket is the server's user's only, TCP refuses host memory, and with
    --allow-tcp-host-engines the loopback caller's uid must own the process."""
    server = start_server(tmp_path, "--pool-size", "16mb", "--allow-tcp-host-engines")
    victim = Victim()
    try:
        with PegaflowClient(server.addr) as client:
            info = client._server_info()
        request = _host_request("thief", victim.pid, victim.address)
        wire = request.SerializeToString()
        attack = (
            f"s = socket.socket(socket.AF_UNIX)\n"
            f"try:\n    s.connect({info.socket_path!r}); print('SOCKET-OPEN')\n"
            f"except PermissionError:\n    print('SOCKET-REFUSED')\n"
            f"req = pb.RegisterInstanceRequest.FromString({wire!r})\n"
            f"stub = pbg.PegaFlowStub(grpc.insecure_channel({server.addr!r}))\n"
            f"try:\n    stub.RegisterInstance(req, timeout=10); print('REGISTERED')\n"
            f"except grpc.RpcError as e:\n    print(e.code().name, e.details())\n"
        )
        out = _run_as(NOBODY, attack)
        assert out.returncode == 0, out.stderr
        assert "SOCKET-REFUSED" in out.stdout
        assert "PERMISSION_DENIED" in out.stdout, out.stdout
        assert f"runs as uid 0, the caller as uid {NOBODY}" in out.stdout
    finally:
        assert victim.close() == 0
        server.stop()


@pytest.mark.skipif(
    os.geteuid() != 0, reason="needs root to run a process as uid 65534"
)
def test_tcp_host_engines_of_the_callers_own_uid_are_accepted(tmp_path) -> None:
    """With --allow-tcp-host-engines a process registering its own memory over
    loopback TCP is accepted, as another uid too: the check is the kernel's uid
    of the connection against the process's, not the server's rights."""
    server = start_server(tmp_path, "--pool-size", "16mb", "--allow-tcp-host-engines")
    try:
        code = (
            f"buf = np.zeros({PAGE * BLOCKS}, np.uint8)\n"
            "req = pb.RegisterInstanceRequest(instance_id='own', namespace='ns', "
            "tp_size=1, world_size=1, device='cpu', regions=[pb.MemoryRegion("
            f"host=pb.HostRegion(pid=os.getpid(), address=buf.ctypes.data, "
            f"size={PAGE * BLOCKS}))], layers=[pb.LayerLayout(num_blocks={BLOCKS}, "
            f"block_stride={PAGE}, segments=[pb.Segment(size={PAGE})])])\n"
            f"stub = pbg.PegaFlowStub(grpc.insecure_channel({server.addr!r}))\n"
            "print(len(stub.RegisterInstance(req, timeout=10).owner_token))\n"
        )
        out = _run_as(NOBODY, code)
        assert out.returncode == 0, out.stderr
        assert out.stdout.strip() == "16"
    finally:
        server.stop()


def test_owner_token_of_the_registration_is_needed_over_grpc(server) -> None:
    """Scenario: over gRPC the server cannot see the caller; a Save naming a
    live instance without its owner token is refused."""
    kv = LocalKV(1, BLOCKS, PAGE)
    with PegaflowClient(server.addr) as client:
        client.register_host("e", "ns", os.getpid(), *_mine(kv))
        token = client._token("e", 0)
        assert len(token) == 16
        with grpc.insecure_channel(server.addr) as channel:
            stub = pb_grpc.PegaFlowStub(channel)
            save = pb.SaveRequest(instance_id="e", block_ids=[0], block_hashes=[b"h"])
            with pytest.raises(grpc.RpcError) as err:
                stub.Save(save, timeout=10)
            assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
            save.owner_token = token
            assert stub.Save(save, timeout=10).stored == 1
    assert np.count_nonzero(kv.buf) > 0  # unchanged source


@needs_root
def test_another_user_cannot_probe_an_instance_over_grpc(server) -> None:
    """Scenario: user nobody, over the loopback gRPC port, asked QueryPrefix
    of root's instance which blocks it holds (a cached prompt prefix is a
    secret) and took leases against that instance's cap. The unix socket
    refused that user (the kernel names it), gRPC answered. Now the
    loopback caller's uid is looked up there too."""
    with tenant(server) as wire:
        assert_only_the_owner_queries(server.addr, wire)


@contextlib.contextmanager
def tenant(server: ServerProc) -> Iterator[list[bytes]]:
    """root's instance 'tenant' holding four blocks: their hashes, while it
    stays registered."""
    owner = EngineProc()
    try:
        owner.call("init", layout="LBNHC", layers=2, blocks=16, heads=2,
                   block_size=4, head=64, seed=1)  # fmt: skip
        owner.call("register", addr=server.addr, instance="tenant", namespace="ns")
        hs = [h.hex() for h in hashes(4)]
        assert owner.call("save", block_ids=[0, 1, 2, 3], hashes=hs)["stored"] == 4
        yield [bytes.fromhex(h) for h in hs]
    finally:
        owner.close()


def assert_only_the_owner_queries(addr: str, wire: list[bytes]) -> None:
    """User nobody's QueryPrefix of 'tenant' over gRPC at `addr` is refused
    naming its uid; root's own answers."""
    probe = (
        f"stub = pbg.PegaFlowStub(grpc.insecure_channel({addr!r}))\n"
        "req = pb.QueryPrefixRequest(instance_id='tenant', "
        f"block_hashes={wire!r})\n"
        "try:\n    r = stub.QueryPrefix(req, timeout=10)\n"
        "    print('ANSWERED', r.ready.num_blocks, r.ready.lease_id)\n"
        "except grpc.RpcError as e:\n    print(e.code().name, e.details())\n"
    )
    out = _run_as(NOBODY, probe)
    assert out.returncode == 0, out.stderr
    assert "PERMISSION_DENIED" in out.stdout, out.stdout
    assert f"the caller is uid {NOBODY}" in out.stdout
    with grpc.insecure_channel(addr) as channel:
        req = pb.QueryPrefixRequest(instance_id="tenant", block_hashes=wire)
        got = pb_grpc.PegaFlowStub(channel).QueryPrefix(req, timeout=10)
    assert got.ready.num_blocks == 4
