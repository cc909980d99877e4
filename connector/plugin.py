"""vLLM general plugin: registers PegaKVConnector with vLLM's connector factory,
so `"kv_connector": "PegaKVConnector"` works without `kv_connector_module_path`.

pyproject.toml names `register` under the `vllm.general_plugins` entry points;
vLLM calls it in every process it starts, before it builds a connector.
"""

from __future__ import annotations

import contextlib

NAME = "PegaKVConnector"


def register() -> None:
    """Idempotent: a second call (or a registration by the original's wheel)
    leaves the first in place."""
    from vllm.distributed.kv_transfer.kv_connector.factory import (
        KVConnectorFactory,
    )

    with contextlib.suppress(ValueError):  # already registered
        KVConnectorFactory.register_connector(NAME, "pegaflow.connector", NAME)
