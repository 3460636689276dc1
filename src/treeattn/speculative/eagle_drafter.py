"""``EagleDrafter``: EAGLE-2 dynamic trees drafted by a published EAGLE-3 or EAGLE-1/2 head.

Per request the drafter keeps one sequence of the head's ``HeadKVCache``: row ``p`` holds the
target's features of position ``p`` paired with the token at ``p + 1``. Each call it first appends
the rows of the positions accepted since the last call (``TargetFeatures`` from the runner: the head
reads the target's aux-layer states for EAGLE-3, its final-norm hidden states for EAGLE-1/2), then
drafts level by level: the last context row's output scores the root's children, the ``width`` best
nodes by path probability are appended as tree nodes (each reading its parent's state) and score
their own children, and so on for ``depth`` levels. Every guessed node is a candidate; the tree is
the ``budget`` best, scored for ``AdaptiveDrafter`` like ``HeadDrafter``'s.

Request state is keyed by the runner's request names (``TargetFeatures.seq_ids``) and freed once a
request is no longer ``live``. It is only a cache: the tokens its rows were built from are kept, and
a context that does not extend them is rebuilt from its features, so drafts never depend on what
the drafter saw before (and drafts only ever change speed, never the output).
"""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from ..packed_linear import pack_linears
from .adaptive import Candidates
from .drafters import as_context
from .eagle import Eagle3Head, EagleHead
from .features import FINAL, TargetFeatures
from .heads import Drafted, best_candidates, expand_frontier
from .verify import DraftTree

__all__ = ["EagleDrafter"]


@dataclass
class _Request:
    tokens: np.ndarray  # the context tokens the cached rows were built from (row p pairs with token p + 1)
    start: int  # the first position with features (the head's first row)
    hidden: torch.Tensor | None = None  # the last context row's HeadOutput: what the first level reads
    final: torch.Tensor | None = None


class EagleDrafter:
    """Drafts with ``head`` (an ``Eagle3Head`` or ``EagleHead``, e.g. from ``load_draft_head(path,
    target=model)``): per level the ``width`` best nodes each guess their ``top_k`` next tokens, over
    ``depth`` levels, stopping below path probability ``min_score``; trees of ``budget`` nodes (root
    included). The defaults follow EAGLE-2's scheme, scaled down for CPU drafting (not tuned).

    ``target_features`` tells the runner what to pass as ``hidden`` (``TargetFeatures``): the head's
    ``aux_layers`` (EAGLE-3) or ``(FINAL,)`` (EAGLE-1/2). Implements ``Drafter`` and ``ScoringDrafter``.

    The drafter runs its own copy of the head's layer (``head`` stays as it was; the target's
    embeddings and EAGLE-1's LM head are shared, neither copied nor packed) with q/k/v and gate/up
    fused (``fuse_projections``) and oneDNN-packed linear layers on the CPU: a drafting level runs a
    few rows, where each call costs about as much as its arithmetic and unpacked ``F.linear`` repacks the
    weights on every call (the linear layers of SmolLM2's EAGLE-3 head, 8 rows, one Zen 4 thread:
    1.28 ms in bfloat16 unpacked, 0.88 packed, 1.65 in float32 packed). ``dtype``: what the copy
    computes in: None for the head's own, ``"fastest"`` the fastest of that, float32 and bfloat16,
    timed here on one drafting level (on a Zen 4: bfloat16, 1.6 ms a level against 2.3; with oneDNN
    capped to AVX2 the linear layers ran 2x as fast in float32, while whole levels tied), or a dtype.
    The dtype changes a few draft trees, never the output: verification decides.
    """

    def __init__(self, head: Eagle3Head | EagleHead, *, budget: int = 32, top_k: int = 4, width: int = 4,
                 depth: int = 6, min_score: float = 0.02, backend: str | None = None,
                 dtype: torch.dtype | str | None = None):
        if not isinstance(head, (Eagle3Head, EagleHead)):
            raise TypeError(f"head must be an Eagle3Head or EagleHead (load_draft_head), got {type(head).__name__}")
        for name, value in (("budget", budget), ("top_k", top_k), ("width", width), ("depth", depth)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if not 0 <= min_score < 1:
            raise ValueError(f"min_score must be in [0, 1), got {min_score!r}")
        if not (dtype is None or dtype == "fastest" or dtype in (torch.float32, torch.bfloat16, torch.float16)):
            raise ValueError(f"dtype must be None, 'fastest' or a float dtype, got {dtype!r}")
        if isinstance(head, Eagle3Head):
            if head.config.aux_layers is None:
                raise ValueError("the EAGLE-3 head does not know its target's aux layers: load it with "
                                 "load_draft_head(path, target=model)")
            self.target_features = head.config.aux_layers
        else:
            self.target_features = (FINAL,)
        self.budget, self.top_k, self.width, self.depth, self.min_score = budget, top_k, width, depth, float(min_score)
        self.backend = backend
        own = head.compute_dtype
        if dtype == "fastest" and head.fc.weight.device.type == "cpu":
            copies = [_drafting_copy(head, d) for d in dict.fromkeys((own, torch.float32, torch.bfloat16))]
            seconds = self._level_seconds(copies)
            self.head = copies[seconds.index(min(seconds))]
        else:
            self.head = _drafting_copy(head, own if dtype in (None, "fastest") else dtype)
        self.cache = self.head.new_cache(backend=backend)
        self._requests: dict[Hashable, _Request] = {}

    @torch.inference_mode()
    def _level_seconds(self, heads: list[Eagle3Head | EagleHead], repeats: int = 5) -> list[float]:
        """Per head (on the CPU: ``"fastest"`` times there only), the best of ``repeats`` timings (after a
        warm-up; the heads interleaved) of one drafting level of ``width`` rows after 64 context rows,
        scored and ranked as ``_draft`` does."""
        numbers = torch.Generator().manual_seed(0)  # the caller's random stream is left alone
        cfg = heads[0].config
        feature = cfg.feature_size if isinstance(heads[0], Eagle3Head) else cfg.hidden_size
        features = torch.randn(64, feature, generator=numbers)
        tokens = torch.randint(cfg.vocab_size, (64,), generator=numbers)
        hidden = torch.randn(self.width, cfg.hidden_size, generator=numbers)
        picks = torch.randint(cfg.vocab_size, (self.width,), generator=numbers)
        k = min(self.top_k, cfg.vocab_size_draft)
        caches = [head.new_cache(backend=self.backend) for head in heads]
        for head, cache in zip(heads, caches):
            cache.add_sequence(0)
            head(cache, [0], features, tokens, [64])
        best = [math.inf] * len(heads)
        for _ in range(repeats + 1):
            for i, (head, cache) in enumerate(zip(heads, caches)):
                head(cache, [0], features[:0], tokens[:0], [0])  # an empty context append drops the last level's tree
                start = time.perf_counter()
                out = head(cache, [0], hidden, picks, [self.width], [[-1] * self.width])
                torch.topk(torch.softmax(head.logits(out.final), dim=-1), k, dim=-1)
                best[i] = min(best[i], time.perf_counter() - start)
        return best

    def __repr__(self) -> str:
        return f"EagleDrafter({type(self.head).__name__}, features={self.target_features}, budget={self.budget}, " \
               f"top_k={self.top_k}, width={self.width}, depth={self.depth}, min_score={self.min_score}, " \
               f"dtype={self.head.compute_dtype})"

    def propose(self, contexts: Sequence[np.ndarray], hidden: TargetFeatures | None = None) -> list[DraftTree]:
        return [c.tree for c in self.candidates(contexts, hidden)]

    @torch.inference_mode()
    def candidates(self, contexts: Sequence[np.ndarray], hidden: TargetFeatures | None = None, *,
                   floor: float = 0.0) -> list[Candidates]:
        """``ScoringDrafter``; a level whose every path probability is below ``min_score`` or ``floor``
        (what the caller would not verify) is not drafted."""
        if not isinstance(hidden, TargetFeatures) or hidden.layers != self.target_features or len(hidden) != len(contexts):
            raise ValueError(f"EagleDrafter needs hidden=TargetFeatures of layers {self.target_features}, one per "
                             f"context ({len(contexts)}): run it through treeattn.speculative.generate, which asks "
                             "the target for them")
        contexts = [as_context(c, f"contexts[{i}]") for i, c in enumerate(contexts)]
        for name in [name for name in self._requests if name not in hidden.live]:  # finished requests
            self._forget(name)
        if not contexts:
            return []
        requests = self._catch_up(contexts, hidden)
        nodes: list[Drafted] = [[(-1, int(c[-1]), 1.0, 1.0)] for c in contexts]
        ready = [i for i, r in enumerate(requests) if r.final is not None]  # no context row yet: nothing to draft from
        if ready:
            self._draft(nodes, hidden.seq_ids, ready, torch.stack([requests[i].hidden for i in ready]),
                        torch.stack([requests[i].final for i in ready]), max(self.min_score, floor))
        return [best_candidates(drafted, self.budget) for drafted in nodes]

    def _forget(self, name: Hashable) -> None:
        self.cache.remove_sequence(name)
        del self._requests[name]

    def _catch_up(self, contexts: list[np.ndarray], features: TargetFeatures) -> list[_Request]:
        """Append every context's rows not cached yet (rebuilding a context that does not extend its
        cached tokens), in one context append, which also drops the previous call's draft trees."""
        device = self.head.fc.weight.device
        names, lengths, rows, tokens, requests = [], [], [], [], []
        for i, (context, name, first) in enumerate(zip(contexts, features.seq_ids, features.starts)):
            have = features.rows[i]
            if not 0 <= first < context.size or have.shape[0] != context.size - 1 - first:
                raise ValueError(f"hidden.rows[{i}] holds {have.shape[0]} positions' features from position {first}, "
                                 f"contexts[{i}] has {context.size} tokens: expected one per position but the last")
            request = self._requests.get(name)
            cached = 0 if request is None else request.tokens.size
            if request is not None and not (request.start == first and cached <= context.size
                                            and np.array_equal(context[:cached], request.tokens)):
                self._forget(name)  # another text (or history) under this name: start over
                request, cached = None, 0
            if request is None:
                self.cache.add_sequence(name)
                request = self._requests[name] = _Request(context[:0].copy(), first)
            # The next row's position (row p pairs with token p + 1). A history that starts late (a
            # prefix-cache hit) makes a head cache without the first positions: fewer rows to attend to, and
            # the same relative positions for RoPE.
            start = max(cached - 1, first)
            names.append(name)
            lengths.append(context.size - 1 - start)
            rows.append(have[start - first:].to(device))
            tokens.append(torch.from_numpy(context[start + 1:]))
            requests.append(request)
            request.tokens = context.copy()
        out = self.head(self.cache, names, torch.cat(rows), torch.cat(tokens), lengths)
        ends = np.cumsum(lengths)
        for request, n, end in zip(requests, lengths, ends.tolist()):
            if n:
                request.hidden, request.final = out.hidden[end - 1].clone(), out.final[end - 1].clone()  # not the whole output
        return requests

    def _draft(self, nodes: list[Drafted], seq_ids: list, owner: list[int], hidden: torch.Tensor,
               final: torch.Tensor, min_score: float) -> None:
        """Grow ``nodes`` level by level from the ``owner`` contexts' last context rows (``hidden`` /
        ``final``, one row each), appending each level's expanded nodes (path probability ``min_score``
        or more) to the head's draft trees."""
        front = [0] * len(owner)  # per frontier row: its node in nodes[owner[row]]
        in_tree: list[dict[int, int]] = [{} for _ in nodes]  # per context: node -> index in the head's draft tree
        k = min(self.top_k, self.head.config.vocab_size_draft)
        for level in range(min(self.depth, self.budget - 1)):
            top = torch.topk(torch.softmax(self.head.logits(final), dim=-1), k, dim=-1)
            probs, picks = top.values.double().cpu().numpy(), self.head.to_target(top.indices).cpu().numpy()
            chosen = expand_frontier(nodes, owner, front, probs, picks, self.width, min_score)
            if not chosen or level + 1 == min(self.depth, self.budget - 1):
                return
            rows, ranks, owner, front = (list(column) for column in zip(*chosen))
            seqs = sorted(set(owner))  # expand_frontier lists each context's rows together, in context order: packed
            parents = {b: [] for b in seqs}
            for b, node in zip(owner, front):
                parents[b].append(in_tree[b].get(nodes[b][node][0], -1))  # the root's children are first-level nodes
                in_tree[b][node] = len(in_tree[b])
            out = self.head(self.cache, [seq_ids[b] for b in seqs], hidden[rows], torch.from_numpy(picks[rows, ranks]),
                            [len(parents[b]) for b in seqs], [parents[b] for b in seqs])
            hidden, final = out.hidden, out.final


def _drafting_copy(head: Eagle3Head | EagleHead, dtype: torch.dtype) -> Eagle3Head | EagleHead:
    """A copy of ``head`` in eval mode computing in ``dtype``, its projections fused and its linear
    layers packed for oneDNN (where it can pack them), sharing the target's weights the head holds
    (the embeddings; EAGLE-1's LM head) rather than copying them: the head casts what it reads from them."""
    shared = [head.embed_tokens] + ([head.lm_head] if isinstance(head, EagleHead) else [])
    clone = copy.deepcopy(head, {id(module): module for module in shared})
    for child in clone.children():
        if not any(child is module for module in shared):
            child.to(dtype).requires_grad_(False)
    clone.fuse_projections()
    pack_linears(clone, skip=shared)  # a packed copy of EAGLE-1's LM head would be the vocabulary's size again
    return clone.eval()
