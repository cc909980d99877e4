"""A server whose log cannot be written keeps serving.

The event loop logs every save and load at debug level. Written to stderr
from the loop, a write that blocks (a log file on a disk whose ext4 journal
waits for discards: seen for 12-33 s on the busy dev VM, beside a PP 2
engine's saves; a pipe nobody reads) froze the loop with it: saves past
their deadline, /stats timing out. Lines now go through a queue to a thread
of their own (pegaflow.server.cli).

Here stderr is a pipe the test never reads: its 64 KiB fill with debug
lines within a few hundred requests, after which every write blocks. Before
the fix the saves below stopped being answered there (the client's
deadline ends the test).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

from pegaflow.client.pegaflow_client import PegaflowClient
from tests.kvbuf import LocalKV, hashes
from tests.procs import ROOT, _env, _readline

PIPE_BYTES = 64 << 10
SAVES = 1500  # each logs two debug lines (~200 B): past the pipe's buffer


def test_saves_are_answered_while_stderr_is_blocked() -> None:
    read_end, write_end = os.pipe()
    proc = subprocess.Popen(
        [
            sys.executable, "-m", "pegaflow.cli", "--addr", "127.0.0.1:0",
            "--http-addr", "127.0.0.1:0", "--no-progress", "--log-level", "debug",
            "--pool-size", "16mb",
        ],
        stdout=subprocess.PIPE, stderr=write_end, env=_env(), cwd=ROOT,
    )  # fmt: skip
    os.close(write_end)
    try:
        line = _readline(proc, 60)
        assert line.startswith("READY"), line
        addr = dict(p.split("=", 1) for p in line.split()[1:])["grpc"]
        kv = LocalKV(blocks=8)
        with PegaflowClient(addr, 30) as client:
            kv.register(client, "a", "ns")
            start = time.monotonic()
            for _ in range(SAVES):  # new blocks each: each save logs its lines
                assert client.save("a", [0], hashes(1)).stored == 1
            took = time.monotonic() - start
        # The pipe is full by now (nothing read it): the loop answered anyway.
        assert _pipe_full(read_end), "the server logged less than a pipe's buffer"
        assert took < 120, f"{SAVES} saves took {took:.0f} s"
    finally:
        proc.kill()
        proc.wait()
        os.close(read_end)


def _pipe_full(fd: int) -> bool:
    """Whether the pipe holds about its whole buffer (FIONREAD): within a
    page of it, where a log line's write no longer fits."""
    import fcntl
    import struct
    import termios

    got = fcntl.ioctl(fd, termios.FIONREAD, struct.pack("i", 0))
    return struct.unpack("i", got)[0] >= PIPE_BYTES - 4096
