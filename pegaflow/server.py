"""Server assembly: pool + engine + gRPC + HTTP, and the serve loop."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import signal
import tempfile
import time
from dataclasses import dataclass
from http.server import ThreadingHTTPServer

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from pegaflow import cuda_driver, gcpolicy
from pegaflow.config import CudaConfig, ServerConfig, parse_addr
from pegaflow.cuda_driver import HostRegistrar
from pegaflow.engine import Engine
from pegaflow.fastpath import SocketServerInfo, start_query_socket
from pegaflow.gds import SsdTier
from pegaflow.hostcopy import HostCopyEngine
from pegaflow.http import start_http
from pegaflow.instances import CopyEngine, RegionKind
from pegaflow.metrics import Metrics, SsdCollector
from pegaflow.pool import HostPool
from pegaflow.proto import pegaflow_pb2_grpc as pb_grpc
from pegaflow.service import ErrorInterceptor, PegaFlowServicer
from pegaflow.stats import HitRateCollector, engine_stats, on_loop

logger = logging.getLogger(__name__)

SERVICE_NAME = "pegaflow.v1.PegaFlow"


@dataclass(slots=True)
class RunningServer:
    grpc_server: grpc.aio.Server
    port: int
    http: ThreadingHTTPServer | None
    engine: Engine
    pool: HostPool
    sweeper: asyncio.Task | None = None
    query_server: asyncio.AbstractServer | None = None
    query_socket: str = ""

    @property
    def http_port(self) -> int | None:
        return self.http.server_address[1] if self.http else None

    async def stop(self, grace_s: float = 2.0) -> None:
        if self.sweeper is not None:
            self.sweeper.cancel()
        if self.query_server is not None:
            self.query_server.close()
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.query_socket)
        await self.grpc_server.stop(grace_s)
        if self.http is not None:
            self.http.shutdown()
            self.http.server_close()
        self.engine.close()
        if self.engine.ssd is not None:  # reads pool slots: before the pool goes
            await self.engine.ssd.close()
        self.pool.close()


async def create_server(config: ServerConfig) -> RunningServer:
    """Bring up the pool, bind gRPC (port 0 picks one) and HTTP; start serving."""
    ordinals = _cuda_devices(config.cuda)
    # 8 GiB chunks pinned from 8 threads: 64 GiB came up at 16.8 GB/s on the
    # H200 host, against 5.9 GB/s for one cudaHostRegister call.
    registrar = HostRegistrar(ordinals[0], 8 << 30, 8) if ordinals else None
    # The SSD tier first: its start-up errors (SsdError) then leave no pool.
    tier = SsdTier(config.ssd) if config.ssd is not None else None
    try:
        pool = HostPool(config.pool, registrar)
    except BaseException:
        if tier is not None:
            tier.close()
        raise
    metrics = Metrics()
    copiers: dict[RegionKind, CopyEngine] = {
        "host": HostCopyEngine(threads=config.engine.copy_threads)
    }
    cuda = _cuda_copier(config.cuda, pool, ordinals) if ordinals else None
    if cuda is not None:
        copiers["cuda"] = cuda
    engine = Engine(config.engine, pool, copiers, metrics, tier)
    if tier is not None:
        metrics.registry.register(SsdCollector(tier.stats))
        logger.info(
            "ssd tier: %s, %d B, %s",
            tier.mode,
            tier.stats().capacity_bytes,
            ", ".join(config.ssd.paths),
        )
    started = time.monotonic()
    stats = on_loop(asyncio.get_running_loop(), lambda: engine_stats(engine, started))
    metrics.registry.register(HitRateCollector(stats))
    server = grpc.aio.server(
        interceptors=[ErrorInterceptor(metrics)],
        # Sessions count: see pegaflow.limits.MAX_CONCURRENT_RPCS.
        maximum_concurrent_rpcs=config.max_concurrent_rpcs,
        options=[
            ("grpc.max_receive_message_length", config.max_message_bytes),
            ("grpc.max_send_message_length", config.max_message_bytes),
            ("grpc.so_reuseport", 0),
        ],
    )
    servicer = PegaFlowServicer(engine, os.getpid(), secrets.token_bytes(16))
    pb_grpc.add_PegaFlowServicer_to_server(servicer, server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    host, port = parse_addr(config.addr)
    target = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    try:
        bound = server.add_insecure_port(target)
    except RuntimeError:  # grpc's way of saying the port is taken
        bound = 0
    if bound == 0:
        if tier is not None:
            tier.close()
        pool.close()
        raise OSError(f"--addr: cannot bind {config.addr} (in use or not local?)")
    servicer.port = bound
    query_server = None
    if config.query_socket is not None:
        servicer.query_socket = _socket_path(config.query_socket)
        info = SocketServerInfo(os.getpid(), servicer.server_id, servicer.query_socket)
        query_server = await start_query_socket(servicer.query_socket, engine, info)
    await server.start()
    for name in ("", SERVICE_NAME):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    http = None
    if config.http_addr is not None:
        http_host, http_port = parse_addr(config.http_addr)
        http = start_http(
            http_host,
            http_port,
            metrics.registry,
            _health_report(engine, cuda),
            {"/stats": stats},
        )
    running = RunningServer(
        server, bound, http, engine, pool, None, query_server, servicer.query_socket
    )
    running.sweeper = asyncio.create_task(_sweep_forever(engine))
    return running


def _socket_path(setting: str) -> str:
    if setting != "auto":
        return setting
    return os.path.join(tempfile.gettempdir(), f"pegaflow-{os.getpid()}.sock")


def _cuda_devices(config: CudaConfig) -> list[int]:
    """The GPUs to serve; [] without a GPU stack unless devices were named."""
    if not config.enabled:
        return []
    try:
        return cuda_driver.probe(config.devices)
    except cuda_driver.CudaError as exc:
        raise OSError(str(exc)) from exc


def _cuda_copier(config: CudaConfig, pool: HostPool, ordinals: list[int]) -> object:
    from pegaflow.cudacopy import CudaCopyEngine  # imports numba: GPU hosts only

    try:
        return CudaCopyEngine(
            pool.base, pool.size, ordinals, config.max_ctas, config.event_timeout_s
        )
    except Exception as exc:  # a broken GPU stack must not leave the pool pinned
        pool.close()
        raise OSError(f"--devices: CUDA copy engine failed to start: {exc}") from exc


def _health_report(engine: Engine, cuda: object):  # noqa: ANN202 - HTTP thread's
    ssd = engine.ssd.tier if engine.ssd is not None else None

    def report() -> dict[str, object]:
        slabs = engine.pool.slabs
        return {
            "status": "ok",
            "pool_capacity_bytes": engine.pool.size,
            "pool_used_bytes": slabs.used_bytes,
            "resident_blocks": engine.store.resident_ready,
            "namespaces": len(engine.registry.namespaces),
            "workers": sum(len(i.workers) for i in engine.registry.instances.values()),
            "cuda_mappings": getattr(cuda, "mapped_allocations", 0),
            "ssd_mode": ssd.mode if ssd else "off",
            "ssd_capacity_bytes": ssd.config.capacity_bytes if ssd else 0,
        }

    return report


async def _sweep_forever(engine: Engine) -> None:
    while True:
        await asyncio.sleep(engine.config.lease_sweep_interval_s)
        try:
            engine.sweep()
        except Exception:  # a background loop must survive any one bad sweep
            logger.exception("sweep failed")


async def serve(config: ServerConfig) -> None:
    """Run until SIGTERM/SIGINT; print one READY line for supervisors and tests."""
    gcpolicy.install()
    running = await create_server(config)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    host, _ = parse_addr(config.addr)
    http = (
        f"{config.http_addr.rpartition(':')[0]}:{running.http_port}"
        if running.http
        else "off"
    )
    print(f"READY grpc={host}:{running.port} http={http} pid={os.getpid()}", flush=True)
    logger.info("serving on %s:%d (http %s)", host, running.port, http)
    await stop.wait()
    logger.info("stopping")
    with contextlib.suppress(asyncio.CancelledError):
        await running.stop()
    logger.info("stopped")
