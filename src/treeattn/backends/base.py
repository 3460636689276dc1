"""What a backend is: the capabilities it declares and the calls it serves.

A call is described by an ``AttentionSpec`` (device, dtype, heads, head dims, ragged or paged,
features). Each backend says whether it can serve it (``unsupported`` returns the reason it cannot,
or None), does its per-step host work once in ``plan`` (the result is cached on the
``TreeAttentionPlan`` and shared by every layer), and runs with no host work in
``tree_attention``/``paged_tree_attention``. Backends receive validated, planned inputs only. The
variants a call uses are in its spec (window and soft-cap values too, since they shape the plan);
the sinks' values come with the run (``sinks``: float32 ``[h_q]``, natural-log logits).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from ..rope import RoPE

if TYPE_CHECKING:  # pragma: no cover
    from ..layout import PagedKV
    from ..plan import TreeAttentionPlan


@dataclass(frozen=True)
class AttentionSpec:
    """Everything about a call that decides which backend can run it and how it plans."""

    device: torch.device
    dtype: torch.dtype
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    v_head_dim: int
    page_size: int | None = None  # None: ragged keys/values
    rope: bool = False
    sliding_window: int | None = None  # a row at position p sees keys at positions > p - sliding_window
    logit_softcap: float | None = None  # scores -> c * tanh(scores / c)
    sinks: bool = False  # one extra per-head logit in every softmax denominator

    @property
    def variants(self) -> tuple[str, ...]:
        """The attention variants this call uses, by keyword name."""
        names = []
        if self.sliding_window is not None:
            names.append("sliding_window")
        if self.logit_softcap is not None:
            names.append("logit_softcap")
        if self.sinks:
            names.append("sinks")
        return tuple(names)

    @property
    def paged(self) -> bool:
        return self.page_size is not None

    @property
    def group(self) -> int:
        return self.num_q_heads // self.num_kv_heads

    def describe(self) -> str:
        kind = f"paged (page size {self.page_size})" if self.paged else "ragged"
        dims = f"d={self.head_dim}" + (f"/{self.v_head_dim}" if self.v_head_dim != self.head_dim else "")
        extra = ", inline RoPE" if self.rope else ""
        extra += "".join(f", {name}" for name in self.variants)
        return (f"{kind} {str(self.dtype).replace('torch.', '')} on {self.device.type}, "
                f"h_q/h_kv={self.num_q_heads}/{self.num_kv_heads}, {dims}{extra}")


class Backend:
    """Base class of the backends; subclasses set ``name`` and implement the calls."""

    name: str = ""
    auto: bool = True  # may be picked by ``backend=None`` (the reference is only picked by name)

    def unavailable(self) -> str | None:
        """Why this backend cannot run at all in this process (a missing package), or None."""
        return None

    def unsupported(self, spec: AttentionSpec) -> str | None:
        """Why this backend cannot run ``spec``, or None when it can."""
        raise NotImplementedError

    def plan(self, plan: TreeAttentionPlan, spec: AttentionSpec) -> Any:
        """Per-step state for ``plan`` (work lists, device tables), built once and shared by every layer.
        It must be safe to use from several threads at once (no scratch buffers in it)."""
        return None

    def rope(self, rope: RoPE, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """``x [L, H, d]`` rotated at ``positions``, in ``x.dtype`` (TVM's inline RoPE pre-pass)."""
        return rope.apply(x, positions)

    def tree_attention(self, q, k, v, plan: TreeAttentionPlan, state: Any, *, sm_scale: float,
                       out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor | None = None) -> None:
        raise NotImplementedError

    def paged_tree_attention(self, q, kv: PagedKV, plan: TreeAttentionPlan, state: Any, *, sm_scale: float,
                             out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor | None = None) -> None:
        raise NotImplementedError

    def merge_state(self, out_a, lse_a, out_b, lse_b, *, out: torch.Tensor, lse: torch.Tensor) -> None:
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"<treeattn backend {self.name!r}>"
