"""The native kernel's items of few query rows: a decoding token (or two) of a GQA group, at most 8 rows per
item, which the FMA paths run with rows outside the vectors (csrc/kernel_rows.hpp). Every code path this CPU
has, forced, against the float64 reference (fresh random inputs, NaN-poisoned outputs): every variant; paged
layouts whose tiles lie in one page (fp32 K/V read in place) or across pages (converted into a tile); head
dims that are and are not whole vectors; 16-bit dtypes; a prefix split across threads; hidden NaN keys; MLA's
V view of K. The other native tests mostly have more rows per item.
"""

from __future__ import annotations

import pytest
import torch

from tests.helpers import Request, assert_close_to_reference, chain, forest, make_batch
from tests.test_native import ISAS, layouts, native, reference
from tests.test_native_variants import check_paged_variants
from tests.test_variants import VARIANTS, _kwargs, _sinks
from treeattn.backends.native.build import EXTENSION
from treeattn.layout import PagedKV

pytestmark = pytest.mark.skipif(EXTENSION.failure() is not None, reason=f"native kernel not built: {EXTENSION.failure()}")

# With 4 query heads per KV head: 4 or 8 rows per item. A prefix of 150 keys is two whole tiles and a part.
REQUESTS = [Request(chain(1), prefix=150), Request(chain(2), prefix=70), Request(forest(chain(1), chain(1)), prefix=9),
            Request((), prefix=64, qo=1), Request(chain(1))]


def rows_per_item(batch) -> int:
    group = batch.q.shape[1] // batch.k.shape[1]
    return group * max(int(n) for n in batch.q_indptr.diff())


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_every_variant(isa, dtype, variant):
    batch = make_batch(REQUESTS, h_q=8, h_kv=2, d=32, dtype=dtype, seed=len(variant))
    assert rows_per_item(batch) <= 8
    kw = _kwargs(VARIANTS[variant], 8, 1)
    assert_close_to_reference(*native(batch, isa, **kw), *reference(batch, **kw), dtype)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("page_size", [16, 64])
@pytest.mark.parametrize("head_dim", [24, 32])
def test_paged_layouts_and_head_dims(isa, page_size, head_dim):
    batch = make_batch(REQUESTS, h_q=4, h_kv=1, d=head_dim, seed=page_size + head_dim, page_size=page_size)
    check_paged_variants(batch, isa, page_size)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("page_size", [3, 16, 64])
def test_dims_major_k_as_keys_in_the_lanes(isa, dtype, page_size):
    """A dims-major K (vLLM's CPU cache) is read as K^T, the keys in the lanes: in place (fp32 tiles within
    one page) or copied a run of contiguous keys at a time (16-bit, tiles across pages, pages of 3 keys)."""
    batch = make_batch(REQUESTS, h_q=4, h_kv=1, d=24, dtype=dtype, seed=page_size, page_size=page_size)
    assert_close_to_reference(*native(batch, isa, layouts(batch)["K dims-major"]), *reference(batch), dtype)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("variant", ["dominant sinks", "window + softcap + sinks"])
def test_long_prefix_split_across_threads(isa, variant):
    """Two requests on one KV head are fewer items than the threads, with enough work to run in parallel
    (native.cpp's PARALLEL_FLOPS): their prefixes are cut into chunks whose partial results (sinks left out)
    are merged by LSE."""
    kw = _kwargs(VARIANTS[variant], 8, 3)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        batch = make_batch([Request((), prefix=8000, qo=1), Request(chain(1), prefix=3000)], h_q=8, h_kv=1, d=128,
                           seed=8, page_size=16)
        got = native(batch, isa, layouts(batch)["TVM"], **kw)
    finally:
        torch.set_num_threads(before)
    assert_close_to_reference(*got, *reference(batch, **kw), torch.float32)


@pytest.mark.parametrize("isa", ISAS)
def test_hidden_nan_keys_do_not_leak(isa):
    """NaN in K and V of a tree key some rows cannot see leaves those rows exact (0 x NaN would not); rows
    that see it, or a NaN prefix key, get NaN."""
    batch = make_batch([Request(forest(chain(2), chain(2)), prefix=9)], h_q=4, h_kv=2, d=16, seed=5)
    assert rows_per_item(batch) <= 8
    want = reference(batch)
    batch.k[9 + 1] = float("nan")  # the last node of the first chain: only it sees itself
    batch.v[9 + 1] = float("nan")
    out, lse = native(batch, isa)
    assert out[1].isnan().all()
    clean = torch.tensor([True, False, True, True])
    assert_close_to_reference(out[clean], lse[clean], want[0][clean], want[1][clean], torch.float32)
    seen = make_batch([Request(chain(1), prefix=100)], h_q=4, h_kv=2, d=16, seed=6)
    seen.k[5, 0] = float("nan")  # a prefix key of KV head 0, in a tile no row masks
    out, lse = native(seen, isa)
    assert out[:, :2].isnan().all() and not out[:, 2:].isnan().any()


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("paged", [False, True], ids=["ragged", "paged"])
def test_mla_absorbed_form(isa, paged):
    """One latent KV head of 512 + 64 dims with V the first 512 dims of K (a view: V read from K's tile)."""
    d_k, d_v = 576, 512
    batch = make_batch([Request(chain(1), prefix=70), Request(chain(2), prefix=33)], h_q=4, h_kv=1, d=d_k, seed=9,
                       page_size=16)
    batch.v = batch.k[..., :d_v]
    kv = None
    if paged:
        k_pages = batch.extra["kv_pages"][:, 0].transpose(1, 2).contiguous()  # [pages, page, 1, 576]
        kv = PagedKV.wrap((k_pages, k_pages[..., :d_v]), "NHD")
    kw = dict(logit_softcap=30.0, sinks=_sinks(4, 1.0, 5), sliding_window=40)
    out, lse = native(batch, isa, kv, sm_scale=d_k**-0.5, **kw)
    assert_close_to_reference(out, lse, *reference(batch, d_k**-0.5, **kw), torch.float32)
