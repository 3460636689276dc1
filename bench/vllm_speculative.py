"""Speculation inside vLLM on the CPU: plain decoding vs vLLM's chain n-gram vs treeattn's trees, same run.

    python bench/vllm_speculative.py [--max-tokens 96] [--repeats 2] [--out bench/results/vllm-speculative]

Needs the vLLM venv (``make test-vllm`` builds it). SmolLM2-135M-Instruct (float32, converted to
safetensors once) serves the demo's built-in prompts (they repeat their input: lookup drafters
shine) and prompts with nothing to look up (``bench/speculative.py``'s), one request at a time,
greedy, chat template, ``--max-tokens`` new tokens each (no stop token: every method emits the same
count). Each method runs in its own engine process, one after the other, ``--repeats`` times (every
other round in reverse order, so load drifts hit all methods alike); a method's fastest round per
prompt group is reported:

- ``plain``: vLLM, its own attention (``CPU_ATTN``), no speculation;
- ``chain ngram k``: vLLM's n-gram speculation, ``k`` draft tokens per step, its own attention;
- ``tree N ngram``: ``TREEATTN_VLLM=1`` with ``tree_speculative_config(nodes=N)`` (treeattn's n-gram
  tree drafter, the same draft source as vLLM's chain; adaptive: per step only the nodes expected to
  pay for their verification time, up to ``N``, verified with treeattn's attention); ``tree N ngram
  full``: the drafter's whole tree every step; ``tree N suffix``: the suffix drafter (a suffix trie
  over the prompts and earlier answers); ``tree N auto``: suffix + the shipped draft head (asked
  where the suffix drafter is unsure; it reads vLLM's hidden states, embeddings and LM head).

Tokens per step = generated tokens / (generated - accepted), from vLLM's own speculative metrics
(each model step of a request emits one token plus the drafts it accepted). Every output is checked
token for token against ``plain``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

from speculative import NO_LOOKUP  # bench/speculative.py: prompts with nothing to look up
from treeattn.cli.machine import describe_cpu
from vllm_engines import engine_env, run_engine, write_results

METHODS = {"plain": None, "chain ngram 5": {"chain": 5}, "chain ngram 15": {"chain": 15},
           "tree 16 ngram full": {"tree": 16, "adaptive": False}, "tree 16 ngram": {"tree": 16},
           "tree 16 suffix": {"tree": 16, "drafter": "suffix"}, "tree 16 auto": {"tree": 16, "drafter": "auto"}}


def serve(args, method: dict | None, prompts: dict[str, dict[str, list[int]]]) -> dict:
    """One engine: every prompt group, one request at a time; times, tokens and vLLM's counters."""
    from vllm import LLM, SamplingParams, TokensPrompt

    from treeattn.vllm.speculative import tree_speculative_config

    spec = None
    if method and "chain" in method:
        spec = {"method": "ngram", "num_speculative_tokens": method["chain"], "prompt_lookup_max": 4,
                "prompt_lookup_min": 1}
    elif method:
        spec = tree_speculative_config(nodes=method["tree"], adaptive=method.get("adaptive", True),
                                       drafter=method.get("drafter", "ngram"))
    llm = LLM(model=args.model, dtype="float32", max_model_len=2048, enforce_eager=True, seed=0,
              disable_log_stats=False, speculative_config=spec)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)

    def counters() -> dict[str, float]:
        return {m.name: m.value for m in llm.get_metrics() if type(m).__name__ == "Counter"}

    llm.generate([TokensPrompt(prompt_token_ids=next(iter(prompts["no lookup"].values())))],
                 SamplingParams(max_tokens=8), use_tqdm=False)  # warm-up
    groups = {}
    for group, texts in prompts.items():
        before, seconds, tokens = counters(), 0.0, {}
        for name, ids in texts.items():
            start = time.perf_counter()
            out = llm.generate([TokensPrompt(prompt_token_ids=ids)], params, use_tqdm=False)
            seconds += time.perf_counter() - start
            tokens[name] = list(out[0].outputs[0].token_ids)
        after = counters()
        delta = {k: after.get(k, 0) - before.get(k, 0) for k in after if k.startswith("vllm:spec_decode")}
        groups[group] = {"seconds": seconds, "tokens": tokens, "counters": delta,
                         "load": os.getloadavg()[0]}
    return groups


def table(results: dict, args) -> str:
    lines = [f"# Speculation in vLLM {results['vllm']} on the CPU: SmolLM2-135M-Instruct (float32), "
             f"{args.max_tokens} new tokens per prompt, one request at a time",
             "", f"`python bench/vllm_speculative.py --max-tokens {args.max_tokens}`: {results['machine']}. "
             f"Engines run one after the other, {args.repeats} round(s), the fastest kept; load average after each "
             "prompt group in the last column.", ""]
    for group in ("built-in", "no lookup"):
        plain = results["methods"]["plain"][group]
        lines += [f"**{group}** ({', '.join(plain['tokens'])})", "",
                  "| method | tokens/step | accepted/draft | tokens/s | speed-up | same tokens as plain | load |",
                  "|---|---:|---:|---:|---:|:-:|---:|"]
        for name, runs in results["methods"].items():
            r = runs[group]
            generated = sum(len(t) for t in r["tokens"].values())
            accepted = r["counters"].get("vllm:spec_decode_num_accepted_tokens", 0)
            drafts = r["counters"].get("vllm:spec_decode_num_drafts", 0)
            per_draft = f"{accepted / drafts:.2f}" if drafts else "-"
            rate = generated / r["seconds"]
            speedup = rate / (sum(len(t) for t in plain["tokens"].values()) / plain["seconds"])
            same = "yes" if r["tokens"] == plain["tokens"] else "**no**"
            lines.append(f"| {name} | {generated / (generated - accepted):.2f} | {per_draft} | {rate:.1f} | "
                         f"{speedup:.2f}x | {same} | {r['load']:.1f} |")
        lines.append("")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    parser.add_argument("--repeats", type=int, default=1, help="rounds over all methods; the fastest is kept")
    parser.add_argument("--model", help="a SmolLM2 safetensors folder (default: converted into a temp folder)")
    parser.add_argument("--out", default="bench/results/vllm-speculative", help="writes OUT.json and OUT.md")
    parser.add_argument("--serve", nargs=3, help=argparse.SUPPRESS)  # internal: METHOD PROMPTS.json OUT.json
    args = parser.parse_args()
    if args.serve:
        method, prompts, out = args.serve
        Path(out).write_text(json.dumps(serve(args, METHODS[method], json.loads(Path(prompts).read_text()))))
        return

    import vllm
    from transformers import AutoTokenizer

    from treeattn.cli.demo import BUILTIN_PROMPTS, chat_ids

    with tempfile.TemporaryDirectory() as tmp:
        if args.model is None:
            from treeattn.models.loader import save_smollm2

            args.model = str(save_smollm2(Path(tmp) / "smollm2"))
        tokenizer = AutoTokenizer.from_pretrained(args.model)
        prompts = {group: {name: chat_ids(tokenizer, text) for name, text in texts.items()}
                   for group, texts in (("built-in", BUILTIN_PROMPTS), ("no lookup", NO_LOOKUP))}
        prompts_file = Path(tmp) / "prompts.json"
        prompts_file.write_text(json.dumps(prompts))
        results = {"vllm": vllm.__version__, "args": {k: v for k, v in vars(args).items() if k != "serve"},
                   "machine": f"{describe_cpu()}, {time.strftime('%Y-%m-%d')}, "
                              f"load average before {os.getloadavg()[0]:.1f}", "methods": {}}
        rounds: dict[str, list[dict]] = {name: [] for name in args.methods}
        for r in range(args.repeats):
            for name in args.methods if r % 2 == 0 else args.methods[::-1]:
                out = Path(tmp) / "out.json"
                tree = METHODS[name] is not None and "tree" in METHODS[name]
                cmd = [sys.executable, __file__, "--max-tokens", str(args.max_tokens), "--model", args.model,
                       "--serve", name, str(prompts_file), str(out)]
                rounds[name].append(run_engine(f"{name} (round {r + 1}/{args.repeats})", cmd,
                                               engine_env(tree, VLLM_ENABLE_V1_MULTIPROCESSING="0"), out))
        results["methods"] = {name: {group: min((run[group] for run in runs), key=lambda g: g["seconds"])
                                     for group in runs[0]} for name, runs in rounds.items()}
        results["rounds"] = rounds
    write_results(args.out, results, table(results, args))

if __name__ == "__main__":  # vLLM starts engine processes with spawn
    main()
