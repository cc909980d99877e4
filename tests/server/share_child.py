"""Child processes of tests/server/test_shared_kv.py.

share_child.py intruder ADDR INSTANCE TOKEN_HEX
    A process that is not the registrant: it knows the registration's
    instance id and owner token, and sends a sealed memfd of its own
    memory for it. Prints the error the server answered (or "accepted").
share_child.py engine ADDR
    An engine whose KV is shared with the server: registers (with a
    liveness session), saves every block, then loads them back in a loop,
    printing one line per load, until killed.
"""

from __future__ import annotations

import json
import os
import sys

from pegaflow.client.host_share import share_memory
from pegaflow.client.pegaflow_client import PegaflowClient
from pegaflow.common.errors import PegaflowError
from tests.kvbuf import LocalKV, hashes


def intruder(addr: str, instance: str, token: str) -> None:
    kv = LocalKV(2, 8, 64 << 10, seed=5)
    shared = share_memory(kv.mem.regions)
    assert shared is not None
    with PegaflowClient(addr) as client:
        client._tokens[(instance, 0)] = bytes.fromhex(token)  # as if it leaked
        try:
            client.share_host(instance, 0, shared.fd, shared.spans)
        except PegaflowError as exc:
            print(json.dumps({"error": type(exc).__name__, "message": str(exc)}))
            return
    print(json.dumps({"error": "", "message": "accepted"}))


def engine(addr: str) -> None:
    kv = LocalKV(8, 64, 64 << 10, seed=6)  # 32 MiB: a load takes a while
    shared = share_memory(kv.mem.regions)
    assert shared is not None
    client = PegaflowClient(addr)
    kv.register(client, "dying", "ns-dying")
    got = client.share_host("dying", 0, shared.fd, shared.spans)
    session = client.open_session("dying", 0, interval_s=1.0)
    hs = hashes(kv.blocks)
    ids = list(range(kv.blocks))
    client.save("dying", ids, hs)
    print(json.dumps({"shared": got, "pid": os.getpid()}), flush=True)
    n = 0
    while session.alive:
        hit = client.query("dying", hs)
        client.load("dying", hit.lease_id, ids[::-1])
        n += 1
        if n == 3:  # then on back to back: a kill most likely lands mid-copy
            print(json.dumps({"loads": n}), flush=True)


if __name__ == "__main__":
    if sys.argv[1] == "intruder":
        intruder(*sys.argv[2:5])
    else:
        engine(sys.argv[2])
