"""Triton backend: GPU kernels for ragged and paged tree attention, and merge_state.

Runs on CUDA tensors, or on CPU tensors through Triton's interpreter (``TRITON_INTERPRET=1``;
that is how CI tests the kernels). The work partition is computed once per plan and cached in
``plan.cache["triton"]`` (``dispatch.py``); a run launches the kernels through the
``torch.library`` ops in ``treeattn.library_ops`` (so ``torch.compile`` can trace it) and does no
host synchronisation. ``GraphEnvelope`` gives fixed-size buffers and grids for CUDA graphs.
"""

from __future__ import annotations

import torch

from ...plan import TreeAttentionPlan
from ...rope import RoPE
from .dispatch import TileConfig, WorkPartition, build_partition, choose_tiles, get_partition, prepare
from .envelope import GraphEnvelope
from .runner import run

__all__ = ["tree_attention", "paged_tree_attention", "merge_state", "prepare", "build_partition", "choose_tiles",
           "run", "TileConfig", "WorkPartition", "GraphEnvelope"]


def tree_attention(q, k, v, plan: TreeAttentionPlan, *, sm_scale: float, rope: RoPE | None, q_positions,
                   k_positions, out: torch.Tensor, lse: torch.Tensor) -> None:
    part = get_partition(plan, q.shape[1], k.shape[1], q.shape[2], q.dtype)
    run(part, q, k, v, out, lse, sm_scale=sm_scale, rope=rope, rope_cache=plan.cache.setdefault("triton", {}),
        q_positions=q_positions, k_positions=k_positions)


def paged_tree_attention(q, kv_pages, plan: TreeAttentionPlan, *, sm_scale: float, out: torch.Tensor,
                         lse: torch.Tensor) -> None:
    page_size = kv_pages.shape[3]
    if page_size & (page_size - 1):
        raise ValueError(f"the triton backend needs a power-of-two page size, got {page_size}")
    part = get_partition(plan, q.shape[1], kv_pages.shape[2], q.shape[2], q.dtype)
    run(part, q, kv_pages[:, 0], kv_pages[:, 1], out, lse, sm_scale=sm_scale)


def merge_state(out_a, lse_a, out_b, lse_b, *, out: torch.Tensor, lse: torch.Tensor) -> None:
    torch.ops.treeattn.triton_merge_state(out_a, lse_a, out_b, lse_b, out, lse)


from ..base import Backend as _B  # TEMP-STUB (not committed)


class TritonBackend(_B):
    name = "triton"

    def unavailable(self):
        return "TEMP: being ported"
