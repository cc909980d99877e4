"""A pool file whose pages CUDA cannot pin is a one-line start-up error naming
--pool-file and the fix (on the H200 host a file under /tmp was refused with
cudaErrorInvalidValue and the server died with a traceback)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from pegaflow.cache.pool import HostPool
from pegaflow.cache.pool_file import PoolFileError
from pegaflow.common.cuda_driver import CudaError
from pegaflow.common.settings import PoolConfig
from tests.keeper_tools import free


@pytest.fixture(autouse=True)
def _free_keepers(tmp_path: Path) -> Iterator[None]:
    """Each pool's keeper stopped (`rm PATH`) when its test ends."""
    yield
    for p in tmp_path.iterdir():
        free(p)


class RefusingRegistrar:
    """What cudaHostRegister answers for such a file."""

    def __init__(self) -> None:
        self.unregistered: list[int] = []

    def register(self, address: int, size: int) -> None:
        raise CudaError("cudaHostRegister: cudaErrorInvalidValue")

    def unregister(self, address: int) -> None:
        self.unregistered.append(address)


def test_unpinnable_pool_file_names_the_flag_and_the_fix(tmp_path: Path) -> None:
    config = PoolConfig(size_bytes=4 << 20, pool_file=str(tmp_path / "pool.bin"),
                        show_progress=False)  # fmt: skip
    with pytest.raises(PoolFileError) as err:
        HostPool(config, RefusingRegistrar())
    text = str(err.value)
    assert text.startswith("--pool-file: CUDA cannot pin the pages of")
    assert "cudaErrorInvalidValue" in text and "/dev/shm" in text
    # the file is unlocked again: a second server may take it
    with pytest.raises(PoolFileError):
        HostPool(config, RefusingRegistrar())


def test_anonymous_pool_keeps_the_driver_error() -> None:
    with pytest.raises(CudaError):
        HostPool(PoolConfig(size_bytes=4 << 20, show_progress=False),
                 RefusingRegistrar())  # fmt: skip
