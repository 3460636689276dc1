"""Regressions for the defects of issue 15 in the operators, plans and the KV cache, plus extreme valid values.

Each test states the defect it pins. Bad input must raise a ValueError/TypeError naming the argument;
valid input, however extreme, must match the float64 reference.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading

import numpy as np
import pytest
import torch

import treeattn
from tests.helpers import Request, assert_close_to_reference, binary, chain, make_batch, outputs_for, random_tree, star
from treeattn.backends import available_backends
from treeattn.lse import EMPTY_LSE

BACKENDS = [b for b in available_backends("cpu") if b != "triton"]


def _run_python(code: str) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh interpreter, so that a crash fails a test instead of killing the run."""
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=300)


# ---------------------------------------------------------------- 1: zero query heads crashed the process

@pytest.mark.parametrize("threads", [1, 2])
def test_zero_query_heads_is_an_error_not_a_crash(threads):
    result = _run_python(f"""
        import torch, treeattn
        torch.set_num_threads({threads})
        ti, to = treeattn.pack_trees([[-1, 0]])
        k = torch.randn(5, 2, 16)
        try:
            treeattn.tree_attention(torch.randn(2, 0, 16), [0, 2], k, k, [0, 5], ti, to)
        except ValueError as exc:
            print("ValueError:", exc)
        cache = treeattn.PagedKVCache(1, 2, 16, num_pages=4, page_size=4, dtype=torch.float32)
        cache.add_sequence(0)
        cache.begin_forward([0], [2])
        try:
            cache.attention(0, torch.randn(2, 0, 16), torch.randn(2, 2, 16), torch.randn(2, 2, 16))
        except ValueError as exc:
            print("ValueError:", exc)
    """)
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("ValueError: q has 0 heads") == 2, result.stdout


# ---------------------------------------------------------------- 2: a plan shared by threads

@pytest.mark.parametrize("backend", BACKENDS)
def test_a_plan_shared_by_threads_gives_the_same_results(backend):
    """The CPU backend kept a gather buffer on the plan: two threads sharing a paged plan mixed outputs."""
    batch = make_batch([Request(binary(15), prefix=300), Request(chain(9), prefix=200, qo=5)], h_q=4, h_kv=2, d=32,
                       seed=5, page_size=16)
    e = batch.extra
    plan = treeattn.TreeAttentionPlan.paged(batch.q_indptr, e["page_indptr"], e["page_indices"], e["last_page_len"],
                                            batch.tree_indptr, batch.tree_order, page_size=16,
                                            num_pages=e["kv_pages"].shape[0])
    queries = [torch.randn_like(batch.q) for _ in range(4)]
    expected = [treeattn.paged_tree_attention(q, None, e["kv_pages"], None, None, None, None, None, plan=plan,
                                              backend=backend)[0] for q in queries]
    failures = []

    def worker(i: int):
        for _ in range(15):
            out, _ = treeattn.paged_tree_attention(queries[i], None, e["kv_pages"], None, None, None, None, None,
                                                   plan=plan, backend=backend)
            if not torch.equal(out, expected[i]):
                failures.append(i)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not failures


# ---------------------------------------------------------------- 3: a cache driven from two threads

def test_a_cache_used_from_two_threads_fails_loudly():
    cache = treeattn.PagedKVCache(1, 1, 8, num_pages=16, page_size=4, dtype=torch.float32)
    cache.add_sequence("a")
    cache.begin_forward(["a"], [3])
    errors = []

    def other():
        try:
            cache.attention(0, torch.randn(3, 1, 8), torch.randn(3, 1, 8), torch.randn(3, 1, 8))
        except RuntimeError as exc:
            errors.append(str(exc))

    t = threading.Thread(target=other)
    t.start()
    t.join()
    assert errors and "another thread" in errors[0] and "not thread-safe" in errors[0]
    cache.attention(0, torch.randn(3, 1, 8), torch.randn(3, 1, 8), torch.randn(3, 1, 8))  # the owner still can
    cache.end_forward()
    assert cache.seq_len("a") == 3


def test_concurrent_calls_on_one_cache_never_mix_sequences():
    """Two threads hammering one cache: every call either completes alone or raises; no key goes astray."""
    cache = treeattn.PagedKVCache(1, 1, 4, num_pages=256, page_size=4, dtype=torch.float32)
    for sid in (0, 1):
        cache.add_sequence(sid)
    rejected = []

    def worker(sid: int):
        for _ in range(150):
            try:
                cache.begin_forward([sid], [1])
            except RuntimeError:
                rejected.append(sid)
                continue
            try:
                value = torch.full((1, 1, 4), float(sid))
                cache.attention(0, value, value, value)
                cache.end_forward()
            except RuntimeError:  # cannot happen: only the opening thread passes the forward check
                cache.abort_forward()
                raise

    threads = [threading.Thread(target=worker, args=(sid,)) for sid in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for sid in (0, 1):
        k, _ = cache.get_kv(sid, 0)
        assert torch.all(k == sid), f"sequence {sid} holds another sequence's keys"


# ---------------------------------------------------------------- 4: the empty-KV sentinel in merges

@pytest.mark.parametrize("backend", BACKENDS)
def test_an_empty_part_never_outweighs_a_real_one(backend):
    out_real = torch.randn(3, 2, 8)
    lse_real = torch.tensor([[-6e4, -1e5], [-5.1e4, 3.0], [-4e4, -7e4]])
    out_empty = torch.zeros(3, 2, 8)
    lse_empty = torch.full((3, 2), EMPTY_LSE)
    for args in ((out_real, lse_real, out_empty, lse_empty), (out_empty, lse_empty, out_real, lse_real)):
        out, lse = treeattn.merge_state(*args, backend=backend)
        torch.testing.assert_close(out, out_real)
        torch.testing.assert_close(lse, lse_real)
    out, lse = treeattn.merge_state(out_empty, lse_empty, out_empty, lse_empty, backend=backend)
    assert (out == 0).all() and (lse == EMPTY_LSE).all()  # the sentinel back, not -49999
    minus_inf = torch.full((3, 2), float("-inf"))
    out, lse = treeattn.merge_state(out_empty, minus_inf, out_empty, minus_inf, backend=backend)
    assert (out == 0).all() and (lse == EMPTY_LSE).all()  # FlashInfer's empty: no NaN
    out, lse = treeattn.merge_state(out_real, lse_real, out_empty, minus_inf, backend=backend)
    torch.testing.assert_close(out, out_real)


def test_merge_round_of_a_fresh_sequence_with_tiny_scores_is_not_zeroed():
    """first_round='merge' with a fresh sequence batched beside one with a prefix, every score below -34,657."""
    cache = treeattn.PagedKVCache(1, 1, 4, num_pages=16, page_size=4, dtype=torch.float32, first_round="merge")
    cache.add_sequence("old")
    cache.add_sequence("new")
    cache.begin_forward(["old"], [5])
    kv = torch.randn(5, 1, 4)
    cache.attention(0, kv, kv, kv)
    cache.end_forward()
    info = cache.begin_forward(["old", "new"], [2, 2], [[-1, 0], [-1, 0]])
    q = torch.full((4, 1, 4), 1e3)
    k = torch.full((4, 1, 4), -1e3)  # scores -1e6 / 2: far below the sentinel's weight
    v = torch.randn(4, 1, 4)
    out = cache.attention(0, q, k, v, sm_scale=0.5)
    cache.end_forward()
    assert info.num_tokens == 4
    new_rows = out[2:]
    assert not torch.all(new_rows == 0)
    torch.testing.assert_close(new_rows[0], v[2])  # row 0 of "new" sees only itself


# ---------------------------------------------------------------- 5: NaN in a key a row cannot see

@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("where", ["k", "v"])
@pytest.mark.parametrize("prefix", [3, 2000])
def test_nan_in_an_invisible_key_does_not_reach_the_row(backend, where, prefix):
    parents = [-1, 0, 0, 1, 2]  # node 2 is invisible to nodes 1 and 3
    batch = make_batch([Request(parents, prefix=prefix)], h_q=4, h_kv=2, d=16, seed=1, page_size=16)
    getattr(batch, where)[prefix + 2] = float("nan")
    out, lse = outputs_for(batch.q)
    treeattn.tree_attention(*batch.ragged_args(), out=out, lse=lse, backend=backend)
    clean = [0, 1, 3]  # rows that cannot see node 2
    assert torch.isfinite(out[clean]).all() and torch.isfinite(lse[clean]).all()
    assert torch.isnan(out[[2, 4]]).all()  # rows that see it get NaN, as the formula would
    other = make_batch([Request(parents, prefix=prefix)], h_q=4, h_kv=2, d=16, seed=1, page_size=16)
    ref_out, ref_lse = treeattn.tree_attention(*other.ragged_args(), backend="reference")
    torch.testing.assert_close(out[clean], ref_out[clean], atol=2e-5, rtol=1e-5)


# ---------------------------------------------------------------- 6: plan= against other index arrays

def test_a_plan_rejects_index_arrays_it_was_not_built_from():
    a = make_batch([Request(binary(7), prefix=4)], h_q=2, h_kv=1, d=8, seed=2)
    b = make_batch([Request(chain(7), prefix=4)], h_q=2, h_kv=1, d=8, seed=2)
    plan = treeattn.TreeAttentionPlan.ragged(a.q_indptr, a.kv_indptr, a.tree_indptr, a.tree_order)
    with pytest.raises(ValueError, match="tree_order holds other values than the tree_order this plan was built"):
        treeattn.tree_attention(a.q, a.q_indptr, a.k, a.v, a.kv_indptr, a.tree_indptr, b.tree_order, plan=plan)
    same_values = a.tree_order.clone()
    treeattn.tree_attention(a.q, a.q_indptr, a.k, a.v, a.kv_indptr, a.tree_indptr, same_values, plan=plan)
    treeattn.tree_attention(a.q, None, a.k, a.v, None, None, None, plan=plan)  # None: the plan's own
    a.tree_order.copy_(b.tree_order)  # changed in place after planning
    with pytest.raises(ValueError, match="tree_order holds other values"):
        treeattn.tree_attention(*a.ragged_args(), plan=plan)


@pytest.mark.parametrize("backend", BACKENDS)
def test_changing_the_callers_arrays_after_planning_cannot_change_the_plan(backend):
    a = make_batch([Request(binary(7), prefix=4)], h_q=2, h_kv=1, d=8, seed=2)
    order = a.tree_order.clone()
    plan = treeattn.TreeAttentionPlan.ragged(a.q_indptr, a.kv_indptr, a.tree_indptr, order)
    before, _ = treeattn.tree_attention(a.q, None, a.k, a.v, None, None, None, plan=plan, backend=backend)
    order.copy_(treeattn.tree_order(chain(7)))
    after, _ = treeattn.tree_attention(a.q, None, a.k, a.v, None, None, None, plan=plan, backend=backend)
    ref, _ = treeattn.tree_attention(a.q, None, a.k, a.v, None, None, None, plan=plan, backend="reference")
    assert torch.equal(before, after)
    torch.testing.assert_close(after, ref.to(after.dtype), atol=2e-5, rtol=1e-5)


# ---------------------------------------------------------------- 11: errors that blamed the wrong argument

def test_plan_size_arguments_are_checked_by_name():
    args = ([0, 1], [0, 1], [0], [1], [0, 1], treeattn.tree_order([-1]))
    with pytest.raises(ValueError, match="page_size must be >= 1, got 0"):
        treeattn.TreeAttentionPlan.paged(*args, page_size=0, num_pages=4)
    with pytest.raises(TypeError, match="page_size must be an int, got float"):
        treeattn.TreeAttentionPlan.paged(*args, page_size=4.0, num_pages=4)
    with pytest.raises(TypeError, match="page_size must be an int"):
        treeattn.PagedKVCache(1, 1, 8, num_pages=4, page_size=4.0)


def test_numpy_scalars_are_numbers():
    batch = make_batch([Request(binary(3), prefix=2)], h_q=2, h_kv=1, d=8, seed=0)
    out_np, _ = treeattn.tree_attention(*batch.ragged_args(), sm_scale=np.float32(0.25))
    out_py, _ = treeattn.tree_attention(*batch.ragged_args(), sm_scale=0.25)
    assert torch.equal(out_np, out_py)


def test_meta_tensors_get_a_clear_error():
    q = torch.empty(2, 2, 8, device="meta")
    meta = lambda x: torch.tensor(x, dtype=torch.int32, device="meta")
    with pytest.raises(ValueError, match="tree_order is on cpu, expected meta"):
        treeattn.tree_attention(q, [0, 2], q, q, [0, 2], [0, 2], treeattn.tree_order([-1, 0]))
    with pytest.raises(ValueError, match="q_indptr is a meta tensor, which holds no values"):
        treeattn.tree_attention(q, meta([0, 2]), q, q, meta([0, 2]), meta([0, 2]), meta([[0, 2], [1, 2]]))


# ---------------------------------------------------------------- extreme valid values

EXTREMES = {
    "huge scores": dict(requests=[Request(binary(9), prefix=40)], scale=100.0),  # |scores| ~ 1e4
    "equal scores": dict(requests=[Request(star(9), prefix=40)], scale=0.0),
    "deep chain": dict(requests=[Request(chain(4096), prefix=3, qo=6)], scale=1.0),
    "wide star": dict(requests=[Request(star(4096), prefix=3, qo=6)], scale=1.0),
    "long prefix": dict(requests=[Request(random_tree(np.random.default_rng(0), 12), prefix=100_000, qo=3)],
                        scale=1.0),
    "256 requests": dict(requests=[Request(binary(3), prefix=p % 7) for p in range(256)], scale=1.0),
}


@pytest.mark.parametrize("backend", [b for b in BACKENDS if b != "reference"])
@pytest.mark.parametrize("case", list(EXTREMES))
def test_extreme_valid_values_match_the_reference(backend, case):
    spec = EXTREMES[case]
    batch = make_batch(spec["requests"], h_q=2, h_kv=1, d=16, seed=4)
    if spec["scale"] == 0.0:
        batch.k.zero_()  # every score equal: a uniform average of the values
    else:
        batch.q.mul_(spec["scale"])
    out, lse = outputs_for(batch.q)
    treeattn.tree_attention(*batch.ragged_args(), out=out, lse=lse, backend=backend)
    ref_out, ref_lse = treeattn.tree_attention(*batch.ragged_args(), backend="reference")
    assert_close_to_reference(out, lse, ref_out, ref_lse, torch.float32)


@pytest.mark.parametrize("backend", [b for b in BACKENDS if b != "reference"])
def test_fp16_near_its_largest_value(backend):
    batch = make_batch([Request(binary(7), prefix=30)], h_q=2, h_kv=1, d=16, seed=6, dtype=torch.float16)
    batch.v.copy_((batch.v.float().sign() * 60000.0).half())
    out, lse = outputs_for(batch.q)
    treeattn.tree_attention(*batch.ragged_args(), out=out, lse=lse, backend=backend)
    ref_out, _ = treeattn.tree_attention(*batch.ragged_args(), backend="reference")
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.float(), ref_out.float(), atol=60.0, rtol=3e-3)


@pytest.mark.parametrize("backend", [b for b in BACKENDS if b != "reference"])
def test_rope_at_a_million(backend):
    batch = make_batch([Request(binary(7), prefix=5)], h_q=2, h_kv=1, d=16, seed=7)
    rope = treeattn.RoPE(5e5)
    q_pos = torch.arange(1_000_000, 1_000_007, dtype=torch.int32)
    k_pos = torch.arange(999_995, 1_000_007, dtype=torch.int32)
    out, lse = treeattn.tree_attention(*batch.ragged_args(), rope=rope, q_positions=q_pos, k_positions=k_pos,
                                       backend=backend)
    ref_out, ref_lse = treeattn.tree_attention(*batch.ragged_args(), rope=rope, q_positions=q_pos,
                                               k_positions=k_pos, backend="reference")
    assert_close_to_reference(out, lse, ref_out, ref_lse, torch.float32)


# ---------------------------------------------------------------- zero-size and numpy-made tensors

def _from_numpy(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a tensor made from numpy (zero-size ones carry strides (0, ..., 0) there)."""
    return torch.from_numpy(np.ascontiguousarray(t.numpy()))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("paged", [False, True], ids=["ragged", "paged"])
def test_zero_size_tensors_from_numpy_are_valid_input(backend, paged):
    """A step whose requests all have qo_len = 0 (q [0, h_q, d] from numpy: strides (0, 0, 0)) returns
    the empty result on every backend (the native kernel's stride check rejected it)."""
    batch = make_batch([Request(chain(3), prefix=20, qo=0), Request(binary(4), prefix=5, qo=0)], h_q=4, h_kv=2,
                       d=16, page_size=16 if paged else None)
    q = torch.from_numpy(np.zeros((0, 4, 16), dtype=np.float32))
    assert q.stride() == (0, 0, 0)
    index = [_from_numpy(t) for t in (batch.q_indptr, batch.tree_indptr, batch.tree_order)]
    if paged:
        e = batch.extra
        out, lse = treeattn.paged_tree_attention(q, index[0], e["kv_pages"], _from_numpy(e["page_indptr"]),
                                                 _from_numpy(e["page_indices"]), _from_numpy(e["last_page_len"]),
                                                 index[1], index[2], backend=backend)
    else:
        out, lse = treeattn.tree_attention(q, index[0], batch.k, batch.v, _from_numpy(batch.kv_indptr), index[1],
                                           index[2], backend=backend)
    assert out.shape == (0, 4, 16) and lse.shape == (0, 4)
    # No keys at all either: k and v [0, h_kv, d] from numpy.
    kv = torch.from_numpy(np.zeros((0, 2, 16), dtype=np.float32))
    none = torch.zeros(3, dtype=torch.int32)
    out, lse = treeattn.tree_attention(q, none, kv, kv, none, none, torch.zeros(0, 2, dtype=torch.int32),
                                       backend=backend)
    assert out.shape == (0, 4, 16) and lse.shape == (0, 4)
    rows = torch.from_numpy(np.zeros((0, 4, 16), dtype=np.float32))
    lses = torch.from_numpy(np.zeros((0, 4), dtype=np.float32))
    out, lse = treeattn.merge_state(rows, lses, rows, lses, backend=backend)
    assert out.shape == (0, 4, 16) and lse.shape == (0, 4)


@pytest.mark.parametrize("backend", BACKENDS)
def test_numpy_views_with_their_own_strides_match_the_reference(backend):
    """q, k and v as torch views of numpy slices (rows and heads strided, last dim contiguous)."""
    batch = make_batch([Request(random_tree(np.random.default_rng(5), 9), prefix=30), Request(star(4), prefix=3)],
                       h_q=4, h_kv=2, d=16)
    rng = np.random.default_rng(6)
    big_q = rng.standard_normal((batch.q.shape[0] * 2, 6, 16)).astype(np.float32)
    big_k, big_v = (rng.standard_normal((batch.k.shape[0], 5, 16)).astype(np.float32) for _ in range(2))
    q, k, v = torch.from_numpy(big_q[::2, 1:5]), torch.from_numpy(big_k[:, ::2][:, :2]), torch.from_numpy(big_v[:, 3:])
    args = (batch.q_indptr, batch.kv_indptr, batch.tree_indptr, batch.tree_order)
    out, lse = outputs_for(q)
    treeattn.tree_attention(q, args[0], k, v, *args[1:], out=out, lse=lse, backend=backend)
    ref_out, ref_lse = treeattn.tree_attention(q, args[0], k, v, *args[1:], backend="reference")
    assert_close_to_reference(out, lse, ref_out, ref_lse, torch.float32)


# ---------------------------------------------------------------- plans under torch.inference_mode

def test_a_plan_built_under_inference_mode_checks_its_arrays_by_value():
    """vLLM builds its step metadata under inference_mode, where tensors have no version counter: planning
    raised "Inference tensors do not track version counter"; now such arrays are checked by value."""
    batch = make_batch([Request(binary(7), prefix=20)], h_q=4, h_kv=2, d=16)
    with torch.inference_mode():
        q_indptr, kv_indptr = batch.q_indptr.clone(), batch.kv_indptr.clone()
        plan = treeattn.TreeAttentionPlan.ragged(q_indptr, kv_indptr, batch.tree_indptr, batch.tree_order)
        out, _ = treeattn.tree_attention(batch.q, q_indptr, batch.k, batch.v, kv_indptr, None, None, plan=plan)
        ref, _ = treeattn.tree_attention(*batch.ragged_args(), backend="reference")
        torch.testing.assert_close(out, ref.float(), atol=2e-5, rtol=1e-5)
        kv_indptr[1] -= 1  # changed in place after planning: refused, never silently used
        with pytest.raises(ValueError, match="kv_indptr holds other values"):
            treeattn.tree_attention(batch.q, q_indptr, batch.k, batch.v, kv_indptr, None, None, plan=plan)


def test_native_self_checks_run_under_inference_mode():
    """The native kernel's once-per-process self-check of a brgemm path builds a plan; the first bf16 call
    inside vLLM (under inference_mode) ran it there and failed. A fresh process, so the check runs now."""
    proc = _run_python("""
        import torch, treeattn
        from treeattn.testing import Request, binary, make_batch
        batch = make_batch([Request(binary(9), prefix=80)], h_q=8, h_kv=2, d=64, dtype=torch.bfloat16)
        with torch.inference_mode():
            out, lse = treeattn.tree_attention(*batch.ragged_args())
        ref, _ = treeattn.tree_attention(*batch.ragged_args(), backend="reference")
        assert (out.double() - ref).abs().max() < 3e-2, (out.double() - ref).abs().max()
        print("ok")
    """)
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stderr[-3000:]
