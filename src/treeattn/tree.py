"""Token trees: parent arrays, TVM's DFS ``(enter, exit)`` encoding, depths, paths, masks.

A request's draft tree is a parent array ``parents[i]`` with ``-1 <= parents[i] < i`` (several
``-1`` entries make a forest). Nodes are numbered so that a parent always precedes its children,
which is what lets every function here run in one forward or backward sweep.

The kernels never see the parent array: they see ``tree_order[i] = (enter[i], exit[i])``, the
preorder number of node ``i`` and one past the last preorder number of its subtree, so that
"``a`` is an ancestor-or-self of ``u``" is the interval test ``enter[a] <= enter[u] < exit[a]``.
Children and roots are visited in ascending node index, which makes the arrays byte-identical to
the ones TVM's runtime builds.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np
import torch

MAX_TREE_SIZE = 4096  # generous; TVM's runtime caps an accumulated tree at 256 nodes

ParentsLike = Sequence[int] | np.ndarray | torch.Tensor


def as_parents(parents: ParentsLike, name: str = "parents") -> np.ndarray:
    """Return ``parents`` as a validated 1-D int64 numpy array (raises ``ValueError``/``TypeError``)."""
    if isinstance(parents, torch.Tensor):
        if parents.is_floating_point() or parents.is_complex() or parents.dtype == torch.bool:
            raise TypeError(f"{name} must hold integers, got dtype {parents.dtype}")
        arr = parents.detach().cpu().numpy()
    else:
        arr = np.asarray(parents)
        if arr.size == 0:
            arr = arr.astype(np.int64)
        elif not np.issubdtype(arr.dtype, np.integer):
            raise TypeError(f"{name} must hold integers, got {arr.dtype}")
    if arr.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape {tuple(arr.shape)}")
    arr = arr.astype(np.int64, copy=False)
    n = arr.shape[0]
    if n > MAX_TREE_SIZE:
        raise ValueError(f"{name} has {n} nodes; at most {MAX_TREE_SIZE} are supported")
    bad = np.nonzero((arr < -1) | (arr >= np.arange(n)))[0]
    if bad.size:
        i = int(bad[0])
        raise ValueError(
            f"{name}[{i}] = {int(arr[i])}: a parent must satisfy -1 <= parent[i] < i "
            "(parents precede children; -1 marks a root)"
        )
    return arr


def _dfs_arrays(parents: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Preorder enter numbers, subtree sizes and depths of validated parents (children and roots
    in ascending index), in one backward and one forward sweep."""
    n = len(parents)
    plist = parents.tolist()
    size = [1] * n
    for i in range(n - 1, 0, -1):  # children come after parents: a backward sweep sums subtrees
        p = plist[i]
        if p >= 0:
            size[p] += size[i]
    enter = [0] * n
    depth = [0] * n
    next_slot = [0] * n  # next free preorder number below each node
    next_root = 0
    for i in range(n):  # ascending index visits each node's children in ascending order
        p = plist[i]
        if p < 0:
            e = next_root
            next_root += size[i]
        else:
            e = next_slot[p]
            next_slot[p] += size[i]
            depth[i] = depth[p] + 1
        enter[i] = e
        next_slot[i] = e + 1
    return (np.asarray(enter, dtype=np.int64), np.asarray(size, dtype=np.int64),
            np.asarray(depth, dtype=np.int64))


def order_and_depth(parents: ParentsLike, name: str = "parents") -> tuple[np.ndarray, np.ndarray]:
    """Host ``int64`` arrays ``(tree_order [n, 2], depth [n])`` from one validation and one pair of
    sweeps: what the KV cache needs every forward, without building tensors it would convert back."""
    enter, size, depth = _dfs_arrays(as_parents(parents, name))
    return np.stack([enter, enter + size], axis=1), depth


def tree_order(parents: ParentsLike) -> torch.Tensor:
    """DFS ``(enter, exit)`` per node as an ``int32 [n, 2]`` tensor, byte-identical to TVM."""
    return torch.from_numpy(order_and_depth(parents)[0].astype(np.int32))


def tree_depths(parents: ParentsLike) -> torch.Tensor:
    """Depth of every node (roots are 0) as an ``int32 [n]`` tensor."""
    return torch.from_numpy(order_and_depth(parents)[1].astype(np.int32))


def pack_trees(trees: Sequence[ParentsLike]) -> tuple[torch.Tensor, torch.Tensor]:
    """Concatenate the trees of a batch: ``(tree_indptr int32 [B+1], tree_order int32 [N, 2])``."""
    if isinstance(trees, (torch.Tensor, np.ndarray)) or not isinstance(trees, Sequence):
        raise TypeError("pack_trees expects a list of parent arrays, one per request")
    orders = []
    for b, parents in enumerate(trees):
        orders.append(tree_order(as_parents(parents, name=f"trees[{b}]")))
    sizes = [o.shape[0] for o in orders]
    indptr = torch.tensor([0, *np.cumsum(sizes, dtype=np.int64).tolist()], dtype=torch.int32)
    order = torch.cat(orders) if orders else torch.zeros(0, 2, dtype=torch.int32)
    return indptr, order.reshape(-1, 2)


def ancestor_mask(order: torch.Tensor) -> torch.Tensor:
    """Dense ``bool [n, n]`` mask from a ``tree_order``: ``mask[u, a]`` iff ``a`` is ancestor-or-self of ``u``."""
    enter, exit_ = order[:, 0].long(), order[:, 1].long()
    return (enter[None, :] <= enter[:, None]) & (enter[:, None] < exit_[None, :])


@dataclass(frozen=True, eq=False)
class TokenTree:
    """One request's draft tree: the parent array plus everything derived from it.

    Build it with ``TokenTree(parents)`` or ``TokenTree.from_choices(choices)``.
    """

    parents: np.ndarray
    choices: tuple[tuple[int, ...], ...] | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "parents", as_parents(self.parents))
        self.parents.setflags(write=False)

    @classmethod
    def from_choices(cls, choices: Sequence[Sequence[int]], *, root: bool = True) -> TokenTree:
        """Build a tree from Medusa/EAGLE-style choice paths, e.g. ``[(0,), (0, 0), (1,)]``.

        Each choice is a path of child ranks below the root (``(0, 1)`` = second candidate after
        the first candidate). With ``root=True`` node 0 is the root (the last verified token) and
        length-1 choices hang below it; with ``root=False`` length-1 choices are roots (a forest).
        Nodes are numbered by (depth, path), as Medusa sorts its choices, so parents precede
        children; ``tree.choices[i]`` is node ``i``'s path (``()`` for the root).
        """
        paths = []
        for j, c in enumerate(choices):
            try:
                path = tuple(int(x) for x in c)
            except TypeError as exc:
                raise TypeError(f"choices[{j}] must be a sequence of ints, got {c!r}") from exc
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
        return cls(np.asarray(parents, dtype=np.int64), choices=tuple(ordered))

    @property
    def size(self) -> int:
        return int(self.parents.shape[0])

    def __len__(self) -> int:
        return self.size

    @cached_property
    def order(self) -> torch.Tensor:
        """``int32 [n, 2]`` DFS ``(enter, exit)``, as TVM builds it."""
        return tree_order(self.parents)

    @cached_property
    def depth(self) -> torch.Tensor:
        """``int32 [n]`` depth of each node (roots are 0)."""
        return tree_depths(self.parents)

    @property
    def is_chain(self) -> bool:
        return bool(np.all(self.parents == np.arange(-1, self.size - 1)))

    def positions(self, prefix_len: int = 0) -> torch.Tensor:
        """RoPE positions of the nodes, ``prefix_len + depth`` (``int32 [n]``)."""
        return self.depth + int(prefix_len)

    def path(self, node: int) -> list[int]:
        """Node indices from the root down to ``node`` (inclusive)."""
        if not 0 <= node < self.size:
            raise ValueError(f"node {node} is out of range for a tree of {self.size} nodes")
        out = []
        while node >= 0:
            out.append(node)
            node = int(self.parents[node])
        return out[::-1]

    def ancestor_mask(self) -> torch.Tensor:
        """``bool [n, n]``: ``mask[u, a]`` iff ``a`` is an ancestor of ``u`` or ``u`` itself."""
        return ancestor_mask(self.order)

    def __repr__(self) -> str:
        return f"TokenTree(size={self.size}, parents={self.parents.tolist()})"
