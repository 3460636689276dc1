"""Triton kernels on CPU through Triton's interpreter, against a float64 reference.

``TRITON_INTERPRET=1`` must be set before triton is first imported (triton builds its own
``tl.sum``/``tl.max`` for one mode at import), so it is set at the top of this module, which
pytest imports at collection, before any test runs. If some earlier module already imported
triton without it, this module instead runs itself in a fresh pytest process (one test).

The tests call the backend object directly (``TritonBackend.plan`` then its calls), as ``ops``
does. Every output buffer is poisoned with NaN first. bf16 runs through the fp32-dot path here,
because the interpreter's bf16 ``tl.dot`` is wrong (environment.md); bf16 tensor-core dots are
covered by tests/test_triton_compile.py and bench/gpu.py on a GPU.
"""

import os
import subprocess
import sys

_TRITON_IMPORTED_COMPILED = "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1"
os.environ["TRITON_INTERPRET"] = "1"

import math  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

pytest.importorskip("triton")

import treeattn  # noqa: E402
from tests.helpers import (  # noqa: E402
    MIXED,
    Request,
    as_layout,
    assert_close_to_reference,
    binary,
    chain,
    forest,
    make_batch,
    outputs_for,
    parent_arrays,
    poisoned,
    random_tree,
    star,
)
from treeattn.backends import AttentionSpec, select  # noqa: E402
from treeattn.backends.triton import GraphEnvelope, TritonBackend  # noqa: E402
from treeattn.backends.triton.partition import cdiv, choose_tiles, partition_arrays, split_chunk  # noqa: E402
from treeattn.backends.triton.tables import WorkColumn  # noqa: E402
from treeattn.layout import PagedKV  # noqa: E402
from treeattn.lse import EMPTY_LSE  # noqa: E402
from treeattn.plan import TreeAttentionPlan  # noqa: E402

pytestmark = pytest.mark.triton
BACKEND = TritonBackend()

if _TRITON_IMPORTED_COMPILED:
    def test_interpreter_suite_in_fresh_process():
        """triton was imported before this module could set TRITON_INTERPRET: rerun it cleanly."""
        env = dict(os.environ, TRITON_INTERPRET="1")
        result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", __file__],
                                env=env, capture_output=True, text=True, cwd=os.path.dirname(__file__))
        assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]


@pytest.fixture(autouse=True)
def _interpreter_ready(request):
    if _TRITON_IMPORTED_COMPILED and request.node.name != "test_interpreter_suite_in_fresh_process":
        pytest.skip("triton was imported before TRITON_INTERPRET was set; covered by the fresh-process rerun")


# ---------------------------------------------------------------- runs through the backend


def ref(b, **kw):
    """The float64 reference on the ragged keys (it never touches the paged addressing)."""
    return treeattn.tree_attention(*b.ragged_args(), backend="reference", **kw)


def ragged_plan(b):
    return TreeAttentionPlan.ragged(b.q_indptr, b.kv_indptr, b.tree_indptr, b.tree_order)


def paged_plan(b):
    e = b.extra
    return TreeAttentionPlan.paged(b.q_indptr, e["page_indptr"], e["page_indices"], e["last_page_len"],
                                   b.tree_indptr, b.tree_order, page_size=e["kv_pages"].shape[3],
                                   num_pages=e["kv_pages"].shape[0])


def paged_kv(b, layout: str = "TVM") -> PagedKV:
    """``b``'s pages in an engine's layout (``testing.as_layout``), viewed as the kernels read them."""
    return PagedKV.wrap(*as_layout(b.extra["kv_pages"], layout))


def spec_of(q, h_kv: int, page_size=None, *, v_head_dim=None, sinks=None, **variants) -> AttentionSpec:
    """The spec of a call; ``variants``: ``sliding_window``/``logit_softcap`` values, ``sinks`` a tensor."""
    return AttentionSpec(q.device, q.dtype, q.shape[1], h_kv, q.shape[2], v_head_dim or q.shape[2], page_size,
                         sinks=sinks is not None, **variants)


def check_ragged(b, *, kv_chunk=None, expect_split=None, sm_scale=None, **variants):
    """Ragged tree attention through the backend (``kv_chunk`` forces the split; ``variants`` as the ops take
    them) against the reference."""
    sm_scale = sm_scale or 1 / math.sqrt(b.q.shape[2])
    plan = ragged_plan(b)
    state = BACKEND.plan(plan, spec_of(b.q, b.k.shape[1], v_head_dim=b.v.shape[2], **variants), kv_chunk=kv_chunk)
    if expect_split is not None:
        assert state.launch_merge == expect_split
    out, lse = outputs_for(b.q, b.v.shape[2])
    BACKEND.tree_attention(b.q, b.k, b.v, plan, state, sm_scale=sm_scale, out=out, lse=lse, sinks=variants.get("sinks"))
    assert_close_to_reference(out, lse, *ref(b, sm_scale=sm_scale, **variants), b.q.dtype)
    return out, lse


def check_paged(b, layout: str = "TVM", *, kv_chunk=None, expect_split=None, kv=None, **variants):
    """Paged tree attention over ``b``'s pages in ``layout`` (or over ``kv``) against the ragged reference."""
    kv = kv or paged_kv(b, layout)
    plan = paged_plan(b)
    spec = spec_of(b.q, kv.num_kv_heads, kv.page_size, v_head_dim=kv.v_head_dim, **variants)
    state = BACKEND.plan(plan, spec, kv_chunk=kv_chunk)
    if expect_split is not None:
        assert state.launch_merge == expect_split
    out, lse = outputs_for(b.q, kv.v_head_dim)
    BACKEND.paged_tree_attention(b.q, kv, plan, state, sm_scale=1 / math.sqrt(b.q.shape[2]), out=out, lse=lse,
                                 sinks=variants.get("sinks"))
    assert_close_to_reference(out, lse, *ref(b, **variants), b.q.dtype)
    return out, lse


# Every engine's page layout; each is read by the kernel in place (K and V with their own strides).
LAYOUTS = ("TVM", "NHD", "HND", "views", "interleaved", "own-strides")


# A batch with prefixes long enough that a 64-key chunk splits several requests (and not others).
LONG = [
    Request(binary(15), prefix=150),
    Request(forest(chain(4), star(5)), prefix=70, qo=6),
    Request((), prefix=90, qo=2),
    Request((), prefix=0, qo=1),
    Request(chain(5), prefix=3),
]


# ---------------------------------------------------------------- ragged


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("split", [False, True])
def test_ragged_mixed_batch(dtype, split):
    b = make_batch(MIXED + LONG[:2], h_q=4, h_kv=2, d=64, dtype=dtype, seed=1)
    check_ragged(b, kv_chunk=64 if split else 0, expect_split=split)


@pytest.mark.parametrize("h_q,h_kv", [(8, 1), (3, 3), (6, 2)])
def test_ragged_gqa_groups(h_q, h_kv):
    b = make_batch(LONG, h_q=h_q, h_kv=h_kv, d=64, dtype=torch.float16, seed=2)
    check_ragged(b, kv_chunk=64)


@pytest.mark.parametrize("d", [128, 80, 16, 256])
def test_ragged_head_dims(d):
    b = make_batch(MIXED[:5], h_q=4, h_kv=2, d=d, dtype=torch.float16, seed=3)
    check_ragged(b)


@pytest.mark.parametrize("v_from", ["fused", "own"])
def test_ragged_strided_inputs(v_from):
    """q, k and v as views with their own strides (a fused qkv buffer), as a model hands them over;
    V from the same buffer (K's strides) or on its own (other strides)."""
    b = make_batch(LONG, h_q=4, h_kv=2, d=64, dtype=torch.float16, seed=17)
    fused = torch.randn(b.k.shape[0], 3, 2, 64).half()
    fused[:, 0], fused[:, 2] = b.k, b.v
    b.k, b.v = fused[:, 0], (fused[:, 2] if v_from == "fused" else b.v.contiguous())
    b.q = torch.cat([b.q, b.q], dim=1)[:, 2:6]  # a view into a wider tensor: token stride 8 * d
    assert b.k.stride(0) == 6 * 64 and not b.q.is_contiguous()
    assert (b.k.stride() == b.v.stride()) == (v_from == "fused")
    check_ragged(b, kv_chunk=64)


def test_ragged_fp32_large_scores_and_sm_scale():
    """Scores of hundreds in log2 units neither overflow nor lose the softmax."""
    b = make_batch(LONG[:2], h_q=2, h_kv=1, d=64, dtype=torch.float32, seed=4)
    b.q.mul_(40.0)
    out, lse = check_ragged(b, kv_chunk=64, sm_scale=0.3)
    assert lse.abs().max() > 200


ROPES = [
    treeattn.RoPE(theta=5e5, scale=0.5),
    treeattn.RoPE(theta=5e5, scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                     "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
    treeattn.RoPE(scaling={"rope_type": "longrope", "max_position_embeddings": 4096,
                           "original_max_position_embeddings": 256}),
    treeattn.RoPE(scaling={"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
                           "original_max_position_embeddings": 64}),
]


@pytest.mark.parametrize("rope", ROPES, ids=lambda r: r.rope_type)
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_rope_kernel_matches_rope_apply(rope, dtype):
    """The RoPE pass on strided input (a q slice of a fused buffer) equals ``RoPE.apply`` (TVM's formulas)."""
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(37, 10, 80, generator=gen).to(dtype)[:, 3:8]
    positions = torch.randint(0, 60000, (37,), generator=gen, dtype=torch.int32)
    got = BACKEND.rope(rope, x, positions)
    want = rope.apply(x, positions)
    assert got.dtype == dtype and got.is_contiguous()
    atol = 2e-5 if dtype == torch.float32 else 2e-3  # fp32 sin/cos of angles up to 6e4 rad; one fp16 ulp
    torch.testing.assert_close(got.float(), want.float(), atol=atol, rtol=atol)


def test_ragged_rope_then_attention_with_prefix_split():
    """The ops pipeline for inline RoPE: rotate q and k with the backend, then attend (split, padded dim)."""
    b = make_batch(LONG[:2], h_q=4, h_kv=2, d=80, dtype=torch.float16, seed=6)
    gen = torch.Generator().manual_seed(0)
    q_pos = torch.randint(0, 5000, (b.q.shape[0],), generator=gen, dtype=torch.int32)
    k_pos = torch.randint(0, 5000, (b.k.shape[0],), generator=gen, dtype=torch.int32)
    b.q, b.k = BACKEND.rope(ROPES[0], b.q, q_pos), BACKEND.rope(ROPES[0], b.k, k_pos)
    check_ragged(b, kv_chunk=64, expect_split=True)


# ---------------------------------------------------------------- paged: every layout, read in place


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("page_size", [1, 16, 64])
def test_paged_layouts_and_page_sizes(layout, page_size):
    b = make_batch(MIXED + LONG[:1], h_q=4, h_kv=2, d=32, dtype=torch.float16, seed=7, page_size=page_size)
    check_paged(b, layout, kv_chunk=0, expect_split=False)


@pytest.mark.parametrize("layout", ["TVM", "own-strides"])
@pytest.mark.parametrize("page_size", [1, 16])
def test_paged_split_qo_less_than_tree(layout, page_size):
    b = make_batch(LONG + [Request(binary(31), prefix=40, qo=16)], h_q=8, h_kv=2, d=128, dtype=torch.float16,
                   seed=8, page_size=page_size)
    check_paged(b, layout, kv_chunk=64, expect_split=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_dtypes_and_padded_dim(dtype):
    b = make_batch(LONG, h_q=4, h_kv=1, d=80, dtype=dtype, seed=9, page_size=16)
    check_paged(b, "views", kv_chunk=64)


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(trees=st.lists(parent_arrays(max_size=24), min_size=1, max_size=3),
       prefixes=st.lists(st.integers(0, 80), min_size=3, max_size=3), data=st.data())
def test_paged_random_forests(trees, prefixes, data):
    reqs = [Request(t, prefix=p, qo=data.draw(st.integers(1, len(t)))) for t, p in zip(trees, prefixes)]
    page_size = data.draw(st.sampled_from([1, 4, 16]))
    b = make_batch(reqs, h_q=4, h_kv=2, d=32, dtype=torch.float32, seed=10, page_size=page_size)
    check_paged(b, data.draw(st.sampled_from(LAYOUTS)), kv_chunk=data.draw(st.sampled_from([0, 32])))


def test_tree_size_zero_everywhere():
    b = make_batch([Request((), prefix=40, qo=5), Request((), prefix=0, qo=3)], h_q=2, h_kv=2, d=64,
                   dtype=torch.float16, seed=11, page_size=16)
    out, lse = check_paged(b)
    assert (out[5:] == 0).all() and (lse[5:] == EMPTY_LSE).all()


def largest_allocation(fn) -> int:
    """Bytes of the largest CPU allocation any op makes while ``fn()`` runs (torch's profiler)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    return max([e.cpu_memory_usage for e in prof.events()] + [0])


def test_paged_run_allocates_no_cache_sized_tensor():
    """The pages are read in place: nothing the run allocates (split workspace included) nears the cache's size."""
    b = make_batch([Request(binary(7), prefix=300)], h_q=2, h_kv=1, d=16, dtype=torch.float32, seed=12,
                   page_size=16, spare_pages=0)
    kv = paged_kv(b, "views")
    plan = paged_plan(b)
    state = BACKEND.plan(plan, spec_of(b.q, kv.num_kv_heads, kv.page_size), kv_chunk=64)
    assert state.launch_merge
    out, lse = outputs_for(b.q)
    k_bytes = kv.k.numel() * kv.k.element_size()
    assert largest_allocation(lambda: kv.k.contiguous()) >= k_bytes  # the probe sees a copy of the pages
    run = lambda: BACKEND.paged_tree_attention(b.q, kv, plan, state, sm_scale=0.25, out=out, lse=lse)
    assert 0 < largest_allocation(run) < k_bytes // 2
    assert_close_to_reference(out, lse, *ref(b, sm_scale=0.25), torch.float32)


# ---------------------------------------------------------------- attention variants
# (test_variants.py runs the whole variant grid on this backend too, when its process has the interpreter;
# these add what only the Triton plan has: split KV, windows skipping tiles, MLA's two-part head dim)


def sinks_for(h_q: int, seed: int, scale: float = 1.5) -> torch.Tensor:
    return torch.randn(h_q, generator=torch.Generator().manual_seed(seed)) * scale


VARIANTS = {
    "window 5": dict(sliding_window=5),
    "window 70": dict(sliding_window=70),
    "softcap 4": dict(logit_softcap=4.0),
    "sinks": dict(sinks=sinks_for(4, 0)),
    "all": dict(sliding_window=9, logit_softcap=20.0, sinks=sinks_for(4, 1, scale=4.0)),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("split", [False, True])
def test_ragged_variants_with_split_kv(variant, split):
    """Split chunks and their merge: a window narrows the chunks, the sinks join the merge once."""
    b = make_batch(LONG, h_q=4, h_kv=2, d=32, dtype=torch.float32, seed=40)
    check_ragged(b, kv_chunk=16 if split else 0, expect_split=split, **VARIANTS[variant])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_paged_variants_half_precision_own_v_strides(dtype):
    """Every variant at once, in fp16/bf16, V strided unlike K, split (a window wider than a 64-key chunk)."""
    b = make_batch(LONG, h_q=4, h_kv=2, d=64, dtype=dtype, seed=41, page_size=16)
    check_paged(b, "own-strides", kv_chunk=64, expect_split=True, **dict(VARIANTS["all"], sliding_window=70))


def test_a_window_skips_keys_outside_every_rows_window():
    """Keys below every row's window are never read: the plan starts each row block's work at its own window
    floor. NaN in those keys would reach the output through ``p = 0`` times NaN if read."""
    rng = np.random.default_rng(2)
    reqs = [Request(random_tree(rng, 20), prefix=400), Request((), prefix=300, qo=2), Request(chain(6), prefix=3)]
    b = make_batch(reqs, h_q=4, h_kv=2, d=16, dtype=torch.float32, seed=42)
    window = 40
    plan = ragged_plan(b)
    for r in range(plan.batch_size):
        first = max(int(plan.positions(r)[0].min()) - window + 1, 0)
        start = int(plan.kv_starts[r])
        b.k[start:start + first] = float("nan")
        b.v[start:start + first] = float("nan")
    for chunk in (0, 32):
        state = BACKEND.plan(plan, spec_of(b.q, 2, sliding_window=window), kv_chunk=chunk)
        work = state.work.numpy()
        assert work[work[:, 0] == 0, WorkColumn.KV_LO].min() == 400 - window + 1  # request 0's roots: position 400
        out, lse = outputs_for(b.q)
        BACKEND.tree_attention(b.q, b.k, b.v, plan, state, sm_scale=0.25, out=out, lse=lse)
        assert_close_to_reference(out, lse, *ref(b, sm_scale=0.25, sliding_window=window), torch.float32)


@pytest.mark.parametrize("window", [2, 8, 100])
def test_window_over_a_tree_not_numbered_parents_first(window):
    """A valid tree_order need not number parents first: a node deeper than its index sits at a position
    above its index, so a window that opens inside the tree can see a key below the window's start (each
    row block reads from the first such node). A three-node chain whose root is node 1, after and before a
    prefix, and a reversed chain whose root is its last node, in several row blocks, whole and split."""
    three = make_batch([Request([-1, 0, 1], prefix=0, qo=1), Request([-1, 0, 1], prefix=2, qo=1)], h_q=2, h_kv=1,
                       d=16, dtype=torch.float32, seed=window)
    three.tree_order[:] = torch.tensor([[1, 3], [0, 3], [2, 3]] * 2, dtype=three.tree_order.dtype)
    n = 150  # node j enters at n - 1 - j
    reversed_chain = make_batch([Request(chain(n), prefix=10)], h_q=8, h_kv=2, d=16, dtype=torch.float32,
                                seed=window + 1)
    reversed_chain.tree_order[:] = torch.stack([n - 1 - torch.arange(n), torch.full((n,), n)], 1).to(
        reversed_chain.tree_order.dtype)
    for b in (three, reversed_chain):
        plan = ragged_plan(b)
        for chunk in (0, 32):
            state = BACKEND.plan(plan, spec_of(b.q, b.k.shape[1], sliding_window=window), kv_chunk=chunk)
            out, lse = outputs_for(b.q)
            BACKEND.tree_attention(b.q, b.k, b.v, plan, state, sm_scale=0.25, out=out, lse=lse)
            assert_close_to_reference(out, lse, *ref(b, sm_scale=0.25, sliding_window=window), torch.float32)


@pytest.mark.parametrize("paged", [False, True], ids=["ragged", "paged"])
def test_mla_absorbed_form_split(paged):
    """MLA: one KV head of 576 dims (two dots: 512 + 64), V a view of its first 512, every query head packed
    on it; split KV with sinks and a window."""
    d, d_v, h_q = 576, 512, 16
    b = make_batch([Request(binary(7), prefix=70), Request(chain(3), prefix=20, qo=2)], h_q=h_q, h_kv=1, d=d,
                   seed=43, page_size=16)
    kw = dict(sliding_window=50, sinks=sinks_for(h_q, 2))
    b.v = b.k[..., :d_v]
    if paged:
        k_pages = b.extra["kv_pages"][:, 0].transpose(1, 2).contiguous()  # [P, page_size, 1, 576]: K's pages
        kv = PagedKV.wrap((k_pages, k_pages[..., :d_v]))
        assert kv.v.data_ptr() == kv.k.data_ptr()
        check_paged(b, kv=kv, kv_chunk=32, expect_split=True, **kw)
    else:
        check_ragged(b, kv_chunk=32, expect_split=True, **kw)


def test_v_head_dim_of_its_own():
    """V narrower and wider than K, as tensors of their own (not views)."""
    for d_v in (24, 128):
        b = make_batch(LONG[:3], h_q=6, h_kv=2, d=64, dtype=torch.float16, seed=44 + d_v)
        b.v = torch.randn(b.k.shape[0], 2, d_v, generator=torch.Generator().manual_seed(d_v)).half()
        check_ragged(b, kv_chunk=64, expect_split=True, logit_softcap=10.0)


# ---------------------------------------------------------------- through the public ops


def test_public_ops_run_every_layout_and_rope_on_triton():
    """``ops`` -> ``TritonBackend`` -> launcher -> kernel: paged with an engine layout, ragged with inline RoPE."""
    b = make_batch(LONG[:3], h_q=4, h_kv=2, d=32, dtype=torch.float16, seed=30, page_size=16)
    e = b.extra
    pages, kv_layout = as_layout(e["kv_pages"], "own-strides")
    out, lse = outputs_for(b.q)
    got = treeattn.paged_tree_attention(b.q, b.q_indptr, pages, e["page_indptr"], e["page_indices"],
                                        e["last_page_len"], b.tree_indptr, b.tree_order, kv_layout=kv_layout,
                                        out=out, lse=lse, backend="triton")
    assert got[0] is out and got[1] is lse
    assert_close_to_reference(out, lse, *ref(b), torch.float16)
    gen = torch.Generator().manual_seed(1)
    kw = dict(rope=ROPES[1], q_positions=torch.randint(0, 9000, (b.q.shape[0],), generator=gen, dtype=torch.int32),
              k_positions=torch.randint(0, 9000, (b.k.shape[0],), generator=gen, dtype=torch.int32))
    out, lse = outputs_for(b.q)
    treeattn.tree_attention(*b.ragged_args(), out=out, lse=lse, backend="triton", **kw)
    assert_close_to_reference(out, lse, *ref(b, **kw), torch.float16)


def test_the_interpreter_is_never_picked_by_default():
    """backend=None on CPU takes the CPU backend even with TRITON_INTERPRET=1 (a test tool, far slower)."""
    spec = AttentionSpec(torch.device("cpu"), torch.float32, 2, 1, 16, 16)
    assert BACKEND.unsupported(spec) is None and not BACKEND.auto
    assert select(None, spec).name != "triton"


# ---------------------------------------------------------------- capabilities


def test_unsupported_inputs_get_a_reason():
    spec = AttentionSpec(torch.device("cpu"), torch.float16, 4, 2, 64, 64, page_size=12)
    assert BACKEND.unsupported(spec) == "page size 12 is not a power of two"
    assert BACKEND.unsupported(AttentionSpec(torch.device("cpu"), torch.float16, 4, 2, 64, 64, page_size=16)) is None
    assert "head dim 600" in BACKEND.unsupported(AttentionSpec(torch.device("cpu"), torch.float16, 1, 1, 600, 512))
    assert "V head dim 576" in BACKEND.unsupported(AttentionSpec(torch.device("cpu"), torch.float16, 1, 1, 576, 576))
    assert "float64" in BACKEND.unsupported(AttentionSpec(torch.device("cpu"), torch.float64, 1, 1, 64, 64))
    mla = AttentionSpec(torch.device("cpu"), torch.float16, 16, 1, 576, 512, page_size=16, sliding_window=8,
                        logit_softcap=30.0, sinks=True)
    assert BACKEND.unsupported(mla) is None  # every variant, MLA's head dims
    assert BACKEND.unavailable() is None


def test_cpu_without_the_interpreter_is_unsupported(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET")
    reason = BACKEND.unsupported(AttentionSpec(torch.device("cpu"), torch.float16, 4, 2, 64, 64))
    assert "TRITON_INTERPRET=1" in reason
    assert "TRITON_INTERPRET changed" in BACKEND.unavailable()  # triton is imported in interpreter mode here


# ---------------------------------------------------------------- merge_state


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_merge_state(dtype):
    gen = torch.Generator().manual_seed(12)
    shape = (37, 5, 80)
    oa, ob = (torch.randn(shape, generator=gen).to(dtype) for _ in range(2))
    la, lb = (torch.randn(shape[:2], generator=gen) * 8 for _ in range(2))
    lb[:4] = EMPTY_LSE  # an empty side gets zero weight
    out, lse = outputs_for(oa)
    BACKEND.merge_state(oa, la, ob, lb, out=out, lse=lse)
    assert_close_to_reference(out, lse, *treeattn.merge_state(oa, la, ob, lb, backend="reference"), dtype)
    torch.testing.assert_close(out[:4], oa[:4])
    BACKEND.merge_state(oa, la, ob, lb, out=oa, lse=la)  # in place
    torch.testing.assert_close(oa, out)


def test_merge_state_empty_sides():
    """A side with no keys (EMPTY_LSE or -inf) gets zero weight whatever the other side's LSE, even a real
    LSE below the sentinel or a NaN in the empty side's output; two empty sides give 0 and EMPTY_LSE."""
    inf = float("inf")
    la = torch.tensor([[EMPTY_LSE, -inf, -6e4, EMPTY_LSE, -inf, 3.0]])
    lb = torch.tensor([[EMPTY_LSE, -inf, EMPTY_LSE, -inf, 2.0, -inf]])
    oa, ob = torch.randn(1, 6, 16), torch.randn(1, 6, 16)
    oa[0, 4], ob[0, 5] = float("nan"), float("nan")  # outputs of empty sides
    out, lse = outputs_for(oa)
    BACKEND.merge_state(oa, la, ob, lb, out=out, lse=lse)
    want = treeattn.merge_state(oa, la, ob, lb, backend="reference")
    assert_close_to_reference(out, lse, *want, torch.float32)
    assert (out[0, :2] == 0).all() and (lse[0, :2] == EMPTY_LSE).all()
    torch.testing.assert_close(out[0, 2], oa[0, 2])  # the real side wins although its LSE is below the sentinel


def test_split_merge_equals_merge_state_of_halves():
    """Tree attention over a prefix split in two pieces, merged, equals one call over all keys."""
    b = make_batch([Request(binary(7), prefix=100)], h_q=4, h_kv=2, d=64, dtype=torch.float32, seed=13)
    whole = check_ragged(b, kv_chunk=0)
    cut = 60
    first, second = make_batch([Request((), prefix=cut, qo=7)], h_q=4, h_kv=2, d=64), make_batch(
        [Request(binary(7), prefix=100 - cut)], h_q=4, h_kv=2, d=64)
    first.q = second.q = b.q
    first.k, first.v, second.k, second.v = b.k[:cut], b.v[:cut], b.k[cut:], b.v[cut:]
    parts = [check_ragged(part, kv_chunk=0) for part in (first, second)]
    out, lse = outputs_for(b.q)
    BACKEND.merge_state(*parts[0], *parts[1], out=out, lse=lse)
    torch.testing.assert_close(out, whole[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, whole[1], atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------- partition, graphs, torch.library


def test_partition_covers_every_row_and_key_once():
    rng = np.random.default_rng(0)
    reqs = [Request(random_tree(rng, n, 0.2), prefix=p) for n, p in [(9, 300), (1, 0), (30, 1000), (4, 65)]]
    b = make_batch(reqs + [Request((), prefix=0, qo=2)], h_q=8, h_kv=2, d=64, seed=14)
    plan = ragged_plan(b)
    tiles = choose_tiles(torch.float16, 64, 30 * 4)
    host = partition_arrays(plan, 4, tiles, chunk=128)
    seen = {}
    for req, row0, lo, hi, _split in host["work"].tolist():
        for row in range(row0, min(row0 + tiles.block_m, int(plan.qo_lens[req]) * 4)):
            seen.setdefault((req, row), []).append((lo, hi))
    for r in range(plan.batch_size):
        for row in range(int(plan.qo_lens[r]) * 4):
            spans = sorted(seen[(r, row)])
            covered = [k for lo, hi in spans for k in range(lo, hi)]
            assert covered == list(range(int(plan.kv_lens[r])))


def test_split_heuristic_fills_the_gpu_at_batch_1_and_not_at_batch_64():
    kv = np.array([32768])
    chunk = split_chunk(np.array([1]), kv, num_kv_heads=8, block_n=64, num_sms=132)
    assert 0 < chunk < 32768 and chunk % 64 == 0 and cdiv(32768, chunk) * 8 >= 132
    assert split_chunk(np.ones(64, np.int64), np.full(64, 4096), num_kv_heads=8, block_n=64, num_sms=132) == 0
    # 32 requests x 8 heads = 256 programs, under two per SM: split in two
    chunk = split_chunk(np.ones(32, np.int64), np.full(32, 32768), num_kv_heads=8, block_n=64, num_sms=132)
    assert cdiv(32768, chunk) == 2
    assert split_chunk(np.array([1]), np.array([300]), num_kv_heads=8, block_n=64, num_sms=132) == 0  # too short


def test_graph_envelope_rebinds_fixed_buffers():
    """Fixed grids and tables (as a CUDA graph replays them) serve batches of different shapes and layouts."""
    env = GraphEnvelope(max_batch=6, max_tokens=64, max_qo_len=31, max_tree_nodes=80, max_pages=64,
                        num_q_heads=4, num_kv_heads=2, head_dim=32, dtype=torch.float16, device="cpu",
                        max_work=40, max_partial_rows=48)
    tables = [t.data_ptr() for t in (env.partition.work, env.partition.requests)]
    for seed, (reqs, layout) in enumerate([(LONG, "TVM"), (MIXED[:4], "HND")]):
        b = make_batch(reqs, h_q=4, h_kv=2, d=32, dtype=torch.float16, seed=20 + seed, page_size=16)
        q = torch.cat([b.q, torch.randn(64 - b.q.shape[0], 4, 32).half()])  # padded to the envelope
        out, lse = poisoned(q), poisoned(q, q.shape[:2], torch.float32)
        plan = paged_plan(b)
        env.bind(plan)
        pages, kv_layout = as_layout(b.extra["kv_pages"], layout)
        env.run_paged(q, pages, out, lse, kv_layout=kv_layout)
        rows = b.q.shape[0]
        assert_close_to_reference(out[:rows], lse[:rows], *ref(b), torch.float16)
        assert torch.isnan(out[rows:]).all()  # rows past the batch are left alone
    assert tables == [t.data_ptr() for t in (env.partition.work, env.partition.requests)]
    with pytest.raises(ValueError, match="more than this GraphEnvelope holds"):
        env.bind(paged_plan(make_batch([Request(chain(40))] * 2, h_q=4, h_kv=2, d=32, page_size=16)))


def test_graph_envelope_with_variants():
    """An envelope fixed to a window and a soft-cap (MLA-like V, a view of K's first dims), sinks at each run,
    rebound to a second batch: positions and depths are refilled with the tables."""
    env = GraphEnvelope(max_batch=4, max_tokens=32, max_qo_len=15, max_tree_nodes=40, max_pages=40,
                        num_q_heads=4, num_kv_heads=1, head_dim=48, v_head_dim=32, dtype=torch.float32,
                        device="cpu", sliding_window=20, logit_softcap=8.0)
    sinks = sinks_for(4, 3)
    for seed, reqs in enumerate([LONG[:3], [Request(binary(15), prefix=40), Request(chain(4), prefix=70, qo=2)]]):
        b = make_batch(reqs, h_q=4, h_kv=1, d=48, seed=50 + seed, page_size=16)
        k_pages = b.extra["kv_pages"][:, 0].transpose(1, 2).contiguous()
        b.v = b.k[..., :32]
        env.bind(paged_plan(b))
        out, lse = outputs_for(b.q, 32)
        env.run_paged(b.q, (k_pages, k_pages[..., :32]), out, lse, sinks=sinks)
        assert_close_to_reference(out, lse, *ref(b, sliding_window=20, logit_softcap=8.0, sinks=sinks), torch.float32)
    with pytest.raises(ValueError, match="sliding_window must be >= 1"):
        GraphEnvelope(max_batch=1, max_tokens=1, max_qo_len=1, max_tree_nodes=1, num_q_heads=1, num_kv_heads=1,
                      head_dim=16, dtype=torch.float32, device="cpu", sliding_window=0)


def test_torch_library_ops_opcheck_and_compile():
    gen = torch.Generator().manual_seed(15)
    oa, ob = torch.randn(6, 2, 16, generator=gen), torch.randn(6, 2, 16, generator=gen)
    la, lb = torch.randn(6, 2, generator=gen), torch.randn(6, 2, generator=gen)
    torch.library.opcheck(torch.ops.treeattn.triton_merge_state.default,
                          (oa, la, ob, lb, torch.empty_like(oa), torch.empty_like(la)))

    b = make_batch([Request(binary(7), prefix=9)], h_q=2, h_kv=1, d=16, seed=16, page_size=16)
    kv = paged_kv(b, "views")
    plan = paged_plan(b)
    state = BACKEND.plan(plan, spec_of(b.q, kv.num_kv_heads, kv.page_size), kv_chunk=0)
    args = (b.q, kv.k, kv.v, torch.empty_like(b.q), torch.empty(b.q.shape[:2]), 0.25, kv.page_size, None,
            *state.op_args)
    torch.library.opcheck(torch.ops.treeattn.triton_tree_attention.default, args,
                          test_utils=("test_schema", "test_faketensor"))
    variants = BACKEND.plan(plan, spec_of(b.q, kv.num_kv_heads, kv.page_size, sliding_window=3, logit_softcap=5.0,
                                          sinks=sinks_for(2, 4)), kv_chunk=0)
    torch.library.opcheck(torch.ops.treeattn.triton_tree_attention.default,
                          (*args[:7], sinks_for(2, 4), *variants.op_args), test_utils=("test_schema", "test_faketensor"))
    freqs, divide = ROPES[1].frequencies(16)
    torch.library.opcheck(torch.ops.treeattn.triton_rope.default,
                          (b.q, torch.arange(b.q.shape[0], dtype=torch.int32), freqs, torch.empty_like(b.q),
                           1.0, 1.0, divide))

    @torch.compile(backend="eager", fullgraph=True)
    def attend(q, buf, out, lse):
        # PagedKV(...) rather than PagedKV.wrap: wrap's data-pointer check (MLA) breaks a fullgraph trace
        BACKEND.paged_tree_attention(q, PagedKV(buf[:, 0], buf[:, 1], "NHD"), plan, state, sm_scale=0.25,
                                     out=out, lse=lse)
        return out * 2, lse

    buf = torch.stack([kv.k, kv.v], dim=1)
    out, lse = outputs_for(b.q)
    doubled, lse = attend(b.q, buf, out, lse)
    assert_close_to_reference(doubled / 2, lse, *ref(b, sm_scale=0.25), torch.float32)
