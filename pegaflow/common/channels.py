"""Options for every long-lived gRPC channel of ours: an engine's to its
server, a node's to the metaserver and to its peers.

gRPC's default reconnect backoff starts at 1 s and grows 1.6 times a try, up
to 120 s. Meanwhile every call on the channel fails at once (UNAVAILABLE),
even once the server is back: after a metaserver outage of minutes its nodes
would rejoin up to two minutes late, and an engine would miss its restarted
server's cache for as long. These daemons restart in seconds and are local
or a rack away: the channel tries again at least every second (one SYN a
second to an address that is down).
"""

from __future__ import annotations

RECONNECT_MAX_MS = 1000

# Not grpc.min_reconnect_backoff_ms: it is also the least time a connection
# attempt gets (20 s by default), which a slow link needs.
RECONNECT: tuple[tuple[str, int], ...] = (
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", RECONNECT_MAX_MS),
)


def channel_options(max_message_bytes: int | None = None) -> list[tuple[str, int]]:
    """RECONNECT, and the message size limit both ways if given."""
    options = list(RECONNECT)
    if max_message_bytes is not None:
        options += [
            ("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.max_send_message_length", max_message_bytes),
        ]
    return options
