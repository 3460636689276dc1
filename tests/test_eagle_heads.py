"""EAGLE-3 / EAGLE-1 draft heads and the published checkpoint formats (treeattn.speculative.eagle, .checkpoints).

Each head is checked against a float64 reference written here from the published definitions (EAGLE's
cnets.py / cnets1.py, vLLM's llama_eagle3.py / llama_eagle.py): plain torch ops over the whole sequence,
context rows causal, draft nodes seeing every context row plus their ancestors. Checkpoints are written in
each engine's format with random weights and loaded back.
"""

from __future__ import annotations

import copy
import json
import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from treeattn.speculative import MedusaHeads
from treeattn.speculative.checkpoints import DraftTarget, load_draft_head
from treeattn.speculative.eagle import Eagle3Head, EagleHead, HeadConfig, default_aux_layers
from treeattn.tree import CHAIN_CHUNK, MAX_TREE_SIZE

torch.set_num_threads(1)

H, V, DRAFT_V, TARGET_LAYERS = 32, 64, 24, 8
TOL = {"rtol": 2e-4, "atol": 2e-4}


def tiny(**kw) -> HeadConfig:
    base = {"hidden_size": H, "intermediate_size": 48, "num_attention_heads": 4, "num_key_value_heads": 2,
            "vocab_size": V, "rms_norm_eps": 1e-5, "rope_theta": 500.0}
    return HeadConfig(**{**base, **kw})


def randomize(module: torch.nn.Module, seed: int) -> None:
    """Fresh random weights everywhere (norms too: all-ones would hide a missing or swapped norm)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            scale = 1.0 if "norm" in name or "embed" in name else 1 / math.sqrt(p.shape[-1])
            p.copy_(torch.randn(p.shape, generator=g) * scale + (1.0 if "norm" in name else 0.0))


def eagle3(seed=0, draft_vocab=DRAFT_V, **kw) -> Eagle3Head:
    head = Eagle3Head(tiny(draft_vocab_size=draft_vocab, **kw))
    randomize(head, seed)
    if hasattr(head, "d2t"):
        g = torch.Generator().manual_seed(seed + 1)
        targets = torch.randperm(V, generator=g)[:draft_vocab].sort().values  # engines keep the draft ids sorted
        head.d2t.copy_(targets - torch.arange(draft_vocab))
        head.t2d.zero_()
        head.t2d[targets] = True
    return head.eval()


def eagle1(seed=0, **kw) -> EagleHead:
    head = EagleHead(tiny(**kw))
    randomize(head, seed)
    return head.eval()


# ---------------------------------------------------------------------------------------------------------------
# The float64 reference: the published definitions, over a whole sequence at once.

def rms(x, w, eps):
    return w * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def rope(x, pos, cfg):
    d = x.shape[-1]
    inv = 1.0 / cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    if cfg.rope_scaling:  # the tests use linear scaling only here; llama3 is checked against transformers below
        inv = inv / cfg.rope_scaling["factor"]
    ang = pos.double()[:, None] * inv[None]
    cos, sin = torch.cat([ang.cos(), ang.cos()], -1)[:, None], torch.cat([ang.sin(), ang.sin()], -1)[:, None]
    rot = torch.cat([-x[..., d // 2:], x[..., : d // 2]], -1)
    return x * cos + rot * sin


def visible(num_ctx, parents):
    """mask[i, j]: row i sees row j. Context rows are causal; node u sees all context and its ancestors."""
    n = len(parents)
    mask = torch.zeros(num_ctx + n, num_ctx + n, dtype=torch.bool)
    mask[:num_ctx, :num_ctx] = torch.ones(num_ctx, num_ctx).tril().bool()
    mask[num_ctx:, :num_ctx] = True
    for u in range(n):
        a = u
        while a != -1:
            mask[num_ctx + u, num_ctx + a] = True
            a = parents[a]
    return mask


def depths(parents):
    out = []
    for p in parents:
        out.append(0 if p == -1 else out[p] + 1)
    return out


def ref_layer(sd, cfg, attn_in, residual, pos, mask, pre="layers.0."):
    nh, nkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.dim
    lin = lambda x, n: x @ sd[pre + n + ".weight"].T + sd.get(pre + n + ".bias", 0)
    q = rope(lin(attn_in, "self_attn.q_proj").view(-1, nh, d), pos, cfg)
    k = rope(lin(attn_in, "self_attn.k_proj").view(-1, nkv, d), pos, cfg)
    v = lin(attn_in, "self_attn.v_proj").view(-1, nkv, d)
    k, v = k.repeat_interleave(nh // nkv, 1), v.repeat_interleave(nh // nkv, 1)
    s = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(d)
    p = torch.softmax(s.masked_fill(~mask, float("-inf")), -1)
    h = residual + lin(torch.einsum("hqk,khd->qhd", p, v).reshape(-1, nh * d), "self_attn.o_proj")
    x = rms(h, sd[pre + "post_attention_layernorm.weight"], cfg.rms_norm_eps)
    mlp = lin(torch.nn.functional.silu(lin(x, "mlp.gate_proj")) * lin(x, "mlp.up_proj"), "mlp.down_proj")
    return h + mlp


def ref_eagle3(head, feats, ctx_tokens, tree_hidden, tree_tokens, parents):
    """EAGLE-3 (vLLM llama_eagle3.py): fc on target features, hidden_norm/input_layernorm, 2H-wide attention."""
    cfg, sd = head.config, {k: v.double() for k, v in head.state_dict().items()}
    eps = cfg.rms_norm_eps
    if cfg.norm_before_fc:
        feats = rms(feats, sd["input_norm.weight"], eps)
    if cfg.fc_norm:
        feats = torch.cat([rms(c, sd[f"fc_norm.{i}.weight"], eps) for i, c in enumerate(feats.chunk(cfg.num_aux, -1))], -1)
    h_in = torch.cat([feats @ sd["fc.weight"].T, tree_hidden])
    emb = sd["embed_tokens.weight"][torch.cat([ctx_tokens, tree_tokens])]
    normed = rms(h_in, sd["layers.0.hidden_norm.weight"], eps)
    attn_in = torch.cat([rms(emb, sd["layers.0.input_layernorm.weight"], eps), normed], -1)
    n_ctx = feats.shape[0]
    pos = torch.tensor(list(range(n_ctx)) + [n_ctx + d for d in depths(parents)])
    out = ref_layer(sd, cfg, attn_in, normed if cfg.norm_before_residual else h_in, pos, visible(n_ctx, parents))
    final = rms(out, sd["norm.weight"], eps)
    return (final if cfg.norm_output else out), final @ sd["lm_head.weight"].T * cfg.logit_scale


def ref_eagle1(head, feats, ctx_tokens, tree_hidden, tree_tokens, parents):
    """EAGLE-1 (EAGLE cnets1.py): fc(cat(embed, hidden)) + bias, a Llama layer without input_layernorm."""
    cfg, sd = head.config, {k: v.double() for k, v in head.state_dict().items()}
    emb = sd["embed_tokens.weight"][torch.cat([ctx_tokens, tree_tokens])]
    x = torch.cat([emb, torch.cat([feats, tree_hidden])], -1) @ sd["fc.weight"].T + sd["fc.bias"]
    n_ctx = feats.shape[0]
    pos = torch.tensor(list(range(n_ctx)) + [n_ctx + d for d in depths(parents)])
    out = ref_layer(sd, cfg, x, x, pos, visible(n_ctx, parents))
    return out, out @ sd["lm_head.weight"].T


def inputs(head, n_ctx, n_tree, seed):
    g = torch.Generator().manual_seed(seed)
    width = head.config.feature_size if isinstance(head, Eagle3Head) else H
    return (torch.randn(n_ctx, width, generator=g), torch.randint(0, V, (n_ctx,), generator=g),
            torch.randn(n_tree, H, generator=g), torch.randint(0, V, (n_tree,), generator=g))


def run(head, feats, ctx_tokens, tree_hidden, tree_tokens, parents, ctx_chunks, tree_chunks):
    """The head over one sequence: context rows in ``ctx_chunks`` appends, then the tree in ``tree_chunks``."""
    cache = head.new_cache()
    cache.add_sequence("s")
    hidden, logits, at = [], [], 0
    for n in ctx_chunks:
        out = head(cache, ["s"], feats[at:at + n], ctx_tokens[at:at + n], [n])
        hidden.append(out.hidden)
        logits.append(head.logits(out.final))
        at += n
    at = 0
    for n in tree_chunks:
        out = head(cache, ["s"], tree_hidden[at:at + n], tree_tokens[at:at + n], [n], tree_parents=[parents[at:at + n]])
        hidden.append(out.hidden)
        logits.append(head.logits(out.final))
        at += n
    return torch.cat(hidden), torch.cat(logits), cache


TREE = [-1, -1, 0, 0, 1, 2, 2, 4]  # two first-level nodes, depth 3


def _and_fused(head):
    """``head`` and a copy with its projections fused (what drafting runs), which drops q/k/v and gate/up."""
    fused = copy.deepcopy(head)
    fused.fuse_projections()
    fused.fuse_projections()  # a second call keeps what the first made
    names = {name.split(".")[-2] for name in fused.state_dict() if name.startswith("layers.0.")}
    assert {"qkv_proj", "gate_up_proj"} <= names and not names & {"q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"}
    return head, fused


@pytest.mark.parametrize("variant", [
    {},
    {"norm_before_residual": True},
    {"norm_before_fc": True, "fc_norm": True},
    {"norm_output": True, "logit_scale": 0.5, "qkv_bias": True, "o_bias": True},
    {"num_key_value_heads": 4, "head_dim": 16, "target_hidden_size": 24},
    {"num_key_value_heads": 1, "rope_scaling": {"rope_type": "linear", "factor": 4.0}, "num_aux": 2},
])
def test_eagle3_prefix_then_tree_matches_reference(variant):
    head = eagle3(seed=3, **variant)
    feats, toks, th, tt = inputs(head, 11, len(TREE), seed=4)
    ref_hidden, ref_logits = ref_eagle3(head, feats.double(), toks, th.double(), tt, TREE)
    for each in _and_fused(head):
        hidden, logits, cache = run(each, feats, toks, th, tt, TREE, ctx_chunks=[6, 1, 4], tree_chunks=[2, 2, 4])
        torch.testing.assert_close(hidden.double(), ref_hidden, **TOL)
        torch.testing.assert_close(logits.double(), ref_logits, **TOL)
        assert cache.seq_len("s") == 11 and cache.tree_parents("s").tolist() == TREE


@pytest.mark.parametrize("qkv_bias", [False, True])
def test_eagle1_prefix_then_tree_matches_reference(qkv_bias):
    head = eagle1(seed=5, qkv_bias=qkv_bias)
    feats, toks, th, tt = inputs(head, 9, len(TREE), seed=6)
    ref_hidden, ref_logits = ref_eagle1(head, feats.double(), toks, th.double(), tt, TREE)
    assert "input_layernorm" not in " ".join(head.state_dict())  # EAGLE-1's layer 0 has none
    for each in _and_fused(head):
        hidden, logits, _ = run(each, feats, toks, th, tt, TREE, ctx_chunks=[9], tree_chunks=[2, 3, 3])
        torch.testing.assert_close(hidden.double(), ref_hidden, **TOL)
        torch.testing.assert_close(logits.double(), ref_logits, **TOL)


def test_context_append_discards_the_draft_tree():
    """After drafting, the accepted tokens' target features arrive as context rows: the tree's K/V must
    not be seen by them (the result equals never having drafted)."""
    head = eagle3(seed=7)
    feats, toks, th, tt = inputs(head, 10, 3, seed=8)
    cache = head.new_cache()
    cache.add_sequence(0)
    head(cache, [0], feats[:6], toks[:6], [6])
    head(cache, [0], th, tt, [3], tree_parents=[[-1, 0, 0]])
    out = head(cache, [0], feats[6:], toks[6:], [4])
    ref_hidden, _ = ref_eagle3(head, feats.double(), toks, th[:0].double(), tt[:0], [])
    torch.testing.assert_close(out.hidden.double(), ref_hidden[6:], **TOL)
    assert cache.seq_len(0) == 10 and cache.tree_parents(0).size == 0


def test_batch_equals_sequences_one_by_one():
    head = eagle3(seed=9)
    a, b = inputs(head, 7, 4, seed=10), inputs(head, 3, 2, seed=11)
    pa, pb = [-1, 0, 1, 0], [-1, -1]
    cache = head.new_cache()
    for s in ("a", "b", "idle"):
        cache.add_sequence(s)
    ctx = head(cache, ["a", "b", "idle"], torch.cat([a[0], b[0]]), torch.cat([a[1], b[1]]), [7, 3, 0])
    tree = head(cache, ["b", "a"], torch.cat([b[2], a[2]]), torch.cat([b[3], a[3]]), [2, 4], tree_parents=[pb, pa])
    for (feats, toks, th, tt), parents, ctx_rows, tree_rows in ((a, pa, slice(0, 7), slice(2, 6)),
                                                               (b, pb, slice(7, 10), slice(0, 2))):
        ref_hidden, _ = ref_eagle3(head, feats.double(), toks, th.double(), tt, parents)
        n = feats.shape[0]
        torch.testing.assert_close(ctx.hidden[ctx_rows].double(), ref_hidden[:n], **TOL)
        torch.testing.assert_close(tree.hidden[tree_rows].double(), ref_hidden[n:], **TOL)
    assert cache.seq_len("idle") == 0


def test_a_long_context_append_matches_reference():
    """A context append longer than CHAIN_CHUNK (a long prompt's first append) attends as several chains, each
    seeing every row before it; past MAX_TREE_SIZE rows too (one chain that long was refused)."""
    head = eagle3(seed=14)
    n = 2 * CHAIN_CHUNK + 37
    feats, toks, th, tt = inputs(head, n, len(TREE), seed=15)
    hidden, _, cache = run(head, feats, toks, th, tt, TREE, ctx_chunks=[3, n - 3], tree_chunks=[len(TREE)])
    ref_hidden, _ = ref_eagle3(head, feats.double(), toks, th.double(), tt, TREE)
    torch.testing.assert_close(hidden.double(), ref_hidden, **TOL)
    assert cache.seq_len("s") == n
    n = MAX_TREE_SIZE + 1
    feats, toks, th, tt = inputs(head, n, 1, seed=16)
    hidden, _, cache = run(head, feats, toks, th, tt, [-1], ctx_chunks=[n], tree_chunks=[1])
    assert cache.seq_len("s") == n and hidden.isfinite().all()


def test_a_batched_tree_append_where_one_sequence_adds_nothing():
    head = eagle3(seed=16)
    a, b = inputs(head, 5, 6, seed=17), inputs(head, 4, 2, seed=18)
    pa, pb = [-1, 0, -1, 1, 3, 2], [-1, 0]
    cache = head.new_cache()
    for s in ("a", "b"):
        cache.add_sequence(s)
    head(cache, ["a", "b"], torch.cat([a[0], b[0]]), torch.cat([a[1], b[1]]), [5, 4])
    first = head(cache, ["a", "b"], torch.cat([a[2][:3], b[2]]), torch.cat([a[3][:3], b[3]]), [3, 2],
                 tree_parents=[pa[:3], pb])
    more = head(cache, ["b", "a"], a[2][3:], a[3][3:], [0, 3], tree_parents=[[], pa[3:]])
    ref_a, _ = ref_eagle3(head, a[0].double(), a[1], a[2].double(), a[3], pa)
    ref_b, _ = ref_eagle3(head, b[0].double(), b[1], b[2].double(), b[3], pb)
    torch.testing.assert_close(torch.cat([first.hidden[:3], more.hidden]).double(), ref_a[5:], **TOL)
    torch.testing.assert_close(first.hidden[3:].double(), ref_b[4:], **TOL)
    assert cache.tree_parents("a").tolist() == pa and cache.tree_parents("b").tolist() == pb


@settings(max_examples=20, deadline=None)
@given(data=st.data())
def test_any_tree_in_any_steps_matches_reference(data):
    """Random trees appended in random chunks after a random prefix (itself appended in random chunks)."""
    n_ctx = data.draw(st.integers(1, 12), "prefix")
    n = data.draw(st.integers(1, 10), "nodes")
    parents = [data.draw(st.integers(-1, i - 1), f"parent[{i}]") for i in range(n)]
    cut = lambda total, label: _chunks(total, sorted(set(data.draw(st.lists(st.integers(1, total), max_size=3), label))))
    head = eagle3(seed=12)
    feats, toks, th, tt = inputs(head, n_ctx, n, seed=data.draw(st.integers(0, 2**16), "seed"))
    hidden, _, _ = run(head, feats, toks, th, tt, parents, cut(n_ctx, "ctx cuts"), cut(n, "tree cuts"))
    ref_hidden, _ = ref_eagle3(head, feats.double(), toks, th.double(), tt, parents)
    torch.testing.assert_close(hidden.double(), ref_hidden, **TOL)


def _chunks(total, cuts):
    edges = [0] + [c for c in cuts if c < total] + [total]
    return [b - a for a, b in zip(edges, edges[1:])]


def test_draft_ids_map_to_target_ids():
    head = eagle3(seed=13)
    draft_ids = torch.arange(DRAFT_V)
    targets = head.to_target(draft_ids)
    assert torch.equal(targets, draft_ids + head.d2t)
    assert torch.equal(torch.nonzero(head.t2d).flatten(), targets)  # t2d marks exactly the mapped ids
    final = torch.randn(3, H)
    full, draft = head.target_logits(final), head.logits(final)
    torch.testing.assert_close(full[:, targets], draft)
    others = torch.ones(V, dtype=torch.bool)
    others[targets] = False
    assert torch.isneginf(full[:, others]).all()
    # the top draft token, mapped, is the top target token
    assert torch.equal(head.to_target(draft.argmax(-1)), full.argmax(-1))
    same = eagle3(seed=13, draft_vocab=V)  # a full draft vocabulary: no map at all, as in every engine
    assert not hasattr(same, "d2t") and torch.equal(same.to_target(draft_ids), draft_ids)


def test_rope_scaling_matches_transformers():
    rope_utils = pytest.importorskip("transformers.modeling_rope_utils")
    from transformers import LlamaConfig

    from treeattn.speculative.eagle import _inv_freq

    scalings = [{"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                 "original_max_position_embeddings": 64},
                {"rope_type": "linear", "factor": 4.0}]
    for scaling in scalings:
        config = LlamaConfig(hidden_size=256, num_attention_heads=2, rope_parameters={"rope_theta": 5e5, **scaling})
        expected, factor = rope_utils.ROPE_INIT_FUNCTIONS[scaling["rope_type"]](config, "cpu")
        assert factor == 1.0
        torch.testing.assert_close(_inv_freq(128, 5e5, scaling), expected, rtol=1e-6, atol=0)


def test_bad_inputs_are_named():
    head = eagle3(seed=14)
    cache = head.new_cache()
    cache.add_sequence(0)
    with pytest.raises(ValueError, match=r"hidden must be \[2, 96\] \(target features\)"):
        head(cache, [0], torch.randn(2, H), torch.tensor([1, 2]), [2])
    with pytest.raises(ValueError, match="token_ids must be target ids"):
        head(cache, [0], torch.randn(2, 96), torch.tensor([1, V]), [2])
    with pytest.raises(ValueError, match=r"tree_parents\[0\]\[1\] = 1"):
        head(cache, [0], torch.randn(2, H), torch.tensor([1, 2]), [2], tree_parents=[[-1, 1]])
    with pytest.raises(KeyError, match="not in the cache"):
        head(cache, [1], torch.randn(1, 96), torch.tensor([1]), [1])
    with pytest.raises(ValueError, match="rope_scaling type 'yarn'"):
        tiny(rope_scaling={"rope_type": "yarn", "factor": 2.0})
    assert cache.seq_len(0) == 0  # nothing was appended by the failed calls


# ---------------------------------------------------------------------------------------------------------------
# Checkpoint formats

def llama_fields(cfg: HeadConfig) -> dict:
    return {"hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size, "num_hidden_layers": 1,
            "num_attention_heads": cfg.num_attention_heads, "num_key_value_heads": cfg.num_key_value_heads,
            "vocab_size": cfg.vocab_size, "rms_norm_eps": cfg.rms_norm_eps, "rope_theta": cfg.rope_theta}


def target_for(head, layers=TARGET_LAYERS, **kw) -> DraftTarget:
    g = torch.Generator().manual_seed(99)
    return DraftTarget(**{"hidden_size": H, "vocab_size": V, "num_layers": layers,
                          "embed": torch.randn(V, H, generator=g), "lm_head": torch.randn(V, H, generator=g), **kw})


def save(tensors: dict, path, fmt: str) -> None:
    if fmt == "safetensors":
        from safetensors.torch import save_file

        save_file({k: v.contiguous() for k, v in tensors.items()}, str(path))
    else:
        torch.save(tensors, path)


def write(folder, config, tensors, fmt="safetensors", shards=1):
    folder.mkdir(parents=True, exist_ok=True)
    if config is not None:
        (folder / "config.json").write_text(json.dumps(config))
    base = "model" if fmt == "safetensors" else "pytorch_model"
    ext = "safetensors" if fmt == "safetensors" else "bin"
    if shards == 1:
        save(tensors, folder / f"{base}.{ext}", fmt)
        return folder
    names, weight_map = sorted(tensors), {}
    for i in range(shards):
        part = names[i::shards]
        file = f"{base}-{i + 1:05d}-of-{shards:05d}.{ext}"
        save({k: tensors[k] for k in part}, folder / file, fmt)
        weight_map.update(dict.fromkeys(part, file))
    (folder / f"{base}.{ext}.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return folder


def assert_same_head(loaded, source, target_embed=None):
    got, want = loaded.state_dict(), source.state_dict()
    assert set(got) == set(want)
    for name in want:
        expected = target_embed if (name == "embed_tokens.weight" and target_embed is not None) else want[name]
        torch.testing.assert_close(got[name], expected.to(got[name].dtype), rtol=0, atol=0, msg=name)


def eagle3_tensors(head, *, layer_prefix="midlayer.", model_prefix="", embed=False):
    out = {}
    for name, value in head.state_dict().items():
        if name == "embed_tokens.weight" and not embed:
            continue
        name = name.replace("layers.0.", layer_prefix)
        out[name if name in ("d2t", "t2d") or name.startswith("lm_head") else model_prefix + name] = value.clone()
    return out


@pytest.mark.parametrize("fmt,shards,layer_prefix,model_prefix", [
    ("bin", 1, "midlayer.", ""),           # EAGLE's own release (yuhuili/EAGLE3-*): pytorch_model.bin, midlayer.*
    ("safetensors", 1, "layers.0.", ""),   # vLLM / speculators naming
    ("safetensors", 3, "midlayer.", "model."),  # SGLang/SpecForge, sharded with an index
    ("bin", 2, "layers.0.", "model."),
])
def test_eagle3_checkpoint_round_trip(tmp_path, fmt, shards, layer_prefix, model_prefix):
    source = eagle3(seed=20)
    cfg = source.config
    config = {"architectures": ["LlamaForCausalLMEagle3"], **llama_fields(cfg), "draft_vocab_size": DRAFT_V,
              "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 4, 6]}}
    tensors = eagle3_tensors(source, layer_prefix=layer_prefix, model_prefix=model_prefix)
    folder = write(tmp_path / "head", config, tensors, fmt, shards)
    target = target_for(source)
    head = load_draft_head(folder, target=target)
    assert isinstance(head, Eagle3Head) and head.config.aux_layers == (1, 4, 6)
    assert_same_head(head, source, target_embed=target.embed)
    # and it computes what the source computes once the source takes the target's embeddings
    with torch.no_grad():
        source.embed_tokens.weight.copy_(target.embed)
    feats, toks, th, tt = inputs(source, 5, 3, seed=21)
    args = (feats, toks, th, tt, [-1, 0, 0], [5], [3])
    torch.testing.assert_close(run(head, *args)[0], run(source, *args)[0], rtol=0, atol=0)


def test_eagle3_speculators_format_and_own_embeddings(tmp_path):
    """speculators: transformer_layer_config + top-level EAGLE-3 fields, norm_before_residual on by default."""
    source = eagle3(seed=22, norm_before_residual=True)
    config = {"speculators_model_type": "eagle3", "transformer_layer_config": llama_fields(source.config),
              "draft_vocab_size": DRAFT_V, "eagle_aux_hidden_state_layer_ids": [2, 4, 5],
              "speculators_config": {"proposal_methods": [{"speculative_tokens": 3}]}}
    folder = write(tmp_path / "spec", config, eagle3_tensors(source, layer_prefix="layers.0.", embed=True))
    head = load_draft_head(folder)  # its own embeddings and LM head: no target needed
    assert head.config.norm_before_residual and head.config.aux_layers == (2, 4, 5)
    assert_same_head(head, source)


def test_eagle3_aux_layer_conventions(tmp_path):
    source = eagle3(seed=23)
    config = {**llama_fields(source.config), "draft_vocab_size": DRAFT_V}
    folder = write(tmp_path / "h", config, eagle3_tensors(source))
    assert load_draft_head(folder, target=target_for(source)).config.aux_layers == default_aux_layers(TARGET_LAYERS)
    assert default_aux_layers(32) == (2, 16, 29)
    config["eagle_aux_hidden_state_layer_ids"] = [1, 3, 7]
    folder = write(tmp_path / "h2", config, eagle3_tensors(source))
    target = target_for(source)
    assert load_draft_head(folder, target=target, aux_ids="layer_output").config.aux_layers == (2, 4, 8)
    assert load_draft_head(folder, target=target).config.aux_layers == (1, 3, 7)


def test_eagle3_mismatches_name_the_field(tmp_path):
    source = eagle3(seed=24)
    config = {**llama_fields(source.config), "draft_vocab_size": DRAFT_V}
    folder = write(tmp_path / "h", config, eagle3_tensors(source))
    target = target_for(source)
    with pytest.raises(ValueError, match=r"checkpoint hidden_size = 32, target's = 40"):
        load_draft_head(folder, target=target_for(source, hidden_size=40))
    with pytest.raises(ValueError, match=r"checkpoint vocab_size = 64, target's = 65"):
        load_draft_head(folder, target=target_for(source, vocab_size=65))
    with pytest.raises(ValueError, match=r"in \[0, num_layers = 4\]"):
        bad = write(tmp_path / "ids", {**config, "eagle_aux_hidden_state_layer_ids": [1, 2, 6]}, eagle3_tensors(source))
        load_draft_head(bad, target=target_for(source, layers=4))
    with pytest.raises(ValueError, match="checkpoint target_hidden_size = 24, target's = 32"):
        load_draft_head(write(tmp_path / "th", {**config, "target_hidden_size": 24}, eagle3_tensors(source)), target=target)
    with pytest.raises(ValueError, match="has no 'embed_tokens.weight'; pass target="):
        load_draft_head(folder)
    with pytest.raises(ValueError, match="num_hidden_layers = 2"):
        load_draft_head(write(tmp_path / "two", {**config, "num_hidden_layers": 2}, eagle3_tensors(source)), target=target)
    broken = eagle3_tensors(source)
    broken["d2t"] = torch.zeros(DRAFT_V, dtype=torch.long)  # every draft id onto target id 0..: t2d disagrees
    with pytest.raises(ValueError, match="t2d does not mark exactly"):
        load_draft_head(write(tmp_path / "maps", config, broken), target=target)
    extra = {**eagle3_tensors(source), "midlayer.self_attn.qkv_proj.weight": torch.zeros(1)}
    with pytest.raises(ValueError, match=r"unexpected \['layers.0.self_attn.qkv_proj.weight'\]"):
        load_draft_head(write(tmp_path / "extra", config, extra), target=target)


def eagle1_tensors(head, *, embed):
    return {k: v.clone() for k, v in head.state_dict().items()
            if k != "lm_head.weight" and (embed or k != "embed_tokens.weight")}


@pytest.mark.parametrize("fmt,embed", [("bin", False), ("safetensors", True)])
def test_eagle1_checkpoint_round_trip(tmp_path, fmt, embed):
    source = eagle1(seed=30, qkv_bias=fmt == "bin")  # EAGLE's qkv_bias: q/k/v biases, read from the tensors
    config = {"architectures": ["LlamaForCausalLM"], **llama_fields(source.config), "bias": True}
    folder = write(tmp_path / "e1", config, eagle1_tensors(source, embed=embed), fmt)
    target = target_for(source)
    head = load_draft_head(folder, target=target)
    assert isinstance(head, EagleHead) and head.config.fc_bias and head.config.qkv_bias == (fmt == "bin")
    with torch.no_grad():
        source.lm_head.weight.copy_(target.lm_head)  # EAGLE-1 scores with the target's LM head
    assert_same_head(head, source, target_embed=None if embed else target.embed)
    with pytest.raises(ValueError, match=r"checkpoint hidden_size = 32, target's = 16"):
        load_draft_head(folder, target=target_for(source, hidden_size=16))


def test_nested_and_transformers5_configs(tmp_path):
    """vLLM's EAGLEConfig nests the draft's config under "model"; transformers 5 writes rope_parameters."""
    source = eagle1(seed=31)
    llama3 = {"rope_type": "llama3", "rope_theta": 500.0, "factor": 8.0, "low_freq_factor": 1.0,
              "high_freq_factor": 4.0, "original_max_position_embeddings": 16}
    fields = {k: v for k, v in llama_fields(source.config).items() if k != "rope_theta"}
    config = {"model_type": "eagle", "architectures": ["EagleLlamaForCausalLM"],
              "model": {**fields, "architectures": ["LlamaForCausalLM"], "rope_parameters": llama3}}
    folder = write(tmp_path / "nested", config, eagle1_tensors(source, embed=True))
    head = load_draft_head(folder, target=target_for(source))
    assert head.config.rope_theta == 500.0 and head.config.rope_scaling["rope_type"] == "llama3"
    assert head.config.hidden_size == H and not head.config.qkv_bias


def medusa_source(num_heads=3, num_layers=2, seed=40):
    heads = MedusaHeads(H, V, num_heads=num_heads, num_layers=num_layers)
    randomize(heads, seed)
    return heads


@pytest.mark.parametrize("layout", ["faster_safetensors", "faster_pt", "vllm", "medusa2"])
def test_medusa_checkpoint_round_trip(tmp_path, layout):
    source = medusa_source()
    sd = source.state_dict()
    bare = {k.removeprefix("medusa_head."): v.clone() for k, v in sd.items()}
    folder = tmp_path / layout
    folder.mkdir()
    if layout.startswith("faster"):
        (folder / "config.json").write_text(json.dumps({"medusa_num_heads": 3, "medusa_num_layers": 2,
                                                        "base_model_name_or_path": "x"}))
        save(bare, folder / ("medusa_lm_head.safetensors" if layout == "faster_safetensors" else "medusa_lm_head.pt"),
             "safetensors" if layout == "faster_safetensors" else "pt")
    elif layout == "vllm":  # blocks/lm_heads names, no block bias (medusa_fc_bias false): zero biases first
        with torch.no_grad():
            for name, p in source.named_parameters():
                if name.endswith("bias"):
                    p.zero_()
        vllm = {}
        for j in range(3):
            for layer in range(2):
                vllm[f"blocks.{j}.layers.{layer}.weight"] = sd[f"medusa_head.{j}.{layer}.linear.weight"]
            vllm[f"lm_heads.{j}.weight"] = sd[f"medusa_head.{j}.2.weight"]
        write(folder, {"model_type": "medusa", "num_heads": 3, "num_hidden_layers": 2}, vllm)
    else:  # Medusa-2: the heads inside the whole model's checkpoint, next to the base model's tensors
        tensors = {"model.embed_tokens.weight": torch.randn(V, H), **{k: v.clone() for k, v in sd.items()}}
        write(folder, {"num_hidden_layers": 30, "medusa_num_heads": 3, "medusa_num_layers": 2}, tensors)
    heads = load_draft_head(folder, target=DraftTarget(H, V, TARGET_LAYERS))
    assert isinstance(heads, MedusaHeads)
    assert_same_head(heads, source)


def test_medusa_mismatches_and_unknown_formats(tmp_path):
    source = medusa_source()
    bare = {k.removeprefix("medusa_head."): v for k, v in source.state_dict().items()}
    save(bare, tmp_path / "heads.safetensors", "safetensors")
    single = load_draft_head(tmp_path / "heads.safetensors")  # a single file, no config
    assert_same_head(single, source)
    with pytest.raises(ValueError, match=r"checkpoint vocab_size = 64, target's = 80"):
        load_draft_head(tmp_path / "heads.safetensors", target=DraftTarget(H, 80, 4))
    folder = tmp_path / "m"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"medusa_num_heads": 4, "medusa_num_layers": 2}))
    save(bare, folder / "medusa_lm_head.pt", "pt")
    with pytest.raises(ValueError, match="medusa_num_heads = 4, but the checkpoint holds 3"):
        load_draft_head(folder)
    save({"encoder.weight": torch.zeros(2, 2)}, tmp_path / "other.safetensors", "safetensors")
    with pytest.raises(ValueError, match=r"Looked for EAGLE-3 .* found tensors: encoder.weight"):
        load_draft_head(tmp_path / "other.safetensors")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="holds none of model.safetensors"):
        load_draft_head(tmp_path / "empty")


def test_target_from_hf_model():
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(hidden_size=H, intermediate_size=48, num_hidden_layers=TARGET_LAYERS,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=V)
    model = transformers.LlamaForCausalLM(config)
    from treeattn.speculative.checkpoints import as_draft_target

    spec = as_draft_target(model)
    assert (spec.hidden_size, spec.vocab_size, spec.num_layers) == (H, V, TARGET_LAYERS)
    assert torch.equal(spec.embed, model.model.embed_tokens.weight) and torch.equal(spec.lm_head, model.lm_head.weight)
    with pytest.raises(TypeError, match="target must be a DraftTarget"):
        as_draft_target(object())


def test_dtype_and_inference_mode(tmp_path):
    source = eagle3(seed=50)
    config = {**llama_fields(source.config), "draft_vocab_size": DRAFT_V}
    folder = write(tmp_path / "h", config, eagle3_tensors(source, embed=True))
    head = load_draft_head(folder, dtype=torch.bfloat16)
    assert head.fc.weight.dtype == torch.bfloat16 and head.d2t.dtype == torch.long and not head.training
    cache = head.new_cache()
    cache.add_sequence(0)
    with torch.inference_mode():
        out = head(cache, [0], torch.randn(3, 96), torch.tensor([1, 2, 3]), [3])
        assert out.hidden.dtype == torch.bfloat16 and head.logits(out.final).dtype == torch.float32
    np.testing.assert_array_equal(cache.tree_parents(0), np.zeros(0))
