"""SuffixDecoding-style drafter: frequency-scored continuation trees from a bounded suffix trie.

One trie holds every substring of up to ``max_pattern + max_depth`` tokens of the texts the
drafter has seen (prompts and outputs, of every request of every ``generate`` call that used it),
with how often each occurred. To draft, the longest suffix of the context (at most ``max_pattern``
tokens) that occurred before *and was continued* selects a trie node; the tree below it, grown best
first by the estimated probability of a path (the product of each step's share among its siblings,
``count(child) / sum(count(children))``), is the draft.

Memory is bounded: the trie keeps at most ``max_tokens`` tokens of text (oldest texts are evicted
first, their counts removed exactly), and a text of ``L`` tokens adds at most
``L * (max_pattern + max_depth)`` nodes, so the trie never has more than
``max_tokens * (max_pattern + max_depth)`` nodes (``num_nodes`` reports the current count).
Deterministic: ties are broken by token id, so the drafts depend only on the texts seen, in order.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Sequence

import numpy as np
import torch

from .adaptive import Candidates, grow
from .drafters import as_context, lookup_bucket
from .verify import DraftTree

__all__ = ["SuffixDrafter"]

_ROOT = 0


class _Text:
    """A text held in the trie: ``tokens`` are ``context[offset:]`` of the request it came from;
    ``frontier`` the trie nodes of its suffixes still shorter than the trie's depth."""

    def __init__(self, offset: int):
        self.offset = offset
        self.tokens: list[int] = []
        self.frontier: list[int] = []


class SuffixDrafter:
    """Suffix-trie drafter over the prompt and every earlier output (see the module docstring).

    ``budget``: nodes per tree, the root included (``propose``; ``AdaptiveDrafter`` cuts
    ``candidates`` further). ``max_pattern``: longest context suffix matched; ``max_depth``: deepest
    draft; ``max_tokens``: text kept in the trie; ``max_children``: siblings considered per node.
    Implements ``Drafter`` and ``ScoringDrafter``.
    """

    def __init__(self, budget: int = 32, *, max_pattern: int = 6, max_depth: int = 12, max_tokens: int = 1 << 15,
                 max_children: int = 4, recent_texts: int = 64):
        for name, value in (("budget", budget), ("max_pattern", max_pattern), ("max_depth", max_depth),
                            ("max_tokens", max_tokens), ("max_children", max_children),
                            ("recent_texts", recent_texts)):
            if not isinstance(value, (int, np.integer)) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        self.budget, self.max_pattern, self.max_depth = int(budget), int(max_pattern), int(max_depth)
        self.max_tokens, self.max_children, self.recent_texts = int(max_tokens), int(max_children), int(recent_texts)
        self.depth_limit = self.max_pattern + self.max_depth
        # Nodes as parallel lists (compact): count, depth, children (token -> node, None for a leaf).
        self._count: list[int] = [0]
        self._depth: list[int] = [0]
        self._kids: list[dict[int, int] | None] = [None]
        self._free: list[int] = []
        self._texts: deque[_Text] = deque()  # oldest first: eviction order
        self._recent: OrderedDict[int, _Text] = OrderedDict()  # texts that may still grow, by id
        self.num_tokens = 0

    def __repr__(self) -> str:
        return (f"SuffixDrafter(budget={self.budget}, max_pattern={self.max_pattern}, max_depth={self.max_depth}, "
                f"max_tokens={self.max_tokens})")

    @property
    def num_nodes(self) -> int:
        """Trie nodes in use, the root included (at most ``max_tokens * (max_pattern + max_depth) + 1``)."""
        return len(self._count) - len(self._free)

    # ------------------------------------------------------------------ the trie

    def _child(self, node: int, token: int) -> int:
        kids = self._kids[node]
        if kids is None:
            kids = self._kids[node] = {}
        child = kids.get(token)
        if child is None:
            if self._free:
                child = self._free.pop()
                self._count[child], self._depth[child], self._kids[child] = 0, self._depth[node] + 1, None
            else:
                child = len(self._count)
                self._count.append(0)
                self._depth.append(self._depth[node] + 1)
                self._kids.append(None)
            kids[token] = child
        return child

    def _append(self, text: _Text, token: int) -> None:
        """Every suffix of ``text`` shorter than the depth limit, and the empty one, grows by ``token``."""
        grown = []
        for node in text.frontier + [_ROOT]:
            child = self._child(node, token)
            self._count[child] += 1
            if self._depth[child] < self.depth_limit:
                grown.append(child)
        text.frontier = grown
        text.tokens.append(token)
        self.num_tokens += 1

    def _evict(self, text: _Text) -> None:
        """Remove ``text`` from the trie, undoing exactly what ``_append`` added for each start."""
        self._texts.remove(text)
        self._recent.pop(id(text), None)
        toks = text.tokens
        for s in range(len(toks)):
            node = _ROOT
            for t in toks[s:s + self.depth_limit]:
                child = self._kids[node][t]
                self._count[child] -= 1
                if self._count[child] == 0:  # no occurrence left, nor below it (a child never outcounts its parent)
                    del self._kids[node][t]
                    self._free.append(child)
                node = child
        self.num_tokens -= len(toks)

    def _ingest(self, context: np.ndarray) -> None:
        """Add the tokens of ``context`` not yet in the trie: a context extends the recent text that is
        its prefix, else it starts a new one; the oldest other texts make room (at most
        ``max_tokens`` tokens are kept; a longer text keeps its last ``max_tokens``)."""
        n = context.size
        text = None
        for key, cand in reversed(self._recent.items()):
            end = cand.offset + len(cand.tokens)
            # The last token first: most texts differ there, and comparing whole texts costs a
            # list-to-array conversion each (16 concurrent requests made that a millisecond a step).
            if end <= n and (end == cand.offset or context[end - 1] == cand.tokens[-1]) \
                    and np.array_equal(context[cand.offset:end], cand.tokens):
                text = cand
                self._recent.move_to_end(key)
                break
        if text is not None and n - text.offset > self.max_tokens:
            self._evict(text)  # restarted below at its last max_tokens tokens
            text = None
        if text is None:
            text = _Text(max(0, n - self.max_tokens))
            self._texts.append(text)
            self._recent[id(text)] = text
            while len(self._recent) > self.recent_texts:
                self._recent.popitem(last=False)
        new = context[text.offset + len(text.tokens):].tolist()
        while self.num_tokens + len(new) > self.max_tokens:
            self._evict(next(t for t in self._texts if t is not text))
        for t in new:
            self._append(text, t)

    # ------------------------------------------------------------------ drafting

    def _match(self, context: np.ndarray) -> tuple[int, int]:
        """Trie node of the longest continued context suffix and its length (``(-1, 0)``: none)."""
        tail = context[-self.max_pattern:].tolist()
        for m in range(len(tail), 0, -1):
            node = _ROOT
            for t in tail[-m:]:
                kids = self._kids[node]
                node = kids.get(t, -1) if kids else -1
                if node < 0:
                    break
            if node >= 0 and self._kids[node]:
                return node, m
        return -1, 0

    def _expand(self, ref):
        """Children of a trie node as ``(path probability, token, ref)``; ``ref = (node, path
        probability, share among siblings, occurrences of the parent, draft depth)``."""
        node, score, depth = ref[0], ref[1], ref[4]
        kids = self._kids[node]
        if not kids or depth == self.max_depth:
            return []
        total = sum(self._count[c] for c in kids.values())
        best = sorted(kids.items(), key=lambda kv: (-self._count[kv[1]], kv[0]))[: self.max_children]
        out = []
        for t, c in best:
            share = self._count[c] / total
            out.append((score * share, t, (c, score * share, share, total, depth + 1)))
        return out

    def candidates(self, contexts: Sequence[np.ndarray], hidden: torch.Tensor | None = None) -> list[Candidates]:
        out = []
        for b, context in enumerate(contexts):
            c = as_context(context, f"contexts[{b}]")
            self._ingest(c)
            root = int(c[-1])
            node, m = self._match(c)
            if node < 0 or self.budget == 1:
                out.append(Candidates.root_only(root))
                continue
            start = (node, 1.0, 1.0, 0, 0)  # the matched node: probability 1, draft depth 0
            tokens, parents, refs = grow(root, lambda ref, start=start: self._expand(ref or start), self.budget)
            keys, prior = np.zeros(len(tokens), np.int64), np.ones(len(tokens))
            for i in range(1, len(tokens)):
                keys[i], prior[i] = lookup_bucket(m, refs[i][2], refs[i][3])
            out.append(Candidates(DraftTree(np.array(tokens), np.array(parents)), keys, prior))
        return out

    def propose(self, contexts: Sequence[np.ndarray], hidden: torch.Tensor | None = None) -> list[DraftTree]:
        return [c.tree for c in self.candidates(contexts, hidden)]

