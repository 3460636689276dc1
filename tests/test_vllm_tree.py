"""``treeattn.vllm.speculative`` without vLLM: its configuration, its refusals and its step arithmetic.
(The engine itself, greedy and sampling, runs in ``test_vllm.py`` with vLLM installed.)"""

from __future__ import annotations

import time
import types

import numpy as np
import pytest
import torch

from tests.helpers import VOCAB
from treeattn.speculative import DraftTree, NGramDrafter
from treeattn.speculative.adaptive import AdaptiveDrafter, StepGate
from treeattn.speculative.features import wanted_features
from treeattn.speculative.heads import DraftHeads, HeadDrafter, save_heads
from treeattn.vllm import tree_speculative_config
from treeattn.vllm.speculative import (
    DRAFTER_ENV_VAR,
    TREES_ENV_VAR,
    DrafterByName,
    TreeProposer,
    _Step,
    configured_drafter,
    plain_decoding_reason,
    tree_options,
)


@pytest.fixture
def env(monkeypatch):
    monkeypatch.delenv(DRAFTER_ENV_VAR, raising=False)
    monkeypatch.delenv(TREES_ENV_VAR, raising=False)
    return monkeypatch


def _shipped(nodes):
    """What a TreeProposer of ``nodes`` nodes would run, from what tree_speculative_config left in the environment."""
    return configured_drafter({}, nodes)


WEIGHTS = (torch.randn(VOCAB, 64), torch.randn(VOCAB, 64))  # a tiny target's (embeddings, lm_head)


def test_config_names_the_proposer_and_ships_the_drafter(env):
    config = tree_speculative_config(nodes=10)
    assert config == {"method": "custom_class", "model": "treeattn.vllm.speculative.TreeProposer",
                      "num_speculative_tokens": 9}
    drafter = _shipped(10)  # adaptive by default: trees cut to what pays, within the node budget
    assert isinstance(drafter, AdaptiveDrafter) and drafter.max_nodes == 10
    assert isinstance(drafter.sources[0], NGramDrafter) and drafter.sources[0].budget == 10
    tree_speculative_config(nodes=10, adaptive=False)
    assert isinstance(_shipped(10), NGramDrafter)
    tree_speculative_config(nodes=10, drafter="suffix")
    assert [type(s).__name__ for s in _shipped(10).sources] == ["SuffixDrafter"]
    tree_speculative_config(nodes=10, drafter=NGramDrafter(10))  # a drafter object travels pickled
    assert isinstance(_shipped(10), AdaptiveDrafter)
    tree_speculative_config(nodes=10, drafter="auto")  # a head needs the target's weights: built in the worker
    assert _shipped(10) == DrafterByName("auto", 10)  # the worker picks the default head that fits its target


def test_a_drafter_by_name_is_plain_json_for_a_server(env, monkeypatch):
    import json
    import os

    tree_speculative_config(nodes=10, drafter="suffix", adaptive=False)
    assert json.loads(os.environ[TREES_ENV_VAR]) == {"drafter": "suffix", "heads": None, "draft_head": None,
                                                   "adaptive": False}
    assert DRAFTER_ENV_VAR not in os.environ  # no pickle for a drafter by name
    assert type(_shipped(10)).__name__ == "SuffixDrafter"
    monkeypatch.delenv(TREES_ENV_VAR)
    # a server's --additional-config '{"treeattn": {...}}', and the default when nothing is given
    assert [type(s).__name__ for s in configured_drafter({"treeattn": {"drafter": "suffix"}}, 6).sources] == [
        "SuffixDrafter"]
    default = configured_drafter({}, 6)
    assert isinstance(default, AdaptiveDrafter) and type(default.sources[0]).__name__ == "NGramDrafter"
    tree_speculative_config(nodes=10, drafter=NGramDrafter(10))  # an object replaces the JSON, and back
    assert TREES_ENV_VAR not in os.environ
    tree_speculative_config(nodes=10)
    assert DRAFTER_ENV_VAR not in os.environ
    with pytest.raises(ValueError, match="configured twice .additional_config.treeattn and TREEATTN_VLLM_TREES"):
        configured_drafter({"treeattn": {}}, 6)


@pytest.mark.parametrize("value, match", [
    ('{"drafter": "medusa"}', r"^W\.drafter must be one of ngram, suffix, heads, auto, got 'medusa'"),
    ('{"nodes": 16}', r"^W\.nodes: unknown field; .* num_speculative_tokens \+ 1"),
    ('{"adaptive": "yes"}', r"^W\.adaptive must be true or false, got 'yes'"),
    ('{"heads": 3, "drafter": "heads"}', r"^W\.heads must be a head file or EAGLE-3 folder path, or null"),
    ('{"heads": "h.pt"}', r"^W\.heads goes with drafter 'heads' or 'auto', not 'ngram'"),
    ('{"draft_head": "e3"}', r"^W\.draft_head goes with drafter 'heads' or 'auto', not 'ngram'"),
    ('{"draft_head": ["e3"], "drafter": "auto"}', r"^W\.draft_head must be a checkpoint path or null"),
    ('{"draft_head": "e3", "heads": "h.pt", "drafter": "auto"}', r"^W\.draft_head drafts in place of a treeattn heads"),
    ('{"drafter": "auto", "adaptive": false}', r"^W\.adaptive=False verifies one drafter's whole trees"),
    ('["auto"]', r"^W: must be a JSON object"),
    ('{drafter: auto}', r"^W: not JSON"),
])
def test_bad_tree_options_name_the_field(value, match):
    with pytest.raises(ValueError, match=match):
        tree_options(value, "W")


def test_a_missing_head_file_fails_when_the_server_starts(env, monkeypatch):
    monkeypatch.setenv(TREES_ENV_VAR, '{"drafter": "heads", "heads": "/no/such/h.pt"}')
    with pytest.raises(ValueError, match="heads: no such file or folder /no/such/h.pt"):
        configured_drafter({}, 8)  # what TreeProposer(vllm_config) runs in the engine at start


def test_an_eagle3_folder_from_train_heads_binds_with_the_targets_depth(env, tmp_path):
    from tests.helpers import tiny_model
    from treeattn.speculative.eagle_drafter import EagleDrafter
    from treeattn.speculative.eagle_train import new_eagle3_head, save_eagle3

    tiny = tiny_model("llama")
    folder = save_eagle3(new_eagle3_head(tiny, range(16), (0, 1, 2)), tmp_path / "e3", target_layers=2)
    tree_speculative_config(nodes=8, drafter="auto", heads=folder)
    drafter = _shipped(8).bind(tiny.vocab_weights(), num_layers=2)
    assert [type(s).__name__ for s in drafter.sources] == ["SuffixDrafter", "EagleDrafter"]
    assert wanted_features(drafter) == (0, 1, 2)  # what the worker asks vLLM's model for
    assert [type(s).__name__ for s in _shipped(8).bind(tiny.vocab_weights(), num_layers=1).sources] == ["SuffixDrafter"]
    tree_speculative_config(nodes=8, drafter="heads", heads=folder, adaptive=False)
    assert isinstance(_shipped(8).bind(tiny.vocab_weights(), num_layers=2), EagleDrafter)


def test_a_draft_head_by_name_binds_to_the_targets_weights(env, tmp_path):
    save_heads(DraftHeads(64, range(16)), tmp_path / "h.pt")
    tree_speculative_config(nodes=8, drafter="heads", heads=tmp_path / "h.pt", adaptive=False)
    drafter = _shipped(8).bind(WEIGHTS)
    assert isinstance(drafter, HeadDrafter) and drafter.budget == 8
    # It reads the target's embeddings and LM head rows (in the dtype it timed faster: fp32 or bfloat16).
    dtype = drafter.embed.dtype
    assert dtype in (torch.float32, torch.bfloat16)
    assert torch.equal(drafter.embed, WEIGHTS[0].to(dtype))
    assert torch.equal(drafter.project[0].weight, WEIGHTS[1][:16].to(dtype))
    tree_speculative_config(nodes=8, drafter="auto", heads=tmp_path / "h.pt")
    assert [type(s).__name__ for s in _shipped(8).bind(WEIGHTS).sources] == ["SuffixDrafter", "HeadDrafter"]
    narrow = (torch.randn(VOCAB, 32), torch.randn(VOCAB, 32))  # a target the head does not fit
    assert [type(s).__name__ for s in _shipped(8).bind(narrow).sources] == ["SuffixDrafter"]  # auto goes on without
    tree_speculative_config(nodes=8, drafter="heads", heads=tmp_path / "h.pt")
    with pytest.raises(ValueError, match="drafter 'heads': .*hidden states of size 64, the model's are 32"):
        _shipped(8).bind(narrow)


def test_a_published_draft_head_by_name_loads_against_the_target(env, tmp_path):
    """``draft_head``: an EAGLE-3 checkpoint folder, loaded in the worker with the target's weights and
    depth (its aux layers must lie within it), drafting for ``heads`` alone or beside the suffix drafter."""
    from treeattn.speculative import EagleDrafter
    from treeattn.speculative.eagle import Eagle3Head, HeadConfig
    from treeattn.speculative.eagle_train import save_eagle3

    head = Eagle3Head(HeadConfig(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
                                 vocab_size=VOCAB, aux_layers=(0, 2, 4)))
    folder = save_eagle3(head, tmp_path / "e3", target_layers=4, dtype=torch.float32)
    tree_speculative_config(nodes=8, drafter="heads", draft_head=folder, adaptive=False)
    assert _shipped(8) == DrafterByName("heads", 8, full_trees=True, draft_head=str(folder))
    drafter = _shipped(8).bind(WEIGHTS, num_layers=4)
    assert isinstance(drafter, EagleDrafter) and drafter.budget == 8 and drafter.target_features == (0, 2, 4)
    assert torch.equal(drafter.head.embed_tokens.weight, WEIGHTS[0])  # the target's, as every engine shares them
    tree_speculative_config(nodes=8, drafter="auto", draft_head=folder)
    assert [type(s).__name__ for s in _shipped(8).bind(WEIGHTS, num_layers=4).sources] == ["SuffixDrafter",
                                                                                           "EagleDrafter"]
    with pytest.raises(ValueError, match=rf"draft_head {folder}: .*aux layer boundaries \[0, 2, 4\] .* in \[0, num_layers = 3\]"):
        _shipped(8).bind(WEIGHTS, num_layers=3)  # a shallower target than the head was made for
    with pytest.raises(ValueError, match="give num_layers"):
        _shipped(8).bind(WEIGHTS)
    with pytest.raises(ValueError, match="draft_head: no such checkpoint folder or file /no/such"):
        tree_speculative_config(nodes=8, drafter="auto", draft_head="/no/such")


def test_a_large_drafter_travels_in_a_file(env):
    import os

    big = _Recorder()
    big.table = np.arange(100_000)  # pickles to more than an environment string may hold
    tree_speculative_config(nodes=4, drafter=big, adaptive=False)
    assert os.environ[DRAFTER_ENV_VAR].startswith("file:")
    assert np.array_equal(_shipped(4).table, big.table)


class _Recorder:
    """A learning drafter that drafts a fixed chain and records what it is told."""

    def __init__(self):
        self.observed = []

    def propose(self, contexts, hidden=None):
        return [DraftTree([int(c[-1]), 1, 2], [-1, 0, 1]) for c in contexts]

    def observe(self, emitted, seconds):
        self.observed.append((emitted, seconds))


def test_a_learning_drafter_hears_each_request_outcome_by_request_id():
    proposer = TreeProposer.__new__(TreeProposer)  # no vLLM here: the proposer's own bookkeeping only
    drafter = _Recorder()
    proposer._setup(drafter, nodes=3)
    tokens = np.arange(40).reshape(4, 10)
    proposer._rows = [("a", False), ("b", True), ("c", False)]  # b decodes plainly
    drafts = proposer.propose([[9], [9], [9]], np.array([5, 5, 5]), tokens)
    assert drafts == [[1, 2], [], [1, 2]] and drafter.observed == []
    # Next step (the runner's hook timed it): the batch was reordered, c emitted two tokens, a finished
    # (gone), d is new.
    proposer._rows, proposer._step_started = [("c", False), ("d", False)], time.perf_counter() - 0.05
    proposer.propose([[1, 2, 7], [3]], np.array([6, 6]), tokens)
    (emitted, seconds), = drafter.observed
    assert emitted == [[], [1, 2, 7]] and 0.05 <= seconds < 1  # in the order of the last proposal: a, c
    assert proposer._proposed == ["c", "d"]
    # A step that also prefilled (the hook left it untimed): the outcome counts, its time does not.
    proposer._rows = [("c", False), ("d", False)]
    proposer.propose([[4], [5]], np.array([7, 7]), tokens)
    assert drafter.observed[-1] == ([[4], [5]], None)


def test_the_proposer_lets_an_adaptive_drafter_skip_drafting_for_a_whole_step():
    proposer = TreeProposer.__new__(TreeProposer)
    drafter = AdaptiveDrafter(NGramDrafter(4), max_nodes=4)
    proposer._setup(drafter, nodes=4)
    assert isinstance(drafter.gate, StepGate)  # an engine step is shared: drafting must pay per batch step
    own = StepGate(probe_every=8)
    proposer._setup(AdaptiveDrafter(NGramDrafter(4), gate=own), nodes=4)
    assert proposer.drafter.gate is own


class _Unpicklable:
    def __init__(self):
        self.callback = lambda: None

    def propose(self, contexts, hidden=None):
        return []


@pytest.mark.parametrize("kwargs, error, match", [
    ({"nodes": 1}, ValueError, "nodes must be an integer >= 2"),
    ({"nodes": True}, ValueError, "nodes must be an integer >= 2"),
    ({"nodes": 4.0}, ValueError, "nodes must be an integer >= 2"),
    ({"drafter": 3}, TypeError, "drafter must be a drafter name"),
    ({"drafter": "medusa"}, ValueError, "drafter must be one of ngram, suffix, heads, auto"),
    ({"drafter": "heads", "heads": "/no/such/heads.pt"}, ValueError, "heads: no such file"),
    ({"drafter": NGramDrafter(4), "heads": "h.pt"}, ValueError, "heads goes with drafter 'heads' or 'auto'"),
    ({"drafter": "ngram", "heads": "h.pt"}, ValueError, "heads goes with drafter 'heads' or 'auto'"),
    ({"drafter": NGramDrafter(4), "draft_head": "e3"}, ValueError, "draft_head goes with drafter 'heads' or 'auto'"),
    ({"drafter": "auto", "adaptive": False}, ValueError, "adaptive=False verifies one drafter's whole trees"),
    ({"drafter": _Unpicklable()}, TypeError, "must pickle"),
])
def test_bad_configs_are_refused(env, kwargs, error, match):
    import os

    with pytest.raises(error, match=match):
        tree_speculative_config(**kwargs)
    assert DRAFTER_ENV_VAR not in os.environ


def _params(**changes):
    base = dict(presence_penalty=0.0, frequency_penalty=0.0, repetition_penalty=1.0, bad_words=None, logit_bias=None,
                allowed_token_ids=None, min_tokens=0, min_p=0.0, structured_outputs=None)
    return types.SimpleNamespace(**{**base, **changes})


def test_plain_decoding_is_chosen_by_settings_that_depend_on_earlier_tokens():
    assert plain_decoding_reason(_params()) is None
    assert plain_decoding_reason(_params(repetition_penalty=1.2, bad_words=["x"])) == "repetition_penalty, bad_words"
    assert plain_decoding_reason(_params(min_tokens=3)) == "min_tokens"


def test_tree_rows_take_tree_positions():
    trees = [None, DraftTree([7, 1, 2, 3, 4], [-1, 0, 0, 2, 1]), None, DraftTree([5, 6], [-1, 0])]
    step = _Step(trees, np.array([0, 30, 35, 36, 38]), torch.arange(38))
    shift = step.position_shift(38)
    assert shift[:30].tolist() == [0] * 30 and shift[35] == 0
    assert shift[30:35].tolist() == [0, 0, 1, 1, 2]  # index - depth: depths 0, 1, 1, 2, 2
    assert shift[36:38].tolist() == [0, 0]
