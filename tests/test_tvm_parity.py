"""Parity with Apache TVM's own compiled CPU kernels (apache-tvm 0.27.0.post1, llvm): an independent oracle.

Every CPU backend of treeattn runs on the same random batch as TVM's ``tree_attn_cpu``,
``tree_attn_with_paged_kv_cache_cpu`` or ``_merge_state_inplace_cpu`` (outputs of both poisoned with
NaN first), with the ``tree_order`` that ``treeattn.pack_trees`` built, and we check TVM was fed
exactly those index arrays. Regions where TVM's behaviour is undefined (docs/semantics.md)
are not tested: a ragged request without keys (TVM's ragged LSE is never assigned), fully masked
rows, ``sm_scale`` so small that the CPU ragged kernel's masked score ``-5e4·log2(e)·sm_scale``
competes with real scores, and both merge sides empty.

Kernels are built once per process and shared across cases (see ``tvm_oracle``); TVM's results are
memoised per case so each extra backend only costs its own run. ``pytest -s`` prints the largest
errors seen per category.
"""

from __future__ import annotations

import functools
import math
import zlib
from collections import defaultdict

import numpy as np
import pytest
import torch

pytest.importorskip("tvm")

import treeattn
from tests import tvm_oracle as oracle
from tests.helpers import MIXED, Request, binary, chain, forest, make_batch, poisoned, random_tree, star
from treeattn.backends import available_backends, get_backend
from treeattn.lse import EMPTY_LSE

pytestmark = pytest.mark.tvm

# Outputs: (atol, rtol). fp32 absolute; fp16 3e-3 plus one fp16 ulp at any magnitude (|out| >= 4 has
# ulps of 4e-3, and a single rounding flip of the same fp32 value is not a disagreement).
OUT_TOL = {torch.float32: (2e-5, 0.0), torch.float16: (3e-3, 1e-3)}
LSE_RTOL = 1e-3
LSE_ATOL = 1e-4  # for LSEs near 0, where a relative bound means nothing

MAX_ERRORS: dict[str, list] = defaultdict(lambda: [0.0, None])  # category -> [out, lse or None]


@pytest.fixture(params=[b for b in available_backends("cpu") if b != "triton"])
def backend(request):
    try:
        get_backend(request.param)
    except ModuleNotFoundError as exc:  # a backend the registry names before its module has landed
        if exc.name and exc.name.startswith("treeattn"):
            pytest.skip(f"backend {request.param!r} has no module yet ({exc.name})")
        raise
    return request.param


@pytest.fixture(scope="module", autouse=True)
def error_table():
    yield
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"treeattn vs TVM: max errors ({oracle.build_count()} TVM kernels built)")
    for col in ("category", "max |Δout|", "max |Δlse|"):
        table.add_column(col)
    for name, (e_out, e_lse) in sorted(MAX_ERRORS.items()):
        table.add_row(name, f"{e_out:.2e}", "n/a" if e_lse is None else f"{e_lse:.2e}")
    Console().print(table)


def assert_parity(category: str, out, lse, tvm_out, tvm_lse, dtype) -> None:
    assert not torch.isnan(out).any() and not torch.isnan(lse).any(), "treeattn left output unwritten (NaN poison)"
    assert not torch.isnan(tvm_out).any() and not torch.isnan(tvm_lse).any(), "TVM left output unwritten"
    assert out.dtype == tvm_out.dtype == dtype and lse.dtype == tvm_lse.dtype == torch.float32
    if out.numel():
        stats = MAX_ERRORS[category]
        stats[0] = max(stats[0], (out.float() - tvm_out.float()).abs().max().item())
        stats[1] = max(stats[1] or 0.0, (lse - tvm_lse).abs().max().item())
    atol, rtol = OUT_TOL[dtype]
    torch.testing.assert_close(out.float(), tvm_out.float(), atol=atol, rtol=rtol)
    torch.testing.assert_close(lse, tvm_lse, atol=LSE_ATOL, rtol=LSE_RTOL)


def assert_fed_unchanged(fed: dict, **tensors) -> None:
    """TVM saw byte-identical int32 index arrays to the ones treeattn got (tree_order from pack_trees)."""
    for name, t in tensors.items():
        assert fed[name].dtype == np.int32 and t.dtype == torch.int32, name
        assert np.array_equal(fed[name], t.numpy()), f"TVM was fed a different {name}"


def assert_empty_rows(batch, out, lse, tvm_out, tvm_lse) -> None:
    """Requests without keys: out 0 and lse -5e4 exactly, on both sides."""
    for b, r in enumerate(batch.requests):
        if r.kv == 0 and r.rows:
            rows = slice(int(batch.q_indptr[b]), int(batch.q_indptr[b + 1]))
            for o, o_lse in ((out, lse), (tvm_out, tvm_lse)):
                assert torch.all(o[rows] == 0) and torch.all(o_lse[rows] == EMPTY_LSE)


def random_requests(seed: int, count: int, *, max_prefix: int, allow_short_qo: bool) -> list[Request]:
    rng = np.random.default_rng(seed)
    requests = []
    for _ in range(count):
        n = int(rng.integers(1, 40))
        parents = random_tree(rng, n, root_prob=float(rng.choice([0.0, 0.15])))
        qo = int(rng.integers(1, n + 1)) if allow_short_qo and rng.random() < 0.3 else None
        requests.append(Request(parents, prefix=int(rng.integers(0, max_prefix + 1)), qo=qo))
    return requests


# ---------------------------------------------------------------- shapes shared by every kernel family
# (h_kv, h_q, d, dtype, sm_scale): GQA groups 1/4/8, head dims 16/64/128, fp32/fp16, custom sm_scale.
# sm_scale >= 0.05 keeps the CPU ragged kernel's masked score (-5e4·log2e·sm_scale) far below real ones.
SHAPES = {
    "g1-d16-f32": (2, 2, 16, torch.float32, None),
    "g4-d64-f32-s0.3": (2, 8, 64, torch.float32, 0.3),
    "g8-d128-f16": (1, 8, 128, torch.float16, None),
    "g4-d64-f16-s1": (2, 8, 64, torch.float16, 1.0),
}

RAGGED_BATCHES = {
    # MIXED minus its request without keys (TVM's ragged kernel leaves that LSE unassigned, §5.4.3)
    "mixed": lambda: [r for r in MIXED if r.kv > 0],
    "shapes": lambda: [Request(chain(12), prefix=5), Request(star(11), prefix=0), Request([-1], prefix=0),
                       Request(forest(chain(3), star(4), [-1]), prefix=40, qo=5), Request((), prefix=9, qo=9)],
    "random": lambda: random_requests(11, 6, max_prefix=60, allow_short_qo=True),
}

PAGED_BATCHES = {
    "mixed": lambda: list(MIXED),
    # prefixes 0/15/16/17 and several pages, qo < tree (TVM's multi-round case), a request without pages
    "pages": lambda: [Request(binary(7), prefix=0), Request(binary(15), prefix=15), Request(chain(5), prefix=16),
                      Request(forest(binary(7), binary(7)), prefix=17), Request(binary(31), prefix=40, qo=16),
                      Request(random_tree(np.random.default_rng(5), 20, 0.2), prefix=83, qo=7),
                      Request((), prefix=0, qo=2), Request((), prefix=33, qo=3), Request(star(16), prefix=0)],
    "random": lambda: random_requests(12, 6, max_prefix=100, allow_short_qo=True),
}


def resolved_scale(sm_scale: float | None, d: int) -> float:
    """TVM takes sm_scale explicitly; treeattn gets None (its 1/sqrt(d) default) or the same value."""
    return sm_scale if sm_scale is not None else 1 / math.sqrt(d)


def _seed(*parts) -> int:
    """A stable per-case seed (``hash`` of a str changes between processes)."""
    return zlib.crc32("/".join(map(str, parts)).encode())


@functools.cache
def ragged_case(shape: str, batch_name: str):
    h_kv, h_q, d, dtype, sm_scale = SHAPES[shape]
    batch = make_batch(RAGGED_BATCHES[batch_name](), h_q=h_q, h_kv=h_kv, d=d, dtype=dtype,
                       seed=_seed("ragged", shape, batch_name))
    return batch, sm_scale, oracle.tree_attn(*batch.ragged_args(), sm_scale=resolved_scale(sm_scale, d))


@functools.cache
def paged_case(shape: str, batch_name: str):
    h_kv, h_q, d, dtype, sm_scale = SHAPES[shape]
    batch = make_batch(PAGED_BATCHES[batch_name](), h_q=h_q, h_kv=h_kv, d=d, dtype=dtype,
                       seed=_seed("paged", shape, batch_name), page_size=oracle.PAGE_SIZE, spare_pages=4)
    return batch, sm_scale, oracle.paged_tree_attn(*batch.paged_args(), sm_scale=resolved_scale(sm_scale, d))


@pytest.mark.parametrize("batch_name", list(RAGGED_BATCHES))
@pytest.mark.parametrize("shape", list(SHAPES))
def test_ragged_matches_tvm(backend, shape, batch_name):
    batch, sm_scale, (tvm_out, tvm_lse, fed) = ragged_case(shape, batch_name)
    assert_fed_unchanged(fed, q_indptr=batch.q_indptr, kv_indptr=batch.kv_indptr,
                         tree_indptr=batch.tree_indptr, tree_order=batch.tree_order)
    out, lse = poisoned(batch.q), poisoned(batch.q, batch.q.shape[:2], torch.float32)
    treeattn.tree_attention(*batch.ragged_args(), sm_scale=sm_scale, out=out, lse=lse, backend=backend)
    assert_parity(f"ragged {batch.q.dtype} | {backend}", out, lse, tvm_out, tvm_lse, batch.q.dtype)


@pytest.mark.parametrize("batch_name", list(PAGED_BATCHES))
@pytest.mark.parametrize("shape", list(SHAPES))
def test_paged_matches_tvm(backend, shape, batch_name):
    batch, sm_scale, (tvm_out, tvm_lse, fed) = paged_case(shape, batch_name)
    e = batch.extra
    assert_fed_unchanged(fed, q_indptr=batch.q_indptr, page_indptr=e["page_indptr"], page_indices=e["page_indices"],
                         last_page_len=e["last_page_len"], tree_indptr=batch.tree_indptr, tree_order=batch.tree_order)
    assert e["kv_pages"].shape[0] > len(e["page_indices"]), "the pool should hold unused pages"
    out, lse = poisoned(batch.q), poisoned(batch.q, batch.q.shape[:2], torch.float32)
    treeattn.paged_tree_attention(*batch.paged_args(), sm_scale=sm_scale, out=out, lse=lse, backend=backend)
    assert_parity(f"paged {batch.q.dtype} | {backend}", out, lse, tvm_out, tvm_lse, batch.q.dtype)
    assert_empty_rows(batch, out, lse, tvm_out, tvm_lse)


def test_paged_batches_cover_the_page_edges():
    """Guards the case list itself: prefixes 0/15/16/17, several pages, qo < tree, a request without pages."""
    reqs = PAGED_BATCHES["pages"]()
    assert {0, 15, 16, 17} <= {r.prefix for r in reqs}
    assert max(r.kv for r in reqs) > 4 * oracle.PAGE_SIZE
    assert any(r.rows < r.n for r in reqs) and any(r.kv == 0 and r.rows for r in reqs)
    assert any(r.kv % oracle.PAGE_SIZE == 0 and r.kv for r in reqs)  # a full last page


# ---------------------------------------------------------------- merge_state

@functools.cache
def merge_case(dtype: torch.dtype):
    gen = torch.Generator().manual_seed(_seed("merge", dtype))
    rows, heads, d = 37, 8, 64
    out_a = torch.randn(rows, heads, d, generator=gen).to(dtype)
    out_b = torch.randn(rows, heads, d, generator=gen).to(dtype)
    lse_a = torch.rand(rows, heads, generator=gen) * 30 - 10
    lse_b = lse_a + torch.randn(rows, heads, generator=gen) * 4  # comparable weights, plus some lopsided
    lse_b[::5] += 40.0
    lse_b[1::6] = EMPTY_LSE  # the side without keys: zero weight
    lse_a[2::7] = EMPTY_LSE
    lse_b[2::7] = lse_b[2::7].clamp(min=-10.0)  # never both empty (undefined region)
    return out_a, lse_a, out_b, lse_b, oracle.merge_state(out_a, lse_a, out_b, lse_b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_merge_state_matches_tvm(backend, dtype):
    out_a, lse_a, out_b, lse_b, (tvm_out, tvm_lse) = merge_case(dtype)
    out, lse = poisoned(out_a), poisoned(out_a, out_a.shape[:2], torch.float32)
    treeattn.merge_state(out_a, lse_a, out_b, lse_b, out=out, lse=lse, backend=backend)
    assert_parity(f"merge {dtype} | {backend}", out, lse, tvm_out, tvm_lse, dtype)
    empty_b = lse_b == EMPTY_LSE
    assert empty_b.any() and (lse_a == EMPTY_LSE).any()
    for o, o_lse in ((out, lse), (tvm_out, tvm_lse)):  # an empty side leaves the other one unchanged
        assert torch.equal(o[empty_b], out_a[empty_b]) and torch.equal(o_lse[empty_b], lse_a[empty_b])


# ---------------------------------------------------------------- inline RoPE (ragged kernel only)
# TVM ropes K at q_rope_position[kv offset], so every request has kv == q rows (kv_indptr == q_indptr):
# trees without an in-batch prefix, plus one request without a tree. Positions are a virtual cached
# prefix + depth, as TVM's runtime assigns them. They stay below 8000: an fp32 angle at position p is
# only good to ~p·6e-8 rad, so both sides drift from exact math (measured ~3e-4 on outputs at p ~ 7000,
# identically on both), and a one-ulp pow/cos difference in some platform's libm would move the angle by
# that much; at huge positions such a slip is noise, not semantics. Here the two sides compute
# bit-identical angles, which the element-wise rotation test at the end checks up to position 1e5.

LLAMA = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 512}
YARN = {"rope_type": "yarn", "factor": 4.0, "beta_fast": 32, "beta_slow": 1, "original_max_position_embeddings": 4096}
SCALINGS = {
    "default": {},
    "gptj": {"rope_type": "gptj"},
    "llama3": {"rope_type": "llama3", **LLAMA},
    "llama4": {"rope_type": "llama4", **LLAMA},
    "llama4-lf=hf": {"rope_type": "llama4", **LLAMA, "low_freq_factor": 2.0, "high_freq_factor": 2.0},
    "longrope-M/L>1": {"rope_type": "longrope", "max_position_embeddings": 131072,
                       "original_max_position_embeddings": 4096},
    "longrope-M/L<=1": {"rope_type": "longrope", "max_position_embeddings": 2048,
                        "original_max_position_embeddings": 4096},
    "yarn": YARN,
}
ROPE_SETTINGS = {"theta1e4-scale1": (1e4, 1.0), "theta5e5-scale0.5": (5e5, 0.5)}
ROPE_SHAPE = (2, 8, 64, torch.float32, 0.3)  # shares the default-RoPE build with SHAPES["g4-d64-f32-s0.3"]
ROPE_REQUESTS = [  # (request, virtual prefix)
    (Request(binary(15)), 0), (Request(forest(chain(4), star(5))), 1000), (Request(chain(9)), 7000),
    (Request(random_tree(np.random.default_rng(3), 24)), 4321), (Request((), prefix=6, qo=6), 250),
]


def scaling_for(name: str, theta: float) -> dict:
    scaling = dict(SCALINGS[name])
    if scaling.get("rope_type") == "yarn":  # TVM needs it precomputed; give both sides the same value
        scaling["inv_theta_log_scale"] = 1.0 / (2.0 * math.log(theta))
    return scaling


def rope_positions(requests_and_prefixes) -> torch.Tensor:
    parts = []
    for r, prefix in requests_and_prefixes:
        depth = treeattn.tree_depths(r.parents) if r.n else torch.arange(r.kv, dtype=torch.int32)
        parts.append(depth + prefix)
    return torch.cat(parts).to(torch.int32)


@functools.cache
def rope_case(scaling_name: str, setting: str, shape=ROPE_SHAPE):
    h_kv, h_q, d, dtype, sm_scale = shape
    theta, scale = ROPE_SETTINGS[setting]
    scaling = scaling_for(scaling_name, theta)
    batch = make_batch([r for r, _ in ROPE_REQUESTS], h_q=h_q, h_kv=h_kv, d=d, dtype=dtype,
                       seed=_seed("rope", scaling_name, setting, dtype))
    assert torch.equal(batch.q_indptr, batch.kv_indptr)
    positions = rope_positions(ROPE_REQUESTS)
    assert int(positions.max()) < 8000
    result = oracle.tree_attn(*batch.ragged_args(), sm_scale=resolved_scale(sm_scale, d), q_positions=positions,
                              rope_theta=theta,
                              rope_scale=scale, rope_scaling=scaling)
    return batch, sm_scale, positions, treeattn.RoPE(theta, scale, scaling), result


def _run_rope(backend, batch, sm_scale, positions, rope, result, category):
    tvm_out, tvm_lse, fed = result
    assert_fed_unchanged(fed, q_indptr=batch.q_indptr, kv_indptr=batch.kv_indptr, tree_indptr=batch.tree_indptr,
                         tree_order=batch.tree_order, q_positions=positions)
    out, lse = poisoned(batch.q), poisoned(batch.q, batch.q.shape[:2], torch.float32)
    treeattn.tree_attention(*batch.ragged_args(), sm_scale=sm_scale, rope=rope, q_positions=positions,
                            out=out, lse=lse, backend=backend)
    assert_parity(category, out, lse, tvm_out, tvm_lse, batch.q.dtype)
    return out


@pytest.mark.parametrize("setting", list(ROPE_SETTINGS))
@pytest.mark.parametrize("scaling_name", list(SCALINGS))
def test_inline_rope_matches_tvm(backend, scaling_name, setting):
    batch, sm_scale, positions, rope, result = rope_case(scaling_name, setting)
    out = _run_rope(backend, batch, sm_scale, positions, rope, result, f"rope {scaling_name} | {backend}")
    # the comparison must see RoPE at all: without it the output differs by far more than the tolerance
    plain, _ = treeattn.tree_attention(*batch.ragged_args(), sm_scale=sm_scale, backend="reference")
    assert (plain - out).abs().max() > 100 * OUT_TOL[batch.q.dtype][0]


def test_inline_rope_fp16_matches_tvm(backend):
    """fp16: q and k are rounded to fp16 after the fp32 rotation, on both sides (shares the g8-d128-f16 build)."""
    h_kv, h_q, d, dtype, sm_scale = SHAPES["g8-d128-f16"]
    batch, sm_scale, positions, rope, result = rope_case("default", "theta5e5-scale0.5",
                                                         shape=(h_kv, h_q, d, dtype, sm_scale))
    _run_rope(backend, batch, sm_scale, positions, rope, result, f"rope default fp16 | {backend}")


@pytest.mark.parametrize("dtype,d", [(torch.float32, 128), (torch.float16, 64)], ids=["f32-d128", "f16-d64"])
@pytest.mark.parametrize("setting", list(ROPE_SETTINGS))
@pytest.mark.parametrize("scaling_name", list(SCALINGS))
def test_rope_rotation_matches_tvm_elementwise(scaling_name, setting, dtype, d):
    """RoPE.apply against TVM's own ``_rope`` expression, element by element, at positions up to 1e5.

    Both sides evaluate the angle with the same float32 operations, so they agree to a couple of ulps
    even where fp32 angle rounding has drifted far from exact math (large positions): any formula or
    operation-order difference (e.g. a float64 constant where TVM folds in float32) shows up here.
    """
    theta, scale = ROPE_SETTINGS[setting]
    scaling = scaling_for(scaling_name, theta)
    gen = torch.Generator().manual_seed(_seed("rotation", scaling_name, setting, dtype))
    positions = torch.cat([torch.tensor([0, 1, 7, 100, 1000, 4095, 7999, 30000, 100000]),
                           torch.randint(0, 100001, (23,), generator=gen)]).to(torch.int32)
    x = torch.randn(len(positions), 3, d, generator=gen).to(dtype)
    expected = oracle.rope(x, positions, rope_theta=theta, rope_scale=scale, rope_scaling=scaling)
    got = treeattn.RoPE(theta, scale, scaling).apply(x, positions)
    assert got.dtype == expected.dtype == dtype and not torch.isnan(expected).any()
    if dtype == torch.float32:  # measured <= 2.4e-7 (cos/sin ulps); a one-ulp frequency slip gives ~1e-4
        torch.testing.assert_close(got, expected, atol=1e-6, rtol=0)
    else:  # at most one fp16 rounding flip of the same fp32 value
        torch.testing.assert_close(got.float(), expected.float(), atol=1e-3, rtol=1e-3)
    stats = MAX_ERRORS[f"rotation {scaling_name} {dtype}"]
    stats[0] = max(stats[0], (got.float() - expected.float()).abs().max().item())
