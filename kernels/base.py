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

from collections.abc import Callable
from typing import Any

import numpy as np

from pegaflow.common.geometry import Transfers

from .plan import (
    Buffer,
    Direction,
    LaunchShape,
    StageRounds,
    Width,
    check_launch,
    descriptor_table,
    stage_rounds,
)

# (src, dst, runs, stream): copy each run [3, k] (src offset, dst offset,
# nbytes) between the buffers on the stream, e.g. one batched driver call.
Dma = Callable[[Buffer, Buffer, np.ndarray, Any], None]

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

    def _record(self, stream: Any) -> Any:
        """Mark `stream`'s work so far; another stream may then wait for it
        (None where copies are synchronous: nothing needs ordering)."""
        return None

    def _wait(self, stream: Any, mark: Any) -> None:
        """Order `stream`'s later work after `mark` (a _record's result)."""

    def gather_staged(
        self,
        src: Buffer,
        dst: Buffer,
        t: Transfers,
        staging: Buffer,
        *,
        stream: Any,
        copy_stream: Any = None,
        dma: Dma | None = None,
        parts: int = 1,
        round_bytes: int | None = None,
        max_blocks: int | None = None,
        width: Width = 16,
        shape: LaunchShape = DEFAULT_SHAPE,
    ) -> None:
        """Save via device `staging`: pack pages there, then DMA each host run.

        Work larger than a round goes in rounds. With `copy_stream` the runs
        of a round move there while the next round packs on `stream` (the
        staging split into `parts` in turn); everything is done once `stream`
        is, and work queued on `stream` before runs first. `dma` replaces the
        backend's per-run copy (a batched driver call). Calls sharing a
        staging buffer must come from one thread at a time.
        """
        check_launch(width, max_blocks)
        rounds = self._rounds(src, dst, t, staging, "gather", parts, round_bytes)
        copy = dma or self._dma
        pipelined = copy_stream is not None and copy_stream is not stream
        lane = copy_stream if pipelined else stream
        free: list[Any] = [None] * len(rounds.bases)
        for i, chunk in enumerate(rounds.chunks):
            part = i % len(rounds.bases)
            if free[part] is not None:  # the runs that last read this part left
                self._wait(stream, free[part])
            self._launch(src, staging, chunk.table, stream, max_blocks, width, shape)
            if pipelined:
                self._wait(lane, self._record(stream))
            copy(staging, dst, chunk.runs, lane)
            if pipelined:
                free[part] = self._record(lane)
        if pipelined and rounds.chunks:
            self._wait(stream, self._record(lane))

    def scatter_staged(
        self,
        src: Buffer,
        dst: Buffer,
        t: Transfers,
        staging: Buffer,
        *,
        stream: Any,
        copy_stream: Any = None,
        dma: Dma | None = None,
        parts: int = 1,
        round_bytes: int | None = None,
        max_blocks: int | None = None,
        width: Width = 16,
        shape: LaunchShape = DEFAULT_SHAPE,
    ) -> None:
        """Load via device `staging`: DMA each host run there, then unpack;
        rounds, `copy_stream` and `dma` as in gather_staged (the next round's
        runs land while this one unpacks)."""
        check_launch(width, max_blocks)
        rounds = self._rounds(src, dst, t, staging, "scatter", parts, round_bytes)
        copy = dma or self._dma
        pipelined = copy_stream is not None and copy_stream is not stream
        lane = copy_stream if pipelined else stream
        free: list[Any] = [None] * len(rounds.bases)
        if pipelined and rounds.chunks:  # the last call's unpacks read staging
            self._wait(lane, self._record(stream))
        for i, chunk in enumerate(rounds.chunks):
            part = i % len(rounds.bases)
            if free[part] is not None:  # the unpack that last read this part ran
                self._wait(lane, free[part])
            copy(src, staging, chunk.runs, lane)
            if pipelined:
                self._wait(stream, self._record(lane))
            self._launch(staging, dst, chunk.table, stream, max_blocks, width, shape)
            if pipelined:
                free[part] = self._record(stream)

    def _rounds(
        self,
        src: Buffer,
        dst: Buffer,
        t: Transfers,
        staging: Buffer,
        direction: Direction,
        parts: int,
        round_bytes: int | None,
    ) -> StageRounds:
        """The checked table packed into rounds, each placed in its part of
        `staging` (round i in part i % parts)."""
        table = self._checked(src, dst, t)
        return stage_rounds(table, staging.nbytes, direction, parts, round_bytes)

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
