"""Host memory named over TCP (--allow-tcp-host-engines) is copied only for a
process the caller could trace itself: every uid its own, no setgid or file
capability transition, dumpable. A root server bypasses the kernel's own
ptrace test, so without these a user could have it write into their setgid
or non-dumpable processes."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pegaflow.common.errors import PermissionDenied
from pegaflow.common.identity import UNKNOWN, Caller, check_host_memory_owner

pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root to setpriv"),
    pytest.mark.skipif(shutil.which("setpriv") is None, reason="no setpriv here"),
]
USER = 1000
CALLER = Caller("tcp", UNKNOWN, USER)
SLEEP = [sys.executable, "-c", "import time; time.sleep(30)"]
UNDUMPABLE = [sys.executable, "-c", "import ctypes, time; "
              "ctypes.CDLL(None).prctl(4, 0); time.sleep(30)"]  # fmt: skip


def _run(ids: list[str], argv: list[str]) -> subprocess.Popen:
    return subprocess.Popen(["setpriv", *ids, "--clear-groups", "--", *argv])


def _settled(proc: subprocess.Popen, check) -> None:
    end = time.monotonic() + 10
    while not check() and time.monotonic() < end:
        time.sleep(0.02)


@pytest.mark.parametrize(
    "ids, argv, refused",
    [
        (["--reuid", str(USER), "--regid", str(USER)], SLEEP, None),
        (["--reuid", str(USER), "--rgid", str(USER), "--egid", "0"], SLEEP, "gids"),
        (["--reuid", str(USER), "--regid", str(USER)], UNDUMPABLE, "not dumpable"),
    ],
    ids=["plain", "setgid-like", "non-dumpable"],
)
def test_a_tcp_caller_may_name_only_its_plain_processes(ids, argv, refused) -> None:
    proc = _run(ids, argv)
    try:
        status = Path(f"/proc/{proc.pid}")
        # Wait for the exec (and the prctl) to have happened.
        exe = sys.executable.encode()
        _settled(proc, lambda: (status / "cmdline").read_bytes().startswith(exe))
        if refused == "not dumpable":
            _settled(proc, lambda: (status / "status").stat().st_uid == 0)
        if refused is None:
            check_host_memory_owner(proc.pid, CALLER, "pid", allow_tcp=True)
        else:
            with pytest.raises(PermissionDenied, match=f"pid: .*{refused}"):
                check_host_memory_owner(proc.pid, CALLER, "pid", allow_tcp=True)
    finally:
        proc.kill()
        proc.wait()
