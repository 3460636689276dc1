"""The float64 reference against a naive per-row computation that walks parent pointers."""

import math

import pytest
import torch

import treeattn
from tests.helpers import MIXED, Request, binary, make_batch, outputs_for


def naive(batch, sm_scale):
    """Row by row: keys visible to a node = prefix + ancestors found by walking parents."""
    q, k, v = batch.q.double(), batch.k.double(), batch.v.double()
    group = q.shape[1] // k.shape[1]
    out = torch.zeros_like(q)
    lse = torch.full(q.shape[:2], -5e4, dtype=torch.float64)
    qs = ks = 0
    for r in batch.requests:
        for row in range(r.rows):
            node = row + r.n - r.rows
            cols = list(range(r.prefix))
            u = node if r.n else -1
            while u >= 0:
                cols.append(r.prefix + u)
                u = r.parents[u]
            if not r.n:
                cols = list(range(r.kv))
            for h in range(q.shape[1]):
                if not cols:
                    continue
                kk, vv = k[ks + torch.tensor(cols), h // group], v[ks + torch.tensor(cols), h // group]
                s = kk @ q[qs + row, h] * sm_scale
                p = torch.softmax(s, 0)
                out[qs + row, h] = p @ vv
                lse[qs + row, h] = torch.logsumexp(s, 0) / math.log(2)
        qs += r.rows
        ks += r.kv
    return out, lse


@pytest.mark.parametrize("sm_scale", [None, 0.05, 1.0])
def test_reference_matches_naive_walk(sm_scale):
    batch = make_batch(MIXED, h_q=4, h_kv=2, d=16, seed=3)
    out, lse = outputs_for(batch.q)
    treeattn.tree_attention(*batch.ragged_args(), sm_scale=sm_scale, out=out, lse=lse, backend="reference")
    exp_out, exp_lse = naive(batch, sm_scale or 16 ** -0.5)
    rows_with_queries = ~torch.isnan(lse)  # qo 0 requests have no rows; every real row must be written
    assert rows_with_queries.all()
    torch.testing.assert_close(out.double(), exp_out.float().double(), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(lse.double(), exp_lse.float().double(), atol=1e-5, rtol=1e-6)


def test_reference_paged_equals_ragged():
    batch = make_batch(MIXED, h_q=4, h_kv=2, d=16, seed=4, page_size=4)
    ragged = treeattn.tree_attention(*batch.ragged_args(), backend="reference")
    paged = treeattn.paged_tree_attention(*batch.paged_args(), backend="reference")
    torch.testing.assert_close(paged[0], ragged[0], atol=1e-6, rtol=0)
    torch.testing.assert_close(paged[1], ragged[1], atol=1e-6, rtol=0)


def test_reference_merge_with_empty_side_is_identity():
    gen = torch.Generator().manual_seed(0)
    o = torch.randn(5, 3, 8, generator=gen)
    lse_a = torch.randn(5, 3, generator=gen) * 4
    out, lse = treeattn.merge_state(o, lse_a, torch.randn(5, 3, 8, generator=gen), torch.full((5, 3), -5e4),
                                    backend="reference")
    torch.testing.assert_close(out, o)
    torch.testing.assert_close(lse, lse_a)


def test_reference_rope_rotates_before_attending():
    batch = make_batch([Request(binary(7), prefix=0)], h_q=2, h_kv=1, d=16, seed=5)
    rope = treeattn.RoPE(10000.0)
    pos = treeattn.TokenTree(binary(7)).positions(40)
    got = treeattn.tree_attention(*batch.ragged_args(), rope=rope, q_positions=pos, backend="reference")
    q, k = rope.apply(batch.q, pos), rope.apply(batch.k, pos)
    want = treeattn.tree_attention(q, batch.q_indptr, k, batch.v, batch.kv_indptr, batch.tree_indptr,
                                   batch.tree_order, backend="reference")
    torch.testing.assert_close(got[0], want[0])
    assert not torch.allclose(got[0], treeattn.tree_attention(*batch.ragged_args(), backend="reference")[0])
