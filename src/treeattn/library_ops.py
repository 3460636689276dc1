"""``torch.library`` registration of the Triton kernels, so ``torch.compile`` graphs can hold them.

The ops take only tensors and numbers (a plan is a Python object, so its device tables travel as
tensors) and write their outputs in place; their fake implementations do nothing, which is all
a tracer needs from an op that returns nothing. The Triton backend calls kernels only through
these ops. Importing this module needs torch only; triton is imported at the first launch.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .backends.triton import launch


@torch.library.custom_op("treeattn::triton_tree_attention", mutates_args=("o_part", "lse_part", "out", "lse"))
def triton_tree_attention(
    q: Tensor, k: Tensor, v: Tensor, requests: Tensor, work: Tensor, counts: Tensor, token_request: Tensor,
    tree_order: Tensor, page_indices: Tensor, o_part: Tensor, lse_part: Tensor, out: Tensor, lse: Tensor,
    sm_scale: float, block_m: int, block_n: int, block_d: int, num_warps: int, num_stages: int, fp32_dot: bool,
    grid_work: int, grid_tokens: int, launch_merge: bool,
) -> None:
    """Ragged (``k``/``v [L, h_kv, d]``) or paged (``[P, h_kv, page_size, d]`` halves) tree attention
    over a work partition (``treeattn.backends.triton.dispatch``)."""
    launch.tree_attention(
        q, k, v, requests, work, counts, token_request, tree_order, page_indices, o_part, lse_part, out, lse,
        sm_scale=sm_scale, block_m=block_m, block_n=block_n, block_d=block_d, num_warps=num_warps,
        num_stages=num_stages, fp32_dot=fp32_dot, grid_work=grid_work, grid_tokens=grid_tokens,
        launch_merge=launch_merge)


@triton_tree_attention.register_fake
def _(*args, **kwargs) -> None:
    return None


@torch.library.custom_op("treeattn::triton_rope", mutates_args=("out",))
def triton_rope(x: Tensor, positions: Tensor, freqs: Tensor, out: Tensor, scale: float, multiplier: float,
                divide: bool) -> None:
    """TVM-formula rotate-half RoPE of ``x [L, H, d]`` into ``out`` (``freqs`` from ``RoPE.frequencies``)."""
    launch.rope(x, positions, freqs, out, scale=scale, multiplier=multiplier, divide=divide)


@triton_rope.register_fake
def _(*args, **kwargs) -> None:
    return None


@torch.library.custom_op("treeattn::triton_merge_state", mutates_args=("out", "lse"))
def triton_merge_state(out_a: Tensor, lse_a: Tensor, out_b: Tensor, lse_b: Tensor, out: Tensor, lse: Tensor) -> None:
    """Base-2 LSE merge of two partial attention states into ``out``/``lse``."""
    launch.merge_state(out_a, lse_a, out_b, lse_b, out, lse)


@triton_merge_state.register_fake
def _(*args, **kwargs) -> None:
    return None
