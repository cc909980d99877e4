"""Any local user could take every RPC slot of a real server: 1,030 health
Watch streams (they never end) filled --max-concurrent-rpcs, and every
engine's next call failed RESOURCE_EXHAUSTED (issue 30). Watch streams are now
bounded apart from the engines' RPCs."""

from __future__ import annotations

import asyncio

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pegaflow.client.pegaflow_client import PegaflowClient
from tests.kvbuf import LocalKV, hashes
from tests.procs import start_server

WATCHES = 1030
PER_CHANNEL = 90  # under grpc's default of 100 streams a connection


async def _open_watches(addr: str) -> tuple[list, list[grpc.aio.Channel], int]:
    """(calls still watching, channels, calls refused at once)."""
    channels = [
        grpc.aio.insecure_channel(addr) for _ in range(-(-WATCHES // PER_CHANNEL))
    ]
    calls = []
    for i in range(WATCHES):
        stub = health_pb2_grpc.HealthStub(channels[i // PER_CHANNEL])
        calls.append(stub.Watch(health_pb2.HealthCheckRequest(service="")))

    async def first(call) -> bool:
        try:
            await asyncio.wait_for(call.read(), 10)
            return True
        except grpc.aio.AioRpcError as exc:
            assert exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, exc
            assert "Watch" in exc.details()
            return False

    got = await asyncio.gather(*(first(c) for c in calls))
    watching = [c for c, ok in zip(calls, got, strict=True) if ok]
    return watching, channels, got.count(False)


def test_health_watches_cannot_starve_engines(tmp_path) -> None:
    server = start_server(tmp_path, "--pool-size", "16mb")

    async def scenario() -> None:
        watching, channels, refused = await _open_watches(server.addr)
        try:
            assert refused > 0 and len(watching) < 100, (len(watching), refused)
            # An engine registers, saves and queries while they stay open.
            kv = LocalKV(layers=2, blocks=4, page=4096)
            keys = hashes(2)

            def engine() -> int:
                with PegaflowClient(server.addr, timeout_s=10) as client:
                    kv.register(client, "starved", "ns-starved")
                    client.save("starved", [0, 1], keys)
                    return client.query("starved", keys).num_blocks

            assert await asyncio.to_thread(engine) == 2
        finally:
            for call in watching:
                call.cancel()
            for channel in channels:
                await channel.close()

    try:
        asyncio.run(scenario())
    finally:
        server.stop()
