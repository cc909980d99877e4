"""Options, environment and import cost: no vLLM needed."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from pegaflow.connector.extra_config import ConnectorConfig, parse_config, server_addr
from tests.procs import ROOT, _env


def test_defaults_and_env() -> None:
    cfg = parse_config(None, env={})
    assert cfg == ConnectorConfig()
    assert cfg.addr == "127.0.0.1:50055"
    env = {"PEGAFLOW_HOST": "http://10.1.2.3/", "PEGAFLOW_PORT": "6000"}
    assert parse_config({}, env=env).addr == "10.1.2.3:6000"
    assert server_addr({"PEGAFLOW_HOST": "::1"}) == "[::1]:50055"
    assert server_addr({"PEGAFLOW_HOST": "cache-host"}) == "cache-host:50055"


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"PEGAFLOW_PORT": "http"}, "PEGAFLOW_PORT"),
        ({"PEGAFLOW_PORT": "70000"}, "PEGAFLOW_PORT"),
        ({"PEGAFLOW_HOST": "https://x"}, "only http://"),
        ({"PEGAFLOW_HOST": "a/b"}, "PEGAFLOW_HOST"),
    ],
)
def test_bad_env(env: dict[str, str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_config({}, env=env)


def test_extra_config_values() -> None:
    cfg = parse_config(
        {"sync_load_max_tokens": 256, "timeout_s": 3, "save_decode": False}, env={}
    )
    assert (cfg.sync_load_max_tokens, cfg.timeout_s, cfg.save_decode) == (
        256,
        3.0,
        False,
    )


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"pool_size": 1}, r"unknown key\(s\) pool_size; PegaKVConnector accepts"),
        ({"timeout_s": "5"}, "timeout_s: expected a number"),
        ({"timeout_s": 0}, "timeout_s: must be > 0"),
        ({"sync_load_max_tokens": 1.5}, "sync_load_max_tokens: expected an integer"),
        ({"sync_load_max_tokens": -1}, "sync_load_max_tokens: must be >= 0"),
        ({"save_decode": 1}, "save_decode: expected true/false"),
        ({"instance_id": 7}, "instance_id: expected a string"),
        ({"lease_reuse_s": -1}, "lease_reuse_s: must be >= 0"),
        ({"timeout_s": 3601}, "timeout_s: must be <= 3600"),
        ({"query_timeout_s": 10**400}, "query_timeout_s: expected a finite number"),
    ],
)
def test_bad_extra_config(extra: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_config(extra, env={})


@pytest.mark.parametrize(
    "key", ["timeout_s", "query_timeout_s", "retry_interval_s", "lease_reuse_s"]
)
@pytest.mark.parametrize("literal", ["NaN", "Infinity", "-Infinity"])
def test_non_finite_seconds_are_refused(key: str, literal: str) -> None:
    """Scenario: vLLM's --kv-transfer-config is JSON, whose Python parser reads
    NaN and Infinity; NaN passed every `> 0` check and an infinite deadline
    made bounded waits hang. Each is refused, naming the key."""
    extra = json.loads(f'{{"{key}": {literal}}}')
    with pytest.raises(ValueError, match=f"^kv_connector_extra_config.{key}: "):
        parse_config(extra, env={})


def test_import_is_cheap() -> None:
    """vLLM imports the module from config and metrics code: no torch, vLLM,
    gRPC or GPU import, no connection, until the class is looked up."""
    code = (
        "import sys, time; t = time.perf_counter(); import pegaflow.connector; "
        "dt = time.perf_counter() - t; "
        "heavy = [m for m in ('vllm', 'torch', 'grpc', 'numba', 'cupy', 'kvikio') "
        "if m in sys.modules]; print(heavy, dt)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env=_env(),
        cwd=ROOT,
        check=True,
    ).stdout.split()
    assert out[0] == "[]", out
    assert float(out[1]) < 0.5


def test_original_connector_keys(caplog: pytest.LogCaptureFixture) -> None:
    """Scenario: the original connector's `pegaflow.*` keys were refused as
    unknown. They keep their meaning; PEGAFLOW_HOST/PORT win, as there."""
    extra = {"pegaflow.host": "http://10.0.0.7", "pegaflow.port": 6001}
    assert parse_config(extra, env={}).addr == "10.0.0.7:6001"
    env = {"PEGAFLOW_HOST": "http://10.0.0.9"}
    assert parse_config(extra, env=env).addr == "10.0.0.9:6001"
    one = {"pegaflow.tp_shard_endpoints": ["http://10.0.0.8:6002"]}
    assert parse_config(one, env={}).addr == "10.0.0.8:6002"
    assert parse_config({"pegaflow.mode": "save_only"}, env={}).mode == "save_only"
    with caplog.at_level("WARNING", logger="pegaflow.connector.extra_config"):
        parse_config({"pegaflow.pd_tail_save": True}, env={})
    assert "pd_tail_save is accepted and ignored" in caplog.text


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"pegaflow.mode": "read_only"}, "mode: read_write or save_only"),
        (
            {"pegaflow.tp_shard_endpoints": ["http://a:1", "http://b:1"]},
            "spanning hosts is not supported",
        ),
        ({"pegaflow.nope": 1}, r"unknown key\(s\) pegaflow.nope"),
    ],
)
def test_bad_original_keys(extra: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_config(extra, env={})
