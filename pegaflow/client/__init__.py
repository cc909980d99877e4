"""What an engine imports: `PegaflowClient` and its transports (the unix
socket, else gRPC), the registration messages, KV layouts and CUDA export.
Light on purpose (grpcio, protobuf, numpy); never imports a server module."""

from .pegaflow_client import (
    LoadItem,
    PegaflowClient,
    Registration,
    allow_ptrace_from,
)

__all__ = ["LoadItem", "PegaflowClient", "Registration", "allow_ptrace_from"]
