"""Batched Load (LoadRequest.items) and replicated (MLA) registration through a
real server process: one copy for every item, per-item results for gone leases,
whole-call rejections that name `items[i].field` and leave every lease intact."""

from __future__ import annotations

import os
import re
from collections.abc import Iterator

import grpc
import numpy as np
import pytest

from pegaflow.client.pegaflow_client import LoadItem, PegaflowClient
from pegaflow.common.errors import InvalidRequest
from pegaflow.proto import pegaflow_pb2 as pb
from pegaflow.proto import pegaflow_pb2_grpc as pb_grpc
from tests.kvbuf import LocalKV, hashes
from tests.procs import ServerProc, start_server

LAYERS, BLOCKS, PAGE = 4, 64, 4096
Code = grpc.StatusCode


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProc]:
    srv = start_server(tmp_path_factory.mktemp("batch-load"), "--pool-size", "64mb")
    yield srv
    srv.stop()


@pytest.fixture
def client(server: ServerProc) -> Iterator[PegaflowClient]:
    with PegaflowClient(server.addr, timeout_s=10.0) as c:
        yield c


def saved(
    client: PegaflowClient, name: str, n: int = 24
) -> tuple[LocalKV, LocalKV, list[bytes]]:
    """Engine `name`-src saved blocks [0, n); `name` (empty KV) will load them."""
    src, dst = LocalKV(LAYERS, BLOCKS, PAGE, seed=1), LocalKV(LAYERS, BLOCKS, PAGE)
    dst.buf[:] = 0
    src.register(client, f"{name}-src", f"ns-{name}")
    dst.register(client, name, f"ns-{name}")
    hs = hashes(n)
    assert client.save(f"{name}-src", range(n), hs).stored == n
    return src, dst, hs


def load_copies(server: ServerProc) -> float:
    return server.metric("pegaflow_transfer_seconds_count", 'direction="load"')


def test_items_load_in_one_copy_and_a_gone_lease_fails_alone(
    server: ServerProc, client: PegaflowClient
) -> None:
    src, dst, hs = saved(client, "batch")
    first = client.query("batch", hs[:10])
    second = client.query("batch", hs)  # loaded from offset 4, 12 blocks
    gone = client.query("batch", hs[:6])
    client.release_lease(gone.lease_id)
    into = [list(range(63, 53, -1)), list(range(30, 42)), [50, 51, 52]]
    copies = load_copies(server)
    res = client.load_many(
        "batch",
        [
            LoadItem(first.lease_id, into[0]),
            LoadItem(second.lease_id, into[1], lease_offset=4),
            LoadItem(gone.lease_id, into[2]),
        ],
    )
    assert load_copies(server) == copies + 1  # one copy for all items
    assert (res.loaded, res.bytes) == (22, 22 * LAYERS * PAGE)
    assert [(r.loaded, r.bytes) for r in res.items] == [
        (10, 10 * LAYERS * PAGE),
        (12, 12 * LAYERS * PAGE),
        (0, 0),
    ]
    assert res.failed == [2]
    assert res.items[2].error.startswith("items[2].lease_id:")
    for s, d in zip(range(10), into[0], strict=True):
        np.testing.assert_array_equal(dst.block(d), src.block(s))
    for s, d in zip(range(4, 16), into[1], strict=True):
        np.testing.assert_array_equal(dst.block(d), src.block(s))
    assert not dst.block(50).any()  # the gone lease's blocks are untouched
    assert server.metric("pegaflow_active_leases") == 0  # both consumed


def test_bad_items_name_the_item_and_change_nothing(
    server: ServerProc, client: PegaflowClient
) -> None:
    src, dst, hs = saved(client, "bad", n=8)
    own = client.query("bad", hs).lease_id
    foreign = client.query("bad-src", hs).lease_id
    ok = LoadItem(own, list(range(8)))
    cases = [
        ([ok, LoadItem(foreign, [0])], "items[1].lease_id"),
        ([ok, ok, LoadItem(own, [BLOCKS])], "items[2].block_ids"),
        ([LoadItem(own, [0, 1], lease_offset=7)], "items[0].block_ids"),
        ([LoadItem(own, list(range(9)))], "items[0].block_ids"),
    ]
    copies = load_copies(server)
    for items, field in cases:
        with pytest.raises(
            InvalidRequest, match="^INVALID_ARGUMENT: " + re.escape(field) + ":"
        ):
            client.load_many("bad", items)
    assert load_copies(server) == copies  # nothing moved
    assert not dst.buf.any()
    channel = grpc.insecure_channel(server.addr)
    stub = pb_grpc.PegaFlowStub(channel)
    both = pb.LoadRequest(
        instance_id="bad", lease_id=own, items=[pb.LoadItem(lease_id=own)]
    )
    with pytest.raises(grpc.RpcError) as info:
        stub.Load(both, timeout=10)
    assert info.value.code() == Code.INVALID_ARGUMENT
    assert info.value.details().startswith("items:")
    channel.close()
    # The leases survived every rejection: the own one still loads whole.
    res = client.load_many("bad", [ok])
    assert res.loaded == 8 and res.failed == []
    for b in range(8):
        np.testing.assert_array_equal(dst.block(b), src.block(b))
    client.release_lease(foreign)
    assert server.metric("pegaflow_active_leases") == 0


def test_replicated_blocks_are_stored_once_and_loaded_by_every_rank(
    server: ServerProc, client: PegaflowClient
) -> None:
    """MLA: rank 0 saves the even blocks, rank 1 the odd ones, into one shard
    each; a block is a hit as soon as its one shard landed, and both ranks of
    another instance load every block."""
    kv = LocalKV(LAYERS, BLOCKS, PAGE, seed=5)  # one latent KV, as on every rank
    for rank in range(2):
        client.register_host(
            "mla", "ns-mla", *_host(kv), tp_rank=rank, tp_size=2, replicated=True
        )
    used = server.metric("pegaflow_pool_used_bytes")
    hs = hashes(10)
    assert client.save("mla", range(0, 10, 2), hs[0::2], tp_rank=0).stored == 5
    early = client.query("mla", hs)
    assert early.num_blocks == 1  # block 1 not saved yet
    client.release_lease(early.lease_id)
    assert client.save("mla", range(1, 10, 2), hs[1::2], tp_rank=1).stored == 5
    assert server.metric("pegaflow_pool_used_bytes") - used == 10 * LAYERS * PAGE
    # A rank's save of a block the other rank stored is a duplicate.
    assert client.save("mla", [0], hs[:1], tp_rank=1).deduplicated == 1

    loaders = [LocalKV(LAYERS, BLOCKS, PAGE) for _ in range(2)]
    for rank, other in enumerate(loaders):
        other.buf[:] = 0
        client.register_host(
            "mla-b", "ns-mla", *_host(other), tp_rank=rank, tp_size=2, replicated=True
        )
    lease = client.query("mla-b", hs)
    assert lease.num_blocks == 10
    into = list(range(40, 50))
    for rank, other in enumerate(loaders):
        res = client.load_many("mla-b", [LoadItem(lease.lease_id, into)], rank)
        assert res.loaded == 10
        for s, d in enumerate(into):
            np.testing.assert_array_equal(other.block(d), kv.block(s))
    assert server.metric("pegaflow_active_leases") == 0

    # One namespace stores blocks one way: plain TP=2 (two shards) is refused.
    with pytest.raises(InvalidRequest, match=r"^INVALID_ARGUMENT: tp_size: 2 "):
        client.register_host("tp2", "ns-mla", *_host(kv), tp_rank=0, tp_size=2)


def _host(kv: LocalKV) -> tuple[int, object, object]:
    return os.getpid(), kv.mem.regions, kv.mem.layers
