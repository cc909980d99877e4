"""Binary frames of the unix-socket fast path (pegaflow.fastpath).

Little-endian; every request is `u32 body_len | body`, the body starting with a
u8 kind. Arrays travel as raw u32 runs, hashes as one run of equal-length
strings, so neither side builds per-block Python objects to frame a request.

  query (1): u8 kind | u8 hash_len | u16 id_len | u32 count | id | hashes
  save  (2): u8 kind | u8 hash_len | u16 id_len | u32 count | u32 tp_rank
             | u32 wait_event | u32 n_layers | id | u32 block_ids[count]
             | u32 layer_ids[n_layers] | hashes
  load  (3): u8 kind | u8 batch | u16 id_len | u32 n_items | u32 tp_rank
             | u64 layer_seq | id
             | n_items x (u64 lease_id | u32 lease_offset | u32 count)
             | u32 block_ids[sum of counts]

Replies: u8 status (a grpc.StatusCode value, 0 = OK; 255 = LOADING) | payload
  query OK / LOADING: u32 num_blocks | u64 lease_id | f64 lease_ttl_s
  save OK:            u32 stored | u32 deduplicated | u32 rejected
  load OK:            u32 loaded | u64 bytes | u32 n_items
                      | n_items x (u32 loaded | u64 bytes | u32 error_len) | errors
  any error:          u32 msg_len | utf-8 message
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

import numpy as np

from pegaflow.errors import InvalidRequest, PegaflowError
from pegaflow.ready_index import PackedHashes

QUERY, SAVE, LOAD = 1, 2, 3
KINDS = (QUERY, SAVE, LOAD)
QUERY_HEADER = struct.Struct("<BBHI")
SAVE_HEADER = struct.Struct("<BBHIIII")
QUERY_REPLY = struct.Struct("<BIQd")
SAVE_REPLY = struct.Struct("<BIII")
LOAD_HEADER = struct.Struct("<BBHIIQ")
LOAD_REPLY = struct.Struct("<BIQI")
LOAD_ITEM = np.dtype([("lease_id", "<u8"), ("lease_offset", "<u4"), ("count", "<u4")])
LOAD_ITEM_REPLY = np.dtype([("loaded", "<u4"), ("bytes", "<u8"), ("error_len", "<u4")])
# One item of a Load: (lease id, first leased block, destination block ids).
LoadSpec = tuple[int, int, np.ndarray]
# Not a grpc.StatusCode value (those stop at 16): the query's answer is `loading`.
LOADING = 255
MAX_BODY = 64 << 20


def _hash_size(hashes: list[bytes]) -> int | None:
    """The one length every hash has, or None (mixed, 0 or > 255 bytes)."""
    sizes = set(map(len, hashes)) or {1}
    size = sizes.pop()
    return None if sizes or not 0 < size < 256 else size


def _framed(body: bytes) -> bytes:
    return len(body).to_bytes(4, "little") + body


def encode_query(
    instance_id: str, hashes: list[bytes], hash_len: int | None = None
) -> bytes | None:
    """The request frame, or None when the hashes differ in length (use gRPC).
    hash_len: the caller's word that every hash has this length, which skips a
    pass over the hashes (~0.1 ms at 2560); the total is still checked."""
    ident = instance_id.encode()
    size = _hash_size(hashes) if hash_len is None else hash_len
    if size is None or not 0 < size < 256 or len(ident) > 65535:
        return None
    joined = b"".join(hashes)
    if len(joined) != size * len(hashes):
        return None if hash_len is None else encode_query(instance_id, hashes)
    head = QUERY_HEADER.pack(QUERY, size, len(ident), len(hashes))
    return _framed(head + ident + joined)


def encode_save(
    instance_id: str,
    tp_rank: int,
    block_ids: np.ndarray,
    hashes: list[bytes],
    layer_ids: Sequence[int],
    wait_event: int,
) -> bytes | None:
    """The request frame, or None when gRPC must carry it (mixed hash lengths,
    values outside u32: the server's answer there names the field)."""
    ident = instance_id.encode()
    size = _hash_size(hashes)
    if size is None or len(ident) > 65535 or len(block_ids) != len(hashes):
        return None
    try:
        ids = np.asarray(block_ids, np.int64)
        layers = np.asarray(layer_ids, np.int64)
        head = SAVE_HEADER.pack(
            SAVE, size, len(ident), len(hashes), tp_rank, wait_event, len(layers)
        )
    except (struct.error, OverflowError, ValueError, TypeError):
        return None
    if ids.ndim != 1 or layers.ndim != 1:
        return None
    for arr in (ids, layers):
        if len(arr) and (arr.min() < 0 or arr.max() > 0xFFFFFFFF):
            return None
    return _framed(
        head
        + ident
        + ids.astype("<u4").tobytes()
        + layers.astype("<u4").tobytes()
        + b"".join(hashes)
    )


def encode_load(
    instance_id: str,
    tp_rank: int,
    items: Sequence[LoadSpec],
    batch: bool,
    layer_seq: int = 0,
) -> bytes | None:
    """The request frame, or None when gRPC must carry it (values outside the
    frame's fields: the server's answer there names the field)."""
    ident = instance_id.encode()
    try:
        head = LOAD_HEADER.pack(LOAD, batch, len(ident), len(items), tp_rank, layer_seq)
        table = np.zeros(len(items), LOAD_ITEM)
        ids = [np.asarray(block_ids, np.int64).reshape(-1) for _, _, block_ids in items]
        table["lease_id"] = [lease for lease, _, _ in items]
        table["lease_offset"] = [offset for _, offset, _ in items]
        table["count"] = list(map(len, ids))
    except (struct.error, OverflowError, ValueError, TypeError):
        return None
    flat = np.concatenate(ids) if ids else np.zeros(0, np.int64)
    if len(ident) > 65535 or (
        len(flat) and (flat.min() < 0 or flat.max() > 0xFFFFFFFF)
    ):
        return None
    return _framed(head + ident + table.tobytes() + flat.astype("<u4").tobytes())


def decode_load(body: bytes) -> tuple[str, int, list[LoadSpec], bool, int]:
    """(instance id, tp_rank, items, batch, layer_seq), in Engine.load's order."""
    if len(body) < LOAD_HEADER.size:
        raise InvalidRequest("frame: shorter than its header")
    _, batch, id_len, n_items, rank, layer_seq = LOAD_HEADER.unpack_from(body)
    table_at = LOAD_HEADER.size + id_len
    ids_at = table_at + n_items * LOAD_ITEM.itemsize
    if len(body) < ids_at:
        raise InvalidRequest(f"frame: {len(body)} bytes, header promises {ids_at}+")
    table = np.frombuffer(body, LOAD_ITEM, n_items, table_at)
    counts = table["count"].astype(np.int64)
    _check_length(body, ids_at + 4 * int(counts.sum()))
    flat = np.frombuffer(body, "<u4", int(counts.sum()), ids_at).astype(np.int64)
    if not batch and n_items != 1:
        raise InvalidRequest(f"items: {n_items} in a single-lease load, need 1")
    ends = np.cumsum(counts)
    starts, ends = (ends - counts).tolist(), ends.tolist()
    items = [
        (lease, offset, flat[a:b])
        for lease, offset, a, b in zip(
            table["lease_id"].tolist(),
            table["lease_offset"].tolist(),
            starts,
            ends,
            strict=True,
        )
    ]
    ident = _ident(body, LOAD_HEADER.size, table_at)
    return ident, rank, items, bool(batch), layer_seq


def load_reply(loaded: int, nbytes: int, items: Sequence) -> bytes:
    """items: LoadItemResult-like (loaded, bytes, error)."""
    table = np.zeros(len(items), LOAD_ITEM_REPLY)
    errors = [item.error.encode() for item in items]
    table["loaded"] = [item.loaded for item in items]
    table["bytes"] = [item.bytes for item in items]
    table["error_len"] = list(map(len, errors))
    head = LOAD_REPLY.pack(0, loaded, nbytes, len(items))
    return head + table.tobytes() + b"".join(errors)


def parse_load_reply(
    reply: bytes,
) -> tuple[int, int, list[tuple[int, int, str]]]:
    """(loaded, bytes, [(loaded, bytes, error)] per item) of a load_reply."""
    _, loaded, nbytes, n_items = LOAD_REPLY.unpack_from(reply)
    table = np.frombuffer(reply, LOAD_ITEM_REPLY, n_items, LOAD_REPLY.size)
    at = LOAD_REPLY.size + table.nbytes
    out = []
    for got, size, err_len in table.tolist():
        out.append((got, size, reply[at : at + err_len].decode(errors="replace")))
        at += err_len
    return loaded, nbytes, out


def kind_of(body: bytes) -> int:
    if not body:
        raise InvalidRequest("frame: empty")
    if body[0] not in KINDS:
        raise InvalidRequest(f"frame.kind: {body[0]}, this server speaks {KINDS}")
    return body[0]


def _hashes(body: bytes, start: int, size: int, count: int) -> list[bytes]:
    if size == 0:
        raise InvalidRequest("block_hashes: hash length 0")
    return np.frombuffer(body, dtype=f"V{size}", count=count, offset=start).tolist()


def _check_length(body: bytes, expected: int) -> None:
    if len(body) != expected:
        raise InvalidRequest(f"frame: {len(body)} bytes, header promises {expected}")


def _ident(body: bytes, start: int, end: int) -> str:
    try:
        return body[start:end].decode()
    except UnicodeDecodeError:
        raise InvalidRequest("instance_id: not UTF-8") from None


def decode_query(body: bytes) -> tuple[str, PackedHashes, int]:
    """(instance id, hashes, the length of every hash). The hashes stay packed
    in body: the index probes them as they are, a Python bytes object per hash
    would cost ~40 us per 1000 before the lookup starts."""
    if len(body) < QUERY_HEADER.size:
        raise InvalidRequest("frame: shorter than its header")
    _, size, id_len, count = QUERY_HEADER.unpack_from(body)
    start = QUERY_HEADER.size + id_len
    _check_length(body, start + size * count)
    hashes = PackedHashes(body, size, count, start)
    return _ident(body, QUERY_HEADER.size, start), hashes, size


def decode_save(
    body: bytes,
) -> tuple[str, int, np.ndarray, list[bytes], np.ndarray | None, int]:
    """(instance id, tp_rank, block_ids, hashes, layer_ids or None, wait_event),
    in Engine.save's order."""
    if len(body) < SAVE_HEADER.size:
        raise InvalidRequest("frame: shorter than its header")
    _, size, id_len, count, rank, event, n_layers = SAVE_HEADER.unpack_from(body)
    ids_at = SAVE_HEADER.size + id_len
    layers_at = ids_at + 4 * count
    hashes_at = layers_at + 4 * n_layers
    _check_length(body, hashes_at + size * count)
    ids = np.frombuffer(body, "<u4", count, ids_at).astype(np.int64)
    layers = np.frombuffer(body, "<u4", n_layers, layers_at).astype(np.int64)
    return (
        _ident(body, SAVE_HEADER.size, ids_at),
        rank,
        ids,
        _hashes(body, hashes_at, size, count),
        layers if n_layers else None,
        event,
    )


def error_reply(exc: PegaflowError) -> bytes:
    msg = str(exc).encode()[:65536]
    return bytes([exc.code.value[0]]) + len(msg).to_bytes(4, "little") + msg
