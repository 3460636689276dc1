"""Every validation rule raises a clear error that names the offending argument."""

import re

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import treeattn
from tests.helpers import MIXED, Request, binary, chain, make_batch, parent_arrays
from treeattn.plan import check_tree_order

BATCH = make_batch(MIXED, h_q=4, h_kv=2, d=16, seed=0, page_size=4)


def ragged(**changes):
    args = dict(zip(["q", "q_indptr", "k", "v", "kv_indptr", "tree_indptr", "tree_order"], BATCH.ragged_args()))
    kwargs = {k: changes.pop(k) for k in list(changes) if k not in args}
    args.update(changes)
    kwargs.setdefault("backend", "reference")
    return treeattn.tree_attention(*args.values(), **kwargs)


def paged(**changes):
    names = ["q", "q_indptr", "kv_pages", "page_indptr", "page_indices", "last_page_len", "tree_indptr", "tree_order"]
    args = dict(zip(names, BATCH.paged_args()))
    kwargs = {k: changes.pop(k) for k in list(changes) if k not in args}
    args.update(changes)
    kwargs.setdefault("backend", "reference")
    return treeattn.paged_tree_attention(*args.values(), **kwargs)


def i32(*xs):
    return torch.tensor(xs, dtype=torch.int32)


q, k = BATCH.q, BATCH.k

RAGGED_ERRORS = [
    (dict(q=q.numpy()), TypeError, "q must be a torch.Tensor"),
    (dict(q=q.to(torch.int32)), TypeError, "q must be float16, bfloat16 or float32"),
    (dict(q=q[0]), ValueError, "q must be 3-D"),
    (dict(k=k.half()), TypeError, "k has dtype torch.float16, expected torch.float32"),
    (dict(v=BATCH.v[:-1]), ValueError, "k and v must have the same \\[keys, heads\\]"),
    (dict(k=k.to("meta")), ValueError, "k is on meta"),
    (dict(q=q.transpose(1, 2).contiguous().transpose(1, 2)), ValueError, "q must have a contiguous last dimension"),
    (dict(q=torch.randn(q.shape[0], 3, 16), ), ValueError, "multiple of k's 2 KV heads"),
    (dict(k=torch.randn(k.shape[0], 2, 8), v=torch.randn(k.shape[0], 2, 8)), ValueError, "head dim 16 but k has head dim 8"),
    (dict(q_indptr=BATCH.q_indptr.float()), TypeError, "q_indptr must be an int32 tensor"),
    (dict(q_indptr=BATCH.q_indptr[None]), ValueError, "q_indptr must be 1-D"),
    (dict(kv_indptr=BATCH.kv_indptr[:-1]), ValueError, "kv_indptr has length 8, expected batch_size \\+ 1 = 9"),
    (dict(q_indptr=BATCH.q_indptr + 1), ValueError, r"q_indptr\[0\] must be 0"),
    (dict(kv_indptr=i32(0, 20, 10, *BATCH.kv_indptr[3:].tolist())), ValueError, "kv_indptr must be non-decreasing"),
    (dict(q_indptr=BATCH.q_indptr.clone().index_fill_(0, torch.tensor([8]), 1000)), ValueError,
     r"q_indptr\[-1\] = 1000 must equal q.shape\[0\]"),
    (dict(tree_order=BATCH.tree_order[:, :1]), ValueError, r"tree_order must have shape \[N, 2\]"),
    (dict(tree_order=BATCH.tree_order[:-1]), ValueError, r"tree_indptr\[-1\] = .* must equal tree_order.shape\[0\]"),
    (dict(sm_scale=torch.tensor(0.1)), TypeError, "sm_scale must be a real number, got Tensor"),
    (dict(sm_scale=-1.0), ValueError, "sm_scale must be finite and > 0"),
    (dict(sm_scale=True), TypeError, "sm_scale must be a real number, got bool"),
    (dict(q_indptr=[0, 7.5, *BATCH.q_indptr[2:].tolist()]), TypeError, "q_indptr must hold integers, got float64"),
    (dict(sm_scale=float("nan")), ValueError, "sm_scale must be finite and > 0"),
    (dict(rope="llama"), TypeError, "rope must be a treeattn.RoPE"),
    (dict(rope=treeattn.RoPE()), ValueError, "rope needs q_positions"),
    (dict(q_positions=torch.zeros(q.shape[0], dtype=torch.int32)), ValueError, "only used with rope"),
    (dict(rope=treeattn.RoPE(), q_positions=torch.zeros(q.shape[0], dtype=torch.int32)), ValueError,
     "k_positions is required with rope unless kv_indptr == q_indptr"),
    (dict(rope=treeattn.RoPE(), q_positions=torch.zeros(3, dtype=torch.int32),
          k_positions=torch.zeros(k.shape[0], dtype=torch.int32)), ValueError, r"q_positions must have shape \[41\], got \(3,\)"),
    (dict(rope=treeattn.RoPE(), q_positions=torch.full((q.shape[0],), -1, dtype=torch.int32),
          k_positions=torch.zeros(k.shape[0], dtype=torch.int32)), ValueError, "q_positions must be non-negative"),
    (dict(out=torch.empty(3, 4, 16)), ValueError, "out must be a contiguous tensor of shape"),
    (dict(out=torch.empty_like(q).half()), TypeError, "out has dtype torch.float16"),
    (dict(lse=torch.empty(q.shape[:2], dtype=torch.float64)), TypeError, "lse must be a float32 tensor"),
    (dict(lse=torch.empty(q.shape[1], q.shape[0]).t()), ValueError, "lse must be a contiguous tensor"),
    (dict(backend="cuda"), ValueError, "backend must be one of"),
]


@pytest.mark.parametrize("changes,exc,message", RAGGED_ERRORS)
def test_ragged_argument_errors(changes, exc, message):
    with pytest.raises(exc, match=message):
        ragged(**changes)


def _single(parents, prefix, qo=None, **kw):
    return make_batch([Request(parents, prefix=prefix, qo=qo)], h_q=2, h_kv=1, d=8, **kw)


def test_rope_needs_an_even_head_dim():
    q, k = torch.randn(3, 2, 7), torch.randn(3, 1, 7)
    tree_indptr, tree_order = treeattn.pack_trees([binary(3)])
    with pytest.raises(ValueError, match="rope needs an even head dim, got 7"):
        treeattn.tree_attention(q, i32(0, 3), k, k, i32(0, 3), tree_indptr, tree_order, rope=treeattn.RoPE(),
                                q_positions=i32(0, 1, 1))


def test_query_rows_must_not_exceed_tree_and_tree_must_fit_in_kv():
    b = _single(binary(7), prefix=3)
    with pytest.raises(ValueError, match="request 0: need qo_len <= tree size <= kv_len.*qo_len=9, tree size=7"):
        treeattn.tree_attention(torch.randn(9, 2, 8), i32(0, 9), b.k, b.v, b.kv_indptr, b.tree_indptr, b.tree_order)
    with pytest.raises(ValueError, match="tree size=7, kv_len=5"):
        treeattn.tree_attention(b.q, b.q_indptr, b.k[:5], b.v[:5], i32(0, 5), b.tree_indptr, b.tree_order)


@pytest.mark.parametrize("order,message", [
    ([[0, 3], [0, 2], [2, 3]], "permutation"),
    ([[0, 3], [1, 1], [2, 3]], "enter < exit"),
    ([[0, 3], [1, 4], [2, 3]], "enter < exit <= tree size"),
    ([[0, 2], [1, 3], [2, 3]], "overlap without nesting"),
])
def test_inconsistent_tree_order_is_rejected(order, message):
    b = _single(chain(3), prefix=2)
    with pytest.raises(ValueError, match=r"tree_order\[0:3\] \(request 0\): .*" + message):
        treeattn.tree_attention(b.q, b.q_indptr, b.k, b.v, b.kv_indptr, b.tree_indptr, i32(*order).reshape(-1, 2))


def _is_dfs_order(order) -> bool:
    """The definition, pair by pair: enters a permutation, enter < exit <= n, no crossing intervals."""
    n = len(order)
    if sorted(e for e, _ in order) != list(range(n)) or any(not e < x <= n for e, x in order):
        return False
    return not any(ei < ej < xi < xj for ei, xi in order for ej, xj in order)


@settings(max_examples=300, deadline=None)
@given(st.lists(parent_arrays(max_size=10), min_size=1, max_size=4), st.data())
def test_batched_tree_order_check_matches_the_definition(trees, data):
    """The batch-vectorised check accepts exactly the valid trees and names an invalid request."""
    indptr, order = treeattn.pack_trees(trees)
    order = order.numpy().astype(np.int64)
    for _ in range(data.draw(st.integers(0, 2))):  # perturb some entries (often into another valid order)
        order[data.draw(st.integers(0, len(order) - 1)), data.draw(st.integers(0, 1))] += data.draw(st.integers(-2, 2))
    bounds = indptr.numpy().astype(np.int64)
    invalid = [b for b in range(len(trees)) if not _is_dfs_order(order[bounds[b]:bounds[b + 1]].tolist())]
    if not invalid:
        check_tree_order(order, bounds[:-1], np.diff(bounds))
        return
    with pytest.raises(ValueError, match="not a DFS|permutation|enter < exit") as err:
        check_tree_order(order, bounds[:-1], np.diff(bounds))
    assert int(re.search(r"\(request (\d+)\)", str(err.value)).group(1)) in invalid


def test_int64_index_arrays_are_accepted():
    out, _ = ragged(q_indptr=BATCH.q_indptr.long(), kv_indptr=BATCH.kv_indptr.long(), tree_order=BATCH.tree_order.long())
    ref, _ = ragged()
    torch.testing.assert_close(out, ref)


pages = BATCH.extra["kv_pages"]
PAGED_ERRORS = [
    (dict(kv_pages=pages[:, :1]), ValueError, r"kv_pages must have shape \[num_pages, 2, h_kv, page_size, d\]"),
    (dict(kv_pages=pages.transpose(3, 4).contiguous().transpose(3, 4)), ValueError, "kv_pages must have a contiguous last"),
    (dict(kv_pages=pages.half()), TypeError, "kv_pages has dtype torch.float16"),
    (dict(page_indices=BATCH.extra["page_indices"].clone().fill_(pages.shape[0])), ValueError,
     r"page_indices\[0\] = \d+ is out of range for kv_pages with \d+ pages"),
    (dict(page_indices=BATCH.extra["page_indices"].clone().fill_(-1)), ValueError, "is out of range"),
    (dict(last_page_len=BATCH.extra["last_page_len"][:-1]), ValueError, "last_page_len has length 7, expected batch_size = 8"),
    (dict(last_page_len=BATCH.extra["last_page_len"].clone().fill_(5)), ValueError, r"last_page_len\[0\] = 5 must be in \[1, 4\]"),
    (dict(page_indptr=BATCH.extra["page_indptr"][:-1]), ValueError, "page_indptr has length 8"),
    (dict(q=q[:, :3]), ValueError, "multiple of kv_pages's 2 KV heads"),
]


@pytest.mark.parametrize("changes,exc,message", PAGED_ERRORS)
def test_paged_argument_errors(changes, exc, message):
    with pytest.raises(exc, match=message):
        paged(**changes)


def test_reused_plan_must_fit_the_pages_it_reads():
    e = BATCH.extra
    plan = treeattn.TreeAttentionPlan.paged(BATCH.q_indptr, e["page_indptr"], e["page_indices"], e["last_page_len"],
                                            BATCH.tree_indptr, BATCH.tree_order, page_size=4,
                                            num_pages=pages.shape[0], total_q=q.shape[0])
    largest = int(e["page_indices"].max())
    with pytest.raises(ValueError, match=f"plan uses page id {largest}, but kv_pages has only {largest} pages"):
        paged(kv_pages=pages[:largest].contiguous(), plan=plan)
    out, _ = paged(plan=plan)
    torch.testing.assert_close(out, paged()[0])


def test_plan_from_host_arrays_equals_plan_from_tensors():
    """The KV cache plans from numpy arrays (validated on the host, uploaded once)."""
    e = BATCH.extra
    args = [BATCH.q_indptr, e["page_indptr"], e["page_indices"], e["last_page_len"], BATCH.tree_indptr, BATCH.tree_order]
    from_tensors = treeattn.TreeAttentionPlan.paged(*args, page_size=4, num_pages=pages.shape[0])
    from_host = treeattn.TreeAttentionPlan.paged(*(a.numpy() for a in args), page_size=4, num_pages=pages.shape[0])
    for name in ("q_indptr", "page_indptr", "page_indices", "last_page_len", "tree_indptr", "tree_order"):
        got, want = getattr(from_host, name), getattr(from_tensors, name)
        assert got.dtype == torch.int32 and torch.equal(got, want), name
    for name in ("kv_lens", "tree_sizes", "page_indices_host", "qo_lens"):
        np.testing.assert_array_equal(getattr(from_host, name), getattr(from_tensors, name))
    assert from_host.page_id_bound == from_tensors.page_id_bound == int(e["page_indices"].max()) + 1
    with pytest.raises(ValueError, match="last_page_len must be 1-D"):
        treeattn.TreeAttentionPlan.paged(*(a.numpy() for a in args[:3]), np.zeros((8, 1), np.int32), *args[4:],
                                         page_size=4, num_pages=pages.shape[0])


def test_request_without_pages_must_have_last_page_len_zero():
    last = BATCH.extra["last_page_len"].clone()
    last[5] = 1  # request 5 has no keys, hence no pages
    with pytest.raises(ValueError, match=r"last_page_len\[5\] = 1 must be in \[0, 0\] for a request with 0 pages"):
        paged(last_page_len=last)


def test_plan_of_the_wrong_kind_or_batch_is_rejected():
    plan = treeattn.TreeAttentionPlan.ragged(BATCH.q_indptr, BATCH.kv_indptr, BATCH.tree_indptr, BATCH.tree_order)
    with pytest.raises(TypeError, match="TreeAttentionPlan.paged"):
        paged(plan=plan)
    with pytest.raises(ValueError, match="plan was built for a different batch"):
        treeattn.tree_attention(q[:-1], BATCH.q_indptr, k, BATCH.v, BATCH.kv_indptr, BATCH.tree_indptr,
                                BATCH.tree_order, plan=plan)


def test_merge_state_errors():
    o, o_lse = torch.randn(4, 2, 8), torch.randn(4, 2)
    with pytest.raises(ValueError, match="out_a and out_b must have the same shape"):
        treeattn.merge_state(o, o_lse, o[:3], o_lse[:3])
    with pytest.raises(TypeError, match="lse_b must be a float32 tensor"):
        treeattn.merge_state(o, o_lse, o, o_lse.double())
    with pytest.raises(ValueError, match=r"lse_a must have shape \(4, 2\)"):
        treeattn.merge_state(o, o_lse[:, :1], o, o_lse)
    with pytest.raises(TypeError, match="out_b has dtype torch.float16"):
        treeattn.merge_state(o, o_lse, o.half(), o_lse)
