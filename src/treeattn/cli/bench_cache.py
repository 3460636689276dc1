"""Paged KV cache benchmark: one tree-decoding step of a batch, split into planning, attention, commit.

A step is what a speculative decoder does per verification: ``begin_forward`` (page allocation,
trees, plans), ``attention`` for every layer (K/V append + tree attention), ``end_forward`` and
``commit_accepted`` (compaction of each accepted path, pages freed). Defaults: 32 sequences, each a
random 64-node tree (fixed seed) over a ``prefix``-token committed prefix, 4 layers, 32 query / 8 KV
heads, head dim 128, pages of 16. Leaves are drawn at random, so each step grows the sequences by
the accepted path.

For scale, ``kernel`` is one ``treeattn.paged_tree_attention`` call per layer over the same pages
with a plan built once outside the timing: the attention work alone, without the cache around it.
Steps are timed one by one after a warmup; medians are reported.
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from ..kvcache import PagedKVCache
from ..ops import paged_tree_attention
from ..plan import TreeAttentionPlan
from ..testing import random_tree
from ..tree import pack_trees
from .bench_cpu import DTYPES
from .machine import machine_info


@dataclass(frozen=True)
class CacheBenchConfig:
    batch: int = 32
    tree: int = 64
    prefix: int = 512
    layers: int = 4
    h_q: int = 32
    h_kv: int = 8
    head_dim: int = 128
    page_size: int = 16
    dtype: str = "fp32"
    first_round: str = "paged"
    backend: str | None = None
    steps: int = 8
    warmup: int = 2


def _median_ms(xs: list[float]) -> float:
    return round(statistics.median(xs) * 1e3, 3)


def _kernel_plan(cache: PagedKVCache, ids: list[int], trees: list[list[int]]) -> TreeAttentionPlan:
    """The append-first plan of the step just run: each tree is the last keys of its sequence."""
    pages = [cache.page_indices(i) for i in ids]
    lengths = [cache.seq_len(i) for i in ids]
    tree_indptr, order = pack_trees(trees)
    last = [n - (len(p) - 1) * cache.page_size for n, p in zip(lengths, pages)]
    indptr = lambda xs: torch.tensor([0, *np.cumsum(xs).tolist()], dtype=torch.int32)
    return TreeAttentionPlan.paged(indptr([len(t) for t in trees]), indptr([len(p) for p in pages]),
                                   torch.tensor(sum(pages, []), dtype=torch.int32),
                                   torch.tensor(last, dtype=torch.int32), tree_indptr, order,
                                   page_size=cache.page_size, num_pages=cache.num_pages, device=cache.device)


def run_cache_step_bench(cfg: CacheBenchConfig) -> dict:
    dtype = DTYPES[cfg.dtype]
    rng = np.random.default_rng(0)
    gen = torch.Generator().manual_seed(0)
    trees = [random_tree(rng, cfg.tree) for _ in range(cfg.batch)]
    max_len = cfg.prefix + cfg.tree * (cfg.steps + cfg.warmup + 1)
    num_pages = cfg.batch * -(-max_len // cfg.page_size)
    cache = PagedKVCache(cfg.layers, cfg.h_kv, cfg.head_dim, num_pages=num_pages, page_size=cfg.page_size,
                         dtype=dtype, backend=cfg.backend, first_round=cfg.first_round)
    ids = list(range(cfg.batch))
    for i in ids:
        cache.add_sequence(i)
    rows = cfg.batch * cfg.prefix
    if rows:
        cache.begin_forward(ids, [cfg.prefix] * cfg.batch)
        for layer in range(cfg.layers):  # the prefix's K/V: random, written through the cache
            kv = torch.randn(rows, cfg.h_kv, cfg.head_dim, generator=gen).to(dtype)
            cache.attention(layer, torch.randn(rows, cfg.h_kv, cfg.head_dim, generator=gen).to(dtype), kv, kv)
        cache.end_forward()

    rows = cfg.batch * cfg.tree
    q, k, v = (torch.randn(rows, h, cfg.head_dim, generator=gen).to(dtype) for h in (cfg.h_q, cfg.h_kv, cfg.h_kv))
    plan_s, attn_s, commit_s, kernel_s = [], [], [], []
    for step in range(cfg.warmup + cfg.steps):
        t0 = time.perf_counter()
        cache.begin_forward(ids, [cfg.tree] * cfg.batch, trees)
        t1 = time.perf_counter()
        for layer in range(cfg.layers):
            cache.attention(layer, q, k, v)
        t2 = time.perf_counter()
        cache.end_forward()
        t2_end = time.perf_counter()
        plan = _kernel_plan(cache, ids, trees)  # before the commit drops the trees
        t3 = time.perf_counter()
        cache.commit_accepted(ids, rng.integers(0, cfg.tree, cfg.batch).tolist())
        t4 = time.perf_counter()
        for layer in range(cfg.layers):
            paged_tree_attention(q, None, cache.kv_pages[layer], None, None, None, None, None, plan=plan,
                                 backend=cfg.backend)
        t5 = time.perf_counter()
        if step >= cfg.warmup:
            plan_s.append(t1 - t0)
            attn_s.append(t2 - t1)
            commit_s.append((t2_end - t2) + (t4 - t3))
            kernel_s.append(t5 - t4)
    steps = [p + a + c for p, a, c in zip(plan_s, attn_s, commit_s)]
    return {"config": asdict(cfg), "plan_ms": _median_ms(plan_s), "attention_ms": _median_ms(attn_s),
            "commit_ms": _median_ms(commit_s), "step_ms": _median_ms(steps), "kernel_ms": _median_ms(kernel_s),
            "final_lengths": [min(cache.seq_len(i) for i in ids), max(cache.seq_len(i) for i in ids)]}


def _markdown(results: list[dict], machine: dict) -> str:
    lines = ["# Paged KV cache: one tree-decoding step", "",
             "A step = `begin_forward` (plan) + `attention` for every layer + `end_forward` + `commit_accepted`. "
             "`kernel` = one `paged_tree_attention` per layer over the same pages with a prebuilt plan "
             "(the attention work without the cache). Medians over the timed steps. "
             "Produced by `python bench/cache.py`.", "",
             "Shapes: {h_q} query / {h_kv} KV heads, head dim {head_dim}, pages of {page_size}, random trees "
             "(fixed seed), random accepted leaves; backend {backend}. `cache overhead` = (step - kernel) / step; "
             "both are timed on a shared machine, so a few percent either way is noise.".format(
                 **{**results[0]["config"], "backend": results[0]["config"]["backend"] or "default"}), "",
             "Machine: " + ", ".join(f"{k} {v}" for k, v in machine.items()), "",
             "| batch x tree | prefix | layers | dtype | first round | threads | plan ms | attention ms | commit ms "
             "| step ms | kernel ms | cache overhead |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        c = r["config"]
        overhead = (r["step_ms"] - r["kernel_ms"]) / r["step_ms"] * 100
        lines.append(f"| {c['batch']} x {c['tree']} | {c['prefix']} | {c['layers']} | {c['dtype']} | "
                     f"{c['first_round']} | {r['threads']} | {r['plan_ms']:.2f} | {r['attention_ms']:.1f} | "
                     f"{r['commit_ms']:.2f} | {r['step_ms']:.1f} | {r['kernel_ms']:.1f} | {overhead:.0f}% |")
    return "\n".join(lines) + "\n"


def add_cache_bench_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--prefix", type=int, nargs="+", default=[512])
    parser.add_argument("--dtype", nargs="+", default=["fp32"], choices=list(DTYPES))
    parser.add_argument("--first-round", nargs="+", default=["paged", "merge"], choices=["merge", "paged"])
    parser.add_argument("--threads", type=int, nargs="+", default=[torch.get_num_threads()])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--backend", default=None)
    parser.add_argument("--quick", action="store_true", help="8 sequences x 16-node trees, 2 steps")
    parser.add_argument("--out", type=Path, default=None, help="write a markdown table here")


def main_cache_bench(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    base = {"steps": args.steps, "backend": args.backend}
    if args.quick:
        base.update(batch=8, tree=16, steps=2, warmup=1)
    console, results = Console(), []
    machine = machine_info()
    for threads in args.threads:
        torch.set_num_threads(threads)
        for dtype in args.dtype:
            for prefix in args.prefix:
                for first_round in args.first_round:
                    cfg = CacheBenchConfig(prefix=prefix, dtype=dtype, first_round=first_round, **base)
                    with console.status(f"{cfg.batch} x {cfg.tree}-node trees, prefix {prefix}, {dtype}, "
                                        f"{first_round}, {threads} threads"):
                        result = run_cache_step_bench(cfg)
                    results.append({**result, "threads": threads})
    table = Table(title="paged KV cache: one tree-decoding step (ms, median)")
    for col in ("prefix", "dtype", "first round", "threads", "plan", "attention", "commit", "step", "kernel"):
        table.add_column(col, justify="right")
    for r in results:
        c = r["config"]
        table.add_row(str(c["prefix"]), c["dtype"], c["first_round"], str(r["threads"]), f"{r['plan_ms']:.2f}",
                      f"{r['attention_ms']:.1f}", f"{r['commit_ms']:.2f}", f"{r['step_ms']:.1f}", f"{r['kernel_ms']:.1f}")
    console.print(table)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(_markdown(results, machine))
        console.print(f"wrote {args.out}")
    return 0
