"""numba's CPU compiler with its on-disk cache where one can be written.

numba caches next to the source (`__pycache__`) or in the user's cache
directory; where neither is writable (a read-only install run by a user
without a writable HOME, as in a locked-down container) `cache=True` raises at
decoration, which would stop the server at its start. There the function is
compiled without the cache instead: the same code, a few seconds more at each
start. Importing this module imports no numba.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)


def njit(fn: Callable[..., Any], signature: str | None = None, **options: Any) -> Any:
    """numba.njit(signature, cache=True, **options)(fn), or without the cache
    where numba finds no writable cache directory."""
    import numba

    args = () if signature is None else (signature,)
    try:
        return numba.njit(*args, cache=True, **options)(fn)
    except RuntimeError as exc:
        if "cannot cache" not in str(exc):
            raise
        logger.info(
            "numba cannot cache %s (%s): compiled at each start", fn.__name__, exc
        )
        return numba.njit(*args, cache=False, **options)(fn)


def checked_nogil(
    fn: Callable[..., Any],
    check: Callable[[Callable[..., Any]], None],
    fallback: str,
    log: logging.Logger,
) -> Callable[..., Any] | None:
    """numba.njit(nogil=True)(fn) once check(compiled) has passed; None,
    saying `fallback` (what the caller does instead) and why, without numba
    (info) or when the compile or the check fails (warning). For loops that
    call C functions through ctypes: never cached on disk, as the compiled
    code holds this process's addresses of those functions."""
    try:
        import numba
    except ImportError as exc:
        log.info("%s (%s)", fallback, exc)
        return None
    compiled = numba.njit(nogil=True, cache=False)(fn)
    try:
        check(compiled)  # compiles it, too
    except Exception as exc:  # an optional speed-up: fall back, never fail
        log.warning("%s: %s", fallback, exc)
        return None
    return compiled
