"""Attention variants (sliding window, logit soft-capping, sinks, a value head dim of its own, MLA's absorbed
form): every CPU-side backend against the float64 reference, and the reference against HF transformers'
own attention functions where HF has the variant.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import treeattn
from tests.helpers import (
    MIXED,
    Request,
    as_layout,
    assert_close_to_reference,
    binary,
    chain,
    forest,
    make_batch,
    outputs_for,
    random_tree,
    star,
)
from treeattn.backends import AttentionSpec, available_backends, get_backend

_ALL_VARIANTS = AttentionSpec(torch.device("cpu"), torch.float32, 4, 2, 16, 8, sliding_window=2, logit_softcap=1.0,
                              sinks=True)
# CPU-side backends that serve every variant (the others say so in their capabilities: tests/test_layouts.py);
# triton is one of them when this process runs its interpreter (TRITON_INTERPRET=1 before triton's import)
BACKENDS = [b for b in available_backends("cpu")
            if b != "reference" and get_backend(b).unsupported(_ALL_VARIANTS) is None]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
REQUESTS = [*MIXED, Request(chain(12), prefix=40, qo=7), Request(random_tree(np.random.default_rng(3), 30), prefix=1300),
            Request(forest(binary(7), star(5)), prefix=9)]
# Triton's interpreter runs a tile in milliseconds: its long prefix is shorter (still past every window but the
# largest, and cut into many tiles and split-KV chunks).
INTERPRETED_REQUESTS = [*REQUESTS[:-2], Request(REQUESTS[-2].parents, prefix=150), REQUESTS[-1]]


def requests_for(backend: str) -> list[Request]:
    return INTERPRETED_REQUESTS if backend == "triton" else REQUESTS


def _sinks(h_q: int, scale: float, seed: int) -> torch.Tensor:
    return torch.randn(h_q, generator=torch.Generator().manual_seed(seed)) * scale


VARIANTS = {
    "window 1": dict(sliding_window=1),
    "window 3 (< tree depth)": dict(sliding_window=3),
    "window 64": dict(sliding_window=64),
    "window 100000 (> context)": dict(sliding_window=100_000),
    "softcap 5": dict(logit_softcap=5.0),
    "softcap 50": dict(logit_softcap=50.0),
    "sinks": dict(sinks=1.0),
    "dominant sinks": dict(sinks=30.0),
    "window + softcap + sinks": dict(sliding_window=5, logit_softcap=20.0, sinks=2.0),
}


def _kwargs(variant: dict, h_q: int, seed: int) -> dict:
    kw = dict(variant)
    if "sinks" in kw:
        kw["sinks"] = _sinks(h_q, kw["sinks"], seed)
    return kw


# Interpreted Triton in fp32 only here: its fp16/bf16 variant runs are in test_triton_interpreter.py
# (every variant at once, split, V strided unlike K), at a fraction of this grid's interpreter time.
RAGGED_CASES = [(b, dtype) for b in BACKENDS for dtype in DTYPES if b != "triton" or dtype == torch.float32]


@pytest.mark.parametrize("backend,dtype", RAGGED_CASES, ids=str)
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_ragged_variants_match_the_reference(backend, variant, dtype):
    batch = make_batch(requests_for(backend), h_q=8, h_kv=2, d=32, dtype=dtype, seed=len(variant))
    kw = _kwargs(VARIANTS[variant], 8, 1)
    if "sinks" not in kw:
        kw["q_positions"], kw["k_positions"], kw["rope"] = None, None, None
    out, lse = outputs_for(batch.q)
    treeattn.tree_attention(*batch.ragged_args(), out=out, lse=lse, backend=backend, **kw)
    ref_out, ref_lse = treeattn.tree_attention(*batch.ragged_args(), backend="reference", **kw)
    assert_close_to_reference(out, lse, ref_out, ref_lse, dtype)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("variant", ["window 3 (< tree depth)", "window + softcap + sinks", "dominant sinks"])
@pytest.mark.parametrize("layout", ["TVM", "NHD", "views"])
@pytest.mark.parametrize("page_size", [1, 16, 64])
def test_paged_variants_match_the_ragged_reference(backend, variant, layout, page_size):
    batch = make_batch(requests_for(backend), h_q=4, h_kv=2, d=16, seed=page_size, page_size=page_size)
    kw = _kwargs(VARIANTS[variant], 4, 2)
    pages, kv_layout = as_layout(batch.extra["kv_pages"], layout)
    e = batch.extra
    out, lse = outputs_for(batch.q)
    treeattn.paged_tree_attention(batch.q, batch.q_indptr, pages, e["page_indptr"], e["page_indices"],
                                  e["last_page_len"], batch.tree_indptr, batch.tree_order, kv_layout=kv_layout,
                                  out=out, lse=lse, backend=backend, **kw)
    ref_out, ref_lse = treeattn.tree_attention(*batch.ragged_args(), backend="reference", **kw)
    assert_close_to_reference(out, lse, ref_out, ref_lse, torch.float32)


@pytest.mark.parametrize("backend", BACKENDS)
def test_variants_compose_with_inline_rope_and_gqa(backend):
    """Inline RoPE (rows and keys at the same positions: TVM's k_positions default) under every variant."""
    batch = make_batch([Request(binary(15), prefix=0), Request(chain(6), prefix=0)], h_q=8, h_kv=1, d=32, seed=9)
    pos = torch.randint(0, 5000, (batch.q.shape[0],), dtype=torch.int32)
    kw = dict(rope=treeattn.RoPE(1e4), q_positions=pos, sliding_window=4, logit_softcap=10.0, sinks=_sinks(8, 1.0, 3))
    out, lse = treeattn.tree_attention(*batch.ragged_args(), backend=backend, **kw)
    ref_out, ref_lse = treeattn.tree_attention(*batch.ragged_args(), backend="reference", **kw)
    assert_close_to_reference(out, lse, ref_out, ref_lse, torch.float32)


# ---------------------------------------------------------------- MLA and value head dims

@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("paged", [False, True], ids=["ragged", "paged"])
def test_mla_absorbed_form(backend, paged):
    """One latent KV head (512 latent + 64 RoPE dims), V the first 512 dims of the same tensor (a view), all
    query heads packed on it; against the reference computed from an independent copy of V."""
    d_k, d_v, h_q = 576, 512, 16
    batch = make_batch([Request(binary(15), prefix=70), Request(chain(5), prefix=33, qo=3)], h_q=h_q, h_kv=1, d=d_k,
                       seed=4, page_size=16)
    v_view = batch.k[..., :d_v]
    assert v_view.data_ptr() == batch.k.data_ptr()
    ref_out, ref_lse = treeattn.tree_attention(batch.q, batch.q_indptr, batch.k, v_view.contiguous(),
                                               batch.kv_indptr, batch.tree_indptr, batch.tree_order,
                                               backend="reference")
    out, lse = outputs_for(batch.q, d_v)
    if paged:
        k_pages = batch.extra["kv_pages"][:, 0].transpose(1, 2).contiguous()  # [P, page, 1, 576]
        e = batch.extra
        treeattn.paged_tree_attention(batch.q, batch.q_indptr, (k_pages, k_pages[..., :d_v]), e["page_indptr"],
                                      e["page_indices"], e["last_page_len"], batch.tree_indptr, batch.tree_order,
                                      out=out, lse=lse, backend=backend)
    else:
        treeattn.tree_attention(batch.q, batch.q_indptr, batch.k, v_view, batch.kv_indptr, batch.tree_indptr,
                                batch.tree_order, out=out, lse=lse, backend=backend)
    assert out.shape == (batch.q.shape[0], h_q, d_v)
    assert_close_to_reference(out, lse, ref_out, ref_lse, torch.float32)


def test_a_view_of_k_wider_than_k_is_rejected():
    storage = torch.randn(5 * 64)
    k = storage[:256].view(4, 1, 64)
    wide = torch.as_strided(storage, (4, 1, 80), (64, 64, 1))
    with pytest.raises(ValueError, match="v starts where k does .* head dim 80 > k's 64"):
        treeattn.tree_attention(torch.randn(1, 2, 64), [0, 1], k, wide, [0, 4], [0, 1], treeattn.tree_order([-1]))


# ---------------------------------------------------------------- against HF transformers' own attention

class _Module(torch.nn.Module):
    def __init__(self, groups: int, head_dim: int, sinks: torch.Tensor | None = None):
        super().__init__()
        self.num_key_value_groups, self.head_dim, self.training = groups, head_dim, False
        if sinks is not None:
            self.sinks = torch.nn.Parameter(sinks)


def _hf_case(t: int, h_q: int = 4, h_kv: int = 2, d: int = 16):
    gen = torch.Generator().manual_seed(t)
    q, k, v = (torch.randn(1, h, t, d, generator=gen, dtype=torch.float64) for h in (h_q, h_kv, h_kv))
    ours = [x[0].transpose(0, 1).contiguous() for x in (q, k, v)]  # [T, h, d]
    indptr = torch.tensor([0, t], dtype=torch.int32)
    tree_indptr, order = treeattn.pack_trees([chain(t)])
    return q, k, v, ours, (indptr, indptr, tree_indptr, order)


def _additive(allowed: torch.Tensor) -> torch.Tensor:
    return torch.zeros(allowed.shape, dtype=torch.float64).masked_fill(~allowed, float("-inf"))[None, None]


@pytest.mark.parametrize("window", [1, 3, 8, 50])
def test_sliding_window_matches_hf_on_a_chain(window):
    """A chain's tree positions are the causal positions: HF's sliding-window causal mask must agree."""
    from transformers.masking_utils import causal_mask_function, sliding_window_overlay
    from transformers.models.mistral.modeling_mistral import eager_attention_forward

    t = 20
    q, k, v, (qq, kk, vv), (q_indptr, kv_indptr, tree_indptr, order) = _hf_case(t)
    overlay = sliding_window_overlay(window)
    allowed = torch.tensor([[causal_mask_function(0, 0, i, j) and overlay(0, 0, i, j) for j in range(t)]
                            for i in range(t)])
    hf, _ = eager_attention_forward(_Module(2, 16), q, k, v, _additive(allowed), scaling=0.25)
    ours, _ = treeattn.tree_attention(qq.float(), q_indptr, kk.float(), vv.float(), kv_indptr, tree_indptr, order,
                                      sm_scale=0.25, sliding_window=window, backend="reference")
    torch.testing.assert_close(ours.double(), hf[0], atol=1e-5, rtol=1e-5)


def test_softcap_matches_hf_gemma2():
    from transformers.models.gemma2.modeling_gemma2 import eager_attention_forward

    t = 12
    q, k, v, (qq, kk, vv), args = _hf_case(t)
    q = q * 8  # large scores, where the cap matters
    allowed = torch.ones(t, t, dtype=torch.bool).tril()
    hf, _ = eager_attention_forward(_Module(2, 16), q, k, v, _additive(allowed), scaling=0.25, softcap=3.0)
    ours, _ = treeattn.tree_attention(qq.float() * 8, args[0], kk.float(), vv.float(), *args[1:], sm_scale=0.25,
                                      logit_softcap=3.0, backend="reference")
    torch.testing.assert_close(ours.double(), hf[0], atol=1e-5, rtol=1e-5)


def test_sinks_match_hf_gpt_oss():
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    t = 12
    q, k, v, (qq, kk, vv), args = _hf_case(t)
    sinks = _sinks(4, 2.0, 5)
    allowed = torch.ones(t, t, dtype=torch.bool).tril()
    hf, _ = eager_attention_forward(_Module(2, 16, sinks.double()), q, k, v, _additive(allowed), scaling=0.25)
    ours, _ = treeattn.tree_attention(qq.float(), args[0], kk.float(), vv.float(), *args[1:], sm_scale=0.25,
                                      sinks=sinks, backend="reference")
    torch.testing.assert_close(ours.double(), hf[0], atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------- semantics and the CPU plan

@pytest.mark.parametrize("backend", BACKENDS + ["reference"])
def test_sinks_merge_exactly_with_a_part_without_them(backend):
    """Split keys in two: the part with sinks merged with the part without equals one call with sinks."""
    batch = make_batch([Request((), prefix=40, qo=5)], h_q=4, h_kv=2, d=16, seed=8)
    sinks = _sinks(4, 1.5, 6)
    q, k, v = batch.q, batch.k, batch.v
    whole, whole_lse = treeattn.tree_attention(q, [0, 5], k, v, [0, 40], [0, 0], torch.zeros(0, 2, dtype=torch.int32), sinks=sinks,
                                               backend=backend)
    a, a_lse = treeattn.tree_attention(q, [0, 5], k[:25], v[:25], [0, 25], [0, 0], torch.zeros(0, 2, dtype=torch.int32), sinks=sinks,
                                       backend=backend)
    b, b_lse = treeattn.tree_attention(q, [0, 5], k[25:], v[25:], [0, 15], [0, 0], torch.zeros(0, 2, dtype=torch.int32), backend=backend)
    merged, merged_lse = treeattn.merge_state(a, a_lse, b, b_lse, backend=backend)
    torch.testing.assert_close(merged, whole, atol=2e-6, rtol=1e-5)
    torch.testing.assert_close(merged_lse, whole_lse, atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS + ["reference"])
def test_a_row_without_keys_with_sinks_is_all_sink(backend):
    q = torch.randn(2, 4, 16)
    sinks = _sinks(4, 1.0, 7)
    out, lse = treeattn.tree_attention(q, [0, 2], torch.zeros(0, 2, 16), torch.zeros(0, 2, 16), [0, 0], [0, 0],
                                       torch.zeros(0, 2, dtype=torch.int32), sinks=sinks, backend=backend)
    assert (out == 0).all()
    torch.testing.assert_close(lse, (sinks / np.log(2.0)).expand(2, 4))


def test_a_window_skips_keys_outside_every_rows_window():
    """A window of 1024 over a 16k prefix: the CPU plan reads ~1/16 of the keys, unmasked except a tree-deep edge
    (the Triton plan's own test is in test_triton_interpreter.py)."""
    backend = "cpu"
    parents = random_tree(np.random.default_rng(1), 64)
    batch = make_batch([Request(parents, prefix=16384)], h_q=4, h_kv=2, d=16, seed=1)
    plan = treeattn.TreeAttentionPlan.ragged(batch.q_indptr, batch.kv_indptr, batch.tree_indptr, batch.tree_order)
    treeattn.tree_attention(*batch.ragged_args(), sliding_window=1024, backend=backend, plan=plan)
    spec = AttentionSpec(batch.q.device, batch.q.dtype, 4, 2, 16, 16, sliding_window=1024)
    (job,) = plan.state(get_backend(backend), spec).jobs(torch.get_num_threads())
    depth = int(treeattn.tree_depths(parents).max())
    first_read = min([job.unmasked[0]] + [a for a, _ in job.masked])
    assert first_read == 16384 + 0 - 1024 + 1  # the root row's window starts here; nothing below is read
    assert job.unmasked[0] - first_read == depth  # only the edge rows disagree on needs a mask
    keys_read = job.kv_len - first_read
    assert keys_read <= 1024 + 64


VALUE_ERRORS = [
    (dict(sliding_window=0), ValueError, "sliding_window must be >= 1"),
    (dict(sliding_window=-3), ValueError, "sliding_window must be >= 1"),
    (dict(sliding_window=2.5), TypeError, "sliding_window must be an int"),
    (dict(sliding_window=True), TypeError, "sliding_window must be an int"),
    (dict(logit_softcap=0.0), ValueError, "logit_softcap must be finite and > 0"),
    (dict(logit_softcap=-5.0), ValueError, "logit_softcap must be finite and > 0"),
    (dict(logit_softcap=float("inf")), ValueError, "logit_softcap must be finite and > 0"),
    (dict(logit_softcap="5"), TypeError, "logit_softcap must be a real number"),
    (dict(sinks=torch.zeros(3)), ValueError, r"sinks must have shape \[4\]"),
    (dict(sinks=torch.zeros(4, dtype=torch.float64)), TypeError, "sinks must be a float32 tensor"),
    (dict(sinks=[0.0] * 4), TypeError, "sinks must be a float32 tensor"),
    (dict(sinks=torch.tensor([0.0, float("nan"), 0.0, 0.0])), ValueError, "sinks must be finite"),
]


@pytest.mark.parametrize("changes,exc,message", VALUE_ERRORS)
def test_invalid_variant_values_are_rejected(changes, exc, message):
    batch = make_batch([Request(binary(3), prefix=2)], h_q=4, h_kv=2, d=8, seed=0, page_size=4)
    with pytest.raises(exc, match=message):
        treeattn.tree_attention(*batch.ragged_args(), **changes)
    with pytest.raises(exc, match=message):
        treeattn.paged_tree_attention(*batch.paged_args(), **changes)
