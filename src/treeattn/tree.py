"""Token trees: parent arrays, TVM's DFS ``(enter, exit)`` encoding, depths, paths, masks.

A request's draft tree is a parent array ``parents[i]`` with ``-1 <= parents[i] < i`` (several
``-1`` entries make a forest). Nodes are numbered so that a parent always precedes its children.

The kernels never see the parent array: they see ``tree_order[i] = (enter[i], exit[i])``, the
preorder number of node ``i`` and one past the last preorder number of its subtree, so that
"``a`` is an ancestor-or-self of ``u``" is the interval test ``enter[a] <= enter[u] < exit[a]``.
Children and roots are visited in ascending node index, which makes the arrays byte-identical to
the ones TVM's runtime builds.

A large batch is encoded in numpy all at once, with no Python loop over nodes (the KV cache encodes
its trees every forward step): each tree's Euler tour is laid out as a linked list and ranked by
pointer jumping, ``ceil(log2(2 n))`` vector steps for any shape, a 4096-deep chain included. A small
one (a draft head's tree, grown a level at a time) takes two plain passes over its nodes, which cost
less than the vector passes' fixed few dozen numpy calls.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import cached_property
from typing import Union

import numpy as np
import torch

from .checks import as_index, int_vector

MAX_TREE_SIZE = 4096  # generous; TVM's runtime caps an accumulated tree at 256 nodes
# A causal append longer than this is attended as several chains, each seeing the keys before it:
# every kernel tree stays small (a tree's ancestor mask is quadratic in its size).
CHAIN_CHUNK = 512

ParentsLike = Union[Sequence[int], np.ndarray, torch.Tensor, "TokenTree"]


def _check_parents(parents: np.ndarray, sizes: np.ndarray, label) -> None:
    """Check int64 parent arrays laid end to end (tree ``b`` has ``sizes[b]`` nodes) in one vector
    pass; ``label(b, i)`` names node ``i`` of tree ``b`` in the error."""
    big = np.flatnonzero(sizes > MAX_TREE_SIZE)
    if big.size:
        b = int(big[0])
        raise ValueError(f"{label(b, None)} has {int(sizes[b])} nodes; at most {MAX_TREE_SIZE} are supported")
    starts = np.cumsum(sizes) - sizes
    local = np.arange(parents.shape[0]) - np.repeat(starts, sizes)
    bad = np.flatnonzero((parents < -1) | (parents >= local))
    if bad.size:
        i = int(bad[0])
        b = int(np.searchsorted(starts, i, side="right") - 1)
        raise ValueError(
            f"{label(b, int(local[i]))} = {int(parents[i])}: a parent must satisfy -1 <= parent[i] < i "
            "(parents precede children; -1 marks a root)"
        )


def as_parents(parents: ParentsLike, name: str = "parents") -> np.ndarray:
    """Return ``parents`` as a validated 1-D int64 numpy array (raises ``ValueError``/``TypeError``)."""
    if isinstance(parents, TokenTree):
        return parents.parents
    arr = int_vector(parents, name)
    _check_parents(arr, np.array([arr.shape[0]]), lambda b, i: name if i is None else f"{name}[{i}]")
    return arr


# Up to this many nodes in a batch the two-pass Python walk beats the vector passes (a 24-node tree:
# 8 us against 34 on a Zen 4; they break even near 256 nodes): what drafting level by level encodes.
_WALK_NODES = 128


def _encode(parents: np.ndarray, sizes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(tree_order int64 [N, 2], depth int64 [N])`` of validated parent arrays laid end to end
    (tree ``b`` has ``sizes[b]`` nodes; its parents and its order are local to it)."""
    return (_encode_walk if parents.shape[0] <= _WALK_NODES else _encode_tour)(parents, sizes)


def _encode_walk(parents: np.ndarray, sizes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``_encode`` in two passes over the nodes in Python, for small batches. Parents precede their
    children, so one backward pass sums subtree sizes; a forward pass then hands each node the next
    free preorder number under its parent (children and roots arrive in ascending index, the tour's
    order) and moves that slot past the node's subtree: ``exit = enter + subtree size``."""
    order = np.empty((parents.shape[0], 2), dtype=np.int64)
    depth = np.empty(parents.shape[0], dtype=np.int64)
    start = 0
    for n in sizes.tolist():
        tree = parents[start:start + n].tolist()
        size = [1] * n
        for i in range(n - 1, 0, -1):  # node 0 is a root
            if tree[i] >= 0:
                size[tree[i]] += size[i]
        enter, level, free, next_root = [0] * n, [0] * n, [0] * n, 0
        for i, p in enumerate(tree):
            if p < 0:
                enter[i], next_root = next_root, next_root + size[i]
            else:
                enter[i], level[i] = free[p], level[p] + 1
                free[p] += size[i]
            free[i] = enter[i] + 1
        order[start:start + n, 0] = enter
        order[start:start + n, 1] = np.add(enter, size)
        depth[start:start + n] = level
        start += n
    return order, depth


def _encode_tour(parents: np.ndarray, sizes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``_encode`` in vector passes, for large batches: their cost grows with the log of the largest
    tree, not with the nodes.

    The Euler tour of a forest enters each node, tours its children in ascending index, and leaves
    it; the roots are toured in ascending index. Numbering the enter events in tour order gives the
    preorder: ``enter[u]`` is the count of enter events before "enter u", ``exit[u]`` the count before
    "leave u", and ``depth[u]`` the count of enters minus leaves before "enter u". Each event's
    successor is local (first child, next sibling, or the parent's leave), so the tour is a linked
    list, and suffix sums over a linked list take one pointer-jumping step per doubling (Wyllie).
    """
    total = parents.shape[0]
    if total == 0:
        return np.zeros((0, 2), dtype=np.int64), np.zeros(0, dtype=np.int64)
    starts = np.cumsum(sizes) - sizes
    tree = np.repeat(np.arange(sizes.shape[0]), sizes)
    # Siblings share a key: their parent's global index, or total + tree for a tree's roots. A stable
    # sort by key lists each family together in ascending index, the order the tour visits it.
    key = np.where(parents < 0, total + tree, parents + starts[tree])
    by_key = np.argsort(key, kind="stable")
    sorted_key = key[by_key]
    youngest = np.append(sorted_key[1:] != sorted_key[:-1], True)  # last of its family
    eldest = np.concatenate(([True], youngest[:-1]))

    # Events: enter u = u, leave u = total + u, and one shared end of list at 2 * total.
    end = 2 * total
    succ = np.empty(end + 1, dtype=np.int64)
    succ[:total] = np.arange(total, end)  # enter u -> leave u, for a leaf
    first_child = eldest & (sorted_key < total)
    succ[sorted_key[first_child]] = by_key[first_child]  # enter u -> enter its first child
    # leave u -> enter its next sibling; after the youngest, leave the parent (end, after a last root)
    succ[total + by_key] = np.where(youngest, np.minimum(sorted_key + total, end), np.append(by_key[1:], end))
    succ[end] = end
    # Suffix sums of two weights: enters (1 per enter event) and level (+1 per enter, -1 per leave).
    enters = np.zeros(end + 1, dtype=np.int64)
    enters[:total] = 1
    level = enters.copy()
    level[total:end] = -1
    for _ in range(int(2 * sizes.max() - 1).bit_length()):  # until 2**k covers the longest tour
        enters += enters[succ]  # now the sums over the 2**k events from each one (the end adds 0)
        level += level[succ]
        succ = succ[succ]
    n = sizes[tree]
    # Before "enter u" come enter[u] enters and depth[u] more enters than leaves; the tour sums to
    # n enters and a level of 0, and each suffix sum includes its own event.
    return np.stack([n - enters[:total], n - enters[total:end]], axis=1), -level[:total]


def encode_trees(trees: Sequence[ParentsLike], name: str = "trees") -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Validate and encode a batch of trees in one go: host ``int64`` arrays
    ``(tree_indptr [B+1], tree_order [N, 2], depth [N])``. Tree ``b`` owns rows
    ``tree_indptr[b]:tree_indptr[b+1]``; its ``(enter, exit)`` and depths are relative to it, as TVM's.

    Encode a batch with one call, not one call per tree: an encoding costs a fixed few dozen numpy
    calls (tens of microseconds) plus a little per node, so small trees are cheap only together."""
    if isinstance(trees, (torch.Tensor, np.ndarray, TokenTree)) or not isinstance(trees, Sequence):
        raise TypeError(f"{name} must be a list of parent arrays, one per request, got {type(trees).__name__}")
    arrays = [p.parents if isinstance(p, TokenTree) else int_vector(p, f"{name}[{b}]") for b, p in enumerate(trees)]
    sizes = np.fromiter(map(len, arrays), dtype=np.int64, count=len(arrays))
    parents = np.concatenate(arrays) if arrays else np.zeros(0, dtype=np.int64)
    _check_parents(parents, sizes, lambda b, i: f"{name}[{b}]" if i is None else f"{name}[{b}][{i}]")
    indptr = np.concatenate([[0], np.cumsum(sizes)])
    order, depth = _encode(parents, sizes)
    return indptr, order, depth


def order_and_depth(parents: ParentsLike, name: str = "parents") -> tuple[np.ndarray, np.ndarray]:
    """Host ``int64`` arrays ``(tree_order [n, 2], depth [n])`` of one tree (see ``encode_trees``)."""
    arr = as_parents(parents, name)
    return _encode(arr, np.array([arr.shape[0]]))


def tree_order(parents: ParentsLike) -> torch.Tensor:
    """DFS ``(enter, exit)`` per node as an ``int32 [n, 2]`` tensor, byte-identical to TVM."""
    return torch.from_numpy(order_and_depth(parents)[0].astype(np.int32))


def tree_depths(parents: ParentsLike) -> torch.Tensor:
    """Depth of every node (roots are 0) as an ``int32 [n]`` tensor."""
    return torch.from_numpy(order_and_depth(parents)[1].astype(np.int32))


def chain_order(n: int) -> np.ndarray:
    """Host ``int64`` ``tree_order [n, 2]`` of a chain (a causal append): node ``i`` enters at ``i`` and
    its subtree runs to the end."""
    return np.stack([np.arange(n), np.full(n, n)], axis=1)


def chain_chunks(n: int) -> list[tuple[int, np.ndarray]]:
    """A causal append of ``n`` rows as chains of at most ``CHAIN_CHUNK`` rows: ``(first row, chain_order)``
    per chain; each chain's rows also see every row before the chain (none when ``n`` is 0)."""
    return [(lo, chain_order(min(n, lo + CHAIN_CHUNK) - lo)) for lo in range(0, n, CHAIN_CHUNK)]


def pack_trees(trees: Sequence[ParentsLike]) -> tuple[torch.Tensor, torch.Tensor]:
    """Concatenate the trees of a batch: ``(tree_indptr int32 [B+1], tree_order int32 [N, 2])``."""
    indptr, order, _ = encode_trees(trees)
    return torch.from_numpy(indptr.astype(np.int32)), torch.from_numpy(order.astype(np.int32))


def _contains(order, enter):
    """The interval test: does the subtree of the node(s) with ``(enter, exit)`` rows ``order``
    contain the node(s) entered at ``enter``? Broadcasts; numpy or torch alike."""
    return (order[..., 0] <= enter) & (enter < order[..., 1])


def ancestor_paths(order: np.ndarray, tree_indptr: np.ndarray, nodes: np.ndarray) -> list[np.ndarray]:
    """Per tree ``b`` of a packed batch (host ``tree_order``/``tree_indptr``, every tree non-empty),
    the local indices from its root down to ``nodes[b]`` inclusive: the ancestors-or-self by the
    interval test. Ascending index is root first, since parents precede children. Unchecked."""
    tree_indptr = np.asarray(tree_indptr, dtype=np.int64)
    sizes = np.diff(tree_indptr)
    tree = np.repeat(np.arange(sizes.shape[0]), sizes)
    targets = order[tree_indptr[:-1] + np.asarray(nodes, dtype=np.int64), 0]
    on_path = np.flatnonzero(_contains(order, targets[tree]))
    counts = np.bincount(tree[on_path], minlength=sizes.shape[0])
    return np.split(on_path - tree_indptr[tree[on_path]], np.cumsum(counts)[:-1])


def path_sums(order: np.ndarray, tree_indptr: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """Per node of a packed batch, the sum of ``weights`` over its ancestors-or-self, in O(N): each
    node adds its weight over its preorder interval (a difference array), and a node's preorder
    slot lies inside exactly its ancestors-or-self intervals. Unchecked host arrays."""
    tree_indptr = np.asarray(tree_indptr, dtype=np.int64)
    base = np.repeat(tree_indptr[:-1], np.diff(tree_indptr))
    total = order.shape[0]
    delta = np.bincount(base + order[:, 0], weights, minlength=total + 1)
    delta -= np.bincount(base + order[:, 1], weights, minlength=total + 1)
    return np.cumsum(delta)[base + order[:, 0]]


def ancestor_path(order: np.ndarray, node: int) -> np.ndarray:
    """Indices from the root down to ``node`` inclusive, by the interval test on a host ``tree_order``
    (what a KV cache's commit keeps of a tree). Unchecked: ``0 <= node < len(order)``."""
    return np.flatnonzero(_contains(order, order[node, 0]))


def check_tree_order(order_host: np.ndarray, tree_starts: np.ndarray, tree_sizes: np.ndarray) -> None:
    """Each tree's ``(enter, exit)`` must be a DFS numbering: enters a permutation of ``0..n-1``,
    ``enter < exit <= n``, and intervals nested or disjoint (then they describe a forest).

    Vectorised over the whole batch (no per-request Python loop: this runs every forward step).
    Trees are laid side by side, tree ``b``'s preorder slot ``e`` at ``offset_b + e``, so one
    interval family covers the batch and intervals of different trees are disjoint.
    """
    sizes = tree_sizes.astype(np.int64)
    total = int(sizes.sum())
    if total == 0:
        return
    offsets = np.cumsum(sizes) - sizes
    owner = np.repeat(np.arange(sizes.shape[0]), sizes)  # request of every node
    rows = np.repeat(tree_starts.astype(np.int64) - offsets, sizes) + np.arange(total)
    enter, exit_, n = order_host[rows, 0], order_host[rows, 1], sizes[owner]

    def fail(node: int, what: str):
        b = int(owner[node])
        start, size = int(tree_starts[b]), int(sizes[b])
        raise ValueError(f"tree_order[{start}:{start + size}] (request {b}): {what}")

    slot = offsets[owner] + enter
    in_range = (enter >= 0) & (enter < n)
    taken = np.bincount(slot[in_range], minlength=total)
    if not in_range.all() or (taken != 1).any():
        node = int(np.argmin(in_range)) if not in_range.all() else int(np.flatnonzero(taken[slot] != 1)[0])
        fail(node, f"enter values must be a permutation of 0..{int(n[node]) - 1}")
    bad_exit = np.flatnonzero((exit_ <= enter) | (exit_ > n))
    if bad_exit.size:
        fail(int(bad_exit[0]), f"each exit must satisfy enter < exit <= tree size {int(n[bad_exit[0]])}")
    # Laminar: every interval starting strictly inside [e, x) must end by x, i.e. the largest end
    # among slots e+1 .. x-1 is <= x. Range maxima come from a sparse table (log2(max n) levels).
    lo, hi = slot + 1, offsets[owner] + exit_  # per node: the slots strictly inside its interval, [lo, hi)
    end_at = np.empty(total, dtype=np.int64)  # per slot: where the interval starting there ends
    end_at[slot] = hi
    span = hi - lo
    level = np.zeros(total, dtype=np.int64)
    has = span > 0
    level[has] = np.floor(np.log2(span[has])).astype(np.int64)
    table, worst = end_at, np.full(total, -1, dtype=np.int64)
    for k in range(int(level.max()) + 1 if has.any() else 0):
        if k:  # table[i] = max(end_at[i : i + 2**k])
            half = 1 << (k - 1)
            table = np.maximum(table[:-half], table[half:])
        sel = has & (level == k)
        worst[sel] = np.maximum(table[lo[sel]], table[hi[sel] - (1 << k)])
    crossing = np.flatnonzero(worst > hi)
    if crossing.size:
        fail(int(crossing[0]), "intervals overlap without nesting; not a DFS (enter, exit) order")


def ancestor_mask(order: torch.Tensor, *, check: bool = True) -> torch.Tensor:
    """Dense ``bool [n, n]`` mask from one tree's ``tree_order``: ``mask[u, a]`` iff ``a`` is
    ancestor-or-self of ``u``. ``check=False`` skips validating ``order`` (for callers that did)."""
    if check:
        if not isinstance(order, torch.Tensor) or order.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"order must be an int32 or int64 tensor [n, 2], got "
                            f"{order.dtype if isinstance(order, torch.Tensor) else type(order).__name__}")
        if order.dim() != 2 or order.shape[1] != 2:
            raise ValueError(f"order must have shape [n, 2] (enter, exit), got {tuple(order.shape)}")

        n = order.shape[0]
        check_tree_order(order.cpu().numpy().astype(np.int64), np.zeros(1, np.int64), np.array([n]))
    return _contains(order[None, :, :], order[:, None, 0])


class TokenTree:
    """One request's tree: the parent array plus everything derived from it (order, depth, paths).

    Build it with ``TokenTree(parents)`` or ``TokenTree.from_choices(choices)``. Immutable: the
    parents are a read-only array and the derived arrays are computed once, on first use.
    """

    def __init__(self, parents: ParentsLike, choices: tuple[tuple[int, ...], ...] | None = None):
        arr = as_parents(parents).copy()
        arr.setflags(write=False)
        self._parents = arr
        self._choices = choices

    @property
    def parents(self) -> np.ndarray:
        """Read-only ``int64 [n]``: ``parents[i]`` of node ``i``, ``-1`` at a root."""
        return self._parents

    @property
    def choices(self) -> tuple[tuple[int, ...], ...] | None:
        """For a tree built ``from_choices``: node ``i``'s path of child ranks (``()`` for the root)."""
        return self._choices

    @classmethod
    def from_choices(cls, choices: Sequence[Sequence[int]], *, root: bool = True) -> TokenTree:
        """Build a tree from Medusa/EAGLE-style choice paths, e.g. ``[(0,), (0, 0), (1,)]``.

        Each choice is a path of child ranks below the root (``(0, 1)`` = second candidate after
        the first candidate). With ``root=True`` node 0 is the root (the last verified token) and
        length-1 choices hang below it; with ``root=False`` length-1 choices are roots (a forest).
        Nodes are numbered by (depth, path), as Medusa sorts its choices, so parents precede
        children; ``tree.choices[i]`` is node ``i``'s path (``()`` for the root). Always a plain
        ``TokenTree``, whatever class it is called on.
        """
        paths = []
        for j, c in enumerate(choices):
            if isinstance(c, (str, bytes)) or not isinstance(c, Sequence):
                raise TypeError(f"choices[{j}] must be a sequence of ints, got {c!r}")
            path = tuple(as_index(x, f"choices[{j}][{i}]") for i, x in enumerate(c))
            if not path:
                raise ValueError(f"choices[{j}] is empty: the root is implicit, list only paths below it")
            if min(path) < 0:
                raise ValueError(f"choices[{j}] = {path} has a negative rank")
            paths.append(path)
        if len(set(paths)) != len(paths):
            raise ValueError("choices contains duplicate paths")
        paths.sort(key=lambda p: (len(p), p))
        ordered = ([()] if root else []) + paths
        index = {p: i for i, p in enumerate(ordered)}
        parents = []
        for p in ordered:
            if not p:
                parents.append(-1)
                continue
            up = p[:-1]
            if up and up not in index:
                raise ValueError(f"choice {p} has no parent: its prefix {up} is missing from choices")
            parents.append(index[up] if (up or root) else -1)
        return TokenTree(np.asarray(parents, dtype=np.int64), choices=tuple(ordered))

    @property
    def size(self) -> int:
        return int(self._parents.shape[0])

    def __len__(self) -> int:
        return self.size

    @cached_property
    def _encoding(self) -> tuple[np.ndarray, np.ndarray]:
        """Host ``int64`` ``(tree_order [n, 2], depth [n])``."""
        return _encode(self._parents, np.array([self.size]))

    @cached_property
    def order(self) -> torch.Tensor:
        """``int32 [n, 2]`` DFS ``(enter, exit)``, as TVM builds it."""
        return torch.from_numpy(self._encoding[0].astype(np.int32))

    @cached_property
    def depth(self) -> torch.Tensor:
        """``int32 [n]`` depth of each node (roots are 0)."""
        return torch.from_numpy(self._encoding[1].astype(np.int32))

    @property
    def is_chain(self) -> bool:
        return bool(np.all(self._parents == np.arange(-1, self.size - 1)))

    def positions(self, prefix_len: int = 0) -> torch.Tensor:
        """RoPE positions of the nodes, ``prefix_len + depth`` (``int32 [n]``); ``prefix_len`` is an
        int >= 0 (the number of tokens before the tree)."""
        prefix_len = as_index(prefix_len, "prefix_len")
        if not 0 <= prefix_len <= np.iinfo(np.int32).max - self.size:
            raise ValueError(f"prefix_len must be >= 0 and keep positions in int32, got {prefix_len}")
        return self.depth + prefix_len

    def path(self, node: int) -> list[int]:
        """Node indices from the root down to ``node`` (inclusive)."""
        node = as_index(node, "node")
        if not 0 <= node < self.size:
            raise ValueError(f"node {node} is out of range for a tree of {self.size} nodes")
        return ancestor_path(self._encoding[0], node).tolist()

    def ancestor_mask(self) -> torch.Tensor:
        """``bool [n, n]``: ``mask[u, a]`` iff ``a`` is an ancestor of ``u`` or ``u`` itself."""
        return ancestor_mask(self.order, check=False)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(size={self.size}, parents={self._parents.tolist()})"
