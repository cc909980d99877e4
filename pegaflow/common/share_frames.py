"""The share frame of the server's unix socket: a registered host engine hands
the server a sealed memfd that backs its KV memory (pegaflow.client.host_share
makes it, pegaflow.copiers.shared_kv maps it), so that the server copies with
plain loads and stores instead of process_vm_readv / process_vm_writev.

Same framing as pegaflow.common.socket_frames (little-endian, `u32 body_len |
body`); a server that predates it answers INVALID_ARGUMENT ("frame.kind") and
the engine keeps the process_vm path.

  share (5): u8 kind | u8 0 | u16 id_len | u32 n_spans | u32 tp_rank
             | u64 deadline | token | id
             | n_spans x (u64 address | u64 offset | u64 size)

  A span: `size` bytes of the engine's memory at `address` are the memfd's
  bytes at `offset`. The exchange is in two steps, as the file descriptor
  must not reach the server before it reads it with recvmsg:
    engine: share frame            server: u8 0 | u8 READY | 3 B 0 (or an error)
    engine: 1 byte + SCM_RIGHTS    server: u8 0 | u8 DONE | u64 bytes mapped
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np

from .errors import InvalidRequest

SHARE = 5
READY, DONE = 1, 2
SHARE_HEADER = struct.Struct("<BBHIIQ16s")
SHARE_READY = struct.Struct("<BBxxx")  # every reply is at least 5 bytes
SHARE_DONE = struct.Struct("<BBQ")
SPAN = np.dtype([("address", "<u8"), ("offset", "<u8"), ("size", "<u8")])
# More spans than any engine's KV allocations; a bound on the frame's table.
MAX_SPANS = 4096


@dataclass(frozen=True, slots=True)
class ShareSpan:
    """`size` bytes at `address` in the engine are the memfd's at `offset`."""

    address: int
    offset: int
    size: int


@dataclass(frozen=True, slots=True)
class ShareRequest:
    instance_id: str
    tp_rank: int
    spans: tuple[ShareSpan, ...]
    deadline_ns: int
    token: bytes


def encode_share(req: ShareRequest) -> bytes:
    ident = req.instance_id.encode()
    head = SHARE_HEADER.pack(
        SHARE,
        0,
        len(ident),
        len(req.spans),
        req.tp_rank,
        req.deadline_ns,
        req.token,
    )
    table = np.zeros(len(req.spans), SPAN)
    table["address"] = [s.address for s in req.spans]
    table["offset"] = [s.offset for s in req.spans]
    table["size"] = [s.size for s in req.spans]
    body = head + ident + table.tobytes()
    return len(body).to_bytes(4, "little") + body


def decode_share(body: bytes) -> ShareRequest:
    if len(body) < SHARE_HEADER.size:
        raise InvalidRequest("frame: shorter than its header")
    _, _, id_len, n, rank, deadline_ns, token = SHARE_HEADER.unpack_from(body)
    if not 0 < n <= MAX_SPANS:
        raise InvalidRequest(f"share.spans: {n}, need 1 to {MAX_SPANS}")
    at = SHARE_HEADER.size + id_len
    if len(body) != at + n * SPAN.itemsize:
        raise InvalidRequest(
            f"frame: {len(body)} bytes, header promises {at + n * SPAN.itemsize}"
        )
    try:
        ident = body[SHARE_HEADER.size : at].decode()
    except UnicodeDecodeError:
        raise InvalidRequest("instance_id: not UTF-8") from None
    table = np.frombuffer(body, SPAN, n, at)
    spans = tuple(
        ShareSpan(a, o, s)
        for a, o, s in zip(
            table["address"].tolist(),
            table["offset"].tolist(),
            table["size"].tolist(),
            strict=True,
        )
    )
    return ShareRequest(ident, rank, spans, deadline_ns, token)
