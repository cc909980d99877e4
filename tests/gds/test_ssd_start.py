"""Start-up: clear errors for bad paths and too little space, files of another
format or capacity, O_DIRECT refused, and the backend choice."""

from __future__ import annotations

import errno
import logging
import os
import struct
import sys
import types
import zlib
from pathlib import Path

import numpy as np
import pytest

from pegaflow.gds import SsdError, SsdTier, kvikio_io
from pegaflow.gds import io as gds_io
from pegaflow.gds.format import FORMAT_VERSION
from tests.gds.helpers import config, load, opened, spill


def test_missing_directory(tmp_path: Path) -> None:
    cfg = config(tmp_path / "nope")
    with pytest.raises(SsdError, match="directory .*nope does not exist"):
        SsdTier(cfg)


def test_path_is_a_directory_or_unwritable(tmp_path: Path) -> None:
    (tmp_path / "cache0.bin").mkdir()
    with pytest.raises(SsdError, match="not a regular file"):
        SsdTier(config(tmp_path))
    # sysfs takes no new files, not even from root
    with pytest.raises(SsdError, match="cannot create files in /sys"):
        SsdTier(config(Path("/sys")))


def test_not_enough_space(tmp_path: Path) -> None:
    with pytest.raises(SsdError, match="not enough space .*need"):
        SsdTier(config(tmp_path, capacity=1 << 60))


def test_foreign_file_is_never_overwritten(tmp_path: Path) -> None:
    precious = tmp_path / "cache0.bin"
    precious.write_bytes(b"somebody's database" * 1000)
    with pytest.raises(SsdError, match="not a PegaFlow SSD cache file"):
        SsdTier(config(tmp_path))
    assert precious.read_bytes().startswith(b"somebody's database")


def test_capacity_change_reinitialises_or_refuses(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with opened(config(tmp_path)) as tier:
        spill(tier, [1, 2])
    with pytest.raises(SsdError, match="capacity changed.*reinit"):
        SsdTier(config(tmp_path, capacity=32 << 20, on_mismatch="refuse"))
    with caplog.at_level(logging.WARNING), opened(config(tmp_path, 32 << 20)) as tier:
        assert "capacity changed" in tier.store.recovery.reinitialised
        assert tier.store.recovery.blocks == 0 and not load(tier, [1, 2]).any()
        assert os.path.getsize(tier.config.paths[0]) == 32 << 20
    assert "reinitialising (capacity changed" in caplog.text


def test_format_version_change_reinitialises(tmp_path: Path) -> None:
    cfg = config(tmp_path)
    with opened(cfg) as tier:
        spill(tier, [1])
    with open(cfg.paths[0], "r+b") as f:  # as if another version wrote it
        raw = bytearray(f.read(64))
        struct.pack_into("<I", raw, 8, FORMAT_VERSION + 1)
        struct.pack_into("<I", raw, 52, zlib.crc32(bytes(raw[:52])))
        f.seek(0)
        f.write(raw)
    with opened(cfg) as tier:
        why = tier.store.recovery.reinitialised
        assert f"format version {FORMAT_VERSION + 1}" in why
        assert not load(tier, [1]).any()


def test_file_set_change_reinitialises(tmp_path: Path) -> None:
    with opened(config(tmp_path, capacity=32 << 20, files=2)) as tier:
        spill(tier, list(range(8)))
    with opened(config(tmp_path, capacity=16 << 20, files=1)) as tier:
        assert "file set changed" in tier.store.recovery.reinitialised


def test_odirect_refused_falls_back_or_fails(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Like tmpfs on older kernels: open with O_DIRECT fails with EINVAL."""
    real_open = os.open

    def no_direct(path: str, flags: int, *args: int) -> int:
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *args)

    monkeypatch.setattr(gds_io.os, "open", no_direct)
    with pytest.raises(SsdError, match="O_DIRECT not usable"):
        SsdTier(config(tmp_path, direct_io="on", backend="posix"))
    posix = config(tmp_path, files=2, backend="posix")
    with caplog.at_level(logging.WARNING), opened(posix) as tier:
        assert tier.mode == "posix-buffered"
        spill(tier, [1, 2, 3])
        assert load(tier, [1, 2, 3]).all()
    assert "refuses O_DIRECT" in caplog.text


def test_backend_kvikio_needs_kvikio_and_a_driver(tmp_path: Path) -> None:
    why = kvikio_io.unavailable()
    if why is None:
        pytest.skip("kvikio and a CUDA driver are here")
    with pytest.raises(SsdError, match="--ssd-backend kvikio"):
        SsdTier(config(tmp_path, backend="kvikio"))


class _FakeFuture:
    def __init__(self, n: int) -> None:
        self.n = n

    def get(self) -> int:
        return self.n


class _FakeCuFile:
    """kvikio.CuFile in compat mode, over os.pread / os.pwrite."""

    def __init__(self, path: str, flags: str) -> None:
        assert flags == "r+"
        self.fd = os.open(path, os.O_RDWR)

    def pread(self, buf: np.ndarray, size: int, file_offset: int) -> _FakeFuture:
        data = os.pread(self.fd, size, file_offset)
        buf[: len(data)] = np.frombuffer(data, np.uint8)
        return _FakeFuture(len(data))

    def pwrite(self, buf: np.ndarray, size: int, file_offset: int) -> _FakeFuture:
        return _FakeFuture(os.pwrite(self.fd, buf[:size].tobytes(), file_offset))

    def is_direct_io_supported(self) -> bool:
        return False

    def close(self) -> None:
        os.close(self.fd)


def test_kvikio_backend_same_format(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The kvikio path, against a stand-in module: blocks written by POSIX load
    through it and back, so both backends share one format."""
    cfg = config(tmp_path, backend="posix")
    with opened(cfg) as tier:
        spill(tier, [1, 2])
    settings: dict[str, object] = {}
    defaults = types.SimpleNamespace(
        is_compat_mode_preferred=lambda: True,
        set=settings.__setitem__,
        get=settings.__getitem__,
    )
    fake = types.SimpleNamespace(
        CuFile=_FakeCuFile, defaults=defaults, __version__="fake"
    )
    monkeypatch.setitem(sys.modules, "kvikio", fake)
    monkeypatch.setitem(sys.modules, "kvikio.defaults", defaults)  # a submodule
    monkeypatch.setattr(kvikio_io, "unavailable", lambda: None)
    with opened(config(tmp_path, backend="kvikio")) as tier:
        assert tier.mode == "kvikio-compat"
        assert settings["num_threads"] == 2 + 4  # as deep as the tier's threads
        assert settings["auto_direct_io_write"] is True
        assert load(tier, [1, 2]).all()
        spill(tier, [3])
    with opened(cfg) as tier:
        assert load(tier, [1, 2, 3]).all()


def test_second_server_on_the_same_files_is_refused(tmp_path: Path) -> None:
    cfg = config(tmp_path)
    with opened(cfg), pytest.raises(SsdError, match="in use by another process"):
        SsdTier(cfg)
    with opened(cfg) as tier:  # released at close
        assert tier.store.recovery.reinitialised == ""


def test_a_file_starting_with_zeros_is_not_taken_for_a_new_one(
    tmp_path: Path,
) -> None:
    """A disk image (an ISO starts with 32 KiB of zeros) or a sparse file
    named by mistake: its all-zero first page once read as a cache file whose
    making was cut short, so it was chmod'ed, truncated and overwritten."""
    image = tmp_path / "cache0.bin"
    data = b"\0" * 32768 + b"an ISO's volume descriptors" * 2000
    image.write_bytes(data)
    image.chmod(0o644)
    with pytest.raises(SsdError, match=r"not a PegaFlow SSD cache file \(its first"):
        SsdTier(config(tmp_path))
    assert image.read_bytes() == data
    assert image.stat().st_mode & 0o777 == 0o644


def test_a_file_whose_making_was_cut_short_is_made_again(tmp_path: Path) -> None:
    """The server's own unfinished file (its first page says so, the
    superblock not yet written) is made again, not refused."""
    from pegaflow.gds.format import INIT_MAGIC

    unfinished = tmp_path / "cache0.bin"
    unfinished.write_bytes(INIT_MAGIC.ljust(8192, b"\0"))
    unfinished.chmod(0o600)
    tier = SsdTier(config(tmp_path))
    try:
        assert unfinished.read_bytes()[:8] != INIT_MAGIC
    finally:
        tier.close()
