"""``treeattn bench --variants``: the cost of each attention variant on the CPU, and MLA against SDPA.

One request, T = 64 draft nodes (random tree) after P prefix tokens, h_q/h_kv = 32/8, d = 128, fp32:
plain tree attention against soft-capping (c = 30), sinks, a sliding window of 1024 and all three
together, on the ``native`` kernel (what ``backend=None`` picks on a CPU) and the ``cpu`` backend (same
run, interleaved rounds, median). MLA's absorbed form (h_q = 16 on one latent KV head of 512 + 64
dims, V a view of the latent's first 512) on both backends, against SDPA with a dense tree mask on
the decompressed heads (K 192 = 128 + 64 RoPE dims, V 128 per head) and SDPA on the absorbed form.
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from .. import ops
from ..plan import TreeAttentionPlan
from ..testing import Request, make_batch, random_tree
from ..tree import ancestor_mask
from .machine import machine_info

T, H_Q, H_KV, D = 64, 32, 8, 128
PREFIXES = (4096, 16384)
WINDOW, SOFTCAP = 1024, 30.0
MLA_HEADS, MLA_LATENT, MLA_ROPE, MLA_HEAD, MLA_PREFIX = 16, 512, 64, 128, 4096
BACKENDS = ("native", "cpu")


def _interleaved(fns: dict, repeats: int, warmup: int) -> dict:
    """Median milliseconds of each callable, timed one call of each per round (noise hits all alike)."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    times: dict = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[name].append((time.perf_counter() - start) * 1e3)
    return {name: statistics.median(ts) for name, ts in times.items()}


def _variant_fns(prefix: int) -> dict[tuple[str, str], Callable[[], object]]:
    batch = make_batch([Request(random_tree(np.random.default_rng(T), T), prefix=prefix)], h_q=H_Q, h_kv=H_KV, d=D,
                       seed=0)
    plan = TreeAttentionPlan.ragged(batch.q_indptr, batch.kv_indptr, batch.tree_indptr, batch.tree_order)
    out = torch.empty_like(batch.q)
    lse = torch.empty(batch.q.shape[:2])
    sinks = torch.randn(H_Q)

    def run(backend, **variants):
        return lambda: ops.tree_attention(batch.q, None, batch.k, batch.v, None, None, None, plan=plan, out=out,
                                          lse=lse, backend=backend, **variants)

    fns = {}
    for b in BACKENDS:
        fns.update({(b, "plain"): run(b), (b, "softcap"): run(b, logit_softcap=SOFTCAP), (b, "sinks"): run(b, sinks=sinks),
                    (b, f"window {WINDOW}"): run(b, sliding_window=WINDOW),
                    (b, "all three"): run(b, sliding_window=WINDOW, logit_softcap=SOFTCAP, sinks=sinks)})
    return fns


def _mla_fns() -> dict[tuple[str, str], Callable[[], object]]:
    d_k = MLA_LATENT + MLA_ROPE
    batch = make_batch([Request(random_tree(np.random.default_rng(T), T), prefix=MLA_PREFIX)], h_q=MLA_HEADS, h_kv=1,
                       d=d_k, seed=1)
    plan = TreeAttentionPlan.ragged(batch.q_indptr, batch.kv_indptr, batch.tree_indptr, batch.tree_order)
    v_view = batch.k[..., :MLA_LATENT]
    out = torch.empty(T, MLA_HEADS, MLA_LATENT)
    lse = torch.empty(T, MLA_HEADS)
    length = MLA_PREFIX + T
    visible = torch.ones(T, length, dtype=torch.bool)
    visible[:, MLA_PREFIX:] = ancestor_mask(batch.tree_order)
    mask = visible[None, None]
    gen = torch.Generator().manual_seed(2)
    q_dec = torch.randn(1, MLA_HEADS, T, MLA_HEAD + MLA_ROPE, generator=gen)
    k_dec = torch.randn(1, MLA_HEADS, length, MLA_HEAD + MLA_ROPE, generator=gen)
    v_dec = torch.randn(1, MLA_HEADS, length, MLA_HEAD, generator=gen)
    q_abs = batch.q.transpose(0, 1)[None]
    k_abs, v_abs = batch.k.transpose(0, 1)[None], v_view.transpose(0, 1)[None]
    def ours(backend):
        return lambda: ops.tree_attention(batch.q, None, batch.k, v_view, None, None, None, plan=plan, out=out,
                                          lse=lse, backend=backend)

    return {
        **{(b, "treeattn (absorbed)"): ours(b) for b in BACKENDS},
        ("torch", "sdpa, decompressed heads"): lambda: F.scaled_dot_product_attention(q_dec, k_dec, v_dec,
                                                                                      attn_mask=mask),
        ("torch", "sdpa, absorbed"): lambda: F.scaled_dot_product_attention(q_abs, k_abs, v_abs, attn_mask=mask,
                                                                            enable_gqa=True),
    }


def run_variants_bench(*, repeats: int = 7, warmup: int = 2, out_dir: str | Path | None = "bench/results",
                       console=None) -> dict:
    from rich.console import Console

    console = console or Console()
    info = machine_info()
    rows = []
    for prefix in PREFIXES:
        console.print(f"variants, P={prefix}...")
        times = _interleaved(_variant_fns(prefix), repeats, warmup)
        rows += [{"case": f"T={T}, P={prefix}", "backend": b, "method": m, "ms": ms, "vs plain": ms / times[b, "plain"]}
                 for (b, m), ms in times.items()]
    console.print("MLA...")
    times = _interleaved(_mla_fns(), repeats, warmup)
    ours = times[BACKENDS[0], "treeattn (absorbed)"]
    rows += [{"case": f"MLA h_q={MLA_HEADS}, T={T}, P={MLA_PREFIX}", "backend": b, "method": m, "ms": ms,
              "treeattn speedup": ms / ours} for (b, m), ms in times.items()]
    info["load_average_after"] = machine_info()["load_average_before"]
    report = {"machine": info, "settings": {"repeats": repeats, "warmup": warmup}, "rows": rows}
    lines = ["# Attention variants on the CPU", "",
             f"Machine: {info['cpu']}, {info['cores']} cores (torch threads: {info['torch_threads']}), ISA "
             f"{', '.join(info['isa']) or 'n/a'}; torch {info['torch']}. Load average before {info['load_average_before']}"
             f", after {info['load_average_after']}. fp32, median of {repeats} interleaved calls after {warmup} "
             "warm-up calls, wall clock.", "",
             f"One request, T = {T} draft nodes after P prefix tokens, h_q/h_kv = {H_Q}/{H_KV}, d = {D}: plain tree "
             f"attention vs soft-cap {SOFTCAP:g}, sinks, a window of {WINDOW}, and all three, on the native kernel "
             f"(`backend=None` on a CPU) and the `cpu` backend; ratios against the same backend's plain call. MLA: "
             f"h_q = {MLA_HEADS} on one latent head of {MLA_LATENT} + {MLA_ROPE} dims (V a view of the first "
             f"{MLA_LATENT}) against SDPA with a dense tree mask on decompressed heads (K {MLA_HEAD + MLA_ROPE}, V "
             f"{MLA_HEAD}) and on the absorbed form; ratios: how much faster the native kernel is.",
             "", "| case | backend | method | ms | ratio |", "|---|---|---|---|---|"]
    for r in rows:
        ratio = (f"{r['vs plain']:.2f}x plain" if "vs plain" in r else f"native {r['treeattn speedup']:.2f}x faster")
        lines.append(f"| {r['case']} | {r['backend']} | {r['method']} | {r['ms']:.3g} | {ratio} |")
    text = "\n".join(lines) + "\n"
    console.print(text)
    if out_dir is not None:
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / "variants.md").write_text(text)
        (out / "variants.json").write_text(json.dumps(report, indent=1) + "\n")
        console.print(f"wrote {out / 'variants.md'}, .json")
    return report
