"""Adaptive draft trees: per step, verify the tree that maximises expected tokens per second.

Three parts, one job each:

- ``Candidates``: a drafter's *scored* candidate tree. Every non-root node carries the drafter's own
  guess of the probability that the target emits its token given that its parent was accepted
  (``prior``) and a calibration bucket (``key``) that says which guesses behave alike.
- ``Calibrator``: turns those guesses into measured probabilities, per bucket, from what the target
  actually emitted. Labels are counterfactual, so every candidate node gets one whether it was
  verified or not: node ``x`` at depth ``d`` whose parent path equals the first ``d - 1`` emitted
  tokens is "accepted" iff the ``d``-th emitted token is ``x``. The token emitted at a position is
  distributed exactly as the target's (greedy: its argmax; sampling: lossless verification keeps
  the target distribution), so the label is an unbiased draw of the acceptance probability, even
  for nodes that were cut and for steps that drafted nothing (which would otherwise never learn).
- ``CostModel``: the seconds one decoding step takes for ``n`` tree nodes in total (roots included,
  the whole batch), ``a + b * n``, plus ``c`` when the step drafts anything, fitted by exponentially weighted least squares to the steps
  measured on the running machine, so it follows the current batch and context as they change.

``AdaptiveDrafter`` joins them: a node's probability of being accepted is the product of the
calibrated edge probabilities along its path, the expected tokens of a step are ``B + sum(p)``
(``B`` bonus tokens), and the nodes of all requests, best first, are cut at the count that maximises
``(B + sum(p)) / (a + b * (B + k) + c * [k > 0])``. When no node pays for its verification the step is a plain
decode: every tree is a lone root.

``StepGate`` (optional; vLLM's ``TreeProposer`` gives every adaptive drafter one) decides, before any
drafting, whether a batch step drafts at all. At concurrency a step is shared and compute-bound:
drafting for every request (a draft head runs per request) and verifying trees can cost more than
they return, and a linear cost model fitted on drafting steps alone cannot tell (it never sees the
plain step it is compared with). The gate does not model: per batch size (powers of two) it keeps
the measured tokens per request per second of steps that drafted and of steps that did not, takes
the better, and tries the other now and then. Its plain steps feed the cost model too: the plain
step that trees are compared with is measured, not extrapolated from drafting steps.
"""

from __future__ import annotations

import heapq
import inspect
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple, Protocol, runtime_checkable

import numpy as np
import torch

from .verify import DraftTree

__all__ = ["AdaptiveDrafter", "Calibrator", "Candidates", "CostModel", "LearningDrafter", "ScoringDrafter",
           "StepCost", "StepGate", "grow", "make_adaptive", "probe_cost", "takes_floor"]


@dataclass(frozen=True, eq=False)
class Candidates:
    """A scored candidate tree: ``tree`` (best siblings first), and per node the calibration bucket
    ``keys[i]`` and the drafter's prior ``prior[i]`` that node ``i`` is accepted given its parent was
    (entry 0, the root, is ignored)."""

    tree: DraftTree
    keys: np.ndarray  # int64 [n]
    prior: np.ndarray  # float64 [n], in [0, 1]

    def __post_init__(self) -> None:
        n = self.tree.size
        keys, prior = np.asarray(self.keys, dtype=np.int64), np.asarray(self.prior, dtype=np.float64)
        if keys.shape != (n,) or prior.shape != (n,):
            raise ValueError(f"keys and prior must have one entry per tree node ({n}), "
                             f"got shapes {keys.shape} and {prior.shape}")
        if n > 1 and not ((prior[1:] >= 0) & (prior[1:] <= 1)).all():
            raise ValueError("prior must be probabilities in [0, 1]")
        object.__setattr__(self, "keys", keys)
        object.__setattr__(self, "prior", prior)

    @classmethod
    def root_only(cls, token: int) -> Candidates:
        return cls(DraftTree.root_only(token), np.zeros(1, np.int64), np.ones(1))


@runtime_checkable
class ScoringDrafter(Protocol):
    """A drafter that scores its candidates. Its ``candidates`` may also take a keyword ``floor``
    (``AdaptiveDrafter`` passes it to sources that do): a calibrated path probability below which no
    node can pay for its verification this step, so the source may leave such nodes undrafted. Only a
    source whose own probabilities do not underrate its guesses should take it (a draft head's
    softmax, measured calibrated or overconfident, does; the suffix drafter's sibling shares, which
    underrate long matches, do not): it stops where its own estimate falls below ``floor``."""

    def candidates(self, contexts: Sequence[np.ndarray], hidden: torch.Tensor | None = None) -> list[Candidates]:
        """One scored candidate tree per context; ``tree.tokens[0]`` is the context's last token."""
        ...


def takes_floor(source: ScoringDrafter) -> bool:
    """Whether ``source.candidates`` takes the ``floor`` keyword (``ScoringDrafter``)."""
    try:
        return "floor" in inspect.signature(source.candidates).parameters
    except (TypeError, ValueError):  # no signature to read (a builtin or C extension): assume not
        return False


@runtime_checkable
class LearningDrafter(Protocol):
    """A drafter that learns from the outcome of the step it drafted for (``generate`` calls
    ``observe`` after every ``propose``)."""

    def observe(self, emitted: Sequence[Sequence[int]], seconds: float | None) -> None:
        """``emitted[b]``: tokens the step emitted for the ``b``-th proposed tree; ``seconds``: the step's
        time, or None when it measures more than this proposal (an engine step that also prefilled)."""
        ...


def grow(root_token: int, expand, budget: int) -> tuple[list[int], list[int], list[object]]:
    """Best-first growth of a tree of at most ``budget`` nodes (the root included).

    ``expand(ref)`` lists the children of the node described by ``ref`` (``None`` for the root) as
    ``(score, token, ref)``, each child's score at most its parent's. Nodes are taken highest score
    first (ties: earlier discovered), so the tree holds the ``budget - 1`` best nodes reachable and
    every node comes after its parent; siblings come out best first.
    Returns ``tokens``, ``parents`` and the ``ref`` of every node.
    """
    tokens, parents, refs = [root_token], [-1], [None]
    heap: list[tuple[float, int, int, int, object]] = []
    order = 0
    for score, token, ref in expand(None):
        heapq.heappush(heap, (-score, order, 0, token, ref))
        order += 1
    while heap and len(tokens) < budget:
        _, _, parent, token, ref = heapq.heappop(heap)
        node = len(tokens)
        tokens.append(token)
        parents.append(parent)
        refs.append(ref)
        for score, child_token, child_ref in expand(ref):
            heapq.heappush(heap, (-score, order, node, child_token, child_ref))
            order += 1
    return tokens, parents, refs


class Calibrator:
    """Measured acceptance probability per calibration bucket: a Beta posterior whose prior is the
    drafter's own guess (``strength`` pseudo-observations), with old observations fading by
    ``decay`` per new one in the same bucket so that it follows the text being generated."""

    def __init__(self, strength: float = 2.0, decay: float = 0.98):
        if not strength > 0:
            raise ValueError(f"strength must be > 0, got {strength}")
        if not 0 < decay <= 1:
            raise ValueError(f"decay must be in (0, 1], got {decay}")
        self.strength, self.decay = float(strength), float(decay)
        self.hits: dict[int, float] = {}
        self.trials: dict[int, float] = {}

    def probability(self, keys: np.ndarray, prior: np.ndarray) -> np.ndarray:
        hits = np.array([self.hits.get(k, 0.0) for k in keys.tolist()])
        trials = np.array([self.trials.get(k, 0.0) for k in keys.tolist()])
        return (hits + self.strength * prior) / (trials + self.strength)

    def update(self, key: int, accepted: bool) -> None:
        self.hits[key] = self.hits.get(key, 0.0) * self.decay + float(accepted)
        self.trials[key] = self.trials.get(key, 0.0) * self.decay + 1.0

    def learn(self, cands: Candidates, emitted: Sequence[int]) -> None:
        """Label every node of ``cands`` whose parent path matches ``emitted`` and whose own depth
        is within it (see the module docstring)."""
        tree = cands.tree
        on_path = np.zeros(tree.size, dtype=bool)  # node's path equals the emitted prefix
        on_path[0] = True
        depth = np.zeros(tree.size, dtype=np.int64)
        for i in range(1, tree.size):
            p = int(tree.parents[i])
            depth[i] = depth[p] + 1
            if on_path[p] and depth[i] <= len(emitted):
                hit = int(tree.tokens[i]) == int(emitted[depth[i] - 1])
                on_path[i] = hit
                self.update(int(cands.keys[i]), hit)


def _acceptance(cands: Candidates, calibrator: Calibrator) -> np.ndarray:
    """Each node's calibrated probability of being accepted: the product of its path's edge probabilities."""
    edge = calibrator.probability(cands.keys, cands.prior)
    parents = cands.tree.parents
    path = np.ones(cands.tree.size)
    for i in range(1, path.size):
        path[i] = path[int(parents[i])] * edge[i]
    return path


class StepCost(NamedTuple):
    """A step's seconds: ``per_step + per_node * nodes``, plus ``to_draft`` when it verifies any draft."""

    per_step: float
    per_node: float
    to_draft: float


class CostModel:
    """Step seconds for ``n`` tree nodes in total: ``a + b * n``, plus ``c`` when the step drafts.

    ``c`` is the price of verifying any draft at all, beyond its nodes: with PyTorch's own CPU
    matmuls a 2-4 token step runs far below the speed of a one-token decode (measured on SmolLM2,
    1 core: one node 50 ms, two 75 ms, sixteen 178 ms, so ``c`` was about a third of a plain step;
    ``pack_linears`` brings it near 0), and the step takes the tree path (mask, commit). A model
    without it thinks a single likely node pays when it does not, which is how prompts with nothing
    to look up ran slower than plain decoding.
    Fitted by exponentially weighted least squares (``forget`` per step: recent steps count most,
    so the fit follows the context length and the machine's load). Until steps of several sizes have
    been seen the slope is pinned by a weak prior ``b = ratio * a`` (``ratio``: the cost of one extra
    node relative to a one-node step; ``strength`` its weight relative to the data's), and ``c`` by
    a weak prior ``c = 0`` (optimistic: the drafter tries drafting, and learns ``c`` from it).
    ``CostModel.fixed(a, b, c)`` never learns: tree choices then depend on the text alone, which makes
    seeded sampling reproducible (measured times differ from run to run, and the tree decides which
    random draws verification makes).
    """

    def __init__(self, ratio: float = 0.08, forget: float = 0.95, strength: float = 1.0):
        if not ratio >= 0:
            raise ValueError(f"ratio must be >= 0, got {ratio}")
        if not 0 < forget <= 1:
            raise ValueError(f"forget must be in (0, 1], got {forget}")
        self.ratio, self.forget, self.strength = float(ratio), float(forget), float(strength)
        self._gram = np.zeros((3, 3))
        self._rhs = np.zeros(3)
        self.steps = 0
        self._fixed: StepCost | None = None

    @classmethod
    def fixed(cls, seconds_per_step: float, seconds_per_node: float, seconds_to_draft: float = 0.0) -> CostModel:
        """A cost model that does not learn: ``seconds_per_step + seconds_per_node * n``, plus
        ``seconds_to_draft`` for a step that drafts."""
        values = (seconds_per_step, seconds_per_node, seconds_to_draft)
        if not (min(values) >= 0 and seconds_per_step + seconds_per_node > 0):
            raise ValueError(f"seconds_per_step, seconds_per_node and seconds_to_draft must be >= 0 and the first "
                             f"two not both 0, got {values}")
        model = cls()
        model._fixed = StepCost(*map(float, values))
        return model

    def add(self, nodes: int, seconds: float, *, drafted: bool | None = None) -> None:
        """Record a step of ``nodes`` tree nodes (roots included) that took ``seconds``; ``drafted``:
        whether any tree had more than its root (default ``nodes > 1``, right for one request)."""
        if nodes < 1 or not seconds > 0:
            raise ValueError(f"a step has nodes >= 1 and seconds > 0, got {nodes} and {seconds}")
        if self._fixed is not None:
            return
        x = np.array([1.0, float(nodes), float(nodes > 1 if drafted is None else drafted)])
        self._gram = self.forget * self._gram + np.outer(x, x)
        self._rhs = self.forget * self._rhs + x * seconds
        self.steps += 1

    @property
    def coefficients(self) -> StepCost:
        """``(per_step, per_node, to_draft)`` seconds; all nan before the first step."""
        if self._fixed is not None:
            return self._fixed
        if self.steps == 0:
            return StepCost(float("nan"), float("nan"), float("nan"))
        # The priors as penalties strength * (b - ratio * a)^2 and strength * c^2, scaled by the
        # data's weight so that they stay weak however many steps were seen.
        weight = self.strength * 1e-3 * self._gram[0, 0]
        slope, jump = np.array([-self.ratio, 1.0, 0.0]), np.array([0.0, 0.0, 1.0])
        gram = self._gram + weight * (np.outer(slope, slope) + np.outer(jump, jump))
        a, b, c = np.linalg.solve(gram, self._rhs)
        if min(a, b, c) < 0:  # noise can tilt the fit; time never falls as nodes or drafts are added
            b, c = max(b, 0.0), max(c, 0.0)
            a = max((self._rhs[0] - b * self._gram[0, 1] - c * self._gram[0, 2]) / self._gram[0, 0], 0.0)
        return StepCost(float(a), float(b), float(c))

    def seconds(self, nodes, drafted=None) -> np.ndarray | float:
        """Predicted seconds of steps of ``nodes`` nodes; ``drafted`` as in ``add`` (default ``nodes > 1``)."""
        a, b, c = self.coefficients
        nodes = np.asarray(nodes, dtype=np.float64)
        drafted = nodes > 1 if drafted is None else np.asarray(drafted, dtype=bool)
        return a + b * nodes + c * drafted


def probe_cost(model, cost: CostModel, sizes: Sequence[int] = (1, 2, 4, 8, 16, 32), context: int = 64,
               repeats: int = 2) -> CostModel:
    """Seed ``cost`` with timed forwards of chain trees of ``sizes`` nodes after a ``context``-token
    prompt (a scratch cache; a few hundred milliseconds for a 135M model on a CPU)."""
    total = context + max(sizes) + repeats * len(sizes)  # each step keeps its root
    pages = -(-total // 16) + 1
    cache = model.new_cache(pages, page_size=16)
    cache.add_sequence(0)
    prompt = torch.zeros(context, dtype=torch.int64)
    model.forward(cache, [0], prompt, [context], logits_rows=torch.tensor([context - 1]))
    for _ in range(repeats):
        for n in sizes:
            # n == 1 is a plain decode, as generate runs a step that drafts nothing (no tree, no commit)
            parents = [np.arange(-1, n - 1, dtype=np.int64)] if n > 1 else None
            start = time.perf_counter()
            out = model.forward(cache, [0], torch.zeros(n, dtype=torch.int64), [n], parents)
            out.logits.argmax(dim=-1)
            if parents is not None:
                cache.commit_accepted([0], [0])  # keep the root only: the context stays about the same
            cost.add(n, time.perf_counter() - start)
    return cost


class StepGate:
    """Whether a step of ``batch`` requests drafts at all, from measured throughput (module docstring).

    Per batch-size class (``batch.bit_length()``: 1, 2-3, 4-7, 8-15, ...) and per arm (drafting or not), an
    exponentially weighted mean of the step's emitted tokens per request per second. Every step of the class
    ages both arms' weights by ``forget``: an arm that does not run keeps its rate but not its weight, so
    when it runs again its new steps, not its old rate, decide (serving bf16 on a 2-core CPU, plain's rate
    at 16 requests stood at 25 tokens per request-second from steps long before, while its steps then
    measured 31). A class with an unmeasured arm tries it (not drafting first: the drafter learns its costs
    from plain steps); otherwise the better arm runs and the other is tried again after ``probe_every``
    steps of the class times how many times faster the better arm measured, at most ``MAX_RATIO`` (a far
    worse arm is tried more rarely, but a one-off stall, a kernel build or a page fault storm inside one
    step, cannot keep an arm untried for thousands of steps), so that a change of load or text is noticed. A
    try runs the arm for ``try_steps`` steps in a row: one drafting step says little (how many tokens a step
    accepts varies from step to step, and the first drafting step after plain ones also catches the drafters
    up on the tokens they have not seen), and at concurrency 16 single-step tries judged drafting worse
    while drafting every step ran 4-5% faster than plain. From its second step on, a try ends sooner when
    the arm measures ``CLEAR`` times worse than the other: no step-to-step noise (drafting steps at
    concurrency 16 varied by about a quarter) but a real loss, which more steps would only repeat (not on
    the first step alone: a re-tried arm is judged on its new steps only, and the first drafting step after
    plain ones is the drafters' catching up). Each try that finds the same arm still better doubles the
    wait, up to ``max_backoff`` times (a try of the worse arm costs up to a whole step's gain per step); a
    try that finds the other arm better resets it.
    """

    MAX_RATIO = 4.0
    CLEAR = 1.5

    def __init__(self, probe_every: int = 16, forget: float = 0.8, max_backoff: int = 8, try_steps: int = 4):
        for name, value, low in (("probe_every", probe_every, 2), ("max_backoff", max_backoff, 1),
                                 ("try_steps", try_steps, 1)):
            if not isinstance(value, (int, np.integer)) or value < low:
                raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
        if not 0 < forget < 1:
            raise ValueError(f"forget must be in (0, 1), got {forget}")
        self.probe_every, self.forget, self.max_backoff = int(probe_every), float(forget), int(max_backoff)
        self.try_steps = int(try_steps)
        self._rates: dict[tuple[int, bool], list[float]] = {}  # (class, drafts) -> [weighted mean rate, weight]
        self._since: dict[int, int] = {}  # per class, steps since the losing arm was last tried
        self._backoff: dict[int, int] = {}  # per class, the wait's factor (1, 2, 4, ... max_backoff)
        self._trying: dict[int, list] = {}  # per class, [arm being tried, its steps still to record, a re-try]

    def rate(self, batch: int, drafts: bool) -> float:
        """Measured tokens per request per second of an arm at this batch size; nan before any step."""
        measured = self._rates.get((int(batch).bit_length(), bool(drafts)))
        return measured[0] if measured else float("nan")

    def drafts(self, batch: int) -> bool:
        """Whether the next step of ``batch`` requests should draft."""
        key = int(batch).bit_length()
        if key in self._trying:
            return self._trying[key][0]
        plain, drafting = self.rate(batch, False), self.rate(batch, True)
        if np.isnan(plain):
            return False
        if np.isnan(drafting):
            self._trying[key] = [True, self.try_steps, False]
            return True
        better = bool(drafting > plain)
        since = self._since[key] = self._since.get(key, 0) + 1
        ratio = min(max(plain, drafting) / min(plain, drafting), self.MAX_RATIO)
        if since < self.probe_every * self._backoff.get(key, 1) * ratio:
            return better
        self._since[key] = 0
        self._trying[key] = [not better, self.try_steps, True]
        return not better

    def record(self, batch: int, drafted: bool, tokens: int, seconds: float) -> None:
        """A step of ``batch`` requests that did (``drafted``) or did not draft emitted ``tokens`` in ``seconds``."""
        if batch < 1 or tokens < batch or not seconds > 0:
            raise ValueError(f"a step has batch >= 1, tokens >= batch and seconds > 0, got {batch}, {tokens}, {seconds}")
        key = int(batch).bit_length()
        for arm in (False, True):
            if (key, arm) in self._rates:
                self._rates[key, arm][1] *= self.forget
        mean = self._rates.setdefault((key, bool(drafted)), [0.0, 0.0])
        mean[1] += 1.0
        mean[0] += (tokens / batch / seconds - mean[0]) / mean[1]
        trying = self._trying.get(key)
        if trying is not None and trying[0] is bool(drafted):
            trying[1] -= 1
            clear = self.try_steps - trying[1] >= 2 and self.rate(batch, drafted) * self.CLEAR < self.rate(batch, not drafted)
            if trying[1] == 0 or clear:
                del self._trying[key]
                if trying[2]:  # a re-try's verdict (not the arm's first measurement): back off, or start over
                    still_worse = not self.rate(batch, drafted) > self.rate(batch, not drafted)
                    self._backoff[key] = min(2 * self._backoff.get(key, 1), self.max_backoff) if still_worse else 1


def make_adaptive(drafter, *, max_nodes: int = 32):
    """``drafter`` wrapped in an ``AdaptiveDrafter`` (trees of at most ``max_nodes``) when it scores its
    candidates and does not learn by itself; any other drafter as it is."""
    if isinstance(drafter, ScoringDrafter) and not isinstance(drafter, LearningDrafter):
        return AdaptiveDrafter(drafter, max_nodes=max_nodes)
    return drafter


class AdaptiveDrafter:
    """Drafts, per step, the tree with the most expected tokens per second (see the module docstring).

    ``sources``: one or more ``ScoringDrafter``, cheapest first; their candidate trees are merged by
    token path (a node's probability is the best any source gives it). A later source is asked only
    for the contexts where the sources before it expect fewer than ``enough`` accepted tokens (None:
    always): a suffix drafter's confident match costs microseconds, and a draft head's few
    milliseconds per step would buy little beside it (the head costs ~6 ms a step on 2 CPU cores;
    in vLLM on SmolLM2, single development runs, 0.5 ran faster on the demo's prompts than 1 or 2).
    ``max_nodes`` caps one request's tree (the root included). ``cost`` defaults to a fresh
    ``CostModel``. ``gate``: a ``StepGate`` that may skip drafting for a whole step (None: always
    draft, and let the cut decide). Implements ``Drafter`` and ``LearningDrafter``: keep one instance
    across ``generate`` calls to keep what it learnt.
    """

    def __init__(self, *sources: ScoringDrafter, cost: CostModel | None = None, max_nodes: int = 32,
                 calibration_strength: float = 2.0, enough: float | None = 0.5, gate: StepGate | None = None):
        if not sources:
            raise ValueError("AdaptiveDrafter needs at least one ScoringDrafter source")
        for i, s in enumerate(sources):
            if not isinstance(s, ScoringDrafter):
                raise TypeError(f"sources[{i}] must implement candidates(contexts, hidden=None), "
                                f"got {type(s).__name__}")
        if not isinstance(max_nodes, (int, np.integer)) or max_nodes < 1:
            raise ValueError(f"max_nodes must be an integer >= 1, got {max_nodes!r}")
        if enough is not None and not enough > 0:
            raise ValueError(f"enough must be > 0 or None, got {enough!r}")
        self.sources = sources
        self._takes_floor = [takes_floor(s) for s in sources]
        self.enough = None if enough is None else float(enough)
        self.cost = cost if cost is not None else CostModel()
        self.max_nodes = int(max_nodes)
        self.calibrators = [Calibrator(calibration_strength) for _ in sources]
        self.gate = gate
        self._gated = False  # whether the gate let the last step draft
        self._pending: list[list[Candidates]] = []  # per source, the last step's candidates
        self._nodes = 0  # total nodes of the last step
        self._drafted = False  # whether the last step drafted anything

    def __repr__(self) -> str:
        return f"AdaptiveDrafter({', '.join(map(repr, self.sources))}, max_nodes={self.max_nodes}, enough={self.enough})"

    def propose(self, contexts: Sequence[np.ndarray], hidden: torch.Tensor | None = None) -> list[DraftTree]:
        n = len(contexts)
        self._gated = n > 0 and self.gate is not None and self.gate.drafts(n)
        if self.gate is not None and not self._gated:  # a plain step: no drafting, nothing to label
            self._pending, self._nodes, self._drafted = [], n, False
            return [DraftTree.root_only(int(c[-1])) for c in contexts]
        per_source, expected = [], np.zeros(n)
        floor = self.floor(n)
        for i, (s, calibrator) in enumerate(zip(self.sources, self.calibrators)):
            ask = [b for b in range(n) if i == 0 or self.enough is None or expected[b] < self.enough]
            options = {"floor": floor} if self._takes_floor[i] else {}
            got = s.candidates([contexts[b] for b in ask], None if hidden is None else hidden[ask],
                               **options) if ask else []
            if len(got) != len(ask):
                raise ValueError(f"{s!r} returned {len(got)} candidate trees for {len(ask)} contexts")
            cands = [Candidates.root_only(int(c[-1])) for c in contexts]
            for b, c in zip(ask, got):
                cands[b] = c
            per_source.append(cands)
            if self.enough is not None and i + 1 < len(self.sources):
                expected = np.maximum(expected, [self._expected_tokens(c, calibrator) for c in cands])
        self._pending = per_source
        merged = [self._merge([src[b] for src in per_source], self.calibrators)
                  for b in range(len(contexts))]
        trees = self._cut(merged)
        self._nodes = sum(t.size for t in trees)
        self._drafted = self._nodes > len(trees)
        return trees

    def floor(self, batch: int) -> float:
        """The least path probability a node of a step of ``batch`` requests needs to pay for its
        verification (what the sources are told: ``ScoringDrafter``). A node of probability ``p`` raises
        the step's tokens per second only if ``p > per_node * rate``, and the best cut's rate is at
        least the plain step's, ``batch / (per_step + per_node * batch)``. So it grows with the batch:
        alone a node pays at a few percent, at concurrency 16 on 2 cores only at about a third, and a
        drafter need not search deep trees that would be cut. 0 before any step was measured."""
        a, b, _ = self.cost.coefficients
        if np.isnan(a):
            return 0.0
        return float(b * batch / (a + b * batch))

    def observe(self, emitted: Sequence[Sequence[int]], seconds: float | None) -> None:
        for calibrator, cands in zip(self.calibrators, self._pending):
            for c, tokens in zip(cands, emitted):
                calibrator.learn(c, tokens)
        if self._nodes and seconds is not None:
            self.cost.add(self._nodes, seconds, drafted=self._drafted)
            served = [e for e in emitted if e]  # a request that left the batch emitted nothing
            if self.gate is not None and served:
                self.gate.record(len(served), self._gated, sum(map(len, served)), seconds)
        self._pending, self._nodes = [], 0

    def _expected_tokens(self, cands: Candidates, calibrator: Calibrator) -> float:
        """Accepted tokens a source's tree is expected to give (its ``max_nodes - 1`` likeliest nodes)."""
        path = _acceptance(cands, calibrator)
        return float(np.sort(path[1:])[::-1][: self.max_nodes - 1].sum())

    @staticmethod
    def _merge(cands: Sequence[Candidates], calibrators: Sequence[Calibrator]):
        """One trie over all sources: ``(tokens, parents, node probabilities)``, nodes in the order of
        first appearance (parents first); a node's probability is the best any source gives it."""
        root = int(cands[0].tree.tokens[0])
        tokens, parents, prob = [root], [-1], [1.0]
        index: dict[tuple[int, int], int] = {}  # (parent node, token) -> node
        for c, cal in zip(cands, calibrators):
            t = c.tree
            if int(t.tokens[0]) != root:
                raise ValueError(f"candidate trees disagree on the root token ({int(t.tokens[0])} vs {root})")
            path_p = _acceptance(c, cal).tolist()
            where = [0] * t.size
            for i in range(1, t.size):
                p = int(t.parents[i])
                key = (where[p], int(t.tokens[i]))
                node = index.get(key)
                if node is None:
                    node = index[key] = len(tokens)
                    tokens.append(key[1])
                    parents.append(key[0])
                    prob.append(path_p[i])
                else:
                    prob[node] = max(prob[node], path_p[i])
                where[i] = node
        return np.asarray(tokens, np.int64), np.asarray(parents, np.int64), np.asarray(prob)

    def _cut(self, merged) -> list[DraftTree]:
        """Keep, over all requests, the nodes (best first) that maximise expected tokens per second."""
        batch = len(merged)
        if np.isnan(self.cost.coefficients[0]):  # nothing measured yet: a plain decode, and measure it
            return [DraftTree.root_only(int(m[0][0])) for m in merged]
        # Best first per request, capped at max_nodes - 1; a child never beats its parent
        # (probabilities multiply), ties go to the earlier (shallower) node: kept sets are connected.
        rows = []
        for b, (_, _parents, prob) in enumerate(merged):
            order = np.lexsort((np.arange(1, prob.size), -prob[1:]))[: self.max_nodes - 1] + 1
            rows.extend((-float(prob[i]), b, int(i)) for i in order)
        rows.sort()
        gain = batch + np.cumsum([0.0] + [-r[0] for r in rows])
        kept = np.arange(len(rows) + 1)
        rate = gain / self.cost.seconds(batch + kept, drafted=kept > 0)
        keep = int(np.argmax(rate))  # argmax takes the first maximum: no drafts unless they pay
        chosen: list[list[int]] = [[] for _ in range(batch)]
        for _, b, i in rows[:keep]:
            chosen[b].append(i)
        trees = []
        for (tokens, parents, _), nodes in zip(merged, chosen):
            nodes = [0] + sorted(nodes)  # original order: parents before children, best siblings first
            new = {old: j for j, old in enumerate(nodes)}
            trees.append(DraftTree(tokens[nodes], np.array([-1] + [new[int(parents[i])] for i in nodes[1:]])))
        return trees
