"""Launchers: the ``torch.library`` custom ops whose bodies launch the Triton kernels.

The ops take only tensors and numbers (a partition is a Python object, so its device tables
travel as tensors), write their outputs in place and return nothing; their fake implementations
do nothing, which is all a tracer needs, so ``torch.compile`` graphs can hold them. Each kernel's
argument list is written once, in its ``*_launch`` function here (every argument by name,
constexprs included); the ops launch what it returns and ``aot.py`` compiles from it.

Triton decides at decoration time, from ``TRITON_INTERPRET``, whether ``@triton.jit`` builds
compiled or interpreted kernels, and that includes its own ``tl.sum``/``tl.max``, which are
decorated when triton is first imported. So the variable must be set before triton is imported;
the kernels module is imported lazily (first launch) and a mismatch is reported, not run.
"""

from __future__ import annotations

import importlib
import os
import sys
from types import ModuleType
from typing import Any, NamedTuple

import torch
from torch import Tensor

from ...layout import PagedKV
from ...lse import LOG2E
from .partition import TileConfig, cdiv, padded_head_dim

MERGE_BLOCK_ROWS = 16  # (row, head) pairs per merge_state program
MERGE_BLOCK_H = 16  # heads per program of the split merge
ROPE_BLOCK_ROWS = 16  # (token, head) rows per RoPE program
SMALL_KERNEL_WARPS = 4  # rope, merge_state and the split merge


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def mode_mismatch() -> str | None:
    """Why kernels cannot be built in the mode ``TRITON_INTERPRET`` asks for, or None (never imports triton)."""
    if "triton.language" not in sys.modules:
        return None  # triton's first import will follow the environment
    from triton.language import standard
    from triton.runtime.interpreter import InterpretedFunction

    if isinstance(standard.sum, InterpretedFunction) != interpreting():
        return ("TRITON_INTERPRET changed after triton was imported: set TRITON_INTERPRET=1 before the first "
                "`import triton` (triton builds its own tl.sum/tl.max for one mode at import time)")
    return None


def load_kernels() -> ModuleType:
    """The kernels module, after checking triton was imported in the mode the environment asks for."""
    import triton  # noqa: F401  (imported here, in the mode the environment asks for, before the check)

    reason = mode_mismatch()
    if reason:
        raise RuntimeError(reason)
    return importlib.import_module(f"{__package__}.kernels")


class Launch(NamedTuple):
    """One kernel launch: which kernel, its grid, every argument by name, and the compile options."""

    kernel: str  # name of the @triton.jit function in kernels.py
    grid: tuple[int, ...]
    args: dict[str, Any]
    num_warps: int
    num_stages: int

    def __call__(self) -> None:
        if 0 in self.grid:
            return
        fn = getattr(load_kernels(), self.kernel)
        fn[self.grid](**self.args, num_warps=self.num_warps, num_stages=self.num_stages)


# ---------------------------------------------------------------- argument lists (one per kernel)


def attention_launch(q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, o_part: Tensor, lse_part: Tensor,
                     requests: Tensor, work: Tensor, counts: Tensor, tree_order: Tensor, page_indices: Tensor,
                     row_positions: Tensor, node_depths: Tensor, sinks: Tensor | None, *, sm_scale: float,
                     softcap: float, window: int, page_size: int, tiles: TileConfig, grid_work: int) -> Launch:
    """``tree_attn_kernel`` over ``grid_work`` work items. ``k``/``v`` are ragged ``[L, h_kv, d]``
    (``page_size`` 0) or logical pages ``[P, page_size, h_kv, d]`` (``PagedKV.k``/``.v``), any strides; ``v``
    may have a head dim of its own (and be a view of ``k``). ``softcap``/``window`` 0: not used."""
    if k.stride(-1) != 1:
        raise ValueError(f"the Triton kernels read each key's head dims contiguous; K has strides {k.stride()} "
                         "(dims-major pages, as vLLM's CPU cache): use a CPU backend for it")
    if page_size:
        (kp, kt, kh), (vp, vt, vh) = PagedKV.strides(k), PagedKV.strides(v)
    else:
        (kp, kt, kh), (vp, vt, vh) = (0, k.stride(0), k.stride(1)), (0, v.stride(0), v.stride(1))
    num_q_heads, num_kv_heads = q.shape[1], k.shape[-2]
    # Scores go to log2 units: s * log2(e); soft-capped, c * tanh(s / c) * log2(e) with s = dot * sm_scale.
    qk_scale, cap_scale = (softcap * LOG2E, sm_scale / softcap) if softcap else (sm_scale * LOG2E, 1.0)
    args = dict(
        q_ptr=q, k_ptr=k, v_ptr=v, out_ptr=out, lse_ptr=lse, o_part_ptr=o_part, lse_part_ptr=lse_part,
        requests_ptr=requests, work_ptr=work, counts_ptr=counts, tree_order_ptr=tree_order,
        page_indices_ptr=page_indices, row_pos_ptr=row_positions, depth_ptr=node_depths,
        sinks_ptr=lse if sinks is None else sinks,  # any fp32 pointer when unused
        qk_scale=qk_scale, cap_scale=cap_scale, window=window, stride_qt=q.stride(0), stride_qh=q.stride(1),
        stride_kp=kp, stride_kt=kt, stride_kh=kh, stride_vp=vp, stride_vt=vt, stride_vh=vh,
        page_log2=page_size.bit_length() - 1 if page_size else 0, num_q_heads=num_q_heads,
        group=num_q_heads // num_kv_heads,
        HEAD_DIM=q.shape[2], V_HEAD_DIM=v.shape[-1], PAGED=bool(page_size), SAME_KV_STRIDES=(kp, kt, kh) == (vp, vt, vh),
        BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_D=tiles.block_d, BLOCK_DT=tiles.block_dt,
        BLOCK_DV=tiles.block_dv, FP32_DOT=tiles.fp32_dot, WINDOW=bool(window), SOFTCAP=bool(softcap),
        SINKS=sinks is not None)
    return Launch("tree_attn_kernel", (grid_work, num_kv_heads), args, tiles.num_warps, tiles.num_stages)


def merge_splits_launch(out: Tensor, lse: Tensor, o_part: Tensor, lse_part: Tensor, requests: Tensor,
                        token_request: Tensor, counts: Tensor, sinks: Tensor | None, *, grid_tokens: int) -> Launch:
    """``merge_splits_kernel``: each split request's chunk states (and the sinks, once) into ``out``/``lse``."""
    num_q_heads, head_dim = out.shape[1], out.shape[2]
    args = dict(out_ptr=out, lse_ptr=lse, o_part_ptr=o_part, lse_part_ptr=lse_part, requests_ptr=requests,
                token_request_ptr=token_request, counts_ptr=counts, sinks_ptr=lse if sinks is None else sinks,
                num_q_heads=num_q_heads, HEAD_DIM=head_dim, BLOCK_H=MERGE_BLOCK_H, BLOCK_D=padded_head_dim(head_dim),
                SINKS=sinks is not None)
    return Launch("merge_splits_kernel", (grid_tokens, cdiv(num_q_heads, MERGE_BLOCK_H)), args, SMALL_KERNEL_WARPS, 1)


def rope_launch(x: Tensor, positions: Tensor, freqs: Tensor, out: Tensor, *, scale: float, multiplier: float,
                divide: bool) -> Launch:
    """``rope_kernel``: ``x [L, H, d]`` (any token/head strides) rotated into contiguous ``out``."""
    rows, head_dim = x.shape[0] * x.shape[1], x.shape[2]
    args = dict(x_ptr=x, pos_ptr=positions, freq_ptr=freqs, out_ptr=out, num_rows=rows, num_heads=x.shape[1],
                stride_xt=x.stride(0), stride_xh=x.stride(1), rope_scale=scale, rope_mult=multiplier,
                HEAD_DIM=head_dim, BLOCK_R=ROPE_BLOCK_ROWS, BLOCK_D=padded_head_dim(head_dim), ROPE_DIVIDE=divide)
    return Launch("rope_kernel", (cdiv(rows, ROPE_BLOCK_ROWS),), args, SMALL_KERNEL_WARPS, 1)


def merge_state_launch(out_a: Tensor, lse_a: Tensor, out_b: Tensor, lse_b: Tensor, out: Tensor,
                       lse: Tensor) -> Launch:
    """``merge_state_kernel`` over every (row, head) pair; inputs with any row/head strides, outputs contiguous."""
    rows, heads, head_dim = out_a.shape
    args = dict(out_a_ptr=out_a, lse_a_ptr=lse_a, out_b_ptr=out_b, lse_b_ptr=lse_b, out_ptr=out, lse_ptr=lse,
                num_rows=rows, num_heads=heads, stride_an=out_a.stride(0), stride_ah=out_a.stride(1),
                stride_bn=out_b.stride(0), stride_bh=out_b.stride(1), stride_lan=lse_a.stride(0),
                stride_lah=lse_a.stride(1), stride_lbn=lse_b.stride(0), stride_lbh=lse_b.stride(1),
                HEAD_DIM=head_dim, BLOCK_R=MERGE_BLOCK_ROWS, BLOCK_D=padded_head_dim(head_dim))
    return Launch("merge_state_kernel", (cdiv(rows * heads, MERGE_BLOCK_ROWS),), args, SMALL_KERNEL_WARPS, 1)


# ---------------------------------------------------------------- the ops


@torch.library.custom_op("treeattn::triton_tree_attention", mutates_args=("out", "lse"))
def tree_attention(
    q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, sm_scale: float, page_size: int, sinks: Tensor | None,
    requests: Tensor, work: Tensor, counts: Tensor, token_request: Tensor, tree_order: Tensor, page_indices: Tensor,
    row_positions: Tensor, node_depths: Tensor, window: int, softcap: float,
    block_m: int, block_n: int, block_d: int, block_dt: int, block_dv: int, num_warps: int, num_stages: int,
    fp32_dot: bool, partial_rows: int, grid_work: int, grid_tokens: int, launch_merge: bool,
) -> None:
    """Tree attention over a work partition (its tables, sizes and variant values are
    ``WorkPartition.op_args``), then the merge of split requests. ``k``/``v`` as in ``attention_launch``;
    ``sinks`` float32 ``[h_q]`` or None."""
    if launch_merge:  # per run, not in the shared partition: concurrent runs must not share a workspace
        o_part = torch.empty(partial_rows, q.shape[1], block_dv, dtype=torch.float32, device=q.device)
        lse_part = torch.empty(partial_rows, q.shape[1], dtype=torch.float32, device=q.device)
    else:
        o_part = lse_part = lse  # never written (no split item); the kernel just needs fp32 pointers
    tiles = TileConfig(block_m, block_n, block_d, block_dt, block_dv, num_warps, num_stages, fp32_dot)
    attention_launch(q, k, v, out, lse, o_part, lse_part, requests, work, counts, tree_order, page_indices,
                     row_positions, node_depths, sinks, sm_scale=sm_scale, softcap=softcap, window=window,
                     page_size=page_size, tiles=tiles, grid_work=grid_work)()
    if launch_merge:
        merge_splits_launch(out, lse, o_part, lse_part, requests, token_request, counts, sinks,
                            grid_tokens=grid_tokens)()


@tree_attention.register_fake
def _(*args, **kwargs) -> None:
    return None


@torch.library.custom_op("treeattn::triton_rope", mutates_args=("out",))
def rope(x: Tensor, positions: Tensor, freqs: Tensor, out: Tensor, scale: float, multiplier: float,
         divide: bool) -> None:
    """TVM-formula rotate-half RoPE of ``x [L, H, d]`` into ``out`` (``freqs`` from ``RoPE.frequencies``)."""
    rope_launch(x, positions, freqs, out, scale=scale, multiplier=multiplier, divide=divide)()


@rope.register_fake
def _(*args, **kwargs) -> None:
    return None


@torch.library.custom_op("treeattn::triton_merge_state", mutates_args=("out", "lse"))
def merge_state(out_a: Tensor, lse_a: Tensor, out_b: Tensor, lse_b: Tensor, out: Tensor, lse: Tensor) -> None:
    """Base-2 LSE merge of two partial attention states into ``out``/``lse``."""
    merge_state_launch(out_a, lse_a, out_b, lse_b, out, lse)()


@merge_state.register_fake
def _(*args, **kwargs) -> None:
    return None
