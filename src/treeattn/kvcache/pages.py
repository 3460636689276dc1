"""Host-side bookkeeping of the paged KV cache: a refcounted page pool and per-sequence page tables.

Everything here is numpy on the host; the cache turns the resulting index arrays into device
tensors once per ``begin_forward``/``commit_accepted``. Nothing loops over tokens or pages in Python.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


class OutOfPagesError(RuntimeError):
    """The pool has fewer free pages than an operation needs; the cache was left unchanged.

    ``needed`` and ``free`` are page counts, so a scheduler can preempt sequences and retry.
    """

    def __init__(self, needed: int, free: int, num_pages: int, what: str):
        super().__init__(f"out of KV-cache pages: {what} needs {needed} new pages but only {free} of "
                         f"{num_pages} are free (remove, pop or commit sequences first, or make a larger cache)")
        self.needed, self.free = needed, free


class PagePool:
    """Pages ``0 .. num_pages-1`` with reference counts; a page is free iff its count is 0.

    Forked sequences share pages (count > 1); whoever writes into a shared page copies it first.
    """

    def __init__(self, num_pages: int):
        self.num_pages = num_pages
        self.refcount = np.zeros(num_pages, dtype=np.int64)
        # Free ids form a stack with its top at ``_free[_num_free - 1]``; low ids are handed out first.
        self._free = np.arange(num_pages - 1, -1, -1, dtype=np.int64)
        self._num_free = num_pages

    @property
    def num_free(self) -> int:
        return self._num_free

    def allocate(self, n: int) -> np.ndarray:
        """``n`` fresh pages (count 1). The caller has checked ``n <= num_free``."""
        if n > self._num_free:  # callers check before mutating anything; this is a bug guard
            raise OutOfPagesError(n, self._num_free, self.num_pages, "an allocation")
        ids = self._free[self._num_free - n:self._num_free][::-1].copy()
        self._num_free -= n
        self.refcount[ids] = 1
        return ids

    def share(self, ids: np.ndarray) -> None:
        np.add.at(self.refcount, ids, 1)

    def release(self, ids: np.ndarray) -> None:
        """Drop one reference per entry of ``ids``; pages whose count reaches 0 become free."""
        if ids.size == 0:
            return
        np.subtract.at(self.refcount, ids, 1)
        freed = np.unique(ids[self.refcount[ids] == 0])
        self._free[self._num_free:self._num_free + freed.size] = freed
        self._num_free += freed.size


def num_pages_for(length: int, page_size: int) -> int:
    return -(-length // page_size)


@dataclass
class SequenceState:
    """One sequence: its page table and, while a draft tree is pending, that tree.

    The tree (parent array over its nodes, tree-relative across rounds) is always the last
    ``tree_size`` tokens; ``order``/``depth`` are its DFS ``(enter, exit)`` and node depths.
    """

    pages: np.ndarray  # int64 page ids holding tokens 0 .. length-1 in order: exactly ceil(length / page_size)
    length: int = 0
    tree: np.ndarray | None = None
    order: np.ndarray | None = None
    depth: np.ndarray | None = None

    @property
    def tree_size(self) -> int:
        return 0 if self.tree is None else int(self.tree.shape[0])

    @property
    def committed_len(self) -> int:
        return self.length - self.tree_size

    def tree_state(self) -> tuple:
        return self.tree, self.order, self.depth

    def set_tree(self, state: tuple) -> None:
        self.tree, self.order, self.depth = state
