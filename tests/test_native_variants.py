"""The native C++ kernel's attention variants: sliding window, logit soft-cap, sinks, a value head dim of its
own and MLA's absorbed form, each and together, forced on every code path this CPU has, against the float64
reference (fresh random inputs, NaN-poisoned outputs); paged layouts and page sizes; a prefix split across
threads (sinks counted once); keys outside every row's window never read; and capability dispatch.

``tests/test_variants.py`` runs the default path through the public ops as well (every dtype, layouts, RoPE,
rows without keys, sinks merged with a part without them).
"""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

import treeattn
from tests.helpers import MIXED, Request, assert_close_to_reference, binary, chain, forest, make_batch, random_tree
from tests.test_native import ISAS, layouts, native, reference
from tests.test_variants import VARIANTS, _kwargs, _sinks
from treeattn.backends import AttentionSpec, select
from treeattn.backends.native.build import EXTENSION
from treeattn.layout import PagedKV

pytestmark = pytest.mark.skipif(EXTENSION.failure() is not None, reason=f"native kernel not built: {EXTENSION.failure()}")

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# The long prefix is past every window but the largest (its window edges fall in the prefix).
REQUESTS = [*MIXED, Request(chain(12), prefix=40, qo=7), Request(random_tree(np.random.default_rng(3), 30), prefix=300)]


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_ragged_variants_every_path(isa, dtype, variant):
    batch = make_batch(REQUESTS, h_q=8, h_kv=2, d=32, dtype=dtype, seed=len(variant))
    kw = _kwargs(VARIANTS[variant], 8, 1)
    assert_close_to_reference(*native(batch, isa, **kw), *reference(batch, **kw), dtype)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("page_size", [1, 16, 64])
def test_paged_variants_every_layout(isa, page_size):
    check_paged_variants(make_batch(REQUESTS, h_q=4, h_kv=2, d=16, seed=page_size, page_size=page_size), isa, page_size)


def check_paged_variants(batch, isa: str, page_size: int) -> None:
    """A window shorter than the trees, and window + soft-cap + sinks, over every paged layout of ``batch``."""
    for variant in ("window 3 (< tree depth)", "window + softcap + sinks"):
        kw = _kwargs(VARIANTS[variant], batch.q.shape[1], page_size)
        want = reference(batch, **kw)
        for kv in layouts(batch).values():
            assert_close_to_reference(*native(batch, isa, kv, **kw), *want, torch.float32)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("paged", [False, True], ids=["ragged", "paged"])
@pytest.mark.parametrize("variant", ["dominant sinks", "window + softcap + sinks", "sinks, window 2000"])
def test_long_prefix_split_counts_sinks_once(isa, paged, variant):
    """Two requests on one KV head are fewer items than the threads: each prefix is cut into chunks run in
    parallel and merged by LSE in the call. The chunks leave the sinks out and the merge adds them once (a
    sink counted per chunk would show in the LSE); a window's reading starts at its lowest row's window."""
    kw = dict(sliding_window=2000, sinks=_sinks(4, 3.0, 2)) if variant.startswith("sinks,") else _kwargs(VARIANTS[variant], 4, 2)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        batch = make_batch([Request(binary(31), prefix=5000, qo=20), Request((), prefix=3001, qo=3)], h_q=4, h_kv=1,
                           d=64, seed=7, page_size=16)
        got = native(batch, isa, layouts(batch)["TVM"] if paged else None, **kw)
    finally:
        torch.set_num_threads(before)
    assert_close_to_reference(*got, *reference(batch, **kw), torch.float32)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("paged", [False, True], ids=["ragged", "paged"])
@pytest.mark.parametrize("variant", ["none", "window + softcap + sinks", "sinks, window 2000"])
def test_tree_key_cut_with_split_chunks_and_variants(isa, paged, variant):
    """Row blocks read tree keys only up to their rows' last ancestor, together with what else changes an
    item's keys: a forest whose first tree (a chain numbered root last: ancestors after descendants) cuts
    the second one off its blocks, on one KV head and two threads (each block's keys split into chunks
    merged by LSE), with a window, soft-cap and sinks, ragged and paged."""
    kw = ({} if variant == "none" else dict(sliding_window=2000, sinks=_sinks(4, 3.0, 5))
          if variant.startswith("sinks,") else _kwargs(VARIANTS[variant], 4, 5))
    m = 260
    batch = make_batch([Request(forest(chain(m), chain(m)), prefix=1500)], h_q=4, h_kv=1, d=32, seed=9, page_size=16)
    j = torch.arange(m)
    batch.tree_order[:] = torch.cat([torch.stack([m - 1 - j, torch.full((m,), m)], 1),  # root last
                                     torch.stack([m + j, torch.full((m,), 2 * m)], 1)]).to(batch.tree_order.dtype)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        got = native(batch, isa, layouts(batch)["TVM"] if paged else None, **kw)
    finally:
        torch.set_num_threads(before)
    assert_close_to_reference(*got, *reference(batch, **kw), torch.float32)


@pytest.mark.parametrize("isa", ISAS)
def test_keys_outside_the_window_have_no_effect(isa):
    """NaN in every key and value below the shallowest row's window (keys that are never read) and in the
    window's edge hidden from deeper rows (masked) leaves every row exact."""
    window, prefix = 6, 100
    batch = make_batch([Request(chain(10), prefix=prefix)], h_q=4, h_kv=2, d=16, seed=3)
    kw = dict(sliding_window=window, logit_softcap=10.0, sinks=_sinks(4, 1.0, 4))
    batch.k[:prefix] = float("nan")  # the shallowest row (position 100) sees keys from position 95 on
    batch.v[:prefix] = float("nan")
    batch.k[prefix - window + 1:prefix] = torch.randn(window - 1, 2, 16)  # ... so these are seen after all
    batch.v[prefix - window + 1:prefix] = torch.randn(window - 1, 2, 16)
    want = reference(batch, **kw)
    assert not want[0].isnan().any()
    assert_close_to_reference(*native(batch, isa, **kw), *want, torch.float32)


def test_a_window_skips_the_keys_outside_it():
    """A window of 1024 over a 16k prefix reads ~1/16 of the keys: at least 3x faster than no window (about
    12x measured on an idle core), on one thread, best of several interleaved runs."""
    batch = make_batch([Request(binary(15), prefix=16384)], h_q=4, h_kv=2, d=64, seed=5)
    plan = treeattn.TreeAttentionPlan.ragged(batch.q_indptr, batch.kv_indptr, batch.tree_indptr, batch.tree_order)
    out, lse = torch.empty_like(batch.q), torch.empty(batch.q.shape[:2])

    def seconds(**kw) -> float:
        start = time.perf_counter()
        treeattn.tree_attention(batch.q, None, batch.k, batch.v, None, None, None, plan=plan, out=out, lse=lse,
                                backend="native", **kw)
        return time.perf_counter() - start

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        runs = [(seconds(), seconds(sliding_window=1024)) for _ in range(5)]
    finally:
        torch.set_num_threads(before)
    full, windowed = min(r[0] for r in runs), min(r[1] for r in runs)
    assert full > 3 * windowed, (full, windowed)


# ---------------------------------------------------------------- MLA and value head dims

@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("paged", [False, True], ids=["ragged", "paged"])
@pytest.mark.parametrize("group", [16, 128])
def test_mla_absorbed_form(isa, paged, group):
    """One latent KV head of 512 + 64 dims, V the first 512 dims of the same tensor (a view, read from the K
    tile), every query head packed on it; soft-cap and sinks on top at group 16, and at group 128 (two tokens per
    work item) a window whose start differs between the items."""
    d_k, d_v = 576, 512
    batch = make_batch([Request(binary(7), prefix=70), Request(chain(3), prefix=33, qo=2)], h_q=group, h_kv=1, d=d_k,
                       seed=group, page_size=16)
    batch.v = batch.k[..., :d_v]
    assert batch.v.data_ptr() == batch.k.data_ptr() and not batch.v.is_contiguous()
    kw = dict(logit_softcap=30.0, sinks=_sinks(group, 1.0, 5)) if group == 16 else dict(sliding_window=40)
    kv = None
    if paged:
        k_pages = batch.extra["kv_pages"][:, 0].transpose(1, 2).contiguous()  # [pages, page, 1, 576]
        kv = PagedKV.wrap((k_pages, k_pages[..., :d_v]), "NHD")
        assert kv.v.untyped_storage().data_ptr() == kv.k.untyped_storage().data_ptr()
    out, lse = native(batch, isa, kv, sm_scale=d_k**-0.5, **kw)
    assert out.shape == (batch.q.shape[0], group, d_v)
    assert_close_to_reference(out, lse, *reference(batch, d_k**-0.5, **kw), torch.float32)


@pytest.mark.parametrize("isa", ISAS)
def test_v_head_dim_of_its_own(isa):
    """A separate V tensor with a narrower head dim than K (not a view), under a window."""
    batch = make_batch(REQUESTS, h_q=6, h_kv=3, d=48, seed=6)
    batch.v = torch.randn(batch.k.shape[0], 3, 20)
    kw = dict(sliding_window=9)
    assert_close_to_reference(*native(batch, isa, **kw), *reference(batch, **kw), torch.float32)


# ---------------------------------------------------------------- dispatch

@pytest.mark.parametrize("variants", [dict(sliding_window=8), dict(logit_softcap=30.0), dict(sinks=True),
                                      dict(sliding_window=8, logit_softcap=30.0, sinks=True)], ids=str)
@pytest.mark.parametrize("page_size", [None, 16])
def test_dispatch_picks_native_for_variants_on_cpu(variants, page_size):
    spec = AttentionSpec(torch.device("cpu"), torch.bfloat16, 32, 8, 128, 128, page_size=page_size, **variants)
    assert select(None, spec).name == "native"
    mla = AttentionSpec(torch.device("cpu"), torch.float32, 128, 1, 576, 512, page_size=page_size, **variants)
    assert select(None, mla).name == "native"
