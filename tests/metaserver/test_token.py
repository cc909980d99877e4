"""The shared peer token (pegaflow.common.peer_auth) on every RPC of a real
metaserver."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pegaflow.common import peer_auth
from pegaflow.metaserver.meta_client import MetaClient
from tests.metaserver.conftest import hashes
from tests.procs import ROOT, ServerProc, _env

TOKEN = "s3cret-token-0123456789abcdef"
NS = b"\x09" * 32


def _refused(call: Callable[[], object]) -> str:
    """The details of the UNAUTHENTICATED error `call` must raise."""
    with pytest.raises(grpc.RpcError) as info:
        call()
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    return info.value.details()


def test_token_refused_when_missing_or_wrong_accepted_when_right(
    metaserver_factory: Callable[..., ServerProc],
    node_factory: Callable[..., MetaClient],
) -> None:
    """$PEGAFLOW_PEER_TOKEN set: a client without the token, or with a wrong one
    (same length, one character off), gets UNAUTHENTICATED on every RPC, the
    gRPC health check included, with details saying missing or wrong and never
    the token, and changes nothing; the right token is served; /health and
    /metrics stay open."""
    meta = metaserver_factory(env={peer_auth.ENV_VAR: TOKEN})
    good = node_factory(meta, "good", token=TOKEN)
    good.join("127.0.0.1:1")
    prefix = hashes(8)
    assert good.insert(NS, prefix) == (8, 0)
    wrong = TOKEN[:-1] + ("x" if TOKEN[-1] != "x" else "y")
    for token, why in ((None, "missing"), ("", "missing"), (wrong, "wrong token")):
        bad = node_factory(meta, "good", token=token)
        for method, args in (
            ("join", ("127.0.0.1:2",)),
            ("heartbeat", ()),
            ("insert", (NS, hashes(2))),
            ("remove", (NS, prefix)),
            ("query", (NS, prefix)),
            ("leave", ()),
        ):
            details = _refused(lambda: getattr(bad, method)(*args))  # noqa: B023
            assert details.startswith(f"{peer_auth.METADATA_KEY}: {why}"), details
            assert TOKEN not in details and wrong not in details
        with grpc.insecure_channel(meta.addr) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            _refused(lambda: stub.Check(health_pb2.HealthCheckRequest(), timeout=5))  # noqa: B023
    assert good.heartbeat() == 8
    assert [s.blocks for s in good.query(NS, prefix)] == []  # only itself holds
    asker = node_factory(meta, "asker", token=TOKEN)
    asker.join("127.0.0.1:3")
    assert [s.blocks for s in asker.query(NS, prefix)] == [8]
    refused = meta.metric(
        "pegaflow_meta_rpc_seconds_count", 'code="UNAUTHENTICATED",method="Insert"'
    )
    assert refused == 3  # refusals are timed and counted like any call
    status, body = meta.get("/health")
    assert status == 200 and b'"token_required": true' in body
    status, body = meta.get("/metrics")
    assert status == 200 and b"pegaflow_meta_entries" in body
    assert TOKEN not in meta.log.read_text()


def test_token_flag_wins_over_env(
    metaserver_factory: Callable[..., ServerProc],
    node_factory: Callable[..., MetaClient],
) -> None:
    """--peer-token and $PEGAFLOW_PEER_TOKEN both set: the flag's token is the
    one required; the variable's is wrong; the start warns that the flag shows
    in `ps`."""
    other = "env-token-" + "e" * 16
    meta = metaserver_factory("--peer-token", TOKEN, env={peer_auth.ENV_VAR: other})
    assert node_factory(meta, "a", token=TOKEN).join("127.0.0.1:1").ttl_s > 0
    by_env = node_factory(meta, "b", token=other)
    assert "wrong token" in _refused(lambda: by_env.join("127.0.0.1:2"))
    assert "--peer-token is visible to every local user" in meta.log.read_text()


def test_no_token_configured_is_open(
    metaserver_factory: Callable[..., ServerProc],
    node_factory: Callable[..., MetaClient],
) -> None:
    """No --peer-token* flag and no $PEGAFLOW_PEER_TOKEN: every RPC is served
    with or without a token sent (a client's token is then simply unused)."""
    meta = metaserver_factory()
    prefix = hashes(4)
    for name, token in (("plain", None), ("tokened", TOKEN)):
        node = node_factory(meta, name, token=token)
        node.join(f"127.0.0.1:{len(name)}")
        assert node.insert(NS, prefix)[0] + node.insert(NS, prefix)[1] >= 4
    asker = node_factory(meta, "asker")
    assert sum(s.blocks for s in asker.query(NS, prefix)) == 4
    with grpc.insecure_channel(meta.addr) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(), timeout=5
        )
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
    status, body = meta.get("/health")
    assert status == 200 and b'"token_required": false' in body


def _start_fails(*args: str, env: dict[str, str] | None = None) -> str:
    base = {k: v for k, v in _env().items() if k != peer_auth.ENV_VAR}
    res = subprocess.run(
        [sys.executable, "-m", "pegaflow.metaserver", "--addr", "127.0.0.1:0", *args],
        env={**base, **(env or {})},
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 2, res.stdout + res.stderr
    return res.stderr


def test_token_file_and_bad_tokens_refused_at_start(tmp_path: Path) -> None:
    """A token file others can read, an empty or unset variable (named or the
    default $PEGAFLOW_PEER_TOKEN), a short token and a token with spaces each
    stop the metaserver at start, naming the flag or variable; a 0600 file is
    accepted."""
    loose = tmp_path / "loose"
    loose.write_text(TOKEN + "\n")
    loose.chmod(0o644)
    assert "--peer-token-file" in _start_fails("--peer-token-file", str(loose))
    assert "readable by others" in _start_fails("--peer-token-file", str(loose))
    assert "--peer-token-env" in _start_fails("--peer-token-env", "NO_SUCH_VAR_X")
    short = _start_fails("--peer-token-env", "T", env={"T": "short"})
    assert "need 16.." in short
    spaced = _start_fails("--peer-token-env", "T", env={"T": "a b" * 8})
    assert "printable ASCII" in spaced
    assert "PEGAFLOW_PEER_TOKEN: set but empty" in _start_fails(
        env={peer_auth.ENV_VAR: " "}
    )
    assert "need 16.." in _start_fails("--peer-token", "short")
    tight = tmp_path / "tight"
    tight.write_text(TOKEN + "\n")
    os.chmod(tight, 0o600)
    from tests.metaserver.conftest import start_metaserver

    meta = start_metaserver(tmp_path, "--peer-token-file", str(tight))
    try:
        client = MetaClient(meta.addr, "n", 1, token=TOKEN)
        assert client.join("127.0.0.1:1").max_batch_hashes == 65536
        client.close()
    finally:
        meta.stop()
