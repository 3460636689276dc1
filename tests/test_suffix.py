"""The suffix-trie drafter: drafts, memory bound, exact eviction, determinism (no model needed).

Budget: ~5 s on 2 cores.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from treeattn.speculative import Drafter, DraftTree
from treeattn.speculative.adaptive import ScoringDrafter
from treeattn.speculative.suffix import SuffixDrafter


def paths(tree: DraftTree) -> set[tuple[int, ...]]:
    return {tuple(int(tree.tokens[i]) for i in tree.path(n)[1:]) for n in range(tree.size)}


def trie_snapshot(d: SuffixDrafter) -> dict[tuple[int, ...], int]:
    """Every substring held, with its count."""
    out, stack = {}, [((), 0)]
    while stack:
        prefix, node = stack.pop()
        for t, child in (d._kids[node] or {}).items():
            out[prefix + (t,)] = d._count[child]
            stack.append((prefix + (t,), child))
    return out


def test_repeated_text_is_drafted_as_a_chain():
    text = [5, 6, 7, 8, 9, 10, 11, 1, 2, 5, 6, 7]
    tree = SuffixDrafter(8, max_depth=5).propose([np.array(text)])[0]
    assert tree.tokens[0] == 7
    assert (8, 9, 10, 11, 1) in paths(tree)


def test_earlier_outputs_of_other_requests_are_drafted():
    d = SuffixDrafter(8)
    d.propose([np.array([1, 2, 3, 4, 5, 6, 7])])  # request one
    tree = d.propose([np.array([9, 9, 3, 4])])[0]  # request two: "3 4" was followed by "5 6 7"
    assert (5, 6, 7) in paths(tree)


def test_frequent_continuations_come_first():
    text = [0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 4, 0, 1, 2]  # "0 1 2" was followed by 3 twice, by 4 once
    c = SuffixDrafter(16, max_depth=1).candidates([np.array(text)])[0]
    kids = np.nonzero(c.tree.parents == 0)[0]
    assert c.tree.tokens[kids].tolist() == [3, 4]
    assert c.prior[kids[0]] > c.prior[kids[1]]


def test_no_match_gives_root_only_and_arguments_are_checked():
    assert SuffixDrafter().propose([np.array([1, 2, 3])])[0].size == 1
    with pytest.raises(ValueError, match="max_tokens"):
        SuffixDrafter(max_tokens=0)
    with pytest.raises(ValueError, match="contexts"):
        SuffixDrafter().propose([np.array([], dtype=np.int64)])
    d = SuffixDrafter()
    assert isinstance(d, Drafter) and isinstance(d, ScoringDrafter)


texts = st.lists(st.lists(st.integers(0, 4), min_size=1, max_size=40), min_size=1, max_size=8)


@settings(max_examples=60, deadline=None)
@given(texts, st.integers(1, 24), st.integers(8, 60), st.integers(1, 4), st.integers(1, 6))
def test_trees_valid_within_budget_and_memory_bound(batch, budget, max_tokens, max_pattern, max_depth):
    d = SuffixDrafter(budget, max_pattern=max_pattern, max_depth=max_depth, max_tokens=max_tokens)
    for text in batch:
        for end in range(1, len(text) + 1):  # a request growing one token at a time
            tree = d.propose([np.array(text[:end])])[0]
            assert 1 <= tree.size <= budget and tree.tokens[0] == text[end - 1]
            assert all(0 <= tree.parents[i] < i for i in range(1, tree.size))
            for path in paths(tree):
                assert len(path) <= max_depth
            assert d.num_tokens <= max_tokens
            assert d.num_nodes <= max_tokens * (max_pattern + max_depth) + 1
    assert min(trie_snapshot(d).values(), default=1) >= 1  # evicted nodes are really gone


@settings(max_examples=40, deadline=None)
@given(texts, st.integers(8, 50))
def test_eviction_is_exact_and_drafts_are_deterministic(batch, max_tokens):
    d = SuffixDrafter(12, max_pattern=3, max_depth=4, max_tokens=max_tokens)
    trees = [d.propose([np.array(t)])[0] for t in batch]
    # The trie counts exactly the substrings (up to the depth limit) of the texts it still holds.
    expected: dict[tuple[int, ...], int] = {}
    for text in d._texts:
        toks = text.tokens
        for s in range(len(toks)):
            for e in range(s + 1, min(s + d.depth_limit, len(toks)) + 1):
                expected[tuple(toks[s:e])] = expected.get(tuple(toks[s:e]), 0) + 1
    assert trie_snapshot(d) == expected
    again = SuffixDrafter(12, max_pattern=3, max_depth=4, max_tokens=max_tokens)
    for t, tree in zip(batch, trees):
        other = again.propose([np.array(t)])[0]
        assert np.array_equal(other.tokens, tree.tokens) and np.array_equal(other.parents, tree.parents)
