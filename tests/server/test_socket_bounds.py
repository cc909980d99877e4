"""The unix socket cannot be used to exhaust the server (issue: trust, bounded
resources). The probes that found it: 10 connections each sending a 59 MiB
partial frame took server RSS from 138 to 724 MiB, and the receive buffer was
re-copied on every read; a client of another protocol version was answered as
if it spoke ours."""

from __future__ import annotations

import contextlib
import fcntl
import itertools
import os
import resource
import signal
import socket
import struct
import termios
import threading
import time
from collections.abc import Iterator

import grpc
import numpy as np
import pytest

from pegaflow.client.host_share import whole_pages
from pegaflow.client.pegaflow_client import PegaflowClient
from pegaflow.client.registration_messages import allow_ptrace_from, host_request
from pegaflow.common.errors import PegaflowError
from pegaflow.common.share_frames import (
    READY,
    SHARE_READY,
    ShareRequest,
    ShareSpan,
    encode_share,
)
from pegaflow.common.socket_frames import (
    HELLO_HEADER,
    LOAD_REPLY,
    MAX_BODY,
    QUERY_REPLY,
    REGISTER_REPLY,
    encode_hello,
    encode_load,
    encode_query,
    encode_register,
    encode_save,
    load_reply_size,
)
from pegaflow.server.socket_service import (
    BACKLOG_BUDGET,
    FRAME_TIMEOUT_S,
    HELLO_TIMEOUT_S,
    WRITE_HIGH_BYTES,
)
from tests.kvbuf import LocalKV, hashes
from tests.procs import HOST_ONLY, ServerProc, start_server, wait_until
from tests.socket_tools import greeted


@pytest.fixture
def server(tmp_path) -> Iterator[ServerProc]:
    proc = start_server(tmp_path, "--pool-size", "16mb", *HOST_ONLY)
    yield proc
    proc.stop()


def _rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def _socket_path(server: ServerProc) -> str:
    with PegaflowClient(server.addr) as client:
        return client._server_info().socket_path


def _reply(sock: socket.socket) -> bytes:
    out = b""
    while chunk := sock.recv(65536):
        out += chunk
    return out


def test_oversized_frames_are_refused_before_buffering(server) -> None:
    """Scenario: ten connections announce 59 MiB frames and send half of each.
    Each is refused on its header (nothing buffered) and RSS stays flat."""
    path = _socket_path(server)
    before = _rss_mib(server.pid)
    socks = [greeted(path) for _ in range(10)]
    try:
        for sock in socks:
            sock.sendall((59 << 20).to_bytes(4, "little"))
            with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                sock.sendall(bytes(1 << 20))  # refused already: may not get in
        for sock in socks:
            reply = _reply(sock)
            assert reply[0] == grpc.StatusCode.INVALID_ARGUMENT.value[0]
            assert f"> {MAX_BODY}".encode() in reply
    finally:
        for sock in socks:
            sock.close()
    assert _rss_mib(server.pid) - before < 64


def test_slow_partial_frames_are_bounded(server) -> None:
    """Scenario: twenty connections each trickle a frame just under the size
    cap in 64 KiB pieces and never finish it. Buffering is linear and the
    server-wide budget of partial frames refuses the connections past it, so
    RSS grows by at most about that budget; the server keeps serving."""
    path = _socket_path(server)
    before = _rss_mib(server.pid)
    size = MAX_BODY - 1024
    socks = [greeted(path) for _ in range(20)]
    refused = 0
    try:
        for sock in socks:
            sock.sendall(size.to_bytes(4, "little"))
        piece = bytes(64 << 10)
        for _ in range((size - (64 << 10)) // len(piece)):
            for sock in socks:
                with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                    sock.sendall(piece)
        time.sleep(0.5)  # let the server read what is in flight
        kv = LocalKV(1, 8, 4096)
        with PegaflowClient(server.addr) as client:
            kv.register(client, "e", "ns")
            hs = hashes(2)
            assert client.save("e", [0, 1], hs).stored == 2
            assert client.query("e", hs).num_blocks == 2
        growth = _rss_mib(server.pid) - before
        for sock in socks:
            sock.setblocking(False)
            try:
                head = sock.recv(1)
            except BlockingIOError:
                continue
            refused += head == bytes([grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]])
    finally:
        for sock in socks:
            sock.close()
    assert refused >= 1  # 20 x ~8 MiB is past the 128 MiB budget
    assert growth < 128 + 64, growth


def test_a_client_of_another_protocol_is_refused_clearly(server) -> None:
    """Scenario: an engine with an older pegaflow (no hello) or another
    protocol version gets FAILED_PRECONDITION / INVALID_ARGUMENT saying so,
    never a misread answer."""
    path = _socket_path(server)
    with socket.socket(socket.AF_UNIX) as sock:  # version 1: a query first
        sock.settimeout(10)
        sock.connect(path)
        body = struct.pack("<BBHI", 1, 32, 1, 0) + b"e"
        sock.sendall(len(body).to_bytes(4, "little") + body)
        reply = _reply(sock)
    assert b"first frame must be a hello" in reply
    with socket.socket(socket.AF_UNIX) as sock:
        sock.settimeout(10)
        sock.connect(path)
        hello = HELLO_HEADER.pack(0, 0, 99)
        sock.sendall(len(hello).to_bytes(4, "little") + hello)
        reply = _reply(sock)
    assert reply[0] == grpc.StatusCode.FAILED_PRECONDITION.value[0]
    assert b"hello.version: 99" in reply


def test_a_client_that_never_reads_its_replies_stops_being_read(server) -> None:
    """Scenario: a client pipelines batch loads whose replies are large (an
    error line per unknown lease: ~280 KiB a reply) and never reads them. Once
    16 MiB of replies wait, the server stops reading that connection, so the
    client's sends stall instead of the server's memory growing (before: every
    frame was read and answered into an unbounded write buffer)."""
    kv = LocalKV(1, 8, 4096)
    with PegaflowClient(server.addr) as client:
        kv.register(client, "e", "ns")
        token = client._token("e", 0)
    items = [(2 * i + 3, 0, np.array([0])) for i in range(4000)]  # the most: 4080
    frame = encode_load("e", 0, items, True, token=token)
    assert frame is not None
    before = _rss_mib(server.pid)
    sock = greeted(_socket_path(server))
    sock.settimeout(5)
    sent = 0
    try:
        for _ in range(600):  # 600 x 80 KiB of frames, ~170 MiB of replies
            try:
                sock.sendall(frame)
            except TimeoutError:
                break
            sent += 1
        time.sleep(1)  # what it read is answered meanwhile
        growth = _rss_mib(server.pid) - before
    finally:
        sock.close()
    assert sent < 200, sent
    assert growth < 100, growth
    with PegaflowClient(server.addr) as client:  # and it serves others still
        kv.register(client, "f", "ns")
        assert client.save("f", [0, 1], hashes(2)).stored == 2


def test_a_full_socket_names_itself_to_a_registering_engine(server) -> None:
    """Scenario: 1,024 open connections take every socket slot; a new host
    engine was told "host-memory registration over TCP is refused" (its
    client fell back to gRPC) instead of the real cause. It must hear that
    the socket is full, and register once a slot is free again."""
    path = _socket_path(server)
    held = []
    try:
        for _ in range(1024):
            sock = socket.socket(socket.AF_UNIX)
            sock.connect(path)
            held.append(sock)
            # greeted (its reply unread): idle, never timed out as a silent one is
            sock.sendall(encode_hello())
        kv = LocalKV(layers=2, blocks=4, page=4096)
        with PegaflowClient(server.addr) as client, pytest.raises(PegaflowError) as err:
            kv.register(client, "late", "ns-late")
        message = str(err.value)
        assert "RESOURCE_EXHAUSTED" in message and "more than 1024" in message, message
        assert "over TCP" not in message, message
    finally:
        for sock in held:
            sock.close()
    deadline = time.monotonic() + 10
    while True:  # the server sees the closes on its loop
        try:
            with PegaflowClient(server.addr) as client:
                kv.register(client, "late", "ns-late")
            break
        except Exception:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def test_a_connection_that_never_completes_its_hello_is_closed(server) -> None:
    """Scenario: one client connects and sends nothing, another half a hello.
    Each held its connection slot for ever; now each is told why
    (DEADLINE_EXCEEDED naming the hello) and closed HELLO_TIMEOUT_S in."""
    path = _socket_path(server)
    silent, half = socket.socket(socket.AF_UNIX), socket.socket(socket.AF_UNIX)
    start = time.monotonic()
    try:
        for sock in (silent, half):
            sock.settimeout(HELLO_TIMEOUT_S + 10)
            sock.connect(path)
        half.sendall(encode_hello()[:6])
        for sock in (silent, half):
            reply = _reply(sock)  # to the server's close
            assert reply[0] == grpc.StatusCode.DEADLINE_EXCEEDED.value[0], reply
            assert f"hello: none within {HELLO_TIMEOUT_S:g} s".encode() in reply
        assert time.monotonic() - start >= HELLO_TIMEOUT_S - 0.5
    finally:
        silent.close()
        half.close()


def test_a_frame_begun_must_finish_but_an_idle_engine_stays(server) -> None:
    """Scenario: an engine connection idles between requests while another
    client sends a frame's header and 10 of its 100 body bytes, then nothing.
    The half frame held its connection and buffer for ever; now that client is
    told so (DEADLINE_EXCEEDED) and closed FRAME_TIMEOUT_S in, while the idle
    engine, idle longer than that, is still served."""
    kv = LocalKV(1, 8, 4096)
    hs = hashes(2)
    with PegaflowClient(server.addr) as client:
        kv.register(client, "e", "ns")
        assert client.save("e", [0, 1], hs).stored == 2
    path = _socket_path(server)
    idle = greeted(path)
    stuck = greeted(path)
    stuck.settimeout(FRAME_TIMEOUT_S + 10)
    try:
        start = time.monotonic()
        stuck.sendall((100).to_bytes(4, "little") + bytes(10))
        reply = _reply(stuck)
        assert reply[0] == grpc.StatusCode.DEADLINE_EXCEEDED.value[0], reply
        assert b"frame: 14 of its 104 B arrived within" in reply, reply
        assert time.monotonic() - start >= FRAME_TIMEOUT_S - 0.5
        frame = encode_query("e", hs)
        assert frame is not None
        idle.sendall(frame)
        got = idle.recv(QUERY_REPLY.size, socket.MSG_WAITALL)
        assert QUERY_REPLY.unpack(got)[:2] == (0, 2)
    finally:
        idle.close()
        stuck.close()


def _unread_by_peer(sock: socket.socket) -> int:
    """Bytes this end sent that the peer has not read yet (SIOCOUTQ: on a
    unix stream socket they stay charged to the sender until read)."""
    buf = fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, b"\0\0\0\0")
    return int.from_bytes(buf, "little")


def test_a_frame_the_server_was_too_stalled_to_read_is_not_timed_out(
    server,
) -> None:
    """Scenario (a review's): an engine sends a 1 MiB save frame in one
    sendall; the server reads its first part, then stops running for longer
    than FRAME_TIMEOUT_S (SIGSTOP: an overloaded host, long work on its
    loop). Its frame timer counted that stall: at the first read after it
    the frame was refused as sent too slowly, though its bytes had waited in
    the kernel all along. Now the server answers the save."""
    kv = LocalKV(1, 8, 4096)
    with PegaflowClient(server.addr) as client:
        kv.register(client, "e", "ns")
        token = client._token("e", 0)
    n = 16384  # 64-B hashes: ~1.1 MiB, several reads of the server's
    hs = [os.urandom(64) for _ in range(n)]
    frame = encode_save("e", 0, np.zeros(n, np.int64), hs, [], 0, token=token)
    first = 64 << 10
    sock = greeted(_socket_path(server))
    sock.settimeout(FRAME_TIMEOUT_S + 30)
    sender = None
    try:
        sock.sendall(frame[:first])
        assert wait_until(lambda: _unread_by_peer(sock) == 0)  # read: timer armed
        os.kill(server.pid, signal.SIGSTOP)
        sender = threading.Thread(target=sock.sendall, args=(frame[first:],))
        sender.start()
        time.sleep(FRAME_TIMEOUT_S + 0.5)
    finally:
        os.kill(server.pid, signal.SIGCONT)
    try:
        head = sock.recv(5, socket.MSG_WAITALL)
        assert len(head) == 5, head
        body = sock.recv(int.from_bytes(head[1:5], "little"), socket.MSG_WAITALL)
        assert b"a frame must be sent whole" not in body, body
        assert head[0] != grpc.StatusCode.DEADLINE_EXCEEDED.value[0], body
    finally:
        sender.join(10)
        sock.close()


def test_clients_that_never_read_are_bounded_over_all_connections(server) -> None:
    """Scenario: 24 connections each pipeline batch loads with ~280 KiB error
    replies and never read them. Each stops being read at 16 MiB of replies,
    but together they held 24 x 16 MiB: nothing bounded the sum. Now the
    connection that pipelines past BACKLOG_BUDGET over all connections is
    refused (RESOURCE_EXHAUSTED, counted by reason), the server's memory stays
    near the budget, and an engine that reads its replies is served."""
    kv = LocalKV(1, 8, 4096)
    with PegaflowClient(server.addr) as client:
        kv.register(client, "e", "ns")
        token = client._token("e", 0)
    items = [(2 * i + 3, 0, np.array([0])) for i in range(4000)]
    frame = encode_load("e", 0, items, True, token=token)
    assert frame is not None
    path = _socket_path(server)
    with greeted(path) as probe:  # one reply's size
        probe.sendall(frame)
        reply = bytearray(probe.recv(LOAD_REPLY.size, socket.MSG_WAITALL))
        while len(reply) < (size := load_reply_size(reply)):
            reply += probe.recv(size - len(reply))
    per_conn = WRITE_HIGH_BYTES // len(reply) + 2  # one past the pause
    before = _rss_mib(server.pid)
    socks = [greeted(path) for _ in range(24)]
    try:
        for sock in socks:
            sock.settimeout(10)
            with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                for _ in range(per_conn):
                    sock.sendall(frame)
        assert wait_until(
            lambda: server.metric("pegaflow_socket_refusals_total", 'reason="backlog"')
        )
        growth = _rss_mib(server.pid) - before
        with PegaflowClient(server.addr) as client:  # reads its replies: served
            kv.register(client, "f", "ns")
            assert client.save("f", [0, 1], hashes(2)).stored == 2
    finally:
        for sock in socks:
            sock.close()
    assert growth < BACKLOG_BUDGET / (1 << 20) + 100, growth


def test_requests_queued_by_a_client_that_left_are_dropped(server) -> None:
    """Scenario: a host engine sends a share (whose descriptor the server then
    waits for) and a save behind it, and closes its connection on READY. The
    save still ran, copying for no one; now the share ends (its descriptor
    never came) and the save is dropped undone, counted as such."""
    kv = LocalKV(1, 8, 4096)
    hs = hashes(2)
    with PegaflowClient(server.addr) as client:
        kv.register(client, "e", "ns")
        token = client._token("e", 0)
        spans = tuple(ShareSpan(a, 0, n) for a, n in whole_pages(kv.mem.regions))
        share = encode_share(ShareRequest("e", 0, spans[:1], 0, token))
        save = encode_save("e", 0, np.array([0, 1]), hs, [], 0, token=token)
        assert save is not None
        sock = greeted(_socket_path(server))
        try:
            sock.sendall(share + save)
            ready = sock.recv(SHARE_READY.size, socket.MSG_WAITALL)
            assert SHARE_READY.unpack(ready) == (0, READY)
        finally:
            sock.close()
        assert wait_until(
            lambda: server.metric("pegaflow_socket_dropped_requests_total") == 1
        )
        assert client.query("e", hs).num_blocks == 0  # the save never ran
        assert client.save("e", [0, 1], hs).stored == 2  # and could have


def _lowest_free_fd(pid: int) -> int:
    taken = {int(name) for name in os.listdir(f"/proc/{pid}/fd")}
    return next(fd for fd in itertools.count() if fd not in taken)


def test_a_share_without_a_descriptor_to_spare_leaves_the_connection_working(
    server,
) -> None:
    """Scenario: every descriptor the server may open is in use (its soft
    RLIMIT_NOFILE, e.g. 1024 with as many connections) when an engine shares
    its memfd. The server paused reading, sent READY, then failed to dup the
    connection: the engine got INTERNAL and the connection was never read
    again, so its next request hung. Now the share is refused before READY
    (RESOURCE_EXHAUSTED naming share.fd) and the connection goes on working."""
    kv = LocalKV(1, 8, 4096)
    hs = hashes(2)
    with PegaflowClient(server.addr) as client:
        kv.register(client, "e", "ns")
        token = client._token("e", 0)
        assert client.save("e", [0, 1], hs).stored == 2
        spans = tuple(ShareSpan(a, 0, n) for a, n in whole_pages(kv.mem.regions))
        share = encode_share(ShareRequest("e", 0, spans[:1], 0, token))
        query = encode_query("e", hs)
        assert query is not None
        sock = greeted(_socket_path(server))
        limit = original = resource.prlimit(server.pid, resource.RLIMIT_NOFILE)
        try:
            # As low as the descriptors the idle server holds: a dup fails.
            while (low := _lowest_free_fd(server.pid)) != limit[0]:
                limit = (low, limit[1])
                resource.prlimit(server.pid, resource.RLIMIT_NOFILE, limit)
            sock.sendall(share)
            head = sock.recv(5, socket.MSG_WAITALL)
            assert head != SHARE_READY.pack(0, READY), "READY: the dup succeeded"
            length = int.from_bytes(head[1:5], "little")
            message = sock.recv(length, socket.MSG_WAITALL)
        finally:
            resource.prlimit(server.pid, resource.RLIMIT_NOFILE, original)
        try:
            assert head[0] == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0], message
            assert message.startswith(b"share.fd: the server cannot take"), message
            sock.sendall(query)
            got = sock.recv(QUERY_REPLY.size, socket.MSG_WAITALL)
            assert QUERY_REPLY.unpack(got)[:2] == (0, 2)
        finally:
            sock.close()


def test_a_registration_without_a_descriptor_to_spare_is_refused_clearly(
    server,
) -> None:
    """Scenario: the server may open one descriptor more when a host engine
    registers (its connection's SO_PEERPIDFD takes it and gives it back). The
    pidfd of the engine then took it and /proc/<pid> found none: the engine got
    INTERNAL, and pidfd_open out of descriptors had answered "no pidfds on this
    kernel", checking by the bare pid. Now the registration is refused
    (RESOURCE_EXHAUSTED naming regions.host.pid and why), the server logs it and
    registers the engine once it may open descriptors again."""
    kv = LocalKV(1, 8, 4096)
    req = host_request("e", "ns", os.getpid(), kv.mem.regions, kv.mem.layers)
    frame = encode_register(req.SerializeToString(), 0)
    allow_ptrace_from(server.pid)
    sock = greeted(_socket_path(server))
    limit = original = resource.prlimit(server.pid, resource.RLIMIT_NOFILE)
    try:
        while (low := _lowest_free_fd(server.pid)) + 1 != limit[0]:
            limit = (low + 1, limit[1])
            resource.prlimit(server.pid, resource.RLIMIT_NOFILE, limit)
        sock.sendall(frame)
        head = sock.recv(5, socket.MSG_WAITALL)
        message = sock.recv(int.from_bytes(head[1:5], "little"), socket.MSG_WAITALL)
    finally:
        resource.prlimit(server.pid, resource.RLIMIT_NOFILE, original)
    try:
        assert head[0] == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0], message
        want = b"regions.host.pid: the server cannot open a descriptor for process "
        assert message.startswith(want), message
        assert b"Too many open files" in message, message
        sock.sendall(frame)  # the same connection, descriptors to spare again
        head = sock.recv(REGISTER_REPLY.size, socket.MSG_WAITALL)
        assert REGISTER_REPLY.unpack(head)[0] == 0, head
    finally:
        sock.close()
    assert "cannot open a descriptor for process" in server.log.read_text()
