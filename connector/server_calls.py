"""The worker half's calls to the server, on its I/O threads: one Load per
KV cache group for a step's loads, one Save per group for its saves, and the
counters they add to (vLLM's connector stats, via take_stats)."""

from __future__ import annotations

import logging
import threading
import time

from pegaflow.client.pegaflow_client import LoadItem, PegaflowClient
from pegaflow.common.errors import PegaflowError, ServerUnavailable, UnknownInstance

from .registrar import Registrar
from .step_plan import LoadJob, ReqId, new_stats

logger = logging.getLogger(__name__)


class ServerCalls:
    def __init__(
        self,
        client: PegaflowClient,
        tp_rank: int,
        parts: dict[int, Registrar],
        in_flight: bool = False,
    ) -> None:
        """in_flight: a CUDA part's loads name a done_event (loads_in_flight)."""
        self.client = client
        self.in_flight = in_flight
        self.tp_rank = tp_rank
        self.parts = parts  # the worker's, by group id (it may drop some)
        self.stats = new_stats()
        self._lock = threading.Lock()  # I/O threads add to the counters

    def take_stats(self) -> dict[str, float] | None:
        with self._lock:
            if not any(self.stats.values()):
                return None
            stats, self.stats = self.stats, new_stats()
        return stats

    def load(
        self,
        jobs: list[LoadJob],
        layer_seq: int = 0,
        sent: threading.Event | None = None,
    ) -> set[ReqId]:
        """One Load per group for the jobs; the requests that did not load.
        sent: set as the first Load goes out (or once there is none)."""
        # Lease 0: the scheduler could not lease what vLLM allocated.
        failed = {job.req_id for job in jobs if not job.lease_id}
        try:
            for group, part in self.parts.items():
                batch = [job for job in jobs if job.group == group and job.lease_id]
                if batch:
                    failed |= self._load_part(part, batch, layer_seq, sent)
        finally:
            if sent is not None:
                sent.set()
        return failed

    def _load_part(
        self,
        part: Registrar,
        jobs: list[LoadJob],
        layer_seq: int,
        sent: threading.Event | None = None,
    ) -> set[ReqId]:
        start = time.perf_counter()
        items = [
            LoadItem(job.lease_id, job.block_ids, job.lease_offset) for job in jobs
        ]
        try:
            if not part.wait_registered():
                raise UnknownInstance("not registered with the server")
            if sent is not None:  # the engine thread resumes at our next syscall
                sent.set()
            done = part.load_event() if self.in_flight and not layer_seq else 0
            sent_at = time.monotonic()
            res = self.client.load_many(
                part.instance_id,
                items,
                tp_rank=self.tp_rank,
                layer_seq=layer_seq,
                done_event=done,
            )
            if res.in_flight:  # answered as its copy was queued: wait for it here
                wait_s = self.client.timeout_s + self.client.copy_grace_s
                fd = self.client.connection_fd()
                part.wait_loaded(done, wait_s, res.bytes, sent_at, fd)
        except PegaflowError as exc:
            self.failed("load", exc, part, len(jobs))
            return {job.req_id for job in jobs}
        for i in res.failed:  # lease expired or released: that request only
            logger.warning(
                "pegaflow load of %s failed: %s", jobs[i].req_id, res.items[i].error
            )
        self.count(
            load_seconds=time.perf_counter() - start,
            load_blocks=res.loaded,
            load_bytes=res.bytes,
            load_failures=len(res.failed),
            layerwise_loads=bool(layer_seq),
        )
        return {jobs[i].req_id for i in res.failed}

    def save_parts(
        self, batches: list[tuple[Registrar, list[int], list[bytes], int]]
    ) -> None:
        for part, ids, hashes, wait_event in batches:
            self._save(part, ids, hashes, wait_event)

    def _save(
        self, part: Registrar, ids: list[int], hashes: list[bytes], wait_event: int
    ) -> None:
        if not part.registered:
            self.count(saves_skipped=len(ids))  # a future miss, nothing more
            return
        start = time.perf_counter()
        extra = {"wait_event": wait_event} if wait_event else {}
        try:
            res = self.client.save(
                part.instance_id, ids, hashes, tp_rank=self.tp_rank, **extra
            )
        except PegaflowError as exc:
            self.failed("save", exc, part)
            return
        self.count(
            save_seconds=time.perf_counter() - start,
            save_blocks=res.stored,
            save_bytes=res.stored * part.slot_bytes,
        )

    def count(self, **values: float) -> None:
        with self._lock:
            for key, value in values.items():
                self.stats[key] += value

    def failed(
        self,
        op: str,
        exc: PegaflowError,
        part: Registrar | None = None,
        n: int = 1,
    ) -> None:
        self.count(**{f"{op}_failures": n})
        logger.warning("pegaflow %s failed: %s", op, exc)
        if isinstance(exc, ServerUnavailable | UnknownInstance):
            for lost in [part] if part is not None else self.parts.values():
                lost.lost(str(exc))
