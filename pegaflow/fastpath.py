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


async def start_query_socket(path: str, engine: Engine) -> asyncio.AbstractServer:
    """Serve prefix queries on `path` (mode 0600: the server's user only)."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    seconds = engine.metrics.rpc_seconds

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                size = int.from_bytes(await reader.readexactly(4), "little")
                if size > MAX_BODY:
                    writer.write(
                        _error(InvalidRequest(f"frame: {size} B > {MAX_BODY}"))
                    )
                    break
                body = await reader.readexactly(size)
                start, code = time.perf_counter(), "OK"
                try:
                    res = engine.query(*decode_query(body))
                    reply = OK_REPLY.pack(
                        LOADING if res.loading else 0,
                        res.num_blocks,
                        res.lease_id,
                        res.lease_ttl_s,
                    )
                except PegaflowError as exc:
                    code, reply = exc.code.name, _error(exc)
                writer.write(reply)
                seconds.labels("QueryPrefix/unix", code).observe(
                    time.perf_counter() - start
                )
        except (asyncio.IncompleteReadError, ConnectionError):
            pass  # the engine went away
        except asyncio.CancelledError:
            pass  # server shutdown: end quietly, the loop is closing
        except Exception:  # a broken connection must not take the server down
            logger.exception("query socket connection failed")
        finally:
            writer.close()

    # A large reader limit: an 80 KiB query (2560 hashes) arrives without the
    # transport pausing and resuming reads.
    server = await asyncio.start_unix_server(serve, path, limit=1 << 20)
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
            status = self._recv(1)[0]
            if status in (0, LOADING):
                n, lease, ttl = struct.unpack("<IQd", self._recv(OK_REPLY.size - 1))
                return n, lease, ttl, status == LOADING
            length = int.from_bytes(self._recv(4), "little")
            message = self._recv(length).decode(errors="replace")
        code = next((c for c in grpc.StatusCode if c.value[0] == status), None)
        raise from_status(code or grpc.StatusCode.UNKNOWN, message)

    def _recv(self, n: int) -> bytes:
        buf = bytearray()
        while len(buf) < n:
            chunk = self._sock.recv(n - len(buf))
            if not chunk:
                raise ConnectionError("query socket closed by the server")
            buf += chunk
        return bytes(buf)

    def close(self) -> None:
        self._sock.close()
