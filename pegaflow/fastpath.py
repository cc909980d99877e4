"""Queries, saves and loads over a unix socket: the scheduler asks once per
waiting request per step and a worker saves and loads once per step; on the
machines we run on
a Python gRPC round trip costs ~1 ms against ~0.15 ms for a framed unix-socket
exchange (benchmarks/RESULTS.md). gRPC stays the reference API; the client uses
this path when the server named a socket at registration and it is reachable,
and falls back otherwise. Frames: pegaflow.frames.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import grpc
import numpy as np

from pegaflow import deadlines
from pegaflow.errors import (
    CopyFailed,
    InvalidRequest,
    Overloaded,
    PegaflowError,
    ProtocolMismatch,
    from_status,
)
from pegaflow.frames import (
    HELLO_REPLY,
    LOAD,
    LOAD_ITEM_REPLY,
    LOAD_REPLY,
    LOADING,
    MAX_BODY,
    PROTOCOL_VERSION,
    QUERY,
    QUERY_REPLY,
    REGISTER,
    REGISTER_REPLY,
    SAVE,
    SAVE_REPLY,
    decode_hello,
    decode_load,
    decode_query,
    decode_register,
    decode_save,
    encode_hello,
    error_reply,
    kind_of,
    load_reply,
    parse_load_reply,
    register_reply,
)
from pegaflow.identity import UNKNOWN, CallContext, Caller, unix_peer
from pegaflow.sockfile import bind_private_unix, unlink_if_ours

if TYPE_CHECKING:
    from pegaflow.engine import Engine

logger = logging.getLogger(__name__)

# Partial frames buffered over all connections at once; past it a connection
# that wants more is refused. A legitimate frame arrives whole within
# milliseconds, so this only bounds what slow or stuck senders can pin.
RECEIVE_BUDGET = 128 << 20
MAX_CONNECTIONS = 1024
REFUSED_LINGER_S = 2.0  # a refused connection drains this long, then closes


@dataclass(frozen=True, slots=True)
class SocketServerInfo:
    """What a registration over the socket answers with (as ServerInfo does)."""

    pid: int
    server_id: bytes
    path: str


@dataclass(slots=True)
class _Shared:
    """State of one socket server shared by its connections."""

    engine: Engine
    info: SocketServerInfo
    buffered: int = 0  # bytes of partial frames over all connections
    connections: int = 0


class _FastProtocol(asyncio.Protocol):
    """One engine connection. Queries are answered straight from the loop's read
    callback; a save, load or registration runs as a task, and frames behind it
    wait their turn, so replies leave in request order.

    The kernel names the peer (SO_PEERCRED) when it connects: that, not any
    field of a frame, is who the requests come from."""

    def __init__(self, shared: _Shared) -> None:
        self._shared = shared
        self._engine = shared.engine
        self._seconds = shared.engine.metrics.rpc_seconds
        self._ok_seconds = self._seconds.labels("QueryPrefix/unix", "OK")
        self._buf = bytearray()
        self._counted = 0  # of _buf, charged to the shared receive budget
        self._transport: asyncio.Transport | None = None
        self._caller = Caller("unix")
        self._greeted = False
        self._discard = False  # refused: the rest of the input is dropped
        self._queued: deque[bytes] = deque()
        self._task: asyncio.Task | None = None
        self._eof = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]
        self._shared.connections += 1
        if self._shared.connections > MAX_CONNECTIONS:
            self._refuse(Overloaded(f"connection: more than {MAX_CONNECTIONS} open"))
            return
        try:
            self._caller = unix_peer(transport.get_extra_info("socket"))
        except OSError as exc:  # no credentials: nothing may be trusted
            logger.warning("fast-path peer without credentials: %s", exc)

    def connection_lost(self, exc: Exception | None) -> None:
        self._shared.connections -= 1
        self._charge(0)

    def _refuse(self, exc: PegaflowError) -> None:
        """Answer with the error and stop. Whatever the peer still sends is
        read and dropped for a moment: closing with unread bytes would reset
        the connection and lose the error before the peer read it."""
        self._discard = True
        self._buf.clear()
        self._charge(0)
        self._transport.write(error_reply(exc))
        if self._transport.can_write_eof():
            self._transport.write_eof()
        asyncio.get_running_loop().call_later(REFUSED_LINGER_S, self._transport.close)

    def _charge(self, size: int) -> None:
        """Charge the shared budget for `size` bytes of partial frame."""
        self._shared.buffered += size - self._counted
        self._counted = size

    def data_received(self, data: bytes) -> None:
        if self._discard:
            return
        buf = self._buf
        buf += data  # amortised O(len(data)); frames are cut from the front
        at = 0
        try:
            while len(buf) - at >= 4:
                size = int.from_bytes(buf[at : at + 4], "little")
                if size > MAX_BODY:
                    self._refuse(InvalidRequest(f"frame: {size} B > {MAX_BODY}"))
                    return
                if len(buf) - at - 4 < size:
                    break
                self._dispatch(bytes(buf[at + 4 : at + 4 + size]))
                at += 4 + size
        except Exception:  # a broken connection must not take the server down
            logger.exception("fast-path connection failed")
            self._transport.close()
            return
        if at:
            del buf[:at]
        self._charge(len(buf))
        if self._shared.buffered > RECEIVE_BUDGET and buf:
            self._refuse(
                Overloaded(
                    f"frame: {self._shared.buffered} B of partial frames are "
                    f"buffered over all connections (at most {RECEIVE_BUDGET})"
                )
            )

    def eof_received(self) -> bool:
        """The engine is done sending; answer what is queued, then close."""
        self._eof = True
        return self._task is not None  # True keeps the transport open for now

    def _dispatch(self, body: bytes) -> None:
        if self._discard or self._transport.is_closing():
            return
        if not self._greeted:
            self._hello(body)
            return
        if not self._queued and body[:1] == bytes([QUERY]):
            self._transport.write(self._query(body))
            return
        self._queued.append(body)
        if self._task is None:
            self._task = asyncio.ensure_future(self._drain())

    def _hello(self, body: bytes) -> None:
        try:
            version = decode_hello(body)
        except PegaflowError as exc:
            self._refuse(exc)
            return
        if version != PROTOCOL_VERSION:
            self._refuse(
                ProtocolMismatch(
                    f"hello.version: {version}; this server speaks protocol "
                    f"{PROTOCOL_VERSION}: run the same pegaflow version on both sides"
                )
            )
            return
        self._greeted = True
        info = self._shared.info
        self._transport.write(HELLO_REPLY.pack(0, PROTOCOL_VERSION, info.server_id))

    async def _drain(self) -> None:
        try:
            while self._queued:
                reply = await self._answer(self._queued[0])
                self._queued.popleft()
                if not (self._discard or self._transport.is_closing()):
                    self._transport.write(reply)
        finally:
            self._task = None
            if self._eof:
                self._transport.close()

    async def _answer(self, body: bytes) -> bytes:
        try:
            kind = kind_of(body)
        except PegaflowError as exc:
            return error_reply(exc)
        if kind == QUERY:
            return self._query(body)
        return await self._guarded(kind, body)

    def _query(self, body: bytes) -> bytes:
        start = time.perf_counter()
        try:
            ident, hashes, hash_len, deadline_ns = decode_query(body)
            ctx = CallContext(self._caller, b"", deadlines.from_wire(deadline_ns))
            res = self._engine.query(ident, hashes, hash_len, ctx)
        except PegaflowError as exc:
            self._seconds.labels("QueryPrefix/unix", exc.code.name).observe(
                time.perf_counter() - start
            )
            return error_reply(exc)
        self._ok_seconds.observe(time.perf_counter() - start)
        status = LOADING if res.loading else 0
        return QUERY_REPLY.pack(status, res.num_blocks, res.lease_id, res.lease_ttl_s)

    def _register(self, body: bytes) -> bytes:
        from pegaflow.proto import pegaflow_pb2 as pb
        from pegaflow.service import register_response, spec_from_message

        request, deadline_ns = decode_register(body)
        deadlines.check(deadlines.from_wire(deadline_ns), "register")
        try:
            req = pb.RegisterInstanceRequest.FromString(request)
        except Exception:  # protobuf's DecodeError and friends: the client's
            raise InvalidRequest("register: not a RegisterInstanceRequest") from None
        if self._caller.pid == UNKNOWN:
            raise InvalidRequest("register: the kernel named no peer process")
        worker = self._engine.register(spec_from_message(req), self._caller)
        info = self._shared.info
        response = register_response(worker, info.pid, info.path)
        return register_reply(response.SerializeToString())

    async def _save(self, body: bytes) -> bytes:
        *args, event, deadline_ns, token = decode_save(body)
        ctx = CallContext(self._caller, token, deadlines.from_wire(deadline_ns))
        res = await self._engine.save(*args, event, ctx)
        return SAVE_REPLY.pack(0, res.stored, res.deduplicated, res.rejected)

    async def _load(self, body: bytes) -> bytes:
        *args, deadline_ns, token = decode_load(body)
        ctx = CallContext(self._caller, token, deadlines.from_wire(deadline_ns))
        got = await self._engine.load(*args, ctx)
        return load_reply(got.loaded, got.bytes, got.items)

    async def _guarded(self, kind: int, body: bytes) -> bytes:
        """As gRPC's interceptor: errors become statuses, a bug INTERNAL, and
        the server lives on; every request is timed."""
        method = _METHODS[kind]
        start, code = time.perf_counter(), "OK"
        try:
            if kind == REGISTER:
                return self._register(body)
            return await (self._save(body) if kind == SAVE else self._load(body))
        except PegaflowError as exc:
            code = exc.code.name
            return error_reply(exc)
        except Exception:
            code = "INTERNAL"
            logger.exception("%s failed", method)
            return error_reply(CopyFailed(f"{method.split('/')[0]}: internal error"))
        finally:
            self._seconds.labels(method, code).observe(time.perf_counter() - start)


_METHODS = {SAVE: "Save/unix", LOAD: "Load/unix", REGISTER: "RegisterInstance/unix"}


async def start_query_socket(
    path: str, engine: Engine, info: SocketServerInfo
) -> asyncio.AbstractServer:
    """Serve the socket's frames on `path` (mode 0600 from creation: the
    server's user only; pegaflow.sockfile refuses a path that is not a stale
    socket of ours)."""
    sock = bind_private_unix(path)
    loop = asyncio.get_running_loop()
    shared = _Shared(engine, info)
    try:
        return await loop.create_unix_server(lambda: _FastProtocol(shared), sock=sock)
    except BaseException:
        unlink_if_ours(path, sock)
        sock.close()
        raise


class FastPathClient:
    """Blocking client of the fast-path socket: one connection per calling
    thread (a worker's save must not hold up its load or a query), one request
    in flight on each. Every connection checks that the server behind the
    socket is the one the client asked over gRPC (its pid from the kernel, its
    random id from the hello), so a socket planted at that path gets nothing."""

    def __init__(
        self, path: str, timeout_s: float, server_id: bytes, server_pid: int
    ) -> None:
        self._path = path
        self._timeout_s = timeout_s
        self._server_id = server_id
        self._server_pid = server_pid
        self._local = threading.local()
        self._lock = threading.Lock()
        self._socks: list[socket.socket] = []
        self._closed = False
        self._conn()  # fail now when the socket cannot be reached

    def _conn(self) -> socket.socket:
        sock = getattr(self._local, "sock", None)
        if sock is None:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                sock.settimeout(self._timeout_s)
                sock.connect(self._path)
                self._greet(sock)
            except (OSError, PegaflowError):
                sock.close()
                raise
            with self._lock:
                if self._closed:
                    sock.close()
                    raise ConnectionError("fast-path client closed")
                self._socks.append(sock)
            self._local.sock = sock
        return sock

    def _greet(self, sock: socket.socket) -> None:
        peer = unix_peer(sock)
        if peer.pid != self._server_pid:
            raise ConnectionRefusedError(
                f"{self._path}: served by pid {peer.pid}, not the server "
                f"(pid {self._server_pid})"
            )
        sock.sendall(encode_hello())
        status, reply = self._read_reply(sock, HELLO_REPLY.size, None)
        _, version, server_id = HELLO_REPLY.unpack(reply)
        if server_id != self._server_id or version != PROTOCOL_VERSION:
            raise ConnectionRefusedError(f"{self._path}: another server's socket")

    def query(self, frame: bytes, wait_s: float) -> tuple[int, int, float, bool]:
        """(num_blocks, lease_id, lease_ttl_s, loading); typed exceptions for
        errors; OSError when the connection is broken, TimeoutError when no
        reply came within wait_s."""
        status, reply = self._exchange(frame, wait_s, QUERY_REPLY.size)
        _, n, lease, ttl = QUERY_REPLY.unpack(reply)
        return n, lease, ttl, status == LOADING

    def save(self, frame: bytes, wait_s: float) -> tuple[int, int, int]:
        """(stored, deduplicated, rejected)."""
        _, reply = self._exchange(frame, wait_s, SAVE_REPLY.size)
        return SAVE_REPLY.unpack(reply)[1:]

    def load(
        self, frame: bytes, wait_s: float
    ) -> tuple[int, int, list[tuple[int, int, str]]]:
        """(loaded, bytes, [(loaded, bytes, error)] per item)."""
        _, reply = self._exchange(frame, wait_s, LOAD_REPLY.size, _load_reply_size)
        return parse_load_reply(bytes(reply))

    def register(self, frame: bytes, wait_s: float) -> bytes:
        """The serialised RegisterInstanceResponse."""
        _, reply = self._exchange(frame, wait_s, REGISTER_REPLY.size, _register_size)
        return bytes(reply[REGISTER_REPLY.size :])

    def _exchange(
        self,
        frame: bytes,
        wait_s: float,
        ok_size: int,
        full_size: Callable[[bytearray], int] | None = None,
    ) -> tuple[int, bytearray]:
        sock = self._conn()
        try:
            sock.settimeout(max(wait_s, 1e-3))
            sock.sendall(frame)
            return self._read_reply(sock, ok_size, full_size)
        except OSError:  # an error reply leaves the connection usable
            self._forget(sock)  # half a reply may be left in it
            raise

    def _read_reply(
        self,
        sock: socket.socket,
        ok_size: int,
        full_size: Callable[[bytearray], int] | None,
    ) -> tuple[int, bytearray]:
        # Every reply is at least 5 bytes and the only one in flight on
        # this connection: the first recv (4 KiB) usually takes it whole.
        reply = self._recv(sock, 5, bytearray())
        status = reply[0]
        if status in (0, LOADING):
            reply = self._recv(sock, ok_size, reply)
            while full_size is not None and len(reply) < (n := full_size(reply)):
                reply = self._recv(sock, n, reply)
            return status, reply
        length = int.from_bytes(reply[1:5], "little")
        message = self._recv(sock, 5 + length, reply)[5:].decode(errors="replace")
        code = next((c for c in grpc.StatusCode if c.value[0] == status), None)
        raise from_status(code or grpc.StatusCode.UNKNOWN, message)

    @staticmethod
    def _recv(sock: socket.socket, n: int, buf: bytearray) -> bytearray:
        """Read until buf holds n bytes."""
        while len(buf) < n:
            chunk = sock.recv(max(n - len(buf), 4096))
            if not chunk:
                raise ConnectionError("fast-path socket closed by the server")
            buf += chunk
        return buf

    def _forget(self, sock: socket.socket) -> None:
        self._local.sock = None
        with self._lock:
            if sock in self._socks:
                self._socks.remove(sock)
        sock.close()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            socks, self._socks = self._socks, []
        for sock in socks:
            sock.close()


def _register_size(reply: bytearray) -> int:
    return REGISTER_REPLY.size + REGISTER_REPLY.unpack_from(reply)[1]


def _load_reply_size(reply: bytearray) -> int:
    """The whole load reply's length, as far as its first bytes tell."""
    _, _, _, n_items = LOAD_REPLY.unpack_from(reply)
    size = LOAD_REPLY.size + n_items * LOAD_ITEM_REPLY.itemsize
    if len(reply) < size:
        return size
    table = np.frombuffer(bytes(reply), LOAD_ITEM_REPLY, n_items, LOAD_REPLY.size)
    return size + int(table["error_len"].sum())
