"""GPU benchmark of the Triton backend: correctness first, then paged tree attention against peers.

    python bench/gpu.py --out bench/results            # on a CUDA GPU, well under 8 minutes on an H200
    python bench/gpu.py --dry-run --out /tmp/dry       # same code path on CPU (Triton interpreter), tiny grid

1. Correctness on the device: the Triton kernels against the float64 reference (fp16/bf16/fp32,
   page sizes 1/16/64, every engine page layout read in place, split and unsplit, inline RoPE,
   merge_state), a CUDA-graph replay through a
   ``GraphEnvelope`` rebound to a second batch, and the benchmark shapes against SDPA with a dense
   tree mask and FlexAttention.
2. Timing (CUDA events, inputs rotated so no call finds its KV in L2) of paged tree attention for
   T x context x batch, h_q/h_kv 32/8, d 128, bf16, page size 16, shuffled pages, against:
   SDPA's flash kernel with a lower-right causal mask on the same (q, kv) shape (no tree, a speed
   reference), SDPA with a dense tree mask, compiled FlexAttention with the tree as ``mask_mod``,
   and FlashInfer with a custom mask if it is installed.
3. The roofline floor of each shape, ``max(KV bytes / copy bandwidth, FLOPs / bf16 matmul rate)``
   with both rates measured on this device, and the fraction of it each method reaches.

Writes ``results.md``, ``results.json`` and ``results.png`` under ``--out``.
"""

from __future__ import annotations

import os
import sys

DRY_RUN = "--dry-run" in sys.argv
if DRY_RUN:  # the interpreter must be chosen before triton is first imported
    os.environ["TRITON_INTERPRET"] = "1"

import argparse  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
from dataclasses import dataclass, field  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

import treeattn  # noqa: E402
from treeattn.backends import AttentionSpec, get_backend  # noqa: E402
from treeattn.backends.reference import visible_mask  # noqa: E402
from treeattn.backends.triton import GraphEnvelope  # noqa: E402
from treeattn.layout import PagedKV  # noqa: E402
from treeattn.plan import TreeAttentionPlan  # noqa: E402
from treeattn.testing import (  # noqa: E402
    MIXED,
    Request,
    as_layout,
    assert_close_to_reference,
    binary,
    chain,
    make_batch,
    outputs_for,
)

console = Console()
FULL_GRID = {"T": (8, 26, 64, 128), "ctx": (1024, 4096, 16384, 32768), "batch": (1, 8, 32)}
DRY_GRID = {"T": (8,), "ctx": (40, 100), "batch": (1, 2)}
PAGE_SIZE = 16


# ---------------------------------------------------------------- timing and device rates


class Clock:
    """CUDA events on a GPU, perf_counter on CPU (dry run)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def sync(self):
        if self.cuda:
            torch.cuda.synchronize()

    def time_ms(self, fn, repeats: int) -> float:
        """Mean milliseconds of ``fn()`` over ``repeats`` back-to-back calls."""
        self.sync()
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(repeats):
                fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / repeats
        t0 = time.perf_counter()
        for _ in range(repeats):
            fn()
        return (time.perf_counter() - t0) * 1e3 / repeats


def timed(clock: Clock, calls: list, target_ms: float) -> float:
    """Mean ms per call, cycling through ``calls`` (one per rotated input set)."""
    state = {"i": 0}

    def one():
        calls[state["i"] % len(calls)]()
        state["i"] += 1

    for _ in range(min(3, len(calls) + 1)):
        one()  # warm-up (and compile)
    first = clock.time_ms(one, 1)
    repeats = max(3, min(200, int(target_ms / max(first, 1e-3))))
    repeats = max(repeats, len(calls))
    return clock.time_ms(one, repeats)


def graphed(clock: Clock, calls: list, target_ms: float) -> float:
    """Mean ms per call when all rotated calls are captured in one CUDA graph and replayed."""
    for c in calls:
        c()  # warm-up outside capture
    clock.sync()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for c in calls:
            c()
    return timed(clock, [graph.replay], target_ms) / len(calls)


def device_rates(device: torch.device, clock: Clock) -> dict:
    """Copy bandwidth (bytes/s, read + write) and bf16 matmul rate (FLOP/s), measured here."""
    n_bytes = (1 << 30) if device.type == "cuda" else (1 << 24)
    src = torch.empty(n_bytes // 2, dtype=torch.bfloat16, device=device).normal_()
    dst = torch.empty_like(src)
    ms = timed(clock, [lambda: dst.copy_(src)], 200 if device.type == "cuda" else 20)
    n = 8192 if device.type == "cuda" else 256
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    mm_ms = timed(clock, [lambda: a @ b], 200 if device.type == "cuda" else 20)
    return {"copy_bytes_per_s": 2 * n_bytes / (ms * 1e-3), "bf16_flops_per_s": 2 * n**3 / (mm_ms * 1e-3)}


# ---------------------------------------------------------------- one benchmark shape


@dataclass
class Shape:
    batch: int
    ctx: int
    T: int
    h_q: int = 32
    h_kv: int = 8
    d: int = 128

    @property
    def kv_len(self) -> int:
        return self.ctx + self.T

    def kv_bytes(self, itemsize: int = 2) -> int:
        return self.batch * self.kv_len * self.h_kv * self.d * 2 * itemsize

    def flops(self) -> float:
        return 4.0 * self.batch * self.h_q * self.T * self.kv_len * self.d


@dataclass
class Inputs:
    shape: Shape
    plan: TreeAttentionPlan
    args: tuple  # paged_tree_attention arguments after q and kv_pages
    qs: list
    pages: list
    enter: torch.Tensor  # [B, T] DFS enter of each node, for the Flex mask_mod
    exit: torch.Tensor
    extra: dict = field(default_factory=dict)


def draft_trees(rng: np.random.Generator, batch: int, T: int) -> list[list[int]]:
    """EAGLE-like draft trees: each node hangs below one of the last few nodes (wide and a few deep)."""
    out = []
    for _ in range(batch):
        parents = [-1]
        for i in range(1, T):
            parents.append(int(rng.integers(max(0, i - 6), i)))
        out.append(parents)
    return out


def rotations_for(set_bytes: int, device: torch.device) -> int:
    """Enough input copies that cycling through them streams from HBM, not L2."""
    if device.type != "cuda":
        return 2
    l2 = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 64 << 20) or (64 << 20)
    return int(min(32, max(1, math.ceil(3 * l2 / max(set_bytes, 1)))))


def build_inputs(shape: Shape, device: torch.device, dtype: torch.dtype, seed: int) -> Inputs:
    rng = np.random.default_rng(seed)
    gen = torch.Generator(device=device).manual_seed(seed)
    trees = draft_trees(rng, shape.batch, shape.T)
    tree_indptr, tree_order = treeattn.pack_trees(trees)
    pages_per = -(-shape.kv_len // PAGE_SIZE)
    num_pages = shape.batch * pages_per
    page_indices = torch.randperm(num_pages, generator=torch.Generator().manual_seed(seed)).to(torch.int32)
    page_indptr = torch.arange(0, num_pages + 1, pages_per, dtype=torch.int32)
    last = torch.full((shape.batch,), (shape.kv_len - 1) % PAGE_SIZE + 1, dtype=torch.int32)
    q_indptr = torch.arange(0, shape.batch * shape.T + 1, shape.T, dtype=torch.int32)
    to = lambda t: t.to(device)
    args = (to(q_indptr), to(page_indptr), to(page_indices), to(last), to(tree_indptr), to(tree_order))
    plan = TreeAttentionPlan.paged(*args[:4], *args[4:], page_size=PAGE_SIZE, num_pages=num_pages)
    rot = rotations_for(shape.kv_bytes(torch.finfo(dtype).bits // 8), device)
    pages = [torch.randn(num_pages, 2, shape.h_kv, PAGE_SIZE, shape.d, generator=gen, device=device, dtype=dtype)
             for _ in range(rot)]
    qs = [torch.randn(shape.batch * shape.T, shape.h_q, shape.d, generator=gen, device=device, dtype=dtype)
          for _ in range(rot)]
    order = tree_order.view(shape.batch, shape.T, 2)
    return Inputs(shape, plan, args, qs, pages, to(order[..., 0].contiguous()), to(order[..., 1].contiguous()))


def dense_kv(inp: Inputs, r: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotation ``r``'s keys/values as ``[B, h_kv, L, d]`` (what SDPA and Flex take), read through ``PagedKV``."""
    kv, plan = PagedKV.wrap(inp.pages[r]), inp.plan
    tables = [plan.page_indices_host[plan.page_starts[b]:plan.page_starts[b] + plan.num_pages[b]]
              for b in range(inp.shape.batch)]
    k, v = zip(*(kv.gather(table, inp.shape.kv_len) for table in tables))
    return torch.stack(k).transpose(1, 2).contiguous(), torch.stack(v).transpose(1, 2).contiguous()


def dense_mask(inp: Inputs) -> torch.Tensor:
    """bool [B, 1, T, L]: the prefix plus tree ancestors (the reference's own mask)."""
    masks = [visible_mask(inp.plan, b) for b in range(inp.shape.batch)]
    return torch.stack(masks)[:, None].to(inp.qs[0].device)


def q_bhtd(inp: Inputs, r: int) -> torch.Tensor:
    s = inp.shape
    return inp.qs[r].view(s.batch, s.T, s.h_q, s.d).transpose(1, 2)


# ---------------------------------------------------------------- methods


def method_treeattn(inp: Inputs, clock: Clock, target_ms: float, graph: bool):
    out = torch.empty_like(inp.qs[0])
    lse = torch.empty(out.shape[:2], device=out.device, dtype=torch.float32)
    calls = [lambda r=r: treeattn.paged_tree_attention(inp.qs[r], inp.args[0], inp.pages[r], *inp.args[1:],
                                                        plan=inp.plan, out=out, lse=lse, backend="triton")
             for r in range(len(inp.pages))]
    return graphed(clock, calls, target_ms) if graph else timed(clock, calls, target_ms)


def sdpa_causal_calls(inp: Inputs):
    """SDPA's flash kernel, lower-right causal (bottom-aligned like a decode step), same (q, kv) shape."""
    from torch.nn.attention.bias import causal_lower_right

    s = inp.shape
    bias = causal_lower_right(s.T, s.kv_len)
    kvs = [dense_kv(inp, r) for r in range(len(inp.pages))]
    if inp.qs[0].device.type == "cuda":
        flash = torch.ops.aten._scaled_dot_product_flash_attention
        try:
            flash(q_bhtd(inp, 0), *kvs[0], 0.0, True)
        except RuntimeError:  # no native GQA in this build's flash op: expand the KV heads once
            g = s.h_q // s.h_kv
            kvs = [(k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)) for k, v in kvs]
        return [lambda r=r: flash(q_bhtd(inp, r), *kvs[r], 0.0, True) for r in range(len(kvs))]
    return [lambda r=r: F.scaled_dot_product_attention(q_bhtd(inp, r), *kvs[r], attn_mask=bias, enable_gqa=True)
            for r in range(len(kvs))]


def sdpa_mask_calls(inp: Inputs):
    """SDPA with a dense tree mask (additive bf16 bias; KV heads expanded so the fused kernels apply)."""
    s = inp.shape
    g = s.h_q // s.h_kv
    mask = dense_mask(inp)
    bias = torch.zeros(mask.shape, dtype=inp.qs[0].dtype, device=mask.device).masked_fill_(~mask, float("-inf"))
    kvs = [tuple(x.repeat_interleave(g, 1) for x in dense_kv(inp, r)) for r in range(len(inp.pages))]
    return [lambda r=r: F.scaled_dot_product_attention(q_bhtd(inp, r), *kvs[r], attn_mask=bias)
            for r in range(len(kvs))]


_FLEX = {}


def flex_calls(inp: Inputs, compiled: bool):
    """FlexAttention with the tree as mask_mod (interval test on the DFS order, no dense mask)."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    if "fn" not in _FLEX:
        torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 256)
        _FLEX["fn"] = torch.compile(flex_attention) if compiled else flex_attention
    s = inp.shape
    enter, exit_, ctx = inp.enter, inp.exit, s.ctx

    def tree_mask(b, h, q_idx, kv_idx):
        node = (kv_idx - ctx).clamp(min=0)
        return (kv_idx < ctx) | ((enter[b, node] <= enter[b, q_idx]) & (enter[b, q_idx] < exit_[b, node]))

    block_mask = create_block_mask(tree_mask, s.batch, None, s.T, s.kv_len, device=str(inp.qs[0].device))
    kvs = [dense_kv(inp, r) for r in range(len(inp.pages))]
    fn = _FLEX["fn"]
    return [lambda r=r: fn(q_bhtd(inp, r), *kvs[r], block_mask=block_mask, enable_gqa=True) for r in range(len(kvs))]


def flashinfer_calls(inp: Inputs):
    """FlashInfer's paged prefill with a custom (tree) mask, on the same pages (HND layout)."""
    import flashinfer

    s = inp.shape
    device = inp.qs[0].device
    workspace = torch.empty(256 << 20, dtype=torch.uint8, device=device)
    wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, kv_layout="HND")
    mask = torch.cat([visible_mask(inp.plan, b).flatten() for b in range(s.batch)]).to(device)
    wrapper.plan(inp.args[0], inp.args[1], inp.args[2], inp.args[3], s.h_q, s.h_kv, s.d, PAGE_SIZE,
                 custom_mask=mask, q_data_type=inp.qs[0].dtype)
    return [lambda r=r: wrapper.run(inp.qs[r], inp.pages[r]) for r in range(len(inp.pages))]


# ---------------------------------------------------------------- correctness


def check_correctness(device: torch.device, dry: bool) -> list[dict]:
    """Triton vs the float64 reference on small batches; returns one row per check (raises on failure).

    Paged runs go through the backend object with a forced split (``TritonBackend.plan(kv_chunk=)``),
    with the pages in every engine layout; the reference reads the ragged keys."""
    triton = get_backend("triton")
    rows = []
    dtypes = [torch.float16, torch.bfloat16, torch.float32]
    layouts = ("TVM", "own-strides") if dry else ("TVM", "NHD", "HND", "views", "interleaved", "own-strides")
    long = [Request(binary(15), prefix=300), Request(chain(6), prefix=90, qo=4), Request((), prefix=0, qo=2)]
    for dtype in dtypes:
        for page_size in ((16,) if dry else (1, 16, 64)):
            b = make_batch(MIXED + long, h_q=8, h_kv=2, d=64 if dry else 128, dtype=dtype, seed=page_size,
                           page_size=page_size, device=device)
            ref = treeattn.tree_attention(*b.ragged_args(), backend="reference")
            e = b.extra
            plan = TreeAttentionPlan.paged(b.q_indptr, e["page_indptr"], e["page_indices"], e["last_page_len"],
                                           b.tree_indptr, b.tree_order, page_size=page_size,
                                           num_pages=e["kv_pages"].shape[0])
            spec = AttentionSpec(device, dtype, 8, 2, b.q.shape[2], b.q.shape[2], page_size)
            for chunk in (0, 64):
                state = triton.plan(plan, spec, kv_chunk=chunk)
                for layout in layouts:
                    kv = PagedKV.wrap(*as_layout(e["kv_pages"], layout))
                    out, lse = outputs_for(b.q)
                    triton.paged_tree_attention(b.q, kv, plan, state, sm_scale=1 / math.sqrt(b.q.shape[2]), out=out,
                                                lse=lse)
                    assert_close_to_reference(out, lse, *ref, dtype)
                    rows.append({"check": f"paged {str(dtype)[6:]} page {page_size} {layout} chunk {chunk}",
                                 "max_abs_err": float((out.double() - ref[0].double()).abs().max())})
        if dry and dtype == torch.bfloat16:
            continue  # the interpreter truncates fp32 -> bf16 casts (GPUs round to nearest): roped q/k differ
        out, lse = outputs_for(b.q)
        rope = treeattn.RoPE(theta=5e5, scale=0.5)
        pos_q = torch.arange(b.q.shape[0], device=device, dtype=torch.int32) * 37
        pos_k = torch.arange(b.k.shape[0], device=device, dtype=torch.int32) * 11
        kw = dict(rope=rope, q_positions=pos_q, k_positions=pos_k)
        ref_r = treeattn.tree_attention(*b.ragged_args(), backend="reference", **kw)
        treeattn.tree_attention(*b.ragged_args(), out=out, lse=lse, backend="triton", **kw)
        assert_close_to_reference(out, lse, *ref_r, dtype)
        rows.append({"check": f"ragged+rope {str(dtype)[6:]}",
                     "max_abs_err": float((out.double() - ref_r[0].double()).abs().max())})
    # merge_state
    oa, ob = (torch.randn(50, 8, 128, device=device, dtype=torch.bfloat16) for _ in range(2))
    la, lb = (torch.randn(50, 8, device=device) * 5 for _ in range(2))
    ref = treeattn.merge_state(oa, la, ob, lb, backend="reference")
    got = treeattn.merge_state(oa, la, ob, lb, backend="triton")
    assert_close_to_reference(*got, *ref, torch.bfloat16)
    rows.append({"check": "merge_state bf16", "max_abs_err": float((got[0].double() - ref[0].double()).abs().max())})
    if device.type == "cuda":
        rows.append(check_cuda_graph(device))
    return rows


def check_cuda_graph(device: torch.device) -> dict:
    """Capture once through a GraphEnvelope, rebind to a different batch, replay: same as the reference."""
    env = GraphEnvelope(max_batch=4, max_tokens=64, max_qo_len=31, max_tree_nodes=96, max_pages=256,
                           num_q_heads=8, num_kv_heads=2, head_dim=128, dtype=torch.bfloat16, device=device)
    batches = [make_batch([Request(binary(31), prefix=900), Request(chain(9), prefix=40)], h_q=8, h_kv=2, d=128,
                          dtype=torch.bfloat16, seed=s, page_size=16, device=device, spare_pages=0) for s in (1, 2)]
    q = torch.zeros(64, 8, 128, device=device, dtype=torch.bfloat16)
    pool = torch.zeros(256, 2, 2, 16, 128, device=device, dtype=torch.bfloat16)
    out = torch.zeros_like(q)
    lse = torch.zeros(64, 8, device=device)

    def load(b):
        e = b.extra
        plan = TreeAttentionPlan.paged(b.q_indptr, e["page_indptr"], e["page_indices"], e["last_page_len"],
                                       b.tree_indptr, b.tree_order, page_size=16, num_pages=256)
        q[:b.q.shape[0]].copy_(b.q)
        pool[:e["kv_pages"].shape[0]].copy_(e["kv_pages"])
        env.bind(plan)

    load(batches[0])
    env.run_paged(q, pool, out, lse)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        env.run_paged(q, pool, out, lse)
    errs = []
    for b in batches[::-1]:
        load(b)
        graph.replay()
        torch.cuda.synchronize()
        ref = treeattn.tree_attention(*b.ragged_args(), backend="reference")
        n = b.q.shape[0]
        assert_close_to_reference(out[:n], lse[:n], *ref, torch.bfloat16)
        errs.append(float((out[:n].double() - ref[0].double()).abs().max()))
    return {"check": "CUDA graph replay after rebind (GraphEnvelope)", "max_abs_err": max(errs)}


def check_against_peers(inp: Inputs, flex_compiled: bool) -> dict:
    """The benchmark shape itself: Triton vs SDPA with a dense mask and vs Flex (bf16 tolerance)."""
    out = torch.empty_like(inp.qs[0])
    lse = torch.empty(out.shape[:2], device=out.device)
    treeattn.paged_tree_attention(inp.qs[0], inp.args[0], inp.pages[0], *inp.args[1:], plan=inp.plan, out=out,
                                  lse=lse, backend="triton")
    mine = out.view(inp.shape.batch, inp.shape.T, inp.shape.h_q, -1).transpose(1, 2).float()
    row = {"check": f"B{inp.shape.batch} ctx{inp.shape.ctx} T{inp.shape.T} vs peers"}
    for name, calls in (("sdpa_mask", lambda: sdpa_mask_calls(inp)), ("flex", lambda: flex_calls(inp, flex_compiled))):
        theirs = calls()[0]().float()
        err = float((mine - theirs).abs().max())
        row[f"max_abs_err_vs_{name}"] = err
        assert err < 3e-2, f"triton differs from {name} by {err}"
    return row


# ---------------------------------------------------------------- report


def fmt(x, digits=3):
    return "—" if x is None else (f"{x:.{digits}f}" if isinstance(x, float) else str(x))


def write_report(out_dir: Path, rates: dict, checks: list, results: list, device_name: str, wall: float) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "results.json").write_text(json.dumps({"device": device_name, "rates": rates, "checks": checks,
                                                      "results": results}, indent=1))
    peers = ["treeattn_graph", "sdpa_causal", "sdpa_mask", "flex", "flashinfer"]
    lines = [f"# treeattn Triton backend on {device_name}", "",
             f"Copy bandwidth {rates['copy_bytes_per_s'] / 1e12:.2f} TB/s, bf16 matmul "
             f"{rates['bf16_flops_per_s'] / 1e12:.0f} TFLOP/s (measured). Floor = max(KV bytes / bandwidth, "
             f"FLOPs / matmul rate). Times in µs; `x/treeattn` = peer time / treeattn time (> 1: treeattn faster). "
             f"Whole run {wall:.0f} s.", "",
             "`treeattn` is the eager call (Python validation + launch), `graph` the same call replayed in "
             "a CUDA graph (launch overhead removed). Peers run eager.", "",
             "| B | ctx | T | floor | treeattn | % floor | graph | % floor | "
             + " | ".join(f"{p} | x/treeattn" for p in peers[1:]) + " |",
             "|" + "---|" * (8 + 2 * len(peers[1:]))]
    for r in results:
        t, g = r.get("treeattn"), r.get("treeattn_graph")
        cells = [str(r["batch"]), str(r["ctx"]), str(r["T"]), fmt(r["floor_us"], 1), fmt(t, 1),
                 fmt(100 * r["floor_us"] / t if isinstance(t, float) else None, 0), fmt(g, 1),
                 fmt(100 * r["floor_us"] / g if isinstance(g, float) else None, 0)]
        for p in peers[1:]:
            v = r.get(p)
            ratio = v / t if isinstance(v, float) and isinstance(t, float) else None
            cells += [fmt(v, 1) if isinstance(v, float) else (v or "—"), fmt(ratio, 2)]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "## Correctness checks", ""] + [f"- {c}" for c in checks]
    (out_dir / "results.md").write_text("\n".join(lines) + "\n")
    plot(out_dir / "results.png", results, device_name)


def plot(path: Path, results: list, device_name: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    batches = sorted({r["batch"] for r in results})
    fig, axes = plt.subplots(2, len(batches), figsize=(5 * len(batches), 8), squeeze=False)
    for j, b in enumerate(batches):
        for T in sorted({r["T"] for r in results}):
            rs = [r for r in results if r["batch"] == b and r["T"] == T and isinstance(r.get("treeattn"), float)]
            if not rs:
                continue
            ctx = [r["ctx"] for r in rs]
            best = [min(r["treeattn"], r.get("treeattn_graph") or math.inf) for r in rs]
            axes[0][j].plot(ctx, [100 * r["floor_us"] / t for r, t in zip(rs, best)], marker="o", label=f"T={T}")
            speed = [(r["ctx"], r["sdpa_causal"] / r["treeattn"]) for r in rs
                     if isinstance(r.get("sdpa_causal"), float)]
            if speed:
                axes[1][j].plot(*zip(*speed), marker="o", label=f"T={T}")
        axes[0][j].set(title=f"batch {b}: % of roofline floor (best of eager, graph)", xscale="log", xlabel="context", ylim=(0, 105))
        axes[1][j].set(title=f"batch {b}: SDPA causal flash time / treeattn time", xscale="log", xlabel="context")
        axes[1][j].axhline(1.0, color="gray", lw=0.8)
        for ax in axes[:, j]:
            ax.legend(fontsize=8)
            ax.grid(alpha=0.3)
    r0 = results[0]
    fig.suptitle(f"treeattn paged tree attention (bf16, h {r0['h_q']}/{r0['h_kv']}, d {r0['d']}, page {PAGE_SIZE}) "
                 f"on {device_name}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---------------------------------------------------------------- main


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="treeattn GPU benchmark")
    parser.add_argument("--out", default="bench/results")
    parser.add_argument("--dry-run", action="store_true", help="CPU + Triton interpreter, tiny grid, same code path")
    parser.add_argument("--budget-s", type=float, default=420.0, help="stop starting new shapes after this long")
    parser.add_argument("--no-flex", action="store_true")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    dry = args.dry_run
    if not dry and not torch.cuda.is_available():
        console.print("[red]no CUDA device: use --dry-run to exercise this script on CPU[/red]")
        return 2
    device = torch.device("cpu" if dry else "cuda")
    device_name = "CPU (dry run, Triton interpreter)" if dry else torch.cuda.get_device_name(device)
    clock = Clock(device)
    grid = DRY_GRID if dry else FULL_GRID
    heads = {"h_q": 4, "h_kv": 2, "d": 64} if dry else {}
    target_ms = 5.0 if dry else 30.0

    console.rule(f"[bold]treeattn GPU benchmark on {device_name}")
    checks = check_correctness(device, dry)
    for c in checks:
        console.print(f"[green]ok[/green] {c}")
    rates = device_rates(device, clock)
    console.print(f"copy {rates['copy_bytes_per_s'] / 1e9:.0f} GB/s, "
                  f"bf16 matmul {rates['bf16_flops_per_s'] / 1e12:.1f} TFLOP/s")

    try:
        import flashinfer  # noqa: F401
        has_flashinfer = True
    except ImportError:
        has_flashinfer = False
        console.print("FlashInfer not installed: skipped")

    dtype = torch.bfloat16
    shapes = [Shape(b, c, t, **heads) for b in grid["batch"] for t in grid["T"] for c in grid["ctx"]]
    results = [{"batch": s.batch, "ctx": s.ctx, "T": s.T, "h_q": s.h_q, "h_kv": s.h_kv, "d": s.d,
                "kv_bytes": s.kv_bytes(), "flops": s.flops(),
                "floor_us": 1e6 * max(s.kv_bytes() / rates["copy_bytes_per_s"], s.flops() / rates["bf16_flops_per_s"])}
               for s in shapes]

    def methods_for(s: Shape, inp: Inputs, phase: int) -> list:
        if phase == 2:  # compiled Flex recompiles per shape (seconds each): batch 8 only, after everything else
            return [("flex", lambda: timed(clock, flex_calls(inp, compiled=not dry), target_ms))] \
                if not args.no_flex and (dry or s.batch == 8) else []
        out = [("treeattn", lambda: method_treeattn(inp, clock, target_ms, graph=False))]
        if not dry:
            out.append(("treeattn_graph", lambda: method_treeattn(inp, clock, target_ms, graph=True)))
        out += [("sdpa_causal", lambda: timed(clock, sdpa_causal_calls(inp), target_ms)),
                ("sdpa_mask", lambda: timed(clock, sdpa_mask_calls(inp), target_ms))]
        if has_flashinfer:
            out.append(("flashinfer", lambda: timed(clock, flashinfer_calls(inp), target_ms)))
        return out

    peer_checked = set()
    for phase in (1, 2):
        for i, (s, row) in enumerate(zip(shapes, results)):
            if time.perf_counter() - start > args.budget_s:
                console.print(f"[yellow]time budget reached in phase {phase} at shape {i + 1}/{len(shapes)}[/yellow]")
                break
            if phase == 2 and not methods_for(s, None, 2):
                continue
            try:
                inp = build_inputs(s, device, dtype, seed=i)
            except torch.OutOfMemoryError:
                row["error"] = "out of memory building inputs"
                continue
            if phase == 1 and s.T not in peer_checked and (dry or s.batch == 8):
                try:
                    checks.append(check_against_peers(inp, flex_compiled=not dry and not args.no_flex))
                    peer_checked.add(s.T)
                except AssertionError:
                    raise
                except Exception as exc:  # a peer that cannot run here does not stop the benchmark
                    checks.append({"check": f"peers at T={s.T}", "error": f"{type(exc).__name__}: {exc}"})
            for name, run in methods_for(s, inp, phase):
                try:
                    row[name] = 1e3 * run()
                except Exception as exc:  # a peer that cannot run this shape is reported, not fatal
                    row[name] = f"error: {type(exc).__name__}"
                    console.print(f"[yellow]{name} failed on {s}: {exc}[/yellow]")
                    if name == "treeattn":
                        traceback.print_exc()
                if device.type == "cuda":
                    torch.cuda.empty_cache()
            del inp
            t = row.get("treeattn")
            console.print(f"(phase {phase}, {i + 1}/{len(shapes)}) B={s.batch} ctx={s.ctx} T={s.T}: treeattn "
                          f"{fmt(t, 1)} µs (floor {row['floor_us']:.1f} µs), flex {fmt(row.get('flex'), 1)} µs; "
                          f"{time.perf_counter() - start:.0f} s")

    table = Table("B", "ctx", "T", "floor µs", "treeattn µs", "% floor", "graph µs", "sdpa causal", "sdpa mask",
                  "flex", "flashinfer")
    for row in results:
        t = row.get("treeattn")
        table.add_row(*(str(row[k]) for k in ("batch", "ctx", "T")), fmt(row["floor_us"], 1), fmt(t, 1),
                      fmt(100 * row["floor_us"] / t if isinstance(t, float) else None, 0),
                      *(fmt(row.get(k), 1) for k in ("treeattn_graph", "sdpa_causal", "sdpa_mask", "flex",
                                                     "flashinfer")))
    console.print(table)
    wall = time.perf_counter() - start
    write_report(Path(args.out), rates, checks, results, device_name, wall)
    console.print(f"wrote {args.out}/results.md, results.json, results.png in {wall:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
