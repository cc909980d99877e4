"""The copy kernel's cubin on disk (pegaflow.kernels.cubin_cache): loaded
only from this user's private, intact file; anything else is compiled
afresh and replaced, never loaded, and no cache at all costs only a compile.
"""

from __future__ import annotations

import os

import pytest

from pegaflow.kernels import cubin_cache

IMAGE = (b"\x7fELF" + bytes(range(256)) * 4, "_Z6kernel")


@pytest.fixture
def cache(tmp_path, monkeypatch):
    directory = tmp_path / "kernels"
    monkeypatch.setenv(cubin_cache.ENV_DIR, str(directory))
    return directory


class Compiler:
    def __init__(self, image=IMAGE) -> None:
        self.calls = 0
        self.image = image

    def __call__(self):
        self.calls += 1
        return self.image


def _file(cache):
    (path,) = cache.glob("copy-*.cubin")
    return path


def test_compiled_once_then_loaded(cache) -> None:
    compile_image = Compiler()
    assert cubin_cache.load_or_compile("sm_90", compile_image) == IMAGE
    assert cubin_cache.load_or_compile("sm_90", compile_image) == IMAGE
    assert compile_image.calls == 1
    assert oct(os.stat(cache).st_mode & 0o777) == oct(0o700)
    assert oct(os.stat(_file(cache)).st_mode & 0o777) == oct(0o600)
    assert not list(cache.glob(".*tmp"))


def test_the_key_names_the_architecture_and_the_source(cache, monkeypatch) -> None:
    a, b = cubin_cache.image_name("sm_90"), cubin_cache.image_name("sm_100")
    assert a != b and a.startswith("copy-sm_90-")
    source = cache.parent / "copy_kernel.py"
    source.write_text("changed kernel")
    monkeypatch.setattr(cubin_cache, "SOURCE", source)
    assert cubin_cache.image_name("sm_90") != a


@pytest.mark.parametrize("damage", ["flip", "truncate", "empty", "magic"])
def test_a_damaged_file_is_compiled_again_and_replaced(cache, damage) -> None:
    cubin_cache.load_or_compile("sm_90", Compiler())
    path = _file(cache)
    data = bytearray(path.read_bytes())
    if damage == "flip":
        data[-7] ^= 0x10
    elif damage == "truncate":
        data = data[: len(data) // 2]
    elif damage == "empty":
        data = bytearray()
    else:
        data[:8] = b"NOTCUBIN"
    path.write_bytes(bytes(data))
    fresh = (b"fresh cubin", "_Z5fresh")
    again = Compiler(fresh)
    assert cubin_cache.load_or_compile("sm_90", again) == fresh
    assert again.calls == 1
    assert cubin_cache.load_or_compile("sm_90", Compiler()) == fresh  # stored


def test_a_file_others_may_write_is_never_loaded(cache) -> None:
    cubin_cache.load_or_compile("sm_90", Compiler())
    path = _file(cache)
    os.chmod(path, 0o666)
    fresh = (b"recompiled", "_Z1k")
    assert cubin_cache.load_or_compile("sm_90", Compiler(fresh)) == fresh
    assert oct(os.stat(path).st_mode & 0o777) == oct(0o600)  # replaced


def test_a_symbolic_link_is_not_followed(cache, tmp_path) -> None:
    cubin_cache.load_or_compile("sm_90", Compiler())
    path = _file(cache)
    elsewhere = tmp_path / "planted.cubin"
    elsewhere.write_bytes(path.read_bytes())
    os.chmod(elsewhere, 0o600)
    path.unlink()
    path.symlink_to(elsewhere)
    fresh = (b"not the planted one", "_Z1k")
    assert cubin_cache.load_or_compile("sm_90", Compiler(fresh)) == fresh
    assert not path.is_symlink()


def test_a_directory_others_may_write_is_not_used(cache) -> None:
    cache.mkdir(mode=0o700)
    os.chmod(cache, 0o777)
    compile_image = Compiler()
    for _ in range(2):
        assert cubin_cache.load_or_compile("sm_90", compile_image) == IMAGE
    assert compile_image.calls == 2
    assert not list(cache.iterdir())


def test_no_cache_directory_still_compiles(cache) -> None:
    cache.parent.mkdir(exist_ok=True)
    cache.write_text("a file where the directory should be")
    compile_image = Compiler()
    assert cubin_cache.load_or_compile("sm_90", compile_image) == IMAGE
    assert cubin_cache.load_or_compile("sm_90", compile_image) == IMAGE
    assert compile_image.calls == 2


def test_fresh_skips_a_cached_image(cache) -> None:
    cubin_cache.load_or_compile("sm_90", Compiler())
    other = (b"other", "_Z1o")
    assert cubin_cache.load_or_compile("sm_90", Compiler(other), fresh=True) == other
    assert cubin_cache.load_or_compile("sm_90", Compiler()) == other
