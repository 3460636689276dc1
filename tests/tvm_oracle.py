"""Apache TVM's compiled CPU tree-attention kernels as an independent oracle.

Builds ``tree_attn_cpu``, ``tree_attn_with_paged_kv_cache_cpu`` (``tvm.relax.frontend.nn.llm.tree_attn``)
and ``_merge_state_inplace_cpu`` (``..._decode_kernels``) for ``llvm`` and runs them on torch tensors.
``rope`` wraps TVM's ``_rope`` helper (``..._kernel_common``), the expression both tree kernels inline
for ``rotary_mode == 1``, in a one-statement kernel, so rotations can be compared element by element.
Each build is cached per process, keyed by ``(kernel, h_kv, h_q, d, dtype, rope_scaling)``, because
compiling is the expensive part (about 0.2–0.3 s per variant; running is scalar loops).

Argument orders are those of TVM's compiled CPU kernels (as its wheel builds them). Every wrapper poisons the TVM outputs with NaN before
the call and returns the numpy copies of the index arrays it fed TVM (``fed``), so tests can assert
that TVM saw exactly the arrays treeattn was given. TVM's constraints the caller must respect:
page size 16, ``rope_scaling={}`` for default RoPE, inline RoPE only on the ragged kernel and only
with ``kv_indptr == q_indptr`` (K reads its position from the query position array), fp16/fp32 only.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
import tvm
from tvm.relax.frontend.nn.llm._decode_kernels import _merge_state_inplace_cpu
from tvm.relax.frontend.nn.llm._kernel_common import _rope
from tvm.relax.frontend.nn.llm.tree_attn import tree_attn_cpu, tree_attn_with_paged_kv_cache_cpu
from tvm.script import tirx as T

PAGE_SIZE = 16  # hard-coded in TVM's paged kernels
_DTYPES = {torch.float32: "float32", torch.float16: "float16"}
_BUILDERS = {"ragged": tree_attn_cpu, "paged": tree_attn_with_paged_kv_cache_cpu}


def _freeze(scaling: Mapping[str, Any]) -> tuple:
    return tuple(sorted(scaling.items()))


@functools.cache
def _attention_kernel(kind: str, h_kv: int, h_q: int, d: int, dtype: str, frozen_scaling: tuple):
    return tvm.compile(_BUILDERS[kind](h_kv, h_q, d, dtype, dict(frozen_scaling)), target="llvm")


@functools.cache
def _merge_kernel(dtype: str):
    return tvm.compile(_merge_state_inplace_cpu(dtype), target="llvm")


@functools.cache
def _rope_kernel(d: int, dtype: str, frozen_scaling: tuple):
    scaling = dict(frozen_scaling)

    @T.prim_func(s_tir=True)
    def rope(var_x: T.handle, var_pos: T.handle, var_y: T.handle, theta: T.float32, scale: T.float32):
        rows = T.int32()
        x = T.match_buffer(var_x, (rows, d), dtype)
        pos = T.match_buffer(var_pos, (rows,), "int32")
        y = T.match_buffer(var_y, (rows, d), dtype)
        for i, j in T.grid(rows, d):
            with T.sblock("rope"):
                vi, vj = T.axis.remap("SS", [i, j])
                y[vi, vj] = _rope(x, pos[vi], d, theta, scale, (vi, vj), dtype, scaling)

    return tvm.compile(rope, target="llvm")


def build_count() -> int:
    """How many distinct kernels this process has compiled so far (to keep the test file cheap)."""
    return sum(f.cache_info().currsize for f in (_attention_kernel, _merge_kernel, _rope_kernel))


def _dtype(x: torch.Tensor) -> str:
    if x.dtype not in _DTYPES:
        raise TypeError(f"TVM's CPU kernels are compared in float16/float32 only, got {x.dtype}")
    return _DTYPES[x.dtype]


def _index(x: torch.Tensor) -> np.ndarray:
    """An int32 index array exactly as given: no silent narrowing of the arrays under test."""
    if x.dtype != torch.int32:
        raise TypeError(f"index arrays must be int32 to be fed to TVM unchanged, got {x.dtype}")
    return np.ascontiguousarray(x.detach().cpu().numpy())


def _dense(x: torch.Tensor) -> np.ndarray:
    return np.ascontiguousarray(x.detach().cpu().numpy())


def _tensor(a: np.ndarray):
    return tvm.runtime.tensor(a, tvm.cpu())


def _poisoned(rows: int, h_q: int, d: int, dtype: torch.dtype):
    out = np.full((rows, h_q, d), np.nan, dtype=torch.empty(0, dtype=dtype).numpy().dtype)
    lse = np.full((rows, h_q), np.nan, dtype=np.float32)
    return _tensor(out), _tensor(lse)


def tree_attn(q, q_indptr, k, v, kv_indptr, tree_indptr, tree_order, *, sm_scale: float,
              q_positions: torch.Tensor | None = None, rope_theta: float = 1e4, rope_scale: float = 1.0,
              rope_scaling: Mapping[str, Any] | None = None):
    """TVM ``tree_attn_cpu``. Inline RoPE (``rotary_mode=1``) when ``q_positions`` is given.

    Returns ``(out, lse, fed)``: torch tensors in q's dtype / float32, and the numpy index arrays fed.
    """
    h_q, d, h_kv = q.shape[1], q.shape[2], k.shape[1]
    rotary = q_positions is not None
    fed = {"q_indptr": _index(q_indptr), "kv_indptr": _index(kv_indptr), "tree_indptr": _index(tree_indptr),
           "tree_order": _index(tree_order)}
    if rotary:
        if not np.array_equal(fed["q_indptr"], fed["kv_indptr"]):
            raise ValueError("TVM ropes K at q_rope_position[kv offset]: inline RoPE needs kv_indptr == q_indptr")
        fed["q_positions"] = _index(q_positions)
    else:  # never read with rotary_mode 0, but the buffer must match [Lq]
        fed["q_positions"] = np.zeros(q.shape[0], dtype=np.int32)
    kernel = _attention_kernel("ragged", h_kv, h_q, d, _dtype(q), _freeze(rope_scaling or {}))
    out, lse = _poisoned(q.shape[0], h_q, d, q.dtype)
    kernel(_tensor(_dense(q)), _tensor(fed["q_indptr"]), _tensor(_dense(k)), _tensor(_dense(v)),
           _tensor(fed["kv_indptr"]), _tensor(fed["q_positions"]), _tensor(fed["tree_indptr"]),
           _tensor(fed["tree_order"]), out, lse, int(rotary), float(rope_scale), float(rope_theta), float(sm_scale))
    return torch.from_numpy(out.numpy()), torch.from_numpy(lse.numpy()), fed


def paged_tree_attn(q, q_indptr, kv_pages, page_indptr, page_indices, last_page_len, tree_indptr, tree_order, *,
                    sm_scale: float):
    """TVM ``tree_attn_with_paged_kv_cache_cpu`` (no RoPE: TVM asserts ``rotary_mode == 0`` here).

    ``kv_pages [num_pages, 2, h_kv, 16, d]``. Returns ``(out, lse, fed)`` like ``tree_attn``.
    """
    h_q, d, h_kv = q.shape[1], q.shape[2], kv_pages.shape[2]
    if kv_pages.shape[3] != PAGE_SIZE:
        raise ValueError(f"TVM's paged kernel has page size {PAGE_SIZE}, got {kv_pages.shape[3]}")
    fed = {"q_indptr": _index(q_indptr), "page_indptr": _index(page_indptr), "page_indices": _index(page_indices),
           "last_page_len": _index(last_page_len), "tree_indptr": _index(tree_indptr),
           "tree_order": _index(tree_order)}
    batch = fed["last_page_len"].shape[0]
    unused_positions = np.zeros(q.shape[0], dtype=np.int32)  # RoPE arguments are dead in the paged kernel
    unused_offsets = np.zeros(batch, dtype=np.int32)
    kernel = _attention_kernel("paged", h_kv, h_q, d, _dtype(q), ())
    out, lse = _poisoned(q.shape[0], h_q, d, q.dtype)
    kernel(_tensor(_dense(q)), _tensor(fed["q_indptr"]), _tensor(_dense(kv_pages)), _tensor(fed["page_indptr"]),
           _tensor(fed["page_indices"]), _tensor(fed["last_page_len"]), _tensor(unused_offsets),
           _tensor(unused_positions), out, lse, 0, 1.0, 1e4, float(sm_scale),
           _tensor(fed["tree_indptr"]), _tensor(fed["tree_order"]))
    return torch.from_numpy(out.numpy()), torch.from_numpy(lse.numpy()), fed


def merge_state(out_a, lse_a, out_b, lse_b):
    """TVM ``_merge_state_inplace_cpu`` on copies of ``(out_a, lse_a)``. Returns ``(out, lse)``."""
    if lse_a.dtype != torch.float32 or lse_b.dtype != torch.float32:
        raise TypeError("LSEs must be float32")
    v, s = _tensor(_dense(out_a).copy()), _tensor(_dense(lse_a).copy())
    _merge_kernel(_dtype(out_a))(v, s, _tensor(_dense(out_b)), _tensor(_dense(lse_b)))
    return torch.from_numpy(v.numpy()), torch.from_numpy(s.numpy())


def rope(x, positions, *, rope_theta: float, rope_scale: float, rope_scaling: Mapping[str, Any]):
    """TVM's inline RoPE of ``x [L, H, d]`` at ``positions [L]`` (fp32 math, rounded to x's dtype)."""
    rows, heads, d = x.shape
    flat = _dense(x).reshape(rows * heads, d)
    pos = np.repeat(_index(positions), heads)
    y = _tensor(np.full_like(flat, np.nan))
    _rope_kernel(d, _dtype(x), _freeze(rope_scaling))(_tensor(flat), _tensor(pos), y, float(rope_theta),
                                                      float(rope_scale))
    return torch.from_numpy(y.numpy()).reshape(rows, heads, d)
