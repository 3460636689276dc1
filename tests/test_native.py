"""The native C++ CPU kernel: every code path this CPU has, forced one at a time, against the float64
reference (fresh random inputs, NaN-poisoned outputs), on every page layout; hidden-key NaNs; the prefix
split across threads; merges; and the fallback when the extension cannot be built.

``tests/test_attention.py`` runs the default path through the public ops as well. The first test to
run compiles the extension (about 1-3 minutes on 2 cores; cached afterwards).
"""

from __future__ import annotations

import shutil
import warnings
from pathlib import Path

import pytest
import torch

import treeattn
from tests.helpers import MIXED, Request, assert_close_to_reference, binary, chain, forest, make_batch, outputs_for, poisoned, star
from treeattn.backends import AttentionSpec
from treeattn.backends.native import NativeBackend
from treeattn.backends.native.build import EXTENSION, Extension
from treeattn.layout import PagedKV
from treeattn.lse import EMPTY_LSE, merge
from treeattn.plan import TreeAttentionPlan
from treeattn.testing import paginate

pytestmark = pytest.mark.skipif(EXTENSION.failure() is not None, reason=f"native kernel not built: {EXTENSION.failure()}")

ISAS = NativeBackend().isas() if EXTENSION.failure() is None else []
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def spec_of(batch, page_size=None, sliding_window=None, logit_softcap=None, sinks=None) -> AttentionSpec:
    return AttentionSpec(torch.device("cpu"), batch.q.dtype, batch.q.shape[1], batch.k.shape[1], batch.q.shape[2],
                         batch.v.shape[2], page_size=page_size, sliding_window=sliding_window,
                         logit_softcap=logit_softcap, sinks=sinks is not None)


def skip_unless_checked(backend: NativeBackend, dtype: torch.dtype) -> None:
    """Skip (with the reason) a brgemm path whose oneDNN kernels this CPU lacks for ``dtype``; that a CPU
    which has them passes the check is tests/test_native_brgemm.py's."""
    if backend.isa.startswith("brgemm-") and (reason := backend.check(backend.isa, dtype)):
        pytest.skip(f"{backend.isa} {dtype}: {reason}")


def native(batch, isa: str, kv: PagedKV | None = None, sm_scale: float = 0.125, **variants):
    """Run one forced kernel path directly (no ops dispatch) into poisoned buffers; ``variants``: the
    ``sliding_window``, ``logit_softcap`` and ``sinks`` keywords of the ops. V's head dim is ``batch.v``'s."""
    backend = NativeBackend(isa=isa)
    out, lse = outputs_for(batch.q, batch.v.shape[2])
    sinks = variants.get("sinks")
    skip_unless_checked(backend, batch.q.dtype)
    if kv is None:
        plan = TreeAttentionPlan.ragged(batch.q_indptr, batch.kv_indptr, batch.tree_indptr, batch.tree_order)
        spec = spec_of(batch, **variants)
        assert backend.unsupported(spec) is None
        backend.tree_attention(batch.q, batch.k, batch.v, plan, backend.plan(plan, spec), sm_scale=sm_scale,
                               out=out, lse=lse, sinks=sinks)
    else:
        e = batch.extra
        plan = TreeAttentionPlan.paged(batch.q_indptr, e["page_indptr"], e["page_indices"], e["last_page_len"],
                                       batch.tree_indptr, batch.tree_order, page_size=kv.page_size,
                                       num_pages=kv.num_pages)
        spec = spec_of(batch, kv.page_size, **variants)
        backend.paged_tree_attention(batch.q, kv, plan, backend.plan(plan, spec), sm_scale=sm_scale, out=out, lse=lse,
                                     sinks=sinks)
    return out, lse


def reference(batch, sm_scale: float = 0.125, **variants):
    q, q_indptr, k, v, *rest = batch.ragged_args()
    return treeattn.tree_attention(q, q_indptr, k, v.contiguous(), *rest, sm_scale=sm_scale, backend="reference",
                                   **variants)


def layouts(batch) -> dict[str, PagedKV]:
    """The batch's TVM pages, and the same tokens as NHD, HND, strided views into one engine buffer, and
    HND with each page's K stored dims-major (vLLM's CPU cache: K's head dims ``page_size`` elements apart)."""
    tvm = batch.extra["kv_pages"]  # [pages, 2, h_kv, page_size, d]
    nhd = tvm.permute(0, 1, 3, 2, 4).contiguous()  # [pages, 2, page_size, h_kv, d]: vLLM-style K/V views
    dims_major = tvm[:, 0].transpose(2, 3).contiguous().transpose(2, 3)  # [pages, h_kv, page_size, d] view
    assert dims_major.stride(-1) == tvm.shape[3]
    return {"TVM": PagedKV.wrap(tvm),
            "NHD": PagedKV.wrap((nhd[:, 0].contiguous(), nhd[:, 1].contiguous()), "NHD"),
            "HND": PagedKV.wrap((tvm[:, 0].contiguous(), tvm[:, 1].contiguous()), "HND"),
            "views": PagedKV.wrap((nhd[:, 0], nhd[:, 1]), "NHD"),
            "K dims-major": PagedKV.wrap((dims_major, tvm[:, 1].contiguous()), "HND")}


def test_every_simd_path_this_cpu_has():
    """A test machine with AVX2 or AVX-512 must not silently fall to a slower path: it has the brgemm
    and FMA paths of its widest ISA, and the default runs each dtype on the fastest of them."""
    assert ISAS[-1] == "generic"
    flags = set(Path("/proc/cpuinfo").read_text().split())
    if "avx2" in flags:
        assert {"brgemm-avx2", "avx2"} <= set(ISAS)
    if {"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= flags:
        assert {"brgemm-avx512", "avx512"} <= set(ISAS)
        backend = NativeBackend()  # fp32: the brgemm path where it measures faster, else the FMA kernel
        assert backend.path(torch.float32) in ("avx512", "brgemm-avx512")
        assert backend.path(torch.float32) == ("brgemm-avx512" if not backend.check("brgemm-avx512", torch.float32)
                                               and backend.pays("brgemm-avx512", torch.float32) else "avx512")


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("page_size", [1, 16, 64])
def test_mixed_batch_every_layout(isa, dtype, page_size):
    batch = make_batch(MIXED, h_q=8, h_kv=2, d=64, dtype=dtype, seed=page_size, page_size=page_size)
    want = reference(batch)
    assert_close_to_reference(*native(batch, isa), *want, dtype)
    for kv in layouts(batch).values():
        assert_close_to_reference(*native(batch, isa, kv), *want, dtype)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("shape", ["tree", "forest", "chain", "star", "deep_chain", "qo_lt_n"])
@pytest.mark.parametrize("prefix", [0, 15, 16, 17, 63, 64, 65])
def test_tree_shapes_at_page_boundaries(isa, shape, prefix):
    parents = {"tree": binary(26), "forest": forest(binary(7), chain(3), [-1]), "chain": chain(10),
               "star": star(9), "deep_chain": chain(200), "qo_lt_n": binary(15)}[shape]
    request = Request(parents, prefix=prefix, qo=5 if shape == "qo_lt_n" else None)
    batch = make_batch([request], h_q=4, h_kv=2, d=32, seed=prefix, page_size=16)
    want = reference(batch)
    assert_close_to_reference(*native(batch, isa), *want, torch.float32)
    assert_close_to_reference(*native(batch, isa, layouts(batch)["NHD"]), *want, torch.float32)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_row_blocks_read_tree_keys_only_up_to_their_last_ancestor(isa, dtype):
    """Trees longer than a row block (64 or 128 tokens at group 4): each block reads the tree keys up to
    the last node that enters the DFS no later than its rows do. A prefill's chain (most keys skipped), a
    level-order tree, query rows that are part of a chain, and a tree_order no parent array gives, whose
    ancestors come after their descendants (a cut by node index would drop keys these rows see)."""
    batch = make_batch([Request(chain(700), prefix=33), Request(binary(600)), Request(chain(500), prefix=5, qo=300)],
                       h_q=8, h_kv=2, d=64, dtype=dtype, seed=5)
    assert_close_to_reference(*native(batch, isa), *reference(batch), dtype)
    reversed_chain = make_batch([Request(chain(400), prefix=10)], h_q=8, h_kv=2, d=64, dtype=dtype, seed=6)
    n = 400  # node j enters at n - 1 - j: node n - 1 is the root, node 0 the leaf that sees every key
    reversed_chain.tree_order[:] = torch.stack([n - 1 - torch.arange(n), torch.full((n,), n)], 1).to(
        reversed_chain.tree_order.dtype)
    assert_close_to_reference(*native(reversed_chain, isa), *reference(reversed_chain), dtype)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rows_that_see_no_key_of_a_tile_skip_it(isa, dtype):
    """Without GQA a row block holds 512 tokens (brgemm) and spans several key tiles: on a tile of tree
    keys, the rows that enter the DFS before all of its keys skip it (a prefill's upper triangle), and a
    tile no row of the block sees is skipped whole (a forest's other tree). Chains, a forest of two chains,
    a level-order tree, a reversed chain (its late rows enter first), ragged and paged with K dims-major."""
    forest_ = forest(chain(450), chain(500))
    batch = make_batch([Request(chain(1100), prefix=33), Request(forest_, prefix=7), Request(binary(900), prefix=2)],
                       h_q=2, h_kv=2, d=32, dtype=dtype, seed=8, page_size=16)
    want = reference(batch)
    assert_close_to_reference(*native(batch, isa), *want, dtype)
    assert_close_to_reference(*native(batch, isa, layouts(batch)["K dims-major"]), *want, dtype)
    n = 900
    reversed_chain = make_batch([Request(chain(n), prefix=10)], h_q=1, h_kv=1, d=32, dtype=dtype, seed=9)
    reversed_chain.tree_order[:] = torch.stack([n - 1 - torch.arange(n), torch.full((n,), n)], 1).to(
        reversed_chain.tree_order.dtype)
    assert_close_to_reference(*native(reversed_chain, isa), *reference(reversed_chain), dtype)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("window", [2, 8, 100])
def test_window_over_a_tree_not_numbered_parents_first(isa, window):
    """A valid tree_order need not number parents first: a node deeper than its index sits at a position
    above its index, so a window that opens inside the tree can still see a key below the window's start.
    A three-node chain whose root is node 1 (after and before a prefix), and a reversed chain whose root is
    its last node, cut into row blocks."""
    three = make_batch([Request([-1, 0, 1], prefix=0, qo=1), Request([-1, 0, 1], prefix=2, qo=1)], h_q=2, h_kv=1,
                       d=16, seed=window)
    three.tree_order[:] = torch.tensor([[1, 3], [0, 3], [2, 3]] * 2, dtype=three.tree_order.dtype)
    n = 400  # node j enters at n - 1 - j
    reversed_chain = make_batch([Request(chain(n), prefix=10)], h_q=8, h_kv=2, d=64, seed=window + 1)
    reversed_chain.tree_order[:] = torch.stack([n - 1 - torch.arange(n), torch.full((n,), n)], 1).to(
        reversed_chain.tree_order.dtype)
    for batch in (three, reversed_chain):
        want = reference(batch, sliding_window=window)
        assert_close_to_reference(*native(batch, isa, sliding_window=window), *want, torch.float32)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("group", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("head_dim", [16, 20, 64, 128, 256])
def test_gqa_groups_and_head_dims(isa, group, head_dim):
    """Odd groups and head dims exercise every panel width and the dims left over by 4- and 8-wide blocks."""
    batch = make_batch([Request(binary(13), prefix=70), Request(chain(5), prefix=3, qo=2)], h_q=2 * group, h_kv=2,
                       d=head_dim, seed=group * head_dim)
    assert_close_to_reference(*native(batch, isa, sm_scale=head_dim**-0.5), *reference(batch, head_dim**-0.5),
                              torch.float32)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("group", [3, 4])
def test_items_of_9_to_16_rows(isa, group):
    """Small trees of a GQA group (9-16 rows): the AVX paths run them as few-rows items (rows outside the
    lanes, sharing each K chunk), with tree masks on the last tile, on every layout; and with a window
    and sinks."""
    batch = make_batch([Request(binary(5), prefix=40), Request(chain(4), prefix=130), Request(forest(chain(2), chain(2)),
                        prefix=7), Request(star(3), prefix=300), Request((), prefix=64, qo=3)], h_q=2 * group, h_kv=2,
                       d=64, seed=group, page_size=16)
    want = reference(batch)
    assert_close_to_reference(*native(batch, isa), *want, torch.float32)
    for kv in layouts(batch).values():
        assert_close_to_reference(*native(batch, isa, kv), *want, torch.float32)
    sinks = torch.linspace(-1.0, 1.0, 2 * group)
    assert_close_to_reference(*native(batch, isa, sliding_window=24, sinks=sinks),
                              *reference(batch, sliding_window=24, sinks=sinks), torch.float32)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("page_size", [16, 128])
def test_items_of_17_to_32_rows_on_a_dims_major_k(isa, dtype, page_size):
    """With K dims-major (vLLM's cells) the AVX-512 paths run items of up to 32 rows as few-rows items (the
    rows share each dim row of K): trees of a GQA group of 3 or 4 giving 15-32 rows, with tree masks on the
    last tiles; and with a window and sinks."""
    requests = [Request(binary(8), prefix=40), Request(chain(6), prefix=130), Request(forest(chain(3), chain(4)), prefix=7),
                Request(star(5), prefix=300), Request((), prefix=64, qo=7)]
    for group in (3, 4):
        batch = make_batch(requests, h_q=2 * group, h_kv=2, d=64, dtype=dtype, seed=group + page_size,
                           page_size=page_size)
        kv = layouts(batch)["K dims-major"]
        assert_close_to_reference(*native(batch, isa, kv), *reference(batch), dtype)
        sinks = torch.linspace(-1.0, 1.0, 2 * group)
        assert_close_to_reference(*native(batch, isa, kv, sliding_window=24, sinks=sinks),
                                  *reference(batch, sliding_window=24, sinks=sinks), dtype)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("head_dim", [17, 66, 129])
def test_16_bit_head_dims_odd_and_uneven(isa, dtype, head_dim):
    """16-bit K rows of an odd head dim end in half a 32-bit word: the brgemm paths pack K^T in word pairs
    (VNNI) or in plain rows (fp16 on AVX512-FP16) and must pad that half with zero, from K rows and from
    a dims-major K (whose last dim pairs with nothing)."""
    skip_unless_checked(NativeBackend(isa=isa), dtype)
    batch = make_batch([Request(binary(20), prefix=300), Request(chain(5), prefix=3, qo=2)], h_q=4, h_kv=2,
                       d=head_dim, dtype=dtype, seed=head_dim, page_size=16)  # 40 rows: no few-rows item
    want = reference(batch, head_dim**-0.5)
    assert_close_to_reference(*native(batch, isa, sm_scale=head_dim**-0.5), *want, dtype)
    assert_close_to_reference(*native(batch, isa, layouts(batch)["K dims-major"], sm_scale=head_dim**-0.5), *want,
                              dtype)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("paged", [False, True], ids=["ragged", "paged"])
def test_long_prefix_split_across_threads(isa, dtype, paged):
    """One request with one KV head has fewer items than threads: its prefix is cut into chunks that run
    in parallel and are merged by LSE inside the call (and a chunk may hold only hidden tree keys)."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        batch = make_batch([Request(binary(31), prefix=5000, qo=20), Request((), prefix=3001, qo=3)], h_q=4, h_kv=1,
                           d=64, dtype=dtype, seed=7, page_size=16)
        got = native(batch, isa, layouts(batch)["TVM"] if paged else None)
    finally:
        torch.set_num_threads(before)
    assert_close_to_reference(*got, *reference(batch), dtype)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_scores_rising_and_falling_along_the_prefix(isa, dtype):
    """Keys whose scores grow tile after tile (each tile's max so far above the earlier ones that
    exponentials against an old softmax shift would overflow fp32: the shift must move, rescaling what
    the row summed), shrink, or rise within the brgemm kernel's slack; with sinks (a row's first shift
    is the sink's) and on pages."""
    skip_unless_checked(NativeBackend(isa=isa), dtype)
    batch = make_batch([Request(binary(9), prefix=1100), Request(chain(3), prefix=900), Request(star(4), prefix=700)],
                       h_q=4, h_kv=2, d=64, dtype=dtype, seed=11)
    starts = batch.kv_indptr.tolist()
    for (lo, hi), ramp in zip(zip(starts, starts[1:]), [(1.0, 40.0), (7.0, 1.0), (1.0, 1.6)]):
        batch.k[lo:hi] = (batch.k[lo:hi].float() * torch.linspace(*ramp, hi - lo)[:, None, None]).to(dtype)
    batch.extra.update(paginate(batch.k, batch.v, [hi - lo for lo, hi in zip(starts, starts[1:])], 16,
                                torch.Generator().manual_seed(3)))
    want = reference(batch)
    assert_close_to_reference(*native(batch, isa), *want, dtype)
    assert_close_to_reference(*native(batch, isa, layouts(batch)["NHD"]), *want, dtype)
    sinks = torch.linspace(-2.0, 2.0, 4)
    assert_close_to_reference(*native(batch, isa, sinks=sinks), *reference(batch, sinks=sinks), dtype)


def assert_only_row_nan(out, lse, want, row: int, dtype) -> None:
    """Query row ``row`` is all NaN; every other row matches ``want`` (out, lse)."""
    assert out[row].isnan().all()
    clean = torch.ones(out.shape[0], dtype=torch.bool)
    clean[row] = False
    assert_close_to_reference(out[clean], lse[clean], want[0][clean], want[1][clean], dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("isa", ISAS)
def test_hidden_nan_keys_do_not_leak(isa, dtype):
    """NaN in K and V of tree keys a row cannot see leaves that row exact; rows that see them get NaN, also
    from a full tile of prefix keys that no row masks (the brgemm paths' unmasked softmax and their 16-bit
    rounding of probabilities must keep a NaN)."""
    skip_unless_checked(NativeBackend(isa=isa), dtype)
    batch = make_batch([Request(forest(chain(4), chain(4)), prefix=9)], h_q=4, h_kv=2, d=16, seed=5, dtype=dtype)
    want = reference(batch)
    batch.k[9 + 3] = float("nan")  # the last node of the first chain: only it sees itself
    batch.v[9 + 3] = float("nan")
    assert_only_row_nan(*native(batch, isa), want, 3, dtype)
    seen = make_batch([Request(chain(3), prefix=600)], h_q=4, h_kv=2, d=16, seed=6, dtype=dtype)
    seen.k[5, 0] = float("nan")  # a prefix key of KV head 0, in the first (unmasked) tile
    out, lse = native(seen, isa)
    assert out[:, :2].isnan().all() and not out[:, 2:].isnan().any()
    # An item of 400 rows (the brgemm paths run a tile of tree keys 64 rows at a time, each chunk up to
    # the keys it may see): NaN in V of the first chain's last node reaches only that node's row.
    wide = make_batch([Request(forest(chain(30), chain(70)), prefix=5)], h_q=8, h_kv=2, d=16, seed=7, dtype=dtype)
    want = reference(wide)
    wide.v[5 + 29] = float("nan")
    assert_only_row_nan(*native(wide, isa), want, 29, dtype)
    # A chain's rows past a key all see it: the brgemm paths run it unmasked in the chunks of rows that
    # come later (their `clear` keys), and its NaN still reaches exactly the rows that see it.
    long = make_batch([Request(chain(200), prefix=5)], h_q=8, h_kv=2, d=16, seed=8, dtype=dtype)
    want = reference(long)
    long.v[5 + 20] = float("nan")
    out, lse = native(long, isa)
    assert out[20:].isnan().all()
    assert_close_to_reference(out[:20], lse[:20], want[0][:20], want[1][:20], dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("in_place", [False, True])
def test_merge_state_matches_lse_merge(dtype, in_place):
    gen = torch.Generator().manual_seed(11)
    out_a, out_b = (torch.randn(7, 4, 24, generator=gen).to(dtype) for _ in range(2))
    lse_a, lse_b = (torch.randn(7, 4, generator=gen) * 8 for _ in range(2))
    lse_a[0], lse_b[1] = EMPTY_LSE, float("-inf")  # empty parts weigh 0 whatever they hold
    lse_a[2], lse_b[2] = EMPTY_LSE, EMPTY_LSE  # both empty: 0 and EMPTY_LSE
    out_a[0] = float("nan")
    lse_b[3] = -6e4  # a real LSE below the sentinel is still a part with keys
    want_out, want_lse = merge(out_a, lse_a, out_b, lse_b, torch.float64)
    out, lse = (out_a.clone(), lse_a.clone()) if in_place else (poisoned(out_a), poisoned(lse_a))
    NativeBackend().merge_state(out if in_place else out_a, lse if in_place else lse_a, out_b, lse_b, out=out, lse=lse)
    atol, rtol = {torch.float32: (1e-6, 1e-6), torch.float16: (1e-3, 1e-3), torch.bfloat16: (1e-2, 1e-2)}[dtype]
    torch.testing.assert_close(out.double(), want_out, atol=atol, rtol=rtol)
    torch.testing.assert_close(lse.double(), want_lse, atol=1e-4, rtol=1e-6)


def test_unsupported_calls_give_reasons():
    backend = NativeBackend()
    assert "CPU" in backend.unsupported(AttentionSpec(torch.device("meta"), torch.float32, 4, 2, 64, 64))
    assert "float32" in backend.unsupported(AttentionSpec(torch.device("cpu"), torch.float64, 4, 2, 64, 64))
    assert "query heads per KV head" in backend.unsupported(AttentionSpec(torch.device("cpu"), torch.float32, 512, 1, 8, 8))
    # every variant runs in the kernel (tests/test_native_variants.py), MLA's head dims and groups too
    assert backend.unsupported(AttentionSpec(torch.device("cpu"), torch.float32, 128, 1, 576, 512, sliding_window=8,
                                             logit_softcap=30.0, sinks=True)) is None
    assert "not available" in NativeBackend(isa="avx9000").unsupported(AttentionSpec(torch.device("cpu"), torch.float32, 4, 2, 8, 8))


def test_build_cache_is_named_by_the_sources(tmp_path, monkeypatch):
    """Two different kernels (checkouts, versions) get different build folders: neither rebuilds over the
    other's cache."""
    from treeattn.backends.native import build

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    csrc = tmp_path / "csrc"
    shutil.copytree(build.CSRC, csrc)
    monkeypatch.setattr(build, "CSRC", csrc)
    first = build.default_build_directory()
    assert first.startswith(str(tmp_path / "ext")) and first == build.default_build_directory()
    (csrc / "kernel.hpp").write_text((csrc / "kernel.hpp").read_text() + "\n// changed\n")
    assert build.default_build_directory() != first


def test_a_killed_build_leaves_no_lock_that_blocks_the_next(tmp_path, monkeypatch):
    """PyTorch's build lock file, left by a build killed mid-way, must not make the next process wait forever."""
    monkeypatch.setenv("CXX", "false")  # fails fast: the point is getting past the lock
    build = tmp_path / "build"
    build.mkdir()
    (build / "lock").touch()
    extension = Extension(build_directory=str(build))
    with pytest.warns(RuntimeWarning, match="could not be built"):
        assert "could not be built" in NativeBackend(extension=extension).unavailable()
    assert not (build / "lock").exists()


def test_build_failure_falls_back_with_a_warning(tmp_path, monkeypatch):
    """No working compiler: one warning, and the backend reports itself unavailable (dispatch then picks the
    next backend) instead of crashing."""
    monkeypatch.setenv("CXX", "false")  # a "compiler" that always fails
    extension = Extension(build_directory=str(tmp_path / "build"))
    with pytest.warns(RuntimeWarning, match="could not be built"):
        reason = NativeBackend(extension=extension).unavailable()
    assert "could not be built" in reason
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # reported once, not on every call
        assert NativeBackend(extension=extension).unavailable() == reason
    with pytest.raises(RuntimeError, match="could not be built"):
        extension.module()



def test_the_operators_run_a_native_backend_object_as_configured(monkeypatch):
    """``backend=NativeBackend(isa=...)`` through the public operators runs that path (ragged and paged, a
    plan reused across paths), not the registry's default; each path's result is right."""
    seen = []  # the paths of the calls the operators make (not the self-checks')
    ragged, paged = NativeBackend.tree_attention, NativeBackend.paged_tree_attention

    def spy_ragged(self, q, k, v, plan, state, **kwargs):
        seen.append(state.isa)
        ragged(self, q, k, v, plan, state, **kwargs)

    def spy_paged(self, q, kv, plan, state, **kwargs):
        seen.append(state.isa)
        paged(self, q, kv, plan, state, **kwargs)

    monkeypatch.setattr(NativeBackend, "tree_attention", spy_ragged)
    monkeypatch.setattr(NativeBackend, "paged_tree_attention", spy_paged)
    batch = make_batch(MIXED, seed=5, page_size=16)
    want = reference(batch)
    plan = TreeAttentionPlan.ragged(batch.q_indptr, batch.kv_indptr, batch.tree_indptr, batch.tree_order)
    for isa in ISAS:
        got = treeattn.tree_attention(*batch.ragged_args(), sm_scale=0.125, backend=NativeBackend(isa=isa), plan=plan)
        assert_close_to_reference(*got, *want, torch.float32)
        got = treeattn.paged_tree_attention(*batch.paged_args(), sm_scale=0.125, backend=NativeBackend(isa=isa))
        assert_close_to_reference(*got, *want, torch.float32)
    assert seen == [isa for isa in ISAS for _ in range(2)]
