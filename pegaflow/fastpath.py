"""Prefix queries over a unix socket: the scheduler asks once per waiting request
per step, and on the VMs we run on a Python gRPC round trip costs ~1 ms against
~0.14 ms for a framed unix-socket exchange (benchmarks/RESULTS.md). gRPC's
QueryPrefix stays the reference API; the client uses this path when the server
named a socket at registration and it is reachable, and falls back otherwise.

Frames, little-endian:
  request  = u32 body_len | body
  body     = u8 version(1) | u8 hash_len | u16 id_len | u32 count | id | hashes
  response = u8 status (a grpc.StatusCode value, 0 = OK; 255 = LOADING) | payload
  payload  = OK: u32 num_blocks | u64 lease_id | f64 lease_ttl_s
             LOADING: the same, num_blocks coming from a slower tier, no lease
             else: u32 msg_len | utf-8 message
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import struct
import threading
import time
from typing import TYPE_CHECKING

import grpc
import numpy as np

from pegaflow.errors import InvalidRequest, PegaflowError, from_status

if TYPE_CHECKING:
    from pegaflow.engine import Engine

logger = logging.getLogger(__name__)

VERSION = 1
HEADER = struct.Struct("<BBHI")
OK_REPLY = struct.Struct("<BIQd")
# Not a grpc.StatusCode value (those stop at 16): the query's answer is `loading`.
LOADING = 255
MAX_BODY = 64 << 20


def encode_query(instance_id: str, hashes: list[bytes]) -> bytes | None:
    """The request frame, or None when the hashes differ in length (use gRPC)."""
    ident = instance_id.encode()
    sizes = set(map(len, hashes)) or {1}
    size = sizes.pop()
    if sizes or not 0 < size < 256 or len(ident) > 65535:
        return None
    body = (
        HEADER.pack(VERSION, size, len(ident), len(hashes)) + ident + b"".join(hashes)
    )
    return len(body).to_bytes(4, "little") + body


def decode_query(body: bytes) -> tuple[str, list[bytes], int]:
    """(instance id, hashes, the length of every hash)."""
    if len(body) < HEADER.size:
        raise InvalidRequest("frame: shorter than its header")
    version, size, id_len, count = HEADER.unpack_from(body)
    if version != VERSION:
        raise InvalidRequest(f"frame.version: {version}, this server speaks {VERSION}")
    if size == 0:
        raise InvalidRequest("block_hashes: hash length 0")
    start = HEADER.size + id_len
    if len(body) != start + size * count:
        raise InvalidRequest(
            f"frame: {len(body)} bytes, header promises {start + size * count}"
        )
    try:
        instance_id = body[HEADER.size : start].decode()
    except UnicodeDecodeError:
        raise InvalidRequest("instance_id: not UTF-8") from None
    hashes = np.frombuffer(body, dtype=f"V{size}", count=count, offset=start).tolist()
    return instance_id, hashes, size


def _error(exc: PegaflowError) -> bytes:
    msg = str(exc).encode()[:65536]
    return bytes([exc.code.value[0]]) + len(msg).to_bytes(4, "little") + msg


class _QueryProtocol(asyncio.Protocol):
    """One engine connection: frames in, answers out, straight from the loop's
    read callback (no stream reader task: two fewer loop hops per query)."""

    def __init__(self, engine: Engine) -> None:
        self._engine = engine
        self._seconds = engine.metrics.rpc_seconds
        self._ok_seconds = self._seconds.labels("QueryPrefix/unix", "OK")
        self._buf = bytearray()
        self._transport: asyncio.Transport | None = None

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
                    self._transport.write(_error(exc))
                    self._transport.close()
                    return
                if len(data) - at - 4 < size:
                    break
                self._transport.write(self._answer(data[at + 4 : at + 4 + size]))
                at += 4 + size
        except Exception:  # a broken connection must not take the server down
            logger.exception("query socket connection failed")
            self._transport.close()
            return
        self._buf = bytearray(data[at:])

    def _answer(self, body: bytes) -> bytes:
        start = time.perf_counter()
        try:
            res = self._engine.query(*decode_query(body))
        except PegaflowError as exc:
            self._seconds.labels("QueryPrefix/unix", exc.code.name).observe(
                time.perf_counter() - start
            )
            return _error(exc)
        self._ok_seconds.observe(time.perf_counter() - start)
        status = LOADING if res.loading else 0
        return OK_REPLY.pack(status, res.num_blocks, res.lease_id, res.lease_ttl_s)


async def start_query_socket(path: str, engine: Engine) -> asyncio.AbstractServer:
    """Serve prefix queries on `path` (mode 0600: the server's user only)."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    loop = asyncio.get_running_loop()
    server = await loop.create_unix_server(lambda: _QueryProtocol(engine), path)
    os.chmod(path, 0o600)
    return server


class QuerySocketClient:
    """Blocking client of the query socket; one request in flight at a time."""

    def __init__(self, path: str, timeout_s: float) -> None:
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.settimeout(timeout_s)
        self._sock.connect(path)
        self._lock = threading.Lock()

    def query(self, frame: bytes) -> tuple[int, int, float, bool]:
        """(num_blocks, lease_id, lease_ttl_s, loading); typed exceptions for
        errors; OSError when the connection is broken."""
        with self._lock:
            self._sock.sendall(frame)
            # Every reply is at least 5 bytes and the only one in flight: the
            # first recv (4 KiB) usually takes it whole.
            reply = self._recv(5, bytearray())
            status = reply[0]
            if status in (0, LOADING):
                _, n, lease, ttl = OK_REPLY.unpack(self._recv(OK_REPLY.size, reply))
                return n, lease, ttl, status == LOADING
            length = int.from_bytes(reply[1:5], "little")
            message = self._recv(5 + length, reply)[5:].decode(errors="replace")
        code = next((c for c in grpc.StatusCode if c.value[0] == status), None)
        raise from_status(code or grpc.StatusCode.UNKNOWN, message)

    def _recv(self, n: int, buf: bytearray) -> bytearray:
        """Read until buf holds n bytes."""
        while len(buf) < n:
            chunk = self._sock.recv(max(n - len(buf), 4096))
            if not chunk:
                raise ConnectionError("query socket closed by the server")
            buf += chunk
        return buf

    def close(self) -> None:
        self._sock.close()
