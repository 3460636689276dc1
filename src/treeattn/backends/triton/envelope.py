"""Fixed-size work buffers for CUDA graphs.

A captured graph replays the same kernels with the same pointers and grid sizes. So the envelope
owns every table the kernels read (work list, request table, tree order, page table) at its
maximum size, sizes the split workspace (allocated inside the launch, so from the graph's own
memory pool during capture) at its maximum, and launches fixed grids; ``bind(plan)`` refills the
tables for a new batch outside the graph (host work plus async copies), and programs past the
live work exit.
Typical use::

    env = GraphEnvelope(max_batch=8, max_tokens=8 * 64, max_qo_len=64, max_tree_nodes=8 * 64, max_pages=4096,
                        num_q_heads=32, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16, device="cuda")
    env.bind(plan0); env.run_paged(q, kv_pages, out, lse)          # warm up (compiles)
    with torch.cuda.graph(g): env.run_paged(q, kv_pages, out, lse)
    ...; env.bind(plan); g.replay()                                  # every step
"""

from __future__ import annotations

import math

import numpy as np
import torch

from ...layout import PagedKV
from ...ops import check_variants
from ...plan import TreeAttentionPlan
from ...rope import RoPE
from .. import AttentionSpec, select
from .partition import WorkPartition, cdiv, default_chunk, num_sms, partition_arrays, plan_tiles
from .tables import CountColumn, RequestColumn, WorkColumn


class GraphEnvelope:
    """Static buffers and grids for up to ``max_batch`` requests, ``max_tokens`` query rows in all,
    ``max_qo_len`` rows per request, ``max_tree_nodes`` tree nodes and ``max_pages`` page ids in all."""

    def __init__(self, *, max_batch: int, max_tokens: int, max_qo_len: int, max_tree_nodes: int, num_q_heads: int,
                 num_kv_heads: int, head_dim: int, dtype: torch.dtype, device, max_pages: int = 0,
                 max_work: int | None = None, max_partial_rows: int | None = None, v_head_dim: int | None = None,
                 sliding_window: int | None = None, logit_softcap: float | None = None):
        """``v_head_dim``, ``sliding_window`` and ``logit_softcap`` as the operators take them (fixed per
        envelope: a model that alternates windowed and global layers uses one envelope for each)."""
        device = torch.device(device)
        check_variants(sliding_window, logit_softcap, None, num_q_heads, device)
        for name, value in (("max_batch", max_batch), ("max_tokens", max_tokens), ("max_qo_len", max_qo_len),
                            ("num_kv_heads", num_kv_heads)):
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if num_q_heads % num_kv_heads:
            raise ValueError(f"num_q_heads {num_q_heads} must be a multiple of num_kv_heads {num_kv_heads}")
        self.spec = AttentionSpec(device, dtype, num_q_heads, num_kv_heads, head_dim,
                                  head_dim if v_head_dim is None else v_head_dim, sliding_window=sliding_window,
                                  logit_softcap=logit_softcap)
        self.backend = select("triton", self.spec)  # raises with the reason when triton cannot serve it
        tiles = plan_tiles(self.spec, max_qo_len * self.spec.group)
        unsplit = cdiv(max_tokens * self.spec.group, tiles.block_m) + max_batch  # bound on items without splits
        self.max_work = max_work or unsplit + 4 * num_sms(device)
        if self.max_work < unsplit:
            raise ValueError(f"max_work must be at least {unsplit} (the work of an unsplit batch), got {max_work}")
        max_partial_rows = max_partial_rows if max_partial_rows is not None else 8 * max_tokens
        self.limits = {"batch size": max_batch, "query rows": max_tokens, "rows per request": max_qo_len,
                       "tree nodes": max_tree_nodes, "page ids": max_pages}
        i32 = {"dtype": torch.int32, "device": device}
        self.partition = WorkPartition(
            tiles=tiles,
            requests=torch.zeros(max_batch, len(RequestColumn), **i32),
            work=torch.zeros(self.max_work, len(WorkColumn), **i32),
            counts=torch.zeros(len(CountColumn), **i32),
            token_request=torch.zeros(max_tokens, **i32),
            tree_order=torch.zeros(max(1, max_tree_nodes), 2, **i32),
            page_indices=torch.zeros(max(1, max_pages), **i32),
            row_positions=torch.zeros(max_tokens if sliding_window else 1, **i32),
            node_depths=torch.zeros(max(1, max_tree_nodes) if sliding_window else 1, **i32),
            partial_rows=max_partial_rows, grid_work=self.max_work, grid_tokens=max_tokens, launch_merge=True,
            chunk=0, window=sliding_window or 0, softcap=logit_softcap or 0.0)
        self.plan: TreeAttentionPlan | None = None
        self.chunk = 0  # KV chunk length of the bound batch's split requests (0: none split)

    def _check(self, plan: TreeAttentionPlan) -> None:
        pages = 0 if plan.page_indices_host is None else plan.page_indices_host.shape[0]
        sizes = {"batch size": plan.batch_size, "query rows": plan.total_q,
                 "rows per request": int(plan.qo_lens.max()) if plan.batch_size else 0,
                 "tree nodes": plan.tree_order.shape[0], "page ids": pages}
        for what, size in sizes.items():
            if size > self.limits[what]:
                raise ValueError(f"plan has {size} {what}, more than this GraphEnvelope holds ({self.limits[what]})")
        if plan.device != self.spec.device:
            raise ValueError(f"plan is on {plan.device}, the envelope on {self.spec.device}")

    def bind(self, plan: TreeAttentionPlan) -> None:
        """Load ``plan``'s partition into the static tables (host work plus async copies, no sync)."""
        self._check(plan)
        part, tiles, group = self.partition, self.partition.tiles, self.spec.group
        chunk = default_chunk(plan, self.spec, tiles)
        while True:  # a coarser split until the work list and workspace fit (no split always fits)
            host = partition_arrays(plan, group, tiles, chunk, self.spec.sliding_window)
            if chunk == 0 or (host["work"].shape[0] <= self.max_work and host["partial_rows"] <= part.partial_rows):
                break
            chunk = 0 if chunk * 2 >= int(plan.kv_lens.max()) else chunk * 2
        copy = lambda dst, src: dst[:src.shape[0]].copy_(torch.from_numpy(src), non_blocking=True)
        copy(part.requests, host["requests"])
        copy(part.work, host["work"])
        copy(part.token_request, host["token_request"])
        copy(part.counts, host["counts"])
        part.tree_order[:plan.tree_order.shape[0]].copy_(plan.tree_order, non_blocking=True)
        if plan.page_indices is not None:
            part.page_indices[:plan.page_indices.shape[0]].copy_(plan.page_indices, non_blocking=True)
        if self.spec.sliding_window:
            copy(part.row_positions, plan.row_positions.astype(np.int32))
            copy(part.node_depths, plan.node_depths.astype(np.int32))
        self.plan, self.chunk = plan, chunk if host["any_split"] else 0

    def _bound(self) -> TreeAttentionPlan:
        if self.plan is None:
            raise ValueError("bind(plan) a batch to the GraphEnvelope before running it")
        return self.plan

    def run_paged(self, q, kv_pages, out, lse, *, sm_scale: float | None = None, kv_layout: str | None = None,
                  sinks: torch.Tensor | None = None) -> None:
        """Paged tree attention on the bound batch (``kv_pages`` as ``PagedKV.wrap`` takes it);
        ``q``/``out``/``lse`` may hold more rows than the batch uses. ``sinks``: float32 ``[h_q]`` as the
        operators take them (not checked here: checking their values would sync, which a capture forbids)."""
        self.backend.paged_tree_attention(q, PagedKV.wrap(kv_pages, kv_layout), self._bound(), self.partition,
                                          sm_scale=sm_scale or 1.0 / math.sqrt(self.spec.head_dim), out=out, lse=lse,
                                          sinks=sinks)

    def run_ragged(self, q, k, v, out, lse, *, sm_scale: float | None = None, rope: RoPE | None = None,
                   q_positions=None, k_positions=None, sinks: torch.Tensor | None = None) -> None:
        """Ragged tree attention on the bound batch (``k_positions`` is required with ``rope``; ``sinks`` as
        in ``run_paged``)."""
        if rope is not None:
            q, k = self.backend.rope(rope, q, q_positions), self.backend.rope(rope, k, k_positions)
        self.backend.tree_attention(q, k, v, self._bound(), self.partition,
                                    sm_scale=sm_scale or 1.0 / math.sqrt(self.spec.head_dim), out=out, lse=lse,
                                    sinks=sinks)
