"""The seeds' vLLM config without `kv_connector_module_path`: the plugin
registers PegaKVConnector with vLLM's own KVConnectorFactory, and the original
connector's `pegaflow.*` extra-config keys keep their meaning."""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.connector.conftest import free_port, needs_vllm
from tests.procs import ROOT, ServerProc

needs_vllm()

from vllm.config import KVTransferConfig  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.factory import (  # noqa: E402
    KVConnectorFactory,
)

from pegaflow.connector.plugin import register  # noqa: E402
from tests.connector.engine import Engine, vllm_config  # noqa: E402

# The seeds' --kv-transfer-config, less the module path the plugin makes moot.
SEED = json.loads('{"kv_connector": "PegaKVConnector", "kv_role": "kv_both"}')
PROMPT = list(range(100, 180))


def _plugin_config(model: Path, extra: dict) -> object:
    config = vllm_config(model, extra)
    config.kv_transfer_config = KVTransferConfig(
        **SEED, kv_connector_extra_config=extra, kv_load_failure_policy="recompute"
    )
    return config


def test_entry_point_is_declared() -> None:
    """Scenario: vLLM finds general plugins only through package metadata."""
    text = (ROOT / "pyproject.toml").read_text()  # tomllib: Python 3.11+ only
    section = text.split('[project.entry-points."vllm.general_plugins"]\n', 1)[1]
    first = section.split("\n", 1)[0]
    assert first == 'pegaflow = "pegaflow.connector.plugin:register"'
    module, func = first.split('"')[1].split(":")
    assert module == "pegaflow.connector.plugin" and callable(register)


def test_factory_resolves_the_seed_config() -> None:
    """Scenario: `"kv_connector": "PegaKVConnector"` alone was "Unsupported
    connector type"; after the plugin ran, vLLM's factory finds our class, and
    a second registration (vLLM loads plugins in every process) is harmless."""
    register()
    register()
    cls = KVConnectorFactory.get_connector_class(KVTransferConfig(**SEED))
    from pegaflow.connector import PegaKVConnector

    assert cls is PegaKVConnector


def test_original_keys_through_vllms_factory(
    server_factory: Callable[..., ServerProc],
    tiny_model: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Scenario: an engine configured as for the original connector (no module
    path; server named by `pegaflow.host`/`pegaflow.port`, no environment)
    saves through vLLM's Scheduler, which builds the connector with the
    factory; a second engine hits those blocks; a third in
    `pegaflow.mode: save_only` never loads them."""
    register()
    port = free_port()
    server_factory("--pool-size", "64mb", "--addr", f"127.0.0.1:{port}")
    monkeypatch.delenv("PEGAFLOW_HOST", raising=False)
    monkeypatch.delenv("PEGAFLOW_PORT", raising=False)
    extra = {
        "pegaflow.host": "http://127.0.0.1",
        "pegaflow.port": port,
        "retry_interval_s": 0.2,
    }
    a = Engine(_plugin_config(tiny_model, extra))
    a.add("a", PROMPT)
    a.run()
    assert a.errors == [] and a.counters()["save_blocks"] > 0

    b = Engine(_plugin_config(tiny_model, extra))
    b.step()  # an idle step: the worker tells the scheduler the query socket
    b.add("b", PROMPT)
    b.run()
    assert b.errors == [] and b.counters()["hit_tokens"] > 0

    c = Engine(_plugin_config(tiny_model, {**extra, "pegaflow.mode": "save_only"}))
    c.step()
    c.add("c", PROMPT)
    c.run()
    assert c.errors == [] and c.counters()["hit_tokens"] == 0


def test_fail_policy_warns(tiny_model: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Scenario: vLLM's default kv_load_failure_policy "fail" turns a dead
    server into failed requests, silently; the scheduler half now says so."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from pegaflow.connector import PegaKVConnector

    config = _plugin_config(tiny_model, {})
    config.kv_transfer_config.kv_load_failure_policy = "fail"
    engine = Engine(_plugin_config(tiny_model, {}))  # a kv_cache_config to reuse
    with caplog.at_level(logging.WARNING, logger="pegaflow.connector.connector"):
        conn = PegaKVConnector(
            config, KVConnectorRole.SCHEDULER, engine.kv_cache_config
        )
    conn.shutdown()
    assert any("kv_load_failure_policy is 'fail'" in r.message for r in caplog.records)


def test_sleep_mode_is_refused_by_vllm(tiny_model: Path) -> None:
    """Scenario: vLLM's default supports_sleep_mode is True while the connector
    neither unregisters nor restores its KV memory: sleep freed memory the
    server kept mapped (and could copy into). vLLM's own check now refuses."""
    config = vllm_config(tiny_model)
    config.model_config.enable_sleep_mode = True  # on CPU ModelConfig refuses it
    with pytest.raises(ValueError, match="PegaKVConnector does not support sleep"):
        config._verify_kv_transfer_compat()


def test_each_data_parallel_replica_gets_its_own_instance(tiny_model: Path) -> None:
    """Scenario: with data parallelism every replica reads the same extra
    config, so an explicit instance_id named one server instance for all of
    them; it now gets the replica's suffix, as the derived id does."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from pegaflow.connector import PegaKVConnector

    engine = Engine(vllm_config(tiny_model))  # a kv_cache_config to reuse

    def ident(extra: dict, dp_size: int, dp_rank: int) -> str:
        config = vllm_config(tiny_model, extra)
        config.parallel_config.data_parallel_size = dp_size
        config.parallel_config.data_parallel_rank = dp_rank
        conn = PegaKVConnector(
            config, KVConnectorRole.SCHEDULER, engine.kv_cache_config
        )
        conn.shutdown()
        return conn._scheduler.instance_id

    named = {"instance_id": "shared-llama"}
    assert ident(named, 1, 0) == "shared-llama"
    assert [ident(named, 2, r) for r in range(2)] == [
        "shared-llama-dp0",
        "shared-llama-dp1",
    ]
    # Derived from vLLM's engine_id (random per config here): the same suffix.
    assert re.fullmatch(r"vllm-.+-dp1", ident({}, 2, 1))
    engine.close()
