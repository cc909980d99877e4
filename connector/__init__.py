"""vLLM KV connector for pegaflow-server (installed as `pegaflow.connector`).

    --kv-transfer-config '{"kv_connector":"PegaKVConnector","kv_role":"kv_both",
                           "kv_connector_module_path":"pegaflow.connector"}'

The module path may be left out once the package is installed: its
`vllm.general_plugins` entry point (plugin.register) registers the name.

Importing this package is cheap and side-effect free (vLLM imports it from config
setup, layout resolution and metrics): no vLLM, torch or GPU import and no
connection until `PegaKVConnector` itself is looked up and instantiated.
"""

from __future__ import annotations

from typing import Any

__all__ = ["PegaKVConnector"]


def __getattr__(name: str) -> Any:
    if name == "PegaKVConnector":
        from .connector import PegaKVConnector

        return PegaKVConnector
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
