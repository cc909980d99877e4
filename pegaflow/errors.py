"""Moved to pegaflow.common.errors; this name stays for engines and docs."""

import sys

from pegaflow.common import errors as _home

sys.modules[__name__] = _home
