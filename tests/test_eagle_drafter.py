"""EagleDrafter: published EAGLE-3 / EAGLE-1 heads (checkpoints written here with random weights) drafting in
``generate``, ``treeattn.hf.speculative_generate`` and ``treeattn demo --draft-head`` on tiny random Llamas.

Random heads draft poorly, so these tests check exactness (greedy identical, sampling lossless), the drafter's
per-request state and the target features it is fed, not acceptance rates.
"""

from __future__ import annotations

import copy
import json
import time

import numpy as np
import pytest
import torch

from tests.features import reference_features
from tests.helpers import VOCAB, make_prompts, tiny_hf
from tests.test_demo import demo_args, tiny_folder  # noqa: F401  (a fixture)
from tests.test_eagle_heads import eagle1_tensors, eagle3_tensors, llama_fields, randomize, write
from tests.test_eagle_heads import eagle3 as random_eagle3
from tests.test_hf import assert_sampling_keeps_the_target_distribution
from tests.test_speculative_generate import CHEAP
from treeattn.cli import demo
from treeattn.hf import HFTreeModel, PackedLinear, speculative_generate
from treeattn.speculative import FINAL, AdaptiveDrafter, CostModel, EagleDrafter, NGramDrafter, TargetFeatures, generate, load_draft_head
from treeattn.speculative.choice import published_drafter
from treeattn.speculative.drafters import MedusaHeads, StaticTreeDrafter
from treeattn.speculative.eagle import Eagle3Head, EagleHead, HeadConfig

torch.set_num_threads(1)

DRAFT_V = 40


def head_config(vocab=VOCAB, **kw) -> HeadConfig:
    return HeadConfig(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
                      vocab_size=vocab, rms_norm_eps=1e-5, rope_theta=1e4, **kw)


def eagle3_folder(path, aux=(0, 1, 2), seed=0, **kw):
    """An EAGLE-3 checkpoint (EAGLE's naming) with a draft vocabulary mapped onto random target ids."""
    source = Eagle3Head(head_config(draft_vocab_size=DRAFT_V, **kw))
    randomize(source, seed)
    targets = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(seed))[:DRAFT_V].sort().values
    source.d2t.copy_(targets - torch.arange(DRAFT_V))
    source.t2d.zero_()
    source.t2d[targets] = True
    config = {**llama_fields(source.config), "draft_vocab_size": DRAFT_V,
              "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(aux)}}
    return write(path, config, eagle3_tensors(source))


def eagle1_folder(path, seed=1):
    source = EagleHead(head_config())
    randomize(source, seed)
    return write(path, {**llama_fields(source.config), "bias": True}, eagle1_tensors(source, embed=False))


@pytest.fixture(scope="module")
def model():
    return HFTreeModel(tiny_hf("llama"))


@pytest.fixture(scope="module")
def heads(model, tmp_path_factory):
    root = tmp_path_factory.mktemp("heads")
    # Boundaries 0, 1 and 2 of a 2-layer target: the embeddings, a layer boundary and the last layer's
    # output before the final norm (the one HF's hidden states do not hold).
    return {"eagle3": load_draft_head(eagle3_folder(root / "e3"), target=model),
            "eagle": load_draft_head(eagle1_folder(root / "e1"), target=model)}


@pytest.mark.parametrize("kind", ["eagle3", "eagle"])
def test_generate_with_published_heads_is_greedy(model, heads, kind):
    prompts = make_prompts(seed=3, count=3)
    plain = generate(model, prompts, max_new_tokens=16)
    for drafter, adaptive in ((EagleDrafter(heads[kind], budget=10), False),
                              (EagleDrafter(heads[kind], budget=10, dtype=torch.bfloat16), False),
                              (AdaptiveDrafter(EagleDrafter(heads[kind]), cost=CostModel.fixed(*CHEAP)), True)):
        started = time.perf_counter()
        spec = generate(model, prompts, max_new_tokens=16, drafter=drafter, adaptive=adaptive)
        assert 0 < spec.draft_s < spec.decode_s and spec.elapsed_s <= time.perf_counter() - started  # timed right
        assert spec.tokens == plain.tokens, (kind, adaptive)
        assert spec.mean_tree_size > 2  # it drafted trees, not lone roots


@pytest.mark.parametrize("kind", ["eagle3", "eagle"])
@pytest.mark.parametrize("dtype", [None, torch.bfloat16])
def test_the_drafter_runs_a_packed_copy_of_the_head(heads, kind, dtype):
    """Its own copy in ``dtype``, linear layers packed where oneDNN packs them, the target's weights
    shared; the caller's head is left as it was, and both compute the same states."""
    head = heads[kind]
    before = {name: t.clone() for name, t in head.state_dict().items()}
    drafter = EagleDrafter(head, dtype=dtype)
    clone, want = drafter.head, dtype or torch.float32
    assert clone is not head and clone.compute_dtype == want and not clone.training
    assert clone.embed_tokens is head.embed_tokens  # shared, not copied (nor cast)
    shared = ("embed_tokens",) + (("lm_head",) if kind == "eagle" else ())
    if kind == "eagle":
        assert clone.lm_head is head.lm_head and type(head.lm_head) is torch.nn.Linear  # the target's: not packed again
    assert {p.dtype for name, p in clone.named_parameters() if not name.startswith(shared)} == {want}
    assert not any(p.requires_grad for name, p in clone.named_parameters() if not name.startswith(shared))
    if dtype is None and torch.backends.mkldnn.is_available():
        layer = clone.layers[0]  # fused too: q/k/v and gate/up in one product each
        assert all(isinstance(linear, PackedLinear) for linear in (clone.fc, layer.self_attn.qkv_proj,
                                                                   layer.mlp.gate_up_proj, layer.mlp.down_proj))
    assert type(head.fc) is torch.nn.Linear and head.compute_dtype == torch.float32
    assert all(torch.equal(before[name], t) for name, t in head.state_dict().items())

    numbers = torch.Generator().manual_seed(4)
    feature = head.config.feature_size if kind == "eagle3" else head.config.hidden_size
    features, tokens = torch.randn(7, feature, generator=numbers), torch.randint(VOCAB, (7,), generator=numbers)
    outs = []
    for h in (head, clone):
        cache = h.new_cache()
        cache.add_sequence("a")
        with torch.inference_mode():
            context = h(cache, ["a"], features, tokens, [7])
            drafted = h(cache, ["a"], context.hidden[-2:], tokens[:2], [2], [[-1, 0]])
            outs.append([context.final.float(), drafted.final.float(), h.logits(drafted.final)])
    tol = 1e-5 if dtype is None else 5e-2
    for got, expected in zip(outs[1], outs[0]):
        torch.testing.assert_close(got, expected, atol=tol, rtol=tol)


@pytest.mark.parametrize("faster", [torch.float32, torch.bfloat16, torch.float16])
def test_fastest_keeps_the_dtype_that_drafts_a_level_faster(heads, monkeypatch, faster):
    timed = []

    def seconds(self, copies):
        timed.append([c.compute_dtype for c in copies])
        return [1.0 if c.compute_dtype == faster else 2.0 for c in copies]

    monkeypatch.setattr(EagleDrafter, "_level_seconds", seconds)
    head = heads["eagle3"]
    if faster == torch.float16:  # a head loaded in float16 weighs its own dtype too
        head = copy.deepcopy(head).to(torch.float16)
    assert EagleDrafter(head, dtype="fastest").head.compute_dtype == faster
    assert published_drafter(head, 8).head.compute_dtype == faster  # what the CLI and the runners build
    assert set(timed[0]) == {torch.float32, torch.bfloat16, head.compute_dtype}


@pytest.mark.parametrize("kind", ["eagle3", "eagle"])
def test_fastest_times_real_levels_and_leaves_the_random_stream_alone(heads, kind):
    state = torch.get_rng_state()
    drafter = EagleDrafter(heads[kind], dtype="fastest", top_k=500, width=70)  # more than a random vocab / context
    assert torch.equal(torch.get_rng_state(), state)
    assert drafter.head.compute_dtype in (torch.float32, torch.bfloat16)
    times = drafter._level_seconds([drafter.head], repeats=1)
    assert len(times) == 1 and 0 < times[0] < 10


def test_speculative_generate_matches_hf_generate(model, heads):
    hf = model.model
    ids = torch.tensor([p[-15:] for p in make_prompts(seed=5, count=2)])
    want = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False)
    got = speculative_generate(hf, ids, max_new_tokens=12, drafter=EagleDrafter(heads["eagle3"], budget=8))
    assert torch.equal(got, want)
    assert hf.config._attn_implementation == "eager"  # switched to treeattn for the call only


@pytest.mark.parametrize("kind", ["eagle3", "eagle"])
def test_sampling_keeps_the_target_distribution(kind):
    def make(hf_model):  # a random head over the 6-token vocabulary: drafts of every kind of quality
        head = Eagle3Head(head_config(6, aux_layers=(0, 1, 2))) if kind == "eagle3" else EagleHead(head_config(6))
        randomize(head, 7)
        return EagleDrafter(head.eval(), budget=6, top_k=3, width=2, min_score=0.0)

    assert_sampling_keeps_the_target_distribution(make)


def test_features_are_the_right_layers_and_positions(model):
    """A feature-reading drafter (here a source of an AdaptiveDrafter) gets, per context, the requested
    layers (in the order asked) of every position but the last, through accepted multi-token paths."""
    hf = model.model
    layers = (2, FINAL, 0, 1)
    seen = []

    class Recorder(NGramDrafter):  # prompt lookup: long accepted paths on these repetitive prompts
        target_features = layers

        def candidates(self, contexts, hidden=None):
            seen.append(([c.copy() for c in contexts], [r.clone() for r in hidden.rows], hidden.layers))
            return super().candidates(contexts)

    prompts = make_prompts(seed=8, count=2)
    speculative_generate(hf, torch.tensor([p[-15:] for p in prompts]), max_new_tokens=14,
                         drafter=AdaptiveDrafter(Recorder(8), cost=CostModel.fixed(*CHEAP)),
                         eos_token_id=[])  # no early stop: many steps
    lengths = []
    for contexts, rows, got_layers in seen:
        assert got_layers == layers
        for context, row in zip(contexts, rows):
            assert row.shape == (len(context) - 1, 4 * hf.config.hidden_size)
            torch.testing.assert_close(row, reference_features(hf, context[:-1], layers), atol=1e-4, rtol=1e-4)
        lengths.append(len(contexts[0]))
    assert max(np.diff(lengths)) > 1  # some step accepted drafts


def test_request_state_follows_each_request_and_is_rebuilt_or_freed(model, heads):
    """Driven by hand: contexts that grow by one token (drafts rejected) or several (accepted), a repeated
    call, another text under a known name (rebuilt) and a request that ends (freed); every call drafts
    exactly what a fresh drafter drafts from the same contexts and features."""
    hf = model.model
    head = heads["eagle3"]
    drafter = EagleDrafter(head, budget=12)
    rng = np.random.default_rng(0)
    text = {"a": rng.integers(0, VOCAB, 30), "b": rng.integers(0, VOCAB, 30)}

    def call(lengths, live=None, texts=text):
        names = list(lengths)
        contexts = [texts[n][:lengths[n]] for n in names]
        rows = [reference_features(hf, c[:-1], drafter.target_features) for c in contexts]
        got = drafter.candidates(contexts, TargetFeatures(drafter.target_features, names, rows, live))
        fresh = EagleDrafter(head, budget=12).candidates(contexts, TargetFeatures(drafter.target_features, names, rows))
        for name, context, mine, theirs in zip(names, contexts, got, fresh):
            assert drafter.cache.seq_len(name) == len(context) - 1
            np.testing.assert_array_equal(mine.tree.tokens, theirs.tree.tokens)
            np.testing.assert_array_equal(mine.tree.parents, theirs.tree.parents)
            np.testing.assert_allclose(mine.prior, theirs.prior, rtol=1e-4, atol=1e-5)
            assert mine.tree.size > 1
        return got

    call({"a": 6, "b": 9})
    call({"a": 7, "b": 13})  # a: one token (its drafts rejected); b: four (three accepted)
    call({"a": 7})  # no progress for a; b skipped this step (an adaptive source asked for a only)...
    call({"b": 14, "a": 10})  # ...and catches up two steps later
    call({"a": 12, "b": 15}, texts={"a": text["b"], "b": text["b"]})  # another text under "a": rebuilt
    call({"a": 13}, live=frozenset({"a"}))  # b finished
    with pytest.raises(KeyError, match="'b' is not in the cache"):
        drafter.cache.seq_len("b")


def test_a_history_that_starts_late_drafts_as_a_context_without_its_first_tokens(model, heads):
    """Features from position s on (a serving engine's prefix-cache hit) draft exactly what the same
    features draft as a context that begins at s (RoPE is relative); another start rebuilds the request."""
    head = heads["eagle3"]
    layers = EagleDrafter(head).target_features
    context = np.random.default_rng(4).integers(0, VOCAB, 20)
    rows = reference_features(model.model, context[:-1], layers)
    drafter = EagleDrafter(head, budget=12)
    for first in (5, 5, 0, 12):  # again from the cache, then rebuilt from other starts
        late = drafter.candidates([context], TargetFeatures(layers, ["a"], [rows[first:]], starts=[first]))[0]
        alone = EagleDrafter(head, budget=12).candidates([context[first:]],
                                                          TargetFeatures(layers, ["a"], [rows[first:]]))[0]
        assert drafter.cache.seq_len("a") == len(context) - 1 - first
        np.testing.assert_array_equal(late.tree.tokens, alone.tree.tokens)
        np.testing.assert_array_equal(late.tree.parents, alone.tree.parents)
        np.testing.assert_allclose(late.prior, alone.prior, rtol=1e-4, atol=1e-5)
        assert late.tree.size > 1
    with pytest.raises(ValueError, match=r"holds 6 positions' features from position 12, contexts\[0\] has 20"):
        drafter.candidates([context], TargetFeatures(layers, ["a"], [rows[13:]], starts=[12]))


def test_a_floor_stops_drafting_where_min_score_would(model, heads):
    """``floor`` (what an adaptive caller would not verify) ends the search like ``min_score``."""
    head = heads["eagle3"]
    context = np.random.default_rng(3).integers(0, VOCAB, 12)
    layers = EagleDrafter(head).target_features
    rows = [reference_features(model.model, context[:-1], layers)]

    def tree(drafter, **floor):
        return drafter.candidates([context], TargetFeatures(layers, ["a"], rows), **floor)[0].tree

    full, floored = tree(EagleDrafter(head, budget=12)), tree(EagleDrafter(head, budget=12), floor=0.999)
    strict = tree(EagleDrafter(head, budget=12, min_score=0.999))
    assert floored.tokens.tolist() == strict.tokens.tolist() and floored.parents.tolist() == strict.parents.tolist()
    assert (floored.parents[1:] == 0).all() and floored.size < full.size == 12  # random weights: no path is that sure


def test_generate_frees_requests_between_calls(model, heads):
    drafter = EagleDrafter(heads["eagle"], budget=6)
    generate(model, make_prompts(seed=1, count=3), max_new_tokens=6, drafter=drafter, adaptive=False)
    generate(model, make_prompts(seed=2, count=1), max_new_tokens=6, drafter=drafter, adaptive=False)
    assert len(drafter.cache._seqs) == 1  # the first call's three requests were dropped at the second's first step


def test_drafter_errors_name_the_argument(model, heads):
    drafter = EagleDrafter(heads["eagle3"])
    with pytest.raises(ValueError, match=r"hidden=TargetFeatures of layers \(0, 1, 2\)"):
        drafter.propose([np.arange(5)], hidden=torch.zeros(1, 64))
    rows = [torch.zeros(3, 3 * 64)]
    with pytest.raises(ValueError, match=r"hidden.rows\[0\] holds 3 positions' features from position 0, contexts\[0\] has 5 tokens"):
        drafter.propose([np.arange(5)], hidden=TargetFeatures((0, 1, 2), ["x"], rows))
    with pytest.raises(ValueError, match="load it with load_draft_head"):
        EagleDrafter(Eagle3Head(head_config()))
    with pytest.raises(ValueError, match="width must be an int >= 1"):
        EagleDrafter(heads["eagle"], width=0)
    with pytest.raises(ValueError, match="dtype must be None, 'fastest' or a float dtype, got 'fast'"):
        EagleDrafter(heads["eagle"], dtype="fast")
    with pytest.raises(ValueError, match=r"feature_layers entries must be 'final' or layer boundaries in \[0, 2\]"):
        generate(model, [[1, 2, 3]], max_new_tokens=2, drafter=type("Deep", (NGramDrafter,), {"target_features": (3,)})())


def test_demo_draft_head(tiny_folder, tmp_path, capsys):  # noqa: F811
    folder = eagle3_folder(tmp_path / "e3")
    base = ("--model", str(tiny_folder), "--threads", "1", "--max-tokens", "8", "--prompt", "abc abc abc abc")
    assert demo.main_demo(demo_args(*base, "--json", "--draft-head", str(folder))) == 0
    record = json.loads(capsys.readouterr().out)
    assert record["identical"] is True and record["drafter"].startswith("SuffixDrafter + EagleDrafter, adaptive")

    def error(*argv) -> str:
        assert demo.main_demo(demo_args(*base, *argv)) == 2
        return " ".join(capsys.readouterr().err.split())

    assert f"--draft-head {tmp_path / 'missing'}: no draft-head checkpoint" in error("--draft-head", str(tmp_path / "missing"))
    narrow = random_eagle3(seed=2)  # hidden size 32, 64 tokens: another model's head
    narrow_folder = write(tmp_path / "narrow", {**llama_fields(narrow.config), "draft_vocab_size": narrow.config.draft_vocab_size},
                          eagle3_tensors(narrow))
    assert "--draft-head" in (message := error("--draft-head", str(narrow_folder))) and "hidden_size = 32, target's = 64" in message
    message = error("--draft-head", str(folder), "--drafter", "ngram")
    assert "published draft head (--draft-head) drafts for drafter heads or auto" in message


def test_medusa_heads_draft_static_full_trees(model):
    medusa = MedusaHeads(64, VOCAB, num_heads=3)
    drafter = published_drafter(medusa, 8, full_trees=True)
    assert isinstance(drafter, StaticTreeDrafter) and drafter.tree.size == 8
    prompts = make_prompts(seed=4, count=2)
    spec = generate(model, prompts, max_new_tokens=8, drafter=drafter, adaptive=False)
    assert spec.tokens == generate(model, prompts, max_new_tokens=8).tokens
    with pytest.raises(ValueError, match="Medusa heads do not score their guesses"):
        published_drafter(medusa, 8)
