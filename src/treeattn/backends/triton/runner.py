"""Run a prepared work partition through the ``torch.library`` ops (so ``torch.compile`` sees them)."""

from __future__ import annotations

import torch

from ... import library_ops  # noqa: F401  (registers torch.ops.treeattn.*)
from ...rope import RoPE
from .dispatch import WorkPartition


def rope_buffers(cache: dict, rope: RoPE, q: torch.Tensor, k: torch.Tensor):
    """Device frequency table and roped-q/k buffers, kept in ``cache`` so later runs allocate nothing."""
    key = ("rope", rope, q.dtype, tuple(q.shape), tuple(k.shape))
    if key not in cache:
        g, divide = rope.frequencies(q.shape[2])
        cache[key] = (g.to(device=q.device, dtype=torch.float32).contiguous(), divide,
                      torch.empty(q.shape, dtype=q.dtype, device=q.device),
                      torch.empty(k.shape, dtype=k.dtype, device=k.device))
    return cache[key]


def run(part: WorkPartition, q, k, v, out, lse, *, sm_scale: float, rope: RoPE | None = None,
        rope_cache: dict | None = None, q_positions=None, k_positions=None) -> None:
    """Launch over a prepared partition (``k``/``v``: ragged tensors or the K/V halves of the pages).

    With ``rope``, q and k are first rotated into buffers held in ``rope_cache`` (ragged only)."""
    if rope is not None:
        freqs, divide, q_rot, k_rot = rope_buffers(rope_cache, rope, q, k)
        for x, pos, dst in ((q, q_positions, q_rot), (k, k_positions, k_rot)):
            torch.ops.treeattn.triton_rope(x, pos, freqs, dst, rope.scale, rope.multiplier, divide)
        q, k = q_rot, k_rot
    t = part.tiles
    torch.ops.treeattn.triton_tree_attention(
        q, k, v, part.requests, part.work, part.counts, part.token_request, part.tree_order, part.page_indices,
        part.o_part, part.lse_part, out, lse, sm_scale, t.block_m, t.block_n, t.block_d, t.num_warps,
        t.num_stages, t.fp32_dot, part.grid_work, part.grid_tokens, part.launch_merge)
