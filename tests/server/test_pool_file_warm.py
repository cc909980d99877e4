"""A server on --pool-file compiles the sealer's checksum loop on a thread of
its own, never in the sealer's run, and serves before it is done.

The sealer checksums every published slot with a numba-compiled loop
(pegaflow.common.checksum_rows). Compiled in the sealer's run (at the first
seal: rows() called the loop with a read-only array, another numba type than
the one warm() compiled), numba's import and compile held the GIL for
seconds: ctypes' dlopen of llvmlite's 168 MB library holds it whole (Python
3.11), and the compile's Python takes turns with the event loop at every
switch interval. On a busy host (load 18-40 on 2 cores) that froze the loop
for 13-24 s with a PP 2 engine's first saves on it: the saves timed out ("no
answer on the socket"), /stats too. Compiled before READY instead, it held
a restarted server's first answer ~1 s.

What the test sees from outside: the server logs at debug level, numba's
compiler logs every function it compiles there, and once the warm thread
logged the loop compiled nothing more is compiled while blocks are saved and
sealed (a SIGTERM seals what is queued before the server exits).
"""

from __future__ import annotations

import signal
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from pegaflow.client.pegaflow_client import PegaflowClient
from tests.kvbuf import LocalKV, hashes
from tests.procs import start_server

SHM = Path("/dev/shm")
N = 16
pytest.importorskip("numba")


@pytest.fixture
def pool_dir(tmp_path: Path) -> Iterator[Path]:
    if not SHM.is_dir():
        yield tmp_path
        return
    with tempfile.TemporaryDirectory(prefix="pegaflow-test-", dir=SHM) as d:
        yield Path(d)


def test_nothing_is_compiled_while_saved_blocks_are_sealed(
    tmp_path: Path, pool_dir: Path
) -> None:
    server = start_server(
        tmp_path, "--pool-size", "16mb", "--pool-file", str(pool_dir / "pool.bin")
    )
    try:
        deadline = time.monotonic() + 120
        while b"xxh3 row loop compiled" not in server.log.read_bytes():
            assert time.monotonic() < deadline, "the checksum loop never compiled"
            time.sleep(0.05)
        after_warm = server.log.stat().st_size
        kv = LocalKV(blocks=N)
        with PegaflowClient(server.addr, 30) as client:
            kv.register(client, "a", "ns")
            assert client.save("a", list(range(N)), hashes(N)).stored == N
    finally:
        assert server.stop(signal.SIGTERM, timeout=60) == 0
    with open(server.log, "rb") as f:
        f.seek(after_warm)
        after = f.read().decode(errors="replace")
    compiled = [line for line in after.splitlines() if " numba." in line]
    assert not compiled, (
        "numba compiled after the warm thread (the sealer's first seal): "
        + "\n".join(compiled[:5])
    )
