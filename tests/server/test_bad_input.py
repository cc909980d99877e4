"""Bad input to every RPC of a real server process, over the raw generated stub.

Each rejection carries the exact status code and a message that starts with the
offending field ("field: why"). A rejected request changes nothing: the last test
checks that the server still serves, byte for byte, and that blocks acknowledged
before any bad input still load unchanged.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import grpc
import numpy as np
import pytest

from pegaflow.client.pegaflow_client import PegaflowClient, allow_ptrace_from
from pegaflow.proto import pegaflow_pb2 as pb
from pegaflow.proto import pegaflow_pb2_grpc as pb_grpc
from tests.kvbuf import LocalKV, hashes
from tests.procs import HOST_ONLY, ServerProc, start_server

Code = grpc.StatusCode
TIMEOUT_S = 10.0
LAYERS, BLOCKS, PAGE = 4, 64, 4096
KV = LAYERS * BLOCKS * PAGE  # bytes of a LocalKV region
ACKED = list(range(8))  # blocks of "good" saved before any bad input
MAX_BLOCKS = 65536  # EngineConfig.max_blocks_per_request
U32, U64 = (1 << 32) - 1, (1 << 64) - 1


@dataclass
class Env:
    server: ServerProc
    channel: grpc.Channel
    stub: pb_grpc.PegaFlowStub
    client: PegaflowClient
    kv: LocalKV  # instance "good" in "ns-good"
    other: LocalKV  # instance "other" in "ns-good"
    acked_hashes: list[bytes]
    acked_bytes: list[np.ndarray]
    big: np.ndarray  # one block of it is larger than a pool slot


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    # Registrations here are raw gRPC: host memory over TCP must be allowed
    # (the caller's uid is then checked; tests/server/test_trust.py covers the
    # refusals of the default).
    server = start_server(
        tmp_path_factory.mktemp("bad-input"),
        "--pool-size",
        "64mb",
        "--allow-tcp-host-engines",
        *HOST_ONLY,
    )
    allow_ptrace_from(server.pid)  # raw registrations skip the client's prctl
    channel = grpc.insecure_channel(server.addr)
    client = PegaflowClient(server.addr, timeout_s=TIMEOUT_S)
    kv = LocalKV(LAYERS, BLOCKS, PAGE, seed=1)
    other = LocalKV(LAYERS, BLOCKS, PAGE, seed=2)
    kv.register(client, "good", "ns-good")
    other.register(client, "other", "ns-good")
    acked = hashes(len(ACKED))
    assert client.save("good", ACKED, acked).stored == len(ACKED)
    yield Env(
        server,
        channel,
        pb_grpc.PegaFlowStub(channel),
        client,
        kv,
        other,
        acked,
        [kv.block(b).copy() for b in ACKED],
        np.ones(5 << 20, np.uint8),
    )
    client.close()
    channel.close()
    server.stop()


def expect(
    method: Callable[..., object], request: object, code: Code, field: str
) -> str:
    """Call, and check the status and that the message starts with `field:`."""
    with pytest.raises(grpc.RpcError) as info:
        method(request, timeout=TIMEOUT_S)
    err = info.value
    assert err.code() == code, err.details()
    assert err.details().startswith(f"{field}:"), err.details()
    return err.details()


# -- RegisterInstance ---------------------------------------------------------


def host(addr: int, size: int, pid: int | None = None) -> pb.MemoryRegion:
    pid = os.getpid() if pid is None else pid
    return pb.MemoryRegion(host=pb.HostRegion(pid=pid, address=addr, size=size))


def cuda(size: int = PAGE) -> pb.MemoryRegion:
    region = pb.CudaRegion(ipc_handle=bytes(64), size=size, device_uuid=bytes(16))
    return pb.MemoryRegion(cuda=region)


def layers(page: int = PAGE, n: int = LAYERS, **last: object) -> list[pb.LayerLayout]:
    """LBNHC layers of a LocalKV; `last` overrides fields of the last layer."""
    out = [
        pb.LayerLayout(
            offset=i * BLOCKS * PAGE,
            num_blocks=BLOCKS,
            block_stride=PAGE,
            segments=[pb.Segment(offset=0, size=page)],
        )
        for i in range(n)
    ]
    for name, value in last.items():
        if name == "segments":
            out[-1].ClearField("segments")
            out[-1].segments.extend(value)
        else:
            setattr(out[-1], name, value)
    return out


def reg(env: Env, **over: object) -> pb.RegisterInstanceRequest:
    """A valid re-registration of "good" rank 0, with fields replaced."""
    fields: dict[str, object] = dict(
        instance_id="good",
        namespace="ns-good",
        tp_rank=0,
        tp_size=1,
        world_size=1,
        device="cpu",
        regions=[host(*env.kv.mem.regions[0])],
        layers=layers(),
        owner_token=env.client._token("good", 0),  # its owner re-registering
    )
    fields.update(over)
    return pb.RegisterInstanceRequest(**fields)


def owned(env: Env, request: pb.SaveRequest) -> pb.SaveRequest:
    """The request with the owner token of its instance, as its engine sends."""
    out = type(request)()
    out.CopyFrom(request)
    out.owner_token = env.client._token(request.instance_id, request.tp_rank)
    return out


def _dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def _server_mapping(pid: int) -> tuple[int, int]:
    """A read-write mapping of the server process, as an engine could name it."""
    with open(f"/proc/{pid}/maps") as f:
        for line in f:
            span, perms = line.split()[:2]
            start, end = (int(x, 16) for x in span.split("-"))
            if perms.startswith("rw") and end - start >= PAGE:
                return start, PAGE
    raise AssertionError("server maps nothing read-write")


def mine(e: Env, size: int = KV, pid: int | None = None) -> pb.MemoryRegion:
    """The "good" LocalKV region, with another size or pid."""
    return host(e.kv.mem.regions[0][0], size, pid)


def one_page(size: int = PAGE) -> list[pb.LayerLayout]:
    return [pb.LayerLayout(num_blocks=1, segments=[pb.Segment(size=size)])]


Rq = Callable[[Env], pb.RegisterInstanceRequest]
INVALID, PRECONDITION = Code.INVALID_ARGUMENT, Code.FAILED_PRECONDITION
SEG = pb.Segment
# fmt: off
REGISTER_CASES: list[tuple[str, Rq, Code, str]] = [
    ("empty-instance", lambda e: reg(e, instance_id=""), INVALID, "instance_id"),
    ("long-instance", lambda e: reg(e, instance_id="i" * 257), INVALID, "instance_id"),
    ("unprintable-id", lambda e: reg(e, instance_id="a\nb"), INVALID, "instance_id"),
    ("empty-namespace", lambda e: reg(e, namespace=""), INVALID, "namespace"),
    ("tp-size-0", lambda e: reg(e, tp_size=0), INVALID, "tp_size"),
    ("tp-size-huge", lambda e: reg(e, tp_size=U32, world_size=U32), INVALID, "tp_size"),
    ("rank-ge-size", lambda e: reg(e, tp_rank=1, tp_size=1), INVALID, "tp_rank"),
    ("rank-huge", lambda e: reg(e, tp_rank=U32), INVALID, "tp_rank"),
    ("world-lt-tp", lambda e: reg(e, tp_size=2, world_size=1), INVALID, "world_size"),
    ("device-gpu", lambda e: reg(e, device="gpu:0"), INVALID, "device"),
    ("device-empty", lambda e: reg(e, device=""), INVALID, "device"),
    ("device-no-index", lambda e: reg(e, device="cuda:"), INVALID, "device"),
    ("device-space", lambda e: reg(e, device="cpu "), INVALID, "device"),
    # regions: kinds, pids, mappings
    ("no-regions", lambda e: reg(e, regions=[]), INVALID, "regions"),
    ("no-kind", lambda e: reg(e, regions=[pb.MemoryRegion()]), INVALID, "regions"),
    ("mixed-kinds", lambda e: reg(e, regions=[mine(e), cuda()]), INVALID, "regions"),
    ("two-pids", lambda e: reg(e, regions=[mine(e), mine(e, pid=1)]), INVALID,
     "regions"),
    ("pid-0", lambda e: reg(e, regions=[mine(e, pid=0)]), INVALID,
     "regions[0].host.pid"),
    ("pid-dead", lambda e: reg(e, regions=[mine(e, pid=_dead_pid())]), INVALID,
     "regions.host.pid"),
    ("pid-2-31", lambda e: reg(e, regions=[mine(e, pid=(1 << 31) - 1)]), INVALID,
     "regions.host.pid"),
    ("pid-u32-max", lambda e: reg(e, regions=[mine(e, pid=U32)]), INVALID,
     "regions.host.pid"),
    # Fixed: loads would have written into the server's own memory (its pool).
    ("pid-of-server", lambda e: reg(
        e, regions=[host(*_server_mapping(e.server.pid), e.server.pid)],
        layers=one_page()), Code.PERMISSION_DENIED, "regions.host.pid"),
    ("unmapped", lambda e: reg(e, regions=[host(0x1000, KV)]), INVALID, "regions[0]"),
    ("past-mapping", lambda e: reg(e, regions=[mine(e, 1 << 40)]), INVALID,
     "regions[0]"),
    ("wraps-2-64", lambda e: reg(e, regions=[host(U64 - PAGE + 1, KV)]), INVALID,
     "regions[0]"),
    ("size-0", lambda e: reg(e, regions=[mine(e, 0)]), INVALID, "regions[0].size"),
    ("cuda-on-cpu", lambda e: reg(e, regions=[cuda(KV)]), INVALID, "regions"),
    ("host-on-cuda", lambda e: reg(e, device="cuda:0"), INVALID, "regions"),
    ("cuda-no-gpu", lambda e: reg(e, device="cuda:0", regions=[cuda(KV)]),
     PRECONDITION, "regions"),
    # layers: counts, indices, pages reaching past the region
    ("no-layers", lambda e: reg(e, layers=[]), INVALID, "layers"),
    ("4097-layers", lambda e: reg(e, layers=layers(n=1) * 4097), INVALID, "layers"),
    ("region-index", lambda e: reg(e, layers=layers(region_index=1)), INVALID,
     "layers[3].region_index"),
    ("blocks-0", lambda e: reg(e, layers=layers(num_blocks=0)), INVALID,
     "layers[3].num_blocks"),
    ("blocks-differ", lambda e: reg(e, layers=layers(num_blocks=BLOCKS - 1)),
     INVALID, "layers[3].num_blocks"),
    ("no-segments", lambda e: reg(e, layers=layers(segments=[])), INVALID,
     "layers[3].segments"),
    ("9-segments", lambda e: reg(e, layers=layers(segments=[SEG(size=1)] * 9)),
     INVALID, "layers[3].segments"),
    ("segment-0", lambda e: reg(e, layers=layers(segments=[SEG(size=0)])), INVALID,
     "layers[3].segments"),
    ("stride-0", lambda e: reg(e, layers=layers(block_stride=0)), INVALID,
     "layers[3].block_stride"),
    ("offset-past", lambda e: reg(e, layers=layers(offset=3 * BLOCKS * PAGE + PAGE)),
     INVALID, "layers[3]"),
    ("stride-past", lambda e: reg(e, layers=layers(block_stride=2 * PAGE)), INVALID,
     "layers[3]"),
    ("segment-past", lambda e: reg(e, layers=layers(segments=[SEG(offset=1,
     size=PAGE)])), INVALID, "layers[3]"),
    ("offset-huge", lambda e: reg(e, layers=layers(offset=U64)), INVALID, "layers[3]"),
    # Fixed: pages sharing memory were accepted; every load of them failed as
    # INTERNAL (the copy's own overlap check).
    ("pages-overlap", lambda e: reg(e, layers=layers(offset=BLOCKS * PAGE // 2)),
     INVALID, "layers[3].segments[0]"),
    # Fixed: a block larger than a pool slot made every Save fail INTERNAL.
    ("block-over-slot", lambda e: reg(
        e, instance_id="big", namespace="ns-big", layers=one_page(5 << 20),
        regions=[host(e.big.ctypes.data, e.big.nbytes)]), INVALID, "layers"),
    # namespaces and instances already registered
    ("ns-page-size", lambda e: reg(e, instance_id="odd", layers=layers(PAGE // 2)),
     INVALID, "layers"),
    ("ns-layer-count", lambda e: reg(e, instance_id="odd", layers=layers(n=3)),
     INVALID, "layers"),
    ("ns-tp-size", lambda e: reg(e, instance_id="odd", tp_size=2, world_size=2),
     INVALID, "tp_size"),
    ("instance-namespace", lambda e: reg(e, namespace="ns-elsewhere"), INVALID,
     "instance_id"),
    ("instance-world", lambda e: reg(e, world_size=2), INVALID, "instance_id"),
]
# fmt: on


@pytest.mark.parametrize(
    ("build", "code", "field"),
    [pytest.param(*case[1:], id=case[0]) for case in REGISTER_CASES],
)
def test_register_rejected(env: Env, build: Rq, code: Code, field: str) -> None:
    expect(env.stub.RegisterInstance, build(env), code, field)


def test_register_zombie_pid(env: Env) -> None:
    """An engine killed but not yet reaped has no memory map: refused by pid."""
    child = subprocess.Popen(["sleep", "60"])
    try:
        child.send_signal(signal.SIGKILL)
        os.waitid(os.P_PID, child.pid, os.WEXITED | os.WNOWAIT)  # exited, not reaped
        addr = env.kv.mem.regions[0][0]
        req = reg(env, regions=[host(addr, KV, child.pid)])
        assert "exited" in expect(env.stub.RegisterInstance, req, INVALID, "pid")
    finally:
        child.wait()


def test_rejected_registration_leaves_no_namespace(env: Env) -> None:
    """Regression: "good" (registered in ns-good) asks for a new namespace with a
    half-size page and is refused; the new namespace must not keep that geometry,
    so a later engine with full-size pages can still create it."""
    bad = reg(env, namespace="ns-fresh", layers=layers(page=PAGE // 2))
    expect(env.stub.RegisterInstance, bad, INVALID, "instance_id")
    env.other.register(env.client, "fresh", "ns-fresh")
    env.client.unregister("fresh")


# -- Save ---------------------------------------------------------------------


def save(**over: object) -> pb.SaveRequest:
    fields: dict[str, object] = dict(
        instance_id="good", tp_rank=0, block_ids=[8, 9], block_hashes=hashes(2)
    )
    fields.update(over)
    return pb.SaveRequest(**fields)


MANY = MAX_BLOCKS + 1
# fmt: off
SAVE_CASES: list[tuple[str, pb.SaveRequest, Code, str]] = [
    ("unknown-instance", save(instance_id="nobody"), PRECONDITION, "instance_id"),
    ("empty-instance", save(instance_id=""), PRECONDITION, "instance_id"),
    ("unknown-rank", save(tp_rank=3), PRECONDITION, "tp_rank"),
    ("rank-u32-max", save(tp_rank=U32), PRECONDITION, "tp_rank"),
    ("more-hashes", save(block_hashes=hashes(3)), INVALID, "block_hashes"),
    ("fewer-hashes", save(block_hashes=hashes(1)), INVALID, "block_hashes"),
    ("no-hashes", save(block_hashes=[]), INVALID, "block_hashes"),
    ("hash-0-bytes", save(block_hashes=[*hashes(1), b""]), INVALID, "block_hashes[1]"),
    ("hash-65-bytes", save(block_hashes=[bytes(65), *hashes(1)]), INVALID,
     "block_hashes[0]"),
    ("block-id-num-blocks", save(block_ids=[8, BLOCKS]), INVALID, "block_ids"),
    ("block-id-u32-max", save(block_ids=[U32, 9]), INVALID, "block_ids"),
    ("layer-id-range", save(layer_ids=[0, LAYERS]), INVALID, "layer_ids"),
    ("layer-id-u32-max", save(layer_ids=[U32]), INVALID, "layer_ids"),
    ("layer-id-duplicate", save(layer_ids=[1, 1]), INVALID, "layer_ids"),
    # Refused by the per-request block cap (common.request_limits) before the hashes.
    ("too-many-blocks", save(block_ids=[0] * MANY, block_hashes=[b"h"] * MANY),
     INVALID, "block_ids"),
]
# fmt: on


@pytest.mark.parametrize(
    ("request_", "code", "field"),
    [pytest.param(*case[1:], id=case[0]) for case in SAVE_CASES],
)
def test_save_rejected(
    env: Env, request_: pb.SaveRequest, code: Code, field: str
) -> None:
    expect(env.stub.Save, owned(env, request_), code, field)
    first = [h for h in request_.block_hashes[:2] if 0 < len(h) <= 64]
    assert env.client.query("good", first).num_blocks == 0  # nothing was stored


# -- QueryPrefix --------------------------------------------------------------


def query(instance: str = "good", *hs: bytes) -> pb.QueryPrefixRequest:
    return pb.QueryPrefixRequest(instance_id=instance, block_hashes=hs)


# fmt: off
QUERY_CASES: list[tuple[str, pb.QueryPrefixRequest, Code, str]] = [
    ("unknown-instance", query("nobody"), PRECONDITION, "instance_id"),
    ("empty-instance", query("", *hashes(1)), PRECONDITION, "instance_id"),
    ("hash-0-bytes", query("good", b""), INVALID, "block_hashes[0]"),
    ("hash-65-bytes", query("good", *hashes(2), bytes(65)), INVALID, "block_hashes[2]"),
    ("too-many-hashes", query("good", *[b"h"] * MANY), INVALID, "block_hashes"),
]
# fmt: on


@pytest.mark.parametrize(
    ("request_", "code", "field"),
    [pytest.param(*case[1:], id=case[0]) for case in QUERY_CASES],
)
def test_query_rejected(
    env: Env, request_: pb.QueryPrefixRequest, code: Code, field: str
) -> None:
    expect(env.stub.QueryPrefix, request_, code, field)


def test_oversized_message_refused_by_grpc(env: Env) -> None:
    """9 MiB is above the server's 8 MiB receive limit: grpc itself refuses."""
    req = pb.QueryPrefixRequest(instance_id="good", block_hashes=[bytes(9 << 20)])
    with pytest.raises(grpc.RpcError) as info:
        env.stub.QueryPrefix(req, timeout=30)
    assert info.value.code() == Code.RESOURCE_EXHAUSTED
    assert "larger than max" in info.value.details()


# -- Load and ReleaseLease ----------------------------------------------------


def lease(env: Env, instance: str = "good") -> int:
    hit = env.client.query(instance, env.acked_hashes)
    assert hit.num_blocks == len(ACKED)
    return hit.lease_id


def test_load_rejected_then_lease_still_loads(env: Env) -> None:
    """Every bad Load names its field and leaves the lease intact: it still loads
    all its blocks, and is then consumed (ReleaseLease: NOT_FOUND)."""
    lid = lease(env)
    foreign = lease(env, "other")

    def load(**over: object) -> pb.LoadRequest:
        fields: dict[str, object] = dict(
            instance_id="good", tp_rank=0, lease_id=lid, block_ids=ACKED
        )
        return owned(env, pb.LoadRequest(**{**fields, **over}))

    cases: list[tuple[pb.LoadRequest, Code, str]] = [
        (load(instance_id="nobody"), PRECONDITION, "instance_id"),
        (load(instance_id=""), PRECONDITION, "instance_id"),
        (load(tp_rank=1), PRECONDITION, "tp_rank"),
        (load(lease_id=lid ^ 2), Code.NOT_FOUND, "lease_id"),
        (load(lease_id=0), Code.NOT_FOUND, "lease_id"),
        (load(lease_id=U64), Code.NOT_FOUND, "lease_id"),
        (load(lease_id=foreign), INVALID, "lease_id"),
        (load(block_ids=[*ACKED, 9]), INVALID, "block_ids"),
        (load(lease_offset=6, block_ids=[0, 1, 2]), INVALID, "block_ids"),
        (load(lease_offset=U32, block_ids=[0]), INVALID, "block_ids"),
        (load(block_ids=[0, 1, 2, 3, 4, 5, 6, BLOCKS]), INVALID, "block_ids"),
        (load(block_ids=[U32] * 8), INVALID, "block_ids"),
        (load(block_ids=[0, 1, 2, 3, 4, 5, 6, 3]), INVALID, "block_ids"),  # twice
    ]
    for req, code, field in cases:
        expect(env.stub.Load, req, code, field)
    env.client.release_lease(foreign)
    resp = env.stub.Load(load(), timeout=TIMEOUT_S)
    assert resp.loaded == len(ACKED)
    assert resp.bytes == len(ACKED) * LAYERS * PAGE
    expect(
        env.stub.ReleaseLease,
        pb.ReleaseLeaseRequest(lease_id=lid),
        Code.NOT_FOUND,
        "lease_id",
    )


@pytest.mark.parametrize("lease_id", [0, 1, 12345, U64])
def test_release_garbage_lease(env: Env, lease_id: int) -> None:
    req = pb.ReleaseLeaseRequest(lease_id=lease_id)
    expect(env.stub.ReleaseLease, req, Code.NOT_FOUND, "lease_id")


def test_release_lease_twice(env: Env) -> None:
    req = pb.ReleaseLeaseRequest(lease_id=lease(env))
    env.stub.ReleaseLease(req, timeout=TIMEOUT_S)
    expect(env.stub.ReleaseLease, req, Code.NOT_FOUND, "lease_id")


# -- Unregister and Session ---------------------------------------------------


@pytest.mark.parametrize(
    ("instance", "rank", "field"),
    [
        ("nobody", 0, "instance_id"),
        ("", 0, "instance_id"),
        ("good", 1, "tp_rank"),
        ("good", U32, "tp_rank"),
    ],
)
def test_unregister_unknown(env: Env, instance: str, rank: int, field: str) -> None:
    req = pb.UnregisterRequest(instance_id=instance, tp_rank=rank)
    expect(env.stub.Unregister, req, PRECONDITION, field)


def test_unregister_twice(env: Env) -> None:
    env.other.register(env.client, "twice", "ns-good")
    req = owned(env, pb.UnregisterRequest(instance_id="twice"))
    env.stub.Unregister(req, timeout=TIMEOUT_S)
    expect(env.stub.Unregister, req, PRECONDITION, "instance_id")


@pytest.mark.parametrize(
    ("instance", "rank", "field"),
    [("nobody", 0, "instance_id"), ("", 0, "instance_id"), ("good", 2, "tp_rank")],
)
def test_session_unknown_worker(env: Env, instance: str, rank: int, field: str) -> None:
    pings = iter([pb.SessionPing(instance_id=instance, tp_rank=rank)])
    with pytest.raises(grpc.RpcError) as info:
        list(env.stub.Session(pings, timeout=TIMEOUT_S))
    assert info.value.code() == PRECONDITION, info.value.details()
    assert info.value.details().startswith(f"{field}:"), info.value.details()


def test_session_without_ping_ends_quietly(env: Env) -> None:
    assert list(env.stub.Session(iter(()), timeout=TIMEOUT_S)) == []


def test_a_session_that_never_pings_is_ended(env: Env) -> None:
    """An open stream that never says who it is would hold one of the
    server's concurrent RPCs for good: the server ends it after 10 s."""
    quiet = threading.Event()

    def never() -> Iterator[pb.SessionPing]:
        quiet.wait(30)  # until the test ends: the client never sends a ping
        return
        yield

    started = time.monotonic()
    try:
        with pytest.raises(grpc.RpcError) as info:
            list(env.stub.Session(never(), timeout=25))
    finally:
        quiet.set()
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert "no first ping within 10 s" in info.value.details()
    assert 9 < time.monotonic() - started < 20


# -- undecodable bodies ---------------------------------------------------------

METHODS = {
    "RegisterInstance": "RegisterInstanceRequest",
    "Save": "SaveRequest",
    "QueryPrefix": "QueryPrefixRequest",
    "Load": "LoadRequest",
    "ReleaseLease": "ReleaseLeaseRequest",
    "Unregister": "UnregisterRequest",
}


@pytest.mark.parametrize("method", sorted(METHODS))
@pytest.mark.parametrize("body", [b"\xff\xff\xff", b"\x0a\x05ab", b"\x12\x02\xc3\x28"])
def test_undecodable_body(env: Env, method: str, body: bytes) -> None:
    """Bad wire type, truncated field, invalid UTF-8 (or a bytes field): grpc's
    deserializer refuses before our code runs (UNKNOWN, "Error parsing message"),
    or the bytes happen to decode and the server answers as for any request."""
    call = env.channel.unary_unary(f"/pegaflow.v1.PegaFlow/{method}")
    with pytest.raises(grpc.RpcError) as info:
        call(body, timeout=TIMEOUT_S)
    err = info.value
    if err.code() == Code.UNKNOWN:
        assert f"Error parsing message with type 'pegaflow.v1.{METHODS[method]}'" in (
            err.details()
        )
    else:
        assert err.code() in (INVALID, PRECONDITION, Code.NOT_FOUND), err.details()


# -- afterwards ---------------------------------------------------------------


def test_still_serves_and_acked_blocks_intact(env: Env) -> None:
    """Runs last: the process lives, /health answers, the blocks saved before all
    the bad input load byte-exact, and a new register/save/query/load round trip
    moves every byte."""
    assert env.server.proc.poll() is None
    status, body = env.server.get("/health")
    assert status == 200
    assert json.loads(body)["workers"] == 2  # "good" and "other"; no bad one got in

    env.kv.randomize(ACKED, seed=11)
    lid = lease(env)
    assert env.client.load("good", lid, ACKED).loaded == len(ACKED)
    for b, want in zip(ACKED, env.acked_bytes, strict=True):
        np.testing.assert_array_equal(env.kv.block(b), want)

    src, dst = LocalKV(LAYERS, BLOCKS, PAGE, seed=21), LocalKV(LAYERS, BLOCKS, PAGE)
    src.register(env.client, "rt-src", "ns-roundtrip")
    dst.register(env.client, "rt-dst", "ns-roundtrip")
    ids, hs = list(range(10, 30)), hashes(20)
    assert env.client.save("rt-src", ids, hs).stored == 20
    hit = env.client.query("rt-dst", [*hs, *hashes(1)])
    assert hit.num_blocks == 20
    into = list(range(63, 43, -1))
    assert env.client.load("rt-dst", hit.lease_id, into).loaded == 20
    for s, d in zip(ids, into, strict=True):
        np.testing.assert_array_equal(dst.block(d), src.block(s))
    env.client.unregister("rt-src")
    env.client.unregister("rt-dst")
    assert env.server.get("/health")[0] == 200
