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
from treeattn.speculative.adaptive import AdaptiveDrafter
from treeattn.speculative.heads import DraftHeads, HeadDrafter, find_heads, save_heads
from treeattn.vllm import tree_speculative_config
from treeattn.vllm.speculative import DRAFTER_ENV_VAR, DrafterByName, TreeProposer, _Step, _unshare, plain_decoding_reason


@pytest.fixture
def env(monkeypatch):
    monkeypatch.delenv(DRAFTER_ENV_VAR, raising=False)
    return monkeypatch


def _shipped():
    import os

    return _unshare(os.environ[DRAFTER_ENV_VAR])


WEIGHTS = (torch.randn(VOCAB, 64), torch.randn(VOCAB, 64))  # a tiny target's (embeddings, lm_head)


def test_config_names_the_proposer_and_ships_the_drafter(env):
    config = tree_speculative_config(nodes=10)
    assert config == {"method": "custom_class", "model": "treeattn.vllm.speculative.TreeProposer",
                      "num_speculative_tokens": 9}
    drafter = _shipped()  # adaptive by default: trees cut to what pays, within the node budget
    assert isinstance(drafter, AdaptiveDrafter) and drafter.max_nodes == 10
    assert isinstance(drafter.sources[0], NGramDrafter) and drafter.sources[0].budget == 10
    tree_speculative_config(nodes=10, adaptive=False)
    assert isinstance(_shipped(), NGramDrafter)
    tree_speculative_config(nodes=10, drafter="suffix")
    assert [type(s).__name__ for s in _shipped().sources] == ["SuffixDrafter"]
    tree_speculative_config(nodes=10, drafter=NGramDrafter(10))  # a drafter object travels pickled
    assert isinstance(_shipped(), AdaptiveDrafter)
    tree_speculative_config(nodes=10, drafter="auto")  # a head needs the target's weights: built in the worker
    assert _shipped() == DrafterByName("auto", 10, str(find_heads()))


def test_a_draft_head_by_name_binds_to_the_targets_weights(env, tmp_path):
    save_heads(DraftHeads(64, range(16)), tmp_path / "h.pt")
    tree_speculative_config(nodes=8, drafter="heads", heads=tmp_path / "h.pt", adaptive=False)
    drafter = _shipped().bind(WEIGHTS)
    assert isinstance(drafter, HeadDrafter) and drafter.budget == 8
    assert torch.equal(drafter.embed, WEIGHTS[0])  # it reads the target's embeddings and LM head rows
    assert torch.equal(drafter.project[0].weight, WEIGHTS[1][:16])
    tree_speculative_config(nodes=8, drafter="auto", heads=tmp_path / "h.pt")
    assert [type(s).__name__ for s in _shipped().bind(WEIGHTS).sources] == ["SuffixDrafter", "HeadDrafter"]
    narrow = (torch.randn(VOCAB, 32), torch.randn(VOCAB, 32))  # a target the head does not fit
    assert [type(s).__name__ for s in _shipped().bind(narrow).sources] == ["SuffixDrafter"]  # auto goes on without
    tree_speculative_config(nodes=8, drafter="heads", heads=tmp_path / "h.pt")
    with pytest.raises(ValueError, match="drafter 'heads': .*hidden states of size 64, the model's are 32"):
        _shipped().bind(narrow)


def test_a_large_drafter_travels_in_a_file(env):
    import os

    big = _Recorder()
    big.table = np.arange(100_000)  # pickles to more than an environment string may hold
    tree_speculative_config(nodes=4, drafter=big, adaptive=False)
    assert os.environ[DRAFTER_ENV_VAR].startswith("file:")
    assert np.array_equal(_shipped().table, big.table)


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
