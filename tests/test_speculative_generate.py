"""Generation with the adaptive, suffix and head drafters stays identical to greedy decoding
(tiny random Llama, CPU).

Budget: ~30 s on 2 quiet cores.
"""

from __future__ import annotations

import torch

from tests.helpers import make_prompts
from tests.test_model import llama  # noqa: F401  (a fixture)
from treeattn.speculative import NGramDrafter, SamplingParams
from treeattn.speculative.adaptive import AdaptiveDrafter, CostModel
from treeattn.speculative.generate import generate
from treeattn.speculative.heads import DraftHeads, HeadDrafter
from treeattn.speculative.suffix import SuffixDrafter

CHEAP = (0.01, 1e-5)  # nodes nearly free: every candidate that can be accepted is verified
DEAR = (1e-4, 1.0)  # a node costs far more than a step: never worth drafting


def random_heads(model, seed=0) -> HeadDrafter:
    torch.manual_seed(seed)
    heads = DraftHeads(model.config.hidden_size, range(model.config.vocab_size), depth=3)
    with torch.no_grad():
        for p in heads.parameters():
            p.normal_(0, 0.1)
    return HeadDrafter(heads, model.vocab_weights(), budget=12, top_k=3, width=2)


def test_every_drafter_reproduces_greedy(llama):  # noqa: F811
    _, model = llama
    prompts = make_prompts(seed=2, count=2)
    plain = generate(model, prompts, max_new_tokens=20)
    drafters = {
        "suffix, cheap nodes": AdaptiveDrafter(SuffixDrafter(16), cost=CostModel.fixed(*CHEAP)),
        "ngram, cheap nodes": AdaptiveDrafter(NGramDrafter(16), cost=CostModel.fixed(*CHEAP)),
        "heads, cheap nodes": AdaptiveDrafter(random_heads(model), cost=CostModel.fixed(*CHEAP)),
        "suffix + heads, measured": AdaptiveDrafter(SuffixDrafter(16), random_heads(model)),
        "suffix, full trees": SuffixDrafter(16),
        "heads, full trees": random_heads(model),
    }
    for name, drafter in drafters.items():
        spec = generate(model, prompts, max_new_tokens=20, drafter=drafter, adaptive="full" not in name)
        assert spec.tokens == plain.tokens, name
        if "cheap" in name and "heads" not in name:
            assert spec.forward_passes < plain.forward_passes, name  # repetitive prompts: drafts accepted
            assert spec.mean_tree_size > 1.5, name


def test_adaptive_never_drafts_when_nodes_cannot_pay(llama):  # noqa: F811
    _, model = llama
    prompts = make_prompts(seed=4, count=2)
    plain = generate(model, prompts, max_new_tokens=12)
    spec = generate(model, prompts, max_new_tokens=12,
                    drafter=AdaptiveDrafter(SuffixDrafter(16), cost=CostModel.fixed(*DEAR)))
    assert spec.tokens == plain.tokens
    assert spec.mean_tree_size == 1.0 and spec.forward_passes == plain.forward_passes


def test_generate_wraps_scoring_drafters_adaptively_and_learns(llama):  # noqa: F811
    _, model = llama
    prompts = make_prompts(seed=7, count=1)
    adaptive = AdaptiveDrafter(SuffixDrafter(16))
    generate(model, prompts, max_new_tokens=12, drafter=adaptive)
    assert adaptive.cost.steps > 0 and adaptive.calibrators[0].trials  # it measured and calibrated
    a, b, c = adaptive.cost.coefficients
    assert a >= 0 and b >= 0 and c >= 0 and a + b > 0


def test_seeded_sampling_reproduces_with_a_fixed_cost_model(llama):  # noqa: F811
    _, model = llama
    prompts = make_prompts(seed=6, count=2)
    params = SamplingParams(temperature=0.9)

    def run(seed):
        drafter = AdaptiveDrafter(SuffixDrafter(16), cost=CostModel.fixed(*CHEAP))
        return generate(model, prompts, max_new_tokens=12, drafter=drafter, sampling=params,
                        generator=torch.Generator().manual_seed(seed)).tokens

    assert run(1) == run(1)
    assert run(1) != run(2)


def test_the_drafters_time_is_counted_within_decoding(llama):  # noqa: F811
    import time

    _, model = llama

    class Slow(NGramDrafter):
        def propose(self, contexts, hidden=None):
            time.sleep(0.01)
            return super().propose(contexts, hidden)

    plain = generate(model, make_prompts(seed=6, count=1), max_new_tokens=6)
    assert plain.draft_s == 0.0
    slow = generate(model, make_prompts(seed=6, count=1), max_new_tokens=6, drafter=Slow(8), adaptive=False)
    steps = len(slow.emitted_per_step)
    assert 0.01 * steps <= slow.draft_s < slow.decode_s
