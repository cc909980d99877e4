"""The copy operations, written once over two backend hooks.

A backend (cpu.py, cuda.py) supplies `_launch` (copy a checked offset table
between two buffers in one go: one kernel launch on CUDA), `_launch_pair` (two
such tables, each between its own pair of buffers, in one go: a save and a
load in one launch) and `_dma` (copy contiguous runs: the copy engine on CUDA).
Everything else — validation, the
direction of each step, staging rounds — is here, so both backends behave the
same by construction and the CPU twin is a faithful reference.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from pegaflow.geometry import Transfers

from .plan import (
    Buffer,
    LaunchShape,
    Width,
    check_launch,
    descriptor_table,
    stage_chunks,
)

DEFAULT_SHAPE = LaunchShape()
PAIR_SHAPE = LaunchShape("warp")


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
        shape: LaunchShape,
    ) -> None:
        raise NotImplementedError

    def _launch_pair(
        self,
        a: tuple[Buffer, Buffer, np.ndarray],
        b: tuple[Buffer, Buffer, np.ndarray],
        stream: Any,
        max_blocks: int | None,
        width: int,
        shape: LaunchShape,
    ) -> None:
        raise NotImplementedError

    def _dma(self, src: Buffer, dst: Buffer, runs: np.ndarray, stream: Any) -> None:
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
        shape: LaunchShape = DEFAULT_SHAPE,
    ) -> None:
        """Copy every descriptor of `t` from `src` into `dst` in one launch.

        `t` names bytes by absolute address (`Buffer.address` space); every
        range must lie inside its buffer and destinations must not overlap, or
        InternalError names the field. `max_blocks` caps the CUDA grid (SM
        share); `width` caps the store size (16, 8, or 1 = bytes only);
        `shape` picks the kernel and how it cuts the work (plan.LaunchShape).
        """
        check_launch(width, max_blocks)
        table = self._checked(src, dst, t)
        self._launch(src, dst, table, stream, max_blocks, width, shape)

    def gather(
        self,
        src: Buffer,
        dst: Buffer,
        t: Transfers,
        *,
        stream: Any,
        max_blocks: int | None = None,
        width: Width = 16,
        shape: LaunchShape = DEFAULT_SHAPE,
    ) -> None:
        """Save, zero-copy: engine KV pages (`src`) -> mapped pool slots (`dst`)."""
        self.copy_descriptors(
            src, dst, t, stream=stream, max_blocks=max_blocks, width=width, shape=shape
        )

    def scatter(
        self,
        src: Buffer,
        dst: Buffer,
        t: Transfers,
        *,
        stream: Any,
        max_blocks: int | None = None,
        width: Width = 16,
        shape: LaunchShape = DEFAULT_SHAPE,
    ) -> None:
        """Load, zero-copy: mapped pool slots (`src`) -> engine KV pages (`dst`)."""
        self.copy_descriptors(
            src, dst, t, stream=stream, max_blocks=max_blocks, width=width, shape=shape
        )

    def gather_staged(
        self,
        src: Buffer,
        dst: Buffer,
        t: Transfers,
        staging: Buffer,
        *,
        stream: Any,
        max_blocks: int | None = None,
        width: Width = 16,
        shape: LaunchShape = DEFAULT_SHAPE,
    ) -> None:
        """Save via device `staging`: pack pages there, then DMA each host run.

        Work larger than `staging` goes in rounds, ordered on `stream`.
        """
        check_launch(width, max_blocks)
        table = self._checked(src, dst, t)
        for chunk in stage_chunks(table, staging.nbytes, "gather"):
            self._launch(src, staging, chunk.table, stream, max_blocks, width, shape)
            self._dma(staging, dst, chunk.runs, stream)

    def scatter_staged(
        self,
        src: Buffer,
        dst: Buffer,
        t: Transfers,
        staging: Buffer,
        *,
        stream: Any,
        max_blocks: int | None = None,
        width: Width = 16,
        shape: LaunchShape = DEFAULT_SHAPE,
    ) -> None:
        """Load via device `staging`: DMA each host run there, then unpack."""
        check_launch(width, max_blocks)
        table = self._checked(src, dst, t)
        for chunk in stage_chunks(table, staging.nbytes, "scatter"):
            self._dma(src, staging, chunk.runs, stream)
            self._launch(staging, dst, chunk.table, stream, max_blocks, width, shape)

    def copy_pair(
        self,
        a: tuple[Buffer, Buffer, Transfers],
        b: tuple[Buffer, Buffer, Transfers],
        *,
        stream: Any,
        max_blocks: int | None = None,
        width: Width = 16,
        shape: LaunchShape = PAIR_SHAPE,
    ) -> None:
        """Two copies, each (src, dst, transfers), in one launch: a save and a
        load at once without two grids competing for the SMs. The warp kernel
        runs it whatever `shape.kernel` says (its pieces alternate between the
        two tables); `threads` and `parts` apply. Destinations of `a` and `b`
        must not overlap each other either: nothing orders one against the other.
        """
        check_launch(width, max_blocks)
        ta = self._checked(*a)
        tb = self._checked(*b)
        self._launch_pair(
            (a[0], a[1], ta), (b[0], b[1], tb), stream, max_blocks, width, shape
        )
