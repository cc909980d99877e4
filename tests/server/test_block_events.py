"""KV events for routers, server side (pegaflow.server.block_events): a
watcher of an instance's namespace sees the blocks other engines save and
the blocks the server evicts; a watcher that does not read costs a bounded
backlog and is sent a resync; another user, or one stream too many, is
refused."""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest

from pegaflow.client.block_watch import BlockEvents
from pegaflow.client.pegaflow_client import PegaflowClient
from pegaflow.common.errors import PegaflowError, UnknownInstance
from pegaflow.proto import pegaflow_pb2 as pb
from pegaflow.proto import pegaflow_pb2_grpc as pb_grpc
from tests.procs import ROOT, EngineProc, ServerProc, _env

# 1 KiB blocks: thousands fit a small pool.
SHAPES = dict(layout="LBNHC", layers=1, blocks=128, heads=1, block_size=16, head=16)
DEADLINE_S = 60.0  # the machine is shared: generous


class View:
    """What a router would know from one stream: the L1 blocks held, rebuilt
    at each resync (as pegaflow.connector.kv_events does)."""

    def __init__(self, client: PegaflowClient, instance: str) -> None:
        self.watch = client.watch_blocks(instance)
        self.held: set[bytes] = set()  # in L1
        self.removed: set[bytes] = set()
        self.on_ssd: set[bytes] = set()
        self.ssd_removed: set[bytes] = set()
        self.resyncs = 0
        self.synced = False  # a snapshot completed
        self.error: PegaflowError | None = None
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            for batch in self.watch:
                self.apply(batch)
        except PegaflowError as exc:
            self.error = exc

    def apply(self, batch: BlockEvents) -> None:
        with self._lock:
            if batch.resync:
                self.resyncs += 1
                self.held.clear()
                self.on_ssd.clear()
                self.synced = False
            for event in batch.events:
                assert event.tier in ("l1", "ssd")
                l1 = event.tier == "l1"
                held = self.held if l1 else self.on_ssd
                if event.kind == "stored":
                    held.update(event.hashes)
                else:
                    held.difference_update(event.hashes)
                    (self.removed if l1 else self.ssd_removed).update(event.hashes)
            self.synced |= batch.snapshot_done

    def wait(self, what: Callable[[View], bool]) -> None:
        end = time.monotonic() + DEADLINE_S
        while time.monotonic() < end:
            with self._lock:
                if what(self):
                    return
            assert self.error is None, self.error
            time.sleep(0.02)
        raise AssertionError(
            f"the watcher never saw it: {len(self.held)} in L1, {len(self.on_ssd)} "
            f"on the SSD, {len(self.removed)} / {len(self.ssd_removed)} removed, "
            f"{self.resyncs} resync(s), synced {self.synced}"
        )

    def close(self) -> None:
        self.watch.cancel()
        self._thread.join(10)


@pytest.fixture
def views(server: ServerProc) -> Iterator[Callable[[str], View]]:
    made: list[View] = []
    client = PegaflowClient(server.addr)

    def make(instance: str) -> View:
        made.append(View(client, instance))
        return made[-1]

    yield make
    for view in made:
        view.close()
    client.close()


def _engine(
    engines: Callable[[], EngineProc], server: ServerProc, name: str
) -> EngineProc:
    eng = engines()
    eng.call("init", seed=len(name), **SHAPES)
    eng.call("register", addr=server.addr, instance=name, namespace="ns-events")
    return eng


def _save(eng: EngineProc, n: int) -> list[bytes]:
    hashes = [secrets.token_bytes(32) for _ in range(n)]
    for i in range(0, n, 100):
        part = hashes[i : i + 100]
        reply = eng.call(
            "save", block_ids=list(range(len(part))), hashes=[h.hex() for h in part]
        )
        assert reply["stored"] == len(part)
    return hashes


def test_watcher_sees_both_engines_saves_and_the_evictions(
    server_factory: Callable[..., ServerProc], engines: Callable[[], EngineProc]
) -> None:
    """Scenario: engine B's scheduler watches its namespace. Blocks engine A
    saved before the watch (the snapshot), blocks A and B save after, and
    the blocks the server evicts for later saves must all show, in order."""
    server = server_factory("--pool-size", "4mb")
    a = _engine(engines, server, "engine-a")
    b = _engine(engines, server, "engine-b")
    before = _save(a, 50)
    client = PegaflowClient(server.addr)
    view = View(client, "engine-b")
    try:
        view.wait(lambda v: v.synced and set(before) <= v.held)
        first = _save(a, 50) + _save(b, 50)
        view.wait(lambda v: set(first) <= v.held)
        # The pool holds ~4k blocks of 1 KiB: more saves evict the oldest.
        later = _save(b, 6000)
        view.wait(lambda v: set(before) <= v.removed and not set(before) & v.held)
        assert view.resyncs == 1  # it kept up: no backlog was dropped
        # What the view says is held is what a query of B finds.
        held = [h for h in later if h in view.held]
        assert len(held) > 1000
        hit = b.call("query", hashes=[h.hex() for h in held[-100:]])
        assert hit["num_blocks"] == 100
    finally:
        view.close()
        client.close()


def test_ssd_blocks_are_events_of_their_own_tier(
    server_factory: Callable[..., ServerProc],
    engines: Callable[[], EngineProc],
    tmp_path: Path,
) -> None:
    """Scenario: with write-behind to a small SSD tier, a watcher's snapshot
    names the blocks the SSD holds (tier ssd) beside L1's; blocks written
    after the watch come as ssd stored events, and those the SSD's ring
    overwrites as ssd removed events, so the view of the SSD matches what
    the server's SSD holds."""
    server = server_factory(
        *("--pool-size", "4mb", "--ssd-cache-path", str(tmp_path / "ssd0.bin")),
        *("--ssd-cache-capacity", "4mb", "--ssd-backend", "posix"),
        *("--ssd-write-on", "seal"),
    )
    a = _engine(engines, server, "engine-a")
    before = _save(a, 50)
    end = time.monotonic() + DEADLINE_S
    while server.metric("pegaflow_ssd_blocks") < 50:
        assert time.monotonic() < end, "write-behind never wrote the blocks"
        time.sleep(0.05)
    client = PegaflowClient(server.addr)
    view = View(client, "engine-a")
    try:
        view.wait(lambda v: v.synced and set(before) <= v.on_ssd & v.held)
        after = _save(a, 50)
        view.wait(lambda v: set(after) <= v.on_ssd)
        # A 4 MiB ring holds a few hundred records (a header page and a
        # padded payload each): these overwrite the first ones.
        _save(a, 1500)
        view.wait(lambda v: set(before) <= v.ssd_removed)
        view.wait(lambda v: not set(before) & v.on_ssd)
        view.wait(lambda v: len(v.on_ssd) == server.metric("pegaflow_ssd_blocks"))
        assert view.resyncs == 1
    finally:
        view.close()
        client.close()


def test_a_watcher_that_does_not_read_gets_a_resync(
    server_factory: Callable[..., ServerProc], engines: Callable[[], EngineProc]
) -> None:
    """Scenario: a scheduler stops reading its stream while the engines save
    far more than --block-events-buffer. The server drops the backlog
    instead of growing it, and when the reader comes back it gets a resync
    whose snapshot brings it to what L1 holds."""
    server = server_factory("--pool-size", "64mb", "--block-events-buffer", "256")
    a = _engine(engines, server, "engine-a")
    _engine(engines, server, "engine-b")
    channel = grpc.insecure_channel(server.addr, options=[("grpc.http2.bdp_probe", 0)])
    stream = pb_grpc.PegaFlowStub(channel).WatchBlocks(
        pb.WatchBlocksRequest(instance_id="engine-b"), timeout=DEADLINE_S * 2
    )
    try:
        assert next(stream).resync
        saved = []
        for _ in range(8):  # ~2 MB of hashes: past any transport window
            saved += _save(a, 2000)
        resyncs, held, synced = 1, set(), True
        for msg in stream:  # reading again: the old messages, then a resync
            if msg.resync:
                resyncs, held, synced = resyncs + 1, set(), False
            for event in msg.events:
                if event.kind == pb.BlockEvent.STORED:
                    held.update(event.block_hashes)
                else:
                    held.difference_update(event.block_hashes)
            synced |= msg.snapshot_done
            if synced and held == set(saved):
                break
        # The backlog went; the snapshot after it (and any events since)
        # told the reader all it missed.
        assert resyncs > 1
        assert server.metric("pegaflow_block_event_resyncs_total") == resyncs - 1
        assert server.metric("pegaflow_block_watchers") == 1
    finally:
        stream.cancel()
        channel.close()


def test_limits_and_unknown_instances_are_refused(
    server_factory: Callable[..., ServerProc], engines: Callable[[], EngineProc]
) -> None:
    """Streams per instance and in all are bounded (each holds one of the
    server's concurrent RPCs); a closed stream gives its place back."""
    server = server_factory("--pool-size", "4mb", "--max-block-watchers", "5")
    _engine(engines, server, "engine-a")
    _engine(engines, server, "engine-b")
    client = PegaflowClient(server.addr)
    views = [View(client, "engine-b") for _ in range(4)]
    try:
        for view in views:
            view.wait(lambda v: v.synced)
        with pytest.raises(PegaflowError, match="RESOURCE_EXHAUSTED.*at most 4"):
            next(iter(client.watch_blocks("engine-b")))
        views.append(View(client, "engine-a"))
        views[-1].wait(lambda v: v.synced)
        with pytest.raises(PegaflowError, match="RESOURCE_EXHAUSTED.*--max-block-w"):
            next(iter(client.watch_blocks("engine-a")))
        with pytest.raises(UnknownInstance, match="'nobody-here'"):
            next(iter(client.watch_blocks("nobody-here")))
        views.pop(0).close()  # its place comes back once the server saw it go
        end = time.monotonic() + DEADLINE_S
        while True:
            try:
                next(iter(client.watch_blocks("engine-a")))
                break
            except PegaflowError:
                assert time.monotonic() < end, "the closed stream kept its place"
                time.sleep(0.05)
    finally:
        for view in views:
            view.close()
        client.close()


NOBODY = 65534


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run as uid 65534")
def test_another_user_cannot_watch(
    server: ServerProc, engines: Callable[[], EngineProc]
) -> None:
    """Scenario: user nobody watched a root engine's namespace and learnt
    every prompt prefix it cached. Now: refused as its queries are."""
    _engine(engines, server, "engine-b")
    prelude = (
        "import os, grpc, pegaflow.proto.pegaflow_pb2 as pb, "
        "pegaflow.proto.pegaflow_pb2_grpc as pbg\n"
        "import grpc._channel, grpc._interceptor, grpc._utilities\n"
        f"os.setgroups([]); os.setgid({NOBODY}); os.setuid({NOBODY})\n"
    )
    code = (
        f"stub = pbg.PegaFlowStub(grpc.insecure_channel({server.addr!r}))\n"
        "req = pb.WatchBlocksRequest(instance_id='engine-b')\n"
        "try:\n    next(stub.WatchBlocks(req, timeout=20)); print('WATCHING')\n"
        "except grpc.RpcError as e:\n    print(e.code().name, e.details())\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", prelude + code],
        capture_output=True,
        text=True,
        env=_env(),
        cwd=Path(ROOT),
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("PERMISSION_DENIED"), out.stdout
    assert "belongs to another user" in out.stdout


@pytest.mark.parametrize(
    ("flag", "value"), [("--max-block-watchers", "-1"), ("--block-events-buffer", "3")]
)
def test_bad_limits_are_refused_naming_the_flag(flag: str, value: str) -> None:
    res = subprocess.run(
        [sys.executable, "-m", "pegaflow.cli", "--no-http", "--addr",
         "127.0.0.1:0", flag, value],
        capture_output=True, text=True, env=_env(), cwd=ROOT, timeout=60,
    )  # fmt: skip
    assert res.returncode == 2 and f"argument {flag}: must lie in" in res.stderr
