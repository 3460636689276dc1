"""Tree encoding: TVM's golden vectors and properties of the DFS (enter, exit) numbering."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings

import treeattn
from tests.helpers import binary, chain, forest, parent_arrays, star

GOLDEN = [
    ([-1, 0, 0, 1, 1, 2, 2], [(0, 7), (1, 4), (4, 7), (2, 3), (3, 4), (5, 6), (6, 7)]),
    ([-1, 0, 1, 2], [(0, 4), (1, 4), (2, 4), (3, 4)]),
    ([-1, -1, 0, 1, 0], [(0, 3), (3, 5), (1, 2), (4, 5), (2, 3)]),
    ([-1, 0, 0, 1, 1, 2, 2, -1, 7, 7, 8, 8, 9, 9],
     [(0, 7), (1, 4), (4, 7), (2, 3), (3, 4), (5, 6), (6, 7), (7, 14), (8, 11), (11, 14), (9, 10), (10, 11),
      (12, 13), (13, 14)]),
]


@pytest.mark.parametrize("parents,expected", GOLDEN)
def test_golden_vectors_match_tvm(parents, expected):
    order = treeattn.tree_order(parents)
    assert order.dtype == torch.int32 and order.shape == (len(parents), 2)
    assert order.tolist() == [list(e) for e in expected]


def _ancestors_by_walking(parents, u):
    out = set()
    while u >= 0:
        out.add(u)
        u = parents[u]
    return out


@settings(max_examples=150, deadline=None)
@given(parent_arrays(max_size=96))
def test_interval_test_equals_walking_parents(parents):
    mask = treeattn.ancestor_mask(treeattn.tree_order(parents))
    n = len(parents)
    expected = torch.zeros(n, n, dtype=torch.bool)
    for u in range(n):
        for a in _ancestors_by_walking(parents, u):
            expected[u, a] = True
    assert torch.equal(mask, expected)


@settings(max_examples=150, deadline=None)
@given(parent_arrays(max_size=96))
def test_enters_are_a_permutation_and_exit_minus_enter_is_subtree_size(parents):
    order = treeattn.tree_order(parents).numpy()
    n = len(parents)
    assert sorted(order[:, 0].tolist()) == list(range(n))
    sizes = [sum(1 for w in range(n) if u in _ancestors_by_walking(parents, w)) for u in range(n)]
    assert (order[:, 1] - order[:, 0]).tolist() == sizes


@settings(max_examples=100, deadline=None)
@given(parent_arrays(max_size=64))
def test_depths_and_paths(parents):
    tree = treeattn.TokenTree(parents)
    for u in range(len(parents)):
        path = tree.path(u)
        assert path[-1] == u and parents[path[0]] == -1
        assert all(parents[b] == a for a, b in zip(path, path[1:]))
        assert int(tree.depth[u]) == len(path) - 1
    assert torch.equal(tree.positions(100), tree.depth + 100)
    assert torch.equal(treeattn.tree_depths(parents), tree.depth)


def test_pack_trees_concatenates_with_indptr():
    trees = [binary(7), [], chain(4), star(5)]
    indptr, order = treeattn.pack_trees(trees)
    assert indptr.tolist() == [0, 7, 7, 11, 16]
    assert order.dtype == torch.int32 and order.shape == (16, 2)
    assert torch.equal(order[7:11], treeattn.tree_order(chain(4)))
    empty_indptr, empty_order = treeattn.pack_trees([])
    assert empty_indptr.tolist() == [0] and empty_order.shape == (0, 2)


def test_chain_detection_and_mask_shapes():
    assert treeattn.TokenTree(chain(5)).is_chain
    assert not treeattn.TokenTree(binary(5)).is_chain
    m = treeattn.TokenTree(forest(chain(2), chain(2))).ancestor_mask()
    assert m.tolist() == [[1, 0, 0, 0], [1, 1, 0, 0], [0, 0, 1, 0], [0, 0, 1, 1]]


def test_from_choices_medusa_style():
    tree = treeattn.TokenTree.from_choices([(1,), (0, 0), (0,), (0, 1), (0, 0, 0)])
    assert tree.choices == ((), (0,), (1,), (0, 0), (0, 1), (0, 0, 0))
    assert tree.parents.tolist() == [-1, 0, 0, 1, 1, 3]
    forest_tree = treeattn.TokenTree.from_choices([(0,), (1,), (0, 0)], root=False)
    assert forest_tree.parents.tolist() == [-1, -1, 0]


@pytest.mark.parametrize("choices,message", [
    ([(0, 0)], "prefix"),
    ([(0,), (0,)], "duplicate"),
    ([()], "empty"),
    ([(0, -1)], "negative"),
])
def test_from_choices_rejects_bad_paths(choices, message):
    with pytest.raises(ValueError, match=message):
        treeattn.TokenTree.from_choices(choices)


@pytest.mark.parametrize("parents,message", [
    ([0], r"parents\[0\] = 0"),
    ([-1, 1], r"parents\[1\] = 1"),
    ([-1, -2], r"parents\[1\] = -2"),
    ([-1, 5, 0], r"parents\[1\] = 5"),
])
def test_invalid_parents_are_rejected_with_the_index(parents, message):
    with pytest.raises(ValueError, match=message):
        treeattn.tree_order(parents)


def test_parent_types_are_checked():
    with pytest.raises(TypeError, match="integers"):
        treeattn.tree_order([-1.0, 0.0])
    with pytest.raises(ValueError, match="1-D"):
        treeattn.tree_order(np.array([[-1, 0]]))
    with pytest.raises(TypeError, match="list of parent arrays"):
        treeattn.pack_trees(torch.tensor([-1, 0]))
    with pytest.raises(ValueError, match=r"trees\[1\]\[1\] = 3"):
        treeattn.pack_trees([[-1], [-1, 3]])
    assert treeattn.tree_order(torch.tensor([-1, 0, 0])).tolist() == [[0, 3], [1, 2], [2, 3]]


def test_tree_size_is_capped():
    """TVM caps a tree at 256 nodes; we accept up to MAX_TREE_SIZE and refuse more, clearly."""
    from treeattn.tree import MAX_TREE_SIZE

    chain = list(range(-1, MAX_TREE_SIZE - 1))
    assert treeattn.tree_order(chain)[-1].tolist() == [MAX_TREE_SIZE - 1, MAX_TREE_SIZE]
    with pytest.raises(ValueError, match=f"has {MAX_TREE_SIZE + 1} nodes; at most {MAX_TREE_SIZE}"):
        treeattn.tree_order(chain + [MAX_TREE_SIZE - 1])
    n = MAX_TREE_SIZE + 1  # a valid chain order, too big for the kernels' plan
    order = torch.stack([torch.arange(n), torch.full((n,), n)], dim=1).int()
    with pytest.raises(ValueError, match=f"request 0: tree of {n} nodes exceeds the maximum {MAX_TREE_SIZE}"):
        treeattn.TreeAttentionPlan.ragged([0, 1], [0, n], [0, n], order)
