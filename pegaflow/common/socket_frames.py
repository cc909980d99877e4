"""Binary frames of the server's unix socket (pegaflow.server.socket_service and
pegaflow.client.socket_transport).

Little-endian; every request is `u32 body_len | body`, the body starting with a
u8 kind. Arrays travel as raw u32 runs, hashes as one run of equal-length
strings, so neither side builds per-block Python objects to frame a request.
A connection opens with a hello naming the protocol version; a server that
speaks another version answers FAILED_PRECONDITION and closes. `deadline` is
CLOCK_MONOTONIC nanoseconds (pegaflow.common.deadlines; 0: none); `token` the worker's
16-byte owner token from its registration.

  hello    (0): u8 kind | u8 0 | u16 version
  query    (1): u8 kind | u8 hash_len | u16 id_len | u32 count | u64 deadline
                | id | hashes
  save     (2): u8 kind | u8 hash_len | u16 id_len | u32 count | u32 tp_rank
                | u32 wait_event | u32 n_layers | u64 deadline | token | id
                | u32 block_ids[count] | u32 layer_ids[n_layers] | hashes
  load     (3): u8 kind | u8 batch | u16 id_len | u32 n_items | u32 tp_rank
                | u64 layer_seq | u64 deadline | token | u32 done_event | id
                | n_items x (u64 lease_id | u32 lease_offset | u32 count)
                | u32 block_ids[sum of counts]
  register (4): u8 kind | u8 0 | u16 0 | u64 deadline
                | RegisterInstanceRequest (protobuf)

Replies: u8 status (a grpc.StatusCode value, 0 = OK; 255 = LOADING; 254 =
IN_FLIGHT: a load's copy is queued, done when its done_event completes) | payload
  hello OK:           u16 version | 16 B server id (ServerInfo's server_id)
  query OK / LOADING: u32 num_blocks | u64 lease_id | f64 lease_ttl_s
                      | u32 ready_blocks | f32 l1_gbps | f32 tier_gbps
  save OK:            u32 stored | u32 deduplicated | u32 rejected
  load OK/IN_FLIGHT:  u32 loaded | u64 bytes | u32 n_items
                      | n_items x (u32 loaded | u64 bytes | u32 error_len) | errors
  register OK:        u32 length | RegisterInstanceResponse (protobuf)
  any error:          u32 msg_len | utf-8 message
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from .errors import InvalidRequest, PegaflowError
from .keys import LoadSpec, PackedHashes
from .request_limits import MAX_LOAD_ITEMS, check_load_items

if TYPE_CHECKING:
    from .results import QueryResult

PROTOCOL_VERSION = 4  # 3: no done_event in loads; 2: no rates in query replies;
# 1: no hello, deadlines, tokens nor register
HELLO, QUERY, SAVE, LOAD, REGISTER = 0, 1, 2, 3, 4
KINDS = (QUERY, SAVE, LOAD, REGISTER)  # after the hello
HELLO_HEADER = struct.Struct("<BBH")
HELLO_REPLY = struct.Struct("<BH16s")
QUERY_HEADER = struct.Struct("<BBHIQ")
SAVE_HEADER = struct.Struct("<BBHIIIIQ16s")
REGISTER_HEADER = struct.Struct("<BBHQ")
REGISTER_REPLY = struct.Struct("<BI")
QUERY_REPLY = struct.Struct("<BIQdIff")
SAVE_REPLY = struct.Struct("<BIII")
LOAD_HEADER = struct.Struct("<BBHIIQQ16sI")
LOAD_REPLY = struct.Struct("<BIQI")
LOAD_ITEM = np.dtype([("lease_id", "<u8"), ("lease_offset", "<u4"), ("count", "<u4")])
LOAD_ITEM_REPLY = np.dtype([("loaded", "<u4"), ("bytes", "<u8"), ("error_len", "<u4")])
_ONE_LOAD_ITEM = struct.Struct("<QII")  # LOAD_ITEM's bytes, for one item
_ONE_LOAD_REPLY = struct.Struct("<IQI")  # LOAD_ITEM_REPLY's
assert _ONE_LOAD_ITEM.size == LOAD_ITEM.itemsize
assert _ONE_LOAD_REPLY.size == LOAD_ITEM_REPLY.itemsize
# Not a grpc.StatusCode value (those stop at 16): the query's answer is `loading`.
LOADING = 255
IN_FLIGHT = 254
# The largest legitimate body: a save of 65536 blocks with 64-byte hashes is
# 4.3 MiB, a registration of 4096 layers x 8 segments ~0.3 MiB. A bigger frame
# is refused before any of it is buffered.
MAX_BODY = 8 << 20
# An error reply's message is cut to this; a client reads no longer one.
MAX_ERROR_MESSAGE = 65536
# A load reply's error line per item is cut to this, over the socket and gRPC
# alike (load_item_error). The longest line the server writes is an SSD
# read's, "items[16383].block_ids: <u32> of the blocks read from the SSD did
# not load (...): recompute them" (<= 172 B): it passes whole. A reply is then
# bounded by the items its request carries (load_reply_bound), which the
# socket's backlog budget charges.
LOAD_ITEM_ERROR_MAX = 192
# An item that names no block ids can fail only for its lease gone
# (pegaflow.cache.leases), in a line of at most this: the longest index and
# lease id (tests/server/test_load_errors.py reads it back from the server).
LEASE_GONE_LINE_MAX = len(
    f"items[{MAX_LOAD_ITEMS - 1}].lease_id: {2**64 - 1} is unknown, expired or "
    "already consumed"
)
# What any other reply can take: an error's own words (the fields it names
# are the request's, charged as its bytes), a query's, save's or registration's.
REPLY_ALLOWANCE = 512
# The largest reply a client reads: a load's is the largest legitimate one
# (16384 items and an error line each, ~3.3 MiB).
MAX_REPLY = 64 << 20


def _hash_size(hashes: list[bytes]) -> int | None:
    """The one length every hash has, or None (mixed, 0 or > 255 bytes)."""
    sizes = set(map(len, hashes)) or {1}
    size = sizes.pop()
    return None if sizes or not 0 < size < 256 else size


def _framed(body: bytes) -> bytes:
    return len(body).to_bytes(4, "little") + body


def encode_hello() -> bytes:
    return _framed(HELLO_HEADER.pack(HELLO, 0, PROTOCOL_VERSION))


def decode_hello(body: bytes) -> int:
    """The client's protocol version; InvalidRequest if this is no hello."""
    if len(body) != HELLO_HEADER.size or body[0] != HELLO:
        raise InvalidRequest(
            f"frame: the first frame must be a hello (protocol {PROTOCOL_VERSION}); "
            "this client speaks an older protocol: upgrade pegaflow on the engine"
        )
    return HELLO_HEADER.unpack(body)[2]


def encode_register(request: bytes, deadline_ns: int) -> bytes:
    """request: a serialised RegisterInstanceRequest."""
    return _framed(REGISTER_HEADER.pack(REGISTER, 0, 0, deadline_ns) + request)


def decode_register(body: bytes) -> tuple[bytes, int]:
    """(serialised RegisterInstanceRequest, deadline_ns)."""
    if len(body) < REGISTER_HEADER.size:
        raise InvalidRequest("frame: shorter than its header")
    return body[REGISTER_HEADER.size :], REGISTER_HEADER.unpack_from(body)[3]


def register_reply(response: bytes) -> bytes:
    return REGISTER_REPLY.pack(0, len(response)) + response


def encode_query(
    instance_id: str,
    hashes: list[bytes],
    hash_len: int | None = None,
    deadline_ns: int = 0,
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
        if hash_len is None:
            return None
        return encode_query(instance_id, hashes, deadline_ns=deadline_ns)
    head = QUERY_HEADER.pack(QUERY, size, len(ident), len(hashes), deadline_ns)
    return _framed(head + ident + joined)


def encode_save(
    instance_id: str,
    tp_rank: int,
    block_ids: np.ndarray,
    hashes: list[bytes],
    layer_ids: Sequence[int],
    wait_event: int,
    deadline_ns: int = 0,
    token: bytes = b"",
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
            SAVE,
            size,
            len(ident),
            len(hashes),
            tp_rank,
            wait_event,
            len(layers),
            deadline_ns,
            token,
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
    deadline_ns: int = 0,
    token: bytes = b"",
    done_event: int = 0,
) -> bytes | None:
    """The request frame, or None when gRPC must carry it (values outside the
    frame's fields: the server's answer there names the field)."""
    ident = instance_id.encode()
    try:
        head = LOAD_HEADER.pack(
            LOAD,
            batch,
            len(ident),
            len(items),
            tp_rank,
            layer_seq,
            deadline_ns,
            token,
            done_event,
        )
        ids = [np.asarray(block_ids, np.int64).reshape(-1) for _, _, block_ids in items]
        if len(items) == 1:  # the usual load: struct, not a structured array
            ((lease, offset, _),) = items
            table = _ONE_LOAD_ITEM.pack(lease, offset, len(ids[0]))
            flat = ids[0]
        else:
            rows = np.zeros(len(items), LOAD_ITEM)
            rows["lease_id"] = [lease for lease, _, _ in items]
            rows["lease_offset"] = [offset for _, offset, _ in items]
            rows["count"] = list(map(len, ids))
            table = rows.tobytes()
            flat = np.concatenate(ids) if ids else np.zeros(0, np.int64)
    except (struct.error, OverflowError, ValueError, TypeError):
        return None
    if len(ident) > 65535 or (
        len(flat) and (flat.min() < 0 or flat.max() > 0xFFFFFFFF)
    ):
        return None
    return _framed(head + ident + table + flat.astype("<u4").tobytes())


def decode_load(
    body: bytes,
) -> tuple[str, int, list[LoadSpec], bool, int, int, int, bytes]:
    """(instance id, tp_rank, items, batch, layer_seq, done_event, deadline_ns,
    token): Engine.load's order, then what its CallContext needs."""
    if len(body) < LOAD_HEADER.size:
        raise InvalidRequest("frame: shorter than its header")
    head = LOAD_HEADER.unpack_from(body)
    _, batch, id_len, n_items, rank, layer_seq, deadline_ns, token, done = head
    table_at = LOAD_HEADER.size + id_len
    ids_at = table_at + n_items * LOAD_ITEM.itemsize
    if len(body) < ids_at:
        raise InvalidRequest(f"frame: {len(body)} bytes, header promises {ids_at}+")
    if not batch and n_items != 1:
        raise InvalidRequest(f"items: {n_items} in a single-lease load, need 1")
    check_load_items(n_items)  # before one object is built for each
    if n_items == 1:  # the usual load: struct, not a structured array (~10 us)
        lease, offset, count = _ONE_LOAD_ITEM.unpack_from(body, table_at)
        _check_length(body, ids_at + 4 * count)
        flat = np.frombuffer(body, "<u4", count, ids_at).astype(np.int64)
        items = [(lease, offset, flat)]
    else:
        items = _load_items(body, n_items, table_at, ids_at)
    ident = _ident(body, LOAD_HEADER.size, table_at)
    return ident, rank, items, bool(batch), layer_seq, done, deadline_ns, token


def _load_items(
    body: bytes, n_items: int, table_at: int, ids_at: int
) -> list[tuple[int, int, np.ndarray]]:
    table = np.frombuffer(body, LOAD_ITEM, n_items, table_at)
    counts = table["count"].astype(np.int64)
    _check_length(body, ids_at + 4 * int(counts.sum()))
    flat = np.frombuffer(body, "<u4", int(counts.sum()), ids_at).astype(np.int64)
    ends = np.cumsum(counts)
    starts, ends = (ends - counts).tolist(), ends.tolist()
    return [
        (lease, offset, flat[a:b])
        for lease, offset, a, b in zip(
            table["lease_id"].tolist(),
            table["lease_offset"].tolist(),
            starts,
            ends,
            strict=True,
        )
    ]


def load_reply(
    loaded: int, nbytes: int, items: Sequence, in_flight: bool = False
) -> bytes:
    """items: LoadItemResult-like (loaded, bytes, error); in_flight: the copy
    is queued, not done (the load named a done_event)."""
    head = LOAD_REPLY.pack(IN_FLIGHT if in_flight else 0, loaded, nbytes, len(items))
    if len(items) == 1:  # the usual load, as for its request
        (item,) = items
        error = load_item_error(item.error)
        return head + _ONE_LOAD_REPLY.pack(item.loaded, item.bytes, len(error)) + error
    table = np.zeros(len(items), LOAD_ITEM_REPLY)
    errors = [load_item_error(item.error) for item in items]
    table["loaded"] = [item.loaded for item in items]
    table["bytes"] = [item.bytes for item in items]
    table["error_len"] = list(map(len, errors))
    return head + table.tobytes() + b"".join(errors)


def load_item_error(error: str) -> bytes:
    """A load item's error line as both transports answer it (gRPC's
    LoadItemResult.error too): UTF-8, cut to LOAD_ITEM_ERROR_MAX bytes at a
    character's boundary (a protobuf string must stay UTF-8)."""
    line = error.encode()
    if len(line) > LOAD_ITEM_ERROR_MAX:
        line = line[:LOAD_ITEM_ERROR_MAX].decode(errors="ignore").encode()
    return line


def load_reply_bound(body: bytes) -> int:
    """The longest load_reply a load frame's body can be answered with, by the
    items it carries: a row each, and in a batch the longest error line each
    can carry (a single lease's load carries none: its failure is an error
    reply). 0 for another frame, or one decode_load refuses on its header and
    length (an error answers it)."""
    if len(body) < LOAD_HEADER.size or body[0] != LOAD:
        return 0
    _, batch, id_len, n_items, *_ = LOAD_HEADER.unpack_from(body)
    if n_items > MAX_LOAD_ITEMS or (not batch and n_items != 1):
        return 0
    table_at = LOAD_HEADER.size + id_len
    if len(body) < table_at + n_items * LOAD_ITEM.itemsize:
        return 0
    rows = LOAD_REPLY.size + n_items * LOAD_ITEM_REPLY.itemsize
    if not batch:
        return rows
    if n_items == 1:  # the usual load: struct, not a structured array
        with_ids = int(_ONE_LOAD_ITEM.unpack_from(body, table_at)[2] > 0)
    else:
        table = np.frombuffer(body, LOAD_ITEM, n_items, table_at)
        with_ids = int(np.count_nonzero(table["count"]))
    empty = n_items - with_ids
    return rows + with_ids * LOAD_ITEM_ERROR_MAX + empty * LEASE_GONE_LINE_MAX


def reply_bound(body: bytes) -> int:
    """The most a request frame's reply can take beyond the frame's own bytes
    (the socket's backlog budget charges both while the request waits)."""
    return max(load_reply_bound(body), REPLY_ALLOWANCE)


def query_reply(res: QueryResult) -> bytes:
    status = LOADING if res.loading else 0
    return QUERY_REPLY.pack(
        status,
        res.num_blocks,
        res.lease_id,
        res.lease_ttl_s,
        res.ready_blocks,
        res.l1_gbps,
        res.tier_gbps,
    )


def load_reply_size(reply: bytearray) -> int:
    """The whole load reply's length, as far as its first bytes tell."""
    _, _, _, n_items = LOAD_REPLY.unpack_from(reply)
    size = LOAD_REPLY.size + n_items * LOAD_ITEM_REPLY.itemsize
    if len(reply) < size:
        return size
    if n_items == 1:  # the usual load: struct, not a structured array
        return size + _ONE_LOAD_REPLY.unpack_from(reply, LOAD_REPLY.size)[2]
    table = np.frombuffer(bytes(reply), LOAD_ITEM_REPLY, n_items, LOAD_REPLY.size)
    return size + int(table["error_len"].sum())


def parse_load_reply(
    reply: bytes,
) -> tuple[int, int, list[tuple[int, int, str]], bool]:
    """(loaded, bytes, [(loaded, bytes, error)] per item, in flight) of a
    load_reply."""
    status, loaded, nbytes, n_items = LOAD_REPLY.unpack_from(reply)
    table = np.frombuffer(reply, LOAD_ITEM_REPLY, n_items, LOAD_REPLY.size)
    at = LOAD_REPLY.size + table.nbytes
    out = []
    for got, size, err_len in table.tolist():
        out.append((got, size, reply[at : at + err_len].decode(errors="replace")))
        at += err_len
    return loaded, nbytes, out, status == IN_FLIGHT


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


def decode_query(body: bytes) -> tuple[str, PackedHashes, int, int]:
    """(instance id, hashes, the length of every hash, deadline_ns). The hashes
    stay packed
    in body: the index probes them as they are, a Python bytes object per hash
    would cost ~40 us per 1000 before the lookup starts."""
    if len(body) < QUERY_HEADER.size:
        raise InvalidRequest("frame: shorter than its header")
    _, size, id_len, count, deadline_ns = QUERY_HEADER.unpack_from(body)
    start = QUERY_HEADER.size + id_len
    _check_length(body, start + size * count)
    hashes = PackedHashes(body, size, count, start)
    return _ident(body, QUERY_HEADER.size, start), hashes, size, deadline_ns


def decode_save(
    body: bytes,
) -> tuple[str, int, np.ndarray, list[bytes], np.ndarray | None, int, int, bytes]:
    """(instance id, tp_rank, block_ids, hashes, layer_ids or None, wait_event,
    deadline_ns, token): Engine.save's order, then its CallContext's."""
    if len(body) < SAVE_HEADER.size:
        raise InvalidRequest("frame: shorter than its header")
    head = SAVE_HEADER.unpack_from(body)
    _, size, id_len, count, rank, event, n_layers, deadline_ns, token = head
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
        deadline_ns,
        token,
    )


def error_reply(exc: PegaflowError) -> bytes:
    msg = str(exc).encode()[:MAX_ERROR_MESSAGE]
    return bytes([exc.code.value[0]]) + len(msg).to_bytes(4, "little") + msg
