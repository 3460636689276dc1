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


def visible_mask(plan: TreeAttentionPlan, b: int) -> torch.Tensor:
    """``bool [qo_len, kv_len]``: the whole prefix, plus ancestors-or-self inside the tree."""
    qo, kv, n = int(plan.qo_lens[b]), int(plan.kv_lens[b]), int(plan.tree_sizes[b])
    mask = torch.ones(qo, kv, dtype=torch.bool)
    if n:
        start = int(plan.tree_starts[b])
        tree = ancestor_mask(plan.tree_order[start:start + n].cpu())
        mask[:, kv - n:] = tree[n - qo:]  # query rows are the last qo nodes
    return mask


def masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor, sm_scale: float):
    """``q [T, h_q, d]`` over ``k [L, h_kv, d]``, ``v [L, h_kv, d_v]`` where ``visible [T, L]``, in the
    dtype of the inputs. Returns ``out [T, h_q, d_v]`` and the base-2 ``lse [T, h_q]``; every row sees
    at least one key. A non-finite value in a visible key makes the affected outputs NaN (as the
    formula would); one in an invisible key has no effect."""
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    scores = torch.einsum("thd,lhd->htl", q, k) * sm_scale
    scores = scores.masked_fill(~visible, float("-inf"))  # replaces, so a NaN score of a hidden key goes too
    lse = torch.logsumexp(scores, dim=-1)  # natural log, [h, T]
    p = torch.exp(scores - lse[..., None])
    finite = torch.isfinite(v)
    out = torch.einsum("htl,lhd->thd", p, torch.where(finite, v, 0.0))
    if not bool(finite.all()):
        seen_bad = torch.einsum("tl,lhd->thd", visible.to(v.dtype), (~finite).to(v.dtype)) > 0
        out = out.masked_fill(seen_bad, float("nan"))
    return out, (lse * LOG2E).transpose(0, 1)


def _write(out, lse, rows: slice, o: torch.Tensor | None, l: torch.Tensor | None) -> None:
    if o is None:  # no keys at all
        out[rows] = 0
        lse[rows] = EMPTY_LSE
    else:
        out[rows] = o.to(out.dtype)
        lse[rows] = l.to(lse.dtype)


class ReferenceBackend(Backend):
    """float64 dense tree attention: the spec in code, for every device, dtype and layout."""

    name = "reference"
    auto = False

    def unsupported(self, spec: AttentionSpec) -> str | None:
        return "meta tensors hold no values to attend over" if spec.device.type == "meta" else None

    def _run(self, q, fetch, plan: TreeAttentionPlan, sm_scale: float, out, lse) -> None:
        q = q.double().cpu()
        for b in range(plan.batch_size):
            qs, qo, kv = int(plan.q_starts[b]), int(plan.qo_lens[b]), int(plan.kv_lens[b])
            if qo == 0:
                continue
            rows = slice(qs, qs + qo)
            if kv == 0:
                _write(out, lse, rows, None, None)
                continue
            k, v = fetch(b)
            o, l = masked_attention(q[rows], k.double().cpu(), v.double().cpu(), visible_mask(plan, b), sm_scale)
            _write(out, lse, rows, o.to(out.device), l.to(lse.device))

    def tree_attention(self, q, k, v, plan, state, *, sm_scale, out, lse) -> None:
        def fetch(b: int):
            start, length = int(plan.kv_starts[b]), int(plan.kv_lens[b])
            return k[start:start + length], v[start:start + length]

        self._run(q, fetch, plan, sm_scale, out, lse)

    def paged_tree_attention(self, q, kv: PagedKV, plan, state, *, sm_scale, out, lse) -> None:
        def fetch(b: int):
            start, count = int(plan.page_starts[b]), int(plan.num_pages[b])
            return kv.gather(plan.page_indices_host[start:start + count], int(plan.kv_lens[b]))

        self._run(q, fetch, plan, sm_scale, out, lse)

    def merge_state(self, out_a, lse_a, out_b, lse_b, *, out, lse) -> None:
        o, l = merge(out_a, lse_a, out_b, lse_b, torch.float64)
        out.copy_(o.to(out.dtype))
        lse.copy_(l.to(lse.dtype))
