"""Host copies through an engine's shared memfd (HostCopyEngine.share and
the copies that use it), against a real engine process that shares its KV:
which copies stay off process_vm (and so off the registration's lane), and
that one registration is mapped once, however its shares arrive."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest

from pegaflow.common.errors import InvalidRequest
from pegaflow.common.geometry import Transfers
from pegaflow.common.share_frames import ShareSpan
from pegaflow.copiers import host_copier
from pegaflow.copiers.host_copier import HostCopyEngine
from pegaflow.copiers.layer_signals import LayerSignals

PAGE = 4096

_SHARES_KV_ONLY = """
import ctypes, json, mmap, sys
from pegaflow.client.host_share import share_memory
P = mmap.PAGESIZE
kv = mmap.mmap(-1, 16 * P, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
words = mmap.mmap(-1, P, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
kv_at = ctypes.addressof(ctypes.c_char.from_buffer(kv))
words_at = ctypes.addressof(ctypes.c_char.from_buffer(words))
for page in range(16):
    kv[page * P : (page + 1) * P] = bytes([page + 1]) * P
shared = share_memory([(kv_at, 16 * P)])  # the KV only, not the words
spans = [(s.address, s.offset, s.size) for s in shared.spans]
print(json.dumps(dict(kv=kv_at, size=16 * P, words=words_at, fd=shared.fd,
                      spans=spans)), flush=True)
sys.stdin.read()
"""


@pytest.fixture
def engine() -> Iterator[dict]:
    """An engine process whose 16 KV pages (page i full of byte i + 1) are
    shared as a memfd, its layer signal words on a page of their own; the
    memfd as the server would receive it, and a registration of the KV."""
    child = subprocess.Popen(
        [sys.executable, "-c", _SHARES_KV_ONLY],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    copier, regions, fd = HostCopyEngine(threads=2), None, -1
    try:
        info = json.loads(child.stdout.readline())
        regions = copier.open(child.pid, [(info["kv"], info["size"])])
        fd = os.open(f"/proc/{child.pid}/fd/{info['fd']}", os.O_RDWR)
        spans = tuple(ShareSpan(*s) for s in info["spans"])
        yield dict(
            info,
            pid=child.pid,
            copier=copier,
            regions=regions,
            fd=fd,
            spans=spans,
            info_spans=info["spans"],
        )
    finally:
        if fd >= 0:
            os.close(fd)
        if regions is not None:
            copier.close(regions)
        child.kill()
        child.wait()


def _table(engine_addresses: list[int], direction: str) -> Transfers:
    there = np.array(engine_addresses, np.uint64)
    here = np.arange(len(there), dtype=np.uint64) * np.uint64(PAGE)
    n = np.full(len(there), PAGE, np.uint64)
    return (
        Transfers(there, here, n) if direction == "save" else Transfers(here, there, n)
    )


def test_signal_words_outside_the_memfd_keep_a_layer_wise_load_on_the_lane(
    engine: dict,
) -> None:
    """A connector that shares only its KV (the words on a page of their
    own): the words are still written with process_vm_writev, so a
    layer-wise load must run on the lane even with every run in the memfd."""
    regions = engine["regions"]
    signals = LayerSignals(engine["pid"], engine["words"], 4)
    engine["copier"].share(regions, engine["fd"], engine["spans"], signals)
    assert not regions.shared.signals_in_kv
    assert signals.shared_words() is None
    runs = _table([engine["kv"] + i * PAGE for i in range(4)], "load")
    assert HostCopyEngine.lane_for(regions, runs, "load", False) is None
    assert HostCopyEngine.lane_for(regions, runs, "load", True) is regions.lane


def test_runs_in_adjacent_spans_are_copied_through_the_memfd(
    engine: dict, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Runs in two adjacent spans of the memfd: each inside one span, so
    lane_for clears the copy (inline on the loop for a small one); merged
    before being sorted out, they made one run no span holds, which went to
    process_vm_readv on that thread."""
    regions = engine["regions"]
    ((at, offset, size),) = engine["info_spans"]
    halves = (
        ShareSpan(at, offset, PAGE),
        ShareSpan(at + PAGE, offset + PAGE, size - PAGE),
    )
    engine["copier"].share(regions, engine["fd"], halves)
    pool = np.zeros(2 * PAGE, np.uint8)
    here = np.uint64(pool.ctypes.data) + np.arange(2, dtype=np.uint64) * PAGE
    there = np.array([at, at + PAGE], np.uint64)
    save = Transfers(there, here, np.full(2, PAGE, np.uint64))
    assert HostCopyEngine.lane_for(regions, save, "save", False) is None

    def no_process_vm(*args: object, **kwargs: object) -> None:
        pytest.fail("process_vm_readv for runs inside the memfd")

    monkeypatch.setattr(host_copier, "transfer", no_process_vm)
    engine["copier"].gather(regions, save)
    first = (at - engine["kv"]) // PAGE + 1  # the child's byte on that page
    assert bytes(pool) == bytes([first]) * PAGE + bytes([first + 1]) * PAGE


def test_one_registration_is_mapped_once_however_its_shares_arrive(
    engine: dict, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Shares of one registration on two connections run on two threads at
    once: both passed the 'already shared' check and both mapped the memfd,
    the first mapping overwritten and never unmapped (a hostile engine could
    repeat it to grow the server's memory). One share claims the slot; a
    failed one gives it back."""
    copier, regions = engine["copier"], engine["regions"]
    null = os.open("/dev/null", os.O_RDONLY)
    try:
        with pytest.raises(InvalidRequest, match="share.fd"):
            copier.share(regions, null, engine["spans"])
    finally:
        os.close(null)
    start, results = threading.Barrier(4), []
    mapping = host_copier.SharedKV

    def slow_mapping(*args: object) -> object:  # widens check-to-map window
        time.sleep(0.05)
        return mapping(*args)

    monkeypatch.setattr(host_copier, "SharedKV", slow_mapping)

    def share() -> None:
        start.wait()
        try:
            results.append(copier.share(regions, engine["fd"], engine["spans"]))
        except InvalidRequest as exc:
            results.append(str(exc))

    threads = [threading.Thread(target=share) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    mapped = [r for r in results if isinstance(r, int)]
    assert mapped == [engine["size"]], results
    assert all("already shares" in r for r in results if isinstance(r, str))
    ino = str(os.fstat(engine["fd"]).st_ino)  # this memfd's, not other tests'
    with open(f"/proc/{os.getpid()}/maps") as maps:
        mine = [line for line in maps if line.split()[4:5] == [ino]]
    assert len(mine) == 1, mine
