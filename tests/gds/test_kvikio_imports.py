"""The kvikio backend against a stub of kvikio 26.x's module tree (no GPU, no
kvikio here): kvikio 26.10's package __init__ does not import `kvikio.defaults`,
so the backend must import every submodule it uses by name. The stub is a real
package on disk, imported through the normal machinery, whose CuFile does real
POSIX I/O; the bytes are checked."""

from __future__ import annotations

import ctypes
import os
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from pegaflow.gds import SsdError, kvikio_io
from pegaflow.gds.io import same_file

_CUFILE = """
import os


class _Done:
    def __init__(self, n):
        self.n = n

    def get(self):
        return self.n


class CuFile:
    def __init__(self, path, flags="r"):
        self.fd = os.open(path, os.O_RDWR)

    def pread(self, buf, size, file_offset=0):
        got = os.preadv(self.fd, [memoryview(buf)[:size]], file_offset)
        return _Done(got)

    def pwrite(self, buf, size, file_offset=0):
        return _Done(os.pwrite(self.fd, memoryview(buf)[:size], file_offset))

    def fileno(self):
        return self.fd

    def close(self):
        os.close(self.fd)
"""

_DEFAULTS = """
_settings = {"num_threads": 1, "auto_direct_io_read": False,
             "auto_direct_io_write": False}


def set(name, value):
    _settings[name] = value


def get(name):
    return _settings[name]


def is_compat_mode_preferred():
    return True
"""


def _stub(root: Path, reexport: bool) -> None:
    pkg = root / "kvikio"
    pkg.mkdir()
    init = '__version__ = "26.10.0-stub"\n'
    if reexport:
        init += "from kvikio.cufile import CuFile\n"
    (pkg / "__init__.py").write_text(init)
    (pkg / "cufile.py").write_text(textwrap.dedent(_CUFILE))
    (pkg / "defaults.py").write_text(textwrap.dedent(_DEFAULTS))


@pytest.fixture(params=[True, False], ids=["reexported", "cufile-only"])
def stub_kvikio(
    request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tmp_path / "site"
    root.mkdir()
    _stub(root, request.param)
    for name in [m for m in sys.modules if m == "kvikio" or m.startswith("kvikio.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.syspath_prepend(str(root))
    yield
    for name in [m for m in sys.modules if m == "kvikio" or m.startswith("kvikio.")]:
        del sys.modules[name]


def test_kvikio_26_without_defaults_imported(stub_kvikio: None, tmp_path: Path) -> None:
    """Scenario: kvikio 26.10, whose `import kvikio` leaves `kvikio.defaults`
    unimported (the H200 machine failed 45 of 57 gds tests with "module
    'kvikio' has no attribute 'defaults'"). The backend opens, configures its
    thread pool, reports compat mode and moves bytes both ways."""
    import kvikio

    assert not hasattr(kvikio, "defaults")  # the stub behaves like 26.10
    path = tmp_path / "data"
    path.write_bytes(bytes(1 << 16))
    io = kvikio_io.KvikioIO([str(path)], threads=6)
    try:
        assert io.mode == "kvikio-compat"
        assert sys.modules["kvikio.defaults"].get("num_threads") == 6
        src = np.random.default_rng(1).integers(0, 256, 3 * 4096, np.uint8)
        dst = np.zeros_like(src)
        io.pwritev(0, [(src.ctypes.data, 4096), (src.ctypes.data + 4096, 8192)], 4096)
        io.pread(0, dst.ctypes.data, dst.nbytes, 4096)
        assert bytes(dst) == bytes(src)
        assert path.read_bytes()[:4096] == bytes(4096)  # the offset was kept
        one = (ctypes.c_ubyte * 4096)()
        io.preadv(0, [(ctypes.addressof(one), 4096)], 8192)
        assert bytes(one) == bytes(src[4096:8192])
    finally:
        io.close()


def test_unavailable_names_the_missing_driver(stub_kvikio: None) -> None:
    """Scenario: kvikio imports (26.x layout) but the machine has no CUDA
    driver: the reason given is the driver, not an import error."""
    why = kvikio_io.unavailable()
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        assert why is not None and "CUDA driver" in why
    else:
        assert why is None


def test_kvikio_opens_the_checked_file_not_the_path(
    stub_kvikio: None, tmp_path: Path
) -> None:
    """Regression: kvikio opens by name, after files.py checked the file on
    a descriptor; a file swapped in between was the one kvikio wrote. Now it
    opens the checked file itself (/proc/self/fd/<fd>) and checks kvikio's
    descriptor is that file."""
    path = tmp_path / "data"
    path.write_bytes(bytes(1 << 16))
    checked = os.open(path, os.O_RDWR)
    decoy = tmp_path / "decoy"
    decoy.write_bytes(b"x" * (1 << 16))
    os.rename(decoy, path)  # the path names another file now
    try:
        io = kvikio_io.KvikioIO([str(path)], threads=2, checked=[checked])
        try:
            src = np.random.default_rng(2).integers(0, 256, 4096, np.uint8)
            io.pwrite(0, src.ctypes.data, 4096, 0)
            io.sync()
        finally:
            io.close()
        assert os.pread(checked, 4096, 0) == bytes(src)
        assert path.read_bytes() == b"x" * (1 << 16)
        other = os.open(path, os.O_RDONLY)
        try:  # a descriptor of another file than the checked one is refused
            with pytest.raises(SsdError, match="another file"):
                same_file(checked, other, str(path))
        finally:
            os.close(other)
    finally:
        os.close(checked)
