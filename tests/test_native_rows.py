"""The native kernel's items of few query rows: a decoding token (or two) of a GQA group, at most 16 rows per
item (32 on AVX-512 with K dims-major), which the FMA paths run with rows outside the vectors
(csrc/kernel_rows.hpp), as do the brgemm paths' fp32 items of at most 8 rows (32, AVX-512, K dims-major) and,
on AVX512-BF16 where they pay (or forced), their bf16 items in bf16 pairs (csrc/kernel_rows_bf16.hpp). Every code path this
CPU has, forced, against the float64 reference (fresh random inputs, NaN-poisoned outputs): every variant;
paged layouts whose tiles lie in one page (fp32 K/V read in place) or across pages (converted into a tile);
head dims that are and are not whole vectors; 16-bit dtypes; a prefix split across threads; hidden NaN keys;
MLA's V view of K. The other native tests mostly have more rows per item.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers import Request, assert_close_to_reference, chain, forest, make_batch
from tests.test_native import ISAS, layouts, native, reference
from tests.test_native_variants import check_paged_variants
from tests.test_variants import VARIANTS, _kwargs, _sinks
from treeattn.backends.native import PAIRS_ENV_VAR, NativeBackend
from treeattn.backends.native.build import EXTENSION
from treeattn.layout import PagedKV

pytestmark = pytest.mark.skipif(EXTENSION.failure() is not None, reason=f"native kernel not built: {EXTENSION.failure()}")

FLAGS = set(Path("/proc/cpuinfo").read_text().split()) if Path("/proc/cpuinfo").exists() else set()
# This CPU runs bf16 items of few rows in bf16 pairs (it has AVX512-BF16, and they pay here or are forced on).
PAIRS = EXTENSION.failure() is None and NativeBackend().pairs("brgemm-avx512")

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


def on_two_threads(batch, isa: str, kv: PagedKV | None = None, **variants):
    """``native`` on two threads (a long prefix is then split into chunks merged by LSE), asserting that
    bf16 items ran on the pairs where the CPU takes them (at least one per request: every item here has
    few enough rows)."""
    takes = PAIRS and isa == "brgemm-avx512" and batch.q.dtype == torch.bfloat16
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        if takes:
            assert NativeBackend().check(isa, torch.bfloat16) is None
        ran = EXTENSION.module().bf16_pairs_items()
        got = native(batch, isa, kv, **variants)
        ran = EXTENSION.module().bf16_pairs_items() - ran
    finally:
        torch.set_num_threads(before)
    assert ran >= len(batch.requests) if takes else ran == 0
    return got


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("variant", ["dominant sinks", "window + softcap + sinks"])
@pytest.mark.parametrize("dtype,layout", [(torch.float32, "TVM"), (torch.bfloat16, "K dims-major")], ids=str)
def test_long_prefix_split_across_threads(isa, variant, dtype, layout):
    """Two requests on one KV head are fewer items than the threads, with enough work to run in parallel
    (native.cpp's PARALLEL_FLOPS): their prefixes are cut into chunks whose partial results (sinks left out)
    are merged by LSE. bf16 items of 8 rows on a dims-major K: on the pairs where the CPU has them."""
    kw = _kwargs(VARIANTS[variant], 8, 3)
    batch = make_batch([Request((), prefix=8000, qo=1), Request(chain(1), prefix=3000)], h_q=8, h_kv=1, d=128,
                       seed=8, page_size=16, dtype=dtype)
    got = on_two_threads(batch, isa, layouts(batch)[layout], **kw)
    assert_close_to_reference(*got, *reference(batch, **kw), dtype)


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


@pytest.mark.skipif(not FLAGS, reason="no /proc/cpuinfo to compare with")
def test_bf16_pairs_run_where_the_cpu_has_avx512_bf16_and_they_pay():
    """The extension can run the bf16 pairs where cpuid has AVX512-BF16; brgemm-avx512 then takes them as
    TREEATTN_NATIVE_BF16_PAIRS forces, else where its probe of decodes timed them at least as fast as its
    GEMMs (the tests here count the items that ran there); no other path takes them."""
    bf16 = {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16"} <= FLAGS
    assert EXTENSION.module().bf16_pairs() == bf16
    backend = NativeBackend()
    forced = os.environ.get(PAIRS_ENV_VAR, "")
    if bf16 and not forced:
        pairs, gemms = backend.pair_speed("brgemm-avx512")
        assert pairs > 0 and gemms > 0
        want = pairs >= gemms
    else:
        want = bf16 and forced == "on"
    assert backend.pairs("brgemm-avx512") == want
    assert not any(backend.pairs(isa) for isa in backend.isas() if isa != "brgemm-avx512")


@pytest.mark.skipif("avx512_bf16" not in FLAGS, reason="this CPU has no AVX512-BF16: no bf16 pairs")
@pytest.mark.parametrize("pay", [True, False])
def test_bf16_pairs_run_where_their_probe_says_they_pay(monkeypatch, pay):
    """Unforced, the pairs' probe decides: a 4-row decode item per KV head runs there when the pairs timed
    faster than the GEMMs, through the GEMMs otherwise; right either way."""
    monkeypatch.delenv(PAIRS_ENV_VAR, raising=False)
    monkeypatch.setitem(NativeBackend._pair_speeds, (EXTENSION, "brgemm-avx512"), (2.0, 1.0) if pay else (1.0, 2.0))
    batch = make_batch([Request((), prefix=70, qo=1)], h_q=8, h_kv=2, d=64, dtype=torch.bfloat16, seed=5)
    assert NativeBackend().check("brgemm-avx512", torch.bfloat16) is None
    before = EXTENSION.module().bf16_pairs_items()
    assert_close_to_reference(*native(batch, "brgemm-avx512"), *reference(batch), torch.bfloat16)
    assert EXTENSION.module().bf16_pairs_items() - before == (2 if pay else 0)


@pytest.mark.skipif("avx512_bf16" not in FLAGS, reason="this CPU has no AVX512-BF16: no bf16 pairs to force")
@pytest.mark.parametrize("mode", ["off", "on"])
def test_bf16_pairs_forced_on_or_off(mode):
    """TREEATTN_NATIVE_BF16_PAIRS forces the pairs off (their items then run on brgemm) or on (whatever their
    probe measured): this file's bf16 cases in a fresh process, against the float64 reference, each counting
    the items that ran on the pairs (all of the few-row ones, or none)."""
    if os.environ.get(PAIRS_ENV_VAR):
        pytest.skip(f"{PAIRS_ENV_VAR} is set for this whole run")
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x", "-k",
                             "(bfloat16 or bf16_items or bf16_decodes or run_where_the_cpu) and not forced", "tests/test_native_rows.py"],
                            cwd=Path(__file__).resolve().parents[1], env={**os.environ, PAIRS_ENV_VAR: mode},
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert " passed" in result.stdout


def test_a_bad_bf16_pairs_setting_is_a_clear_error(monkeypatch):
    backend = NativeBackend()
    monkeypatch.setenv(PAIRS_ENV_VAR, "yes")
    with pytest.raises(ValueError, match=f"{PAIRS_ENV_VAR} must be 'on' or 'off'.*'yes'"):
        NativeBackend()
    with pytest.raises(ValueError, match=f"{PAIRS_ENV_VAR} must be 'on' or 'off'.*'yes'"):  # set after it was made
        backend.pairs("brgemm-avx512")


def on_pairs(batch, isa: str, kv: PagedKV | None = None, sm_scale: float = 0.125, eligible: bool = True, **variants):
    """``native``, counting the items that ran on the bf16 pairs: on a CPU that has them, brgemm-avx512 must
    pass its self-check (a broken path fails here instead of being skipped) and run there every item (one
    per request and KV head: no split) of at most 24 rows with K dims-major, 4 with K as rows
    (kernel_brgemm.hpp's FEW_BF16_ROWS_DIMS and FEW_BF16_ROWS); none where the head dims are not
    ``eligible`` (whole 32-value vectors)."""
    takes = PAIRS and isa == "brgemm-avx512"
    if takes:
        assert NativeBackend().check(isa, torch.bfloat16) is None
    before = EXTENSION.module().bf16_pairs_items()
    got = native(batch, isa, kv, sm_scale, **variants)
    ran = EXTENSION.module().bf16_pairs_items() - before
    rows = batch.q.shape[1] // batch.k.shape[1] * batch.q_indptr.diff()
    bound = 24 if kv is not None and kv.k.stride(-1) != 1 else 4
    runs = (rows > 0) & (batch.kv_indptr.diff() > 0) & (rows <= bound)  # requests with rows and keys
    want = batch.k.shape[1] * int(runs.sum()) if takes and eligible else 0
    assert ran == want and (want > 0 or not takes or not eligible)
    return got


# With 4 query heads per KV head: 4 to 16 rows per item (a decode after a page's worth of keys, trees of 2 and
# 3 nodes, 4 new tokens); prefixes of whole and partial 32-key vectors, one key, none.
PAIR_REQUESTS = [Request((), prefix=576, qo=1), Request(chain(2), prefix=150), Request(forest(chain(1), chain(2)), prefix=37),
                 Request((), prefix=64, qo=4), Request(chain(1), prefix=1), Request(chain(1))]


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("layout,page_size", [("ragged", 16), ("TVM", 16), ("K dims-major", 3), ("K dims-major", 16),
                                              ("K dims-major", 32), ("K dims-major", 40), ("K dims-major", 128)])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_bf16_items_of_few_rows_on_every_layout(isa, layout, page_size, head_dim):
    """bf16 items of 4-16 rows with head dims of whole 32-value vectors (on the brgemm path, where it takes
    the bf16 pairs: all with K dims-major, those of 4 rows with K as rows): K as rows, or dims-major in place
    (a 128-key page holds whole tiles) or copied (pages of 3, 16, 32 and 40 keys: runs within one vector, of
    one whole vector and across two, a tile's partial vector)."""
    batch = make_batch(PAIR_REQUESTS, h_q=8, h_kv=2, d=head_dim, dtype=torch.bfloat16, seed=head_dim + page_size,
                       page_size=page_size)
    assert 4 <= rows_per_item(batch) <= 16
    kv = None if layout == "ragged" else layouts(batch)[layout]
    got = on_pairs(batch, isa, kv, sm_scale=head_dim**-0.5)
    assert_close_to_reference(*got, *reference(batch, head_dim**-0.5), torch.bfloat16)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("head_dim", [32, 96])
def test_bf16_items_of_few_rows_every_variant_in_whole_pages(isa, variant, head_dim):
    """Every variant on K dims-major in 128-key pages (tiles read in place, a 32-key tile among them), head
    dims of one and three 32-value vectors; items of 4-24 rows on the pairs, and one of 28 rows not."""
    requests = [Request((), prefix=160, qo=1), Request(chain(2), prefix=96), Request((), prefix=32, qo=3),
                Request(chain(6), prefix=50), Request(chain(7), prefix=20)]
    batch = make_batch(requests, h_q=8, h_kv=2, d=head_dim, dtype=torch.bfloat16, seed=len(variant) + head_dim,
                       page_size=128)
    kw = _kwargs(VARIANTS[variant], 8, 2)
    got = on_pairs(batch, isa, layouts(batch)["K dims-major"], **kw)
    assert_close_to_reference(*got, *reference(batch, **kw), torch.bfloat16)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("layout,group", [("ragged", 1), ("K dims-major", 4)])
@pytest.mark.parametrize("poison", [float("nan"), float("inf")])
def test_bf16_items_of_few_rows_keep_nan_to_the_rows_that_see_it(isa, layout, group, poison):
    """NaN or inf in V of a tree key reaches only the row that sees it (the pairs take the tile's V widened,
    row by row); a split prefix (two threads, one KV head) merges the chunks' results exactly. Items of 4 and
    2 rows with K as rows, 16 and 8 with K dims-major: on the pairs where the CPU has them."""
    batch = make_batch([Request(forest(chain(2), chain(2)), prefix=70), Request((), prefix=8000, qo=2)], h_q=group,
                       h_kv=1, d=128, dtype=torch.bfloat16, seed=7, page_size=16)
    want = reference(batch)
    key = 70 + 1  # the last node of the first chain: only it sees itself
    batch.v[key] = poison
    page = batch.extra["page_indices"][batch.extra["page_indptr"][0] + key // 16]
    batch.extra["kv_pages"][page, 1, :, key % 16] = poison
    out, lse = on_two_threads(batch, isa, None if layout == "ragged" else layouts(batch)[layout])
    assert not out[1].isfinite().any()
    clean = torch.tensor([True, False, True, True, True, True])
    assert_close_to_reference(out[clean], lse[clean], want[0][clean], want[1][clean], torch.bfloat16)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("group", [1, 2, 3])
@pytest.mark.parametrize("layout,page_size", [("ragged", 16), ("TVM", 16), ("K dims-major", 16)])
def test_bf16_decodes_of_one_to_three_rows(isa, group, layout, page_size):
    """Decodes of 1-3 query heads per KV head (no or little GQA: items of 1-3 rows, the pairs' blocks of fewer
    than four rows), K as rows and dims-major, prefixes of whole and partial vectors."""
    requests = [Request((), prefix=200, qo=1), Request((), prefix=33, qo=1), Request((), prefix=1, qo=1)]
    batch = make_batch(requests, h_q=2 * group, h_kv=2, d=64, dtype=torch.bfloat16, seed=group, page_size=page_size)
    kv = None if layout == "ragged" else layouts(batch)[layout]
    got = on_pairs(batch, isa, kv)
    assert_close_to_reference(*got, *reference(batch), torch.bfloat16)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("d,dv", [(64, 32), (128, 64), (64, 48)])
@pytest.mark.parametrize("layout", ["ragged", "K dims-major"])
def test_bf16_items_of_few_rows_with_a_narrower_v(isa, d, dv, layout):
    """V's head dim of its own (V the first dv dims of the batch's): on the pairs where both are whole
    32-value vectors, elsewhere (dv 48) not, right either way."""
    batch = make_batch(PAIR_REQUESTS, h_q=4 if layout == "ragged" else 8, h_kv=4 if layout == "ragged" else 2, d=d,
                       dtype=torch.bfloat16, seed=d + dv, page_size=16)
    kv = None
    if layout != "ragged":  # as layouts' "K dims-major", V narrowed
        tvm = batch.extra["kv_pages"]  # [pages, 2, h_kv, page_size, d]
        kv = PagedKV.wrap((tvm[:, 0].transpose(2, 3).contiguous().transpose(2, 3), tvm[:, 1, ..., :dv].contiguous()), "HND")
    batch.v = batch.v[..., :dv].contiguous()
    got = on_pairs(batch, isa, kv, sm_scale=d**-0.5, eligible=dv % 32 == 0)
    assert got[0].shape[-1] == dv
    assert_close_to_reference(*got, *reference(batch, d**-0.5), torch.bfloat16)
