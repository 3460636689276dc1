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

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from ..checks import as_index, as_real, int_vector
from ..tree import TokenTree, ancestor_paths, encode_trees, path_sums

__all__ = ["DraftTree", "SamplingParams", "VerifyResult", "sample_rows", "target_probs", "verify", "verify_greedy",
           "verify_sampling"]

# How far a draft_probs row's sum may be from 1: fp32 sums of a large vocabulary round to ~1e-4,
# 16-bit rows (rounded per entry to 2**-8 relative) to ~1e-2.
_ROW_SUM_TOL = {torch.float16: 2e-2, torch.bfloat16: 2e-2}
_ROW_SUM_TOL_DEFAULT = 1e-3


class DraftTree(TokenTree):
    """One request's draft: a ``TokenTree`` with ``tokens[i]`` at node ``i``.

    ``parents[0] == -1`` (node 0 is the root = the last accepted token) and every other node has
    ``0 <= parents[i] < i``. ``draft_probs`` (optional, ``float [n, V]``) says how the tokens were
    drawn, for ``verify_sampling``: row ``i`` is the distribution node ``i``'s token was sampled from,
    *given the tree above it and its earlier siblings* (a drafter that samples siblings without
    replacement passes the renormalised remainder; one that samples them independently passes the
    same row for each). Row 0 is ignored; every other row must be a distribution (finite, >= 0,
    summing to 1 within 1e-3, 2e-2 for 16-bit rows) that gives its node's token a positive
    probability, or the lossless guarantee would not hold. ``None`` means every token was chosen
    deterministically (prompt lookup, top-k of a draft head): a point mass at the drafted token.
    """

    def __init__(self, tokens, parents, draft_probs: torch.Tensor | None = None):
        super().__init__(parents)
        parents = self.parents
        tokens = int_vector(tokens, "tokens")
        if tokens.shape != parents.shape or tokens.size == 0:
            raise ValueError(f"tokens ({tokens.shape[0]}) and parents ({parents.shape[0]}) must have the same, "
                             "non-zero length")
        if parents[0] != -1 or (parents[1:] < 0).any():
            raise ValueError("parents must describe one tree rooted at node 0: parents[0] == -1, all others >= 0")
        if (tokens < 0).any():
            i = int(np.argmax(tokens < 0))
            raise ValueError(f"tokens[{i}] = {int(tokens[i])}: tokens must be non-negative token ids")
        if draft_probs is not None:
            _check_draft_probs(draft_probs, tokens)
        tokens = tokens.copy()
        tokens.setflags(write=False)
        self._tokens = tokens
        self._draft_probs = draft_probs

    @property
    def tokens(self) -> np.ndarray:
        """Read-only ``int64 [n]`` token ids, ``tokens[0]`` the root's."""
        return self._tokens

    @property
    def draft_probs(self) -> torch.Tensor | None:
        return self._draft_probs

    @classmethod
    def root_only(cls, token: int) -> DraftTree:
        """A tree with no drafts: verification then emits exactly one token (plain decoding).

        Built without the general checks, which hold by construction: a plain serving step makes one per
        request (16 of them cost 0.3 ms through ``__init__``, a few percent of a 135M model's step)."""
        token = as_index(token, "token")
        if token < 0:
            raise ValueError(f"token = {token}: tokens must be non-negative token ids")
        tree = cls.__new__(cls)
        tree._parents, tree._choices, tree._draft_probs = _ROOT_PARENTS, None, None
        tree._tokens = np.array([token], dtype=np.int64)
        tree._tokens.setflags(write=False)
        return tree


_ROOT_PARENTS = np.array([-1], dtype=np.int64)
_ROOT_PARENTS.setflags(write=False)


def _check_draft_probs(q, tokens: np.ndarray) -> None:
    n = tokens.shape[0]
    if not isinstance(q, torch.Tensor) or not q.is_floating_point():
        raise TypeError(f"draft_probs must be a float tensor [{n}, vocab], got "
                        f"{q.dtype if isinstance(q, torch.Tensor) else type(q).__name__}")
    if q.dim() != 2 or q.shape[0] != n:
        raise ValueError(f"draft_probs must have shape [{n}, vocab] (one row per node), got {tuple(q.shape)}")
    vocab = q.shape[1]
    if (tokens >= vocab).any():
        i = int(np.argmax(tokens >= vocab))
        raise ValueError(f"tokens[{i}] = {int(tokens[i])} is outside draft_probs' vocabulary of {vocab}")
    if n == 1:
        return
    rows = q[1:].float()  # row 0 (the root's) is ignored
    at_token = rows[torch.arange(n - 1, device=q.device), torch.from_numpy(tokens[1:]).to(q.device)]
    # One host transfer for all three checks (q may live on a GPU): per row, [valid entries, sum, q(token)].
    valid, sums, at_token = torch.stack([(torch.isfinite(rows) & (rows >= 0)).all(dim=1).float(),
                                         rows.sum(dim=1), at_token]).cpu()
    bad_entries = valid == 0
    bad_sum = ~bad_entries & ((sums - 1).abs() > _ROW_SUM_TOL.get(q.dtype, _ROW_SUM_TOL_DEFAULT))
    bad_token = ~bad_entries & ~(at_token > 0)
    first = (bad_entries | bad_sum | bad_token).nonzero()
    if first.numel() == 0:
        return
    i = int(first[0])
    row = f"draft_probs[{i + 1}]"
    if bad_entries[i]:
        raise ValueError(f"{row} has a NaN, infinite or negative entry: each row must be a distribution")
    if bad_sum[i]:
        raise ValueError(f"{row} sums to {float(sums[i]):.6g}, expected 1: each row must be a distribution")
    raise ValueError(f"draft_probs[{i + 1}, tokens[{i + 1}]] = 0: node {i + 1}'s token could not have been drawn "
                     "from its row")


@dataclass(frozen=True)
class SamplingParams:
    """Target sampling: ``temperature`` (0 = greedy), ``top_k`` (0 = off), ``top_p`` (1 = off).

    Any temperature > 0 samples, however small: ``target_probs`` shifts the logits by their row
    maximum before dividing, so nothing overflows, and as the temperature tends to 0 the law tends
    to the uniform law over the row's maxima (greedy, temperature 0, takes the lowest-index one).
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "temperature", as_real(self.temperature, "temperature"))
        object.__setattr__(self, "top_k", as_index(self.top_k, "top_k"))
        object.__setattr__(self, "top_p", as_real(self.top_p, "top_p"))
        if not (self.temperature >= 0.0 and math.isfinite(self.temperature)):
            raise ValueError(f"temperature must be finite and >= 0 (0 = greedy), got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1] (1 = off), got {self.top_p}")

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
    """float32 probabilities ``[..., V]`` after temperature, top-k and top-p (nucleus) filtering.

    Top-p keeps the smallest set of most likely tokens whose mass reaches ``top_p`` (at least one).
    A drafter that samples should draw from this same function so that its ``q`` matches.
    """
    _check_params(params)
    if params.greedy:
        raise ValueError("temperature 0 is greedy decoding: use verify_greedy")
    _check_logits(logits)
    return _target_probs(logits, params)


def _target_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    x = logits.float()
    # Shift by the row maximum before dividing: (x - max) / t <= 0 cannot overflow for any t > 0
    # (a tiny t sends every non-maximal logit to -inf, the t -> 0 limit), while x / t could give inf - inf.
    x = (x - x.amax(dim=-1, keepdim=True)) / params.temperature
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


def _check_params(params) -> None:
    if not isinstance(params, SamplingParams):
        raise TypeError(f"params must be a SamplingParams (or None for greedy), got {type(params).__name__}")


def _check_logits(logits, rows: int | None = None) -> None:
    """A float tensor ``[rows, vocab]`` whose every row has a finite maximum: NaN anywhere in a row,
    +inf, or a row of only -inf leaves no well-defined target token."""
    if not isinstance(logits, torch.Tensor) or not logits.is_floating_point() or logits.dim() < 1:
        raise TypeError(f"logits must be a float tensor [nodes, vocab], got "
                        f"{logits.dtype if isinstance(logits, torch.Tensor) else type(logits).__name__}")
    if rows is not None and (logits.dim() != 2 or logits.shape[0] != rows):
        raise ValueError(f"logits has shape {tuple(logits.shape)}, expected [{rows}, vocab]: 2-D, with one row "
                         "per tree node")
    if logits.shape[-1] == 0:
        raise ValueError("logits has an empty vocabulary dimension")
    bad = ~torch.isfinite(logits.amax(dim=-1)).reshape(-1)  # amax propagates NaN
    if bool(bad.any()):
        r = int(bad.nonzero()[0])
        raise ValueError(f"logits row {r} has a NaN, a +inf or no finite entry: no target token is defined")


@dataclass(frozen=True)
class _Packed:
    """A batch of trees laid out flat (host arrays)."""

    tokens: np.ndarray  # int64 [N]
    parents: np.ndarray  # int64 [N], global indices, -1 at the roots
    indptr: np.ndarray  # int64 [B+1]: tree b is rows indptr[b]:indptr[b+1]
    order: np.ndarray  # int64 [N, 2], tree-relative (enter, exit)
    depth: np.ndarray  # int64 [N]

    @property
    def starts(self) -> np.ndarray:
        return self.indptr[:-1]


def _pack(trees: Sequence[DraftTree]) -> _Packed:
    if isinstance(trees, (TokenTree, torch.Tensor, np.ndarray, str)) or not isinstance(trees, Sequence):
        raise TypeError(f"trees must be a list of DraftTree, one per request, got {type(trees).__name__}"
                        + (": wrap a single tree in a list" if isinstance(trees, TokenTree) else ""))
    if not trees:
        raise ValueError("trees is empty: verify needs at least one request")
    for b, t in enumerate(trees):
        if not isinstance(t, DraftTree):
            raise TypeError(f"trees[{b}] must be a DraftTree, got {type(t).__name__}")
    indptr, order, depth = encode_trees(trees)
    local = np.concatenate([t.parents for t in trees])
    parents = np.where(local >= 0, local + np.repeat(indptr[:-1], np.diff(indptr)), -1)
    return _Packed(np.concatenate([t.tokens for t in trees]), parents, indptr, order, depth)


def _pack_with_logits(trees: Sequence[DraftTree], logits: torch.Tensor) -> _Packed:
    """``_pack`` plus the checks that tie the trees to the logits (rows, finiteness, vocabulary)."""
    packed = _pack(trees)
    _check_logits(logits, packed.tokens.shape[0])
    vocab = logits.shape[1]
    outside = np.flatnonzero(packed.tokens >= vocab)
    if outside.size:
        i = int(outside[0])
        b = int(np.searchsorted(packed.indptr, i, side="right") - 1)
        raise ValueError(f"trees[{b}].tokens[{i - int(packed.indptr[b])}] = {int(packed.tokens[i])} is outside "
                         f"the logits' vocabulary of {vocab}")
    return packed


def _result(packed: _Packed, leaf: np.ndarray, bonus: np.ndarray) -> VerifyResult:
    """Paths and emitted tokens from the global leaf index and bonus token of each tree."""
    paths = ancestor_paths(packed.order, packed.indptr, leaf - packed.starts)
    tokens = [packed.tokens[start + path[1:]].tolist() + [t] for path, start, t in
              zip(paths, packed.starts.tolist(), bonus.tolist())]
    return VerifyResult([p.tolist() for p in paths], tokens)


def verify_greedy(trees: Sequence[DraftTree], logits: torch.Tensor) -> VerifyResult:
    """Greedy verification of a batch of trees; ``logits [sum(sizes), V]`` in the trees' node order.

    The accepted path is the deepest node whose every ancestor-or-self (below the root) carries the
    target's argmax at its parent; among equally deep such nodes the lowest index wins (siblings
    with distinct tokens never tie). The bonus token is the argmax at that node.
    """
    packed = _pack_with_logits(trees, logits)
    total = int(packed.tokens.shape[0])
    pred = logits.argmax(dim=-1).cpu().numpy()
    is_root = packed.parents < 0
    match = is_root | (packed.tokens == pred[np.maximum(packed.parents, 0)])
    accepted = path_sums(packed.order, packed.indptr, ~match) == 0  # no mismatch from the root down
    # Deepest accepted node per tree, lowest index on ties: maximise depth * N + (N - 1 - index) >= 0.
    key = np.where(accepted, packed.depth * total + (total - 1 - np.arange(total)), -1)
    leaf = total - 1 - np.maximum.reduceat(key, packed.starts) % total
    return _result(packed, leaf, pred[leaf])


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


def sample_rows(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """One token per row of ``probs`` ``[B, V]`` (non-negative, each row with positive mass; not
    necessarily normalised), drawn by inverting the row's cumulative distribution at a uniform from
    ``generator``. On the CPU ``torch.multinomial`` draws one exponential per vocabulary entry
    (68 ms for 64 rows of SmolLM2's 49152: a fifth of a batched decoding step); this draws one
    uniform per row (1.7 ms). The sums are float64, so a token's share is its probability to ~1e-16 of
    the row's mass; a zero-probability token spans an empty interval and is never drawn."""
    cdf = torch.cumsum(probs, dim=-1, dtype=torch.float64)  # a new tensor: the caller's probs stay as they are
    total = cdf[:, -1:]
    if not bool((total > 0).all()) or not bool(total.isfinite().all()):  # no token to draw, or NaN / inf
        row = int((~((total > 0) & total.isfinite())).nonzero()[0, 0])
        raise ValueError(f"probs[{row}] must be non-negative with a positive, finite sum, got sum {float(total[row])}")
    u = torch.rand(total.shape, dtype=torch.float64, generator=generator, device=probs.device) * total
    # u < total, except that rounding can make u == total: keep it strictly below the last boundary.
    u = torch.minimum(u, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, u, right=True).squeeze(1)


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
    _check_params(params)
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(f"generator must be a torch.Generator or None, got {type(generator).__name__}")
    if params.greedy:
        return verify_greedy(trees, logits)
    packed = _pack_with_logits(trees, logits)
    device = logits.device
    total = int(packed.tokens.shape[0])
    vocab = logits.shape[1]
    for b, t in enumerate(trees):
        if t.draft_probs is not None and t.draft_probs.shape[1] != vocab:
            raise ValueError(f"trees[{b}].draft_probs has vocab {t.draft_probs.shape[1]}, logits have {vocab}")
    probs = _target_probs(logits, params)
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
            drawn = sample_rows(p[finishing], generator)
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
    return _result(packed, cur.cpu().numpy(), bonus.cpu().numpy())


def verify(trees: Sequence[DraftTree], logits: torch.Tensor, params: SamplingParams | None = None,
           generator: torch.Generator | None = None) -> VerifyResult:
    """``verify_greedy`` when ``params`` is None or has temperature 0, else ``verify_sampling``."""
    if params is not None:
        _check_params(params)
    if params is None or params.greedy:
        return verify_greedy(trees, logits)
    return verify_sampling(trees, logits, params, generator)
