"""Hypothesis state machine: random add / fork / forward / commit / pop / remove on the paged KV cache.

After every step the cache must agree with the plain model in ``cache_model.py``: every forward's
attention output (float64 dense reference with the tree mask), the stored K/V of every sequence,
lengths, and page accounting (shared pages counted once, all pages free once everything is removed).
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from tests.cache_model import ModelCache
from treeattn import OutOfPagesError, PagedKVCache

LAYERS, H_KV, H_Q, D, PAGE, PAGES = 2, 2, 4, 16, 4, 40
MAX_SEQS = 5
BACKENDS = ["reference"] + (["cpu"] if importlib.util.find_spec("treeattn.backends.cpu") else [])


pytestmark = pytest.mark.usefixtures("one_thread")


@st.composite
def new_parents(draw, old: int, n: int) -> list[int]:
    """Parents of ``n`` new nodes appended to an uncommitted tree of ``old`` nodes (-1: a root)."""
    shape = draw(st.sampled_from(["random", "chain", "random"]))
    if shape == "chain":
        start = draw(st.integers(-1, old - 1))
        return [start] + [old + j for j in range(n - 1)]
    return [draw(st.integers(-1, old + j - 1)) for j in range(n)]


class CacheMachine(RuleBasedStateMachine):
    @initialize(first_round=st.sampled_from(["merge", "paged"]), backend=st.sampled_from(BACKENDS))
    def setup(self, first_round, backend):
        self.cache = PagedKVCache(LAYERS, H_KV, D, num_pages=PAGES, page_size=PAGE, dtype=torch.float32,
                                  backend=backend, first_round=first_round)
        self.model = ModelCache(LAYERS, H_Q, H_KV, D, PAGE, PAGES)
        self.next_id = 0

    def _ids(self, committed_only=False, with_tree=False):
        return [sid for sid, s in self.model.seqs.items()
                if (not committed_only or s.tree is None) and (not with_tree or s.tree is not None)]

    @precondition(lambda self: len(self.model.seqs) < MAX_SEQS)
    @rule()
    def add(self):
        self.model.add(self.cache, self.next_id)
        self.next_id += 1

    @precondition(lambda self: len(self.model.seqs) < MAX_SEQS and any(s.tree is None for s in self.model.seqs.values()))
    @rule(data=st.data())
    def fork(self, data):
        parent = data.draw(st.sampled_from(self._ids(committed_only=True)))
        length = self.model.seqs[parent].length
        pos = data.draw(st.one_of(st.none(), st.integers(0, length)))
        self.model.fork(self.cache, parent, self.next_id, pos)
        self.next_id += 1

    @precondition(lambda self: self.model.seqs)
    @rule(data=st.data(), seed=st.integers(0, 2**31 - 1))
    def forward(self, data, seed):
        ids = data.draw(st.lists(st.sampled_from(list(self.model.seqs)), min_size=1, max_size=4, unique=True))
        lengths, trees = [], []
        for sid in ids:
            old = self.model.seqs[sid].tree
            if old is None and data.draw(st.booleans()):
                lengths.append(data.draw(st.integers(1, 6)))
                trees.append(None)  # plain causal append
            else:
                n = data.draw(st.integers(1, 5 if old else 8))
                lengths.append(n)
                trees.append(data.draw(new_parents(0 if old is None else len(old), n)))
        fail_layer = data.draw(st.one_of(st.none(), st.integers(0, LAYERS - 1)))
        abort_after = data.draw(st.one_of(st.none(), st.none(), st.integers(0, LAYERS - 1)))
        free = self.cache.num_free_pages
        try:
            self.model.forward(self.cache, ids, lengths, trees, torch.Generator().manual_seed(seed),
                               fail_layer=fail_layer, abort_after=abort_after)
        except OutOfPagesError as exc:
            assert exc.free == free and exc.needed > free  # and nothing changed: checked by the invariant

    @precondition(lambda self: any(s.tree is not None for s in self.model.seqs.values()))
    @rule(data=st.data())
    def commit(self, data):
        ids = data.draw(st.lists(st.sampled_from(self._ids(with_tree=True)), min_size=1, unique=True))
        leaves = [data.draw(st.integers(-1, len(self.model.seqs[sid].tree) - 1)) for sid in ids]
        self.model.commit(self.cache, ids, leaves)

    @precondition(lambda self: any(s.tree is None for s in self.model.seqs.values()))
    @rule(data=st.data())
    def pop(self, data):
        sid = data.draw(st.sampled_from(self._ids(committed_only=True)))
        self.model.pop(self.cache, sid, data.draw(st.integers(0, self.model.seqs[sid].length)))

    @precondition(lambda self: self.model.seqs)
    @rule(data=st.data())
    def remove(self, data):
        self.model.remove(self.cache, data.draw(st.sampled_from(list(self.model.seqs))))

    @invariant()
    def agrees_with_model(self):
        if hasattr(self, "cache"):
            self.model.check(self.cache)

    def teardown(self):
        if hasattr(self, "cache"):
            if self.cache.in_forward:  # a failed step left its forward open
                self.cache.abort_forward()
            for sid in list(self.model.seqs):
                self.model.remove(self.cache, sid)
            assert self.cache.num_free_pages == PAGES


CacheMachine.TestCase.settings = settings(max_examples=30, stateful_step_count=20, deadline=None,
                                          suppress_health_check=[HealthCheck.too_slow])
TestCache = CacheMachine.TestCase
