"""Triton backend: GPU kernels for ragged and paged tree attention, RoPE and merge_state.

Runs on CUDA tensors, or on CPU tensors through Triton's interpreter (``TRITON_INTERPRET=1``,
set before triton is imported; that is how CI tests the kernels). ``plan`` builds the work
partition once per step (``partition.py``); each call is one hop to a ``torch.library`` op whose
body launches the kernel (``launch.py``; ``torch.compile`` can trace it), with no host
synchronisation. ``GraphEnvelope`` gives fixed-size tables and grids for CUDA graphs.
"""

from __future__ import annotations

import importlib.util
from functools import lru_cache

import torch

from ...layout import PagedKV
from ...plan import TreeAttentionPlan
from ...rope import RoPE
from ..base import AttentionSpec, Backend
from . import launch  # also registers the torch.ops.treeattn.triton_* ops
from .envelope import GraphEnvelope
from .partition import MAX_HEAD_DIM, MAX_V_HEAD_DIM, WorkPartition, build_partition

__all__ = ["GraphEnvelope", "TritonBackend"]

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@lru_cache(maxsize=64)
def _frequencies(rope: RoPE, head_dim: int, device: torch.device) -> tuple[torch.Tensor, bool]:
    """RoPE's per-dim fp32 factors on ``device``, uploaded once per configuration (kept read-only)."""
    g, divide = rope.frequencies(head_dim)
    return g.to(device=device, dtype=torch.float32).contiguous(), divide


class TritonBackend(Backend):
    name = "triton"

    manual_reason = "the Triton interpreter (TRITON_INTERPRET=1) is a test tool, only used when asked for by name"

    @property
    def auto(self) -> bool:
        """Picked by ``backend=None`` except under the interpreter: a test tool, far slower than the CPU backend."""
        return not launch.interpreting()

    def unavailable(self) -> str | None:
        if importlib.util.find_spec("triton") is None:
            return "triton is not installed (pip install 'treeattn[triton]')"
        return launch.mode_mismatch()

    def unsupported(self, spec: AttentionSpec) -> str | None:
        if spec.device.type == "cpu" and not launch.interpreting():
            return "CPU tensors need Triton's interpreter: set TRITON_INTERPRET=1 before triton is imported"
        if spec.device.type not in ("cpu", "cuda"):
            return f"runs on CUDA devices (or the CPU under TRITON_INTERPRET=1), not {spec.device.type}"
        if spec.dtype not in _DTYPES:
            return f"dtype {spec.dtype} is not float16, bfloat16 or float32"
        if not 1 <= spec.head_dim <= MAX_HEAD_DIM:
            return f"head dim {spec.head_dim} is outside 1..{MAX_HEAD_DIM}"
        if not 1 <= spec.v_head_dim <= MAX_V_HEAD_DIM:
            return f"V head dim {spec.v_head_dim} is outside 1..{MAX_V_HEAD_DIM}"
        if spec.paged and spec.page_size & (spec.page_size - 1):
            return f"page size {spec.page_size} is not a power of two"
        return None

    def plan(self, plan: TreeAttentionPlan, spec: AttentionSpec, *, kv_chunk: int | None = None) -> WorkPartition:
        """The work partition (``kv_chunk`` forces the split-KV chunk length, 0: never split; for tests)."""
        return build_partition(plan, spec, kv_chunk=kv_chunk)

    def rope(self, rope: RoPE, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        freqs, divide = _frequencies(rope, x.shape[2], x.device)
        torch.ops.treeattn.triton_rope(x, positions, freqs, out, rope.scale, rope.multiplier, divide)
        return out

    def tree_attention(self, q, k, v, plan: TreeAttentionPlan, state: WorkPartition, *, sm_scale: float,
                       out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor | None = None) -> None:
        torch.ops.treeattn.triton_tree_attention(q, k, v, out, lse, sm_scale, 0, sinks, *state.op_args)

    def paged_tree_attention(self, q, kv: PagedKV, plan: TreeAttentionPlan, state: WorkPartition, *,
                             sm_scale: float, out: torch.Tensor, lse: torch.Tensor,
                             sinks: torch.Tensor | None = None) -> None:
        torch.ops.treeattn.triton_tree_attention(q, kv.k, kv.v, out, lse, sm_scale, kv.page_size, sinks,
                                                 *state.op_args)

    def merge_state(self, out_a, lse_a, out_b, lse_b, *, out: torch.Tensor, lse: torch.Tensor) -> None:
        torch.ops.treeattn.triton_merge_state(out_a, lse_a, out_b, lse_b, out, lse)
