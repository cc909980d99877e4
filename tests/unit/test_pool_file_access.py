"""A kept pool holds every tenant's KV cache and decides what a restart serves.
Its path is now a keeper's socket (pegaflow.cache.pool_keeper), mode 0600
from its creation; an old regular pool file there is adopted only if it is a
file of this user that no one else can change, with one link: --pool-file and
the fix are named otherwise (a symlink or a file another user planted in
/dev/shm would hand that user the cache); read bits for others are taken
away. Another user's socket or keeper: tests/server/test_pool_keeper.py."""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from pegaflow.cache.pool import HostPool
from pegaflow.cache.pool_file import PoolFileError
from pegaflow.common.settings import PoolConfig
from tests.keeper_tools import free, to_old_file

SIZE = 4 << 20


@pytest.fixture(autouse=True)
def _free_keepers(tmp_path: Path) -> Iterator[None]:
    yield
    for p in tmp_path.iterdir():
        free(p)


def _open(path: Path) -> HostPool:
    cfg = PoolConfig(SIZE, prefault_threads=1, show_progress=False, pool_file=str(path))
    return HostPool(cfg)


def _old_file(path: Path) -> None:
    """A regular pool file as a server before 2026-12-05 left it."""
    _open(path).close()
    to_old_file(path)


def test_a_new_pool_is_a_private_socket(tmp_path: Path) -> None:
    path = tmp_path / "pool.bin"
    _open(path).close()
    st = path.lstat()
    assert stat.S_ISSOCK(st.st_mode) and st.st_mode & 0o777 == 0o600
    pool = _open(path)  # and opens again, kept
    assert not pool.file.fresh
    pool.close()


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
def test_an_old_pool_file_others_can_reach_is_refused(
    tmp_path: Path, spoil, says
) -> None:
    path = tmp_path / "pool.bin"
    _old_file(path)
    spoil(path, tmp_path)
    with pytest.raises(PoolFileError, match=f"--pool-file: .*{says}"):
        _open(path)


def test_a_symlink_to_a_keeper_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "pool.bin"
    _open(path).close()
    os.symlink(path, tmp_path / "link")
    with pytest.raises(PoolFileError, match="--pool-file: .*symbolic link"):
        _open(tmp_path / "link")


@pytest.mark.skipif(os.geteuid() != 0, reason="chown to another user needs root")
def test_an_old_pool_file_of_another_user_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "pool.bin"
    _old_file(path)
    os.chown(path, 65534, 65534)
    with pytest.raises(PoolFileError, match="belongs to uid 65534"):
        _open(path)
    assert path.is_file()  # never replaced


def test_an_old_pool_file_others_could_only_read_is_adopted_private(
    tmp_path: Path,
) -> None:
    path = tmp_path / "pool.bin"
    _old_file(path)
    os.chmod(path, 0o644)
    pool = _open(path)
    assert not pool.file.fresh
    pool.close()
    assert path.is_socket() and path.lstat().st_mode & 0o777 == 0o600


def test_a_directory_is_refused(tmp_path: Path) -> None:
    with pytest.raises(PoolFileError, match="--pool-file"):
        _open(tmp_path)
