"""Value types and constants every side shares: the engine's client, the
connector, the server's bookkeeping and the SSD tier. Nothing here moves bytes
or imports a server module; the client and vLLM import this file.
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass

import numpy as np

from .hash64 import packed_hash64

BlockHash = bytes  # an engine's prefix-cache block hash (vLLM: chained sha256)
NamespaceName = str  # the engine's digest of what makes KV bytes compatible
NamespaceId = int  # the server's number for a namespace, unique over its life
NamespaceDigest = (
    bytes  # namespace_digest(): the key of a namespace on disk and between nodes
)
Key = tuple[NamespaceId, BlockHash]  # one cached block
# One item of a Load: (lease id, first leased block, destination block ids).
LoadSpec = tuple[int, int, np.ndarray]

MAX_HASH_BYTES = 64  # a longer block hash is refused (and cannot be framed)
IPC_HANDLE_BYTES = 64  # cudaIpcMemHandle_t and cudaIpcEventHandle_t
UUID_BYTES = 16  # a CUDA device's uuid
TOKEN_BYTES = 16  # an owner token (see pegaflow.cache.instances.Worker.check_owner)


class PackedHashes:
    """count hashes of hash_len bytes each, back to back in buf from offset: a
    query as it came off the wire, with no Python object per hash until one is
    asked for (list() on a miss path)."""

    __slots__ = ("buf", "offset", "hash_len", "count", "_h64", "_list")

    def __init__(self, buf: bytes, hash_len: int, count: int, offset: int = 0) -> None:
        # hash_len is checked by the engine (pegaflow.server.engine.check_hashes).
        if offset + hash_len * count > len(buf):
            raise ValueError(f"{count} hashes of {hash_len} bytes overrun the buffer")
        self.buf, self.offset, self.hash_len, self.count = buf, offset, hash_len, count
        self._h64: np.ndarray | None = None
        self._list: list[bytes] | None = None

    @classmethod
    def pack(cls, hashes: list[bytes], hash_len: int) -> PackedHashes:
        """hashes must all be hash_len bytes long."""
        packed = cls(b"".join(hashes), hash_len, len(hashes))
        packed._list = hashes
        return packed

    def __len__(self) -> int:
        return self.count

    @property
    def h64(self) -> np.ndarray:
        """pegaflow.common.hash64.hash64 of every hash (computed once, shared by the
        index probe and the miss breakdown)."""
        if self._h64 is None:
            self._h64 = packed_hash64(self.buf, self.offset, self.hash_len, self.count)
        return self._h64

    def matrix(self) -> np.ndarray:
        """(count, hash_len) uint8 view of the hashes."""
        return np.frombuffer(
            self.buf, np.uint8, self.hash_len * self.count, self.offset
        ).reshape(self.count, self.hash_len)

    def list(self) -> list[bytes]:
        if self._list is None:
            self._list = np.frombuffer(
                self.buf, f"V{self.hash_len}", self.count, self.offset
            ).tolist()
        return self._list


NS_DIGEST_BYTES = 16  # a namespace's digest on disk and between nodes


def namespace_tag(name: str) -> str:
    """A one-way label of a namespace for /metrics, /stats and logs: equal
    names give equal tags, and a tag does not give the name back (a namespace
    made with a tenant secret cannot be read off the server's outputs)."""
    return hashlib.sha256(b"pegaflow-ns-tag" + name.encode()).hexdigest()[:12]


# The name of a namespace a warm restart found in its pool file, known only
# by its digest until an engine registers it (not printable: no client's).
RECOVERED_PREFIX = "\0recovered:"


@dataclass(slots=True)
class Namespace:
    name: str  # never shown: clients see the tag (see namespace_tag)
    id: int
    tp_size: int  # shards per block: the TP size, or 1 for replicated KV (MLA)
    num_layers: int
    slot_bytes: int
    signature: tuple[int, ...]
    slot_skew: int = 0  # engine pages' offset modulo 4 KiB (see slabs.SlabAllocator)

    @property
    def slot_class(self) -> tuple[int, int]:
        return (self.slot_bytes, self.slot_skew)

    @property
    def block_bytes(self) -> int:
        """Pool bytes one block takes: a slot per shard."""
        return self.slot_bytes * self.tp_size

    @property
    def tag(self) -> str:
        return namespace_tag(self.name)

    @property
    def digest(self) -> bytes:
        """namespace_digest of its name and geometry; for a namespace a warm
        restart knows only by digest (a placeholder until an engine names it:
        pegaflow.server.warm_restart), that digest, the same before and after
        the engine's namespace adopts it (tiers key their caches by id)."""
        if self.name.startswith(RECOVERED_PREFIX):
            return bytes.fromhex(self.name[len(RECOVERED_PREFIX) :])
        return namespace_digest(self.name, self.signature)


def namespace_digest(name: str, signature: tuple[int, ...] = ()) -> bytes:
    """A stable 16-byte digest of a namespace: its name plus its byte geometry
    (Namespace.signature), so blocks of a namespace whose
    geometry changed under the same name never load."""
    h = hashlib.blake2b(name.encode(), digest_size=NS_DIGEST_BYTES)
    h.update(struct.pack(f"<{len(signature)}q", *signature))
    return h.digest()
