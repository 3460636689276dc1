"""Drafters for the vLLM tree-speculation tests; they reach vLLM's engine pickled, so they live in a module.

- ``OracleDrafter`` knows each prompt's true greedy continuation (from a run without speculation) and
  proposes trees that hold a random-length prefix of it among decoys: long paths are accepted, and
  they are not contiguous in the node order, so committing them moves K/V.
- ``HiddenCheckingOracle``: an ``OracleDrafter`` bound to the target's weights (``bind``) that checks,
  every step, that the hidden state it is given for each request is the one that chose the context's
  last token (greedy: the LM head's argmax of it), after plain steps and after accepted tree paths.
- ``FeatureRecorder``: an ``OracleDrafter`` that reads per-position target features (``target_features``)
  and saves, per request, its last context with the ``TargetFeatures`` row block it was given, to check
  against HF's hidden states.
- ``FixedTreeDrafter`` proposes the same tree of tokens every step (sampling tests on a tiny vocabulary).
"""

from __future__ import annotations

import random

import numpy as np

from treeattn.speculative import DraftTree


class OracleDrafter:
    def __init__(self, truths: list[tuple[list[int], list[int]]], vocab: int, max_depth: int = 6):
        self.truths, self.vocab, self.max_depth = truths, vocab, max_depth

    def _next_tokens(self, context: list[int]) -> list[int]:
        for prompt, continuation in self.truths:
            done = len(context) - len(prompt)
            if done >= 0 and context[: len(prompt)] == prompt and context[len(prompt):] == continuation[:done]:
                return continuation[done:]
        return []

    def propose(self, contexts, hidden=None) -> list[DraftTree]:
        return [self._tree(list(map(int, c))) for c in contexts]

    def _tree(self, context: list[int]) -> DraftTree:
        rng = random.Random(len(context) * 1_000_003 + sum(context))  # deterministic, varies step to step
        truth = self._next_tokens(context)
        depth = rng.randint(0, min(self.max_depth, len(truth)))
        tokens, parents, at = [context[-1]], [-1], 0

        def decoy(true_token: int) -> int:
            return (true_token + 1 + rng.randrange(self.vocab - 1)) % self.vocab

        for d in range(depth):
            if rng.random() < 0.6:  # a decoy sibling (with a child) before the true node
                tokens += [decoy(truth[d]), rng.randrange(self.vocab)]
                parents += [at, len(parents)]
            tokens.append(truth[d])
            parents.append(at)
            at = len(parents) - 1
        if depth < len(truth):  # a wrong guess below the accepted path
            tokens.append(decoy(truth[depth]))
            parents.append(at)
        return DraftTree(np.array(tokens), np.array(parents))


class HiddenCheckingOracle(OracleDrafter):
    def bind(self, weights):
        self.lm_head = weights[1]
        return self

    def propose(self, contexts, hidden=None) -> list[DraftTree]:
        if hidden is None or hidden.shape[0] != len(contexts):
            raise AssertionError(f"expected hidden states for {len(contexts)} contexts, got {hidden}")
        chosen = (hidden.double() @ self.lm_head.double().T).argmax(-1).tolist()
        last = [int(c[-1]) for c in contexts]
        if chosen != last:
            raise AssertionError(f"the hidden states chose {chosen}, the contexts end in {last}")
        return super().propose(contexts, hidden)


class FeatureRecorder(OracleDrafter):
    def __init__(self, truths, vocab: int, layers: list, out: str):
        super().__init__(truths, vocab)
        self.target_features, self.out, self.seen = tuple(layers), out, {}

    def propose(self, contexts, hidden=None) -> list[DraftTree]:
        import torch

        if hidden is None or tuple(hidden.layers) != self.target_features or len(hidden) != len(contexts):
            raise AssertionError(f"expected TargetFeatures of {self.target_features} for {len(contexts)} contexts, "
                                 f"got {hidden!r}")
        for name, context, start, rows in zip(hidden.seq_ids, contexts, hidden.starts, hidden.rows):
            lengths = self.seen.get(name, {}).get("lengths", []) + [len(context)]
            self.seen[name] = {"context": list(map(int, context)), "start": start, "rows": rows.clone(),
                               "lengths": lengths}
        torch.save(self.seen, self.out)
        return super().propose(contexts, hidden)


class FixedTreeDrafter:
    """Root -> ``children`` tokens, each -> ``grandchildren`` tokens, whatever the context."""

    def __init__(self, children: list[int], grandchildren: list[int]):
        self.children, self.grandchildren = children, grandchildren

    def propose(self, contexts, hidden=None) -> list[DraftTree]:
        tokens, parents = [0], [-1]
        for c in self.children:
            tokens.append(c)
            parents.append(0)
            child = len(tokens) - 1
            for g in self.grandchildren:
                tokens.append(g)
                parents.append(child)
        return [DraftTree(np.array([int(ctx[-1])] + tokens[1:]), np.array(parents)) for ctx in contexts]
