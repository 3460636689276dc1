"""The model protocol (``TreeModel``) on HF transformers models (``treeattn.hf.HFTreeModel``, the one
model path): logits of prefill, trees and commits equal HF's own forward, and ``generate``'s tree
speculative decoding reproduces greedy decoding, and HF's ``model.generate``, token for token (tiny
random models, CPU).

Budget: ~40 s on 2 cores.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")

from tests.helpers import VOCAB, make_prompts, tiny_hf  # noqa: E402
from treeattn.hf import HFTreeModel  # noqa: E402
from treeattn.speculative import DraftTree, MedusaHeads, NGramDrafter, SamplingParams, StaticTreeDrafter  # noqa: E402
from treeattn.speculative.generate import generate  # noqa: E402


@pytest.fixture(scope="module")
def llama():
    hf = tiny_hf("llama")
    return hf, HFTreeModel(hf)


def hf_last_logits(hf, tokens) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.as_tensor(tokens)[None]).logits[0, -1]


@pytest.mark.parametrize("kind", ["llama", "llama3-rope", "qwen2", "qwen3"])
def test_logits_match_hf_through_prefill_tree_and_commit(kind):
    hf = tiny_hf(kind)
    model = HFTreeModel(hf)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, VOCAB, (n,), generator=g) for n in (21, 6)]  # page_size 4: partial pages
    cache = model.new_cache(64, page_size=4)
    for b in range(2):
        cache.add_sequence(b)
    out = model.forward(cache, [0, 1], torch.cat(prompts), [21, 6])
    with torch.no_grad():
        for b, rows in ((0, slice(0, 21)), (1, slice(21, 27))):
            torch.testing.assert_close(out.logits[rows], hf(prompts[b][None]).logits[0], atol=2e-5, rtol=1e-4)
    contexts = [p.tolist() for p in prompts]
    shapes = [np.array([-1, 0, 0, 1, 1, 3, 2]), np.array([-1, 0, 1, 2, 0])]
    for leaves in ([5, 3], [6, 0]):  # two rounds: tree forward, logits of every node, commit a leaf
        for c in contexts:  # the root: the last emitted token, not in the cache yet
            c.append(int(torch.randint(0, VOCAB, (1,), generator=g)))
        trees = [DraftTree(np.array([c[-1]] + torch.randint(0, VOCAB, (len(p) - 1,), generator=g).tolist()), p)
                 for c, p in zip(contexts, shapes)]
        out = model.forward(cache, [0, 1], torch.from_numpy(np.concatenate([t.tokens for t in trees])),
                            [t.size for t in trees], [t.parents for t in trees])
        start = 0
        for b, tree in enumerate(trees):
            for node in range(tree.size):
                expected = hf_last_logits(hf, contexts[b] + tree.tokens[tree.path(node)[1:]].tolist())
                torch.testing.assert_close(out.logits[start + node], expected, atol=2e-5, rtol=1e-4)
            start += tree.size
        cache.commit_accepted([0, 1], leaves)
        for b, (tree, leaf) in enumerate(zip(trees, leaves)):
            contexts[b] += tree.tokens[tree.path(leaf)[1:]].tolist()
            assert cache.paged.seq_len(b) == len(contexts[b])


def test_lm_head_config_and_attention_come_from_the_hf_model(llama):
    hf, model = llama
    assert model.config.hidden_size == 64 and model.config.vocab_size == VOCAB
    cache = model.new_cache(4, page_size=4)
    cache.add_sequence(0)
    out = model.forward(cache, [0], torch.tensor([3, 17, 5, 60, 2]), [5])
    torch.testing.assert_close(model.logits(out.hidden), out.logits)  # the LM head draft heads draft through
    assert hf.config._attn_implementation == "eager"  # a forward outside attention() switched it back
    with model.attention():
        assert hf.config._attn_implementation == "treeattn"
    assert hf.config._attn_implementation == "eager"


def test_batched_forward_equals_one_sequence_at_a_time(llama):
    _, model = llama
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, VOCAB, (n,), generator=g) for n in (9, 17, 4)]
    batched = model.new_cache(32, page_size=4)
    for b in range(3):
        batched.add_sequence(b)
    out = model.forward(batched, [0, 1, 2], torch.cat(prompts), [9, 17, 4])
    start = 0
    for p in prompts:
        single = model.new_cache(32, page_size=4)
        single.add_sequence("s")
        ref = model.forward(single, ["s"], p, [p.numel()])
        torch.testing.assert_close(out.logits[start:start + p.numel()], ref.logits, atol=1e-5, rtol=1e-5)
        start += p.numel()


class OracleDrafter:
    """Test drafter that knows the greedy continuation: random trees in which each level holds the
    right token with probability 0.7 among random siblings, so that paths of every length, rejected
    branches and duplicate tokens all occur."""

    def __init__(self, prompts, references, seed: int):
        self.prompts, self.references = prompts, references
        self.rng = np.random.default_rng(seed)

    def propose(self, contexts, hidden=None):
        trees = []
        for c in contexts:
            c = list(c)
            b = next(i for i, p in enumerate(self.prompts) if c[:len(p)] == p)
            truth = self.references[b][len(c) - len(self.prompts[b]):]
            tokens, parents, node = [c[-1]], [-1], 0
            for t in truth[: self.rng.integers(0, 6)]:
                for _ in range(self.rng.integers(0, 3)):  # decoys hang off the current node
                    tokens.append(int(self.rng.integers(0, VOCAB)))
                    parents.append(node)
                tokens.append(t if self.rng.random() < 0.7 else int(self.rng.integers(0, VOCAB)))
                parents.append(node)
                node = len(tokens) - 1
            trees.append(DraftTree(np.array(tokens), np.array(parents)))
        return trees


@pytest.mark.parametrize("batch", [1, 3])
def test_speculative_greedy_equals_greedy(llama, batch):
    hf, model = llama
    prompts = make_prompts(seed=batch, count=batch)
    plain = generate(model, prompts, max_new_tokens=40)
    assert plain.forward_passes == 40 and plain.mean_accepted == 1.0
    assert all(len(t) == 40 for t in plain.tokens)
    for prompt, tokens in zip(prompts, plain.tokens):  # plain decoding here is HF's own greedy generate
        ids = torch.tensor([prompt])
        with torch.no_grad():
            ref = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=40, do_sample=False,
                              eos_token_id=None, pad_token_id=0)
        assert ref[0, len(prompt):].tolist() == tokens
    heads = MedusaHeads(64, VOCAB, num_heads=2)
    drafters = [NGramDrafter(4), NGramDrafter(16, max_depth=6), OracleDrafter(prompts, plain.tokens, seed=batch),
                StaticTreeDrafter([(0,), (1,), (0, 0), (0, 1), (1, 0)], heads)]
    for drafter in drafters:
        spec = generate(model, prompts, max_new_tokens=40, drafter=drafter)
        assert spec.tokens == plain.tokens, type(drafter).__name__
        assert spec.forward_passes <= plain.forward_passes
    oracle = generate(model, prompts, max_new_tokens=40, drafter=OracleDrafter(prompts, plain.tokens, seed=9))
    assert oracle.mean_accepted > 1.5  # long accepted paths were really exercised
    assert oracle.forward_passes < plain.forward_passes


def test_stop_tokens_and_streaming(llama):
    _, model = llama
    prompts = make_prompts(seed=5, count=2)
    plain = generate(model, prompts, max_new_tokens=30)
    stop = plain.tokens[0][7]
    streamed: dict[int, list[int]] = {0: [], 1: []}
    spec = generate(model, prompts, max_new_tokens=30, drafter=NGramDrafter(8), stop_tokens=[stop],
                    on_tokens=lambda b, toks: streamed[b].extend(toks))
    for b in range(2):
        ref = plain.tokens[b]
        cut = ref.index(stop) + 1 if stop in ref else len(ref)
        assert spec.tokens[b] == ref[:cut]
        assert streamed[b] == spec.tokens[b]


def test_sampling_is_reproducible_and_follows_the_generator(llama):
    _, model = llama
    prompts = make_prompts(seed=6, count=2)
    params = SamplingParams(temperature=0.9, top_p=0.95)
    # Adaptive trees follow measured step times, which differ between runs: fixed trees here.
    runs = [generate(model, prompts, max_new_tokens=20, drafter=NGramDrafter(8), sampling=params,
                     generator=torch.Generator().manual_seed(s), adaptive=False) for s in (1, 1, 2)]
    assert runs[0].tokens == runs[1].tokens
    assert runs[0].tokens != runs[2].tokens
    assert all(len(t) == 20 for t in runs[0].tokens)


def test_generate_arguments_are_checked(llama):
    _, model = llama
    with pytest.raises(TypeError, match="prompts"):
        generate(model, [], max_new_tokens=4)
    with pytest.raises(ValueError, match="prompts\\[0\\]"):
        generate(model, [[]], max_new_tokens=4)
    with pytest.raises(ValueError, match="max_new_tokens"):
        generate(model, [[1, 2]], max_new_tokens=0)
    with pytest.raises(TypeError, match="drafter"):
        generate(model, [[1, 2]], max_new_tokens=4, drafter=object())

    class Short:  # drafts for the first sequence only
        def propose(self, contexts, hidden=None):
            return [DraftTree.root_only(int(contexts[0][-1]))]

    with pytest.raises(ValueError, match="the drafter returned 1 trees for 2 sequences"):
        generate(model, [[1, 2], [3, 4]], max_new_tokens=4, drafter=Short())
    class Star:  # eight nodes: the root and seven guesses below it
        def propose(self, contexts, hidden=None):
            return [DraftTree(np.r_[c[-1], np.arange(7)], np.r_[-1, np.zeros(7, dtype=np.int64)]) for c in contexts]

    with pytest.raises(ValueError, match="has 8 nodes, more than draft_slack = 4"):
        generate(model, [[1, 2]], max_new_tokens=4, drafter=Star(), draft_slack=4)
