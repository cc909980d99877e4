"""A metaserver and pegaflow-servers, each in its own network namespace (see
netns.py), and host-KV engines beside the servers; real processes, real gRPC,
real one-sided reads over the veth pairs."""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from pegaflow.metaserver.meta_client import MetaClient
from tests.connector.conftest import tiny_model  # noqa: F401 (a fixture here too)
from tests.metaserver.conftest import start_metaserver
from tests.procs import EngineProc, ServerProc, start_server
from tests.remote.netns import Netns, NetnsUnavailable, Node

TOKEN = secrets.token_hex(16)
TOKEN_ENV = {"PEGAFLOW_PEER_TOKEN": TOKEN}
SHAPE = dict(layout="LBNHC", layers=4, blocks=64, heads=2, block_size=16, head=64)
SERVER_PORT, META_PORT, HTTP_PORT = 50055, 50056, 9091


def block_hashes(tag: str, n: int) -> list[str]:
    return [secrets.token_hex(16) + tag.encode().hex() for _ in range(n)]


@dataclass
class Cluster:
    net: Netns
    tmp: Path
    meta_node: Node
    meta: ServerProc
    nodes: list[Node]
    servers: list[ServerProc | None]
    engines: list[EngineProc] = field(default_factory=list)

    @property
    def meta_addr(self) -> str:
        return f"{self.meta_node.address}:{META_PORT}"

    def start_metaserver(self) -> ServerProc:
        self.meta = start_metaserver(
            self.tmp,
            "--addr", self.meta_addr,
            "--http-addr", f"{self.meta_node.address}:9092",
            "--node-stale-secs", "6",
            "--peer-token-env", "PEGAFLOW_PEER_TOKEN",
            env=TOKEN_ENV,
            prefix=tuple(self.meta_node.argv()),
        )  # fmt: skip
        return self.meta

    def start_server(self, i: int, *extra: str, token: str = TOKEN) -> ServerProc:
        node = self.nodes[i]
        server = start_server(
            self.tmp,
            "--addr", f"{node.address}:{SERVER_PORT}",
            "--http-addr", f"{node.address}:{HTTP_PORT}",
            "--pool-size", "256mb",
            "--metaserver-addr", f"http://{self.meta_addr}",
            "--remote-fetch-timeout", "5",
            "--remote-quarantine", "3",
            "--socket", str(self.tmp / f"node{i}.sock"),
            # The vLLM engines of test_remote_connector run in this process,
            # the root namespace: to a node's server, another host.
            "--allow-remote-engines",
            *extra,
            prefix=tuple(node.argv()),
            env={"PEGAFLOW_PEER_TOKEN": token},
        )  # fmt: skip
        self.servers[i] = server
        return server

    def engine(
        self, i: int, instance: str, seed: int, namespace: str = "m",
        shape: dict | None = None,
    ) -> EngineProc:  # fmt: skip
        """A host-KV engine on node i, registered with its server."""
        engine = EngineProc(prefix=tuple(self.nodes[i].argv()))
        self.engines.append(engine)
        engine.call("init", seed=seed, **(shape or SHAPE))
        engine.call("register", addr=self.servers[i].addr, instance=instance,
                    namespace=namespace)  # fmt: skip
        return engine

    def remote(self, i: int) -> dict:
        return json.loads(self.servers[i].get("/stats")[1])["tiers"]["remote"]

    def wait_remote(self, i: int, check: Callable[[dict], bool], what: str,
                    timeout_s: float = 20.0) -> dict:  # fmt: skip
        end = time.monotonic() + timeout_s
        while True:
            got = self.remote(i)
            if check(got):
                return got
            if time.monotonic() > end:
                pytest.fail(f"node {i}: timed out waiting for {what}: {got}")
            time.sleep(0.05)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    pytest.importorskip("mooncake.engine", reason="the `remote` extra")
    try:
        net = Netns()
    except NetnsUnavailable as exc:
        pytest.skip(f"cannot make network namespaces here: {exc}")
    tmp = tmp_path_factory.mktemp("remote")
    c = None
    try:
        meta_node = net.add_node()
        nodes = [net.add_node() for _ in range(3)]
        c = Cluster(net, tmp, meta_node, None, nodes, [None, None, None])  # type: ignore[arg-type]
        c.start_metaserver()
        for i in range(3):
            c.start_server(i)
        for i in range(3):
            c.wait_remote(i, lambda r: r["joined"], "joining the metaserver")
        yield c
    finally:
        if c is not None:
            for engine in c.engines:
                engine.close()
            for server in [*c.servers, c.meta]:
                if server is not None:
                    server.stop()
        net.close()


BIG = dict(layout="LBNHC", layers=8, blocks=256, heads=8, block_size=16, head=64)
BIG_BLOCK_BYTES = 8 * 8 * 16 * 2 * 64 * 2  # layers * page bytes: 256 KiB


def namespace_digest(cluster: Cluster, node: int, block_bytes: int) -> bytes:
    """The digest a node advertises for the namespace of that block size (what
    its /stats lists for operators)."""
    stats = json.loads(cluster.servers[node].get("/stats")[1])
    (digest,) = {
        r["digest"] for r in stats["registered"] if r["block_bytes"] == block_bytes
    }
    return bytes.fromhex(digest)


SHAPE_BLOCK_BYTES = 4 * 8192  # what a block of SHAPE holds


def indexed(cluster: Cluster, node: int, hashes: list[str], block_bytes: int,
             timeout_s: float = 20.0) -> None:  # fmt: skip
    """Until the metaserver names an owner for the whole prefix. The node's
    `advertised` count is no proof that these hashes were sent: a snapshot
    re-sent after a rejoin (the previous test's blackhole can make the
    metaserver drop the node as stale) moves it first, and a query then raced
    the hashes to the index (test_lying_peer_bytes_never_loaded, seen once)."""
    digest = namespace_digest(cluster, node, block_bytes)
    raw = [bytes.fromhex(h) for h in hashes]
    client = MetaClient(cluster.meta_addr, token=TOKEN)
    try:
        end = time.monotonic() + timeout_s
        while sum(s.blocks for s in client.query(digest, raw)) < len(raw):
            if time.monotonic() > end:
                pytest.fail(f"node {node}: its {len(raw)} hashes never indexed")
            time.sleep(0.05)
    finally:
        client.close()
