"""A pool file holds every tenant's KV cache and decides what a restart
serves: the server opens only a regular file of its own user that no one
else can change, with one link, and names --pool-file and the fix otherwise
(a symlink or a file another user planted in /dev/shm would hand that user
the cache); read bits for others are taken away."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from pegaflow.cache.pool import HostPool
from pegaflow.cache.pool_file import PoolFileError
from pegaflow.common.settings import PoolConfig

SIZE = 4 << 20


def _open(path: Path) -> HostPool:
    cfg = PoolConfig(SIZE, prefault_threads=1, show_progress=False, pool_file=str(path))
    return HostPool(cfg)


def test_a_new_pool_file_is_private(tmp_path: Path) -> None:
    path = tmp_path / "pool.bin"
    _open(path).close()
    assert path.stat().st_mode & 0o777 == 0o600
    _open(path).close()  # and opens again


@pytest.mark.parametrize(
    "spoil, says",
    [
        (lambda p, t: os.chmod(p, 0o664), "mode 664.*chmod 600"),
        (lambda p, t: os.link(p, t / "second"), "hard links"),
        (
            lambda p, t: (os.rename(p, t / "real"), os.symlink(t / "real", p)),
            "symbolic link",
        ),
    ],  # fmt: skip
    ids=["group-writable", "hard-linked", "symlink"],
)
def test_a_pool_file_others_can_reach_is_refused(tmp_path: Path, spoil, says) -> None:
    path = tmp_path / "pool.bin"
    _open(path).close()
    spoil(path, tmp_path)
    with pytest.raises(PoolFileError, match=f"--pool-file: .*{says}"):
        _open(path)


@pytest.mark.skipif(os.geteuid() != 0, reason="chown to another user needs root")
def test_a_pool_file_of_another_user_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "pool.bin"
    _open(path).close()
    os.chown(path, 65534, 65534)
    with pytest.raises(PoolFileError, match="belongs to uid 65534"):
        _open(path)


def test_a_pool_file_others_could_only_read_is_made_private(tmp_path: Path) -> None:
    path = tmp_path / "pool.bin"
    _open(path).close()
    os.chmod(path, 0o644)
    _open(path).close()
    assert path.stat().st_mode & 0o777 == 0o600


def test_a_directory_is_refused(tmp_path: Path) -> None:
    with pytest.raises(PoolFileError, match="--pool-file"):
        _open(tmp_path)
