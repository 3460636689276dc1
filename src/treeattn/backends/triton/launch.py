"""Kernel launchers: tensors and plain numbers in, kernels launched, nothing allocated or synced.

Triton decides at decoration time, from ``TRITON_INTERPRET``, whether ``@triton.jit`` builds
compiled or interpreted kernels, and that includes its own ``tl.sum``/``tl.max``, which are
decorated when triton is first imported. So the variable must be set before triton is imported;
the kernels module is imported lazily (first launch) and a mismatch is reported, not run.
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType

import torch

from ...lse import LOG2E

MERGE_BLOCK_ROWS = 16  # (row, head) pairs per merge_state program
MERGE_BLOCK_H = 16  # heads per program of the split merge
ROPE_BLOCK_ROWS = 16  # (token, head) rows per RoPE program


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def load_kernels() -> ModuleType:
    """The kernels module, after checking triton was imported in the mode the environment asks for."""
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction

    if isinstance(tl.standard.sum, InterpretedFunction) != interpreting():
        raise RuntimeError(
            "TRITON_INTERPRET changed after triton was imported: set TRITON_INTERPRET=1 before the first "
            "`import triton` (triton compiles its own tl.sum/tl.max for one mode at import time)")
    return importlib.import_module(f"{__package__}.kernels")


def tree_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, requests: torch.Tensor, work: torch.Tensor,
                   counts: torch.Tensor, token_request: torch.Tensor, tree_order: torch.Tensor,
                   page_indices: torch.Tensor, o_part: torch.Tensor, lse_part: torch.Tensor, out: torch.Tensor,
                   lse: torch.Tensor, *, sm_scale: float, block_m: int, block_n: int, block_d: int, num_warps: int,
                   num_stages: int, fp32_dot: bool, grid_work: int, grid_tokens: int, launch_merge: bool) -> None:
    """Launch tree attention (plus the split merge). ``k``/``v`` are ``[L, h_kv, d]`` (ragged) or
    the K and V halves of the pages, ``[P, h_kv, page_size, d]`` (paged)."""
    kernels = load_kernels()
    paged = k.dim() == 4
    num_q_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k.shape[1]
    if paged:
        page_log2 = k.shape[2].bit_length() - 1
        stride_kt, stride_kh, stride_page = k.stride(2), k.stride(1), k.stride(0)
    else:
        stride_kt, stride_kh, stride_page, page_log2 = k.stride(0), k.stride(1), 0, 0
    stride_vt, stride_vh = (stride_kt, stride_kh) if paged else (v.stride(0), v.stride(1))
    if grid_work:
        kernels.tree_attn_kernel[(grid_work, num_kv_heads)](
            q, k, v, out, lse, o_part, lse_part, requests, work, counts, tree_order, page_indices, sm_scale * LOG2E,
            q.stride(0), q.stride(1), stride_kt, stride_kh, stride_vt, stride_vh, stride_page, page_log2, num_q_heads,
            num_q_heads // num_kv_heads,
            HEAD_DIM=head_dim, PAGED=paged, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d, FP32_DOT=fp32_dot,
            num_warps=num_warps, num_stages=num_stages,
        )
    if launch_merge and grid_tokens:
        kernels.merge_splits_kernel[(grid_tokens, -(-num_q_heads // MERGE_BLOCK_H))](
            out, lse, o_part, lse_part, requests, token_request, counts, num_q_heads,
            HEAD_DIM=head_dim, BLOCK_H=MERGE_BLOCK_H, BLOCK_D=block_d, num_warps=4,
        )


def rope(x: torch.Tensor, positions: torch.Tensor, freqs: torch.Tensor, out: torch.Tensor, *, scale: float,
         multiplier: float, divide: bool) -> None:
    """RoPE of ``x [L, H, d]`` at ``positions [L]`` into contiguous ``out`` (same shape and dtype)."""
    rows = x.shape[0] * x.shape[1]
    if rows == 0:
        return
    head_dim = x.shape[2]
    load_kernels().rope_kernel[(-(-rows // ROPE_BLOCK_ROWS),)](
        x, positions, freqs, out, rows, x.shape[1], x.stride(0), x.stride(1), scale, multiplier,
        HEAD_DIM=head_dim, BLOCK_R=ROPE_BLOCK_ROWS, BLOCK_D=max(16, 1 << (head_dim - 1).bit_length()),
        ROPE_DIVIDE=divide, num_warps=4,
    )


def merge_state(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor,
                out: torch.Tensor, lse: torch.Tensor) -> None:
    kernels = load_kernels()
    rows, heads, head_dim = out_a.shape
    if rows * heads == 0:
        return
    block_d = max(16, 1 << (head_dim - 1).bit_length())
    kernels.merge_state_kernel[(-(-rows * heads // MERGE_BLOCK_ROWS),)](
        out_a, lse_a, out_b, lse_b, out, lse, rows, heads,
        out_a.stride(0), out_a.stride(1), out_b.stride(0), out_b.stride(1),
        lse_a.stride(0), lse_a.stride(1), lse_b.stride(0), lse_b.stride(1),
        HEAD_DIM=head_dim, BLOCK_R=MERGE_BLOCK_ROWS, BLOCK_D=block_d, num_warps=4,
    )
