"""The remote tier's pure parts: batch cutting, endpoint parsing, the routable
--addr check, the --nics check against a sysfs tree, a peer's Pin answer."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest

from pegaflow.common.keys import Namespace
from pegaflow.proto import peer_pb2 as pb
from pegaflow.tiers.remote.fetch import PlanSegment, Refused, check_pin, clip_plan
from pegaflow.tiers.remote.nics import NicError, active_devices, check_nics
from pegaflow.tiers.remote.peers import Endpoint, PeerChannels
from pegaflow.tiers.remote.remote_config import RemoteConfig, check_routable
from pegaflow.tiers.remote.transfer_engine import batches


def test_batches_cut_at_the_limit_and_cover_everything() -> None:
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 100, 1000).astype(np.uint64)
    cuts = batches(lengths, 512)
    assert cuts[0][0] == 0 and cuts[-1][1] == len(lengths)
    assert all(a[1] == b[0] for a, b in zip(cuts, cuts[1:], strict=False))
    assert all(int(lengths[a:b].sum()) <= 512 for a, b in cuts)
    assert batches(np.array([2000], np.uint64), 512) == [(0, 1)]  # one big entry
    assert batches(np.zeros(0, np.uint64), 512) == []


def test_endpoint_round_trip_and_garbage_refused() -> None:
    """An endpoint comes from the metaserver, that is from any node: only
    HOST:PORT pairs are dialled, never another grpc target (unix:, dns:)."""
    for e in (Endpoint("10.0.0.5:50055", "10.0.0.5:15000"),
              Endpoint("node-a.example.com:1", "[fe80::1]:65535")):  # fmt: skip
        assert Endpoint.parse(str(e)) == e
    bad = ["", "rpc=a", "rpc=1.2.3.4:5", "te=1:2", "rpc=x;te=y", "junk",
           "rpc=unix:/run/x.sock;te=a:1", "rpc=unix:/x:5;te=a:1",
           "rpc=dns:///x:1;te=a:1", "rpc=a:0;te=a:1", "rpc=a:70000;te=a:1",
           "rpc=a:1;te=a:1;x=y", "rpc=::1:5;te=a:1", "rpc=[zz]:1;te=a:1",
           "rpc=-a:1;te=a:1", "rpc=a b:1;te=a:1", "rpc=a:1;rpc=b:1"]  # fmt: skip
    for text in bad:
        with pytest.raises(ValueError):
            Endpoint.parse(text)


def test_addr_must_be_routable() -> None:
    assert check_routable("10.1.2.3:50055") == "10.1.2.3"
    with pytest.raises(ValueError, match="wildcard"):
        check_routable("0.0.0.0:50055")
    with pytest.raises(ValueError, match="loopback"):
        check_routable("127.0.0.1:50055")
    assert check_routable("127.0.0.1:1", allow_loopback=True) == "127.0.0.1"
    with pytest.raises(ValueError, match="rdma needs --nics"):
        RemoteConfig("m:1", protocol="rdma")


def _device(root: Path, name: str, state: str) -> None:
    port = root / name / "ports" / "1"
    port.mkdir(parents=True)
    (port / "state").write_text(state)


def test_nics_need_an_active_port(tmp_path: Path) -> None:
    _device(tmp_path, "mlx5_0", "4: ACTIVE\n")
    _device(tmp_path, "mlx5_1", "1: DOWN\n")
    check_nics(("mlx5_0",), tmp_path)
    with pytest.raises(NicError, match="mlx5_1 has no active port"):
        check_nics(("mlx5_0", "mlx5_1"), tmp_path)
    with pytest.raises(NicError, match="no RDMA device 'mlx5_9'"):
        check_nics(("mlx5_9",), tmp_path)
    with pytest.raises(NicError, match="not an RDMA device name"):
        check_nics(("../etc",), tmp_path)
    assert active_devices(tmp_path) == ["mlx5_0"]


NS = Namespace("m", 1, 2, 4, 4096, (4, 1024))


def _pin(blocks: int, shards: int = 2, slot_bytes: int = 4096, sums: bool = True):
    addrs = np.arange(blocks * shards, dtype="<u8") * 4096
    return pb.PinResponse(
        pin_id=7, blocks=blocks, shards=shards, slot_bytes=slot_bytes,
        slot_addrs=addrs.tobytes(), checksums=addrs.tobytes() if sums else b"",
    )  # fmt: skip


def test_a_peers_pin_is_checked_before_any_read() -> None:
    remote, sums = check_pin(_pin(3), 4, NS)
    assert remote.shape == (3, 2) and sums.shape == (3, 2)
    assert check_pin(_pin(3, sums=False), 4, NS)[1] is None
    cases = {
        "peer_evicted": pb.PinResponse(pin_id=0),
        "geometry": _pin(3, slot_bytes=8192),
    }
    too_many = _pin(5)
    short = _pin(3)
    short.slot_addrs = short.slot_addrs[:-8]
    torn = _pin(3)
    torn.checksums = torn.checksums[:8]
    unsaid = _pin(3, shards=0, slot_bytes=0)  # blocks granted, no geometry
    unsaid.slot_addrs = unsaid.checksums = b""
    for cause, pin in [*cases.items(), ("geometry", too_many),
                       ("geometry", short), ("geometry", torn),
                       ("geometry", unsaid)]:  # fmt: skip
        with pytest.raises(Refused) as err:
            check_pin(pin, 4, NS)
        assert err.value.cause == cause


def test_plan_clipped_to_the_slots_reserved() -> None:
    e = Endpoint("a:1", "a:2")
    plan = [PlanSegment(e, 0, 3, 7), PlanSegment(e, 3, 4, 7)]
    assert [(s.start, s.blocks) for s in clip_plan(plan, 5)] == [(0, 3), (3, 2)]
    assert [(s.start, s.blocks) for s in clip_plan(plan, 2)] == [(0, 2)]
    assert {s.incarnation for s in clip_plan(plan, 5)} == {7}  # kept


def test_a_restarted_owner_gets_a_new_channel() -> None:
    """Scenario: an owner was SIGKILLed and restarted (a new incarnation in
    the plan). The channel to its old process may sit in gRPC's reconnect
    backoff, failing every Pin at once while the new process serves (the
    netns test of a stopped peer, right after such a restart, saw its query
    end in 4 ms now and then, and 8 blocks counted peer_unreachable in runs
    that passed): a new incarnation gets a new channel; the same one, and
    calls that name none (checksums, release), keep the channel held."""

    async def run() -> None:
        peers = PeerChannels(None)
        first = peers._stub("10.0.0.2:50055", 5)
        assert peers._stub("10.0.0.2:50055", 5) is first
        assert peers._stub("10.0.0.2:50055") is first  # checksums, release
        second = peers._stub("10.0.0.2:50055", 6)  # the owner restarted
        assert second is not first
        assert peers._stub("10.0.0.2:50055") is second
        assert peers._stub("10.0.0.3:50055", 6) is not second  # another owner
        await asyncio.sleep(0)  # the replaced channel closes meanwhile
        await peers.close()

    asyncio.run(run())
