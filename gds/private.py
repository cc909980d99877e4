"""The SSD tier's files hold every tenant's KV bytes, the store id and the
index: the rules of pegaflow.common.private_files, with this tier's flag and error."""

from __future__ import annotations

from pegaflow.common import private_files

from .io import SsdError

FLAG = "--ssd-cache-path"


def open_private(path: str, flags: int) -> int:
    return private_files.open_private(path, flags, FLAG, SsdError)


def check_private(fd: int, path: str) -> None:
    private_files.check_private(fd, path, FLAG, SsdError)
