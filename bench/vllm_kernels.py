"""One layer's attention call inside vLLM: treeattn vs vLLM's CPU_ATTN kernel, on the same cache tensor.

    python bench/vllm_kernels.py [--out bench/results/vllm-kernels.md]

Needs the vLLM venv (``make test-vllm`` builds it). Shapes of SmolLM2 under vLLM on the CPU
(9 query / 3 KV heads, head dim 64, block size 128), one thread: decode of 1 and 16 requests at
context 576 (the middle of ``bench/vllm_serving.py``'s decode) and a 512-token prefill. Also the
builder's plan (``treeattn.vllm.batch.step_plan``), which vLLM's step pays once for all layers.
treeattn's kernel is the one vLLM's impl gets: capability dispatch (the native C++ kernel here).
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import numpy as np
import torch
from vllm import _custom_ops as ops
from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

from treeattn import paged_tree_attention
from treeattn.cli.machine import describe_cpu
from treeattn.vllm.batch import split_kv_cache, step_plan

H_Q, H_KV, D, PAGE, PAGES = 9, 3, 64, 128, 200
STEPS = [(1, 1, 576), (16, 1, 576), (1, 512, 512)]  # (requests, new tokens each, context)


def ms(fn, repeat: int = 10) -> float:
    fn(), fn()
    start = time.perf_counter()
    for _ in range(repeat):
        fn()
    return (time.perf_counter() - start) / repeat * 1e3


def row(requests: int, new: int, context: int, dtype: torch.dtype) -> str:
    qsl = np.arange(requests + 1) * new
    seq_lens = np.full(requests, context)
    table = np.arange(requests * 8).reshape(requests, 8) % PAGES
    plan_ms = ms(lambda: step_plan(qsl, seq_lens, table, page_size=PAGE, num_pages=PAGES))
    plan = step_plan(qsl, seq_lens, table, page_size=PAGE, num_pages=PAGES)
    k, v = split_kv_cache(torch.randn(PAGES, H_KV, PAGE, 2 * D, dtype=dtype))
    q = torch.randn(requests * new, H_Q, D, dtype=dtype)
    out = torch.empty_like(q)
    ours = ms(lambda: paged_tree_attention(q, None, (k, v), None, None, None, None, None, kv_layout="HND",
                                           sm_scale=D ** -0.5, plan=plan, out=out))
    isa = _get_attn_isa(dtype, PAGE, D)
    qsl_t, seq_t, table_t = (torch.from_numpy(a).to(torch.int32) for a in (qsl, seq_lens, table))
    scheduler = ops.cpu_attn_get_scheduler_metadata(
        num_reqs=requests, num_heads=H_Q, num_kv_heads=H_KV, head_dim=D, seq_lens=seq_t, dtype=dtype,
        query_start_loc=qsl_t, causal=True, sliding_window_size=-1, isa=isa, enable_kv_split=True)
    theirs = ms(lambda: ops.cpu_attention_with_kv_cache(
        query=q, key_cache=k, value_cache=v, output=out, query_start_loc=qsl_t, seq_lens=seq_t, scale=D ** -0.5,
        causal=True, alibi_slopes=None, sliding_window=-1, block_table=table_t, softcap=0,
        scheduler_metadata=scheduler, s_aux=None))
    return (f"| {requests} x {new} | {context} | {str(dtype).removeprefix('torch.')} | {plan_ms:.2f} | {ours:.2f} | "
            f"{theirs:.2f} | {ours / theirs:.1f}x |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="bench/results/vllm-kernels.md")
    args = parser.parse_args()
    torch.set_num_threads(1)
    lines = [f"# One attention call (one layer), treeattn vs vLLM CPU_ATTN ({_get_attn_isa(torch.float32, PAGE, D)} "
             f"kernels), 1 thread, load average before {os.getloadavg()[0]:.1f}", "",
             f"{describe_cpu()}, {time.strftime('%Y-%m-%d')}; torch {torch.__version__}.", "",
             "| requests x new tokens | context | dtype | plan (ms/step) | treeattn (ms) | CPU_ATTN (ms) | ratio |",
             "|---|---:|---|---:|---:|---:|---:|"]
    lines += [row(*step, dtype) for dtype in (torch.bfloat16, torch.float32) for step in STEPS]
    text = "\n".join(lines) + "\n"
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(text)
    print(text)


if __name__ == "__main__":
    main()
