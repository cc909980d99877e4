"""PegaFlow-py: an external KV-cache service for LLM inference engines."""

from __future__ import annotations

import os as _os

__version__ = "0.1.0"

# Installed, kernels/, gds/ and connector/ land inside this package (pyproject's
# package-dir mapping). Run from a source checkout (PYTHONPATH=repo, as on the GPU
# test machine), they are siblings of this directory: let them resolve as
# pegaflow.kernels etc. all the same.
_root = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
if not _os.path.isdir(_os.path.join(_os.path.dirname(__file__), "kernels")) and (
    _os.path.isfile(_os.path.join(_root, "kernels", "__init__.py"))
):
    __path__.append(_root)  # type: ignore[name-defined]  # noqa: F821
