"""xxh3-64, the checksum of SSD records, pool-file slot rows and the slots a
peer serves, computed in the one form that lets other threads run meanwhile
on every python-xxhash this project accepts (>= 3.0).

python-xxhash's streaming `update` drops the GIL past 64 KiB in every
version; its one-shot functions (`xxh3_64_intdigest`) hold it for the whole
buffer before 4.0. Measured on 3.6.0, the version the H200 machine carries
(2026-12-04, dev VM): while one thread hashed 2 MiB buffers one-shot, a
thread sleeping 1 ms resumed 5.3 ms late at P50 (the GIL's switch
interval), against 0.09 ms with the streaming form. Held, it stalls the
event loop behind every reader or hasher thread and serialises hashes meant
to run in parallel (remote.slot_sums).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable

import xxhash

_local = threading.local()  # one hasher per thread, reset per checksum


def _hasher() -> xxhash.xxh3_64:
    h = getattr(_local, "xxh3", None)
    if h is None:
        h = _local.xxh3 = xxhash.xxh3_64()
    return h


def xxh3_64(data: object) -> int:
    """xxh3-64 of a buffer (bytes, memoryview, numpy array)."""
    h = _hasher()
    h.reset()
    h.update(data)
    return h.intdigest()


def xxh3_64_parts(parts: Iterable[object]) -> int:
    """xxh3-64 of the parts' bytes back to back, without joining them."""
    h = _hasher()
    h.reset()
    for part in parts:
        h.update(part)
    return h.intdigest()
