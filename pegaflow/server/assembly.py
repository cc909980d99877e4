"""Server assembly: pool + engine + gRPC + HTTP, and the serve loop."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import importlib.util
import logging
import os
import secrets
import signal
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from http.server import ThreadingHTTPServer

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pegaflow.cache.pin_chunks import ChunkPins
from pegaflow.cache.pool import HostPool
from pegaflow.common import cuda_driver, topology
from pegaflow.common.cuda_driver import (
    POOL_CHUNK_BYTES,
    POOL_CHUNK_THREADS,
    HostRegistrar,
)
from pegaflow.common.settings import CudaConfig, parse_addr
from pegaflow.copiers.copier import CopyEngine, RegionKind
from pegaflow.copiers.host_copier import HostCopyEngine
from pegaflow.daemon.http_endpoint import bind_http, serve_http
from pegaflow.daemon.startup import StartupError, bind_error, bind_failed
from pegaflow.gds import SsdTier
from pegaflow.proto import pegaflow_pb2_grpc as pb_grpc
from pegaflow.tiers import ssd_gpu_direct as ssd_direct
from pegaflow.tiers.protocol import Tier
from pegaflow.tiers.ssd_link import SsdLink

from . import copy_dispatch, start_clock
from . import gc_freeze as gcpolicy
from .compat_metrics import OriginalMetrics, OriginalSsdMetrics
from .cuda_bringup import CudaBringUp
from .engine import Engine
from .grpc_errors import ErrorInterceptor
from .grpc_service import LocalEngines, PegaFlowServicer
from .health_watch import BoundedHealth
from .metrics import CopyPathCollector, Metrics, SsdCollector
from .report import (
    HitRateCollector,
    OncePerScrape,
    engine_stats,
    health_report,
    on_loop,
)
from .server_config import ServerConfig
from .socket_file import check_path, unlink_if_ours
from .socket_service import SocketServerInfo, start_socket_server
from .warm_restart import PoolCheck, Recovered, RecoveryReport, find

Health = Callable[[], dict[str, object]]

logger = logging.getLogger(__name__)

SERVICE_NAME = "pegaflow.v1.PegaFlow"
# A stop waits this long for the CUDA bring-up (pinning) before the pool closes.
CUDA_JOIN_S = 60.0


@dataclass(slots=True)
class RunningServer:
    grpc_server: grpc.aio.Server
    port: int
    http: ThreadingHTTPServer | None
    engine: Engine
    pool: HostPool
    tiers: list[Tier]  # in the order they were built: each closes before its base
    sweeper: asyncio.Task | None = None
    socket_server: asyncio.AbstractServer | None = None
    socket_path: str = ""

    @property
    def http_port(self) -> int | None:
        return self.http.server_address[1] if self.http else None

    async def stop(self, grace_s: float = 2.0) -> None:
        copy_dispatch.stopping()
        if self.sweeper is not None:
            self.sweeper.cancel()
        if self.socket_server is not None:
            _close_socket_server(self.socket_server, self.socket_path)
        await self.grpc_server.stop(grace_s)
        await self.engine.drain_loads(grace_s)  # they read the pool, write engines
        if self.http is not None:
            self.http.shutdown()
            self.http.server_close()
        # Each tier reads or writes pool slots (and the direct route engines'
        # mappings): all close before the engine and the pool, each before
        # the tiers it was built on.
        for tier in reversed(self.tiers):
            await tier.close()
        self.engine.close()
        self.pool.close()


async def create_server(config: ServerConfig) -> RunningServer:
    """Bind gRPC (port 0 picks one) and HTTP, bring up the pool, serve.

    Every address is bound, and the socket path checked, before the pool is
    pre-touched: a port in use fails in milliseconds, not after a minute of
    faulting in memory. A failure at any step releases what earlier steps took.
    """
    async with contextlib.AsyncExitStack() as undo:
        running = await _assemble(config, undo)
        undo.pop_all()  # up: the caller's stop() releases it all from now on
    return running


async def _assemble(
    config: ServerConfig, undo: contextlib.AsyncExitStack
) -> RunningServer:
    ordinals = _cuda_devices(config.cuda)
    start_clock.mark("gpu probe")
    remote_host = None
    if config.remote is not None:  # before anything binds: a bad --addr fails fast
        from pegaflow.tiers.remote import bringup

        remote_host = bringup.preflight(config.remote, config.addr)
    socket_path = ""
    if config.socket is not None:
        socket_path = _socket_path(config.socket)
        check_path(socket_path)
    metrics = Metrics()
    server, port = _bind_grpc(config, metrics)
    undo.push_async_callback(server.stop, None)
    http = _bind_http(config.http_addr) if config.http_addr is not None else None
    if http is not None:
        undo.callback(http.server_close)
    start_clock.mark("bind")
    engine, cuda, recovery, health_doc, built = _bring_up(
        config, ordinals, metrics, undo
    )
    link = None
    if config.remote is not None:
        transport = bringup.start_transport(config.remote, remote_host)
        undo.callback(transport.close)
        bringup.register_pool(
            transport, engine.pool.base, engine.pool.size, config.pool.show_progress
        )
        rpc_addr = bringup.advertised_addr(remote_host, port)
        link = bringup.attach(
            config.remote,
            engine.store,
            engine.pool,
            transport,
            server,
            rpc_addr,
            metrics.registry,
        )
        undo.push_async_callback(link.close)
        built.append(link)
        engine.add_tier(link)
        engine.hit_rates.remote = link.probe  # the miss breakdown's "remote"
    started = time.monotonic()

    def copy_path() -> dict[str, object] | None:  # None until CUDA is up
        built = cuda.engine() if cuda is not None else None
        return built.policy.report() if built is not None else None

    placement = topology.Placement(ordinals, engine.pool.base, engine.pool.size)
    stats = on_loop(
        asyncio.get_running_loop(),
        lambda: engine_stats(engine, started, copy_path, placement.report),
    )
    scrape = OncePerScrape(stats)
    metrics.registry.register(HitRateCollector(scrape.first))
    metrics.registry.register(OriginalMetrics(metrics, scrape.again))  # their names
    servicer = PegaFlowServicer(engine, os.getpid(), secrets.token_bytes(16), port)
    pb_grpc.add_PegaFlowServicer_to_server(servicer, server)
    health_servicer = BoundedHealth()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    socket_server = None
    if socket_path:
        servicer.socket_path = socket_path
        info = SocketServerInfo(os.getpid(), servicer.server_id, socket_path)
        socket_server = await start_socket_server(socket_path, engine, info)
        undo.callback(_close_socket_server, socket_server, socket_path)
    await server.start()
    start_clock.mark("grpc start")
    for tier in built:  # after the start: on few cores it would slow it down
        if isinstance(tier, PoolCheck):
            tier.start(asyncio.get_running_loop(), config.pool.prefault_threads)
    if link is not None:
        bringup.start_advertising(config.remote, link, metrics.registry)
    for name in ("", SERVICE_NAME):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    if http is not None:
        serve_http(
            http,
            metrics.registry,
            health_doc,
            {"/stats": stats},
        )
    running = RunningServer(
        server, port, http, engine, engine.pool, built, None,
        socket_server, socket_path,
    )  # fmt: skip
    running.sweeper = asyncio.create_task(_sweep_forever(engine))
    return running


def _bring_up(
    config: ServerConfig,
    ordinals: list[int],
    metrics: Metrics,
    undo: contextlib.AsyncExitStack,
) -> tuple[Engine, CudaBringUp | None, RecoveryReport | None, Health, list[Tier]]:
    """SSD tier, pool (pre-touched), copy engines (CUDA's coming up beside the
    serving server), the engine itself with its SSD tiers (also returned in
    the order they were built), what a kept pool file gave back, and
    /health's document."""
    # The SSD tier first: its start-up errors (SsdError) then leave no pool.
    tier = SsdTier(config.ssd) if config.ssd is not None else None
    route = None
    if config.ssd is not None:
        try:
            route = ssd_direct.choose_route(config.ssd.gpu_direct, bool(ordinals))
        except BaseException:
            tier.close()
            raise
    try:
        pool = HostPool(config.pool)  # pinned by the CUDA bring-up
    except BaseException:
        if tier is not None:
            tier.close()
        raise
    undo.callback(pool.close)
    start_clock.mark("pool")
    if tier is not None:  # the tier reads pool slots: it closes first
        undo.callback(tier.close)
    copiers: dict[RegionKind, CopyEngine] = {
        "host": HostCopyEngine(threads=config.engine.copy_threads)
    }
    engine = Engine(config.engine, pool, copiers, metrics)
    undo.callback(engine.close)
    cuda = None
    if ordinals:
        cuda = _cuda_bringup(config.cuda, pool, ordinals, copiers, metrics)
        undo.callback(cuda.join, CUDA_JOIN_S)  # before the pool unpins
        engine.cuda_ready = cuda.ready
        if pool.file is not None:
            cuda.hold_pins_until_released()  # by the kept blocks' check, below
        if route is not None and route.route == "direct":
            try:  # the SSD tier's direct route needs it built
                cuda.run_now()
            except Exception as exc:  # a broken GPU stack: one line
                raise StartupError(
                    f"--devices: CUDA copy engine failed to start: {exc}"
                ) from exc
        else:
            cuda.start(asyncio.get_running_loop())
    start_clock.mark("engine")
    built: list[Tier] = []  # the engine's tiers, in the order they were built
    link = None
    if tier is not None:  # at most half the pool waits for the SSD writers
        link = SsdLink(tier, engine.store, engine.registry, metrics.ssd, pool.size // 2)
        built.append(link)
    report = None
    if pool.file is not None:  # before any engine registers: they adopt these
        recovered = Recovered(engine.registry, link.known if link else None)
        engine.registry.adopt = recovered.adopt
        check = find(pool, engine.store, recovered, config.pool.check_rate)
        report = RecoveryReport() if check is None else check.outcome
        if check is not None:  # the first tier: its blocks answer `loading`
            undo.push_async_callback(check.close)
            built.append(check)
            engine.add_tier(check)  # started once the server serves
        if cuda is not None:
            if check is None:
                cuda.release_pins()
            else:
                check.when_done(cuda.release_pins)
        start_clock.mark("pool file rows")
    if route is not None:
        logger.info(
            "ssd hits of cuda engines: the %s route (%s)", route.route, route.reason
        )
        if route.route == "direct":  # asked first: its hits need no L1 slots
            direct = ssd_direct.SsdDirect(link, cuda.engine(), metrics.ssd)
            undo.push_async_callback(direct.close)
            built.append(direct)
            engine.add_tier(direct)
    if link is not None:
        engine.add_tier(link)
        engine.block_events.ssd = link  # its blocks, for KV-event watchers
        metrics.registry.register(SsdCollector(tier.stats))
        metrics.registry.register(OriginalSsdMetrics(tier.stats))
        logger.info(
            "ssd tier: %s, %d B, %s",
            tier.mode,
            tier.stats().capacity_bytes,
            ", ".join(config.ssd.paths),
        )
    health_doc = health_report(engine, cuda, report, tier, route)
    return engine, cuda, report, health_doc, built


def _bind_grpc(config: ServerConfig, metrics: Metrics) -> tuple[grpc.aio.Server, int]:
    """A gRPC server bound to --addr (servicers are added later, before start)."""
    host, port = parse_addr(config.addr)
    # A probe first: grpc's own failure is a bare 0 and a log line from its core.
    if (error := bind_error("--addr", config.addr, host, port)) is not None:
        raise error
    gate = LocalEngines(config.allow_remote_engines)
    errors = ErrorInterceptor(metrics, config.max_request_bytes_in_flight)
    server = grpc.aio.server(
        interceptors=[errors, gate],
        # Beyond it gRPC answers RESOURCE_EXHAUSTED itself. Every engine worker
        # holds one Session stream open, so it sits well above the workers.
        maximum_concurrent_rpcs=config.max_concurrent_rpcs,
        options=[
            ("grpc.max_receive_message_length", config.max_message_bytes),
            ("grpc.max_send_message_length", config.max_message_bytes),
            ("grpc.so_reuseport", 0),
        ],
    )
    target = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    try:
        bound = server.add_insecure_port(target)
    except RuntimeError:  # grpc's way of saying the port cannot be bound
        bound = 0
    if bound == 0:  # taken between the probe and now
        raise StartupError(f"--addr: cannot listen on {config.addr}; try again")
    gate.port = bound  # finds callers' sockets by their connection to it
    return server, bound


def _bind_http(addr: str) -> ThreadingHTTPServer:
    host, port = parse_addr(addr)
    try:
        return bind_http(host, port)
    except OSError as exc:
        raise bind_failed("--http-addr", addr, exc) from None


def _close_socket_server(server: asyncio.AbstractServer, path: str) -> None:
    """Stop accepting and remove the socket file if it is still ours."""
    for sock in server.sockets:  # before close(): it forgets its sockets
        unlink_if_ours(path, sock)
    server.close()


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
        raise StartupError(str(exc)) from exc


def _cuda_bringup(
    config: CudaConfig,
    pool: HostPool,
    ordinals: list[int],
    copiers: dict[RegionKind, CopyEngine],
    metrics: Metrics,
) -> CudaBringUp:
    """The pool pinned chunk by chunk and the CUDA copy engine built over it
    (pegaflow.server.cuda_bringup); a GPU stack missing its Python half fails
    the start here, in one line."""
    if importlib.util.find_spec("numba") is None:  # numba-cuda is numba.cuda
        exc = ImportError("No module named 'numba'")
        raise StartupError(f"--devices: {exc}; {cuda_driver.hint(exc)}")
    registrar = HostRegistrar(ordinals[0], POOL_CHUNK_BYTES, POOL_CHUNK_THREADS)

    def warm() -> None:  # load (or compile) the copy kernel, beside the pinning
        from pegaflow import kernels
        from pegaflow.copiers.cuda_copier import warm_up

        cuda_driver.set_device(ordinals[0])
        k = kernels.backend("cuda")
        warm_up(k, k.stream())

    def build(pins: ChunkPins) -> CopyEngine:  # the pool's first chunk pinned
        from pegaflow.copiers.contention import ContendedPolicy
        from pegaflow.copiers.cuda_copier import CudaCopyEngine

        topology.Placement(ordinals, pool.base, pool.size).log()
        policy = ContendedPolicy.from_config(config)
        return CudaCopyEngine(
            pool.base, pool.size, ordinals, config.max_ctas, config.event_timeout_s,
            policy, pins,
        )  # fmt: skip

    def install(built: CopyEngine) -> None:
        copiers["cuda"] = built
        metrics.registry.register(CopyPathCollector(built.policy.report, built.faulted))

    return CudaBringUp(
        ordinals[0],
        functools.partial(pool.pin, registrar, hold=True),
        warm,
        build,
        install,
    )


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
    start_clock.mark("serving")
    logger.info("started in %s", start_clock.describe())
    for handler in logging.getLogger().handlers:  # the start's lines before READY
        handler.flush()
    took = f"start_s={start_clock.since_exec_now():.2f}"
    print(
        f"READY grpc={host}:{running.port} http={http} pid={os.getpid()} {took}",
        flush=True,
    )
    logger.info("serving on %s:%d (http %s)", host, running.port, http)
    await stop.wait()
    logger.info("stopping")
    with contextlib.suppress(asyncio.CancelledError):
        await running.stop()
        await _rpc_tasks_done(timeout_s=2.0)
    logger.info("stopped")


async def _rpc_tasks_done(timeout_s: float) -> None:
    """Wait for the tasks grpc leaves behind when stop() cancels a call that was
    still open (an engine's Session stream): they finish a moment after stop()
    returns. Left pending, asyncio.run cancels them on the way out and grpc logs
    each as a CancelledError traceback, though nothing went wrong."""
    current = asyncio.current_task()
    rest = [task for task in asyncio.all_tasks() if task is not current]
    if rest:
        await asyncio.wait(rest, timeout=timeout_s)
