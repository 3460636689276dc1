"""One layer's attention call inside vLLM: treeattn vs vLLM's CPU_ATTN kernel, on the same cache tensor.

    python bench/vllm_kernels.py [--out bench/results/vllm-kernels.md]

Needs the vLLM venv (``make test-vllm`` builds it). Shapes of SmolLM2 under vLLM on the CPU
(9 query / 3 KV heads, head dim 64, block size 128), one thread: decode of 1 and 16 requests at
context 576 (the middle of ``bench/vllm_serving.py``'s decode), 16 requests of 8 new tokens (a tree step's
size, causal: what CPU_ATTN runs) and a 512-token prefill. treeattn's
call is what vLLM's impl runs per layer (``PagedCall.run`` into preallocated outputs); the step's host
work, paid once for all layers, is timed apart: the builder's plan (``treeattn.vllm.batch.step_plan``)
and the first layer's ``prepare_paged_tree_attention`` (checks, backend choice, the kernel's tables).
treeattn's kernel is the one vLLM's impl gets: capability dispatch (the native C++ kernel here); the
table names the kernel path each dtype ran on, and "bf16 pairs" where any of the step's items ran there (a
prefill's last block of 2 tokens does): where the
CPU has AVX512-BF16, bf16 items of few rows run on them where a probe times them at least as fast as the
GEMMs (``NativeBackend.pairs``);
``TREEATTN_NATIVE_BF16_PAIRS=on`` / ``off`` forces either, to compare them (on AMX: the pairs against its tiles).

Each step is timed twice: warm (one layer's cache called again and again, so it stays in the CPU's
caches) and as in a model (the calls go round the caches of ``LAYERS`` layers, SmolLM2's 30: each layer's
keys have left the caches by its next turn, and come from memory as they do when serving).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from itertools import cycle
from pathlib import Path

import numpy as np
import torch
from vllm import _custom_ops as ops
from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

from treeattn import PagedKV, prepare_paged_tree_attention
from treeattn.backends.native import NativeBackend
from treeattn.cli.machine import describe_cpu
from treeattn.vllm.backend import shared_cpu_isa
from treeattn.vllm.batch import split_kv_cache, step_plan

H_Q, H_KV, D, PAGE, PAGES, LAYERS = 9, 3, 64, 128, 200, 30
# (requests, new tokens each, context): decodes, a step of 8-token trees' size (as a causal chain: the cost
# of a tree's mask, and what CPU_ATTN can run), a prefill
STEPS = [(1, 1, 576), (16, 1, 576), (16, 8, 576), (1, 512, 512)]


def ms(fn, repeat: int = 10) -> float:
    fn(), fn()
    start = time.perf_counter()
    for _ in range(repeat):
        fn()
    return (time.perf_counter() - start) / repeat * 1e3


def paired_ms(a, b, rounds: int = 15) -> tuple[float, float]:
    """Medians of ``rounds`` interleaved rounds, each timing a run of ~5 ms of calls of ``a`` then ``b``: a
    machine whose speed drifts (shared cores) then shifts both alike."""
    calls = [max(1, int(5.0 / max(ms(f, 3), 1e-3))) for f in (a, b)]
    times: list[list[float]] = [[], []]
    for _ in range(rounds):
        for i, f in enumerate((a, b)):
            times[i].append(ms(f, calls[i]))
    return statistics.median(times[0]), statistics.median(times[1])


def in_turn(fn, values: list):
    """A call of ``fn`` on each of ``values`` in turn, round and round (each call reads the next layer's cache)."""
    turn = cycle(values)
    return lambda: fn(next(turn))


def row(requests: int, new: int, context: int, dtype: torch.dtype) -> str:
    qsl = np.arange(requests + 1) * new
    seq_lens = np.full(requests, context)
    table = np.arange(requests * 8).reshape(requests, 8) % PAGES
    caches = [torch.randn(PAGES, H_KV, PAGE, 2 * D, dtype=dtype) for _ in range(LAYERS)]
    halves = [split_kv_cache(cache) for cache in caches]  # CPU_ATTN takes the two halves of each cell
    # treeattn reads the cells as vLLM's backend does: K dims-major where vLLM's vec / vec16 kernel owns them
    dims_major = shared_cpu_isa(dtype, PAGE, D, "cpu") is not None
    pages = [PagedKV.wrap(split_kv_cache(cache, dims_major), "HND") for cache in caches]
    q = torch.randn(requests * new, H_Q, D, dtype=dtype)
    out, lse = torch.empty_like(q), torch.empty(q.shape[:2])

    def step():  # a fresh plan each time: prepare's tables are cached on the plan
        return prepare_paged_tree_attention(q, pages[0], sm_scale=D ** -0.5,
                                            plan=step_plan(qsl, seq_lens, table, page_size=PAGE, num_pages=PAGES))

    step_ms = ms(step)
    call = step()
    isa = _get_attn_isa(dtype, PAGE, D)
    qsl_t, seq_t, table_t = (torch.from_numpy(a).to(torch.int32) for a in (qsl, seq_lens, table))
    scheduler = ops.cpu_attn_get_scheduler_metadata(
        num_reqs=requests, num_heads=H_Q, num_kv_heads=H_KV, head_dim=D, seq_lens=seq_t, dtype=dtype,
        query_start_loc=qsl_t, causal=True, sliding_window_size=-1, isa=isa, enable_kv_split=True)

    def cpu_attn(kv: tuple[torch.Tensor, torch.Tensor]) -> None:
        ops.cpu_attention_with_kv_cache(
            query=q, key_cache=kv[0], value_cache=kv[1], output=out, query_start_loc=qsl_t, seq_lens=seq_t,
            scale=D ** -0.5, causal=True, alibi_slopes=None, sliding_window=-1, block_table=table_t, softcap=0,
            scheduler_metadata=scheduler, s_aux=None)

    backend = NativeBackend()
    module = backend.extension.module()
    on_pairs = module.bf16_pairs_items()
    cells = ""
    for count in (1, LAYERS):  # warm, then as in a model
        ours, theirs = paired_ms(in_turn(lambda kv: call.run(q, kv, out=out, lse=lse), pages[:count]),
                                 in_turn(cpu_attn, halves[:count]))
        cells += f" {ours:.3f} | {theirs:.3f} | {ours / theirs:.2f}x |"
    path = backend.path(dtype)  # fp32's is measured per process where two paths tie (see its docs)
    label = f"`{path}`" + (", bf16 pairs" if module.bf16_pairs_items() > on_pairs else "")  # items that ran there
    return f"| {requests} x {new} | {context} | {str(dtype).removeprefix('torch.')} ({label}) | {step_ms:.2f} |" + cells


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="bench/results/vllm-kernels.md")
    args = parser.parse_args()
    torch.set_num_threads(1)
    lines = [f"# One attention call (one layer), treeattn vs vLLM CPU_ATTN ({_get_attn_isa(torch.float32, PAGE, D)} "
             f"kernels), 1 thread, load average before {os.getloadavg()[0]:.1f}", "",
             f"{describe_cpu()}, {time.strftime('%Y-%m-%d')}; torch {torch.__version__}.", "",
             f"Times in ms per layer, and treeattn's over CPU_ATTN's; warm: one layer's cache called again and again; "
             f"in a model: the calls go round {LAYERS} layers' caches (their keys come from memory).", "",
             "| requests x new tokens | context | dtype | plan + prepare (ms/step) | warm: treeattn | CPU_ATTN | ratio | "
             "in a model: treeattn | CPU_ATTN | ratio |",
             "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|"]
    lines += [row(*step, dtype) for dtype in (torch.bfloat16, torch.float32) for step in STEPS]
    text = "\n".join(lines) + "\n"
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(text)
    print(text)


if __name__ == "__main__":
    main()
