"""Bringing the remote tier up inside pegaflow-server: check the NICs, start the
transfer engine, register the pool with it (slices of at most 4 GiB, in
parallel, progress on a terminal), serve the Peer RPCs and start advertising."""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time

import grpc
from tqdm import tqdm

from pegaflow.cache.block_store import BlockStore
from pegaflow.cache.pool import HostPool
from pegaflow.common import checksum_rows
from pegaflow.common.settings import parse_addr
from pegaflow.daemon.startup import StartupError
from pegaflow.metaserver.meta_client import MetaClient
from pegaflow.proto import peer_pb2_grpc

from .advertiser import Advertiser
from .link import RemoteLink
from .nics import check_nics
from .peer_service import PeerServicer
from .remote_config import RemoteConfig, check_routable
from .remote_metrics import AdvertiserCollector, RemoteMetrics
from .transfer_engine import MAX_REGISTER_BYTES, MooncakeTransport, TransportSettings

logger = logging.getLogger(__name__)


def preflight(config: RemoteConfig, addr: str) -> str:
    """Checks that need nothing started: the routable --addr and the NICs.
    Returns the host to advertise."""
    try:
        host = check_routable(addr, config.allow_loopback)
        if config.protocol == "rdma":
            check_nics(config.nics)
    except ValueError as exc:
        raise StartupError(str(exc)) from None
    return host


def start_transport(config: RemoteConfig, host: str) -> MooncakeTransport:
    try:
        return MooncakeTransport(TransportSettings(config.protocol, host, config.nics))
    except Exception as exc:  # the engine's own failure: one line, then exit 2
        raise StartupError(f"--metaserver-addr: {exc}") from None


def register_pool(
    transport: MooncakeTransport, base: int, size: int, show_progress: bool
) -> None:
    """Slices of <= 4 GiB registered from a few threads (each registration
    walks its pages)."""
    slices = [
        (base + off, min(MAX_REGISTER_BYTES, size - off))
        for off in range(0, size, MAX_REGISTER_BYTES)
    ]
    bar = tqdm(
        total=size,
        unit="B",
        unit_scale=True,
        desc="registering pool for peers",
        disable=not show_progress,
    )
    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(min(8, len(slices))) as pool:
        for (_, n), _ in zip(
            slices, pool.map(lambda s: transport.register(*s), slices), strict=True
        ):
            bar.update(n)
    bar.close()
    logger.info(
        "pool registered for peers: %d slices in %.2f s",
        len(slices), time.perf_counter() - start,
    )  # fmt: skip


def attach(
    config: RemoteConfig,
    store: BlockStore,
    pool: HostPool,
    transport: MooncakeTransport,
    server: grpc.aio.Server,
    rpc_addr: str,
    metrics_registry: object,
) -> RemoteLink:
    """The link over the store and pool (the caller adds it to the engine's
    tiers), and the Peer service on the gRPC server (before it starts).
    Advertising starts with start_advertising, once serving."""
    metrics = RemoteMetrics(metrics_registry)
    # Compiled now, not on the event loop at the first pin or fetch (the key
    # binding of every checksum, slot_sums.bound: ~0.8 s on the dev VM).
    checksum_rows.warm()
    node_id = config.node_id or rpc_addr
    incarnation = time.time_ns()
    link = RemoteLink(
        config, store, pool, metrics, transport, node_id, incarnation, rpc_addr,
    )  # fmt: skip
    if config.token is None and not config.allow_loopback:
        logger.warning(
            "peer RPCs on %s take no token (--peer-token-env/-file): anyone who "
            "reaches that port can pin blocks and learn their addresses",
            rpc_addr,
        )
    servicer = PeerServicer(
        link.pins, link.namespaces, config.token, incarnation, metrics
    )
    peer_pb2_grpc.add_PeerServicer_to_server(servicer, server)
    return link


def start_advertising(config: RemoteConfig, link: RemoteLink, registry: object) -> None:
    client = MetaClient(
        config.metaserver_host_port, link.node_id, link.incarnation, config.token
    )
    advertiser = Advertiser(
        client,
        str(link.endpoint),
        asyncio.get_running_loop(),
        link.snapshot,
        config.max_advertise_queue,
    )
    registry.register(AdvertiserCollector(lambda: advertiser.counters))
    link.start_advertising(advertiser)


def advertised_addr(host: str, port: int) -> str:
    parse_addr(f"{host}:{port}")
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
