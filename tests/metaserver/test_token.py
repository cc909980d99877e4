"""The shared peer token on every RPC of a real metaserver."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pegaflow.metaserver.client import MetaClient
from tests.metaserver.conftest import hashes
from tests.procs import ROOT, ServerProc, _env

TOKEN = "s3cret-token-0123456789abcdef"
NS = b"\x09" * 32


def test_token_refused_when_missing_or_wrong_accepted_when_right(
    metaserver_factory: Callable[..., ServerProc],
    node_factory: Callable[..., MetaClient],
) -> None:
    """--peer-token-env: a client without the token, or with a wrong one (same
    length, one character off), gets UNAUTHENTICATED on every RPC, the health
    check included, and changes nothing; the right token is served."""
    meta = metaserver_factory(
        "--peer-token-env", "META_TOKEN", env={"META_TOKEN": TOKEN}
    )
    good = node_factory(meta, "good", token=TOKEN)
    good.join("127.0.0.1:1")
    prefix = hashes(8)
    assert good.insert(NS, prefix) == (8, 0)
    wrong = TOKEN[:-1] + ("x" if TOKEN[-1] != "x" else "y")
    for token in (None, wrong, ""):
        bad = node_factory(meta, "good", token=token)
        for method, args in (
            ("join", ("127.0.0.1:2",)),
            ("heartbeat", ()),
            ("insert", (NS, hashes(2))),
            ("remove", (NS, prefix)),
            ("query", (NS, prefix)),
            ("leave", ()),
        ):
            with pytest.raises(grpc.RpcError) as info:
                getattr(bad, method)(*args)
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED, method
        with grpc.insecure_channel(meta.addr) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            with pytest.raises(grpc.RpcError) as info:
                stub.Check(health_pb2.HealthCheckRequest(), timeout=5)
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
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


def _start_fails(*args: str, env: dict[str, str] | None = None) -> str:
    res = subprocess.run(
        [sys.executable, "-m", "pegaflow.metaserver", "--addr", "127.0.0.1:0", *args],
        env={**_env(), **(env or {})},
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 2, res.stdout + res.stderr
    return res.stderr


def test_token_file_and_bad_tokens_refused_at_start(tmp_path: Path) -> None:
    """A token file others can read, an empty or unset variable, a short token
    and a token with spaces each stop the metaserver at start, naming the
    flag; a 0600 file is accepted."""
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
