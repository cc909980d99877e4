"""The data files files.py checked at start, opened again by what must not
follow a path: another flag set (O_DIRECT) or a library that opens by name
(kvikio). Apart from the backends (io, kvikio_io) so that both use it."""

from __future__ import annotations

import os


class SsdError(RuntimeError):
    """The SSD tier cannot start as configured; the message says why and what to
    change."""


def reopen_path(checked: int | None, path: str) -> str:
    """Where to open again the data file files.py checked (and locked) at
    descriptor `checked`, with other flags (O_DIRECT) or by a library that
    opens by name (kvikio): /proc/self/fd/<checked>, which reaches that very
    file whatever `path` names by now. `path` itself without /proc (then
    `same_file` tells a file swapped in since the check) or without a
    checked descriptor (tests)."""
    if checked is None:
        return path
    proc = f"/proc/self/fd/{checked}"
    return proc if os.path.exists(proc) else path


def same_file(checked: int | None, fd: int, path: str) -> None:
    """Raise SsdError unless descriptor fd is open on the file checked at
    descriptor `checked` (same device and inode)."""
    if checked is None:
        return
    a, b = os.fstat(checked), os.fstat(fd)
    if (a.st_dev, a.st_ino) != (b.st_dev, b.st_ino):
        raise SsdError(
            f"ssd cache {path}: the path names another file than the one "
            "checked at start (replaced meanwhile); refusing to use it"
        )
