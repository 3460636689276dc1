"""Generation loops over a batch of prompts: plain decoding and tree speculative decoding.

Both share one loop. Each step, every unfinished sequence contributes a tree whose root is its last
emitted token (its key/value is not in the cache yet): a lone root for plain decoding (appended
causally), the drafter's tree for speculative decoding (appended as a tree, then the accepted path
is committed). One ``model.forward`` runs all sequences' nodes together, ``verify`` picks the
accepted path and the bonus token, so plain decoding is exactly the special case "no drafts".
Greedy verification makes both produce the same tokens; sampling keeps the target distribution.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from .adaptive import LearningDrafter, make_adaptive
from .drafters import Drafter
from .features import FeatureHistory, wanted_features
from .model import TreeModel
from .verify import DraftTree, SamplingParams, verify

__all__ = ["GenerationResult", "generate"]

TokenCallback = Callable[[int, list[int]], None]


@dataclass
class GenerationResult:
    """New tokens per prompt plus the counters the demo and benchmarks report."""

    tokens: list[list[int]]
    forward_passes: int = 0  # model forwards, the prefill included
    emitted_per_step: list[int] = field(default_factory=list)  # per sequence and decoding step
    drafted_per_step: list[int] = field(default_factory=list)  # tree nodes per sequence and step (root included)
    prefill_s: float = 0.0
    decode_s: float = 0.0
    draft_s: float = 0.0  # of decode_s, the time the drafter took to propose

    @property
    def num_tokens(self) -> int:
        return sum(len(t) for t in self.tokens)

    @property
    def elapsed_s(self) -> float:
        return self.prefill_s + self.decode_s

    @property
    def tokens_per_s(self) -> float:
        return self.num_tokens / self.elapsed_s if self.elapsed_s > 0 else float("nan")

    @property
    def mean_accepted(self) -> float:
        """Tokens emitted per sequence per verification step (1.0 for plain decoding)."""
        return float(np.mean(self.emitted_per_step)) if self.emitted_per_step else float("nan")

    @property
    def mean_tree_size(self) -> float:
        return float(np.mean(self.drafted_per_step)) if self.drafted_per_step else float("nan")


def _check_prompts(prompts) -> list[list[int]]:
    if isinstance(prompts, (torch.Tensor, np.ndarray)) or not isinstance(prompts, Sequence) or not prompts:
        raise TypeError("prompts must be a non-empty list of token id lists")
    out = []
    for b, p in enumerate(prompts):
        ids = p.tolist() if isinstance(p, (torch.Tensor, np.ndarray)) else list(p)
        if not ids or not all(isinstance(t, (int, np.integer)) and t >= 0 for t in ids):
            raise ValueError(f"prompts[{b}] must be a non-empty list of non-negative token ids")
        out.append([int(t) for t in ids])
    return out


@torch.inference_mode()
def generate(model: TreeModel, prompts: Sequence[Sequence[int]], *, max_new_tokens: int = 128,
             drafter: Drafter | None = None, sampling: SamplingParams | None = None,
             generator: torch.Generator | None = None, stop_tokens: Sequence[int] = (),
             on_tokens: TokenCallback | None = None, page_size: int = 16, backend: str | None = None,
             draft_slack: int = 256, adaptive: bool = True) -> GenerationResult:
    """Generate up to ``max_new_tokens`` tokens for each prompt, all prompts batched together.

    ``model`` implements ``TreeModel`` (``treeattn.hf.HFTreeModel`` wraps any HF causal LM).

    ``drafter=None`` is plain decoding (one token per sequence per forward); with a drafter each
    forward verifies one tree per sequence. ``sampling=None`` (or temperature 0) is greedy;
    otherwise tokens are sampled, speculative or not, with draws from ``generator``. A sequence
    stops after a token in ``stop_tokens`` (which is kept). ``on_tokens(b, new_tokens)`` is called
    as tokens of prompt ``b`` are produced. The KV cache is allocated here (``page_size``,
    ``backend``) with room for ``draft_slack`` uncommitted tree nodes per sequence.

    With ``adaptive`` (the default) a drafter that scores its candidates (``ScoringDrafter``: the
    n-gram, suffix and head drafters) is wrapped in an ``AdaptiveDrafter``, which verifies per step
    only the nodes expected to pay for their verification time (a plain decode when none does),
    learning acceptance and step cost during this call; pass an ``AdaptiveDrafter`` yourself to keep
    what it learns across calls, or ``adaptive=False`` to verify the drafter's full trees. A drafter
    that is a ``LearningDrafter`` is told each step's emitted tokens and time. Greedy output never
    depends on the trees; sampled output follows the target distribution whatever the trees, but a
    seed reproduces it only when the trees do not depend on measured times (``adaptive=False``, or
    an ``AdaptiveDrafter`` with ``CostModel.fixed``).

    A drafter that reads per-position target features (``target_features``, e.g. ``EagleDrafter``)
    gets a ``TargetFeatures`` as ``hidden``: the model is asked for those layers
    (``feature_layers``) and each request's history of them is kept for the call.
    """
    prompts = _check_prompts(prompts)
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
    if drafter is not None and not isinstance(drafter, Drafter):
        raise TypeError("drafter must implement propose(contexts, hidden=None) -> list[DraftTree]")
    layers = wanted_features(drafter)
    feature_kwargs = {} if layers is None else {"feature_layers": layers}  # other models need not know the keyword
    if adaptive:
        drafter = make_adaptive(drafter)
    learner = drafter if isinstance(drafter, LearningDrafter) else None
    stop = {int(t) for t in stop_tokens}
    batch = len(prompts)
    per_seq = [-(-(len(p) + max_new_tokens + draft_slack) // page_size) for p in prompts]
    cache = model.new_cache(sum(per_seq), page_size=page_size, backend=backend)
    for b in range(batch):
        cache.add_sequence(b)

    result = GenerationResult([[] for _ in range(batch)])
    contexts = [list(p) for p in prompts]
    active: list[int] = []
    history = None if layers is None else FeatureHistory(layers)

    def emit(b: int, new: list[int]) -> None:
        room = max_new_tokens - len(result.tokens[b])
        new = new[:room]
        for j, t in enumerate(new):
            if t in stop:
                new = new[:j + 1]
                break
        result.tokens[b].extend(new)
        contexts[b].extend(new)
        if on_tokens is not None and new:
            on_tokens(b, new)
        if len(result.tokens[b]) < max_new_tokens and not (new and new[-1] in stop):
            active.append(b)
        elif history is not None:
            history.forget(b)

    # Prefill: every prompt in one forward, logits of each prompt's last token only. The first new
    # token is "verifying" a root-only tree, exactly what a step without drafts does.
    start = time.perf_counter()
    lengths = [len(p) for p in prompts]
    last_rows = torch.tensor(np.cumsum(lengths) - 1)
    packed = torch.from_numpy(np.concatenate([np.asarray(p, dtype=np.int64) for p in prompts]))
    out = model.forward(cache, list(range(batch)), packed, lengths, logits_rows=last_rows, **feature_kwargs)
    result.forward_passes += 1
    first = verify([DraftTree.root_only(p[-1]) for p in prompts], out.logits, sampling, generator)
    hidden = out.hidden.clone()  # [B, hidden]: the state that predicted each sequence's next root
    if history is not None:
        for b, rows in enumerate(out.features.split(lengths)):
            history.write(b, 0, rows)
    for b in range(batch):
        emit(b, first.tokens[b])
    result.prefill_s = time.perf_counter() - start

    start = time.perf_counter()
    while active:
        ids, active = active, []
        step_start = time.perf_counter()
        if drafter is None:
            trees = [DraftTree.root_only(contexts[b][-1]) for b in ids]
        else:
            seen = hidden[ids] if history is None else history.features(ids)
            trees = list(drafter.propose([np.asarray(contexts[b]) for b in ids], hidden=seen))
            result.draft_s += time.perf_counter() - step_start
            if len(trees) != len(ids):  # zip below would silently drop sequences
                raise ValueError(f"the drafter returned {len(trees)} trees for {len(ids)} sequences")
            for b, tree in zip(ids, trees):
                if not isinstance(tree, DraftTree):
                    raise TypeError(f"the drafter returned a {type(tree).__name__} for sequence {b}, "
                                    "expected a DraftTree")
                if tree.size > draft_slack:  # the cache was sized for draft_slack uncommitted nodes
                    raise ValueError(f"the drafter's tree for sequence {b} has {tree.size} nodes, more than "
                                     f"draft_slack = {draft_slack}; pass a larger draft_slack to generate()")
                if tree.tokens[0] != contexts[b][-1]:
                    raise ValueError(f"the drafter's tree for sequence {b} has root token {tree.tokens[0]}, "
                                     f"expected the sequence's last token {contexts[b][-1]}")
        sizes = [t.size for t in trees]
        tokens = torch.from_numpy(np.concatenate([t.tokens for t in trees]))
        # A step that drafts nothing (no drafter, or an adaptive one that found nothing worth
        # verifying) appends its roots causally: plain decoding, nothing to commit.
        drafted = any(t.size > 1 for t in trees)
        parents = [t.parents for t in trees] if drafted else None
        out = model.forward(cache, ids, tokens, sizes, parents, **feature_kwargs)
        result.forward_passes += 1
        res = verify(trees, out.logits, sampling, generator)
        if parents is not None:
            cache.commit_accepted(ids, res.leaf_indices)
        node_starts = np.cumsum([0] + sizes[:-1])
        leaf_rows = torch.tensor([s + leaf for s, leaf in zip(node_starts.tolist(), res.leaf_indices)])
        hidden[ids] = out.hidden[leaf_rows]
        if history is not None:  # the accepted path's positions (root first) now have their features
            for b, first, path in zip(ids, node_starts.tolist(), res.paths):  # the root is the context's last token
                history.write(b, len(contexts[b]) - 1, out.features[[first + node for node in path]])
        if learner is not None:
            learner.observe(res.tokens, time.perf_counter() - step_start)
        for b, new, size in zip(ids, res.tokens, sizes):
            result.emitted_per_step.append(len(new))
            result.drafted_per_step.append(size)
            emit(b, new)
    result.decode_s = time.perf_counter() - start
    return result
