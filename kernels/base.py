"""The copy operations, written once over one backend hook.

A backend (cpu.py, cuda.py) supplies `_launch`: copy a checked offset table
between two buffers in one go (one kernel launch on CUDA). Everything else —
validation and the direction of each copy — is here, so both backends behave
the same by construction and the CPU twin is a faithful reference.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from pegaflow.common.geometry import Transfers

from .plan import Buffer, Width, check_launch, descriptor_table


class CopyKernels:
    """Descriptor copies between buffers; subclasses move the bytes."""

    def _launch(
        self,
        src: Buffer,
        dst: Buffer,
        table: np.ndarray,
        stream: Any,
        max_blocks: int | None,
        width: int,
        before_launch: Callable[[], None] | None = None,
    ) -> None:
        raise NotImplementedError

    def _checked(self, src: Buffer, dst: Buffer, t: Transfers) -> np.ndarray:
        """plan.descriptor_table: every range inside its buffer, destinations
        disjoint, or InternalError naming the field (a backend may do the same
        checks faster, in the same words)."""
        return descriptor_table(src, dst, t)

    def copy_descriptors(
        self,
        src: Buffer,
        dst: Buffer,
        t: Transfers,
        *,
        stream: Any,
        max_blocks: int | None = None,
        width: Width = 16,
        before_launch: Callable[[], None] | None = None,
    ) -> None:
        """Copy every descriptor of `t` from `src` into `dst` in one launch.

        `t` names bytes by absolute address (`Buffer.address` space); every
        range must lie inside its buffer and destinations must not overlap, or
        InternalError names the field. `max_blocks` caps the CUDA grid (SM
        share); `width` caps the store size (16, 8, or 1 = bytes only).
        `before_launch` runs after the host's table work, right before the
        launch: a timing event recorded there times the copy, not our Python.
        """
        check_launch(width, max_blocks)
        table = self._checked(src, dst, t)
        self._launch(src, dst, table, stream, max_blocks, width, before_launch)

    def gather(
        self,
        src: Buffer,
        dst: Buffer,
        t: Transfers,
        *,
        stream: Any,
        max_blocks: int | None = None,
        width: Width = 16,
        before_launch: Callable[[], None] | None = None,
    ) -> None:
        """Save, zero-copy: engine KV pages (`src`) -> mapped pool slots (`dst`)."""
        self.copy_descriptors(
            src, dst, t, stream=stream, max_blocks=max_blocks, width=width,
            before_launch=before_launch,
        )  # fmt: skip

    def scatter(
        self,
        src: Buffer,
        dst: Buffer,
        t: Transfers,
        *,
        stream: Any,
        max_blocks: int | None = None,
        width: Width = 16,
        before_launch: Callable[[], None] | None = None,
    ) -> None:
        """Load, zero-copy: mapped pool slots (`src`) -> engine KV pages (`dst`)."""
        self.copy_descriptors(
            src, dst, t, stream=stream, max_blocks=max_blocks, width=width,
            before_launch=before_launch,
        )  # fmt: skip
