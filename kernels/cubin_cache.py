"""The copy kernel's compiled image, kept on disk between server starts.

A restarted server loads the cubin through the driver instead of importing
numba-cuda and compiling (pegaflow.kernels.copy_kernel): on the H100 host
that import, the compile and numba's first launch put ~4 s before a GPU
engine's first hit (benchmarks/RESULTS.md, "Warm restart").

The image is code that runs in the server's CUDA context, where every
engine's KV and the pool are mapped, so it is trusted only as far as the
kernel vouches for its files: the directory and the file must belong to the
server's user and be writable by nobody else (a file that fails is compiled
afresh and replaced, never loaded), and the file is read through no symbolic
link. A checksum in the header catches a torn or damaged file, which is
compiled again too. The key is the kernel's source, numba-cuda's version and
the GPU's architecture, so an upgrade of either never loads a stale image.

Where no private directory can be had (a read-only HOME), the kernel is
compiled at each start, as before; nothing fails.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import importlib.metadata
import logging
import os
import stat
import struct
from collections.abc import Callable
from pathlib import Path

logger = logging.getLogger(__name__)

MAGIC = b"PFCUBIN1"
# magic, sha256 of the rest, name length; then the entry name, then the cubin
_HEADER = struct.Struct("<8s32sI")
MAX_IMAGE_BYTES = 64 << 20
SOURCE = Path(__file__).with_name("copy_kernel.py")
ENV_DIR = "PEGAFLOW_KERNEL_CACHE"

Compile = Callable[[], tuple[bytes, str]]


def cache_dir() -> Path:
    """$PEGAFLOW_KERNEL_CACHE, else $XDG_CACHE_HOME/pegaflow/kernels, else
    ~/.cache/pegaflow/kernels."""
    named = os.environ.get(ENV_DIR)
    if named:
        return Path(named)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(
        os.path.expanduser("~"), ".cache"
    )
    return Path(base) / "pegaflow" / "kernels"


def image_name(arch: str) -> str:
    """The file of `arch` (e.g. "sm_90") for this source and numba-cuda."""
    try:
        numba_cuda = importlib.metadata.version("numba-cuda")
    except importlib.metadata.PackageNotFoundError:
        numba_cuda = "none"
    key = hashlib.sha256(SOURCE.read_bytes())
    key.update(f"\0{numba_cuda}\0{arch}".encode())
    return f"copy-{arch}-{key.hexdigest()[:24]}.cubin"


def load_or_compile(
    arch: str, compile_image: Compile, fresh: bool = False
) -> tuple[bytes, str]:
    """(cubin, entry name) of the copy kernel for `arch`: from the cache
    when a trusted, intact file is there (unless `fresh`: the driver refused
    the cached one); else compiled and stored."""
    directory = cache_dir()
    path = directory / image_name(arch)
    found = None if fresh else _read(directory, path)
    if found is not None:
        return found
    cubin, entry = compile_image()
    _write(directory, path, cubin, entry)
    return cubin, entry


def _private_dir(directory: Path, create: bool) -> bool:
    """Whether `directory` is ours alone (made 0700 with `create`)."""
    if create:
        try:
            directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        except OSError as exc:
            logger.info("kernel cache %s unavailable (%s): compiled each start",
                        directory, exc)  # fmt: skip
            return False
    try:
        st = os.stat(directory, follow_symlinks=False)
    except OSError:
        return False
    if not stat.S_ISDIR(st.st_mode):
        logger.warning("kernel cache %s is not a directory: not used", directory)
        return False
    if st.st_uid != os.geteuid() or stat.S_IMODE(st.st_mode) & 0o022:
        logger.warning(
            "kernel cache %s belongs to uid %d with mode %o; only this server's "
            "user may write it (chmod 700, or set %s): not used",
            directory, st.st_uid, stat.S_IMODE(st.st_mode), ENV_DIR,
        )  # fmt: skip
        return False
    return True


def _read(directory: Path, path: Path) -> tuple[bytes, str] | None:
    if not _private_dir(directory, create=False):
        return None
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno != errno.ENOENT:
            logger.warning("kernel cache %s unreadable (%s): compiling", path, exc)
        return None
    try:
        st = os.fstat(fd)
        trusted = (
            stat.S_ISREG(st.st_mode)
            and st.st_uid == os.geteuid()
            and not stat.S_IMODE(st.st_mode) & 0o022
            and st.st_nlink == 1
            and st.st_size <= MAX_IMAGE_BYTES
        )
        data = os.read(fd, MAX_IMAGE_BYTES + 1) if trusted else b""
    finally:
        os.close(fd)
    if not trusted:
        logger.warning("kernel cache %s is not this user's private file: "
                       "compiling and replacing it", path)  # fmt: skip
        return None
    return _decode(data, path)


def _decode(data: bytes, path: Path) -> tuple[bytes, str] | None:
    if len(data) < _HEADER.size:
        logger.warning("kernel cache %s is truncated: compiling", path)
        return None
    magic, digest, name_len = _HEADER.unpack_from(data)
    rest = data[_HEADER.size :]
    if (
        magic != MAGIC
        or hashlib.sha256(rest).digest() != digest
        or name_len > len(rest)
    ):
        logger.warning("kernel cache %s fails its checksum: compiling", path)
        return None
    try:
        entry = rest[:name_len].decode("ascii")
    except UnicodeDecodeError:
        logger.warning("kernel cache %s names no kernel: compiling", path)
        return None
    return rest[name_len:], entry


def _encode(cubin: bytes, entry: str) -> bytes:
    rest = entry.encode("ascii") + cubin
    return _HEADER.pack(MAGIC, hashlib.sha256(rest).digest(), len(entry)) + rest


def _write(directory: Path, path: Path, cubin: bytes, entry: str) -> None:
    """Store atomically (a private temporary file renamed over the name);
    a failure only costs the next start a compile."""
    if not _private_dir(directory, create=True):
        return
    tmp = directory / f".{path.name}.{os.getpid()}.tmp"
    try:
        fd = os.open(
            tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
            0o600,
        )  # fmt: skip
        try:
            data = memoryview(_encode(cubin, entry))
            while data:
                data = data[os.write(fd, data) :]
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except OSError as exc:
        logger.info("kernel cache %s not written (%s)", path, exc)
        with contextlib.suppress(OSError):
            os.unlink(tmp)
