"""The Engine's page checks (engine.py): what a request's attention reads is
the fake KV of its tokens (fake_kv.py), in every group a hit restores; a
window vLLM replays after a hit is written by the forward alone."""

from __future__ import annotations

from typing import Any

import torch

from tests.connector.fake_kv import BLOCK, fake_kv_batch, pages, what_is_there


class PageChecks:
    """Mixed into Engine: its scheduler, caches, sequences and groups."""

    sched: Any
    caches: dict[str, torch.Tensor]
    seqs: dict[str, Any]
    group_of: dict[str, int]
    state_layers: set[str]
    scratch_layers: set[str]
    replay_groups: set[int]
    replay_layers: set[str]
    replay_window: int
    _replay_snap: dict[str, tuple[list[int], torch.Tensor]]

    def tables(self, rid: str) -> list[list[int]]:
        """Block ids per KV cache group (0: vLLM's null block)."""
        return [list(t) for t in self.sched.kv_cache_manager.get_block_ids(rid)]

    def replayed(self, rid: str) -> range:
        """The hit's last window, which vLLM replays (bounded replay)."""
        start = getattr(self.sched.requests[rid], "replay_start", 0)
        return range(start, start + self.replay_window if start else start)

    def _replay_owned(self) -> set[tuple[int, int]]:
        return {
            (g, b)
            for rid in self.sched.requests
            for g, table in enumerate(self.tables(rid))
            if g in self.replay_groups
            for b in table
            if b
        }

    def replay_changes(self) -> list[str]:
        """Pages of a replayed window changed since the last forward (by a
        load: nothing else may write them), in blocks it held then and now."""
        owned, bad = self._replay_owned(), []
        for name, (ids, before) in self._replay_snap.items():
            kv, g = pages(self.caches[name]), self.group_of[name]
            for i, b in enumerate(ids):
                if (g, b) in owned and not torch.equal(kv[b], before[i]):
                    bad.append(f"{name} block id {b} written outside the forward")
        return bad

    # -- checks ---------------------------------------------------------------
    def page_errors(
        self, rid: str, tables: list[list[int]], num_tokens: int
    ) -> list[str]:
        """Full blocks of `rid` whose bytes differ from the fake KV of its
        tokens (in every group, where the group still holds a block)."""
        return self._block_errors(rid, tables, range(num_tokens // BLOCK))

    def restored_errors(self, so: Any, tables: dict[str, list[list[int]]]) -> list[str]:
        """Pages a request starts its first forward with (a local hit or an
        async load that landed), in every group: what its attention reads."""
        plan = getattr(so.kv_connector_metadata, "plan", None)
        sync = [j for j in plan.loads if j.sync] if plan else []
        syncing = {j.req_id for j in sync}
        # Blocks this step's sync loads fill: another request may hit them in
        # vLLM's own prefix cache in the same step (checked once loaded).
        landing = {(j.group, b) for j in sync for b in j.block_ids}
        # So may blocks another request computes whole in this step: attention
        # writes a layer's KV before it reads it (checked when they finish).
        landing |= self._computing(so, tables)
        bad = []
        for new in so.scheduled_new_reqs:
            rid = new.req_id
            done = max(new.num_computed_tokens, self.replayed(rid).stop)
            if not done or rid in syncing:
                continue
            for g, t in enumerate(tables[rid]):
                hit = [
                    k
                    for k in range(done // BLOCK)
                    if not (k < len(t) and (g, t[k]) in landing)
                ]
                bad += self._block_errors(rid, tables[rid], hit, g, restored=True)
        return [f"restored page wrong before the forward: {e}" for e in bad]

    def _computing(
        self, so: Any, tables: dict[str, list[list[int]]]
    ) -> set[tuple[int, int]]:
        """(group, block id) of the blocks this step's forward writes whole."""
        blocks = set()
        for rid, n in so.num_scheduled_tokens.items():
            end = self.sched.requests[rid].num_computed_tokens
            for g, table in enumerate(tables[rid]):
                start = end - n
                if g not in self.replay_groups:  # the replayed tokens write none
                    start = max(start, self.replayed(rid).stop)
                first = -(-start // BLOCK)
                blocks |= {(g, b) for b in table[first : end // BLOCK] if b}
        return blocks

    def sync_load_errors(self, loads: list[Any]) -> list[str]:
        """Blocks of this step's sync loads whose bytes are not (yet) right."""
        bad = []
        for job in loads:
            if job.sync:
                tables = self.tables(job.req_id)
                blocks = [tables[job.group].index(b) for b in job.block_ids]
                bad += self._block_errors(job.req_id, tables, blocks, job.group)
        return [f"sync load not landed before the forward: {e}" for e in bad]

    def _block_errors(
        self,
        rid: str,
        tables: list[list[int]],
        blocks: Any,
        group: int | None = None,
        restored: bool = False,  # only the groups a hit restores
    ) -> list[str]:
        seq, bad = self.seqs[rid], []
        for layer, (name, view) in enumerate(self.caches.items()):
            if name in self.state_layers or name in self.scratch_layers:
                continue  # checked where a step reads it (_write_state), or scratch
            if restored and name in self.replay_layers:
                continue  # rebuilt by this step's forward
            if group is not None and self.group_of[name] != group:
                continue
            table = tables[self.group_of[name]]
            kv = pages(view)
            for k in blocks:
                if k >= len(table) or table[k] == 0:
                    continue  # a null block: the window moved on
                pos = range(k * BLOCK, (k + 1) * BLOCK)
                values = torch.tensor([seq.value(p) for p in pos], dtype=torch.int64)
                want = fake_kv_batch(values, layer, kv.shape[1], kv.shape[3])
                got = kv[table[k]].permute(1, 0, 2)
                if not torch.equal(got, want):
                    what = (
                        what_is_there(got, seq, k, len(self.caches)) if not bad else ""
                    )
                    bad.append(f"{rid} block {k} (id {table[k]}) layer {layer}{what}")
        return bad
