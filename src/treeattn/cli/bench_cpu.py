"""CPU benchmark: treeattn's CPU backend against SDPA, compiled FlexAttention and TVM's CPU kernels.

One tree-verification step of one request: ``T`` draft nodes (a random tree, fixed seed) after a
prefix of ``P`` tokens, 32 query / 8 KV heads, head dim 128. Every method computes the same
attention (checked: each output is compared with treeattn's), from the layout it natively reads:

- ``treeattn`` / ``treeattn-paged``: ragged ``k/v [L, h_kv, d]`` / 16-token pages, with a plan
  built once per step (as every layer of a model would share it).
- ``sdpa-mask``: what HF transformers does with a custom 4D mask on CPU: repeat the KV heads, then
  SDPA with a dense boolean ``[T, L]`` mask (built once per step, not timed).
- ``sdpa-gqa``: SDPA with the same mask and ``enable_gqa=True`` (no KV repeat; its best variant).
- ``flex``: ``torch.compile(flex_attention)`` with the tree as ``mask_mod``; block mask built once
  per shape. Returns no LSE (compiled Flex cannot on CPU); every new shape recompiles (seconds).
- ``tvm`` / ``tvm-paged``: Apache TVM's ``tree_attn_cpu`` / ``tree_attn_with_paged_kv_cache_cpu``
  built for llvm, when TVM is installed (fp32/fp16 only). Scalar loops: timed with few repeats and
  skipped where one call would take longer than ``--tvm-max-seconds``.

Methods are timed in interleaved rounds (one call of each per round) after a warmup, so that noise
from other processes hits all of them alike; the median is reported. Throughput counts useful
FLOPs, ``4 * h_q * d * sum over rows of visible keys`` (prefix + the row's ancestors), and is set
against the fp32/bf16 ``torch.matmul`` peak measured in the same run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from .. import ops
from ..plan import TreeAttentionPlan
from ..testing import Request, make_batch, random_tree
from ..tree import ancestor_mask, tree_depths
from .machine import load_average, machine_info

GRID_T = (8, 26, 64, 128)
GRID_PREFIX = (0, 512, 4096, 16384)
QUICK_T = (8, 64)
QUICK_PREFIX = (0, 512)
H_Q, H_KV, HEAD_DIM, PAGE_SIZE = 32, 8, 128, 16
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
METHODS = ("treeattn", "treeattn-paged", "sdpa-mask", "sdpa-gqa", "flex", "tvm", "tvm-paged")
# The treeattn variant each baseline is compared with (same KV layout family).
OURS_FOR = {"sdpa-mask": "treeattn", "sdpa-gqa": "treeattn", "flex": "treeattn", "tvm": "treeattn",
            "tvm-paged": "treeattn-paged"}


def matmul_peak(dtype: torch.dtype, seconds: float = 1.5, sizes: tuple[int, ...] = (1024, 2048, 3072),
                clock: Callable[[], float] = time.perf_counter) -> float:
    """Best GFLOP/s of square ``torch.matmul`` (``sizes``) over about ``seconds``, timed by ``clock``."""
    best = 0.0
    for n in sizes:
        a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
        a @ b
        deadline = time.perf_counter() + seconds / len(sizes)
        while time.perf_counter() < deadline:
            start = clock()
            a @ b
            best = max(best, 2 * n**3 / max(clock() - start, 1e-9) / 1e9)
    return best


# ---------------------------------------------------------------- problems and methods


class Problem:
    """One request's tree-verification step with every layout the methods read."""

    def __init__(self, t: int, prefix: int, dtype: torch.dtype, seed: int = 0):
        self.t, self.prefix, self.dtype = t, prefix, dtype
        self.parents = random_tree(np.random.default_rng(seed + t), t)
        self.batch = make_batch([Request(self.parents, prefix=prefix)], h_q=H_Q, h_kv=H_KV, d=HEAD_DIM, dtype=dtype,
                                seed=seed, page_size=PAGE_SIZE)
        self.sm_scale = HEAD_DIM**-0.5
        self.kv_len = prefix + t
        depth = tree_depths(self.parents).long()
        self.visible_keys = int((prefix + depth + 1).sum())  # per query head, over all rows
        visible = torch.ones(t, self.kv_len, dtype=torch.bool)
        visible[:, prefix:] = ancestor_mask(self.batch.tree_order)
        self.dense_mask = visible[None, None]  # [1, 1, T, L], as HF passes a 4D mask

    @property
    def flops(self) -> float:
        return 4.0 * H_Q * HEAD_DIM * self.visible_keys

    def bhld(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q ``[1, h_q, T, d]`` (a transposed view, as after HF's projection) and K/V ``[1, h_kv, L, d]``."""
        b = self.batch
        return (b.q.transpose(0, 1)[None], b.k.transpose(0, 1)[None].contiguous(),
                b.v.transpose(0, 1)[None].contiguous())


def _treeattn(p: Problem, paged: bool, backend: str = "cpu") -> Callable[[], torch.Tensor]:
    b = p.batch
    out = torch.empty_like(b.q)
    lse = torch.empty(b.q.shape[:2], dtype=torch.float32)
    if paged:
        e = b.extra
        plan = TreeAttentionPlan.paged(b.q_indptr, e["page_indptr"], e["page_indices"], e["last_page_len"],
                                       b.tree_indptr, b.tree_order, page_size=PAGE_SIZE,
                                       num_pages=e["kv_pages"].shape[0], total_q=p.t)
        return lambda: ops.paged_tree_attention(*b.paged_args(), sm_scale=p.sm_scale, out=out, lse=lse,
                                                backend=backend, plan=plan)[0]
    plan = TreeAttentionPlan.ragged(b.q_indptr, b.kv_indptr, b.tree_indptr, b.tree_order, total_q=p.t,
                                    total_kv=p.kv_len)
    return lambda: ops.tree_attention(*b.ragged_args(), sm_scale=p.sm_scale, out=out, lse=lse, backend=backend,
                                      plan=plan)[0]


def _hf_layout(o: torch.Tensor) -> torch.Tensor:
    """``[1, h_q, T, d]`` -> contiguous ``[T, h_q, d]``, as HF's attention functions return it (and as treeattn
    writes it)."""
    return o[0].transpose(0, 1).contiguous()


def _sdpa_repeat_kv(p: Problem) -> Callable[[], torch.Tensor]:
    q, k, v = p.bhld()
    group = H_Q // H_KV

    def repeat_kv(x):  # transformers' repeat_kv: expand + reshape (a copy)
        return x[:, :, None].expand(1, H_KV, group, p.kv_len, HEAD_DIM).reshape(1, H_Q, p.kv_len, HEAD_DIM)

    return lambda: _hf_layout(F.scaled_dot_product_attention(q, repeat_kv(k), repeat_kv(v), attn_mask=p.dense_mask,
                                                             scale=p.sm_scale))


def _sdpa_gqa(p: Problem) -> Callable[[], torch.Tensor]:
    q, k, v = p.bhld()
    return lambda: _hf_layout(F.scaled_dot_product_attention(q, k, v, attn_mask=p.dense_mask, scale=p.sm_scale,
                                                             enable_gqa=True))


_compiled_flex = None


def _flex(p: Problem) -> Callable[[], torch.Tensor]:
    global _compiled_flex
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    if _compiled_flex is None:
        # One static specialization per shape (dynamic shapes with a BlockMask fail to build on CPU),
        # and room for every shape of the grid before dynamo falls back to eager.
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 128)
        torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 128)
        _compiled_flex = torch.compile(flex_attention, dynamic=False)
    tree = ancestor_mask(p.batch.tree_order)
    prefix = p.prefix

    def tree_mask(b, h, q_idx, kv_idx):
        return (kv_idx < prefix) | tree[q_idx, (kv_idx - prefix).clamp(min=0)]

    block_mask = create_block_mask(tree_mask, None, None, p.t, p.kv_len, device="cpu")
    q, k, v = p.bhld()
    return lambda: _hf_layout(_compiled_flex(q, k, v, block_mask=block_mask, scale=p.sm_scale, enable_gqa=True))


def tvm_available() -> bool:
    try:
        import tvm  # noqa: F401
        from tvm.relax.frontend.nn.llm.tree_attn import tree_attn_cpu  # noqa: F401
    except Exception:  # TVM missing or broken: the benchmark runs without it
        return False
    return True


_tvm_kernels: dict = {}


def _tvm(p: Problem, paged: bool) -> Callable[[], torch.Tensor] | str:
    import tvm
    from tvm.relax.frontend.nn.llm.tree_attn import tree_attn_cpu, tree_attn_with_paged_kv_cache_cpu

    dtype = {torch.float32: "float32", torch.float16: "float16"}.get(p.dtype)
    if dtype is None:
        return f"TVM's CPU kernels take fp32/fp16, not {p.dtype}"
    key = (paged, dtype)
    if key not in _tvm_kernels:
        build = tree_attn_with_paged_kv_cache_cpu if paged else tree_attn_cpu
        _tvm_kernels[key] = tvm.compile(build(H_KV, H_Q, HEAD_DIM, dtype, {}), target="llvm")
    kernel = _tvm_kernels[key]

    def t(x):
        return tvm.runtime.tensor(np.ascontiguousarray(x.numpy()), tvm.cpu())

    b = p.batch
    out = t(torch.zeros_like(b.q))
    lse = t(torch.zeros(b.q.shape[:2], dtype=torch.float32))
    positions = t(torch.zeros(p.t, dtype=torch.int32))  # RoPE is off (rotary_mode 0): never read
    if paged:
        e = b.extra
        args = (t(b.q), t(b.q_indptr), t(e["kv_pages"]), t(e["page_indptr"]), t(e["page_indices"]),
                t(e["last_page_len"]), t(torch.zeros(1, dtype=torch.int32)), positions, out, lse, 0, 1.0, 1e4,
                p.sm_scale, t(b.tree_indptr), t(b.tree_order))
    else:
        args = (t(b.q), t(b.q_indptr), t(b.k), t(b.v), t(b.kv_indptr), positions, t(b.tree_indptr),
                t(b.tree_order), out, lse, 0, 1.0, 1e4, p.sm_scale)

    def run():
        kernel(*args)
        return torch.from_numpy(out.numpy())

    return run


def build_method(name: str, p: Problem) -> Callable[[], torch.Tensor] | str:
    """The timed callable for ``name``, or a string saying why it does not run here."""
    if name in ("treeattn", "treeattn-paged"):
        return _treeattn(p, paged=name == "treeattn-paged")
    if name in ("native", "native-paged"):  # the native C++ kernel (bench/native.py)
        return _treeattn(p, paged=name == "native-paged", backend="native")
    if name == "sdpa-mask":
        return _sdpa_repeat_kv(p)
    if name == "sdpa-gqa":
        return _sdpa_gqa(p)
    if name == "flex":
        return _flex(p)
    if name in ("tvm", "tvm-paged"):
        return _tvm(p, paged=name == "tvm-paged") if tvm_available() else "TVM is not installed"
    raise ValueError(f"unknown method {name!r}")


# ---------------------------------------------------------------- timing


@dataclass
class Result:
    dtype: str
    t: int
    prefix: int
    method: str
    median_ms: float | None = None
    times_ms: list[float] = field(default_factory=list)
    gflops: float | None = None
    max_abs_diff: float | None = None  # output vs treeattn's
    note: str = ""


CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}


def _timed(fn: Callable[[], torch.Tensor], clock: Callable[[], float]) -> tuple[float, torch.Tensor]:
    start = clock()
    out = fn()
    return (clock() - start) * 1e3, out


def bench_problem(p: Problem, methods: list[str], *, repeats: int, warmup: int, slow_repeats: int,
                  slow_max_s: float, on_step: Callable[[str], None], clock: str = "wall") -> list[Result]:
    """Time every method on one problem, in interleaved rounds; ``on_step`` reports progress.

    ``clock="cpu"`` times this process's CPU time instead of wall time: with one thread it is immune
    to other processes taking turns on the cores (it counts every thread's time with more)."""
    timer = CLOCKS[clock]
    dtype = next(k for k, v in DTYPES.items() if v == p.dtype)
    results = {m: Result(dtype, p.t, p.prefix, m) for m in methods}
    fns: dict[str, Callable[[], torch.Tensor]] = {}
    reference = None
    for m in methods:
        on_step(f"{m}: build + warmup")
        fn = build_method(m, p)
        if isinstance(fn, str):
            results[m].note = fn
            continue
        slow = m.startswith("tvm")
        if slow:  # scalar kernels: predict the call time from the FLOPs before running it
            estimate_s = p.flops / (2e9 if p.dtype == torch.float32 else 1e9)
            if estimate_s > slow_max_s:
                results[m].note = f"skipped: one call would take ~{estimate_s:.0f} s"
                continue
        elapsed, out = _timed(fn, timer)
        for _ in range(0 if slow else warmup - 1):
            elapsed, out = _timed(fn, timer)
        if reference is None:
            reference = out.float().clone()
        results[m].max_abs_diff = float((out.float() - reference).abs().max())
        if slow:
            if elapsed > 1e3:  # too slow to repeat just for warming up: a cold start is noise at this size
                results[m].times_ms.append(elapsed)
            if elapsed / 1e3 * slow_repeats > slow_max_s:
                results[m].note = "1 call (slow)"
                continue
            results[m].note = f"{slow_repeats} calls (slow)"
        fns[m] = fn
    for r in range(repeats):
        on_step(f"round {r + 1}/{repeats}")
        for m, fn in fns.items():
            if m.startswith("tvm") and len(results[m].times_ms) >= slow_repeats:
                continue
            results[m].times_ms.append(_timed(fn, timer)[0])
    for res in results.values():
        if res.times_ms:
            res.median_ms = statistics.median(res.times_ms)
            res.gflops = p.flops / (res.median_ms * 1e6)
    return list(results.values())


# ---------------------------------------------------------------- targets (from the issue, 2-core Sapphire Rapids)


@dataclass
class Target:
    text: str
    dtype: str
    where: Callable[[int, int], bool]  # (T, prefix) -> selected
    method: str  # a baseline (speedup of ours over it), "peak" (fraction of matmul peak) or "fp32" (bf16 vs fp32)
    threshold: float


TARGETS = [
    Target("P=4096, T=64: >= 2.5x sdpa-mask", "fp32", lambda t, p: p == 4096 and t == 64, "sdpa-mask", 2.5),
    Target("P=4096, T=64: >= 1.3x sdpa-gqa", "fp32", lambda t, p: p == 4096 and t == 64, "sdpa-gqa", 1.3),
    Target("P=4096, T=64: >= 65% of fp32 matmul peak", "fp32", lambda t, p: p == 4096 and t == 64, "peak", 0.65),
    Target("P=16384, T=64/128: >= 2x sdpa-mask", "fp32", lambda t, p: p == 16384 and t >= 64, "sdpa-mask", 2.0),
    Target("P=16384, T=64/128: >= 1.3x sdpa-gqa", "fp32", lambda t, p: p == 16384 and t >= 64, "sdpa-gqa", 1.3),
    Target("P=16384, T=64/128: >= 60% of fp32 matmul peak", "fp32", lambda t, p: p == 16384 and t >= 64, "peak", 0.60),
    Target("T=8, P>=4096: >= 8x sdpa-mask", "fp32", lambda t, p: t == 8 and p >= 4096, "sdpa-mask", 8.0),
    Target("T=8, P>=4096: >= 1.7x sdpa-gqa", "fp32", lambda t, p: t == 8 and p >= 4096, "sdpa-gqa", 1.7),
    Target("P<=512: >= 0.9x sdpa-gqa (fp32)", "fp32", lambda t, p: p <= 512, "sdpa-gqa", 0.9),
    Target("P<=512: >= 0.9x sdpa-gqa (bf16)", "bf16", lambda t, p: p <= 512, "sdpa-gqa", 0.9),
    Target("bf16 >= 1.4x own fp32 (P>=4096)", "bf16", lambda t, p: p >= 4096, "fp32", 1.4),
    Target("P=4096: >= 25x TVM ragged", "fp32", lambda t, p: p == 4096, "tvm", 25.0),
    Target("P=4096: >= 30x TVM paged", "fp32", lambda t, p: p == 4096, "tvm-paged", 30.0),
    Target("P=16384: >= 50x TVM paged", "fp32", lambda t, p: p == 16384, "tvm-paged", 50.0),
    Target("P>=4096: >= 1.2x compiled FlexAttention (fp32)", "fp32", lambda t, p: p >= 4096, "flex", 1.2),
    Target("P>=4096: >= 1.2x compiled FlexAttention (bf16)", "bf16", lambda t, p: p >= 4096, "flex", 1.2),
]


def _lookup(results: list[Result]) -> dict[tuple[str, int, int, str], Result]:
    return {(r.dtype, r.t, r.prefix, r.method): r for r in results}


def speedup(table, dtype: str, t: int, prefix: int, baseline: str) -> float | None:
    ours = table.get((dtype, t, prefix, OURS_FOR.get(baseline, "treeattn")))
    other = table.get((dtype, t, prefix, baseline))
    if ours is None or other is None or ours.median_ms is None or other.median_ms is None:
        return None
    return other.median_ms / ours.median_ms


def evaluate_targets(results: list[Result], peaks: dict[str, float]) -> list[dict]:
    table = _lookup(results)
    points = sorted({(r.dtype, r.t, r.prefix) for r in results})
    rows = []
    for target in TARGETS:
        values = []
        for dtype, t, prefix in points:
            if dtype != target.dtype or not target.where(t, prefix):
                continue
            if target.method == "peak":
                ours = table.get((dtype, t, prefix, "treeattn"))
                value = ours.gflops / peaks[dtype] if ours and ours.gflops else None
            elif target.method == "fp32":
                ours, fp32 = table.get(("bf16", t, prefix, "treeattn")), table.get(("fp32", t, prefix, "treeattn"))
                value = fp32.median_ms / ours.median_ms if ours and fp32 and ours.median_ms and fp32.median_ms else None
            else:
                value = speedup(table, dtype, t, prefix, target.method)
            if value is not None:
                values.append((value, t, prefix))
        if not values:
            rows.append({"target": target.text, "status": "not measured"})
            continue
        worst = min(values)
        rows.append({"target": target.text, "worst": worst[0], "at": f"T={worst[1]}, P={worst[2]}",
                     "status": "met" if worst[0] >= target.threshold else "missed"})
    return rows


# ---------------------------------------------------------------- reporting


def _fmt_ms(r: Result | None) -> str:
    if r is None:
        return ""
    if r.median_ms is None:
        return "n/a"
    return f"{r.median_ms:.3g}" if r.median_ms < 100 else f"{r.median_ms:.0f}"


def table_rows(results: list[Result], peaks: dict[str, float], methods: list[str]) -> tuple[list[str], list[list[str]]]:
    """Header and rows: per (dtype, T, P) our time, GFLOP/s, % of peak, and every baseline with our speedup."""
    table = _lookup(results)
    header = ["dtype", "T", "P", "treeattn ms", "GFLOP/s", "% peak"]
    others = [m for m in methods if m != "treeattn"]
    for m in others:
        header.append(f"{m} ms" if m == "treeattn-paged" else f"{m} ms (x)")
    rows = []
    for dtype, t, prefix in sorted({(r.dtype, r.t, r.prefix) for r in results},
                                   key=lambda k: (list(DTYPES).index(k[0]), k[1], k[2])):
        ours = table.get((dtype, t, prefix, "treeattn"))
        row = [dtype, str(t), str(prefix), _fmt_ms(ours),
               f"{ours.gflops:.0f}" if ours and ours.gflops else "",
               f"{100 * ours.gflops / peaks[dtype]:.0f}%" if ours and ours.gflops and dtype in peaks else ""]
        for m in others:
            r = table.get((dtype, t, prefix, m))
            cell = _fmt_ms(r)
            s = speedup(table, dtype, t, prefix, m) if m != "treeattn-paged" else None
            if s is not None:
                cell += f" ({s:.2f}x)" if s < 10 else f" ({s:.0f}x)"
            elif r is not None and r.median_ms is None and r.note:
                cell = "skipped" if r.note.startswith("skipped") else "n/a"
            row.append(cell)
        rows.append(row)
    return header, rows


def markdown(info: dict, peaks: dict, settings: dict, results: list[Result], targets: list[dict],
             methods: list[str]) -> str:
    header, rows = table_rows(results, peaks, methods)
    lines = ["# treeattn CPU benchmark", "",
             f"Machine: {info['cpu']}, {info['cores']} cores (torch threads: {info['torch_threads']}), "
             f"ISA {', '.join(info['isa']) or 'n/a'}; torch {info['torch']} ({info['torch_cpu_capability']}), "
             f"Python {info['python']}. Load average (1/5/15 min) before the run "
             f"{info['load_average_before']}, after {info.get('load_average_after')}: other processes share "
             "these cores, which is why ratios are taken within one run.",
             "Matmul peak measured in this run: "
             + ", ".join(f"{k} {v:.0f} GFLOP/s" for k, v in peaks.items()) + ".", "",
             f"One request: T draft nodes (random tree, fixed seed) after a prefix of P tokens, h_q/h_kv = "
             f"{H_Q}/{H_KV}, d = {HEAD_DIM}, paged KV with page size {PAGE_SIZE}. "
             + ("Times are this process's CPU time (one thread: immune to other processes' turns on the "
                "cores; the matmul peak is wall-clock). " if settings.get("clock") == "cpu" else "Wall-clock times. ")
             + f"Median of {settings['repeats']} interleaved calls after {settings['warmup']} warmup calls (TVM: "
             f"{settings['slow_repeats']} or fewer, skipped where one call would exceed "
             f"{settings['slow_max_s']:.0f} s). GFLOP/s counts useful FLOPs (4 * h_q * d * visible keys "
             "summed over rows). (x) = treeattn's speedup over that method, same run: treeattn (ragged) for "
             "SDPA/Flex/TVM ragged, treeattn-paged for TVM paged. % peak: against the matmul peak of the "
             "same dtype.", "",
             "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    lines += ["", "## Targets (from the issue; set for a 2-core Sapphire Rapids)", "",
              "| target | worst case | at | status |", "|---|---|---|---|"]
    for t in targets:
        worst = f"{t['worst']:.2f}" if "worst" in t else ""
        lines.append(f"| {t['target']} | {worst} | {t.get('at', '')} | {t['status']} |")
    notes = sorted({f"{r.method}: {r.note}" for r in results if r.note and r.median_ms is None})
    if notes:
        lines += ["", "Notes:", ""] + [f"- {n}" for n in notes]
    return "\n".join(lines) + "\n"


def plot(results: list[Result], peaks: dict[str, float], methods: list[str], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    dtypes = [d for d in DTYPES if any(r.dtype == d for r in results)]
    ts = sorted({r.t for r in results})
    fig, axes = plt.subplots(len(dtypes), len(ts), figsize=(4 * len(ts), 3.4 * len(dtypes)), squeeze=False,
                             sharey=True)
    for i, dtype in enumerate(dtypes):
        for j, t in enumerate(ts):
            ax = axes[i][j]
            for m in methods:
                pts = sorted((r.prefix, r.gflops) for r in results
                             if r.dtype == dtype and r.t == t and r.method == m and r.gflops)
                if pts:
                    ax.plot([str(p) for p, _ in pts], [g for _, g in pts], marker="o", label=m)
            if dtype in peaks:
                ax.axhline(peaks[dtype], color="gray", linestyle="--", linewidth=1, label="matmul peak (same dtype)")
            ax.set_yscale("log")
            ax.set_title(f"{dtype}, T = {t}")
            ax.set_xlabel("prefix length")
            if j == 0:
                ax.set_ylabel("useful GFLOP/s")
            ax.grid(True, which="both", alpha=0.3)
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=len(labels), fontsize=8)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---------------------------------------------------------------- entry points


def run_cpu_bench(*, dtypes: list[str] = ("fp32", "bf16"), ts=GRID_T, prefixes=GRID_PREFIX,
                  methods: list[str] = METHODS, repeats: int = 7, warmup: int = 2, slow_repeats: int = 2,
                  slow_max_s: float = 30.0, out_dir: str | Path | None = "bench/results", name: str = "cpu",
                  peak_seconds: float = 1.5, clock: str = "wall", console=None) -> dict:
    """Run the grid; print a table; write ``{name}.md/.json/.png`` to ``out_dir`` (unless None)."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
    from rich.table import Table

    console = console or Console()
    methods = list(methods)
    if "treeattn" not in methods:
        methods.insert(0, "treeattn")
    info = machine_info()
    console.print(f"[bold]{info['cpu']}[/], {info['cores']} cores, torch {info['torch']}; measuring matmul peak...")
    peaks = {d: matmul_peak(DTYPES[d], peak_seconds) for d in dict.fromkeys(["fp32", *dtypes])}
    console.print("matmul peak: " + ", ".join(f"{k} {v:.0f} GFLOP/s" for k, v in peaks.items()))
    results: list[Result] = []
    grid = [(d, t, p) for d in dtypes for t in ts for p in prefixes]
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console) as progress:
        task = progress.add_task("", total=len(grid))
        for dtype, t, prefix in grid:
            label = f"{dtype} T={t} P={prefix}"
            problem = Problem(t, prefix, DTYPES[dtype])
            results += bench_problem(problem, methods, repeats=repeats, warmup=warmup, slow_repeats=slow_repeats,
                                     slow_max_s=slow_max_s, clock=clock,
                                     on_step=lambda s, label=label: progress.update(task, description=f"{label} {s}"))
            progress.advance(task)
    info["load_average_after"] = load_average()
    targets = evaluate_targets(results, peaks)
    header, rows = table_rows(results, peaks, methods)
    table = Table(title="treeattn CPU benchmark (ms; (x) = treeattn speedup)")
    for h in header:
        table.add_column(h, justify="right")
    for r in rows:
        table.add_row(*r)
    console.print(table, width=max(console.width, 170))
    for t in targets:
        if t["status"] == "not measured":  # outside this run's grid
            continue
        style = {"met": "green", "missed": "red"}.get(t["status"], "yellow")
        worst = f" (worst {t['worst']:.2f} at {t['at']})" if "worst" in t else ""
        console.print(f"[{style}]{t['status']:>12}[/] {t['target']}{worst}")
    settings = {"repeats": repeats, "warmup": warmup, "slow_repeats": slow_repeats, "slow_max_s": slow_max_s,
                "clock": clock,
                "dtypes": list(dtypes), "T": list(ts), "prefix": list(prefixes), "methods": methods,
                "h_q": H_Q, "h_kv": H_KV, "head_dim": HEAD_DIM, "page_size": PAGE_SIZE}
    report = {"machine": info, "matmul_peak_gflops": peaks, "settings": settings,
              "results": [asdict(r) for r in results], "targets": targets}
    if out_dir is not None:
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / f"{name}.json").write_text(json.dumps(report, indent=1) + "\n")
        (out / f"{name}.md").write_text(markdown(info, peaks, settings, results, targets, methods))
        plot(results, peaks, methods, out / f"{name}.png")
        console.print(f"wrote {out / name}.md, .json, .png")
    return report


def add_cpu_bench_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true",
                        help=f"small grid (T {QUICK_T}, P {QUICK_PREFIX}, no Flex/TVM) for smoke tests")
    parser.add_argument("--dtype", choices=[*DTYPES, "all"], nargs="+", default=["fp32", "bf16"],
                        help="dtypes to run (default: fp32 bf16)")
    parser.add_argument("--out", default="bench/results", help="folder for cpu.md/.json/.png (default: bench/results)")
    parser.add_argument("--T", type=int, nargs="+", help=f"tree sizes (default {GRID_T})")
    parser.add_argument("--prefix", type=int, nargs="+", help=f"prefix lengths (default {GRID_PREFIX})")
    parser.add_argument("--methods", nargs="+", choices=METHODS, help="methods to run (default: all)")
    parser.add_argument("--no-flex", action="store_true", help="skip compiled FlexAttention (compiles per shape)")
    parser.add_argument("--no-tvm", action="store_true", help="skip TVM's CPU kernels")
    parser.add_argument("--repeats", type=int, default=7, help="timed calls per method (median reported)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed calls per method first")
    parser.add_argument("--tvm-max-seconds", type=float, default=30.0,
                        help="skip a TVM kernel where its calls would take longer than this")
    parser.add_argument("--clock", choices=list(CLOCKS), default="wall",
                        help="wall time (default) or this process's CPU time (steady on a shared machine with --threads 1)")
    parser.add_argument("--variants", action="store_true",
                        help="instead of the grid: the attention variants' cost and MLA vs SDPA (variants.md)")
    parser.add_argument("--threads", type=int,
                        help="torch threads (default: one per core); the report is then named cpu-threadsN")


def main_cpu_bench(args: argparse.Namespace) -> int:
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.variants:
        from .bench_variants import run_variants_bench

        run_variants_bench(repeats=args.repeats, warmup=args.warmup, out_dir=args.out)
        return 0
    dtypes = list(DTYPES) if "all" in args.dtype else list(dict.fromkeys(args.dtype))
    methods = list(args.methods or METHODS)
    if args.no_flex or args.quick:
        methods = [m for m in methods if m != "flex"]
    if args.no_tvm or args.quick:
        methods = [m for m in methods if not m.startswith("tvm")]
    run_cpu_bench(dtypes=dtypes, ts=args.T or (QUICK_T if args.quick else GRID_T),
                  prefixes=args.prefix or (QUICK_PREFIX if args.quick else GRID_PREFIX), methods=methods,
                  repeats=args.repeats, warmup=args.warmup, slow_max_s=args.tvm_max_seconds, out_dir=args.out,
                  clock=args.clock,
                  name="cpu" + ("-quick" if args.quick else "") + (f"-threads{args.threads}" if args.threads else "")
                  + ("-cputime" if args.clock == "cpu" else ""))
    return 0
