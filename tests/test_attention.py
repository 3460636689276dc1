"""Every non-reference CPU backend against the float64 reference and against independent formulas.

Inputs are fresh random tensors, outputs are NaN-poisoned buffers passed through ``out=``/``lse=``
(so a row a kernel forgets to write fails). The Triton backend has its own interpreter suite.
Budget: well under 3 minutes on 2 cores; bigger cases are marked slow.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import treeattn
from tests.helpers import (
    MIXED,
    TOL,
    Batch,
    Request,
    assert_close_to_reference,
    binary,
    chain,
    forest,
    make_batch,
    outputs_for,
    paginate,
    parent_arrays,
    poisoned,
    random_tree,
    star,
)
from treeattn.backends import AttentionSpec, available_backends, get_backend
from treeattn.lse import EMPTY_LSE

BACKENDS = [b for b in available_backends("cpu") if b not in ("reference", "triton")]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
PREFIXES = [0, 1, 15, 16, 17, 31, 32]
SHAPES = {"tree": binary(7), "forest": forest(binary(7), chain(3), [-1]), "chain": chain(10), "star": star(9),
          "deep_chain": chain(256), "single": [-1]}

pytestmark = pytest.mark.skipif(not BACKENDS, reason="no non-reference CPU backend available")


def run(batch: Batch, backend: str, *, paged: bool, **kw) -> tuple[torch.Tensor, torch.Tensor]:
    """Run ``backend`` into poisoned buffers; check it wrote in place and returned them."""
    out, lse = outputs_for(batch.q)
    fn = treeattn.paged_tree_attention if paged else treeattn.tree_attention
    args = batch.paged_args() if paged else batch.ragged_args()
    got = fn(*args, out=out, lse=lse, backend=backend, **kw)
    assert got[0] is out and got[1] is lse
    return out, lse


def check(batch: Batch, backend: str, *, paged: bool, **kw) -> None:
    out, lse = run(batch, backend, paged=paged, **kw)
    fn = treeattn.paged_tree_attention if paged else treeattn.tree_attention
    ref_out, ref_lse = fn(*(batch.paged_args() if paged else batch.ragged_args()), backend="reference", **kw)
    assert_close_to_reference(out, lse, ref_out, ref_lse, batch.q.dtype)


# ---------------------------------------------------------------- against the reference


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("paged", [False, True], ids=["ragged", "paged"])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_tree_shapes_and_prefixes(backend, paged, shape):
    """Each shape after every page-boundary prefix length, one request per prefix (one batch)."""
    requests = [Request(SHAPES[shape], prefix=p) for p in PREFIXES]
    batch = make_batch(requests, h_q=4, h_kv=2, d=32, seed=len(SHAPES[shape]), page_size=16)
    check(batch, backend, paged=paged)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("paged,page_size", [(False, None), (True, 1), (True, 16), (True, 64)],
                         ids=["ragged", "paged1", "paged16", "paged64"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_mixed_batch(backend, paged, page_size, dtype):
    """Forest, chain, star, qo < tree, no tree, no KV (out 0, lse -5e4) and qo 0 in one batch."""
    batch = make_batch(MIXED, h_q=8, h_kv=2, d=64, dtype=dtype, seed=page_size or 0, page_size=page_size)
    threads = torch.get_num_threads()
    check(batch, backend, paged=paged)
    assert torch.get_num_threads() == threads  # the backend runs its small steps on one thread, then restores
    out, lse = run(batch, backend, paged=paged)
    empty = sum(r.rows for r in MIXED[:5])  # MIXED[5]: no keys at all
    assert (out[empty:empty + 2] == 0).all() and (lse[empty:empty + 2] == EMPTY_LSE).all()


def cpu_jobs(plan, batch: Batch, threads: int):
    """The CPU backend's work list for ``plan`` (its typed per-step state, as the last run left it)."""
    spec = AttentionSpec(batch.q.device, batch.q.dtype, batch.q.shape[1], batch.k.shape[1], batch.q.shape[2],
                         batch.v.shape[2])
    return plan.state(get_backend("cpu"), spec).jobs(threads)


@pytest.fixture
def threads(request):
    """Run the test with ``request.param`` torch threads (the CPU backend picks its prefix split from it)."""
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("paged", [False, True], ids=["ragged", "paged"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("threads", [1], indirect=True)
def test_long_prefix(backend, paged, dtype, threads):
    """Long prefixes (attended in several pieces, page-unaligned cuts) before the last nodes of a tree, and
    without a tree."""
    requests = [Request(random_tree(np.random.default_rng(1), 40), prefix=8500, qo=25), Request((), prefix=4100, qo=3),
                Request(binary(7), prefix=1500)]
    batch = make_batch(requests, h_q=8, h_kv=2, d=64, dtype=dtype, seed=2, page_size=16)
    check(batch, backend, paged=paged)
    plan = treeattn.TreeAttentionPlan.ragged(batch.q_indptr, batch.kv_indptr, batch.tree_indptr, batch.tree_order)
    treeattn.tree_attention(*batch.ragged_args(), backend=backend, plan=plan)
    segments = [job.segments for job in cpu_jobs(plan, batch, threads)]
    assert [len(s) for s in segments] == [3, 2, 1]  # the multi-piece path really ran


@settings(max_examples=25, deadline=None)
@given(trees=st.lists(parent_arrays(max_size=24), min_size=1, max_size=4), prefix=st.integers(0, 40),
       seed=st.integers(0, 2**16))
def test_an_unchecked_plan_is_the_checked_one(trees, prefix, seed):
    """TreeAttentionPlan._ragged_unchecked (what a draft head's cache plans its own appends with) holds
    what ragged derives from the same arrays, and attends alike."""
    rng = np.random.default_rng(seed)
    requests = [Request(t, prefix=prefix, qo=int(rng.integers(1, len(t) + 1))) for t in trees]
    batch = make_batch(requests, h_q=4, h_kv=2, d=32, seed=seed)
    host = [x.numpy().astype(np.int64) for x in (batch.q_indptr, batch.kv_indptr, batch.tree_indptr, batch.tree_order)]
    checked = treeattn.TreeAttentionPlan.ragged(*host)
    unchecked = treeattn.TreeAttentionPlan._ragged_unchecked(*host, torch.device("cpu"))
    for name in ("q_indptr", "kv_indptr", "tree_indptr", "tree_order"):
        assert torch.equal(getattr(checked, name), getattr(unchecked, name)) and getattr(unchecked, name).dtype == torch.int32
    for name in ("q_starts", "qo_lens", "kv_lens", "tree_starts", "tree_sizes", "kv_starts"):
        assert np.array_equal(getattr(checked, name), getattr(unchecked, name)), name
    q, _, k, v, *_ = batch.ragged_args()
    expected = treeattn.tree_attention(*batch.ragged_args(), plan=checked)
    got = treeattn.tree_attention(q, None, k, v, None, None, None, plan=unchecked)
    for a, b in zip(expected, got):
        assert torch.equal(a, b)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("group", [1, 2, 4, 8])
@pytest.mark.parametrize("head_dim", [16, 64, 128, 256])
def test_gqa_groups_and_head_dims(backend, group, head_dim):
    requests = [Request(binary(15), prefix=33), Request(chain(5), prefix=0, qo=3), Request((), prefix=7, qo=2)]
    batch = make_batch(requests, h_q=2 * group, h_kv=2, d=head_dim, seed=group * head_dim, page_size=16)
    check(batch, backend, paged=False)
    check(batch, backend, paged=True)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("sm_scale", [0.05, 0.3, 1.0])
def test_sm_scale(backend, dtype, sm_scale):
    batch = make_batch([Request(binary(12), prefix=20), Request(star(6), prefix=3)], h_q=4, h_kv=1, d=32,
                       dtype=dtype, seed=int(sm_scale * 100), page_size=16)
    check(batch, backend, paged=False, sm_scale=sm_scale)
    check(batch, backend, paged=True, sm_scale=sm_scale)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("scaling", [None, {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                            "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
                                     {"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                      "original_max_position_embeddings": 256}], ids=["default", "llama3", "yarn"])
def test_inline_rope(backend, dtype, scaling):
    """RoPE on q at prefix + depth and on k at every key's position, then attention."""
    trees = [binary(7), chain(4)]
    requests = [Request(trees[0], prefix=12), Request(trees[1], prefix=5)]
    batch = make_batch(requests, h_q=4, h_kv=2, d=32, dtype=dtype, seed=9)
    q_pos = torch.cat([treeattn.TokenTree(r.parents).positions(r.prefix) for r in requests])
    k_pos = torch.cat([torch.cat([torch.arange(r.prefix, dtype=torch.int32),
                                  treeattn.TokenTree(r.parents).positions(r.prefix)]) for r in requests])
    rope = treeattn.RoPE(5e5, scale=0.5, scaling=scaling)
    check(batch, backend, paged=False, rope=rope, q_positions=q_pos, k_positions=k_pos)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("threads", [4], indirect=True)
def test_batched_prefix_chunks_for_idle_threads(backend, threads):
    """One KV head and few rows leave threads idle: the prefix runs as a batch of chunks (+ a remainder)."""
    batch = make_batch([Request(chain(3), prefix=4099), Request((), prefix=2049, qo=1)], h_q=1, h_kv=1, d=64,
                       seed=11, page_size=16)
    check(batch, backend, paged=False)
    check(batch, backend, paged=True)
    plan = treeattn.TreeAttentionPlan.ragged(batch.q_indptr, batch.kv_indptr, batch.tree_indptr, batch.tree_order)
    treeattn.tree_attention(*batch.ragged_args(), backend=backend, plan=plan)
    chunks = [job.batched_chunks for job in cpu_jobs(plan, batch, threads)]
    assert chunks == [4, 2]  # the batched path really ran


# ---------------------------------------------------------------- against independent formulas


def _paths(parents) -> list[list[int]]:
    paths = []
    for u in range(len(parents)):
        path = [u]
        while parents[path[-1]] >= 0:
            path.append(parents[path[-1]])
        paths.append(path[::-1])
    return paths


def _plain_attention(q, k, v, sm_scale):
    """q [h_q, d], k/v [L, h_kv, d] in float64 -> out [h_q, d], lse [h_q] (base 2)."""
    group = q.shape[0] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    s = torch.einsum("hd,lhd->hl", q, k) * sm_scale
    return torch.einsum("hl,lhd->hd", torch.softmax(s, -1), v), torch.logsumexp(s, -1) / math.log(2)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_lse_is_log2_sum_exp(backend, dtype):
    """lse == log2(sum over visible keys of exp(sm_scale * q.k)), from the parent array directly."""
    parents, prefix, sm_scale = forest(binary(6), chain(3)), 21, 0.3
    batch = make_batch([Request(parents, prefix=prefix)], h_q=6, h_kv=3, d=32, dtype=dtype, seed=4)
    _, lse = run(batch, backend, paged=False, sm_scale=sm_scale)
    q, k = batch.q.double(), batch.k.double()
    for u, path in enumerate(_paths(parents)):
        keys = k[list(range(prefix)) + [prefix + a for a in path]]
        for h in range(q.shape[1]):
            scores = sm_scale * keys[:, h // 2] @ q[u, h]
            assert lse[u, h].item() == pytest.approx(math.log2(torch.exp(scores).sum().item()), rel=1e-3, abs=1e-3)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("paged", [False, True], ids=["ragged", "paged"])
@pytest.mark.parametrize("prefix", [0, 37])
def test_chain_is_causal_attention(backend, paged, prefix):
    n = 20
    batch = make_batch([Request(chain(n), prefix=prefix)], h_q=8, h_kv=2, d=64, seed=prefix, page_size=16)
    out, _ = run(batch, backend, paged=paged)
    q = batch.q.double().transpose(0, 1)[None]  # [1, h_q, n, d]
    k = batch.k.double().repeat_interleave(4, dim=1).transpose(0, 1)[None]
    v = batch.v.double().repeat_interleave(4, dim=1).transpose(0, 1)[None]
    causal = torch.arange(prefix + n)[None, :] <= prefix + torch.arange(n)[:, None]  # prefix-offset causal mask
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=causal)[0].transpose(0, 1)
    torch.testing.assert_close(out.double(), want, atol=2e-5, rtol=1e-5)


def _shuffle_siblings(parents, rng) -> np.ndarray:
    """A relabelling ``new[i]`` of the nodes that visits children (and roots) in a random order, so parents
    still precede children but sibling order changes."""
    children = [[] for _ in parents]
    roots = []
    for i, p in enumerate(parents):
        (children[p] if p >= 0 else roots).append(i)
    new, order, stack = np.zeros(len(parents), dtype=np.int64), [], list(rng.permutation(roots))
    while stack:  # any order that puts a node after its parent; shuffle siblings
        u = stack.pop(0)
        order.append(u)
        stack += list(rng.permutation(children[u]))
    new[order] = np.arange(len(parents))
    return new


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_node_sees_prefix_and_its_path_in_any_sibling_order(backend, dtype):
    rng = np.random.default_rng(5)
    parents, prefix, sm_scale = random_tree(rng, 30, root_prob=0.1), 19, 0.125
    batch = make_batch([Request(parents, prefix=prefix)], h_q=4, h_kv=2, d=32, dtype=dtype, seed=6)
    out, lse = run(batch, backend, paged=False, sm_scale=sm_scale)
    q, k, v = batch.q.double(), batch.k.double(), batch.v.double()
    atol, rtol = TOL[dtype]
    for u, path in enumerate(_paths(parents)):
        keys = list(range(prefix)) + [prefix + a for a in path]
        want, want_lse = _plain_attention(q[u], k[keys], v[keys], sm_scale)
        torch.testing.assert_close(out[u].double(), want, atol=atol, rtol=rtol)
        torch.testing.assert_close(lse[u].double(), want_lse, atol=1e-3, rtol=1e-3)
    new = _shuffle_siblings(parents, rng)
    new_parents = np.full(len(parents), -1)
    for i, p in enumerate(parents):
        new_parents[new[i]] = new[p] if p >= 0 else -1
    perm = torch.as_tensor(np.argsort(new))  # perm[j] = old node now labelled j
    assert not torch.equal(perm, torch.arange(len(parents)))
    keys = torch.cat([torch.arange(prefix), prefix + perm])
    tree_indptr, tree_order = treeattn.pack_trees([new_parents])
    shuffled = Batch(batch.requests, batch.q[perm], batch.q_indptr, batch.k[keys], batch.v[keys], batch.kv_indptr,
                     tree_indptr, tree_order)
    out2, lse2 = run(shuffled, backend, paged=False, sm_scale=sm_scale)
    torch.testing.assert_close(out2, out[perm], atol=atol, rtol=rtol)
    torch.testing.assert_close(lse2, lse[perm], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_merge_of_tree_part_and_paged_prefix_equals_paged_tree(backend, dtype):
    """TVM's runtime path without appending first: ragged self part (new tokens only) merged with an unmasked
    paged prefix part equals the paged tree kernel over prefix + new tokens (docs/semantics.md, "KV-cache runtime")."""
    requests = [Request(binary(7), prefix=40), Request(chain(5), prefix=16), Request(star(4), prefix=0)]
    full = make_batch(requests, h_q=4, h_kv=2, d=32, dtype=dtype, seed=8, page_size=16)
    kv_starts = np.cumsum([0] + [r.kv for r in requests])
    new = torch.cat([torch.arange(s + r.prefix, s + r.kv) for s, r in zip(kv_starts, requests)])
    old = torch.cat([torch.arange(s, s + r.prefix) for s, r in zip(kv_starts, requests)])
    own = treeattn.tree_attention(full.q, full.q_indptr, full.k[new], full.v[new], full.q_indptr, full.tree_indptr,
                                  full.tree_order, backend=backend)
    gen = torch.Generator().manual_seed(0)
    pages = paginate(full.k[old], full.v[old], [r.prefix for r in requests], 16, gen)
    no_tree = torch.zeros(len(requests) + 1, dtype=torch.int32)
    cross = treeattn.paged_tree_attention(full.q, full.q_indptr, pages["kv_pages"], pages["page_indptr"],
                                          pages["page_indices"], pages["last_page_len"], no_tree,
                                          torch.zeros(0, 2, dtype=torch.int32), backend=backend)
    assert (cross[1][-4:] == EMPTY_LSE).all()  # the request without a prefix: an empty side
    merged = treeattn.merge_state(*own, *cross, backend=backend)
    want = run(full, backend, paged=True)
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(merged[0].float(), want[0].float(), atol=2 * atol, rtol=rtol)
    torch.testing.assert_close(merged[1], want[1], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("in_place", [False, True])
def test_merge_state(backend, dtype, in_place):
    gen = torch.Generator().manual_seed(3)
    out_a, out_b = (torch.randn(9, 4, 16, generator=gen).to(dtype) for _ in range(2))
    lse_a, lse_b = (torch.randn(9, 4, generator=gen) * 8 for _ in range(2))
    lse_b[0] = EMPTY_LSE  # an empty side keeps the other one unchanged
    lse_a[1] = EMPTY_LSE
    want = treeattn.merge_state(out_a, lse_a, out_b, lse_b, backend="reference")
    if in_place:
        out, lse = out_a.clone(), lse_a.clone()
        got = treeattn.merge_state(out, lse, out_b, lse_b, out=out, lse=lse, backend=backend)
        assert got[0] is out and got[1] is lse
    else:
        got = treeattn.merge_state(out_a, lse_a, out_b, lse_b, out=poisoned(out_a), lse=poisoned(lse_a),
                                   backend=backend)
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(got[0].float(), want[0].float(), atol=atol, rtol=rtol)
    torch.testing.assert_close(got[1], want[1], atol=1e-5, rtol=1e-6)
    assert torch.equal(got[0][0], out_a[0]) and torch.equal(got[0][1], out_b[1])


# ---------------------------------------------------------------- random batches


@st.composite
def batches(draw):
    requests = []
    for _ in range(draw(st.integers(1, 4))):
        if draw(st.booleans()):
            parents = draw(parent_arrays(max_size=24))
            qo = draw(st.integers(0, len(parents)))
        else:
            parents, qo = (), draw(st.integers(0, 3))
        requests.append(Request(parents, prefix=draw(st.sampled_from([0, 1, 5, 16, 17, 40, 600])), qo=qo))
    group = draw(st.sampled_from([1, 2, 4]))
    return requests, group, draw(st.sampled_from([1, 3, 16])), draw(st.integers(0, 2**16))


@pytest.mark.parametrize("backend", BACKENDS)
@settings(max_examples=25, deadline=None)
@given(case=batches())
def test_random_batches(backend, case):
    requests, group, page_size, seed = case
    batch = make_batch(requests, h_q=2 * group, h_kv=2, d=16, seed=seed, page_size=page_size)
    check(batch, backend, paged=False)
    check(batch, backend, paged=True)


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_benchmark_shape(backend, dtype):
    """The benchmark's largest shape class: 32/8 heads, d 128, a 64-node tree after 4096 tokens."""
    batch = make_batch([Request(random_tree(np.random.default_rng(0), 64), prefix=4096)], h_q=32, h_kv=8, d=128,
                       dtype=dtype, seed=1, page_size=16)
    check(batch, backend, paged=False)
    check(batch, backend, paged=True)
