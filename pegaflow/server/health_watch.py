"""grpc's health service with its Watch streams bounded.

A Watch stream never ends on its own, and each holds one of the server's
--max-concurrent-rpcs slots while it is open. Anyone who can reach the port
may open them (health is not authenticated): 1,030 of them filled every slot
and every engine's next call failed RESOURCE_EXHAUSTED. So at most
MAX_WATCHES are open at once; past them a Watch is refused at once, naming
Check, which answers and ends (what Kubernetes' gRPC probes use).
"""

from __future__ import annotations

import grpc
from grpc_health.v1 import health, health_pb2

# Watchers a deployment needs (a sidecar or two per server), with room to spare.
MAX_WATCHES = 32


class BoundedHealth(health.aio.HealthServicer):
    def __init__(self, max_watches: int = MAX_WATCHES) -> None:
        super().__init__()
        self._max_watches = max_watches
        self._watching = 0

    async def Watch(  # noqa: N802 (grpc's method name)
        self, request: health_pb2.HealthCheckRequest, context: grpc.aio.ServicerContext
    ) -> None:
        if self._watching >= self._max_watches:
            await context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"Watch: {self._max_watches} health watches are open already; "
                "ask Check instead",
            )
        self._watching += 1
        try:
            await super().Watch(request, context)
        finally:
            self._watching -= 1
