"""Triton kernels on CPU through Triton's interpreter, against the float64 reference.

``TRITON_INTERPRET=1`` must be set before triton is first imported (triton builds its own
``tl.sum``/``tl.max`` for one mode at import), so it is set at the top of this module, which
pytest imports at collection, before any test runs. If some earlier module already imported
triton without it, this module instead runs itself in a fresh pytest process (one test).

Every output buffer is poisoned with NaN first. bf16 runs through the fp32-dot path here,
because the interpreter's bf16 ``tl.dot`` is wrong (environment.md); bf16 tensor-core dots are
covered by tests/test_triton_compile.py and bench/gpu.py on a GPU.
"""

import os
import subprocess
import sys

_TRITON_IMPORTED_COMPILED = "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1"
os.environ["TRITON_INTERPRET"] = "1"

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

pytest.importorskip("triton")

import treeattn  # noqa: E402
from tests.helpers import (MIXED, Request, assert_close_to_reference, binary, chain, forest, make_batch,  # noqa: E402
                   outputs_for, parent_arrays, poisoned, random_tree, star)
from treeattn.backends import triton as tb  # noqa: E402
from treeattn.backends.triton.dispatch import cdiv, choose_tiles, partition_arrays, split_chunk  # noqa: E402
from treeattn.plan import TreeAttentionPlan  # noqa: E402

pytestmark = pytest.mark.triton

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


def _ragged_plan(b):
    return TreeAttentionPlan.ragged(b.q_indptr, b.kv_indptr, b.tree_indptr, b.tree_order)


def _paged_plan(b):
    e = b.extra
    return TreeAttentionPlan.paged(b.q_indptr, e["page_indptr"], e["page_indices"], e["last_page_len"],
                                   b.tree_indptr, b.tree_order, page_size=e["kv_pages"].shape[3],
                                   num_pages=e["kv_pages"].shape[0])


def _prepare(plan, b, kv_chunk):
    h_kv = b.k.shape[1]
    return tb.prepare(plan, num_q_heads=b.q.shape[1], num_kv_heads=h_kv, head_dim=b.q.shape[2], dtype=b.q.dtype,
                      kv_chunk=kv_chunk)


def check_ragged(b, *, kv_chunk=None, expect_split=None, **kw):
    ref = treeattn.tree_attention(*b.ragged_args(), backend="reference", **kw)
    plan = _ragged_plan(b)
    part = _prepare(plan, b, kv_chunk)
    if expect_split is not None:
        assert part.launch_merge == expect_split
    out, lse = outputs_for(b.q)
    res = treeattn.tree_attention(*b.ragged_args(), backend="triton", plan=plan, out=out, lse=lse, **kw)
    assert res[0] is out and res[1] is lse
    assert_close_to_reference(out, lse, *ref, b.q.dtype)
    return out, lse


def check_paged(b, *, kv_chunk=None, expect_split=None):
    ref = treeattn.tree_attention(*b.ragged_args(), backend="reference")
    plan = _paged_plan(b)
    part = _prepare(plan, b, kv_chunk)
    if expect_split is not None:
        assert part.launch_merge == expect_split
    out, lse = outputs_for(b.q)
    treeattn.paged_tree_attention(*b.paged_args(), backend="triton", plan=plan, out=out, lse=lse)
    assert_close_to_reference(out, lse, *ref, b.q.dtype)
    return out, lse


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


def test_ragged_strided_inputs():
    """q, k and v as views with their own strides (a fused qkv buffer), as a model hands them over."""
    b = make_batch(LONG, h_q=4, h_kv=2, d=64, dtype=torch.float16, seed=17)
    fused = torch.randn(b.k.shape[0], 3, 2, 64).half()
    fused[:, 0], fused[:, 2] = b.k, b.v
    b.k, b.v = fused[:, 0], fused[:, 2]
    b.q = torch.cat([b.q, b.q], dim=1)[:, 2:6]  # a view into a wider tensor: token stride 8 * d
    assert b.k.stride(0) == 6 * 64 and not b.q.is_contiguous()
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
def test_ragged_inline_rope_tvm_layout(rope, dtype):
    """TVM's layout: kv_indptr == q_indptr, k positions default to q positions (tree nodes at prefix + depth)."""
    reqs = [Request(binary(7)), Request(forest(chain(3), star(4))), Request(chain(5))]
    b = make_batch(reqs, h_q=4, h_kv=2, d=64, dtype=dtype, seed=5)
    depths = [treeattn.TokenTree(r.parents).depth for r in reqs]
    q_pos = torch.cat([d + off for d, off in zip(depths, (1000, 20000, 7))]).to(torch.int32)
    check_ragged(b, rope=rope, q_positions=q_pos)


def test_ragged_inline_rope_with_prefix_split():
    """Separate k positions (a prefix in the ragged KV), split chunks, padded head dim."""
    b = make_batch(LONG[:2], h_q=4, h_kv=2, d=80, dtype=torch.float16, seed=6)
    gen = torch.Generator().manual_seed(0)
    q_pos = torch.randint(0, 5000, (b.q.shape[0],), generator=gen, dtype=torch.int32)
    k_pos = torch.randint(0, 5000, (b.k.shape[0],), generator=gen, dtype=torch.int32)
    check_ragged(b, kv_chunk=64, expect_split=True, rope=ROPES[0], q_positions=q_pos, k_positions=k_pos)


# ---------------------------------------------------------------- paged


@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_paged_page_sizes(page_size, dtype):
    b = make_batch(MIXED + LONG[:1], h_q=4, h_kv=2, d=64, dtype=dtype, seed=7, page_size=page_size)
    check_paged(b, kv_chunk=0, expect_split=False)


@pytest.mark.parametrize("page_size", [1, 16])
def test_paged_split_qo_less_than_tree(page_size):
    b = make_batch(LONG + [Request(binary(31), prefix=40, qo=16)], h_q=8, h_kv=2, d=128, dtype=torch.float16,
                   seed=8, page_size=page_size)
    check_paged(b, kv_chunk=64, expect_split=True)


def test_paged_bf16_and_padded_dim():
    b = make_batch(LONG, h_q=4, h_kv=1, d=80, dtype=torch.bfloat16, seed=9, page_size=16)
    check_paged(b, kv_chunk=64)


def test_paged_rejects_non_power_of_two_pages():
    b = make_batch([Request(chain(3), prefix=5)], h_q=2, h_kv=1, d=16, page_size=12)
    with pytest.raises(ValueError, match="power-of-two page size"):
        treeattn.paged_tree_attention(*b.paged_args(), backend="triton")


def test_head_dim_too_large_is_a_clear_error():
    b = make_batch([Request(chain(2))], h_q=1, h_kv=1, d=272)
    with pytest.raises(ValueError, match="head dim 272"):
        treeattn.tree_attention(*b.ragged_args(), backend="triton")


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(trees=st.lists(parent_arrays(max_size=24), min_size=1, max_size=3),
       prefixes=st.lists(st.integers(0, 80), min_size=3, max_size=3), data=st.data())
def test_paged_random_forests(trees, prefixes, data):
    reqs = [Request(t, prefix=p, qo=data.draw(st.integers(1, len(t)))) for t, p in zip(trees, prefixes)]
    b = make_batch(reqs, h_q=4, h_kv=2, d=32, dtype=torch.float32, seed=10, page_size=16)
    check_paged(b, kv_chunk=data.draw(st.sampled_from([0, 32])))


def test_tree_size_zero_everywhere():
    b = make_batch([Request((), prefix=40, qo=5), Request((), prefix=0, qo=3)], h_q=2, h_kv=2, d=64,
                   dtype=torch.float16, seed=11, page_size=16)
    out, lse = check_paged(b)
    assert (out[5:] == 0).all() and (lse[5:] == -5e4).all()


# ---------------------------------------------------------------- merge_state


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_merge_state(dtype):
    gen = torch.Generator().manual_seed(12)
    shape = (37, 5, 80)
    oa, ob = (torch.randn(shape, generator=gen).to(dtype) for _ in range(2))
    la, lb = (torch.randn(shape[:2], generator=gen) * 8 for _ in range(2))
    lb[:4] = -5e4  # an empty side gets zero weight
    ref = treeattn.merge_state(oa, la, ob, lb, backend="reference")
    out, lse = outputs_for(oa)
    treeattn.merge_state(oa, la, ob, lb, out=out, lse=lse, backend="triton")
    assert_close_to_reference(out, lse, *ref, dtype)
    torch.testing.assert_close(out[:4], oa[:4])
    treeattn.merge_state(oa, la, ob, lb, out=oa, lse=la, backend="triton")  # in place
    torch.testing.assert_close(oa, out)


def test_split_merge_equals_merge_state_of_halves():
    """Tree attention over a prefix split in two pieces, merged, equals one call over all keys."""
    b = make_batch([Request(binary(7), prefix=100)], h_q=4, h_kv=2, d=64, dtype=torch.float32, seed=13)
    whole = treeattn.tree_attention(*b.ragged_args(), backend="triton")
    cut = 60
    q_ip = b.q_indptr
    empty_tree = (torch.tensor([0, 0], dtype=torch.int32), torch.zeros(0, 2, dtype=torch.int32))
    first = treeattn.tree_attention(b.q, q_ip, b.k[:cut], b.v[:cut], torch.tensor([0, cut], dtype=torch.int32),
                                    *empty_tree, backend="triton")
    second = treeattn.tree_attention(b.q, q_ip, b.k[cut:], b.v[cut:],
                                     torch.tensor([0, b.k.shape[0] - cut], dtype=torch.int32),
                                     b.tree_indptr, b.tree_order, backend="triton")
    merged = treeattn.merge_state(*first, *second, backend="triton")
    torch.testing.assert_close(merged[0], whole[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(merged[1], whole[1], atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------- plan, partition, graphs, torch.library


def test_partition_covers_every_row_and_key_once():
    rng = np.random.default_rng(0)
    reqs = [Request(random_tree(rng, n, 0.2), prefix=p) for n, p in [(9, 300), (1, 0), (30, 1000), (4, 65)]]
    b = make_batch(reqs + [Request((), prefix=0, qo=2)], h_q=8, h_kv=2, d=64, seed=14)
    plan = _ragged_plan(b)
    tiles = choose_tiles(torch.float16, 64, 30 * 4)
    host = partition_arrays(plan, 4, tiles, chunk=128)
    seen = {}
    for req, row0, lo, hi, split in host["work"].tolist():
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
    """Fixed grids and buffers (as a CUDA graph replays them) serve batches of different shapes."""
    env = tb.GraphEnvelope(max_batch=6, max_tokens=64, max_qo_len=31, max_tree_nodes=80, max_pages=64,
                           num_q_heads=4, num_kv_heads=2, head_dim=64, dtype=torch.float16, device="cpu",
                           max_work=40, max_partial_rows=48)
    buffers = [t.data_ptr() for t in (env.partition.work, env.partition.o_part)]
    for seed, reqs in enumerate([LONG, MIXED[:4]]):
        b = make_batch(reqs, h_q=4, h_kv=2, d=64, dtype=torch.float16, seed=20 + seed, page_size=16)
        q = torch.cat([b.q, torch.randn(64 - b.q.shape[0], 4, 64).half()])  # padded to the envelope
        out, lse = poisoned(q), poisoned(q, q.shape[:2], torch.float32)
        plan = _paged_plan(b)
        env.bind(plan)
        env.run_paged(q, b.extra["kv_pages"], out, lse)
        ref = treeattn.tree_attention(*b.ragged_args(), backend="reference")
        rows = b.q.shape[0]
        assert_close_to_reference(out[:rows], lse[:rows], *ref, torch.float16)
        assert torch.isnan(out[rows:]).all()  # rows past the batch are left alone
    assert buffers == [t.data_ptr() for t in (env.partition.work, env.partition.o_part)]
    with pytest.raises(ValueError, match="more than this GraphEnvelope holds"):
        env.bind(_paged_plan(make_batch([Request(chain(40))] * 2, h_q=4, h_kv=2, d=64, page_size=16)))


def test_torch_library_ops_opcheck_and_compile():
    gen = torch.Generator().manual_seed(15)
    oa, ob = torch.randn(6, 2, 16, generator=gen), torch.randn(6, 2, 16, generator=gen)
    la, lb = torch.randn(6, 2, generator=gen), torch.randn(6, 2, generator=gen)
    torch.library.opcheck(torch.ops.treeattn.triton_merge_state.default,
                          (oa, la, ob, lb, torch.empty_like(oa), torch.empty_like(la)))

    b = make_batch([Request(binary(7), prefix=9)], h_q=2, h_kv=1, d=16, seed=16, page_size=16)
    plan = _paged_plan(b)
    part = _prepare(plan, b, kv_chunk=0)
    pages = b.extra["kv_pages"]
    t = part.tiles
    args = (b.q, pages[:, 0], pages[:, 1], part.requests, part.work, part.counts, part.token_request,
            part.tree_order, part.page_indices, part.o_part, part.lse_part, torch.empty_like(b.q),
            torch.empty(b.q.shape[:2]), 0.25, t.block_m, t.block_n, t.block_d, t.num_warps, t.num_stages,
            t.fp32_dot, part.grid_work, part.grid_tokens, part.launch_merge)
    torch.library.opcheck(torch.ops.treeattn.triton_tree_attention.default, args,
                          test_utils=("test_schema", "test_faketensor"))
    freqs, divide = ROPES[1].frequencies(16)
    torch.library.opcheck(torch.ops.treeattn.triton_rope.default,
                          (b.q, torch.arange(b.q.shape[0], dtype=torch.int32), freqs, torch.empty_like(b.q),
                           1.0, 1.0, divide))

    @torch.compile(backend="eager", fullgraph=True)
    def attend(q, kv_pages, out, lse):
        tb.run(part, q, kv_pages[:, 0], kv_pages[:, 1], out, lse, sm_scale=0.25)
        return out * 2, lse

    out, lse = outputs_for(b.q)
    doubled, lse = attend(b.q, pages, out, lse)
    ref = treeattn.tree_attention(*b.ragged_args(), backend="reference", sm_scale=0.25)
    assert_close_to_reference(doubled / 2, lse, *ref, torch.float32)
