"""SmolLM2 through HF transformers: treeattn's paths vs HF's own greedy ``generate``.
``PYTHONPATH=src python bench/hf.py [--repeats 2] [--threads 1] [--out bench/results/hf-table.md]``.

One HF model (``LlamaForCausalLM`` from the shipped GGUF, ``treeattn.models.load_smollm2``), per built-in
demo prompt (chat template, one prompt at a time, greedy, stop at EOS), tokens/s of:
  hf-generate  HF ``model.generate(do_sample=False)`` (its SDPA attention and DynamicCache)
  hf-tree      ``treeattn.hf.speculative_generate`` on the same model (``NGramDrafter``)
  demo-greedy  ``treeattn.speculative.generate`` without a drafter: the demo's plain decoding
  demo-spec    ``treeattn.speculative.generate`` with the demo's default drafter (adaptive suffix + heads)
The paths run interleaved in every repeat (so machine load hits all alike), outputs must be identical,
and the load average is recorded. ``--profile`` adds where the time of one tree run goes, per tree path.
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import sys
import time

import torch

MAX_NEW = 128


def _paths(tree, budget: int, eos: int):
    from treeattn import NGramDrafter
    from treeattn.hf import speculative_generate
    from treeattn.speculative import generate
    from treeattn.speculative.adaptive import probe_cost
    from treeattn.speculative.choice import build_drafter

    hf = tree.model
    hf.set_attn_implementation("sdpa")  # HF's own attention; the treeattn paths switch to theirs per call
    drafter, described = build_drafter("auto", tree.vocab_weights(), budget, num_layers=tree.config.num_hidden_layers)
    with tree.attention():
        probe_cost(tree, drafter.cost)  # as the demo does: the cost model starts from timed forwards

    def hf_generate(ids):
        x = torch.tensor([ids])
        return hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=MAX_NEW, do_sample=False,
                           eos_token_id=eos, pad_token_id=eos)[0, len(ids):].tolist()

    def hf_tree(ids):
        return speculative_generate(hf, torch.tensor([ids]), max_new_tokens=MAX_NEW, drafter=NGramDrafter(budget),
                                    eos_token_id=eos)[0, len(ids):].tolist()

    def demo(with_drafter: bool):
        def run(ids):
            with tree.attention():
                return generate(tree, [ids], max_new_tokens=MAX_NEW, stop_tokens=[eos],
                                drafter=drafter if with_drafter else None).tokens[0]
        return run

    return {"hf-generate": hf_generate, "hf-tree": hf_tree, "demo-greedy": demo(False),
            "demo-spec": demo(True)}, described


def main(argv=None) -> int:
    from treeattn.cli.demo import BUILTIN_PROMPTS, chat_ids
    from treeattn.cli.machine import describe_cpu
    from treeattn.models import load_smollm2

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--tree-budget", type=int, default=16)
    parser.add_argument("--profile", action="store_true", help="profile one run per tree path (cProfile)")
    parser.add_argument("--out", default=None, help="write the markdown table here")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)

    tree, tokenizer = load_smollm2()
    eos = tokenizer.eos_token_id
    paths, described = _paths(tree, args.tree_budget, eos)
    prompts = {name: chat_ids(tokenizer, text) for name, text in BUILTIN_PROMPTS.items()}
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
    base = names[0]
    threads = f"{args.threads} thread{'s' if args.threads != 1 else ''}"
    lines = [f"{describe_cpu()}, {time.strftime('%Y-%m-%d')}; torch {torch.__version__}, {threads}; "
             f"load average before {load_before[0]:.1f}, after {load_after[0]:.1f}; "
             f"best of {args.repeats} interleaved repeats, tree budget {args.tree_budget}, "
             f"up to {MAX_NEW} new tokens, stop at EOS; demo-spec: {described}", "",
             "| prompt | tokens | identical | " + " | ".join(f"{n} tok/s" for n in names) + " | "
             + " | ".join(f"{n} / {base}" for n in names[1:]) + " |",
             "|---|---:|:-:|" + "---:|" * (2 * len(names) - 1)]
    total = {n: 0.0 for n in names}
    tokens_all = 0

    def row(label: str, tokens: int, same: str, rate: dict) -> str:
        return (f"| {label} | {tokens} | {same} | " + " | ".join(f"{rate[n]:.1f}" for n in names) + " | "
                + " | ".join(f"{rate[n] / rate[base]:.2f}x" for n in names[1:]) + " |")

    for p in prompts:
        tokens = len(outputs[p, base])
        same = all(outputs[p, n] == outputs[p, base] for n in names)
        for n in names:
            total[n] += min(times[p, n])
        tokens_all += tokens
        lines.append(row(p, tokens, "yes" if same else "NO", {n: tokens / min(times[p, n]) for n in names}))
    lines.append(row("all", tokens_all, "", {n: tokens_all / total[n] for n in names}))
    table = "\n".join(lines)
    print(table)
    if args.profile:
        ids = prompts[next(iter(prompts))]
        for n in ("hf-tree", "demo-spec"):
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
