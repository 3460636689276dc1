"""Drafters: propose a tree of candidate continuations for each sequence.

A drafter is anything with ``propose(contexts, hidden=None) -> list[DraftTree]`` (the ``Drafter``
protocol): ``contexts[b]`` is every token of sequence ``b`` so far (prompt and output; the last one
is the root of the tree to build, accepted but not yet run through the target), ``hidden[b]`` the
target's final hidden state at the position that predicted that root (what Medusa/EAGLE-style heads
read; ``None`` when the caller has none). Trees are verified by ``treeattn.speculative.verify``.

- ``NGramDrafter``: model-free prompt lookup that builds a tree from every place the current suffix
  occurred before, ranked by match length and frequency, merged by common prefix, within a budget.
- ``StaticTreeDrafter``: a fixed Medusa/EAGLE tree shape (``TokenTree.from_choices``) filled with
  the top-k candidates of a ``CandidateSource``, e.g. ``MedusaHeads``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import numpy as np
import torch
from torch import nn

from ..tree import TokenTree
from .adaptive import Candidates
from .verify import DraftTree

__all__ = ["CandidateSource", "Drafter", "MedusaHeads", "NGramDrafter", "StaticTreeDrafter", "as_context",
           "lookup_bucket"]


@runtime_checkable
class Drafter(Protocol):
    def propose(self, contexts: Sequence[np.ndarray], hidden: torch.Tensor | None = None) -> list[DraftTree]:
        """One ``DraftTree`` per context; ``tree.tokens[0]`` must be the context's last token."""
        ...


def as_context(tokens, name: str = "context") -> np.ndarray:
    """A non-empty 1-D int64 token array."""
    arr = np.asarray(tokens)
    if arr.ndim != 1 or arr.size == 0 or not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"{name} must be a non-empty 1-D sequence of token ids, got shape {arr.shape} ({arr.dtype})")
    return arr.astype(np.int64, copy=False)


class NGramDrafter:
    """Prompt-lookup tree drafter: continuations of earlier occurrences of the current suffix.

    Every earlier position ``e`` whose tokens ``context[e-m+1 : e+1]`` equal the last ``m`` tokens
    (``min_ngram <= m <= max_ngram``, ``m`` as long as possible) proposes the ``max_depth`` tokens
    that followed it. The ``max_matches`` best occurrences (longest match, then most recent) are
    merged into a trie; an occurrence weighs ``(max_matches + 1) ** m``, so one longer match
    outweighs any number of shorter ones (a longer match is far more reliable) and, among equally
    long matches, frequency decides.
    A node scores the weight of the occurrences through it times ``depth_decay ** depth``, which
    never grows down a path, so keeping the ``budget - 1`` best nodes (ties: shallower, then
    earlier) always leaves a connected tree. Siblings come best first, the order in which sampling
    verification tries them. ``budget`` counts the root: ``budget=1`` drafts nothing.
    Deterministic: the tree is a function of the context alone.
    """

    def __init__(self, budget: int = 16, *, max_ngram: int = 4, min_ngram: int = 1, max_depth: int = 12,
                 max_matches: int = 16, depth_decay: float = 0.9):
        for name, value, low in (("budget", budget, 1), ("max_ngram", max_ngram, 1), ("min_ngram", min_ngram, 1),
                                 ("max_depth", max_depth, 1), ("max_matches", max_matches, 1)):
            if not isinstance(value, (int, np.integer)) or value < low:
                raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
        if min_ngram > max_ngram:
            raise ValueError(f"min_ngram ({min_ngram}) must be <= max_ngram ({max_ngram})")
        if not 0.0 < depth_decay <= 1.0:
            raise ValueError(f"depth_decay must be in (0, 1], got {depth_decay}")
        self.budget, self.max_ngram, self.min_ngram = int(budget), int(max_ngram), int(min_ngram)
        self.max_depth, self.max_matches, self.depth_decay = int(max_depth), int(max_matches), float(depth_decay)

    def __repr__(self) -> str:
        return (f"NGramDrafter(budget={self.budget}, max_ngram={self.max_ngram}, min_ngram={self.min_ngram}, "
                f"max_depth={self.max_depth}, max_matches={self.max_matches}, depth_decay={self.depth_decay})")

    def propose(self, contexts: Sequence[np.ndarray], hidden: torch.Tensor | None = None) -> list[DraftTree]:
        return [self.draft(c) for c in contexts]

    def occurrences(self, context: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """End positions of earlier occurrences of the suffix and their match lengths, best first."""
        c = as_context(context)
        n = c.size
        if n < 2 or self.budget == 1:
            return np.zeros(0, np.int64), np.zeros(0, np.int64)
        ends = np.arange(n - 1)  # candidate end positions, before the suffix's own last token
        match_len = np.zeros(n - 1, dtype=np.int64)
        alive = np.ones(n - 1, dtype=bool)
        for k in range(min(self.max_ngram, n - 1)):  # extend each match backwards one token at a time
            pos = ends - k
            alive &= pos >= 0
            alive[alive] &= c[pos[alive]] == c[n - 1 - k]
            match_len += alive
            if not alive.any():
                break
        keep = np.nonzero(match_len >= self.min_ngram)[0]
        order = np.lexsort((-ends[keep], -match_len[keep]))[: self.max_matches]  # longest, then most recent
        return ends[keep][order], match_len[keep][order]

    def draft(self, context) -> DraftTree:
        return self._draft(as_context(context)).tree

    def candidates(self, contexts: Sequence[np.ndarray], hidden: torch.Tensor | None = None) -> list[Candidates]:
        """``ScoringDrafter``: the ``draft`` trees, scored for ``AdaptiveDrafter``."""
        return [self._draft(as_context(c, f"contexts[{b}]")) for b, c in enumerate(contexts)]

    def _draft(self, c: np.ndarray) -> Candidates:
        root_token = int(c[-1])
        ends, lengths = self.occurrences(c)
        if ends.size == 0:
            return Candidates.root_only(root_token)
        # Trie over continuations: node -> {token: child}, plus accumulated weight, occurrences
        # through the node, their longest match, and depth.
        kids: list[dict[int, int]] = [{}]
        weight, count, longest, depth, token, parent = [0.0], [0], [0], [0], [root_token], [-1]
        tokens = c.tolist()
        base = float(self.max_matches + 1)
        for e, m in zip(ends.tolist(), lengths.tolist()):
            w = base ** m
            node = 0
            weight[0] += w
            count[0] += 1
            for t in tokens[e + 1: e + 1 + self.max_depth]:
                nxt = kids[node].get(t)
                if nxt is None:
                    nxt = len(weight)
                    kids[node][t] = nxt
                    kids.append({})
                    weight.append(0.0)
                    count.append(0)
                    longest.append(0)
                    depth.append(depth[node] + 1)
                    token.append(t)
                    parent.append(node)
                weight[nxt] += w
                count[nxt] += 1
                longest[nxt] = max(longest[nxt], m)
                node = nxt
        n = len(weight)
        if n == 1:
            return Candidates.root_only(root_token)
        d = np.asarray(depth[1:], dtype=np.float64)
        score = np.asarray(weight[1:]) * self.depth_decay ** d
        # Best budget-1 nodes: a parent never scores below its child and ties go to the shallower
        # one, so every kept node's parent is kept and ranked earlier: ranks are a valid numbering.
        ranked = (np.lexsort((np.arange(1, n), d, -score))[: self.budget - 1] + 1).tolist()
        new_index = {0: 0}
        for i, trie_node in enumerate(ranked, start=1):
            new_index[trie_node] = i
        parents = np.array([-1] + [new_index[parent[t]] for t in ranked], dtype=np.int64)
        toks = np.array([root_token] + [token[t] for t in ranked], dtype=np.int64)
        keys, prior = np.zeros(len(toks), np.int64), np.ones(len(toks))
        for i, t in enumerate(ranked, start=1):
            keys[i], prior[i] = lookup_bucket(longest[t], weight[t] / weight[parent[t]], count[parent[t]])
        return Candidates(DraftTree(toks, parents), keys, prior)


def lookup_bucket(match_len: int, share: float, support: int) -> tuple[int, float]:
    """Calibration bucket and prior of an edge drafted by prompt lookup, from how long the matched
    suffix was, the edge's share among its siblings and how many occurrences back its parent. The
    prior (a longer match is more reliable, a one-off continuation is a guess) only matters until
    the bucket has observations (``adaptive.Calibrator``)."""
    m = min(int(match_len), 6)
    share_bin = min(int(share * 4), 3)
    support_bin = 0 if support <= 1 else 1 if support <= 3 else 2
    prior = share * m / (m + 2.0) * (0.6 if support <= 1 else 0.8 if support <= 3 else 1.0)
    return m * 100 + share_bin * 10 + support_bin, prior


@runtime_checkable
class CandidateSource(Protocol):
    def candidates(self, contexts: Sequence[np.ndarray], hidden: torch.Tensor | None, num_heads: int,
                   k: int) -> torch.Tensor:
        """``int64 [B, num_heads, k]``: head ``j``'s ``k`` best guesses for the token ``j + 1``
        positions after each root, best first."""
        ...


class StaticTreeDrafter:
    """A fixed tree shape (Medusa/EAGLE choice paths) filled from a ``CandidateSource``.

    ``choices`` are paths of ranks below the root: node ``(r1, ..., rj)`` gets the ``rj``-th
    candidate of head ``j - 1`` (so ``(0, 1)`` = head 0's best guess, then head 1's second best),
    exactly Medusa's construction. The shape is ``TokenTree.from_choices(choices)``.
    """

    def __init__(self, choices: Sequence[Sequence[int]], source: CandidateSource):
        if not isinstance(source, CandidateSource):
            raise TypeError("source must implement candidates(contexts, hidden, num_heads, k)")
        self.tree = TokenTree.from_choices(choices)
        paths = self.tree.choices[1:]
        self.num_heads = max(len(p) for p in paths)
        self.top_k = max(max(p) for p in paths) + 1
        self.source = source
        self._head = torch.tensor([len(p) - 1 for p in paths], dtype=torch.int64)
        self._rank = torch.tensor([p[-1] for p in paths], dtype=torch.int64)

    def propose(self, contexts: Sequence[np.ndarray], hidden: torch.Tensor | None = None) -> list[DraftTree]:
        contexts = [as_context(c, f"contexts[{b}]") for b, c in enumerate(contexts)]
        cands = self.source.candidates(contexts, hidden, self.num_heads, self.top_k)
        expected = (len(contexts), self.num_heads, self.top_k)
        if tuple(cands.shape) != expected:
            raise ValueError(f"candidate source returned shape {tuple(cands.shape)}, expected {expected}")
        filled = cands.cpu()[:, self._head, self._rank].numpy()  # [B, n - 1]
        return [DraftTree(np.concatenate([[int(c[-1])], filled[b]]), self.tree.parents)
                for b, c in enumerate(contexts)]


class _ResBlock(nn.Module):
    def __init__(self, hidden_size: int):
        super().__init__()
        self.linear = nn.Linear(hidden_size, hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + nn.functional.silu(self.linear(x))


class MedusaHeads(nn.Module):
    """Medusa draft heads: head ``j`` = ``num_layers`` residual SiLU blocks then a vocab projection,
    reading the target's last hidden state and guessing the token ``j + 1`` positions after the root.

    Parameter names follow the Medusa reference checkpoints (``medusa_head.{j}.{layer}.linear.*``,
    ``medusa_head.{j}.{num_layers}.weight``) so their state dicts load with ``load_state_dict``.
    """

    def __init__(self, hidden_size: int, vocab_size: int, num_heads: int = 4, num_layers: int = 1):
        super().__init__()
        self.medusa_head = nn.ModuleList(
            nn.Sequential(*[_ResBlock(hidden_size) for _ in range(num_layers)],
                          nn.Linear(hidden_size, vocab_size, bias=False))
            for _ in range(num_heads))

    @torch.inference_mode()
    def candidates(self, contexts, hidden, num_heads, k):
        if hidden is None:
            raise ValueError("MedusaHeads needs the target's hidden states (hidden=[B, hidden_size])")
        if num_heads > len(self.medusa_head):
            raise ValueError(f"the tree needs {num_heads} heads, only {len(self.medusa_head)} exist")
        w = self.medusa_head[0][-1].weight
        h = hidden.to(device=w.device, dtype=w.dtype)
        return torch.stack([torch.topk(self.medusa_head[j](h), k, dim=-1).indices for j in range(num_heads)], dim=1)
