"""Value types and constants every side shares: the engine's client, the
connector, the server's bookkeeping and the SSD tier. Nothing here moves bytes
or imports a server module; the client and vLLM import this file.
"""

from __future__ import annotations

import numpy as np

from pegaflow.cache.hll import packed_hash64

BlockHash = bytes  # an engine's prefix-cache block hash (vLLM: chained sha256)
NamespaceName = str  # the engine's digest of what makes KV bytes compatible
NamespaceId = int  # the server's number for a namespace, unique over its life
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
        """pegaflow.cache.hll.hash64 of every hash (computed once, shared by the
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
