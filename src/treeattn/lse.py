"""The attention-state convention shared by every backend: base-2 log-sum-exp, and "no keys".

A partial attention result over a key set is ``(out, lse)`` with ``lse = log2(sum_j exp(s_j))`` of
the ``sm_scale``-scaled scores (TVM's and FlashInfer's base 2). A row with no visible keys has
``out = 0`` and ``lse = EMPTY_LSE``; merges give such a part zero weight.
"""

import math

import torch

EMPTY_LSE = -5e4  # LSE of a row with no keys (TVM's value)
LOG2E = 1.0 / math.log(2.0)  # scores times LOG2E: natural-log softmax in the base-2 domain


def is_empty(lse):
    """Parts with no keys: TVM's sentinel, or ``-inf`` (FlashInfer's and the natural "no mass")."""
    return (lse == EMPTY_LSE) | (lse == float("-inf"))


def merge(out_a, lse_a, out_b, lse_b, compute_dtype):
    """Softmax-weighted merge of two partial results over disjoint key sets, computed in ``compute_dtype``.

    Weights are ``2 ** (lse - max)`` over the parts that have keys; an empty part gets weight 0
    whatever the other part's LSE (a real LSE may lie below the sentinel), and two empty parts give
    ``out = 0, lse = EMPTY_LSE``. Returns ``(out, lse)`` in ``compute_dtype``.
    """
    la, lb = lse_a.to(compute_dtype), lse_b.to(compute_dtype)
    empty_a, empty_b = is_empty(lse_a), is_empty(lse_b)
    neg_inf = torch.tensor(float("-inf"), dtype=compute_dtype, device=la.device)
    m = torch.maximum(torch.where(empty_a, neg_inf, la), torch.where(empty_b, neg_inf, lb))
    m = torch.where(empty_a & empty_b, 0.0, m)
    wa = torch.where(empty_a, 0.0, torch.exp2(la - m))
    wb = torch.where(empty_b, 0.0, torch.exp2(lb - m))
    total = wa + wb
    none = total == 0
    scale = torch.where(none, 0.0, 1.0 / torch.where(none, 1.0, total))
    wa, wb = (wa * scale)[..., None], (wb * scale)[..., None]
    out = (torch.where(wa > 0, out_a.to(compute_dtype) * wa, 0.0)
           + torch.where(wb > 0, out_b.to(compute_dtype) * wb, 0.0))
    lse = torch.where(none, EMPTY_LSE, torch.log2(torch.where(none, 1.0, total)) + m)
    return out, lse
