"""A registered engine process that executes another program (issue 30 #1).

The server checks who owns a host engine's memory once, at registration, and
then copies with process_vm_readv/writev by pid. Before the fix nothing was
checked again: uid 65534 registered its own buffer over TCP
(--allow-tcp-host-engines, root server), saved, then exec'd a setuid-root
program mapping the same address, and a sibling holding the owner token read
the program's memory with a save and wrote into it with a load. Now every copy
first checks that the process still runs the program, and holds the rights,
it registered with (pegaflow.common.pidfds.ProcessImage); one that exec'd or
changed credentials loses its registration and nothing is copied.

The setuid-root program is built here with the C compiler (Linux ignores the
setuid bit of scripts) from exec_helper.c: a tiny one that maps a secret at a
given address and reports, when its stdin closes, whether those bytes were
written.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest

from pegaflow.client.pegaflow_client import PegaflowClient
from pegaflow.common.errors import PegaflowError, from_status
from pegaflow.common.socket_frames import SAVE_REPLY, encode_save
from tests.kvbuf import LocalKV, hashes
from tests.procs import ROOT, ServerProc, _env, start_server
from tests.server.test_trust import NOBODY, _run_as, needs_root

PAGE, BLOCKS = 4096, 16
SIZE = PAGE * BLOCKS
ADDR = 0x6E0000000000  # far from where a fresh image maps anything (x86-64, arm64)
H0, H1 = (bytes([i]) * 16 for i in (0xA0, 0xA1))

HELPER_C = Path(__file__).with_name("exec_helper.c")

# The engine: maps its KV buffer at ADDR, registers it over loopback gRPC,
# saves block 0, prints its owner token, then goes on as `then` says: becomes
# the helper program (BECOME_HELPER), or stays itself (NOT_DUMPABLE).
# Both engines' KV buffer, mapped at ADDR (MAP_FIXED_NOREPLACE), and its
# RegisterInstanceRequest.
BUFFER = """
libc = ctypes.CDLL(None)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int,
                      ctypes.c_int, ctypes.c_int, ctypes.c_long)
assert libc.mmap({addr}, {size}, 3, 0x22 | 0x100000, -1, 0) == {addr}
ctypes.memset({addr}, 0x11, {size})
req = pb.RegisterInstanceRequest(
    instance_id='eng', namespace='ns', tp_size=1, world_size=1, device='cpu',
    regions=[pb.MemoryRegion(host=pb.HostRegion(
        pid=os.getpid(), address={addr}, size={size}))],
    layers=[pb.LayerLayout(num_blocks={blocks}, block_stride={page},
                           segments=[pb.Segment(size={page})])])
"""
ENGINE = """
import ctypes, sys
{buffer}stub = pbg.PegaFlowStub(grpc.insecure_channel({grpc_addr!r}))
token = stub.RegisterInstance(req, timeout=10).owner_token
save = pb.SaveRequest(instance_id='eng', block_ids=[0], block_hashes=[{h0!r}],
                      owner_token=token)
print(token.hex(), stub.Save(save, timeout=10).stored, flush=True)
{then}
"""
BECOME_HELPER = "os.execv({helper!r}, [{helper!r}, hex({addr}), str({size})])"
# A child sharing the address space (clone(CLONE_VM), running libc's pause()
# on a stack of its own), so that the engine's old address space lives on
# after its exec: only the credential half of the check can see that one.
SHARE_THEN = """
stack = ctypes.create_string_buffer(1 << 16)
libc.clone.argtypes = (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int,
                       ctypes.c_void_p)
pause = ctypes.cast(libc.pause, ctypes.c_void_p)
sharer = libc.clone(pause, ctypes.addressof(stack) + (1 << 16) - 64,
                    0x100 | 17, None)  # CLONE_VM | SIGCHLD
print('sharer', sharer, flush=True)
"""
# PR_SET_DUMPABLE 0 (/proc/<pid>'s files are root's from now on, as after a
# setuid program's exec), then a secret in the buffer, checked at the end.
NOT_DUMPABLE = """
libc.prctl(4, 0)
ctypes.memset({addr}, 0x5A, {size})
print('ready not-dumpable', flush=True)
sys.stdin.read()
same = ctypes.string_at({addr}, {size}) == bytes([0x5A]) * {size}
print('intact' if same else 'written')
"""

# The sibling: holds the owner token (here, on its command line) and asks for
# the copies, in the order given.
SIBLING = """
token = bytes.fromhex({token!r})
stub = pbg.PegaFlowStub(grpc.insecure_channel({grpc_addr!r}))
def ask(name, call, req):
    try:
        got = call(req, timeout=10)
        print(name, 'OK', getattr(got, 'stored', getattr(got, 'loaded', '')))
    except grpc.RpcError as e:
        print(name, e.code().name, e.details())
for op in {ops!r}:
    if op == 'save':
        ask('save', stub.Save, pb.SaveRequest(instance_id='eng', block_ids=[1],
            block_hashes=[{h1!r}], owner_token=token))
    else:
        hit = stub.QueryPrefix(pb.QueryPrefixRequest(instance_id='eng',
                               block_hashes=[{h0!r}]), timeout=10).ready
        assert hit.num_blocks == 1, hit
        ask('load', stub.Load, pb.LoadRequest(instance_id='eng',
            lease_id=hit.lease_id, block_ids=[0], owner_token=token))
"""


# The same engine on the unix socket, as the server's own user: registers and
# saves over raw frames, hands its connection (whose SO_PEERCRED names it) and
# token to the test on fd argv[1], then becomes the helper program.
SOCKET_ENGINE = """
import ctypes, os, socket, sys
import numpy as np
from pegaflow.common.socket_frames import (
    HELLO_REPLY, SAVE_REPLY, encode_hello, encode_register, encode_save)
from pegaflow.proto import pegaflow_pb2 as pb
from tests.server.test_exec_identity import exchange
{buffer}s = socket.socket(socket.AF_UNIX)
s.connect({path!r})
exchange(s, encode_hello(), HELLO_REPLY.size)
reply = exchange(s, encode_register(req.SerializeToString(), 0))
token = pb.RegisterInstanceResponse.FromString(reply[5:]).owner_token
frame = encode_save('eng', 0, np.array([0]), [{h0!r}], (), 0, 0, token)
assert SAVE_REPLY.unpack(exchange(s, frame, SAVE_REPLY.size))[1] == 1
socket.send_fds(socket.socket(fileno=int(sys.argv[1])), [token], [s.fileno()])
os.execv({helper!r}, [{helper!r}, hex({addr}), str({size})])
"""

needs_root_and_cc = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("cc") is None,
    reason="needs root (a setuid-root program, a process as uid 65534) and a C "
    "compiler (cc) to build that program",
)


def exchange(sock: socket.socket, frame: bytes, size: int | None = None) -> bytes:
    """One request frame on the socket and its reply (size None: a register
    reply, whose length follows its status); a typed error for an error."""
    sock.sendall(frame)
    head = _recv(sock, 5)
    length = int.from_bytes(head[1:5], "little")
    if head[0] != 0:
        code = next(c for c in grpc.StatusCode if c.value[0] == head[0])
        raise from_status(code, _recv(sock, length).decode())
    return head + _recv(sock, (5 + length if size is None else size) - 5)


def _recv(sock: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        assert chunk, "the server closed the socket"
        buf += chunk
    return buf


def _buffer() -> str:
    return BUFFER.format(addr=ADDR, size=SIZE, blocks=BLOCKS, page=PAGE)


def _prelude(uid: int) -> str:
    """tests/server/test_trust.py's _run_as prelude: import as root, drop to
    `uid`, dumpable again as a process that user started would be."""
    return (
        "import os, grpc, socket, numpy as np, pegaflow.proto.pegaflow_pb2 as pb, "
        "pegaflow.proto.pegaflow_pb2_grpc as pbg\n"
        "import grpc._channel, grpc._interceptor, grpc._utilities\n"
        "_warm = grpc.insecure_channel('127.0.0.1:1'); _warm.close()\n"
        f"os.setgroups([]); os.setgid({uid}); os.setuid({uid})\n"
        "import ctypes; ctypes.CDLL(None).prctl(4, 1)  # PR_SET_DUMPABLE\n"
    )


@pytest.fixture(scope="module")
def helper() -> Iterator[Path]:
    """The helper program, setuid root, in a directory every user may enter."""
    folder = Path(tempfile.mkdtemp(prefix="pegaflow-setuid-"))
    try:
        folder.chmod(0o755)
        out = folder / "helper"
        cc = subprocess.run(
            ["cc", "-O1", "-o", str(out), str(HELPER_C)],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert cc.returncode == 0, cc.stderr
        os.chown(out, 0, 0)
        out.chmod(0o4755)
        yield out
    finally:
        shutil.rmtree(folder)


@pytest.fixture
def server(tmp_path: Path) -> Iterator[ServerProc]:
    proc = start_server(tmp_path, "--pool-size", "16mb", "--allow-tcp-host-engines")
    yield proc
    proc.stop()


def _wait_ready(engine: subprocess.Popen, helper: Path) -> None:
    """Until the engine runs the helper program (with root's rights)."""
    ready = engine.stdout.readline().strip()
    if ready == f"ready euid={NOBODY}":
        pytest.skip(f"{helper.parent} is mounted nosuid: the program ran as {NOBODY}")
    assert ready == "ready euid=0", (ready, engine.stderr.read())


def _finish(engine: subprocess.Popen) -> None:
    """The helper's own verdict on its secret: never written."""
    engine.stdin.close()
    rc = engine.wait(30)
    assert (engine.stdout.read().strip(), rc) == ("intact", 0)


def _assert_nothing_copied(server: ServerProc) -> None:
    """Only the engine's own block 0, saved before the exec, ever moved, and
    the registration is gone."""
    assert server.metric("pegaflow_transfer_blocks_total", 'direction="save"') == 1
    assert server.metric("pegaflow_transfer_blocks_total", 'direction="load"') == 0
    assert server.metric("pegaflow_registered_workers") == 0
    assert server.metric("pegaflow_resident_blocks") == 1


@needs_root_and_cc
@pytest.mark.parametrize(
    "ops, share",
    [(("save", "save"), False), (("load", "save"), False), (("load", "save"), True)],
)
def test_setuid_exec_ends_the_registration_over_tcp(
    server: ServerProc, helper: Path, ops: tuple[str, str], share: bool
) -> None:
    """Scenario (issue 30 #1): uid 65534 registers its buffer over loopback
    TCP and saves block 0, then exec's a setuid-root program that maps a
    secret at the registered address. A sibling holding the owner token asks
    for a save (it read the secret) or a load (it wrote into the root
    process). Now the first copy is refused, naming the exec, the
    registration is gone (the next request is told so), and the root
    process's memory was neither read into the pool nor written. share: a
    clone(CLONE_VM) child keeps the old address space alive across the
    exec; the new program's rights (euid 0) give it away."""
    then = BECOME_HELPER.format(helper=str(helper), addr=ADDR, size=SIZE)
    engine = _engine_as_nobody(server, (SHARE_THEN if share else "") + then)
    sharer = 0
    try:
        token = _saved(engine)
        if share:
            tag, pid = engine.stdout.readline().split()
            assert tag == "sharer" and int(pid) > 0, (tag, pid)
            sharer = int(pid)
        _wait_ready(engine, helper)
        first = _sibling_asks(server, token, ops)
        assert f"process {engine.pid} executed a new program" in first, first
        if share:  # the address space lived on: the owner of /proc/<pid> told
            assert f"from uid {NOBODY} gid {NOBODY} to uid 0" in first, first
    finally:
        if sharer:
            os.kill(sharer, signal.SIGKILL)
        _finish(engine)
    _assert_nothing_copied(server)


@needs_root
def test_a_process_no_longer_dumpable_loses_its_registration(
    server: ServerProc,
) -> None:
    """The credential half of the check: an engine that makes itself not
    dumpable after registering (PR_SET_DUMPABLE 0, what a setuid program's
    exec does too, and the kernel's own ptrace test refuses) is not copied
    from any more; its address space is the same, so only the check of
    /proc/<pid>'s owner (root now) sees it."""
    engine = _engine_as_nobody(server, NOT_DUMPABLE.format(addr=ADDR, size=SIZE))
    try:
        token = _saved(engine)
        assert engine.stdout.readline().strip() == "ready not-dumpable"
        first = _sibling_asks(server, token, ("load", "save"))
        assert f"process {engine.pid} executed a new program or changed " in first
        assert f"from uid {NOBODY} gid {NOBODY} to uid 0" in first, first
    finally:
        _finish(engine)
    _assert_nothing_copied(server)


def _engine_as_nobody(server: ServerProc, then: str) -> subprocess.Popen:
    code = ENGINE.format(buffer=_buffer(), grpc_addr=server.addr, h0=H0, then=then)
    return subprocess.Popen(
        [sys.executable, "-c", _prelude(NOBODY) + code],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        env=_env(), cwd=ROOT, text=True,
    )  # fmt: skip


def _saved(engine: subprocess.Popen) -> str:
    """The engine's owner token, once it has registered and saved block 0."""
    token, stored = engine.stdout.readline().split() or ("", "")
    assert stored == "1", engine.stderr.read()
    return token


def _sibling_asks(server: ServerProc, token: str, ops: tuple[str, str]) -> str:
    """The sibling (uid 65534, the token in hand) asks for ops; the first is
    refused naming why, the second finds the registration gone. The first
    refusal's message."""
    sibling = SIBLING.format(
        token=token, grpc_addr=server.addr, ops=list(ops), h0=H0, h1=H1
    )
    out = _run_as(NOBODY, sibling)
    assert out.returncode == 0, out.stderr
    first, then = out.stdout.splitlines()
    assert first.startswith(f"{ops[0]} PERMISSION_DENIED"), out.stdout
    assert "its registration has ended" in first, first
    assert then.startswith("save FAILED_PRECONDITION"), out.stdout
    assert "is not registered" in then, then
    return first


@needs_root_and_cc
def test_exec_ends_the_registration_on_the_socket(
    server: ServerProc, helper: Path
) -> None:
    """The socket path: the kernel's pid check passes for every frame on the
    registering process's own connection, and that connection outlives an
    exec when another process holds it (inherited, or passed on as here).
    The engine registers and saves over the socket, passes the connection
    and token on, and exec's another program; the holder's save is refused
    naming the exec and the registration ends. (As the server's own user the
    exec gains no rights: the check is the same, and a server running as
    that user with CAP_SYS_PTRACE would otherwise copy into a setuid
    program's memory.)"""
    with PegaflowClient(server.addr) as client:
        path = client._server_info().socket_path
    mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    code = SOCKET_ENGINE.format(
        buffer=_buffer(), path=path, h0=H0, helper=str(helper), addr=ADDR, size=SIZE
    )
    engine = subprocess.Popen(
        [sys.executable, "-c", code, str(theirs.fileno())],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        env=_env(), cwd=ROOT, text=True, pass_fds=[theirs.fileno()],
    )  # fmt: skip
    theirs.close()
    try:
        mine.settimeout(60)
        token, fds, _, _ = socket.recv_fds(mine, 64, 1)
        assert fds, engine.stderr.read()
        conn = socket.socket(fileno=fds[0])
        assert engine.stdout.readline().strip() == "ready euid=0", engine.stderr.read()
        frame = encode_save("eng", 0, np.array([1]), [H1], (), 0, 0, token)
        with pytest.raises(PegaflowError) as err:
            exchange(conn, frame, SAVE_REPLY.size)
        msg = str(err.value)
        assert msg.startswith("PERMISSION_DENIED"), msg
        assert f"process {engine.pid} executed a new program" in msg, msg
        with pytest.raises(PegaflowError, match="is not registered"):
            exchange(conn, frame, SAVE_REPLY.size)
        conn.close()
    finally:
        mine.close()
        _finish(engine)
    _assert_nothing_copied(server)


def test_an_engine_that_runs_programs_keeps_its_registration(
    server: ServerProc,
) -> None:
    """No false positive: engines on the socket and over TCP, each saving and
    loading (every byte checked) over many rounds, layer by layer too, while
    the engine process starts other programs (fork + exec of a child is not
    an exec of the engine): every copy goes through."""
    kv = LocalKV(4, BLOCKS, PAGE, seed=3)
    signals = np.zeros(4, np.uint64)
    with PegaflowClient(server.addr) as sock, PegaflowClient(server.addr) as tcp:
        tcp.disable_socket()
        for client, name in ((sock, "s"), (tcp, "t")):
            client.register_host(
                name, f"ns-{name}", os.getpid(), kv.mem.regions, kv.mem.layers,
                layer_signals=signals.ctypes.data,
            )  # fmt: skip
        for i in range(60):
            client, name = (sock, "s") if i % 2 else (tcp, "t")
            kv.randomize([0, 1], seed=i)
            want = [kv.block(0), kv.block(1)]
            hs = hashes(2, prefix=f"{name}{i}".encode())
            assert client.save(name, [0, 1], hs).stored == 2
            subprocess.run(["true"], check=True, timeout=30)  # a child's exec
            hit = client.query(name, hs)
            assert hit.num_blocks == 2
            seq = i + 1 if i % 3 == 0 else 0  # every third load layer by layer
            assert client.load(name, hit.lease_id, [8, 9], layer_seq=seq).loaded == 2
            assert np.array_equal(kv.block(8), want[0])
            assert np.array_equal(kv.block(9), want[1])
            if seq:
                assert (signals == seq).all()
        assert server.metric("pegaflow_registered_workers") == 2
