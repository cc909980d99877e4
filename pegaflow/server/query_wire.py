"""A gRPC QueryPrefixRequest read straight off its bytes, so that nothing per
hash is built before the query is known to be served.

protobuf's parse of an 8 MiB request of 240,000 hashes costs ~14 MiB and
list(block_hashes) ~20 MiB more (a bytes object per hash): 64 such requests
for an instance that does not exist took the server from 90 to 1,285 MiB
(issue 30 #4). Here the usual encoding (instance_id, then every hash with one
length, as every protobuf serializer writes it) is checked with numpy over the
bytes, and the hashes are packed (one buffer, pegaflow.common.keys
.PackedHashes) only when asked for: after the instance, the caller and the
count were checked. Any other encoding is parsed by protobuf, its hashes
listed only after the same checks.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from pegaflow.common.keys import BlockHash, PackedHashes
from pegaflow.proto import pegaflow_pb2 as pb

_INSTANCE_TAG = 0x0A  # field 1, length-delimited
_HASH_TAG = 0x12  # field 2, length-delimited

Hashes = list[BlockHash] | PackedHashes


class QueryBody:
    """instance_id and the number of hashes, read at once; hashes() builds
    them on demand."""

    __slots__ = ("instance_id", "count", "_hashes")

    def __init__(
        self, instance_id: str, count: int, hashes: Callable[[], Hashes]
    ) -> None:
        self.instance_id = instance_id
        self.count = count
        self._hashes = hashes

    def hashes(self) -> Hashes:
        return self._hashes()


def decode_query(data: bytes) -> QueryBody:
    """Raises protobuf's DecodeError (or UnicodeDecodeError) for bytes that
    are no QueryPrefixRequest: the caller's deserializer turns it into an
    INVALID_ARGUMENT answer."""
    body = _regular(data)
    if body is not None:
        return body
    msg = pb.QueryPrefixRequest.FromString(data)
    listed = msg.block_hashes
    return QueryBody(msg.instance_id, len(listed), lambda: list(listed))


def _regular(data: bytes) -> QueryBody | None:
    """The usual encoding, or None."""
    pos, instance_id = 0, ""
    if data[:1] == bytes([_INSTANCE_TAG]):
        size, pos = _varint(data, 1)
        if size < 0 or pos + size > len(data):
            return None
        try:
            instance_id = data[pos : pos + size].decode()
        except UnicodeDecodeError:
            return None  # protobuf's parse says so, in its words
        pos += size
    rest = len(data) - pos
    if rest == 0:
        return QueryBody(instance_id, 0, list)
    if data[pos] != _HASH_TAG or rest < 2:
        return None
    hash_len = data[pos + 1]
    stride = hash_len + 2
    if not 0 < hash_len < 0x80 or rest % stride:  # a one-byte length varint
        return None
    rows = np.frombuffer(data, np.uint8, rest, pos).reshape(-1, stride)
    if not ((rows[:, 0] == _HASH_TAG).all() and (rows[:, 1] == hash_len).all()):
        return None
    count = len(rows)
    return QueryBody(
        instance_id, count, lambda: PackedHashes(rows[:, 2:].tobytes(), hash_len, count)
    )


def _varint(data: bytes, pos: int) -> tuple[int, int]:
    """(value, position after it), or (-1, pos) for a varint past 5 bytes or
    the end."""
    value = shift = 0
    for i in range(pos, min(pos + 5, len(data))):
        byte = data[i]
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, i + 1
        shift += 7
    return -1, pos
