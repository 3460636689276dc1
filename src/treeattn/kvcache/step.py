"""Turn one forward of the paged KV cache into a ``StepPlan`` (kernel plans and new-token slots), once.

Two ways to attend, as in TVM's runtime (docs/semantics.md, "KV-cache runtime"):

* **append first** (one kernel per layer): write the new K/V into the pages, then run the paged
  tree kernel over each sequence's whole cache with its accumulated tree as the last keys and the
  new tokens as query rows (``qo_len <= tree size``). Required when a tree continues from an earlier
  round (its old nodes are only in the pages).
* **merge** (first round only, ``first_round="merge"``): ragged tree attention over the new tokens
  alone (``q = k = new``), unmasked paged attention over the cached prefix, and a base-2 LSE merge;
  the K/V are written after. This is TVM's path for a fresh tree; it is used only when no sequence
  of the batch continues a tree, not every append is a single token (decode) and no plain append
  needs chunking.

A plain (non-tree) append is a chain over its new tokens, so both paths are tree attention. A chain
longer than ``CHAIN_CHUNK`` is cut into several kernel requests on the same pages (each chunk sees
the whole cache before it plus a causal chain over itself), which keeps every kernel tree small.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..layout import SlotIndex, slots
from ..plan import TreeAttentionPlan
from ..tree import CHAIN_CHUNK, chain_chunks, chain_order
from .pages import num_pages_for


@dataclass
class Step:
    """One sequence's part of a forward, after its pages were allocated."""

    pages: np.ndarray  # page table covering ``new_len`` tokens
    old_len: int
    new_len: int
    order: np.ndarray | None  # (enter, exit) of the accumulated tree; None: a plain causal append

    @property
    def append(self) -> int:
        return self.new_len - self.old_len


@dataclass
class StepPlan:
    """How one forward of the cache attends: its kernel plans and where its new tokens go."""

    append_first: bool
    paged: TreeAttentionPlan | None  # append first: everything; merge: the cached prefix (None when empty)
    ragged: TreeAttentionPlan | None  # merge only: the new tokens with their trees
    new_slots: SlotIndex  # where the new tokens' K/V are stored, on the cache's device


def _indptr(lengths) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(np.asarray(lengths, dtype=np.int64))])


def _i32(arr) -> np.ndarray:
    """Host index array for a plan, which validates it on the host and uploads it once."""
    return np.ascontiguousarray(arr, dtype=np.int32)


def _cat_orders(orders: list[np.ndarray]) -> np.ndarray:
    return np.concatenate(orders) if orders else np.zeros((0, 2), dtype=np.int64)


def _paged_plan(requests, page_size: int, num_pages: int, device: torch.device) -> TreeAttentionPlan:
    """``requests``: ``(q_len, kv_len, pages, order)`` per kernel request, ``order`` of the last keys."""
    q_lens = [r[0] for r in requests]
    counts = [num_pages_for(r[1], page_size) for r in requests]
    page_ids = [r[2][:c] for r, c in zip(requests, counts)]
    last = [kv - (c - 1) * page_size if c else 0 for (_, kv, _, _), c in zip(requests, counts)]
    orders = [r[3] for r in requests if r[3] is not None]
    tree_sizes = [0 if r[3] is None else r[3].shape[0] for r in requests]
    return TreeAttentionPlan.paged(
        _i32(_indptr(q_lens)), _i32(_indptr(counts)), _i32(np.concatenate(page_ids) if page_ids else np.zeros(0)),
        _i32(last), _i32(_indptr(tree_sizes)), _i32(_cat_orders(orders)),
        page_size=page_size, num_pages=num_pages, total_q=sum(q_lens), device=device)


def _append_first_requests(steps: list[Step]) -> list[tuple]:
    requests = []
    for s in steps:
        if s.order is not None:
            requests.append((s.append, s.new_len, s.pages, s.order))
            continue
        for lo, order in chain_chunks(s.append):
            rows = order.shape[0]
            requests.append((rows, s.old_len + lo + rows, s.pages, order))
    return requests


def plan_step(steps: list[Step], *, page_size: int, num_pages: int, device: torch.device,
              merge_first_round: bool) -> StepPlan:
    continuing = any(s.order is not None and s.order.shape[0] > s.append for s in steps)
    long_chain = any(s.order is None and s.append > CHAIN_CHUNK for s in steps)
    decode = all(s.append == 1 for s in steps)  # one token each: a single paged call is cheapest
    append_first = not merge_first_round or continuing or long_chain or decode

    slot_ids = np.concatenate([slots(s.pages, np.arange(s.old_len, s.new_len), page_size) for s in steps])
    new_slots = SlotIndex.of(slot_ids, page_size, device)

    if append_first:
        paged = _paged_plan(_append_first_requests(steps), page_size, num_pages, device)
        return StepPlan(True, paged, None, new_slots)

    appends = _indptr([s.append for s in steps])
    orders = [chain_order(s.append) if s.order is None else s.order for s in steps]
    tree_sizes = _indptr([o.shape[0] for o in orders])
    ragged = TreeAttentionPlan.ragged(
        _i32(appends), _i32(appends), _i32(tree_sizes), _i32(_cat_orders(orders)),
        total_q=int(appends[-1]), total_kv=int(appends[-1]), device=device)
    paged = None
    if any(s.old_len for s in steps):  # tree size 0: every cached token is visible
        paged = _paged_plan([(s.append, s.old_len, s.pages, None) for s in steps], page_size, num_pages, device)
    return StepPlan(False, paged, ragged, new_slots)
