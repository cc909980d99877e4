"""Hypothesis fuzz of every RPC against one real server process.

Random field values, repeated lengths and bytes; any status is accepted except
INTERNAL, UNKNOWN, UNAVAILABLE and DEADLINE_EXCEEDED (a bug, a crash or a hang).
Random wire bytes may also get grpc's own answer to an undecodable body. After
the fuzz the process lives, answers /health, and a round trip moves every byte.

Safety: host regions that name this test process always lie inside the fuzz's
own buffer, and other pids are ones that cannot hold memory we care about, so a
fuzzed Load can never write outside memory this test owns.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import grpc
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pegaflow.client.pegaflow_client import PegaflowClient, allow_ptrace_from
from pegaflow.common.errors import LeaseNotFound
from pegaflow.common.request_limits import MIN_AVG_SEGMENT_BYTES
from pegaflow.common.socket_frames import (
    LOADING,
    encode_load,
    encode_query,
    encode_save,
)
from pegaflow.proto import pegaflow_pb2 as pb
from pegaflow.proto import pegaflow_pb2_grpc as pb_grpc
from tests.kvbuf import LocalKV, hashes
from tests.procs import ServerProc, start_server

Code = grpc.StatusCode
BAD = {Code.INTERNAL, Code.UNKNOWN, Code.UNAVAILABLE, Code.DEADLINE_EXCEEDED}
TIMEOUT_S = 10.0
LAYERS, BLOCKS, PAGE = 2, 8, 4096
U32, U64 = (1 << 32) - 1, (1 << 64) - 1
ANCHOR_HASHES = [b"anchor-%02d" % i for i in range(BLOCKS)]
INSTANCES = ["anchor", "fuzz-a", "fuzz-b", ""]
NAMESPACES = ["ns-anchor", "ns-f1", "ns-f2", ""]

FUZZ = settings(
    max_examples=60,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


@dataclass
class Fuzz:
    server: ServerProc
    channel: grpc.Channel
    stub: pb_grpc.PegaFlowStub
    client: PegaflowClient
    anchor: LocalKV  # "anchor" in "ns-anchor"; fuzzed regions of our pid lie in it
    witness: LocalKV  # "witness" in "ns-witness", which no fuzzed request names
    witness_hashes: list[bytes]
    witness_bytes: list[np.ndarray]
    dead_pid: int

    @property
    def base(self) -> int:
        return self.anchor.mem.regions[0][0]

    @property
    def size(self) -> int:
        return self.anchor.mem.regions[0][1]


@pytest.fixture(scope="module")
def fz(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fuzz]:
    # A short TTL: blocks half-saved by fuzzed layer_ids go stale within seconds.
    server = start_server(
        tmp_path_factory.mktemp("fuzz"), "--pool-size", "64mb", "--lease-ttl", "1"
    )
    allow_ptrace_from(server.pid)
    channel = grpc.insecure_channel(server.addr)
    client = PegaflowClient(server.addr, timeout_s=TIMEOUT_S)
    anchor = LocalKV(LAYERS, BLOCKS, PAGE, seed=1)
    anchor.register(client, "anchor", "ns-anchor")
    assert client.save("anchor", range(BLOCKS), ANCHOR_HASHES).stored == BLOCKS
    witness = LocalKV(LAYERS, BLOCKS, PAGE, seed=2)
    witness.register(client, "witness", "ns-witness")
    witness_hashes = hashes(BLOCKS)
    assert client.save("witness", range(BLOCKS), witness_hashes).stored == BLOCKS
    dead = subprocess.Popen(["true"])
    dead.wait()
    yield Fuzz(
        server,
        channel,
        pb_grpc.PegaFlowStub(channel),
        client,
        anchor,
        witness,
        witness_hashes,
        [witness.block(b).copy() for b in range(BLOCKS)],
        dead.pid,
    )
    client.close()
    channel.close()
    server.stop()


def check(call: Callable[[], object]) -> object | None:
    """The response, or None for an acceptable error status."""
    try:
        return call()
    except grpc.RpcError as err:
        assert err.code() not in BAD, f"{err.code()}: {err.details()}"
        assert err.details(), err.code()
        return None


def revive_anchor(fz: Fuzz) -> None:
    """Fuzzed Unregister/Session calls may drop "anchor"; bring it back."""
    fz.anchor.register(fz.client, "anchor", "ns-anchor")


# -- strategies -----------------------------------------------------------------
# Each request starts valid (so the fuzz reaches copies, leases and namespaces)
# and then has a few fields replaced by wild values; hypothesis shrinks toward
# the valid request.

small = st.integers(0, 9)
ranks = st.sampled_from([0, 0, 0, 1])  # most workers registered are rank 0
u32 = st.one_of(small, st.integers(0, U32))
u64 = st.one_of(small, st.integers(0, U64))
instance_ids = st.one_of(st.sampled_from(INSTANCES), st.text(max_size=12))
namespaces = st.one_of(st.sampled_from(NAMESPACES), st.text(max_size=12))
wild_ids = st.lists(st.one_of(st.integers(0, BLOCKS), u32), max_size=10)
wild_hashes = st.lists(
    st.one_of(st.sampled_from(ANCHOR_HASHES), st.binary(max_size=70)), max_size=10
)
devices = st.one_of(
    st.sampled_from(["cpu", "cuda:0", "cuda:", "gpu"]), st.text(max_size=8)
)
good_hashes = st.one_of(
    st.sampled_from(ANCHOR_HASHES), st.binary(min_size=1, max_size=64)
)


def mutate(draw: st.DrawFn, fields: dict[str, object], wild: dict) -> dict:
    for name in draw(st.sets(st.sampled_from(sorted(wild)), max_size=3)):
        fields[name] = draw(wild[name])
    return fields


@st.composite
def host_regions(draw: st.DrawFn, fz: Fuzz) -> pb.MemoryRegion:
    kind = draw(st.sampled_from(["ours", "ours", "ours", "server", "other"]))
    if kind == "ours":  # inside our buffer, or empty
        start = draw(st.integers(0, fz.size - 1))
        size = draw(st.integers(0, fz.size - start))
        region = pb.HostRegion(pid=os.getpid(), address=fz.base + start, size=size)
        return pb.MemoryRegion(host=region)
    pid = fz.server.pid
    if kind == "other":
        pid = draw(st.sampled_from([0, fz.dead_pid, (1 << 31) - 1, U32]))
    # Never mapped in user space: null page, top of memory, non-canonical.
    address = draw(st.sampled_from([0, 0x1000, 1 << 60, U64 - 0xFFF]))
    region = pb.HostRegion(pid=pid, address=address, size=draw(u64))
    return pb.MemoryRegion(host=region)


cuda_regions = st.builds(
    lambda h, off, size, uuid: pb.MemoryRegion(
        cuda=pb.CudaRegion(ipc_handle=h, offset=off, size=size, device_uuid=uuid)
    ),
    st.binary(max_size=80),
    u64,
    u64,
    st.binary(max_size=20),
)
segments = st.builds(
    pb.Segment,
    offset=st.one_of(st.integers(0, PAGE), u64),
    size=st.one_of(st.integers(0, PAGE + 1), u64),
)
layer_layouts = st.builds(
    pb.LayerLayout,
    region_index=st.one_of(st.integers(0, 2), u32),
    offset=st.one_of(st.integers(0, BLOCKS * PAGE * LAYERS), u64),
    num_blocks=st.one_of(st.integers(0, BLOCKS + 1), u64),
    block_stride=st.one_of(st.integers(0, 2 * PAGE), u64),
    segments=st.lists(segments, max_size=3),
)


@st.composite
def register_requests(
    draw: st.DrawFn, fz: Fuzz
) -> tuple[pb.RegisterInstanceRequest, bool]:
    """1-3 layers of equal pages (one or two segments) laid out layer after layer
    from the start of our buffer, TP 1 or 2; then maybe wild fields. Also says
    whether any field went wild."""
    n_layers, blocks = draw(st.integers(1, 3)), draw(st.integers(1, BLOCKS))
    # Pages of two segments average >= 512 B (common.request_limits): smaller ones
    # are refused at registration, and wild layers still try them.
    page = draw(st.integers(2 * MIN_AVG_SEGMENT_BYTES, fz.size // (n_layers * blocks)))
    cut = draw(st.integers(0, page - 1))
    segs = [pb.Segment(offset=0, size=page)]
    if cut:
        segs = [pb.Segment(offset=0, size=cut), pb.Segment(offset=cut, size=page - cut)]
    layers = [
        pb.LayerLayout(
            offset=i * blocks * page,
            num_blocks=blocks,
            block_stride=page,
            segments=segs,
        )
        for i in range(n_layers)
    ]
    tp_size = draw(st.integers(1, 2))
    own = f"ns-{n_layers}x{page}x{cut}x{tp_size}"  # a namespace this geometry fits
    region = pb.HostRegion(pid=os.getpid(), address=fz.base, size=fz.size)
    fields: dict[str, object] = dict(
        instance_id=draw(st.sampled_from([f"i-{own}", f"i-{own}", *INSTANCES[1:3]])),
        namespace=draw(st.sampled_from([own, own, *NAMESPACES[:3]])),
        tp_rank=draw(st.integers(0, tp_size - 1)),
        tp_size=tp_size,
        world_size=tp_size,
        device="cpu",
        regions=[pb.MemoryRegion(host=region)],
        layers=layers,
    )
    any_region = st.one_of(host_regions(fz), cuda_regions, st.just(pb.MemoryRegion()))
    wild = dict(
        instance_id=instance_ids.filter(lambda s: s != "anchor"),
        namespace=namespaces,
        tp_rank=u32,
        tp_size=u32,
        world_size=u32,
        device=devices,
        regions=st.lists(any_region, max_size=3),
        layers=st.lists(layer_layouts, max_size=3),
    )
    valid = dict(fields)
    req = pb.RegisterInstanceRequest(**mutate(draw, fields, wild))
    return req, fields != valid


@st.composite
def save_requests(draw: st.DrawFn) -> pb.SaveRequest:
    n = draw(st.integers(0, BLOCKS))
    fields: dict[str, object] = dict(
        instance_id=draw(st.sampled_from(INSTANCES[:3])),
        tp_rank=draw(ranks),
        block_ids=draw(st.lists(st.integers(0, BLOCKS - 1), min_size=n, max_size=n)),
        block_hashes=draw(st.lists(good_hashes, min_size=n, max_size=n)),
        layer_ids=draw(st.lists(st.integers(0, 2), unique=True, max_size=2)),
    )
    wild = dict(
        instance_id=instance_ids,
        tp_rank=u32,
        block_ids=wild_ids,
        block_hashes=wild_hashes,
        layer_ids=st.lists(u32, max_size=4),
    )
    return pb.SaveRequest(**mutate(draw, fields, wild))


@st.composite
def query_requests(draw: st.DrawFn) -> pb.QueryPrefixRequest:
    fields: dict[str, object] = dict(
        instance_id=draw(st.sampled_from(INSTANCES[:3])),
        block_hashes=draw(st.lists(good_hashes, max_size=BLOCKS + 2)),
    )
    wild = dict(instance_id=instance_ids, block_hashes=wild_hashes)
    return pb.QueryPrefixRequest(**mutate(draw, fields, wild))


# -- one test per RPC -------------------------------------------------------------


def release(fz: Fuzz, lease_id: int) -> None:
    """Unpin what a query leased (any answer but a bad one is fine)."""
    req = pb.ReleaseLeaseRequest(lease_id=lease_id)
    check(lambda: fz.stub.ReleaseLease(req, timeout=TIMEOUT_S))


@FUZZ
@given(data=st.data())
def test_fuzz_register(fz: Fuzz, data: st.DataObject) -> None:
    """Whatever registration is accepted also saves, hits and loads; where the
    layout is the generated one, the loaded bytes are checked."""
    req, wild = data.draw(register_requests(fz))
    if check(lambda: fz.stub.RegisterInstance(req, timeout=TIMEOUT_S)) is None:
        return
    inst, rank = req.instance_id, req.tp_rank
    n = min(req.layers[0].num_blocks, BLOCKS)
    hs, before = hashes(n), fz.anchor.buf.copy()
    save = pb.SaveRequest(
        instance_id=inst, tp_rank=rank, block_ids=range(n), block_hashes=hs
    )
    check(lambda: fz.stub.Save(save, timeout=TIMEOUT_S))
    query = pb.QueryPrefixRequest(instance_id=inst, block_hashes=hs)
    hit = check(lambda: fz.stub.QueryPrefix(query, timeout=TIMEOUT_S))
    if hit is None or not hit.ready.num_blocks:
        return
    k = hit.ready.num_blocks
    load = pb.LoadRequest(
        instance_id=inst,
        tp_rank=rank,
        lease_id=hit.ready.lease_id,
        block_ids=range(k - 1, -1, -1),
    )
    loaded = check(lambda: fz.stub.Load(load, timeout=TIMEOUT_S))
    release(fz, hit.ready.lease_id)
    if wild or loaded is None or k != n:
        return
    page = sum(s.size for s in req.layers[0].segments)
    span = len(req.layers) * n * page
    pages = before[:span].reshape(len(req.layers), n, page)
    after = fz.anchor.buf
    np.testing.assert_array_equal(after[:span], pages[:, ::-1].ravel())
    np.testing.assert_array_equal(after[span:], before[span:])


@FUZZ
@given(req=save_requests())
def test_fuzz_save(fz: Fuzz, req: pb.SaveRequest) -> None:
    revive_anchor(fz)
    check(lambda: fz.stub.Save(req, timeout=TIMEOUT_S))


@FUZZ
@given(req=query_requests())
def test_fuzz_query(fz: Fuzz, req: pb.QueryPrefixRequest) -> None:
    revive_anchor(fz)
    resp = check(lambda: fz.stub.QueryPrefix(req, timeout=TIMEOUT_S))
    if resp is not None and resp.ready.lease_id:
        release(fz, resp.ready.lease_id)


@FUZZ
@given(data=st.data())
def test_fuzz_load(fz: Fuzz, data: st.DataObject) -> None:
    """A live lease of a few saved blocks, loaded by its owner into random ids;
    then wild fields (another instance or rank, a foreign or garbage lease)."""
    revive_anchor(fz)
    owner = data.draw(st.sampled_from(INSTANCES[:3]))
    query = pb.QueryPrefixRequest(
        instance_id=owner,
        block_hashes=data.draw(st.lists(good_hashes, max_size=4))
        + ANCHOR_HASHES[: data.draw(st.integers(0, BLOCKS))],
    )
    resp = check(lambda: fz.stub.QueryPrefix(query, timeout=TIMEOUT_S))
    leased = resp.ready.num_blocks if resp is not None else 0
    lease_id = resp.ready.lease_id if resp is not None else 0
    offset = data.draw(st.integers(0, leased))
    ids = st.lists(
        st.integers(0, BLOCKS - 1), min_size=leased - offset, max_size=leased - offset
    )
    fields: dict[str, object] = dict(
        instance_id=owner,
        tp_rank=data.draw(ranks),
        lease_id=lease_id,
        lease_offset=offset,
        block_ids=data.draw(ids),
    )
    wild = dict(
        instance_id=instance_ids,
        tp_rank=u32,
        lease_id=u64,
        lease_offset=u32,
        block_ids=wild_ids,
    )
    req = pb.LoadRequest(**mutate(data.draw, fields, wild))
    check(lambda: fz.stub.Load(req, timeout=TIMEOUT_S))
    if lease_id:
        release(fz, lease_id)


@FUZZ
@given(instance=instance_ids, rank=st.one_of(st.integers(0, 2), u32), lease_id=u64)
def test_fuzz_unregister_and_release(
    fz: Fuzz, instance: str, rank: int, lease_id: int
) -> None:
    req = pb.UnregisterRequest(instance_id=instance, tp_rank=rank)
    check(lambda: fz.stub.Unregister(req, timeout=TIMEOUT_S))
    release(fz, lease_id)


pings = st.builds(
    pb.SessionPing, instance_id=instance_ids, tp_rank=st.one_of(st.integers(0, 2), u32)
)


@settings(FUZZ, max_examples=30)
@given(stream=st.lists(pings, max_size=3))
def test_fuzz_session(fz: Fuzz, stream: list[pb.SessionPing]) -> None:
    revive_anchor(fz)
    pongs = check(lambda: list(fz.stub.Session(iter(stream), timeout=TIMEOUT_S)))
    if pongs is not None:
        assert len(pongs) in (0, len(stream))


# -- raw bytes ------------------------------------------------------------------

REQUEST_TYPES = {
    "RegisterInstance": "RegisterInstanceRequest",
    "Save": "SaveRequest",
    "QueryPrefix": "QueryPrefixRequest",
    "Load": "LoadRequest",
    "ReleaseLease": "ReleaseLeaseRequest",
    "Unregister": "UnregisterRequest",
    "ServerInfo": "ServerInfoRequest",
    "Session": "SessionPing",
}


def raw_check(method: str, call: Callable[[], object]) -> None:
    """grpc answers an undecodable body itself (UNKNOWN, naming the parse error);
    a body that decodes is an ordinary request."""
    try:
        call()
    except grpc.RpcError as err:
        parse = f"Error parsing message with type 'pegaflow.v1.{REQUEST_TYPES[method]}'"
        if err.code() == Code.UNKNOWN and parse in (err.details() or ""):
            return
        assert err.code() not in BAD, f"{err.code()}: {err.details()}"


@settings(FUZZ, max_examples=150)
@given(
    method=st.sampled_from(sorted(REQUEST_TYPES)),
    bodies=st.lists(st.binary(max_size=64), min_size=1, max_size=3),
)
def test_fuzz_raw_bytes(fz: Fuzz, method: str, bodies: list[bytes]) -> None:
    path = f"/pegaflow.v1.PegaFlow/{method}"
    if method == "Session":
        stream = fz.channel.stream_stream(path)
        raw_check(method, lambda: list(stream(iter(bodies), timeout=TIMEOUT_S)))
    else:
        unary = fz.channel.unary_unary(path)
        raw_check(method, lambda: unary(bodies[0], timeout=TIMEOUT_S))


# -- the unix-socket fast path ---------------------------------------------------
FAST_BAD = {c.value[0] for c in BAD}


def fast_exchange(fz: Fuzz, body: bytes) -> None:
    """One whole frame on a fresh connection: some reply always comes back, an
    acceptable status or OK, never a dropped connection or INTERNAL."""
    with socket.socket(socket.AF_UNIX) as sock:
        sock.settimeout(TIMEOUT_S)
        sock.connect(fz.client._socket.server.socket_path)
        sock.sendall(len(body).to_bytes(4, "little") + body)
        sock.shutdown(socket.SHUT_WR)
        reply = b""
        while chunk := sock.recv(65536):
            reply += chunk
    assert reply, "connection closed without a reply"
    assert reply[0] == 0 or reply[0] == LOADING or reply[0] not in FAST_BAD, reply


fast_ids = st.lists(
    st.one_of(st.integers(0, BLOCKS + 2), st.integers(0, U32)), max_size=6
)


@settings(FUZZ, max_examples=120)
@given(data=st.data())
def test_fuzz_fast_path_frames(fz: Fuzz, data: st.DataObject) -> None:
    kind = data.draw(st.sampled_from(["query", "save", "load", "raw"]))
    instance = data.draw(st.sampled_from(INSTANCES))
    rank = data.draw(st.one_of(st.integers(0, 2), st.integers(0, U32)))
    if kind == "raw":
        frame = data.draw(st.binary(max_size=80))
    elif kind == "query":
        hs = data.draw(
            st.lists(
                st.sampled_from(ANCHOR_HASHES) | st.binary(min_size=1, max_size=40)
            )
        )
        frame = encode_query(instance, hs) or b"\x01"
        frame = frame[4:]
    elif kind == "save":
        ids = data.draw(fast_ids)
        hs = data.draw(
            st.lists(
                st.binary(min_size=1, max_size=40), min_size=len(ids), max_size=len(ids)
            )
        )
        layers = data.draw(st.lists(st.integers(0, U32), max_size=3))
        event = data.draw(st.integers(0, U32))
        frame = encode_save(instance, rank, np.array(ids, np.int64), hs, layers, event)
        frame = (frame or b"\x02")[4:]
    else:
        hit = fz.client.query("anchor", ANCHOR_HASHES)
        lease = data.draw(st.sampled_from([hit.lease_id, 0, 1, U64]))
        items = [
            (lease, data.draw(st.integers(0, BLOCKS + 1)), np.array(ids, np.int64))
            for ids in data.draw(st.lists(fast_ids, max_size=3))
        ]
        batch, seq = data.draw(st.booleans()), data.draw(st.sampled_from([0, 1, U64]))
        frame = (encode_load(instance, rank, items, batch, seq) or b"\x03")[4:]
        fast_exchange(fz, frame)
        with contextlib.suppress(LeaseNotFound):  # unless the load consumed it
            fz.client.release_lease(hit.lease_id)
        return
    fast_exchange(fz, frame)


# -- afterwards -----------------------------------------------------------------


def test_serves_after_fuzz(fz: Fuzz) -> None:
    """Runs last: alive, healthy, untouched blocks byte-exact, a new round trip."""
    assert fz.server.proc.poll() is None
    assert fz.server.get("/health")[0] == 200

    fz.witness.randomize(list(range(BLOCKS)), seed=5)
    hit = fz.client.query("witness", fz.witness_hashes)
    if hit.num_blocks:  # fuzzed saves may have evicted some; what is left is exact
        ids = list(range(hit.num_blocks))
        assert fz.client.load("witness", hit.lease_id, ids).loaded == hit.num_blocks
        for b in ids:
            np.testing.assert_array_equal(fz.witness.block(b), fz.witness_bytes[b])

    src, dst = LocalKV(LAYERS, BLOCKS, PAGE, seed=3), LocalKV(LAYERS, BLOCKS, PAGE)
    src.register(fz.client, "rt-src", "ns-roundtrip")
    dst.register(fz.client, "rt-dst", "ns-roundtrip")
    hs = hashes(BLOCKS)
    assert fz.client.save("rt-src", range(BLOCKS), hs).stored == BLOCKS
    hit = fz.client.query("rt-dst", hs)
    assert hit.num_blocks == BLOCKS
    into = list(reversed(range(BLOCKS)))
    assert fz.client.load("rt-dst", hit.lease_id, into).loaded == BLOCKS
    for s, d in enumerate(into):
        np.testing.assert_array_equal(dst.block(d), src.block(s))
    assert fz.server.get("/health")[0] == 200
    assert fz.server.proc.poll() is None
