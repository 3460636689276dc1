"""SmolLM2 through HF transformers vs treeattn's compact model: ``python bench/hf.py [--repeats 3] [--out bench/results/hf.md]``.

Per built-in demo prompt (chat template, one prompt at a time, greedy, stop at EOS), tokens/s of:
  hf-generate  HF ``model.generate(do_sample=False)`` (its SDPA attention and DynamicCache)
  hf-tree      ``treeattn.hf.speculative_generate`` on the same HF model (n-gram tree drafter)
  compact-tree ``treeattn.speculative.generate`` on ``LlamaTreeModel`` built from the same weights
The three run interleaved in every repeat (so machine load hits all alike), outputs must be identical,
and the load average is recorded. ``--profile`` adds where the time of one tree run goes, per path.
"""

from __future__ import annotations

import argparse
import cProfile
import os
import platform
import pstats
import sys
import time

import torch


def _load():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from treeattn.models import LlamaTreeModel, smollm2_dir
    from treeattn.models.loader import SMOLLM2_GGUF

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    folder = smollm2_dir()
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=SMOLLM2_GGUF)
    hf = AutoModelForCausalLM.from_pretrained(folder, gguf_file=SMOLLM2_GGUF, dtype=torch.float32).eval()
    return hf, LlamaTreeModel.from_hf(hf, dtype=torch.float32), tokenizer


def _paths(hf, compact, budget: int, eos: int):
    from treeattn import NGramDrafter
    from treeattn.hf import speculative_generate
    from treeattn.speculative import generate

    def hf_generate(ids):
        x = torch.tensor([ids])
        return hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=MAX_NEW, do_sample=False,
                           eos_token_id=eos, pad_token_id=eos)[0, len(ids):].tolist()

    def hf_tree(ids):
        return speculative_generate(hf, torch.tensor([ids]), max_new_tokens=MAX_NEW, drafter=NGramDrafter(budget),
                                    eos_token_id=eos)[0, len(ids):].tolist()

    def compact_tree(ids):
        return generate(compact, [ids], max_new_tokens=MAX_NEW, drafter=NGramDrafter(budget),
                        stop_tokens=[eos]).tokens[0]

    return {"hf-generate": hf_generate, "hf-tree": hf_tree, "compact-tree": compact_tree}


MAX_NEW = 128


def main(argv=None) -> int:
    from treeattn.cli.demo import BUILTIN_PROMPTS, _chat_ids

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--tree-budget", type=int, default=16)
    parser.add_argument("--profile", action="store_true", help="profile one tree run per path (cProfile)")
    parser.add_argument("--out", default=None, help="write the markdown table here")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)

    hf, compact, tokenizer = _load()
    eos = tokenizer.eos_token_id
    paths = _paths(hf, compact, args.tree_budget, eos)
    prompts = {name: _chat_ids(tokenizer, text) for name, text in BUILTIN_PROMPTS.items()}
    warm = next(iter(prompts.values()))[:32]
    for run in paths.values():  # first calls initialise kernels and plans: outside the timings
        run(warm)

    load_before = os.getloadavg()
    times = {(p, n): [] for p in prompts for n in paths}
    outputs = {}
    for _ in range(args.repeats):
        for p, ids in prompts.items():
            for n, run in paths.items():
                start = time.perf_counter()
                out = run(ids)
                times[p, n].append(time.perf_counter() - start)
                outputs.setdefault((p, n), out)
                if out != outputs[p, n]:
                    raise AssertionError(f"{n} is not deterministic on {p!r}")
    load_after = os.getloadavg()

    names = list(paths)
    lines = [f"torch {torch.__version__}, {args.threads} threads, {platform.processor() or platform.machine()}; "
             f"load average before {load_before[0]:.1f}, after {load_after[0]:.1f}; "
             f"best of {args.repeats} interleaved repeats, tree budget {args.tree_budget}, "
             f"up to {MAX_NEW} new tokens, stop at EOS", "",
             "| prompt | tokens | identical | " + " | ".join(f"{n} tok/s" for n in names) + " | hf-tree / compact |",
             "|---|---:|:-:|" + "---:|" * len(names) + "---:|"]
    total = {n: 0.0 for n in names}
    tokens_all = 0
    for p in prompts:
        tokens = len(outputs[p, names[0]])
        same = all(outputs[p, n] == outputs[p, names[0]] for n in names)
        rate = {n: tokens / min(times[p, n]) for n in names}
        for n in names:
            total[n] += min(times[p, n])
        tokens_all += tokens
        lines.append(f"| {p} | {tokens} | {'yes' if same else 'NO'} | "
                     + " | ".join(f"{rate[n]:.1f}" for n in names)
                     + f" | {rate['hf-tree'] / rate['compact-tree']:.2f} |")
    rate = {n: tokens_all / total[n] for n in names}
    lines.append(f"| all | {tokens_all} | | " + " | ".join(f"{rate[n]:.1f}" for n in names)
                 + f" | {rate['hf-tree'] / rate['compact-tree']:.2f} |")
    table = "\n".join(lines)
    print(table)
    if args.profile:
        ids = prompts[next(iter(prompts))]
        for n in ("hf-tree", "compact-tree"):
            prof = cProfile.Profile()
            prof.runcall(paths[n], ids)
            print(f"\n## {n}: top functions by own time")
            pstats.Stats(prof, stream=sys.stdout).sort_stats("tottime").print_stats(14)
    if args.out:
        with open(args.out, "w") as f:
            f.write(table + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
