"""treeattn.hf against HF's own generate: tiny random models of each family, float32.

HF's ``model.generate(do_sample=False)`` (its default attention, SDPA or eager) is the oracle:
greedy tree speculative decoding through the "treeattn" attention must give the same tokens.
"""

from __future__ import annotations

import copy
import gc
import weakref

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")

from treeattn import DraftTree, NGramDrafter  # noqa: E402
from treeattn.hf import HFTreeModel, TreeCache, check_model, speculative_generate, tree_attention_forward  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

VOCAB = 96
SMALL = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256, bos_token_id=1, eos_token_id=2, pad_token_id=0)
WINDOW = 5  # shorter than the prompts: the sliding window cuts into the prefix and the trees
ALTERNATING = ["sliding_attention", "full_attention"]


def _config(name: str):
    t = transformers
    if name == "llama":
        return t.LlamaConfig(**SMALL)
    if name == "mistral":
        return t.MistralConfig(**SMALL, sliding_window=WINDOW)
    if name == "qwen2":
        return t.Qwen2Config(**SMALL, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1,
                             layer_types=ALTERNATING)
    if name == "qwen3":
        return t.Qwen3Config(**SMALL, head_dim=16)
    if name == "gemma2":
        return t.Gemma2Config(**SMALL, head_dim=16, sliding_window=WINDOW, attn_logit_softcapping=2.0,
                              final_logit_softcapping=5.0, query_pre_attn_scalar=12, layer_types=ALTERNATING)
    if name == "gemma3":
        return t.Gemma3TextConfig(**SMALL, head_dim=16, sliding_window=WINDOW, query_pre_attn_scalar=12,
                                  layer_types=ALTERNATING)
    if name == "phi3":
        return t.Phi3Config(**SMALL, partial_rotary_factor=0.5)
    if name == "olmo2":
        return t.Olmo2Config(**SMALL)
    if name == "gpt_oss":
        return t.GptOssConfig(**{**SMALL, "max_position_embeddings": 131072}, head_dim=16, sliding_window=WINDOW, num_local_experts=4,
                              num_experts_per_tok=2, layer_types=ALTERNATING)
    if name == "deepseek_v3":  # MLA: HF expands the latent per head before the attention function
        return t.DeepseekV3Config(**{**SMALL, "num_key_value_heads": 4}, moe_intermediate_size=32, kv_lora_rank=16,
                                  q_lora_rank=24, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=12,
                                  n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1,
                                  first_k_dense_replace=1)
    if name == "stablelm":  # partial rotary, qk layernorm, parallel residual; HF's _supports_attention_backend is False
        return t.StableLmConfig(**SMALL, partial_rotary_factor=0.25, qk_layernorm=True, use_parallel_residual=True)
    if name == "gpt2":  # learned absolute positions, read at the tree positions
        return t.GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, bos_token_id=1, eos_token_id=2,
                            pad_token_id=0)
    raise KeyError(name)


FAMILIES = ["llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3", "phi3", "olmo2", "gpt_oss", "deepseek_v3", "stablelm", "gpt2"]
_MODELS: dict[str, torch.nn.Module] = {}


def _model(name: str):
    if name not in _MODELS:
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(_config(name), dtype=torch.float32).eval()
        # Random weights with HF's 0.02 init give nearly flat logits; larger ones make greedy choices clear-cut.
        with torch.no_grad():
            for p in model.parameters():
                if p.ndim > 1:
                    p.normal_(0, 0.15)
        if name == "gpt_oss":
            with torch.no_grad():
                for layer in model.model.layers:
                    layer.self_attn.sinks.normal_(0, 1)
        _MODELS[name] = model
    return _MODELS[name]


def _prompts(lengths, seed=0):
    """Left-padded prompts (input_ids, attention_mask); tokens avoid the special ids 0-2."""
    g = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.zeros(len(lengths), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, n in enumerate(lengths):
        ids[b, width - n:] = torch.randint(3, VOCAB, (n,), generator=g)
        mask[b, width - n:] = 1
    return ids, mask


def _hf_greedy(model, ids, mask, max_new_tokens, **kwargs):
    return model.generate(ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False, **kwargs)


class ContinuationDrafter:
    """Trees holding the true continuation (from HF's own output) plus decoys at every depth: long paths
    are accepted and committed, and the decoys' K/V must be dropped by the commit."""

    def __init__(self, references: torch.Tensor, depth: int = 6):
        # Each row without its left padding (prompt tokens are >= 3, the pad id is 0).
        self.references = [r[int(torch.nonzero(r)[0]):].tolist() for r in references]
        self.depth, self.calls = depth, 0

    def propose(self, contexts, hidden=None):
        self.calls += 1
        return [self._tree(c.tolist()) for c in contexts]

    def _tree(self, context):
        truth = next((r[len(context):] for r in self.references if r[:len(context)] == context), [])
        tokens, parents, at = [context[-1]], [-1], 0
        for t in truth[:self.depth]:
            decoy = (t + 1) % VOCAB
            tokens += [decoy, decoy, t]  # a decoy child with a child of its own, then the true child
            parents += [at, len(tokens) - 3, at]
            at = len(tokens) - 1
        return DraftTree(np.asarray(tokens), np.asarray(parents))


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_ngram_batch_matches_generate(family):
    model = _model(family)
    ids, mask = _prompts([9, 14, 6])
    ref = _hf_greedy(model, ids, mask, 24)
    out = speculative_generate(model, ids, attention_mask=mask, max_new_tokens=24, drafter=NGramDrafter(8))
    assert torch.equal(out, ref)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("lengths", [[11], [7, 13, 10]])
def test_greedy_long_accepted_paths_match_generate(family, lengths):
    model = _model(family)
    ids, mask = _prompts(lengths, seed=1)
    ref = _hf_greedy(model, ids, mask, 30)
    drafter = ContinuationDrafter(ref)
    out = speculative_generate(model, ids, attention_mask=mask, max_new_tokens=30, drafter=drafter)
    assert torch.equal(out, ref)
    assert drafter.calls <= 30 // 4  # paths of 6 drafts plus the bonus token were accepted


@pytest.mark.parametrize("family", ["llama", "gemma2", "gpt_oss"])
def test_eos_mid_batch_pads_like_generate(family):
    model = _model(family)
    ids, mask = _prompts([8, 12, 5], seed=2)
    new = _hf_greedy(model, ids, mask, 20)[:, ids.shape[1]:]
    # Stop at the config's EOS or at the 5th token of the row that runs longest: rows end at different steps.
    default = model.generation_config.eos_token_id
    row = max(range(3), key=lambda b: (new[b].tolist() + [default]).index(default))
    eos = [default, int(new[row, 4])]
    ref = _hf_greedy(model, ids, mask, 20, eos_token_id=eos)
    ends = [next(i for i, t in enumerate(r.tolist() + [eos[0]]) if t in eos) for r in ref[:, ids.shape[1]:]]
    assert len(set(ends)) > 1 and min(ends) < ref.shape[1] - ids.shape[1] - 1, ends  # padded rows beside live ones
    out = speculative_generate(model, ids, attention_mask=mask, max_new_tokens=20, eos_token_id=eos,
                               drafter=ContinuationDrafter(ref))
    assert torch.equal(out, ref)


def test_model_stays_on_its_attention_and_cache_is_an_hf_cache():
    model = _model("llama")
    before = model.config._attn_implementation
    ids, _ = _prompts([6])
    speculative_generate(model, ids, max_new_tokens=3)
    assert model.config._attn_implementation == before
    cache = TreeCache(model.config, num_pages=4)
    assert isinstance(cache, transformers.cache_utils.Cache) and len(cache.layers) == 2
    # A model loaded with the "treeattn" attention runs as is and gives the same tokens.
    loaded = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(model.config),
                                                           attn_implementation="treeattn").eval()
    loaded.load_state_dict(model.state_dict())
    assert loaded.config._attn_implementation == "treeattn"
    assert torch.equal(speculative_generate(loaded, ids, max_new_tokens=8), _hf_greedy(model, ids, None, 8))


def test_a_finished_generation_frees_its_cache_at_once(monkeypatch):
    """No reference cycle keeps a TreeCache (and its pages: GBs for a batch) alive after generation:
    it is freed by reference counting, with Python's cyclic collector off."""
    model = _model("llama")
    made = []
    real = TreeCache.__init__

    def tracked(self, *args, **kwargs):
        real(self, *args, **kwargs)
        made.append(weakref.ref(self))

    monkeypatch.setattr(TreeCache, "__init__", tracked)
    ids, _ = _prompts([6, 4])
    gc.collect()
    gc.disable()
    try:
        speculative_generate(model, ids, max_new_tokens=4, drafter=NGramDrafter(4))
        assert made and all(ref() is None for ref in made)
    finally:
        gc.enable()


@pytest.mark.parametrize("family", ["mistral", "gemma2"])
def test_tree_cache_keeps_trees_over_rounds_and_commits(family):
    """HFTreeModel on a TreeCache: a tree grown over two forwards, its commit and a plain append afterwards
    give the logits of HF's own forward over each node's root-to-node path (sliding windows and soft-caps included)."""
    model = _model(family)
    tree_model = HFTreeModel(model)
    prompt = [5, 17, 33, 8, 21, 40, 11]
    cache = tree_model.new_cache(8, page_size=4)
    cache.add_sequence("s")

    def run(tokens, parents=None):
        return tree_model.forward(cache, ["s"], torch.tensor(tokens), [len(tokens)], parents).logits

    def dense(path):
        with torch.no_grad():
            return model(torch.tensor([prompt + path])).logits[0, -1]

    with tree_model.attention():
        run(prompt)
        first = run([50, 51, 52], [[-1, 0, 0]])  # nodes 0-2: a root and two children
        second = run([53, 54], [[1, 3]])  # nodes 3-4 below node 1, indices over both rounds
        cache.commit_accepted(["s"], [4])
        after = run([55])
    for got, path in [(first[2], [50, 52]), (second[0], [50, 51, 53]), (second[1], [50, 51, 53, 54]),
                      (after[0], [50, 51, 53, 54, 55])]:
        torch.testing.assert_close(got, dense(path), atol=1e-4, rtol=1e-4)


def test_drafter_gets_the_models_final_hidden_state():
    """Drafters that read the target's state (draft heads) get HF's last hidden state at the token
    before each context's last (the one that predicted it)."""
    model = _model("qwen3")
    ids, mask = _prompts([5, 8])
    seen = []

    class Recorder:
        def propose(self, contexts, hidden=None):
            seen.append(([c.tolist() for c in contexts], hidden.clone()))
            return [DraftTree.root_only(int(c[-1])) for c in contexts]

    speculative_generate(model, ids, attention_mask=mask, max_new_tokens=3, drafter=Recorder())
    for contexts, hidden in seen:
        for context, h in zip(contexts, hidden):
            with torch.no_grad():
                want = model(torch.tensor([context[:-1]]), output_hidden_states=True).hidden_states[-1][0, -1]
            torch.testing.assert_close(h, want, atol=1e-4, rtol=1e-4)


def assert_sampling_keeps_the_target_distribution(make_drafter):
    """Two sampled tokens after a prompt, 3000 rows in one batch, trees from ``make_drafter(model)`` (a
    tiny random Llama over 6 tokens): the empirical joint law of the two tokens matches the model's
    exact one (chi-square, 0.1% level)."""
    torch.manual_seed(3)
    vocab = 6
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        **{**SMALL, "vocab_size": vocab, "bos_token_id": None, "eos_token_id": None, "pad_token_id": None})).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim > 1:
                p.normal_(0, 0.3)
    prompt = torch.tensor([[1, 4, 2, 5]])
    with torch.no_grad():  # exact law: p(a) p(b | a) from full forwards
        first = model(prompt).logits[0, -1].softmax(-1)
        both = torch.cat([prompt.repeat(vocab, 1), torch.arange(vocab)[:, None]], dim=1)
        second = model(both).logits[:, -1].softmax(-1)
    exact = (first[:, None] * second).flatten().double()

    n = 3000
    out = speculative_generate(model, prompt.repeat(n, 1), max_new_tokens=2, temperature=1.0,
                               drafter=make_drafter(model), generator=torch.Generator().manual_seed(0))
    pairs = out[:, -2] * vocab + out[:, -1]
    counts = torch.bincount(pairs, minlength=vocab * vocab).double()
    expected = exact * n
    keep = expected >= 5  # chi-square needs enough expected counts; pool the rest into one cell
    obs = torch.cat([counts[keep], counts[~keep].sum()[None]])
    exp = torch.cat([expected[keep], expected[~keep].sum()[None]])
    chi2 = float(((obs - exp) ** 2 / exp.clamp_min(1e-9)).sum())
    dof = int(keep.sum())
    assert chi2 < dof + 3.1 * (2 * dof) ** 0.5 + 10, (chi2, dof)  # ~0.1% tail for dof in the tens


def test_sampling_keeps_the_target_distribution():
    class Decoys:  # point-mass drafts: children 0, 1, 2 of the root, 3 below 0
        def propose(self, contexts, hidden=None):
            return [DraftTree(np.array([c[-1], 0, 1, 2, 3]), np.array([-1, 0, 0, 0, 1])) for c in contexts]

    assert_sampling_keeps_the_target_distribution(lambda model: Decoys())


def test_errors_name_the_reason():
    t = transformers
    with pytest.raises(TypeError, match="PreTrainedModel"):
        speculative_generate(torch.nn.Linear(2, 2), torch.zeros(1, 2, dtype=torch.long), max_new_tokens=2)
    t5 = t.T5ForConditionalGeneration(t.T5Config(vocab_size=32, d_model=16, d_kv=4, d_ff=16, num_layers=1,
                                                 num_heads=2))
    with pytest.raises(ValueError, match="encoder-decoder"):
        check_model(t5)
    mamba = t.MambaForCausalLM(t.MambaConfig(vocab_size=32, hidden_size=16, num_hidden_layers=1, state_size=4))
    with pytest.raises(ValueError, match="recurrent"):
        check_model(mamba)

    chunked = t.Llama4ForCausalLM(t.Llama4TextConfig(vocab_size=32, hidden_size=16, intermediate_size=16,
                                                      intermediate_size_mlp=16, num_hidden_layers=1,
                                                      num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                                                      num_local_experts=1, attention_chunk_size=4))
    with pytest.raises(ValueError, match="chunked attention"):
        check_model(chunked)
    bloom = t.BloomForCausalLM(t.BloomConfig(vocab_size=32, hidden_size=16, n_layer=1, n_head=2))
    with pytest.raises(ValueError, match=r"BloomForCausalLM's modeling code .* do not call ALL_ATTENTION_FUNCTIONS"):
        check_model(bloom)  # its attention is its own code: HF itself refuses attn_implementation="treeattn"
    check_model(_model("stablelm"))  # goes through the interface, though _supports_attention_backend is False

    model = _model("llama")
    ids, mask = _prompts([4, 6])
    right = mask.flip(1)
    with pytest.raises(ValueError, match="left padding"):
        speculative_generate(model, ids.flip(1), attention_mask=right, max_new_tokens=2)
    with pytest.raises(TypeError, match="input_ids"):
        speculative_generate(model, ids.tolist(), max_new_tokens=2)
    model.generation_config.repetition_penalty = 1.3  # model.generate would apply it: refused, not ignored
    try:
        with pytest.raises(ValueError, match="repetition_penalty"):
            speculative_generate(model, ids, attention_mask=mask, max_new_tokens=2)
    finally:
        model.generation_config.repetition_penalty = 1.0
    q = torch.zeros(1, 4, 3, 16)
    with pytest.raises(ValueError, match="own attention mask"):  # a model that masks by itself is refused
        tree_attention_forward(model.model.layers[0].self_attn, q, q, q, torch.zeros(1, 1, 3, 3),
                               treeattn_cache=TreeCache(model.config, num_pages=2))
    model.set_attn_implementation("treeattn")
    try:
        with pytest.raises(ValueError, match="only inside treeattn.hf.speculative_generate"):
            model(ids)
    finally:
        model.set_attn_implementation("sdpa")


@pytest.mark.model
def test_smollm2_matches_hf_greedy():
    from treeattn.models import ModelNotAvailable, smollm2_dir
    from treeattn.models.loader import SMOLLM2_GGUF

    try:
        folder = smollm2_dir()
    except ModelNotAvailable as e:
        pytest.skip(str(e))
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=SMOLLM2_GGUF,
                                                              dtype=torch.float32).eval()
    tok = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=SMOLLM2_GGUF)
    tok.padding_side = "left"
    batch = tok(["def fibonacci(n):\n    if n < 2:\n        return n\n    return",
                 "The capital of France is"], return_tensors="pt", padding=True)
    ref = model.generate(**batch, max_new_tokens=24, do_sample=False)
    out = speculative_generate(model, batch["input_ids"], attention_mask=batch["attention_mask"], max_new_tokens=24)
    assert torch.equal(out, ref)
