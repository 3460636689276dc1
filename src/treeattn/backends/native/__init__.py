"""Native CPU backend: a C++ tree-attention kernel for the whole batch in one call.

The kernel (``csrc/``) vectorises over query rows: the ``T x group`` rows that read one KV head are
packed transposed, so each key and value row is read once, in place, for all of them (any ragged or
paged layout, through element strides), with fp32 accumulation and an online base-2 softmax. The
ancestor test runs only on tiles that hold tree keys, and drops invisible keys with a bit mask.
Long prefixes are split across threads when there are too few (request, head) items, and merged by
LSE inside the same call. The code path is picked by cpuid at run time (``avx2``: AVX2 + FMA + F16C;
``generic``: portable C++); ``TREEATTN_NATIVE_ISA`` or ``NativeBackend(isa=...)`` forces one.

Every attention variant runs in the kernel: a sliding window bounds each work item's keys (keys below
every row's window are never read; only the window's ragged edge, as wide as the tree is deep, is
masked); soft-capping applies a vectorised rational tanh to the scores; sinks start each row's online
softmax (a split prefix's chunks leave them out, and the merge adds them once); V may have a head dim
of its own, and MLA's absorbed form (V a view of K's first dims) reads V from the packed K tile.
"""

from __future__ import annotations

import os
from typing import NamedTuple

import numpy as np
import torch

from ..base import AttentionSpec, Backend
from .build import EXTENSION, Extension

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_MAX_GROUP = 256  # ROW_BLOCK in csrc/problem.h: a work item holds whole query tokens
_NONE = torch.zeros(0)  # an absent optional tensor (sinks, positions)
_MAX_WINDOW = 1 << 62  # larger windows (past any context) are passed as this, within int64


class _State(NamedTuple):
    """Per-plan host tables, read-only once built (safe to share between threads)."""

    meta: torch.Tensor  # int64 [7, batch]: q_starts, qo_lens, kv_starts, kv_lens, tree_starts, tree_sizes, page_starts
    order: torch.Tensor  # int32 [nodes, 2]
    pages: torch.Tensor  # int32 page ids (empty when ragged)
    window: int  # sliding window (0: none)
    softcap: float  # logit soft-cap (0: none)
    row_pos: torch.Tensor  # int64 [total_q] query rows' positions (window only; else empty)
    depths: torch.Tensor  # int64 [nodes] tree nodes' depths (window only; else empty)


class NativeBackend(Backend):
    name = "native"

    def __init__(self, isa: str | None = None, extension: Extension = EXTENSION):
        self.isa = isa if isa is not None else os.environ.get("TREEATTN_NATIVE_ISA", "")
        self.extension = extension

    def unavailable(self) -> str | None:
        return self.extension.failure()

    def isas(self) -> list[str]:
        """The kernel paths this CPU can run, best first."""
        return list(self.extension.module().isas())

    def unsupported(self, spec: AttentionSpec) -> str | None:
        if spec.device.type != "cpu":
            return f"runs on the CPU only, got {spec.device}"
        if spec.dtype not in _DTYPES:
            return f"needs float32, float16 or bfloat16, got {spec.dtype}"
        if spec.group > _MAX_GROUP:
            return f"at most {_MAX_GROUP} query heads per KV head, got {spec.group}"
        if self.isa and self.isa not in self.isas():
            return f"kernel path {self.isa!r} is not available on this CPU ({', '.join(self.isas())})"
        return None

    def plan(self, plan, spec: AttentionSpec) -> _State:
        batch = plan.batch_size
        zeros = np.zeros(batch, dtype=np.int64)
        meta = np.stack([plan.q_starts, plan.qo_lens, zeros if plan.kv_starts is None else plan.kv_starts,
                         plan.kv_lens, plan.tree_starts, plan.tree_sizes,
                         zeros if plan.page_starts is None else plan.page_starts]).astype(np.int64)
        pages = plan.page_indices if plan.page_indices is not None else torch.zeros(0, dtype=torch.int32)
        window = spec.sliding_window
        row_pos = depths = _NONE
        if window is not None:
            row_pos = torch.from_numpy(np.ascontiguousarray(plan.row_positions, dtype=np.int64))
            depths = torch.from_numpy(np.ascontiguousarray(plan.node_depths, dtype=np.int64))
        return _State(torch.from_numpy(np.ascontiguousarray(meta)), plan.tree_order.cpu().contiguous(),
                      pages.cpu().contiguous(), min(window or 0, _MAX_WINDOW), spec.logit_softcap or 0.0, row_pos,
                      depths)

    def _run(self, q, k, v, state: _State, page_size: int, sm_scale: float, out, lse, sinks) -> None:
        self.extension.module().attention(q, k, v, state.meta, state.order, state.pages, page_size, sm_scale, out,
                                          lse, self.isa, state.window, state.softcap,
                                          _NONE if sinks is None else sinks, state.row_pos, state.depths)

    def tree_attention(self, q, k, v, plan, state: _State, *, sm_scale: float, out: torch.Tensor,
                       lse: torch.Tensor, sinks: torch.Tensor | None = None) -> None:
        self._run(q, k, v, state, 0, sm_scale, out, lse, sinks)

    def paged_tree_attention(self, q, kv, plan, state: _State, *, sm_scale: float, out: torch.Tensor,
                             lse: torch.Tensor, sinks: torch.Tensor | None = None) -> None:
        self._run(q, kv.k, kv.v, state, kv.page_size, sm_scale, out, lse, sinks)

    def merge_state(self, out_a, lse_a, out_b, lse_b, *, out: torch.Tensor, lse: torch.Tensor) -> None:
        self.extension.module().merge_state(out_a, lse_a, out_b, lse_b, out, lse)
