"""Per-layer load progress: the words an engine polls, and the layer-by-layer
scatter that writes them."""

from __future__ import annotations

import ctypes
import os
from itertools import pairwise

import numpy as np

from pegaflow.common.errors import CopyFailed, InvalidRequest, PermissionDenied
from pegaflow.common.geometry import KVGeometry, Transfers
from pegaflow.common.pidfds import ProcessImage, exited
from pegaflow.common.thread_creds import mode

from .copier import CopyEngine, LoadSignals
from .engine_lane import EngineLane
from .shared_kv import SharedKV
from .vm import (
    check_access,
    file_backed,
    first_outside,
    iovecs,
    read_maps,
    rw_spans,
    transfer,
)


class LayerSignals:
    """Per-layer load progress words in an engine process's host memory.

    The engine polls word l before running layer l; the server writes a load's
    sequence number there once that layer's bytes have landed. One 8-byte
    process_vm_writev per layer, after the layer's copy returned, so on x86's
    store order the engine never sees the word before the bytes. Words the
    engine put in the memfd it shares (pegaflow.copiers.shared_kv) are
    stored to directly instead: no system call and no check of the process
    per layer, since the file is the engine's own and no program it exec's
    sees it.
    """

    def __init__(self, pid: int, address: int, num_layers: int) -> None:
        if pid <= 0 or pid == os.getpid():
            raise InvalidRequest(f"layer_signals.pid: {pid} is not an engine process")
        if address <= 0 or address % 8:
            raise InvalidRequest(
                f"layer_signals.address: {address:#x} is not an 8-byte aligned address"
            )
        image = ProcessImage(pid, "layer_signals.pid")  # first
        try:
            self._check(pid, address, num_layers, image)
        except BaseException:
            image.close()
            raise
        self._image: ProcessImage | None = image
        self._shared: SharedKV | None = None
        # Where a layer-wise load that writes the words with process_vm_writev
        # runs when its copier has no lane of its own (a GPU worker's): the
        # write can wait on the engine for good (pegaflow.copiers.engine_lane).
        self.lane = EngineLane(f"sig{pid}", helpers=0)
        self._words: np.ndarray | None = None  # their addresses in our mapping

    def _check(
        self, pid: int, address: int, num_layers: int, image: ProcessImage
    ) -> None:
        size = 8 * num_layers
        maps = read_maps(pid, "layer_signals.pid")
        addr, nbytes = np.array([address], np.uint64), np.array([size], np.uint64)
        if first_outside(*rw_spans(pid, maps), addr, nbytes) >= 0:
            raise InvalidRequest(
                f"layer_signals.address: [{address:#x}, {address + size:#x}) is not "
                f"mapped read-write in process {pid}"
            )
        if (found := file_backed(pid, maps, addr, nbytes)) is not None:
            raise InvalidRequest(
                f"layer_signals.address: [{address:#x}, {address + size:#x}) maps "
                f"{found[1]}; signal words must be anonymous or shared memory"
            )
        self.pid, self.address, self.num_layers = pid, address, num_layers
        self._word = np.zeros(1, np.uint64)
        self._local = iovecs(np.array([self._word.ctypes.data], np.uint64), _EIGHT)
        self._ids = image.ids
        # Whether the kernel vouches for each write (thread_creds): if not,
        # the server checks the process's rights before every layer's word.
        self._vouched = mode(image.ids) != "unvouched"
        try:  # ptrace permission shows here, at registration, not mid-load
            check_access(pid, self._ids)
        except (CopyFailed, PermissionDenied) as e:
            raise InvalidRequest(f"layer_signals.pid: {e}") from None
        if exited(image.pidfd):
            raise InvalidRequest(f"layer_signals.pid: process {pid} exited meanwhile")

    def _remote(self, layer: int) -> np.ndarray:
        return iovecs(np.array([self.address + 8 * layer], np.uint64), _EIGHT)

    @property
    def span(self) -> tuple[int, int]:
        """(address, bytes) of the words in the engine's memory."""
        return self.address, 8 * self.num_layers

    def attach(self, kv: SharedKV) -> bool:
        """Write the words through the engine's shared mapping, if it holds
        them; the mapping must outlive every signal (it does: both close
        with the worker, after its last copy)."""
        at = self.address + 8 * np.arange(self.num_layers, dtype=np.uint64)
        mapped, inside = kv.translate(at, np.full(len(at), 8, np.uint64))
        if not len(at) or not inside.all():
            return False
        self._shared, self._words = kv, mapped
        return True

    def shared_words(self) -> np.ndarray | None:
        """Our addresses of the words, while the shared mapping lasts."""
        kv = self._shared
        if kv is None or kv.base is None or self._image is None:
            return None
        return self._words

    def signal(self, layer: int, seq: int) -> None:
        if self._image is None:
            raise CopyFailed(f"layer signal: engine process {self.pid} is gone")
        words = self.shared_words()
        if words is not None:  # after the layer's copy returned: x86 order
            ctypes.c_uint64.from_address(int(words[layer])).value = seq
            return
        # An 8-byte write of the caller's seq: never into a program the
        # process exec'd since it registered (a setuid one's memory). Its
        # rights once a load (layer 0 is signalled first, always), then that
        # it runs the same program (~4 us a layer instead of ~10): the write
        # acts as the engine's user, so the kernel refuses a program with
        # more rights, even one exec'd while a clone(CLONE_VM) child keeps
        # the old memory alive (which the program check misses). Where the
        # kernel cannot vouch (thread_creds "unvouched"), every layer's.
        self._image.check("layer signal", rights=layer == 0 or not self._vouched)
        self._word[0] = seq
        transfer("scatter", self.pid, self._local, self._remote(layer), ids=self._ids)

    def close(self) -> None:
        self._shared = self._words = None
        self.lane.close()
        if self._image is not None:
            self._image.close()
            self._image = None


_EIGHT = np.array([8], np.uint64)


def scatter_by_layer(
    copier: CopyEngine,
    geometry: KVGeometry,
    signals: LoadSignals,
    seq: int,
    deadline: float | None,
    handle: object,
    t: Transfers,
) -> None:
    """One copy per layer into a worker's memory (its copier, geometry and
    signal words), each followed by its signal: a Python step per layer is
    what a per-layer signal costs (~50 us a layer on the host path)."""
    rows = len(geometry.layer_rows)
    layer_of = np.tile(geometry.layer_rows, len(t) // rows if rows else 0)
    order = np.argsort(layer_of, kind="stable")
    edges = np.searchsorted(layer_of[order], np.arange(geometry.num_layers + 1))
    src, dst, nbytes = t.src[order], t.dst[order], t.nbytes[order]
    # A copier that can write each layer's word itself does all layers in
    # one call (the host copier into a shared mapping: ~0.2 ms a layer of
    # Python and system calls less, pegaflow.copiers.run_copy.copy_layers).
    by_layers = getattr(copier, "scatter_layers", None)
    if by_layers is not None and by_layers(
        handle, Transfers(src, dst, nbytes), edges, signals, seq, deadline
    ):
        return
    for layer, (a, b) in enumerate(pairwise(edges.tolist())):
        if b > a:
            part = Transfers(src[a:b], dst[a:b], nbytes[a:b])
            copier.scatter(handle, part, deadline=deadline)
        signals.signal(layer, seq)
