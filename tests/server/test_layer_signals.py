"""Layer-wise loads: the server copies layer by layer and writes the load's
sequence number into the engine's signal word of each layer once that layer's
bytes have landed, so an engine can start layer l while later layers copy."""

from __future__ import annotations

import mmap
import os
import threading

import numpy as np
import pytest

from pegaflow.client.host_share import share_memory
from pegaflow.client.pegaflow_client import LoadItem, PegaflowClient
from pegaflow.common.errors import InvalidRequest
from tests.kvbuf import LocalKV, hashes

LAYERS, BLOCKS, PAGE = 8, 64, 64 << 10


class Watcher(threading.Thread):
    """Polls the signal words as an engine would; the moment layer l's word
    shows `seq`, checks layer l's destination pages against the source."""

    def __init__(
        self, signals: np.ndarray, seq: int, kv: LocalKV, src: LocalKV, ids: list
    ) -> None:
        super().__init__(daemon=True)
        self.signals, self.seq, self.kv, self.src, self.ids = signals, seq, kv, src, ids
        self.seen: list[int] = []
        self.wrong: list[int] = []

    def run(self) -> None:
        for layer in range(LAYERS):
            while self.signals[layer] != self.seq:
                pass  # an engine spins too: the wait is at most one layer's copy
            dst = self.kv.views[layer][self.ids[1]]
            want = self.src.views[layer][self.ids[0]]
            if not np.array_equal(dst, want):
                self.wrong.append(layer)
            self.seen.append(layer)


def test_each_layer_is_signalled_after_its_bytes(server) -> None:
    src, dst = LocalKV(LAYERS, BLOCKS, PAGE, seed=1), LocalKV(LAYERS, BLOCKS, PAGE, 2)
    signals = np.zeros(LAYERS, np.uint64)
    hs = hashes(32)
    with PegaflowClient(server.addr) as client:
        src.register(client, "a", "ns")
        client.register_host(
            "b",
            "ns",
            *_host(dst),
            layer_signals=signals.ctypes.data,
        )
        client.save("a", list(range(32)), hs)
        for seq, (rng, via_socket) in enumerate(
            [(range(32), True), (range(16), False)], start=7
        ):
            ids = list(rng)
            hit = client.query("b", hs[: len(ids)])
            dst_ids = [63 - i for i in ids]
            watcher = Watcher(signals, seq, dst, src, [ids, dst_ids])
            watcher.start()
            if via_socket:
                res = client.load_many(
                    "b", [LoadItem(hit.lease_id, dst_ids)], layer_seq=seq
                )
                assert res.loaded == len(ids)
            else:
                client.disable_socket()  # gRPC carries layer_seq too
                assert client.load("b", hit.lease_id, dst_ids, layer_seq=seq).loaded
            watcher.join(10)
            assert watcher.seen == list(range(LAYERS)) and watcher.wrong == []
            assert (signals == seq).all()
    assert (
        server.metric(
            "pegaflow_rpc_seconds_count", 'code="OK",method="Load",transport="unix"'
        )
        == 1
    )


def test_layer_signals_are_checked(server) -> None:
    kv = LocalKV(LAYERS, BLOCKS, PAGE)
    signals = np.zeros(LAYERS, np.uint64)
    with PegaflowClient(server.addr) as client:
        with pytest.raises(InvalidRequest, match="layer_signals.address"):
            client.register_host(
                "e", "ns", *_host(kv), layer_signals=12345
            )  # unaligned
        with pytest.raises(InvalidRequest, match="not mapped read-write"):
            client.register_host("e", "ns", *_host(kv), layer_signals=8)
        kv.register(client, "e", "ns")  # no signals
        hs = hashes(2)
        client.save("e", [0, 1], hs)
        hit = client.query("e", hs)
        with pytest.raises(InvalidRequest, match="layer_seq"):
            client.load("e", hit.lease_id, [2, 3], layer_seq=1)
        client.register_host("f", "ns", *_host(kv), layer_signals=signals.ctypes.data)
        hit = client.query("f", hs)
        assert client.load("f", hit.lease_id, [2, 3], layer_seq=3).loaded == 2
    assert (signals == 3).all()


def _host(kv: LocalKV) -> tuple:
    return os.getpid(), kv.mem.regions, kv.mem.layers


def test_shared_signal_words_are_stored_through_the_mapping(server) -> None:
    """An engine whose memfd holds its KV and its signal words' own page: the
    server copies every layer and stores every word through its mapping in
    one call, each word still after its layer's bytes; a load that reaches
    the buffer's partial pages (process_vm) goes layer by layer instead,
    its words still stored through the mapping."""
    src, dst = LocalKV(LAYERS, BLOCKS, PAGE, seed=1), LocalKV(LAYERS, BLOCKS, PAGE, 2)
    assert dst.mem.regions[0][0] % mmap.PAGESIZE, "want partial first/last pages"
    page = mmap.mmap(-1, mmap.PAGESIZE)
    signals = np.frombuffer(page, np.uint64, count=LAYERS)
    hs = hashes(32)
    with PegaflowClient(server.addr) as client:
        src.register(client, "a", "ns")
        client.register_host("b", "ns", *_host(dst), layer_signals=signals.ctypes.data)
        words = ((signals.ctypes.data, mmap.PAGESIZE),)
        shared = share_memory(dst.mem.regions + words)
        assert shared is not None
        assert client.share_host("b", 0, shared.fd, shared.spans) == shared.nbytes
        client.save("a", list(range(32)), hs)
        ids = list(range(32))
        dst_ids = [62 - i for i in ids]  # clear of the partial pages
        hit = client.query("b", hs)
        watcher = Watcher(signals, 5, dst, src, [ids, dst_ids])
        watcher.start()
        res = client.load_many("b", [LoadItem(hit.lease_id, dst_ids)], layer_seq=5)
        assert res.loaded == 32
        watcher.join(10)
        assert watcher.seen == list(range(LAYERS)) and watcher.wrong == []
        log = server.log.read_text()
        assert f"scatter: {LAYERS} layers in one call, {LAYERS * 32} runs" in log
        hit = client.query("b", hs[:2])  # onto blocks 0 and 63: partial pages
        assert client.load("b", hit.lease_id, [0, 63], layer_seq=6).loaded == 2
        assert (signals == 6).all()
        for b, want in ((0, 0), (63, 1)):
            assert np.array_equal(dst.block(b), src.block(want)), b
    assert server.log.read_text().count("layers in one call") == 1
