"""vLLM serving SmolLM2 with treeattn vs vLLM's own CPU_ATTN, in the same run.

    python bench/vllm_serving.py [--batches 1 16] [--prompt 512] [--new 128] [--out bench/results/vllm]

Needs the vLLM venv (``make test-vllm`` builds it). SmolLM2 is converted to safetensors once; each
backend then serves it in its own process (the plugin picks the class behind ``CPU_ATTN`` at start),
one after the other, with the same engine settings. Per batch size: ``B`` distinct random prompts
of ``--prompt`` tokens (no prefix-cache hits), ``--new`` greedy tokens each, all submitted at once.
Reported: throughput (generated tokens / wall time), time to first token and time per output
token (vLLM's own per-request timestamps, averaged over the batch).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

from treeattn.cli.machine import describe_cpu
from vllm_engines import engine_env, run_engine, write_results

BACKENDS = ("cpu_attn", "treeattn")


def serve(args) -> dict:
    """One backend (chosen by the environment): every batch size on one engine."""
    from vllm import LLM, SamplingParams, TokensPrompt

    llm = LLM(model=args.model, dtype=args.dtype, max_model_len=args.prompt + args.new + 16,
              enforce_eager=True, enable_prefix_caching=False, disable_log_stats=False, seed=0,
              max_num_seqs=max(args.batches), max_num_batched_tokens=args.chunk)
    vocab = llm.llm_engine.model_config.get_vocab_size()
    params = SamplingParams(temperature=0.0, max_tokens=args.new, ignore_eos=True)
    rng = random.Random(0)

    def prompts(n):
        return [TokensPrompt(prompt_token_ids=[rng.randrange(100, vocab) for _ in range(args.prompt)])
                for _ in range(n)]

    llm.generate(prompts(1), SamplingParams(max_tokens=4), use_tqdm=False)  # warm-up
    rows = []
    for batch in args.batches:
        start = time.perf_counter()
        outs = llm.generate(prompts(batch), params, use_tqdm=False)
        wall = time.perf_counter() - start
        ttft = [o.metrics.first_token_latency for o in outs]
        tpot = [(o.metrics.last_token_ts - o.metrics.first_token_ts) / (len(o.outputs[0].token_ids) - 1)
                for o in outs]
        rows.append({"batch": batch, "wall_s": wall, "tokens_per_s": batch * args.new / wall,
                     "ttft_s": sum(ttft) / batch, "tpot_ms": 1e3 * sum(tpot) / batch})
    return {"rows": rows}


def table(results: dict, args) -> str:
    lines = [f"# vLLM {results['vllm']} on the CPU: SmolLM2-135M ({args.dtype}), prompt {args.prompt}, "
             f"{args.new} new tokens, prefill chunk {args.chunk}",
             "",
             f"{results['machine']}; engines run one after the other in one `bench/vllm_serving.py` run.",
             "",
             "| batch | backend | tokens/s | time to first token (s) | time per output token (ms) | wall (s) |",
             "|---:|---|---:|---:|---:|---:|"]
    for i, batch in enumerate(args.batches):
        for name in BACKENDS:
            r = results[name]["rows"][i]
            lines.append(f"| {batch} | {name} | {r['tokens_per_s']:.1f} | {r['ttft_s']:.2f} | {r['tpot_ms']:.1f} | "
                         f"{r['wall_s']:.1f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--new", type=int, default=128)
    parser.add_argument("--chunk", type=int, default=2048, help="vLLM's max_num_batched_tokens")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--model", help="a SmolLM2 safetensors folder (default: converted into a temp folder)")
    parser.add_argument("--out", default="bench/results/vllm", help="writes OUT.json and OUT.md")
    parser.add_argument("--serve", help=argparse.SUPPRESS)  # internal: run one backend, write JSON here
    args = parser.parse_args()
    if args.serve:
        Path(args.serve).write_text(json.dumps(serve(args)))
        return

    import vllm

    with tempfile.TemporaryDirectory() as tmp:
        if args.model is None:
            from treeattn.models.loader import save_smollm2

            args.model = str(save_smollm2(Path(tmp) / "smollm2"))
        results = {"vllm": vllm.__version__, "args": {k: v for k, v in vars(args).items() if k != "serve"},
                   "machine": f"{describe_cpu()}, {time.strftime('%Y-%m-%d')}, "
                              f"load average before {os.getloadavg()[0]:.1f}"}
        for name in BACKENDS:
            out = Path(tmp) / f"{name}.json"
            cmd = [sys.executable, __file__, *sys.argv[1:], "--model", args.model, "--serve", str(out)]
            results[name] = run_engine(name, cmd, engine_env(name == "treeattn"), out)
    write_results(args.out, results, table(results, args))


if __name__ == "__main__":  # vLLM starts engine processes with spawn
    main()
