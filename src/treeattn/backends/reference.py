"""The readable spec: dense float64 tree attention, one request at a time.

Slow on purpose; every other backend is tested against this one. Inputs are already validated and
planned (``ops.py``); RoPE, when asked for, is applied first exactly as the kernels do (fp32, then
rounded to the storage dtype), and everything after that is float64.
"""

from __future__ import annotations

import math

import torch

from .plan import TreeAttentionPlan
from .rope import RoPE
from .tree import ancestor_mask

EMPTY_LSE = -5e4  # LSE of a request with no keys: a merge gives it zero weight
LOG2E = 1.0 / math.log(2.0)


def visible_mask(plan: TreeAttentionPlan, b: int) -> torch.Tensor:
    """``bool [qo_len, kv_len]``: the whole prefix, plus ancestors-or-self inside the tree."""
    qo, kv, n = int(plan.qo_lens[b]), int(plan.kv_lens[b]), int(plan.tree_sizes[b])
    mask = torch.ones(qo, kv, dtype=torch.bool)
    if n:
        start = int(plan.tree_starts[b])
        tree = ancestor_mask(plan.tree_order[start:start + n].cpu())
        mask[:, kv - n:] = tree[n - qo:]  # query rows are the last qo nodes
    return mask


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, sm_scale: float):
    """q [T, h_q, d], k/v [L, h_kv, d] (float64), mask [T, L] -> out [T, h_q, d], lse [T, h_q] (base 2)."""
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    scores = torch.einsum("thd,lhd->htl", q, k) * sm_scale
    scores = scores.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # natural log, [h, T]
    p = torch.exp(scores - lse[..., None])
    out = torch.einsum("htl,lhd->thd", p, v)
    return out, (lse * LOG2E).transpose(0, 1)


def _write(out, lse, rows: slice, o: torch.Tensor | None, l: torch.Tensor | None) -> None:
    if o is None:  # no keys at all
        out[rows] = 0
        lse[rows] = EMPTY_LSE
    else:
        out[rows] = o.to(out.dtype)
        lse[rows] = l.to(lse.dtype)


def tree_attention(q, k, v, plan: TreeAttentionPlan, *, sm_scale: float, rope: RoPE | None,
                   q_positions, k_positions, out: torch.Tensor, lse: torch.Tensor) -> None:
    if rope is not None:
        q = rope.apply(q, q_positions)
        k = rope.apply(k, k_positions)
    q, k, v = q.double().cpu(), k.double().cpu(), v.double().cpu()
    for b in range(plan.batch_size):
        qs, qo = int(plan.q_starts[b]), int(plan.qo_lens[b])
        ks, kv = int(plan.kv_starts[b]), int(plan.kv_lens[b])
        if qo == 0:
            continue
        rows = slice(qs, qs + qo)
        if kv == 0:
            _write(out, lse, rows, None, None)
            continue
        o, l = _attend(q[rows], k[ks:ks + kv], v[ks:ks + kv], visible_mask(plan, b), sm_scale)
        _write(out, lse, rows, o.to(out.device), l.to(lse.device))


def gather_pages(kv_pages: torch.Tensor, plan: TreeAttentionPlan, b: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Request ``b``'s logical ``k, v [kv_len, h_kv, d]`` read from its pages in order."""
    start, count = int(plan.page_starts[b]), int(plan.num_pages[b])
    ids = torch.as_tensor(plan.page_indices_host[start:start + count], device=kv_pages.device)
    pages = kv_pages[ids]  # [np, 2, h_kv, ps, d]
    kv = pages.permute(1, 0, 3, 2, 4).reshape(2, -1, kv_pages.shape[2], kv_pages.shape[4])
    length = int(plan.kv_lens[b])
    return kv[0, :length], kv[1, :length]


def paged_tree_attention(q, kv_pages, plan: TreeAttentionPlan, *, sm_scale: float, out: torch.Tensor,
                         lse: torch.Tensor) -> None:
    q = q.double().cpu()
    for b in range(plan.batch_size):
        qs, qo, kv = int(plan.q_starts[b]), int(plan.qo_lens[b]), int(plan.kv_lens[b])
        if qo == 0:
            continue
        rows = slice(qs, qs + qo)
        if kv == 0:
            _write(out, lse, rows, None, None)
            continue
        k, v = gather_pages(kv_pages, plan, b)
        o, l = _attend(q[rows], k.double().cpu(), v.double().cpu(), visible_mask(plan, b), sm_scale)
        _write(out, lse, rows, o.to(out.device), l.to(lse.device))


def merge_state(out_a, lse_a, out_b, lse_b, *, out: torch.Tensor, lse: torch.Tensor) -> None:
    """Softmax-weighted merge of two partial results over disjoint key sets (base-2 LSEs)."""
    la, lb = lse_a.double(), lse_b.double()
    m = torch.maximum(la, lb)
    wa, wb = torch.exp2(la - m), torch.exp2(lb - m)
    total = wa + wb
    merged = (out_a.double() * (wa / total)[..., None] + out_b.double() * (wb / total)[..., None])
    out.copy_(merged.to(out.dtype))
    lse.copy_((torch.log2(total) + m).to(lse.dtype))
