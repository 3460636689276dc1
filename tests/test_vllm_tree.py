"""``treeattn.vllm.speculative`` without vLLM: its configuration, its refusals and its step arithmetic.
(The engine itself, greedy and sampling, runs in ``test_vllm.py`` with vLLM installed.)"""

from __future__ import annotations

import base64
import pickle
import types

import numpy as np
import pytest
import torch

from treeattn.speculative import DraftTree, NGramDrafter
from treeattn.vllm import tree_speculative_config
from treeattn.vllm.speculative import DRAFTER_ENV_VAR, _Step, plain_decoding_reason


@pytest.fixture
def env(monkeypatch):
    monkeypatch.delenv(DRAFTER_ENV_VAR, raising=False)
    return monkeypatch


def test_config_names_the_proposer_and_ships_the_drafter(env):
    config = tree_speculative_config(nodes=10)
    assert config == {"method": "custom_class", "model": "treeattn.vllm.speculative.TreeProposer",
                      "num_speculative_tokens": 9}
    import os

    drafter = pickle.loads(base64.b64decode(os.environ[DRAFTER_ENV_VAR]))
    assert isinstance(drafter, NGramDrafter) and drafter.budget == 10


class _Unpicklable:
    def __init__(self):
        self.callback = lambda: None

    def propose(self, contexts, hidden=None):
        return []


@pytest.mark.parametrize("kwargs, error, match", [
    ({"nodes": 1}, ValueError, "nodes must be an integer >= 2"),
    ({"nodes": True}, ValueError, "nodes must be an integer >= 2"),
    ({"nodes": 4.0}, ValueError, "nodes must be an integer >= 2"),
    ({"drafter": "ngram"}, TypeError, "drafter must be a treeattn Drafter"),
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
