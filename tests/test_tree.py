"""Tree encoding: TVM's golden vectors and properties of the DFS (enter, exit) numbering."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import treeattn
from tests.helpers import binary, chain, forest, parent_arrays, star
from treeattn.tree import (
    CHAIN_CHUNK,
    MAX_TREE_SIZE,
    _encode_tour,
    _encode_walk,
    ancestor_path,
    ancestor_paths,
    chain_chunks,
    chain_order,
    encode_trees,
    order_and_depth,
    path_sums,
)

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


# ------------------------------------------------------------------ the encoding against a plain DFS


def dfs_by_stack(parents) -> tuple[list[list[int]], list[int]]:
    """TVM's numbering written the obvious way: an explicit-stack DFS over the roots, then each
    node's children, in ascending index; (enter, exit) and depth per node."""
    n = len(parents)
    children = [[] for _ in range(n)]
    roots = []
    for i, p in enumerate(parents):
        (children[p] if p >= 0 else roots).append(i)
    order, depth = [[0, 0] for _ in range(n)], [0] * n
    clock = 0
    stack = [(r, 0, False) for r in reversed(roots)]
    while stack:
        u, d, leaving = stack.pop()
        if leaving:
            order[u][1] = clock
            continue
        order[u][0], depth[u] = clock, d
        clock += 1
        stack.append((u, d, True))
        stack.extend((c, d + 1, False) for c in reversed(children[u]))
    return order, depth


@st.composite
def deep_parent_arrays(draw, max_size: int = 200) -> list[int]:
    """Mostly chains with short back-jumps and occasional new roots: depth ~ n, many shapes."""
    n = draw(st.integers(1, max_size))
    back = draw(st.lists(st.integers(-1, 3), min_size=n, max_size=n))
    return [-1 if (i == 0 or b < 0) else max(i - 1 - b, 0) for i, b in enumerate(back)]


any_tree = st.one_of(parent_arrays(max_size=96), deep_parent_arrays())


@settings(max_examples=200, deadline=None)
@given(any_tree)
def test_encoding_equals_a_stack_dfs(parents):
    order, depth = dfs_by_stack(parents)
    got_order, got_depth = order_and_depth(parents)
    assert got_order.tolist() == order and got_depth.tolist() == depth
    assert got_order.dtype == np.int64 and got_depth.dtype == np.int64


@settings(max_examples=200, deadline=None)
@given(st.lists(st.one_of(st.just([]), any_tree), max_size=8))
def test_both_encodings_equal_a_stack_dfs(trees):
    """The small-batch walk and the large-batch tour, each forced, on any batch (``_encode`` picks one by size)."""
    sizes = np.array([len(t) for t in trees], dtype=np.int64)
    parents = np.array([p for t in trees for p in t], dtype=np.int64)
    expected = [dfs_by_stack(t) for t in trees]
    for encode in (_encode_walk, _encode_tour):
        order, depth = encode(parents, sizes)
        assert order.dtype == depth.dtype == np.int64 and order.shape == (parents.shape[0], 2)
        starts = np.cumsum(sizes) - sizes
        for (want_order, want_depth), lo, n in zip(expected, starts.tolist(), sizes.tolist()):
            assert order[lo:lo + n].tolist() == want_order and depth[lo:lo + n].tolist() == want_depth


@settings(max_examples=80, deadline=None)
@given(st.lists(st.one_of(st.just([]), any_tree), max_size=8))
def test_batch_encoding_equals_per_tree_dfs(trees):
    indptr, order, depth = encode_trees(trees)
    assert indptr.tolist() == np.cumsum([0] + [len(t) for t in trees]).tolist()
    for b, parents in enumerate(trees):
        expected_order, expected_depth = dfs_by_stack(parents)
        assert order[indptr[b]:indptr[b + 1]].tolist() == expected_order
        assert depth[indptr[b]:indptr[b + 1]].tolist() == expected_depth
    packed_indptr, packed_order = treeattn.pack_trees(trees)
    assert packed_indptr.dtype == packed_order.dtype == torch.int32
    assert packed_indptr.tolist() == indptr.tolist() and packed_order.tolist() == order.tolist()


@pytest.mark.parametrize("shape", ["chain", "star", "broom", "caterpillar", "forest of chains"])
def test_largest_trees_equal_a_stack_dfs(shape):
    n = MAX_TREE_SIZE
    parents = {
        "chain": chain(n),
        "star": star(n),
        "broom": chain(n // 2) + [n // 2 - 1] * (n - n // 2),  # a deep handle, then a wide head
        "caterpillar": [-1] + [i - 1 - (i % 2) if i % 2 else i - 2 for i in range(1, n)],
        "forest of chains": forest(*[chain(64)] * (n // 64)),
    }[shape]
    order, depth = dfs_by_stack(parents)
    got_order, got_depth = order_and_depth(parents)
    assert got_order.tolist() == order and got_depth.tolist() == depth
    walked_order, walked_depth = _encode_walk(np.array(parents, dtype=np.int64), np.array([n]))  # not its size's pick
    assert walked_order.tolist() == order and walked_depth.tolist() == depth


@settings(max_examples=80, deadline=None)
@given(st.lists(any_tree, min_size=1, max_size=6), st.data())
def test_paths_and_path_sums_by_the_interval_test(trees, data):
    indptr, order, _ = encode_trees(trees)
    nodes = [data.draw(st.integers(0, len(t) - 1)) for t in trees]
    paths = ancestor_paths(order, indptr, np.array(nodes))
    weights = np.array(data.draw(st.lists(st.integers(0, 3), min_size=int(indptr[-1]), max_size=int(indptr[-1]))))
    sums = path_sums(order, indptr, weights)
    for b, (parents, u) in enumerate(zip(trees, nodes)):
        walked = sorted(_ancestors_by_walking(parents, u))
        assert paths[b].tolist() == walked
        assert ancestor_path(order[indptr[b]:indptr[b + 1]], u).tolist() == walked
        assert treeattn.TokenTree(parents).path(u) == walked
        expected = []  # parents precede children: a node's sum is its weight plus its parent's sum
        for v, p in enumerate(parents):
            expected.append(int(weights[indptr[b] + v]) + (expected[p] if p >= 0 else 0))
        assert sums[indptr[b]:indptr[b + 1]].tolist() == expected


# ------------------------------------------------------------------ bad input (issue 15 defects 9, 11)


@pytest.mark.parametrize("choices,error,message", [
    ([(0,), (1.5,)], TypeError, r"choices\[1\]\[0\] must be an int, got float"),
    ([(0,), (True,)], TypeError, r"choices\[1\]\[0\] must be an int, got a bool"),
    ([(0,), (np.bool_(True),)], TypeError, "bool"),
    ([(0,), "01"], TypeError, r"choices\[1\] must be a sequence of ints"),
    ([(0,), 3], TypeError, r"choices\[1\] must be a sequence of ints"),
])
def test_from_choices_takes_ranks_exactly(choices, error, message):
    """Issue 15 defect 9: (1.5,) silently became (1,) and bool ranks were accepted."""
    with pytest.raises(error, match=message):
        treeattn.TokenTree.from_choices(choices)
    assert treeattn.TokenTree.from_choices([(np.int64(0),), (0, np.int32(1))]).choices == ((), (0,), (0, 1))


@pytest.mark.parametrize("parents,error,message", [
    (np.array([2**64 - 1, 0], dtype=np.uint64), ValueError, r"parents\[0\] = 18446744073709551615 is outside"),
    (np.array([0, 0], dtype=np.uint8), ValueError, r"parents\[0\] = 0"),
    ([[-1, 0], [-1]], ValueError, "parents must be a 1-D sequence of ints, got a ragged nested sequence"),
    ([[-1, 0], [-1, 0]], ValueError, "parents must be 1-D"),
    ([-1, True], TypeError, r"parents\[1\] must be an int, got a bool"),
    ((-1, np.bool_(False)), TypeError, r"parents\[1\] must be an int, got a bool"),
    (np.array([True, False]), TypeError, "parents must hold integers, got bool"),
    (torch.tensor([-1.0, 0.0]), TypeError, "parents must hold integers"),
    (None, TypeError, "parents must be a 1-D sequence of ints, got NoneType"),
    (5, TypeError, "parents must be a 1-D sequence of ints, got int"),
    (["-1", "0"], TypeError, "parents must hold integers"),
    ([-1, 2**70], TypeError, "parents must hold integers"),
])
def test_parents_are_taken_exactly(parents, error, message):
    """Issue 15 defects 9 and 11: uint64 2**64 - 1 wrapped to -1 (a root); ragged lists gave numpy's
    'inhomogeneous shape' message."""
    with pytest.raises(error, match=message):
        treeattn.tree_order(parents)
    with pytest.raises(error):
        treeattn.TokenTree(parents)


def test_narrow_integer_parents_are_accepted():
    expected = [[0, 3], [1, 2], [2, 3]]
    assert treeattn.tree_order(torch.tensor([-1, 0, 0], dtype=torch.int16)).tolist() == expected
    assert treeattn.tree_order(np.array([-1, 0, 0], dtype=np.int8)).tolist() == expected


@pytest.mark.parametrize("prefix_len,error,message", [
    (2.7, TypeError, "prefix_len must be an int, got float"),
    (True, TypeError, "prefix_len must be an int, got a bool"),
    ("3", TypeError, "prefix_len must be an int"),
    (-5, ValueError, "prefix_len must be >= 0"),
    (2**31, ValueError, "int32"),
])
def test_positions_take_a_whole_prefix_length(prefix_len, error, message):
    """Issue 15 defect 9: positions(2.7) and positions(-5) were accepted."""
    tree = treeattn.TokenTree(binary(5))
    with pytest.raises(error, match=message):
        tree.positions(prefix_len)
    assert tree.positions(np.int64(3)).tolist() == [3, 4, 4, 5, 5]


@pytest.mark.parametrize("node,error", [(2.0, TypeError), (True, TypeError), (-1, ValueError), (5, ValueError)])
def test_path_checks_the_node(node, error):
    with pytest.raises(error, match="node"):
        treeattn.TokenTree(binary(5)).path(node)


@pytest.mark.parametrize("order,error,message", [
    ([[0, 2], [1, 2]], TypeError, "order must be an int32 or int64 tensor"),
    (torch.tensor([[0.0, 2.0], [1.0, 2.0]]), TypeError, "order must be an int32 or int64 tensor"),
    (torch.tensor([0, 2, 1, 2]), ValueError, r"order must have shape \[n, 2\]"),
    (torch.tensor([[0, 2], [0, 2]]), ValueError, "permutation"),
    (torch.tensor([[0, 3], [1, 2]]), ValueError, "exit"),
    (torch.tensor([[0, 2], [1, 3], [2, 3]]), ValueError, "nesting"),
])
def test_ancestor_mask_checks_the_order(order, error, message):
    """Issue 15 defect 11: ancestor_mask took any tensor and returned a meaningless mask."""
    with pytest.raises(error, match=message):
        treeattn.ancestor_mask(order)


def test_pack_trees_names_the_bad_tree():
    with pytest.raises(TypeError, match=r"trees must be a list of parent arrays.*TokenTree"):
        treeattn.pack_trees(treeattn.TokenTree([-1, 0]))
    with pytest.raises(ValueError, match=r"trees\[1\] has 4097 nodes"):
        treeattn.pack_trees([[-1], chain(MAX_TREE_SIZE + 1)])
    with pytest.raises(ValueError, match=r"trees\[2\]\[1\] = 1"):
        treeattn.pack_trees([[-1], [], [-1, 1]])
    indptr, order = treeattn.pack_trees([treeattn.TokenTree([-1, 0]), [-1]])
    assert indptr.tolist() == [0, 2, 3] and order.tolist() == [[0, 2], [1, 2], [0, 1]]


def test_token_tree_is_immutable_and_owns_its_parents():
    parents = np.array([-1, 0, 0])
    tree = treeattn.TokenTree(parents)
    parents[2] = 1  # the caller's array stays theirs
    assert tree.parents.tolist() == [-1, 0, 0] and parents.flags.writeable
    with pytest.raises(ValueError):
        tree.parents[1] = -1
    with pytest.raises(AttributeError):
        tree.parents = np.array([-1])


@given(st.integers(0, 3 * CHAIN_CHUNK + 1))
@settings(max_examples=40, deadline=None)
def test_chain_chunks_cut_a_causal_append_into_consecutive_chains(n):
    chunks = chain_chunks(n)
    firsts = [lo for lo, _ in chunks]
    sizes = [order.shape[0] for _, order in chunks]
    assert firsts == list(range(0, n, CHAIN_CHUNK))
    assert sum(sizes) == n and all(0 < k <= CHAIN_CHUNK for k in sizes)
    for _, order in chunks:  # each chunk a chain: node i enters at i, its subtree runs to the chunk's end
        np.testing.assert_array_equal(order, chain_order(order.shape[0]))
        assert (order[:, 1] == order.shape[0]).all()
