"""Every engine's page layout, read in place by every CPU-side backend, against the ragged float64 reference.

The ragged reference reads plain ``k``/``v`` tensors and never touches the paged addressing, so it is
an independent oracle for the layouts: TVM's combined pages, NHD and HND ``(k, v)`` pairs, K/V as
strided views of one bigger buffer, page sizes 1/16/64, shuffled page ids.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.profiler import ProfilerActivity, profile

import treeattn
from tests.helpers import MIXED, Request, as_layout, assert_close_to_reference, binary, chain, make_batch, outputs_for
from treeattn.backends import BACKENDS as BACKENDS_ALL
from treeattn.backends import AttentionSpec, available_backends, select
from treeattn.layout import PagedKV, slots

BACKENDS = [b for b in available_backends("cpu") if b != "triton"]  # triton: tests/test_triton_interpreter.py
LAYOUTS = ["TVM", "NHD", "HND", "views"]


def paged_run(batch, layout, backend, pages=None):
    """Paged tree attention of ``batch`` with its pages in ``layout`` (``pages``: already converted)."""
    pages, kv_layout = pages or as_layout(batch.extra["kv_pages"], layout)
    e = batch.extra
    out, lse = outputs_for(batch.q)
    treeattn.paged_tree_attention(batch.q, batch.q_indptr, pages, e["page_indptr"], e["page_indices"],
                                  e["last_page_len"], batch.tree_indptr, batch.tree_order, kv_layout=kv_layout,
                                  out=out, lse=lse, backend=backend)
    return out, lse


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_layouts_match_the_ragged_reference(backend, layout, page_size, dtype):
    requests = [*MIXED, Request(binary(20), prefix=70, qo=12)]
    batch = make_batch(requests, h_q=8, h_kv=2, d=32, dtype=dtype, seed=page_size, page_size=page_size)
    out, lse = paged_run(batch, layout, backend)
    ref_out, ref_lse = treeattn.tree_attention(*batch.ragged_args(), backend="reference")
    assert_close_to_reference(out, lse, ref_out, ref_lse, dtype)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_prepared_call_runs_every_layer_as_the_operator_does(backend):
    """prepare_paged_tree_attention once, PagedCall.run per layer: the operator's output for each layer's
    q and pages; a q or pages of another shape are refused, not run."""
    batch = make_batch([*MIXED, Request(binary(9), prefix=40)], h_q=8, h_kv=2, d=32, seed=11, page_size=16)
    e = batch.extra
    plan = treeattn.TreeAttentionPlan.paged(batch.q_indptr, e["page_indptr"], e["page_indices"], e["last_page_len"],
                                            batch.tree_indptr, batch.tree_order, page_size=16,
                                            num_pages=e["kv_pages"].shape[0], total_q=batch.q.shape[0])
    layers = [(torch.randn_like(batch.q), torch.randn_like(e["kv_pages"])) for _ in range(3)]
    call = treeattn.prepare_paged_tree_attention(layers[0][0], PagedKV.wrap(layers[0][1]), plan=plan, backend=backend)
    for q, pages in layers:
        out, lse = outputs_for(q)
        call.run(q, PagedKV.wrap(pages), out=out, lse=lse)
        ref_out, ref_lse = treeattn.paged_tree_attention(q, None, pages, None, None, None, None, None, plan=plan,
                                                         backend=backend)
        torch.testing.assert_close(out, ref_out, rtol=0, atol=0)
        torch.testing.assert_close(lse, ref_lse, rtol=0, atol=0)
    with pytest.raises(ValueError, match="q must be"):
        call.run(batch.q[:-1], PagedKV.wrap(layers[0][1]))
    with pytest.raises(ValueError, match="q must be"):
        call.run(batch.q.double(), PagedKV.wrap(layers[0][1]))
    with pytest.raises(ValueError, match="pages must have"):
        call.run(batch.q, PagedKV.wrap(layers[0][1][:-1]))
    with pytest.raises(TypeError, match="PagedKV"):
        treeattn.prepare_paged_tree_attention(batch.q, layers[0][1], plan=plan)


@pytest.mark.parametrize("backend", [b for b in BACKENDS if b != "reference"])  # the reference copies by design
def test_a_paged_run_allocates_no_cache_sized_tensor(backend):
    """Pages are read in place: no allocation during a run comes near the size of the cache."""
    batch = make_batch([Request(chain(8), prefix=600, qo=8), Request(binary(5), prefix=900)], h_q=8, h_kv=2, d=64,
                       seed=3, page_size=16, spare_pages=400)
    cache_bytes = batch.extra["kv_pages"].numel() * batch.extra["kv_pages"].element_size()
    for layout in LAYOUTS:
        pages = as_layout(batch.extra["kv_pages"], layout)
        paged_run(batch, layout, backend, pages)  # warm-up: per-thread buffers are allocated once
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            paged_run(batch, layout, backend, pages)
        largest = max((e.cpu_memory_usage for e in prof.events()), default=0)
        assert largest < cache_bytes / 4, f"{layout}: a run allocated {largest} B against a {cache_bytes} B cache"


def test_unsupported_call_lists_every_backends_reason():
    spec = AttentionSpec(torch.device("meta"), torch.float32, 4, 2, 16, 16, page_size=12)
    with pytest.raises(ValueError) as err:
        select(None, spec)
    message = str(err.value)
    assert message.startswith("no backend can run this call (paged (page size 12) float32 on meta")
    for name in BACKENDS_ALL:
        assert f"\n  {name}: " in message
    assert "cpu: needs CPU tensors, got tensors on meta" in message
    assert "reference: meta tensors hold no values" in message
    with pytest.raises(ValueError, match="backend='cpu' cannot run this call .*: needs CPU tensors"):
        select("cpu", spec)
    with pytest.raises(ValueError, match="backend must be one of"):
        select("cuda", spec)


def test_pair_layout_errors_name_the_argument():
    pages = torch.randn(4, 2, 2, 16, 8)
    q = torch.randn(1, 2, 8)
    args = ([0, 1], [0, 1], [0], [1], [0, 1], treeattn.tree_order([-1]))
    nhd = pages[:, 0].transpose(1, 2).contiguous()
    cases = [
        (((nhd, nhd[:, :8]),), ValueError, "k_pages and v_pages must agree"),
        (((nhd, nhd.double()),), TypeError, "v_pages must be float16, bfloat16 or float32"),
        (((nhd, nhd), "XYZ"), ValueError, "kv_layout must be 'NHD' or 'HND'"),
        ((pages, "NHD"), ValueError, r"kv_layout='NHD' needs kv_pages=\(k_pages, v_pages\)"),
        (((nhd[..., 0], nhd),), ValueError, "k_pages must be 4-D"),
        (([nhd],), TypeError, "kv_pages must be TVM's combined"),
    ]
    for extra, exc, message in cases:
        kv_pages, *layout = extra
        with pytest.raises(exc, match=message):
            treeattn.paged_tree_attention(q, args[0], kv_pages, *args[1:], kv_layout=layout[0] if layout else None)


# ---------------------------------------------------------------- PagedKV properties

@st.composite
def paged_problem(draw):
    page_size = draw(st.sampled_from([1, 2, 3, 16]))
    num_pages = draw(st.integers(1, 12))
    h_kv, d = draw(st.integers(1, 3)), draw(st.sampled_from([1, 4, 8]))
    layout = draw(st.sampled_from(LAYOUTS))
    seed = draw(st.integers(0, 2**16))
    return page_size, num_pages, h_kv, d, layout, seed


@settings(max_examples=60, deadline=None)
@given(paged_problem(), st.data())
def test_pagedkv_write_read_copy_gather(problem, data):
    """Slots written through one layout read back identically; copies read every source before writing;
    gather_heads returns a request's keys per head in order, whatever the strides."""
    page_size, num_pages, h_kv, d, layout, seed = problem
    gen = torch.Generator().manual_seed(seed)
    pages, kv_layout = as_layout(torch.randn(num_pages, 2, h_kv, page_size, d, generator=gen), layout)
    kv = PagedKV.wrap(pages, kv_layout)
    capacity = num_pages * page_size
    picked = data.draw(st.lists(st.integers(0, capacity - 1), min_size=1, max_size=capacity, unique=True))
    k_new, v_new = torch.randn(len(picked), h_kv, d, generator=gen), torch.randn(len(picked), h_kv, d, generator=gen)
    kv.write(picked, k_new, v_new)
    k_back, v_back = kv.read(picked)
    assert torch.equal(k_back, k_new) and torch.equal(v_back, v_new)

    src = np.asarray(picked)
    dst = np.roll(src, 1)  # overlapping source and destination sets
    before_k, before_v = kv.read(src)
    kv.copy(src, dst)
    after_k, after_v = kv.read(dst)
    assert torch.equal(after_k, before_k) and torch.equal(after_v, before_v)

    table = np.asarray(data.draw(st.permutations(range(num_pages))))
    length = data.draw(st.integers(0, capacity))
    k_seq, v_seq = kv.gather(table, length)
    k_ref, v_ref = kv.read(slots(table, np.arange(length), page_size))
    assert torch.equal(k_seq, k_ref) and torch.equal(v_seq, v_ref)
    ids = torch.from_numpy(table)
    buf = torch.empty(num_pages * page_size * h_kv * d)
    per_head = PagedKV.gather_heads(kv.k, ids, buf)
    full_k, _ = kv.gather(table, capacity)
    assert torch.equal(per_head, full_k.transpose(0, 1))
