"""On-disk format of the SSD tier: a superblock per file and a header per record.

A data file is `SUPERBLOCK_BYTES` of superblock followed by records. A record is
one 4 KiB header page followed by the payload (the block's TP-shard slots, back to
back), padded to 4 KiB, so every record starts and ends 4 KiB-aligned (O_DIRECT).

The header names the store (a random id chosen when the files were initialised),
the block (namespace digest, block hash), a sequence number unique within the
store, and the payload's length and 64-bit checksum with the id of the algorithm
that made it (so files written with another one stay readable); a CRC-32 covers
the header itself. A read trusts a record only when all of these match what the
index holds and the payload hashes to the stored checksum: a torn write, an
overwritten record or flipped bits all read as a miss.
"""

from __future__ import annotations

import hashlib
import struct
import zlib
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

import numpy as np

from pegaflow.common.checksums import xxh3_64, xxh3_64_parts
from pegaflow.common.keys import NS_DIGEST_BYTES

ALIGN = 4096
HEADER_BYTES = ALIGN
SUPERBLOCK_BYTES = ALIGN
FORMAT_VERSION = 1
MAX_HASH_BYTES = 64  # as pegaflow.server.engine.MAX_HASH_BYTES
STORE_ID_BYTES = 16
# The largest payload (a block, all its TP shards) the store writes: a header
# or journal entry naming more is damage, and a start never reads more than
# this for one record.
MAX_PAYLOAD_BYTES = 1 << 30

FILE_MAGIC = b"PGFLSSD\x00"
# The first page of a file whose making began (its superblock goes last): a
# start finding it makes it again. Not zeros: a file of someone else's that
# starts with zeros (a disk image, a sparse file) is refused, not taken.
INIT_MAGIC = b"PGFLINIT"
RECORD_MAGIC = b"PGFLBLK\x00"

ChecksumName = Literal["auto", "blake2b", "blake3", "xxh3"]
Hasher = Callable[[memoryview], int]

# magic, version, file index, file count, file bytes, store id, created (unix s)
_SUPER = struct.Struct("<8sIIIQ16sd")
# magic, version, checksum id, hash length, namespace digest, block hash, store id,
# sequence, payload length, payload checksum
_HEADER = struct.Struct("<8sHBB16s64s16sQQQ")
_CRC = struct.Struct("<I")
# _HEADER and its CRC as one numpy row: header_rows fills a run's at once.
HEADER_DTYPE = np.dtype([("body", f"V{_HEADER.size}"), ("crc", "<u4")])


class FormatError(ValueError):
    """Bytes that are not a valid superblock or record header of this format."""


def align_up(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def record_bytes(payload_len: int) -> int:
    return HEADER_BYTES + align_up(payload_len)


# -- payload checksums -----------------------------------------------------------
# The checksum catches torn writes, stale records and flipped bits, not an
# adversary (whoever can write the files can write a matching checksum), so a
# fast non-cryptographic hash does: xxh3-64 hashes ~25 GB/s a core on the dev
# VM, blake3 3.6, blake2b 0.5, and the writers share cores with the save path.
# All three drop the GIL for large buffers (xxh3 in the streaming form of
# pegaflow.common.checksums), so I/O threads hash in parallel.
def _xxh3(data: memoryview) -> int:
    return xxh3_64(data)  # not xxhash's one-shot: see pegaflow.common.checksums


def _blake2b(data: memoryview) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


def _blake3(data: memoryview) -> int:
    import blake3  # lazily: the default until xxh3; old records still name it

    return int.from_bytes(blake3.blake3(data).digest(8), "little")


def _xxh3_parts(parts: Iterable[memoryview]) -> int:
    return xxh3_64_parts(parts)


def _blake2b_parts(parts: Iterable[memoryview]) -> int:
    h = hashlib.blake2b(digest_size=8)
    for part in parts:
        h.update(part)
    return int.from_bytes(h.digest(), "little")


def _blake3_parts(parts: Iterable[memoryview]) -> int:
    import blake3

    h = blake3.blake3()
    for part in parts:
        h.update(part)
    return int.from_bytes(h.digest(8), "little")


# The ids are on disk (record headers, journal entries): never renumber.
CHECKSUM_IDS = {"blake2b": 1, "blake3": 2, "xxh3": 3}
CHECKSUM_NAMES = {v: k for k, v in CHECKSUM_IDS.items()}
_HASHERS: dict[int, Hasher] = {1: _blake2b, 2: _blake3, 3: _xxh3}
_PART_HASHERS: dict[int, Callable[[Iterable[memoryview]], int]] = {
    1: _blake2b_parts,
    2: _blake3_parts,
    3: _xxh3_parts,
}


def _has_blake3() -> bool:
    try:
        import blake3  # noqa: F401
    except ImportError:
        return False
    return True


def checksum_id(name: ChecksumName) -> int:
    """The id new records get: "auto" is xxh3 (the payload checksum is what
    bounds a spill's speed on few cores). Every record names its own, so a
    store may hold records of all three."""
    if name == "auto":
        name = "xxh3"
    elif name == "blake3" and not _has_blake3():
        raise ValueError("checksum blake3: the blake3 module is not installed")
    try:
        return CHECKSUM_IDS[name]
    except KeyError:
        raise ValueError(f"unknown checksum {name!r}") from None


def unknown_checksums(ids: Iterable[int]) -> str:
    """Why records naming these checksum ids cannot be checked here ("" when
    every id is known): they were written by a newer server, and each would
    read as a checksum failure."""
    bad = sorted(set(ids) - _HASHERS.keys())
    if not bad:
        return ""
    known = ", ".join(f"{i} ({n})" for i, n in CHECKSUM_NAMES.items())
    return (
        f"records name checksum id(s) {', '.join(map(str, bad))}, which this "
        f"server does not know (it reads {known}): written by a newer version?"
    )


def hasher(checksum_id: int) -> Hasher:
    try:
        return _HASHERS[checksum_id]
    except KeyError:
        raise FormatError(f"unknown checksum id {checksum_id}") from None


def hash_parts(checksum_id: int, parts: Iterable[memoryview]) -> int:
    """The checksum of the parts' bytes back to back (as `hasher` of their
    concatenation), without joining them: a payload hashed where it lies, in
    its TP-shard slots."""
    try:
        fn = _PART_HASHERS[checksum_id]
    except KeyError:
        raise FormatError(f"unknown checksum id {checksum_id}") from None
    return fn(parts)


# -- superblock ------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Superblock:
    version: int
    file_index: int
    file_count: int
    file_bytes: int
    store_id: bytes
    created: float

    def pack(self) -> bytes:
        body = _SUPER.pack(
            FILE_MAGIC,
            self.version,
            self.file_index,
            self.file_count,
            self.file_bytes,
            self.store_id,
            self.created,
        )
        return body + _CRC.pack(zlib.crc32(body))

    @classmethod
    def unpack(cls, raw: bytes) -> Superblock:
        """Raises FormatError for anything but an intact superblock of any version."""
        size = _SUPER.size
        if len(raw) < size + _CRC.size or raw[:8] != FILE_MAGIC:
            raise FormatError("no PegaFlow SSD superblock")
        (crc,) = _CRC.unpack_from(raw, size)
        if zlib.crc32(raw[:size]) != crc:
            raise FormatError("superblock checksum mismatch")
        _, version, index, count, nbytes, store_id, created = _SUPER.unpack_from(raw)
        return cls(version, index, count, nbytes, store_id, created)


# -- record header ---------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class RecordHeader:
    ns_digest: bytes
    block_hash: bytes
    store_id: bytes
    seq: int
    payload_len: int
    checksum: int
    checksum_id: int

    def pack_into(self, buf: memoryview) -> None:
        """Write the header at the start of buf (the rest of the page stays as is:
        callers keep it zero)."""
        body = _HEADER.pack(
            RECORD_MAGIC,
            FORMAT_VERSION,
            self.checksum_id,
            len(self.block_hash),
            self.ns_digest,
            self.block_hash,
            self.store_id,
            self.seq,
            self.payload_len,
            self.checksum,
        )
        buf[: len(body)] = body
        buf[len(body) : len(body) + _CRC.size] = _CRC.pack(zlib.crc32(body))

    @classmethod
    def unpack(cls, buf: memoryview | bytes) -> RecordHeader:
        size = _HEADER.size
        raw = bytes(buf[: size + _CRC.size])
        if len(raw) < size + _CRC.size or raw[:8] != RECORD_MAGIC:
            raise FormatError("no record header")
        (crc,) = _CRC.unpack_from(raw, size)
        if zlib.crc32(raw[:size]) != crc:
            raise FormatError("record header checksum mismatch")
        fields = _HEADER.unpack_from(raw)
        _, version, algo, hash_len, ns, block_hash, store_id, seq, plen, csum = fields
        if version != FORMAT_VERSION:
            raise FormatError(f"record of format version {version}")
        if not 0 < hash_len <= MAX_HASH_BYTES:
            raise FormatError(f"record hash length {hash_len}")
        return cls(ns, block_hash[:hash_len], store_id, seq, plen, csum, algo)


class HeaderFields(Protocol):
    """What a record header is made of (a gds.ring.Record has it)."""

    ns_digest: bytes
    block_hash: bytes
    seq: int
    payload_len: int
    checksum: int
    checksum_id: int


def header_rows(recs: Sequence[HeaderFields], store_id: bytes) -> np.ndarray:
    """RecordHeader.pack_into of many records at once, one HEADER_DTYPE row
    each, byte for byte what it writes. A struct.pack and a zlib.crc32 per
    record, mapped over the run, are the cheapest per record in CPython
    (measured: numpy column assignments cost more than the pack); what goes
    is the dataclass, the call chain and the page writes per record."""
    bodies = [
        _HEADER.pack(
            RECORD_MAGIC,
            FORMAT_VERSION,
            r.checksum_id,
            len(r.block_hash),
            r.ns_digest,
            r.block_hash,
            store_id,
            r.seq,
            r.payload_len,
            r.checksum,
        )
        for r in recs
    ]
    return crc_rows(bodies, HEADER_DTYPE)


def crc_rows(bodies: list[bytes], dtype: np.dtype) -> np.ndarray:
    """Rows of `dtype` (fields "body", "crc", any others zero): each body
    followed by its CRC-32, the framing of record headers and journal
    entries."""
    rows = np.zeros(len(bodies), dtype)
    rows["body"] = np.frombuffer(b"".join(bodies), dtype["body"])
    rows["crc"] = list(map(zlib.crc32, bodies))
    return rows


def check_key(ns_digest: bytes, block_hash: bytes) -> None:
    if len(ns_digest) != NS_DIGEST_BYTES:
        raise ValueError(f"namespace digest: need {NS_DIGEST_BYTES} bytes")
    if not 0 < len(block_hash) <= MAX_HASH_BYTES:
        raise ValueError(f"block hash: need 1..{MAX_HASH_BYTES} bytes")
