"""Drafters: n-gram / prompt-lookup trees, static choice trees, Medusa heads.

Budget: ~10 s on 2 cores.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from treeattn import TokenTree
from treeattn.speculative import Drafter, DraftTree, MedusaHeads, NGramDrafter, StaticTreeDrafter


def continuations(context: list[int], depth: int, min_ngram: int) -> set[tuple[int, ...]]:
    """Every continuation (up to ``depth`` tokens) that follows an earlier occurrence of the last
    ``min_ngram`` tokens: any root-to-node path of the drafted tree must be a prefix of one."""
    n, suffix = len(context), tuple(context[-min_ngram:])
    out = set()
    for e in range(min_ngram - 1, n - 1):
        if tuple(context[e - min_ngram + 1:e + 1]) == suffix:
            out.add(tuple(context[e + 1:e + 1 + depth]))
    return out


def node_paths(tree: DraftTree) -> list[tuple[int, ...]]:
    return [tuple(int(tree.tokens[i]) for i in tree.path(node)[1:]) for node in range(tree.size)]


def test_repeated_text_is_drafted():
    text = [5, 6, 7, 8, 9, 10, 11, 1, 2, 5, 6, 7]  # "5 6 7" occurred before, followed by 8 9 10 11 1 ...
    tree = NGramDrafter(budget=8, max_depth=5).draft(text)
    assert tree.tokens[0] == 7 and tree.parents[0] == -1
    paths = node_paths(tree)
    assert (8, 9, 10, 11, 1) in paths  # the whole continuation, as one chain
    assert tree.size <= 8


def test_frequent_continuation_ranks_first_and_siblings_are_distinct():
    # After "1 2" came 3 three times and 4 once: 3 is the first child, 4 a later sibling.
    text = [1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 4, 0, 1, 2, 3, 0, 1, 2]
    tree = NGramDrafter(budget=16, max_depth=3).draft(text)
    kids = np.nonzero(tree.parents == 0)[0]
    assert tree.tokens[kids[0]] == 3
    assert 4 in tree.tokens[kids].tolist()
    for node in range(tree.size):  # a trie: siblings never repeat a token
        sib = tree.tokens[tree.parents == node]
        assert len(set(sib.tolist())) == sib.size


def test_no_match_gives_root_only():
    tree = NGramDrafter().draft([1, 2, 3, 4])
    assert tree.size == 1 and tree.tokens.tolist() == [4]
    assert NGramDrafter(budget=1).draft([1, 2, 1, 2]).size == 1


def test_longer_matches_win_over_frequent_short_ones():
    # "9 1" is followed by 7 once (a 2-gram match); "1" alone is followed by 5 three times (1-gram).
    text = [1, 5, 0, 1, 5, 0, 1, 5, 0, 9, 1, 7, 0, 9, 1]
    tree = NGramDrafter(budget=2, max_depth=1, max_ngram=2).draft(text)
    assert tree.tokens.tolist() == [1, 7]


@st.composite
def contexts(draw):
    vocab = draw(st.integers(2, 6))
    return draw(st.lists(st.integers(0, vocab - 1), min_size=1, max_size=120))


@settings(max_examples=80, deadline=None)
@given(contexts(), st.integers(1, 40), st.integers(1, 4), st.integers(1, 3), st.integers(1, 10))
def test_ngram_trees_are_valid_within_budget_and_deterministic(context, budget, max_ngram, min_ngram, depth):
    min_ngram = min(min_ngram, max_ngram)
    drafter = NGramDrafter(budget, max_ngram=max_ngram, min_ngram=min_ngram, max_depth=depth)
    tree = drafter.draft(context)
    assert 1 <= tree.size <= budget
    assert tree.tokens[0] == context[-1]
    assert tree.parents[0] == -1 and all(0 <= tree.parents[i] < i for i in range(1, tree.size))
    assert int(TokenTree(tree.parents).depth.max()) <= depth
    allowed = continuations(context, depth, min_ngram)
    for path in node_paths(tree)[1:]:
        assert any(c[:len(path)] == path for c in allowed), path
    again = drafter.draft(list(context))
    assert np.array_equal(again.tokens, tree.tokens) and np.array_equal(again.parents, tree.parents)
    assert [t.size for t in drafter.propose([np.array(context)] * 2)] == [tree.size] * 2


def test_ngram_arguments_are_checked():
    with pytest.raises(ValueError, match="budget"):
        NGramDrafter(0)
    with pytest.raises(ValueError, match="min_ngram"):
        NGramDrafter(min_ngram=3, max_ngram=2)
    with pytest.raises(ValueError, match="context"):
        NGramDrafter().draft([])
    assert isinstance(NGramDrafter(), Drafter)


class FixedCandidates:
    """Candidate source returning ``base + 10 * head + rank`` for every sequence."""

    def candidates(self, contexts, hidden, num_heads, k):
        base = torch.tensor([int(c[-1]) * 100 for c in contexts])
        grid = 10 * torch.arange(num_heads)[:, None] + torch.arange(k)[None, :]
        return base[:, None, None] + grid[None]


def test_static_tree_fills_choice_paths():
    choices = [(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 2)]
    drafter = StaticTreeDrafter(choices, FixedCandidates())
    trees = drafter.propose([np.array([4, 1]), np.array([2])])
    shape = TokenTree.from_choices(choices)
    for tree, root in zip(trees, (1, 2)):
        assert np.array_equal(tree.parents, shape.parents)
        assert tree.tokens[0] == root
        for node in range(1, tree.size):
            path = shape.choices[node]  # node's choice path: head len(path)-1, rank path[-1]
            assert tree.tokens[node] == root * 100 + 10 * (len(path) - 1) + path[-1]


def test_medusa_heads_shapes_and_checkpoint_names():
    torch.manual_seed(0)
    heads = MedusaHeads(hidden_size=16, vocab_size=50, num_heads=3)
    names = set(heads.state_dict())
    assert {"medusa_head.0.0.linear.weight", "medusa_head.0.0.linear.bias", "medusa_head.2.1.weight"} <= names
    hidden = torch.randn(2, 16)
    cands = heads.candidates([np.array([1]), np.array([2])], hidden, 3, 4)
    assert cands.shape == (2, 3, 4)
    expected = torch.topk(heads.medusa_head[1](hidden), 4, dim=-1).indices
    assert torch.equal(cands[:, 1], expected)
    drafter = StaticTreeDrafter([(0,), (1,), (0, 0)], heads)
    trees = drafter.propose([np.array([1]), np.array([2])], hidden=hidden)
    assert trees[1].tokens[1] == cands[1, 0, 0] and trees[1].tokens[3] == cands[1, 1, 0]
    with pytest.raises(ValueError, match="hidden"):
        drafter.propose([np.array([1])])
