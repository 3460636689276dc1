"""Shared test cases: everything in ``treeattn.testing`` plus hypothesis strategies."""

from __future__ import annotations

import numpy as np
import torch
from hypothesis import strategies as st

from treeattn.testing import *  # noqa: F403
from treeattn.testing import LSE_RTOL, MIXED, TOL, Batch, Request  # noqa: F401  (explicit for linters)


@st.composite
def parent_arrays(draw, min_size: int = 1, max_size: int = 64, forests: bool = True) -> list[int]:
    """Hypothesis strategy: valid parent arrays (forests when ``forests``)."""
    n = draw(st.integers(min_size, max_size))
    parents = []
    for i in range(n):
        lo = -1 if (forests or i == 0) else 0
        parents.append(draw(st.integers(lo, i - 1)) if i else -1)
    return parents


VOCAB = 96  # the tiny random HF models' vocabulary


def tiny_hf(kind: str = "llama", seed: int = 0):
    """A tiny random HF causal LM (2 layers, hidden 64, GQA 4/2), float32, eval mode, eager attention."""
    import transformers

    torch.manual_seed(seed)
    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, attn_implementation="eager")
    if kind == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(rope_theta=1e5, **common))
    elif kind == "llama3-rope":
        scaling = {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                   "original_max_position_embeddings": 16}
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(rope_theta=5e5, rope_scaling=scaling, **common))
    elif kind == "qwen2":
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(tie_word_embeddings=True, **common))
    elif kind == "qwen3":
        model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(head_dim=16, **common))
    else:
        raise ValueError(kind)
    # Random init leaves biases and norm weights at 0 / 1: perturb them so they are really tested.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    return model.eval()


def tiny_model(kind: str = "llama", seed: int = 0, dtype: torch.dtype = torch.float32):
    """``treeattn.hf.HFTreeModel`` of ``tiny_hf(kind, seed)`` in ``dtype``."""
    from treeattn.hf import HFTreeModel

    return HFTreeModel(tiny_hf(kind, seed).to(dtype))


def make_prompts(seed: int, count: int) -> list[list[int]]:
    """Random prompts ending in a motif repeated three times (something for prompt lookup to find)."""
    rng = np.random.default_rng(seed)
    prompts = []
    for _ in range(count):
        motif = rng.integers(0, VOCAB, 5).tolist()
        prompts.append(rng.integers(0, VOCAB, rng.integers(3, 9)).tolist() + motif * 3)  # repetition to look up
    return prompts
