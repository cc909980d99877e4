"""Moved to pegaflow.client.kv_layouts; this name stays for engines and docs."""

import sys

from pegaflow.client import kv_layouts as _home

sys.modules[__name__] = _home
