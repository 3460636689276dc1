"""Verification of draft trees against the target model: greedy and lossless speculative sampling.

A draft tree (``DraftTree``) holds one token per node. Node 0 is the **root**: the last token already
accepted, whose key/value is not yet in the cache; its logits predict its children. Every other node
is a drafted continuation of its parent. The target model runs once over all nodes (tree attention),
which gives ``logits[i]``: the target's prediction for the token *after* node ``i``.

Both verifiers return, per request, the accepted root-to-leaf path and the tokens to emit: the
accepted draft tokens followed by one token chosen by the target itself (the "bonus" token), so
every verification step emits at least one token.

- ``verify_greedy``: a child is accepted iff its token is the target's argmax at its parent; the
  output equals plain greedy decoding token for token.
- ``verify_sampling``: multi-draft speculative sampling (SpecInfer's recursive rejection over the
  siblings of each node), which emits tokens distributed exactly as sampling from the target would.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from ..tree import as_parents

__all__ = ["DraftTree", "SamplingParams", "VerifyResult", "target_probs", "verify", "verify_greedy", "verify_sampling"]


@dataclass(frozen=True, eq=False)
class DraftTree:
    """One request's draft: ``tokens[i]`` at node ``i``, ``parents[i]`` its parent.

    ``parents[0] == -1`` (node 0 is the root = the last accepted token) and every other node has
    ``0 <= parents[i] < i``. ``draft_probs`` (optional, ``float [n, V]``) says how the tokens were
    drawn, for ``verify_sampling``: row ``i`` is the distribution node ``i``'s token was sampled from,
    *given the tree above it and its earlier siblings* (a drafter that samples siblings without
    replacement passes the renormalised remainder; one that samples them independently passes the
    same row for each). Row 0 is ignored. ``None`` means every token was chosen deterministically
    (prompt lookup, top-k of a draft head): a point mass at the drafted token.
    """

    tokens: np.ndarray
    parents: np.ndarray
    draft_probs: torch.Tensor | None = None

    def __post_init__(self) -> None:
        parents = as_parents(self.parents, "parents")
        tokens = np.asarray(self.tokens)
        if tokens.ndim != 1 or (tokens.size and not np.issubdtype(tokens.dtype, np.integer)):
            raise TypeError(f"tokens must be a 1-D integer array, got {tokens.dtype} of shape {tokens.shape}")
        tokens = tokens.astype(np.int64, copy=False)
        if tokens.shape != parents.shape or tokens.size == 0:
            raise ValueError(f"tokens ({tokens.shape[0]}) and parents ({parents.shape[0]}) must have the same, "
                             "non-zero length")
        if parents[0] != -1 or (parents[1:] < 0).any():
            raise ValueError("parents must describe one tree rooted at node 0: parents[0] == -1, all others >= 0")
        if (tokens < 0).any():
            raise ValueError("tokens must be non-negative token ids")
        if self.draft_probs is not None:
            q = self.draft_probs
            if not isinstance(q, torch.Tensor) or not q.is_floating_point() or q.dim() != 2 or q.shape[0] != tokens.size:
                raise ValueError(f"draft_probs must be a float tensor of shape [{tokens.size}, vocab]")
        tokens.setflags(write=False)
        parents.setflags(write=False)
        object.__setattr__(self, "tokens", tokens)
        object.__setattr__(self, "parents", parents)

    @classmethod
    def root_only(cls, token: int) -> DraftTree:
        """A tree with no drafts: verification then emits exactly one token (plain decoding)."""
        return cls(np.array([token], dtype=np.int64), np.array([-1], dtype=np.int64))

    @property
    def size(self) -> int:
        return int(self.tokens.shape[0])

    def __len__(self) -> int:
        return self.size

    def path(self, node: int) -> list[int]:
        """Node indices from the root to ``node``, inclusive."""
        out = []
        while node >= 0:
            out.append(node)
            node = int(self.parents[node])
        return out[::-1]


@dataclass(frozen=True)
class SamplingParams:
    """Target sampling: ``temperature`` (0 = greedy), ``top_k`` (0 = off), ``top_p`` (1 = off)."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self) -> None:
        if not (self.temperature >= 0.0 and np.isfinite(self.temperature)):
            raise ValueError(f"temperature must be finite and >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass(frozen=True)
class VerifyResult:
    """Per request: ``paths[b]`` accepted node indices (root first), ``tokens[b]`` tokens to emit
    (the accepted drafts, then the bonus token; ``len(tokens[b]) == len(paths[b])``)."""

    paths: list[list[int]]
    tokens: list[list[int]]

    @property
    def leaf_indices(self) -> list[int]:
        """Last accepted node of each tree (what ``PagedKVCache.commit_accepted`` takes)."""
        return [p[-1] for p in self.paths]

    @property
    def num_accepted_drafts(self) -> list[int]:
        return [len(p) - 1 for p in self.paths]


def target_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """float32 probabilities ``[N, V]`` after temperature, top-k and top-p (nucleus) filtering.

    Top-p keeps the smallest set of most likely tokens whose mass reaches ``top_p`` (at least one).
    A drafter that samples should draw from this same function so that its ``q`` matches.
    """
    if params.greedy:
        raise ValueError("temperature 0 is greedy decoding: use verify_greedy")
    x = logits.float() / params.temperature
    if params.top_k and params.top_k < x.shape[-1]:
        kth = torch.topk(x, params.top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_x, order = torch.sort(x, dim=-1, descending=True)
        sorted_p = torch.softmax(sorted_x, dim=-1)
        mass_before = torch.cumsum(sorted_p, dim=-1) - sorted_p
        drop_sorted = mass_before >= params.top_p  # the token that crosses top_p is kept
        x = x.masked_fill(torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted), float("-inf"))
    return torch.softmax(x, dim=-1)


@dataclass(frozen=True)
class _Packed:
    """A batch of trees laid out flat (host arrays): parents as global indices, -1 at roots."""

    tokens: np.ndarray  # int64 [N]
    parents: np.ndarray  # int64 [N], global
    sizes: np.ndarray  # int64 [B]
    starts: np.ndarray  # int64 [B]
    depth: np.ndarray  # int64 [N]
    max_depth: int


def _pack(trees: Sequence[DraftTree]) -> _Packed:
    if not trees:
        raise ValueError("trees is empty: verify needs at least one request")
    for b, t in enumerate(trees):
        if not isinstance(t, DraftTree):
            raise TypeError(f"trees[{b}] must be a DraftTree, got {type(t).__name__}")
    sizes = np.fromiter((t.size for t in trees), dtype=np.int64, count=len(trees))
    starts = np.cumsum(sizes) - sizes
    tokens = np.concatenate([t.tokens for t in trees])
    local = np.concatenate([t.parents for t in trees])
    parents = np.where(local >= 0, local + np.repeat(starts, sizes), -1)
    has_parent = parents >= 0
    up = np.where(has_parent, parents, 0)
    depth = np.zeros(tokens.size, dtype=np.int64)
    while True:  # one sweep per tree level: depth = parent's depth + 1 until nothing changes
        new = np.where(has_parent, depth[up] + 1, 0)
        if np.array_equal(new, depth):
            break
        depth = new
    return _Packed(tokens, parents, sizes, starts, depth, int(depth.max()))


def _result(trees: Sequence[DraftTree], packed: _Packed, leaf: torch.Tensor, bonus: torch.Tensor) -> VerifyResult:
    """Paths and emitted tokens from the global leaf index and bonus token of each tree."""
    leaf_host, bonus_host = leaf.cpu().numpy(), bonus.cpu().numpy().tolist()
    # Climb from every leaf at once: column j holds the ancestor j levels up (-1 above the root).
    climb = [leaf_host]
    for _ in range(packed.max_depth):
        prev = climb[-1]
        climb.append(np.where(prev >= 0, packed.parents[np.maximum(prev, 0)], -1))
    ancestors = np.stack(climb, axis=1)[:, ::-1]  # root first, -1 padding on the left
    local = (ancestors - packed.starts[:, None]).tolist()
    toks = packed.tokens[np.maximum(ancestors, 0)].tolist()
    root_column = (packed.max_depth - packed.depth[leaf_host]).tolist()
    paths = [row[c:] for row, c in zip(local, root_column)]
    tokens = [row[c + 1:] + [t] for row, c, t in zip(toks, root_column, bonus_host)]
    return VerifyResult(paths, tokens)


def _check_logits(logits: torch.Tensor, total: int) -> None:
    if not isinstance(logits, torch.Tensor) or not logits.is_floating_point() or logits.dim() != 2:
        raise TypeError("logits must be a float tensor [total_nodes, vocab]")
    if logits.shape[0] != total:
        raise ValueError(f"logits has {logits.shape[0]} rows, expected one per tree node ({total})")


def verify_greedy(trees: Sequence[DraftTree], logits: torch.Tensor) -> VerifyResult:
    """Greedy verification of a batch of trees; ``logits [sum(sizes), V]`` in the trees' node order.

    The accepted path is the deepest node whose every ancestor-or-self (below the root) carries the
    target's argmax at its parent; among equally deep such nodes the lowest index wins (siblings
    with distinct tokens never tie). The bonus token is the argmax at that node.
    """
    packed = _pack(trees)
    total = int(packed.tokens.shape[0])
    _check_logits(logits, total)
    device = logits.device
    pred = logits.argmax(dim=-1)
    parents = torch.from_numpy(packed.parents).to(device)
    is_root = parents < 0
    up = parents.clamp(min=0)
    match = is_root | (torch.from_numpy(packed.tokens).to(device) == pred[up])
    ok = match
    for _ in range(packed.max_depth):  # a node is accepted iff it matches and its parent is accepted
        ok = match & (is_root | ok[up])
    # Deepest accepted node per tree, lowest index on ties: maximise depth * N + (N - 1 - index) >= 0.
    index = torch.arange(total, device=device)
    key = torch.where(ok, torch.from_numpy(packed.depth).to(device) * total + (total - 1 - index), -1)
    seg = torch.from_numpy(np.repeat(np.arange(len(trees)), packed.sizes)).to(device)
    best = torch.full((len(trees),), -1, dtype=key.dtype, device=device).scatter_reduce(0, seg, key, "amax")
    leaf = total - 1 - best % total
    return _result(trees, packed, leaf, pred[leaf])


def _children_table(packed: _Packed) -> np.ndarray:
    """``[N + 1, max_children]`` global child indices in sibling (index) order, padded with -1.

    The extra last row (all -1) lets "no child" states index the table safely.
    """
    total = packed.tokens.size
    kids = np.nonzero(packed.parents >= 0)[0]
    owner = packed.parents[kids]
    order = np.argsort(owner, kind="stable")  # stable: siblings stay in index order
    kids, owner = kids[order], owner[order]
    first = np.searchsorted(owner, owner, side="left")
    rank = np.arange(kids.size) - first
    width = int(rank.max()) + 1 if kids.size else 1
    table = np.full((total + 1, width), -1, dtype=np.int64)
    table[owner, rank] = kids
    return table


def verify_sampling(trees: Sequence[DraftTree], logits: torch.Tensor, params: SamplingParams,
                    generator: torch.Generator | None = None) -> VerifyResult:
    """Lossless multi-draft speculative sampling over a batch of trees (SpecInfer's recursive rejection).

    Walking down from the root with ``p`` = the target distribution at the current node, the
    children are tried in index order: child token ``x`` drawn from ``q`` (its ``draft_probs`` row,
    or a point mass) is accepted with probability ``min(1, p(x) / q(x))``; then the walk moves to
    that child with ``p`` = the target distribution there. On rejection ``p`` becomes the residual
    ``norm(max(p - q, 0))`` and the next sibling is tried. When no child is left, the emitted token
    is drawn from ``p``. Each step leaves the emitted token distributed as ``p`` exactly, so the
    output follows the target distribution whatever the drafts are. For point masses this is:
    accept ``x`` with probability ``p(x)``, else remove ``x`` from ``p`` and renormalise.

    All random draws come from ``generator``: a fixed seed reproduces the output.
    """
    if params.greedy:
        return verify_greedy(trees, logits)
    device = logits.device
    packed = _pack(trees)
    total = int(packed.tokens.shape[0])
    _check_logits(logits, total)
    vocab = logits.shape[1]
    for b, t in enumerate(trees):
        if t.draft_probs is not None and t.draft_probs.shape[1] != vocab:
            raise ValueError(f"trees[{b}].draft_probs has vocab {t.draft_probs.shape[1]}, logits have {vocab}")
    probs = target_probs(logits, params)
    point_mass = all(t.draft_probs is None for t in trees)
    if not point_mass:  # rows of one-hots where a tree was drafted deterministically
        draft_q = torch.nn.functional.one_hot(torch.from_numpy(packed.tokens).to(device), vocab).float()
        for t, s in zip(trees, packed.starts.tolist()):
            if t.draft_probs is not None:
                draft_q[s:s + t.size] = t.draft_probs.to(device=device, dtype=torch.float32)
    children = torch.from_numpy(_children_table(packed)).to(device)
    tokens_ext = torch.from_numpy(np.append(packed.tokens, 0)).to(device)

    batch = len(trees)
    rows = torch.arange(batch, device=device)
    cur = torch.from_numpy(packed.starts).to(device)
    rank = torch.zeros(batch, dtype=torch.int64, device=device)
    p = probs[cur].clone()
    done = torch.zeros(batch, dtype=torch.bool, device=device)
    bonus = torch.zeros(batch, dtype=torch.int64, device=device)
    # Each round every unfinished request tries one sibling or finishes: at most N + B rounds.
    while True:
        child = torch.where(rank < children.shape[1], children[cur, rank.clamp(max=children.shape[1] - 1)], -1)
        child = torch.where(done, -1, child)
        finishing = ~done & (child < 0)
        if bool(finishing.any()):
            drawn = torch.multinomial(p[finishing], 1, generator=generator).squeeze(1)
            bonus[finishing] = drawn
            done = done | finishing
        trying = child >= 0
        if not bool(trying.any()):
            break
        child_safe = torch.where(trying, child, total)
        x = tokens_ext[child_safe]
        px = p[rows, x]
        qx = torch.ones_like(px) if point_mass else draft_q[child_safe.clamp(max=total - 1), x]
        u = torch.rand(batch, generator=generator, device=device)
        accept = trying & (u * qx < px)  # u < p(x) / q(x), without dividing by a zero q(x)
        reject = trying & ~accept
        if bool(accept.any()):
            cur = torch.where(accept, child_safe, cur)
            rank = torch.where(accept, 0, rank)
            p = torch.where(accept[:, None], probs[cur], p)
        if bool(reject.any()):
            if point_mass:
                residual = p.scatter(1, x[:, None], 0.0)
            else:
                residual = (p - draft_q[child_safe.clamp(max=total - 1)]).clamp_(min=0.0)
            mass = residual.sum(dim=1, keepdim=True)
            # mass > 0 whenever a rejection can happen; the guard only absorbs fp32 round-off.
            residual = torch.where(mass > 0, residual / mass.clamp(min=1e-30), p)
            p = torch.where(reject[:, None], residual, p)
            rank = torch.where(reject, rank + 1, rank)
    return _result(trees, packed, cur, bonus)


def verify(trees: Sequence[DraftTree], logits: torch.Tensor, params: SamplingParams | None = None,
           generator: torch.Generator | None = None) -> VerifyResult:
    """``verify_greedy`` when ``params`` is None or has temperature 0, else ``verify_sampling``."""
    if params is None or params.greedy:
        return verify_greedy(trees, logits)
    return verify_sampling(trees, logits, params, generator)
