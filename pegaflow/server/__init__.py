"""pegaflow-server's assembly: the engine's operations and query path, the
transports (gRPC, unix socket), configuration and CLI, warm restart, HTTP
reports and metrics."""
