"""The readable spec: dense float64 tree attention, one request at a time.

Slow on purpose; every other backend is tested against this one. Inputs are already validated and
planned (``ops.py``), and RoPE, when asked for, was applied before (fp32, rounded to the dtype).
Everything here is float64 on the CPU; results are copied to the caller's device.

A row's output depends only on the keys it can see: invisible keys are left out of the sum, not
multiplied by zero, so a NaN or inf in a key a row cannot see never reaches it.
"""

from __future__ import annotations

import torch

from ..layout import PagedKV
from ..lse import EMPTY_LSE, LOG2E, merge
from ..plan import TreeAttentionPlan
from ..tree import ancestor_mask
from .base import AttentionSpec, Backend


def visible_mask(plan: TreeAttentionPlan, b: int, sliding_window: int | None = None) -> torch.Tensor:
    """``bool [qo_len, kv_len]``: the whole prefix, plus ancestors-or-self inside the tree; with a window,
    only keys at positions ``> row position - sliding_window`` (``TreeAttentionPlan.positions``)."""
    qo, kv, n = int(plan.qo_lens[b]), int(plan.kv_lens[b]), int(plan.tree_sizes[b])
    mask = torch.ones(qo, kv, dtype=torch.bool)
    if n:
        start = int(plan.tree_starts[b])
        tree = ancestor_mask(plan.tree_order[start:start + n].cpu())
        mask[:, kv - n:] = tree[n - qo:]  # query rows are the last qo nodes
    if sliding_window is not None:
        rows, keys = (torch.from_numpy(x) for x in plan.positions(b))
        mask &= keys[None, :] > rows[:, None] - sliding_window
    return mask


def masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor, sm_scale: float,
                     logit_softcap: float | None = None, sinks: torch.Tensor | None = None):
    """``q [T, h_q, d]`` over ``k [L, h_kv, d]``, ``v [L, h_kv, d_v]`` where ``visible [T, L]``, in the
    dtype of the inputs. Returns ``out [T, h_q, d_v]`` and the base-2 ``lse [T, h_q]``. Scores are
    soft-capped when asked; ``sinks [h_q]`` join every denominator as keys whose value is 0. A row
    that sees no key gets ``out = 0`` and the LSE of its sink alone (``-inf`` without one). A
    non-finite value in a visible key makes the affected outputs NaN (as the formula would); one in an
    invisible key has no effect."""
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    scores = torch.einsum("thd,lhd->htl", q, k) * sm_scale
    if logit_softcap is not None:
        scores = logit_softcap * torch.tanh(scores / logit_softcap)
    scores = scores.masked_fill(~visible, float("-inf"))  # replaces, so a NaN score of a hidden key goes too
    lse = torch.logsumexp(scores, dim=-1)  # natural log, [h, T]
    if sinks is not None:
        lse = torch.logaddexp(lse, sinks.to(lse)[:, None])
    p = torch.exp(scores - torch.where(torch.isfinite(lse), lse, 0.0)[..., None])
    finite = torch.isfinite(v)
    out = torch.einsum("htl,lhd->thd", p, torch.where(finite, v, 0.0))
    if not bool(finite.all()):
        seen_bad = torch.einsum("tl,lhd->thd", visible.to(v.dtype), (~finite).to(v.dtype)) > 0
        out = out.masked_fill(seen_bad, float("nan"))
    return out, (lse * LOG2E).transpose(0, 1)


def _write(out, lse, rows: slice, o: torch.Tensor | None, o_lse: torch.Tensor | None) -> None:
    if o is None:  # no keys at all
        out[rows] = 0
        lse[rows] = EMPTY_LSE
    else:
        out[rows] = o.to(out.dtype)
        lse[rows] = o_lse.to(lse.dtype)


class ReferenceBackend(Backend):
    """float64 dense tree attention: the spec in code, for every device, dtype and layout."""

    name = "reference"
    auto = False

    def unsupported(self, spec: AttentionSpec) -> str | None:
        return "meta tensors hold no values to attend over" if spec.device.type == "meta" else None

    def plan(self, plan: TreeAttentionPlan, spec: AttentionSpec) -> AttentionSpec:
        return spec  # what a run needs besides the plan: the variants' values

    def _run(self, q, fetch, plan: TreeAttentionPlan, spec: AttentionSpec, sm_scale: float, out, lse, sinks) -> None:
        q = q.double().cpu()
        sinks = None if sinks is None else sinks.double().cpu()
        for b in range(plan.batch_size):
            qs, qo, kv = int(plan.q_starts[b]), int(plan.qo_lens[b]), int(plan.kv_lens[b])
            if qo == 0:
                continue
            rows = slice(qs, qs + qo)
            if kv == 0 and sinks is None:
                _write(out, lse, rows, None, None)
                continue
            k, v = fetch(b)
            visible = visible_mask(plan, b, spec.sliding_window)
            o, o_lse = masked_attention(q[rows], k.double().cpu(), v.double().cpu(), visible, sm_scale,
                                        spec.logit_softcap, sinks)
            o_lse = torch.where(torch.isfinite(o_lse), o_lse, EMPTY_LSE)  # a row with no key in its window
            _write(out, lse, rows, o.to(out.device), o_lse.to(lse.device))

    def tree_attention(self, q, k, v, plan, state: AttentionSpec, *, sm_scale, out, lse, sinks=None) -> None:
        def fetch(b: int):
            start, length = int(plan.kv_starts[b]), int(plan.kv_lens[b])
            return k[start:start + length], v[start:start + length]

        self._run(q, fetch, plan, state, sm_scale, out, lse, sinks)

    def paged_tree_attention(self, q, kv: PagedKV, plan, state: AttentionSpec, *, sm_scale, out, lse,
                             sinks=None) -> None:
        def fetch(b: int):
            start, count = int(plan.page_starts[b]), int(plan.num_pages[b])
            return kv.gather(plan.page_indices_host[start:start + count], int(plan.kv_lens[b]))

        self._run(q, fetch, plan, state, sm_scale, out, lse, sinks)

    def merge_state(self, out_a, lse_a, out_b, lse_b, *, out, lse) -> None:
        merged, merged_lse = merge(out_a, lse_a, out_b, lse_b, torch.float64)
        out.copy_(merged.to(out.dtype))
        lse.copy_(merged_lse.to(lse.dtype))
