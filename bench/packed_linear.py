"""What ``pack_linears`` buys a tree step: SmolLM2 forwards of 1..16 tree nodes, packed vs ``F.linear``.
``PYTHONPATH=src python bench/packed_linear.py [--repeats 2] [--threads 2]`` writes
``bench/results/packed-linear.md``.

One model (``treeattn.models.load_smollm2``: its linear layers are ``PackedLinear``), the demo's
dragon prompt three times as context, chain trees of ``n`` nodes (``n = 1``: a plain causal decode), each step's accepted node
committed; the median of 15 forwards per size. The unpacked rows run the very same layers through
PyTorch's ``F.linear`` (``PackedLinear.forward`` swapped for the run), so only the matmul differs.
The two variants alternate in every repeat, so machine load hits both alike.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from treeattn.cli.demo import chat_ids
from treeattn.cli.machine import describe_cpu
from treeattn.models.loader import load_smollm2
from treeattn.packed_linear import PackedLinear

SIZES = (1, 2, 4, 8, 16)


def step_ms(model, context: list[int], n: int, steps: int = 15) -> float:
    cache = model.new_cache(-(-(len(context) + 2 * steps) // 16) + 1, page_size=16)
    cache.add_sequence(0)
    model.forward(cache, [0], torch.tensor(context), [len(context)])
    times = []
    for _ in range(steps):
        parents = None if n == 1 else [np.arange(-1, n - 1)]
        start = time.perf_counter()
        model.forward(cache, [0], torch.randint(0, 1000, (n,)), [n], parents)
        times.append(time.perf_counter() - start)
        if parents is not None:
            cache.commit_accepted([0], [1])
    return float(np.median(times)) * 1e3


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "packed-linear.md")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, tokenizer = load_smollm2()
    context = chat_ids(tokenizer, "Write a short story about a dragon who learns to cook.") * 3
    packed_forward = PackedLinear.forward
    variants = {"packed (oneDNN)": packed_forward,
                "F.linear": lambda self, x: F.linear(x, self.weight, self.bias)}
    results = {name: {n: [] for n in SIZES} for name in variants}
    loads = []
    try:
        with model.attention():
            for rep in range(args.repeats):
                for name, forward in variants.items():
                    PackedLinear.forward = forward
                    for n in SIZES:
                        results[name][n].append(step_ms(model, context, n))
                    print(f"rep {rep + 1}/{args.repeats} {name:16s}",
                          "  ".join(f"{n}: {results[name][n][-1]:.1f} ms" for n in SIZES), flush=True)
                loads.append(os.getloadavg()[0])
    finally:
        PackedLinear.forward = packed_forward
    lines = [f"# pack_linears: SmolLM2-135M forward time by tree size, CPU float32, {args.threads} thread(s)", "",
             f"`python bench/packed_linear.py --repeats {args.repeats}`: {describe_cpu()}, {time.strftime('%Y-%m-%d')}, "
             f"torch {torch.__version__}, load average {min(loads):.1f}-{max(loads):.1f} during the run. "
             f"Median of 15 forwards after a {len(context)}-token context; each repeat's median in brackets.", "",
             "| tree nodes | " + " | ".join(variants) + " | F.linear / packed |", "|---:|" + "---:|" * (len(variants) + 1)]
    for n in SIZES:
        cells = [f"{np.median(results[name][n]):.1f} ms ({', '.join(f'{v:.1f}' for v in results[name][n])})"
                 for name in variants]
        ratio = np.median(results["F.linear"][n]) / np.median(results["packed (oneDNN)"][n])
        lines.append(f"| {n} | " + " | ".join(cells) + f" | {ratio:.2f}x |")
    args.out.write_text("\n".join(lines) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
