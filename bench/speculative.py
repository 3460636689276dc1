"""Speculative decoding of SmolLM2-135M on the CPU: greedy vs every drafter, same run, interleaved.

    python bench/speculative.py [--reps 2] [--max-tokens 96] [--threads N] [--draft-head PATH] [--out bench/results]

Prompts: the demo's built-in ones (they repeat their input: lookup drafters shine) and prompts with
nothing to look up. Methods: greedy; the n-gram drafter verifying its full 16-node trees (the demo's
drafter before adaptive trees); and the adaptive drafters ``ngram``, ``suffix``, ``heads``,
``auto`` (suffix + heads) with treeattn's head file, each built as ``treeattn demo --drafter NAME``
builds it, and ``eagle`` and ``auto eagle``, an EAGLE-3 head in place of that file: treeattn's (the
user's from ``treeattn train-heads --arch eagle3`` or the shipped one, which ``treeattn demo``
prefers), or ``--draft-head PATH`` (an EAGLE-3 or EAGLE-1/2 checkpoint). Every repetition
runs each prompt with every method, in an order rotated per prompt, with fresh drafters (a drafter
keeps what it learns across the prompts of one repetition, as in the demo, but never sees an answer
to the same prompt twice). Every output is checked token for token against greedy. The load
average is recorded with every measurement: other jobs share the machine.
Reported per method: tokens per step, mean tree size, the drafter's time per step (``draft ms``),
tokens/s and the speed-up. Writes ``speculative.json`` (every run) and ``speculative.md`` (the table)
to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

from treeattn.cli.demo import (
    BUILTIN_PROMPTS,
    MODEL_NAME,
    chat_ids,
    pick_threads,
)
from treeattn.cli.machine import describe_cpu
from treeattn.models.loader import load_smollm2
from treeattn.speculative import NGramDrafter, load_draft_head
from treeattn.speculative.adaptive import probe_cost
from treeattn.speculative.choice import build_drafter
from treeattn.speculative.generate import generate
from treeattn.speculative.heads import find_heads

NO_LOOKUP = {
    "dragon story": "Write a short story about a dragon who learns to cook.",
    "weekend": "Describe a perfect weekend in the countryside.",
    "hiking list": "What should I pack for a week-long hiking trip in the mountains?",
}
GROUPS = {"built-in": list(BUILTIN_PROMPTS), "no lookup": list(NO_LOOKUP)}
METHODS = ("greedy", "ngram full", "ngram", "suffix", "heads", "auto")


def make(method: str, model, budget: int, head_file=None, draft_head=None):
    if method == "greedy":
        return None
    if method == "ngram full":
        return NGramDrafter(16)
    if method in ("eagle", "auto eagle"):  # an EAGLE-3 head in place of treeattn's head file
        drafter, _ = build_drafter("heads" if method == "eagle" else "auto", None, budget, draft_head=draft_head)
    else:  # heads and auto: treeattn's head file, not an EAGLE-3 head
        drafter, _ = build_drafter(method, model.vocab_weights(), budget, model_name=MODEL_NAME,
                                   heads=head_file if method in ("heads", "auto") else None)
    probe_cost(model, drafter.cost)  # as the demo does: the cost model starts from timed forwards
    return drafter


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=2, help="repetitions (default 2)")
    parser.add_argument("--max-tokens", type=int, default=96, help="new tokens per prompt (default 96)")
    parser.add_argument("--tree-budget", type=int, default=24, help="most nodes per tree (default 24)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: as the demo)")
    parser.add_argument("--draft-head", type=Path, default=None, metavar="PATH",
                        help="the EAGLE-3 / EAGLE-1/2 checkpoint of methods eagle and auto eagle (default: treeattn's "
                             "EAGLE-3 head, the user's or the shipped one, where there is one)")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args()
    threads, why = pick_threads(args.threads)
    torch.set_num_threads(threads)
    model, tokenizer = load_smollm2()
    head_file = find_heads(eagle3=False)  # treeattn's head file: what heads and auto measure
    methods = [m for m in METHODS if m not in ("heads", "auto") or head_file is not None]
    if len(methods) < len(METHODS):
        print("no draft head file found (treeattn train-heads): heads and auto are left out", file=sys.stderr)
    own = find_heads()  # treeattn's EAGLE-3 head where there is one (a folder), else its head file
    eagle3 = args.draft_head or (own if own is not None and own.is_dir() else None)
    draft_head = None if eagle3 is None else load_draft_head(eagle3, target=model)
    if draft_head is not None:
        methods += ["eagle", "auto eagle"]
    texts = {**BUILTIN_PROMPTS, **NO_LOOKUP}
    ids = {name: chat_ids(tokenizer, text) for name, text in texts.items()}
    stop = [tokenizer.eos_token_id]
    generate(model, [ids["dragon story"][:32]], max_new_tokens=4)  # warm-up: BLAS kernels, cache plans
    runs = []
    started = time.perf_counter()
    for rep in range(args.reps):
        drafters = {m: make(m, model, args.tree_budget, head_file, draft_head) for m in methods}
        for p, (name, prompt) in enumerate(ids.items()):
            order = methods[p % len(methods):] + methods[:p % len(methods)]  # rotate: no method always first
            results = {}
            for m in order:
                r = generate(model, [prompt], max_new_tokens=args.max_tokens, stop_tokens=stop, drafter=drafters[m],
                             draft_slack=max(256, args.tree_budget))
                results[m] = r
            greedy_tokens = results["greedy"].tokens
            for m in methods:
                r = results[m]
                runs.append({"rep": rep, "prompt": name, "method": m, "tokens": r.num_tokens,
                             "steps": len(r.emitted_per_step), "seconds": r.elapsed_s, "draft_s": r.draft_s,
                             "tokens_per_s": r.tokens_per_s, "tokens_per_step": r.mean_accepted,
                             "mean_tree": r.mean_tree_size, "identical": r.tokens == greedy_tokens,
                             "load": os.getloadavg()[0]})
            line = "  ".join(f"{m} {results[m].tokens_per_s:5.1f}" for m in methods)
            print(f"rep {rep + 1}/{args.reps} {name:<14} tok/s: {line}  (load {os.getloadavg()[0]:.1f}, "
                  f"{time.perf_counter() - started:.0f} s)", flush=True)
    summary = summarize(runs, methods)
    record = {"model": MODEL_NAME, "dtype": "float32", "threads": threads, "why_threads": why.strip(),
              "max_tokens": args.max_tokens, "tree_budget": args.tree_budget, "reps": args.reps,
              "machine": f"{describe_cpu()}, {time.strftime('%Y-%m-%d')}",
              "torch": torch.__version__, "heads": None if head_file is None else str(head_file),
              "draft_head": None if args.draft_head is None else str(args.draft_head),
              "eagle_head": None if eagle3 is None else str(eagle3), "summary": summary, "runs": runs,
              "load_range": [min(r["load"] for r in runs), max(r["load"] for r in runs)]}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "speculative.json").write_text(json.dumps(record, indent=1))
    (args.out / "speculative.md").write_text(markdown(record, methods))
    print(markdown(record, methods))
    return 0 if all(r["identical"] for r in runs) else 1


def summarize(runs: list[dict], methods: list[str]) -> dict:
    """Per prompt group and method: tokens per step and tokens/s over the group (all its tokens over
    all its seconds), and the speed-up over greedy in the same repetition; medians over repetitions."""
    out = {}
    for group, names in GROUPS.items():
        reps = sorted({r["rep"] for r in runs})
        per = {m: {"tokens_per_step": [], "tokens_per_s": [], "speedup": [], "mean_tree": [], "draft_ms": []}
               for m in methods}
        for rep in reps:
            sel = {m: [r for r in runs if r["rep"] == rep and r["method"] == m and r["prompt"] in names]
                   for m in methods}
            rate = {m: sum(r["tokens"] for r in sel[m]) / sum(r["seconds"] for r in sel[m]) for m in methods}
            for m in methods:
                per[m]["tokens_per_step"].append(sum(r["tokens"] for r in sel[m]) / sum(r["steps"] for r in sel[m]))
                per[m]["mean_tree"].append(float(np.mean([r["mean_tree"] for r in sel[m]])))
                per[m]["draft_ms"].append(1e3 * sum(r["draft_s"] for r in sel[m]) / sum(r["steps"] for r in sel[m]))
                per[m]["tokens_per_s"].append(rate[m])
                per[m]["speedup"].append(rate[m] / rate["greedy"])
        out[group] = {m: {k: float(np.median(v)) for k, v in per[m].items()} | {"speedup_all": per[m]["speedup"]}
                      for m in methods}
    return out


def markdown(record: dict, methods: list[str]) -> str:
    lo, hi = record["load_range"]
    same = "yes" if all(r["identical"] for r in record["runs"]) else "NO"
    head = f" --draft-head {record['draft_head']}" if record.get("draft_head") else ""
    intro = (f"`python bench/speculative.py --reps {record['reps']} --max-tokens {record['max_tokens']}{head}`: "
             f"{record['machine']}, torch {record['torch']}, load average {lo:.1f}-{hi:.1f} during the run "
             f"(shared machine). Medians over {record['reps']} repetitions; speed-up = tokens/s over greedy's in "
             "the same repetition (each repetition's values in brackets). All outputs token-identical to "
             f"greedy: {same}.")
    lines = [f"# Speculative decoding, {record['model']}, CPU float32, {record['threads']} thread(s)", "", intro, ""]
    for group, rows in record["summary"].items():
        names = ", ".join(GROUPS[group])
        lines += [f"**{group}** ({names})", "",
                  "| method | tokens/step | mean tree | draft ms/step | tokens/s | speed-up |",
                  "|---|---:|---:|---:|---:|---:|"]
        for m in methods:
            r = rows[m]
            each = ", ".join(f"{x:.2f}" for x in r["speedup_all"])
            lines.append(f"| {m} | {r['tokens_per_step']:.2f} | {r['mean_tree']:.1f} | {r['draft_ms']:.1f} | "
                         f"{r['tokens_per_s']:.1f} | "
                         f"{r['speedup']:.2f}x ({each}) |")
        lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
