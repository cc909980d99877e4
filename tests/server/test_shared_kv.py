"""Host engines whose KV memory the server maps: the engine backs it with a
sealed memfd (pegaflow.client.host_share) and hands it over the unix socket
(SCM_RIGHTS); the server's copies into and out of it are then memcpy, the
rest (a buffer's partial first and last pages) process_vm as before."""

from __future__ import annotations

import fcntl
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest

from pegaflow.client.host_share import share_memory, whole_pages
from pegaflow.client.pegaflow_client import PegaflowClient
from pegaflow.common.errors import InvalidRequest, PermissionDenied
from pegaflow.common.memfd import SEALS
from pegaflow.common.share_frames import ShareSpan
from tests.kvbuf import LocalKV, hashes
from tests.procs import ROOT, _env

LAYERS, BLOCKS, PAGE = 4, 64, 48 << 10  # pages not a multiple of 4 KiB
CHILD = Path(__file__).with_name("share_child.py")


def _shared_kv(seed: int) -> tuple[LocalKV, object]:
    kv = LocalKV(LAYERS, BLOCKS, PAGE, seed=seed)
    assert kv.mem.regions[0][0] % 4096, "numpy's buffer is page aligned: no partials"
    shared = share_memory(kv.mem.regions)
    assert shared is not None
    return kv, shared


def test_shared_memfd_saves_and_loads_every_byte(server) -> None:
    """Random KV in two engines' memfd-backed buffers: a save from one and a
    load into the other in reverse block order (blocks 0 and 63 lie partly
    on the buffers' partial pages, which stay on process_vm) land byte for
    byte, and the server copied the rest through its mapping."""
    src, src_shared = _shared_kv(1)
    dst, dst_shared = _shared_kv(2)
    hs = hashes(BLOCKS)
    ids = list(range(BLOCKS))
    with PegaflowClient(server.addr) as client:
        src.register(client, "a", "ns")
        dst.register(client, "b", "ns")
        for name, shared in (("a", src_shared), ("b", dst_shared)):
            got = client.share_host(name, 0, shared.fd, shared.spans)
            assert got == shared.nbytes > 0
        assert client.save("a", ids, hs).stored == BLOCKS
        hit = client.query("b", hs)
        assert hit.num_blocks == BLOCKS
        assert client.load("b", hit.lease_id, ids[::-1]).loaded == BLOCKS
        for b in ids:
            assert np.array_equal(dst.block(BLOCKS - 1 - b), src.block(b)), b
        # The other direction through the same mappings: B's new bytes back.
        dst.randomize(ids, seed=3)
        hs2 = hashes(BLOCKS)
        assert client.save("b", ids, hs2).stored == BLOCKS
        hit = client.query("a", hs2)
        assert client.load("a", hit.lease_id, ids).loaded == BLOCKS
        for b in ids:
            assert np.array_equal(src.block(b), dst.block(b)), b
    log = server.log.read_text()
    assert log.count("shares") >= 2 and "memcpy" in log


def test_a_memfd_that_could_fault_the_server_is_refused(server) -> None:
    """Unsealed, too small, not mapped where it claims, or not a memfd: each
    refused naming why, before anything is mapped; the registration then
    shares a proper one."""
    kv = LocalKV(LAYERS, BLOCKS, PAGE, seed=4)
    ((addr, size),) = whole_pages(kv.mem.regions)
    with PegaflowClient(server.addr) as client:
        kv.register(client, "a", "ns")

        # Refused before its pages or mappings are looked at (mapping it over
        # the engine's pages would take them from the share below: a page a
        # memfd backs already is never mapped over again).
        unsealed = os.memfd_create("t", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        os.ftruncate(unsealed, size)
        with pytest.raises(InvalidRequest, match="F_SEAL_SHRINK"):
            client.share_host("a", 0, unsealed, [ShareSpan(addr, 0, size)])

        small = _sealed(4096)
        with pytest.raises(InvalidRequest, match="past the memfd"):
            client.share_host("a", 0, small, [ShareSpan(addr, 0, size)])

        elsewhere = _sealed(size)  # right size, but not the engine's memory
        with pytest.raises(InvalidRequest, match="does not map the memfd"):
            client.share_host("a", 0, elsewhere, [ShareSpan(addr, 0, size)])

        plain = ShareSpan(addr, 0, size)
        with (
            tempfile.TemporaryFile() as f,
            pytest.raises(InvalidRequest, match="not a memfd"),
        ):
            client.share_host("a", 0, f.fileno(), [plain])

        good = share_memory(kv.mem.regions)
        assert client.share_host("a", 0, good.fd, good.spans) == size
        for fd in (unsealed, small, elsewhere):
            os.close(fd)


def _sealed(size: int) -> int:
    fd = os.memfd_create("t", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, size)
    os.pwrite(fd, b"\0" * size, 0)  # populated
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS)
    return fd


def test_a_memfd_from_another_process_is_refused(server) -> None:
    """A process that learnt a registration's instance id and owner token
    (which only the registrant should know) still cannot hand the server a
    memfd for it: the kernel's pid of its connection is not the registrant's."""
    kv = LocalKV(LAYERS, BLOCKS, PAGE, seed=5)
    with PegaflowClient(server.addr) as client:
        kv.register(client, "a", "ns")
        token = client._tokens[("a", 0)].hex()
        out = subprocess.run(
            [sys.executable, str(CHILD), "intruder", server.addr, "a", token],
            capture_output=True,
            text=True,
            env=_env(),
            cwd=ROOT,
            timeout=120,
        )
        assert out.returncode == 0, out.stderr
        reply = json.loads(out.stdout.strip().splitlines()[-1])
        assert reply["error"] == PermissionDenied.__name__, reply
        assert f"pid {os.getpid()}" in reply["message"], reply


def test_an_engine_dying_mid_load_leaves_the_server_serving(server) -> None:
    """An engine loading 32 MiB into its shared memory in a loop is SIGKILLed
    (most likely mid-copy): the server's mapping keeps its file, so the copy
    cannot fault; the server drops the registration with its session, unmaps
    the memfd, and serves the next engine byte for byte."""
    child = subprocess.Popen(
        [sys.executable, str(CHILD), "engine", server.addr],
        stdout=subprocess.PIPE,
        text=True,
        env=_env(),
        cwd=ROOT,
    )
    try:
        first = json.loads(_line(child, 120))
        assert first["shared"] > 0
        assert json.loads(_line(child, 120)) == {"loads": 3}
        # Loads run back to back now, the server copying most of the time:
        # two more landed, the kill most likely meets one in its copy.
        count = ("pegaflow_transfer_seconds_count", 'direction="load"')
        deadline = time.monotonic() + 120
        while server.metric(*count) < 5:
            assert time.monotonic() < deadline, "the engine's loads stopped"
        child.send_signal(signal.SIGKILL)
    finally:
        child.kill()
        child.wait(30)
    maps = Path(f"/proc/{server.pid}/maps")
    deadline = time.monotonic() + 60
    while "memfd:pegaflow-kv" in maps.read_text():
        assert time.monotonic() < deadline, "the dead engine's memfd stays mapped"
        time.sleep(0.05)
    assert server.proc.poll() is None
    test_shared_memfd_saves_and_loads_every_byte(server)


def _line(proc: subprocess.Popen, timeout: float) -> str:
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    assert ready, f"the engine said nothing (rc={proc.poll()})"
    line = proc.stdout.readline()
    assert line, f"the engine exited (rc={proc.poll()})"
    return line
