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
from typing import TYPE_CHECKING

import grpc
import numpy as np

from pegaflow.errors import CopyFailed, InvalidRequest, PegaflowError, from_status
from pegaflow.frames import (
    LOAD_ITEM_REPLY,
    LOAD_REPLY,
    LOADING,
    MAX_BODY,
    QUERY,
    QUERY_REPLY,
    SAVE,
    SAVE_REPLY,
    decode_load,
    decode_query,
    decode_save,
    error_reply,
    kind_of,
    load_reply,
    parse_load_reply,
)
from pegaflow.sockfile import bind_private_unix, unlink_if_ours

if TYPE_CHECKING:
    from pegaflow.engine import Engine

logger = logging.getLogger(__name__)


class _FastProtocol(asyncio.Protocol):
    """One engine connection. Queries are answered straight from the loop's read
    callback; a save runs as a task, and frames behind it wait their turn, so
    replies leave in request order."""

    def __init__(self, engine: Engine) -> None:
        self._engine = engine
        self._seconds = engine.metrics.rpc_seconds
        self._ok_seconds = self._seconds.labels("QueryPrefix/unix", "OK")
        self._buf = bytearray()
        self._transport: asyncio.Transport | None = None
        self._queued: deque[bytes] = deque()
        self._task: asyncio.Task | None = None
        self._eof = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        if self._buf:
            self._buf += data
            data = bytes(self._buf)
        at = 0
        try:
            while len(data) - at >= 4:
                size = int.from_bytes(data[at : at + 4], "little")
                if size > MAX_BODY:
                    exc = InvalidRequest(f"frame: {size} B > {MAX_BODY}")
                    self._transport.write(error_reply(exc))
                    self._transport.close()
                    return
                if len(data) - at - 4 < size:
                    break
                self._dispatch(data[at + 4 : at + 4 + size])
                at += 4 + size
        except Exception:  # a broken connection must not take the server down
            logger.exception("fast-path connection failed")
            self._transport.close()
            return
        self._buf = bytearray(data[at:])

    def eof_received(self) -> bool:
        """The engine is done sending; answer what is queued, then close."""
        self._eof = True
        return self._task is not None  # True keeps the transport open for now

    def _dispatch(self, body: bytes) -> None:
        if not self._queued and body[:1] == bytes([QUERY]):
            self._transport.write(self._query(body))
            return
        self._queued.append(body)
        if self._task is None:
            self._task = asyncio.ensure_future(self._drain())

    async def _drain(self) -> None:
        try:
            while self._queued:
                reply = await self._answer(self._queued[0])
                self._queued.popleft()
                if not self._transport.is_closing():
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
        return await self._copy(kind, body)

    def _query(self, body: bytes) -> bytes:
        start = time.perf_counter()
        try:
            res = self._engine.query(*decode_query(body))
        except PegaflowError as exc:
            self._seconds.labels("QueryPrefix/unix", exc.code.name).observe(
                time.perf_counter() - start
            )
            return error_reply(exc)
        self._ok_seconds.observe(time.perf_counter() - start)
        status = LOADING if res.loading else 0
        return QUERY_REPLY.pack(status, res.num_blocks, res.lease_id, res.lease_ttl_s)

    async def _copy(self, kind: int, body: bytes) -> bytes:
        method = "Save/unix" if kind == SAVE else "Load/unix"
        start, code = time.perf_counter(), "OK"
        try:
            if kind == SAVE:
                ident, rank, ids, hashes, layers, event = decode_save(body)
                res = await self._engine.save(
                    ident, rank, ids, hashes, layers, wait_event=event
                )
                return SAVE_REPLY.pack(0, res.stored, res.deduplicated, res.rejected)
            got = await self._engine.load(*decode_load(body))
            return load_reply(got.loaded, got.bytes, got.items)
        except PegaflowError as exc:
            code = exc.code.name
            return error_reply(exc)
        except Exception:  # as gRPC's interceptor does: INTERNAL, server lives on
            code = "INTERNAL"
            logger.exception("%s failed", method)
            return error_reply(CopyFailed(f"{method.split('/')[0]}: internal error"))
        finally:
            self._seconds.labels(method, code).observe(time.perf_counter() - start)


async def start_query_socket(path: str, engine: Engine) -> asyncio.AbstractServer:
    """Serve queries and saves on `path` (mode 0600 from creation: the server's
    user only; pegaflow.sockfile refuses a path that is not a stale socket of
    ours)."""
    sock = bind_private_unix(path)
    loop = asyncio.get_running_loop()
    try:
        return await loop.create_unix_server(lambda: _FastProtocol(engine), sock=sock)
    except BaseException:
        unlink_if_ours(path, sock)
        sock.close()
        raise


class FastPathClient:
    """Blocking client of the fast-path socket: one connection per calling
    thread (a worker's save must not hold up its load or a query), one request
    in flight on each."""

    def __init__(self, path: str, timeout_s: float) -> None:
        self._path = path
        self._timeout_s = timeout_s
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
            except OSError:
                sock.close()
                raise
            with self._lock:
                if self._closed:
                    sock.close()
                    raise ConnectionError("fast-path client closed")
                self._socks.append(sock)
            self._local.sock = sock
        return sock

    def query(self, frame: bytes) -> tuple[int, int, float, bool]:
        """(num_blocks, lease_id, lease_ttl_s, loading); typed exceptions for
        errors; OSError when the connection is broken."""
        status, reply = self._exchange(frame, QUERY_REPLY.size)
        _, n, lease, ttl = QUERY_REPLY.unpack(reply)
        return n, lease, ttl, status == LOADING

    def save(self, frame: bytes) -> tuple[int, int, int]:
        """(stored, deduplicated, rejected)."""
        _, reply = self._exchange(frame, SAVE_REPLY.size)
        return SAVE_REPLY.unpack(reply)[1:]

    def load(self, frame: bytes) -> tuple[int, int, list[tuple[int, int, str]]]:
        """(loaded, bytes, [(loaded, bytes, error)] per item)."""
        _, reply = self._exchange(frame, LOAD_REPLY.size, _load_reply_size)
        return parse_load_reply(bytes(reply))

    def _exchange(
        self,
        frame: bytes,
        ok_size: int,
        full_size: Callable[[bytearray], int] | None = None,
    ) -> tuple[int, bytearray]:
        sock = self._conn()
        try:
            sock.sendall(frame)
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
        except OSError:
            self._forget(sock)  # half a reply may be left in it
            raise
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


def _load_reply_size(reply: bytearray) -> int:
    """The whole load reply's length, as far as its first bytes tell."""
    _, _, _, n_items = LOAD_REPLY.unpack_from(reply)
    size = LOAD_REPLY.size + n_items * LOAD_ITEM_REPLY.itemsize
    if len(reply) < size:
        return size
    table = np.frombuffer(bytes(reply), LOAD_ITEM_REPLY, n_items, LOAD_REPLY.size)
    return size + int(table["error_len"].sum())
