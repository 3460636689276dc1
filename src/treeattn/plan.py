"""Per-step metadata: validate the index arrays once, then run every layer against the result.

A forward step of a model calls tree attention once per layer with the same ``indptr``/tree/page
arrays. Checking those arrays needs their values on the host (one device sync on CUDA), so it is
done once here, FlashInfer-style: ``plan = TreeAttentionPlan.ragged(...)`` then pass ``plan=`` to
every call. The public functions build a plan themselves when none is given.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from .tree import MAX_TREE_SIZE

_INT_DTYPES = (torch.int32, torch.int64)


def check_index_tensor(x: Any, name: str, *, ndim: int = 1, device: torch.device | None = None) -> torch.Tensor:
    """An int32 index tensor on ``device`` (int64 accepted and narrowed; Python lists too)."""
    if isinstance(x, (list, tuple, np.ndarray)):
        x = torch.as_tensor(np.asarray(x, dtype=np.int64), device=device)
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be an int32 tensor, got {type(x).__name__}")
    if x.dtype not in _INT_DTYPES:
        raise TypeError(f"{name} must be an int32 tensor, got dtype {x.dtype}")
    if x.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {tuple(x.shape)}")
    if device is not None and x.device != device:
        raise ValueError(f"{name} is on {x.device}, expected {device} (all inputs of one call on one device)")
    if x.dtype == torch.int64:
        if x.numel() and (int(x.max()) > 2**31 - 1 or int(x.min()) < -(2**31)):
            raise ValueError(f"{name} has values outside the int32 range")
        x = x.to(torch.int32)
    return x.contiguous()


def _check_indptr(indptr: torch.Tensor, name: str, batch_size: int | None, total: int | None, what: str) -> np.ndarray:
    host = indptr.cpu().numpy().astype(np.int64)
    if host.shape[0] < 1:
        raise ValueError(f"{name} must have length batch_size + 1 >= 1, got an empty tensor")
    if batch_size is not None and host.shape[0] != batch_size + 1:
        raise ValueError(f"{name} has length {host.shape[0]}, expected batch_size + 1 = {batch_size + 1} (as q_indptr)")
    if host[0] != 0:
        raise ValueError(f"{name}[0] must be 0, got {host[0]}")
    steps = np.diff(host)
    if (steps < 0).any():
        b = int(np.nonzero(steps < 0)[0][0])
        raise ValueError(f"{name} must be non-decreasing, but {name}[{b + 1}] = {host[b + 1]} < {name}[{b}] = {host[b]}")
    if total is not None and host[-1] != total:
        raise ValueError(f"{name}[-1] = {host[-1]} must equal {what} = {total}")
    return host


def check_tree_order(order_host: np.ndarray, tree_starts: np.ndarray, tree_sizes: np.ndarray) -> None:
    """Each tree's ``(enter, exit)`` must be a DFS numbering: enters a permutation of ``0..n-1``,
    ``enter < exit <= n``, and intervals nested or disjoint (then they describe a forest)."""
    for b, (start, n) in enumerate(zip(tree_starts.tolist(), tree_sizes.tolist())):
        if n == 0:
            continue
        enter, exit_ = order_host[start:start + n, 0], order_host[start:start + n, 1]
        where = f"tree_order[{start}:{start + n}] (request {b})"
        if not np.array_equal(np.sort(enter), np.arange(n)):
            raise ValueError(f"{where}: enter values must be a permutation of 0..{n - 1}")
        if (exit_ <= enter).any() or (exit_ > n).any():
            raise ValueError(f"{where}: each exit must satisfy enter < exit <= tree size {n}")
        # Laminar: a node that starts inside another's interval must also end inside it.
        inside = (enter[None, :] > enter[:, None]) & (enter[None, :] < exit_[:, None])
        if (inside & (exit_[None, :] > exit_[:, None])).any():
            raise ValueError(f"{where}: intervals overlap without nesting; not a DFS (enter, exit) order")


@dataclass(eq=False)
class TreeAttentionPlan:
    """Validated metadata of one batch: device index tensors plus their host copies.

    ``kind`` is ``"ragged"`` (keys and values in ``k``/``v`` tensors) or ``"paged"``.
    Host arrays are int64 numpy arrays of length ``batch_size``.
    """

    kind: str
    device: torch.device
    q_indptr: torch.Tensor
    tree_indptr: torch.Tensor
    tree_order: torch.Tensor
    q_starts: np.ndarray
    qo_lens: np.ndarray
    kv_lens: np.ndarray
    tree_starts: np.ndarray
    tree_sizes: np.ndarray
    kv_indptr: torch.Tensor | None = None
    kv_starts: np.ndarray | None = None
    page_indptr: torch.Tensor | None = None
    page_indices: torch.Tensor | None = None
    last_page_len: torch.Tensor | None = None
    page_size: int | None = None
    page_starts: np.ndarray | None = None
    num_pages: np.ndarray | None = None
    page_indices_host: np.ndarray | None = None
    # Backends keep derived data here (work partitions, device copies), computed once per plan.
    cache: dict[str, Any] = field(default_factory=dict, repr=False)

    @property
    def batch_size(self) -> int:
        return int(self.qo_lens.shape[0])

    @property
    def total_q(self) -> int:
        return int(self.qo_lens.sum())

    @staticmethod
    def _trees(q_host, tree_indptr, tree_order, device, kv_lens) -> tuple[torch.Tensor, torch.Tensor, np.ndarray]:
        batch = q_host.shape[0] - 1
        tree_indptr = check_index_tensor(tree_indptr, "tree_indptr", device=device)
        tree_order = check_index_tensor(tree_order, "tree_order", ndim=2, device=device)
        if tree_order.shape[1] != 2:
            raise ValueError(f"tree_order must have shape [N, 2] (enter, exit), got {tuple(tree_order.shape)}")
        t_host = _check_indptr(tree_indptr, "tree_indptr", batch, tree_order.shape[0], "tree_order.shape[0]")
        qo, n = np.diff(q_host), np.diff(t_host)
        for b in range(batch):
            if n[b] > MAX_TREE_SIZE:
                raise ValueError(f"request {b}: tree of {n[b]} nodes exceeds the maximum {MAX_TREE_SIZE}")
            if n[b] and not qo[b] <= n[b] <= kv_lens[b]:  # n == 0: no mask, plain full attention
                raise ValueError(
                    f"request {b}: need qo_len <= tree size <= kv_len (query rows are the last tree nodes, "
                    f"the tree is the last KV positions), got qo_len={qo[b]}, tree size={n[b]}, kv_len={kv_lens[b]}"
                )
        check_tree_order(tree_order.cpu().numpy().astype(np.int64), t_host[:-1], n)
        return tree_indptr, tree_order, t_host

    @classmethod
    def ragged(cls, q_indptr, kv_indptr, tree_indptr, tree_order, *, total_q: int | None = None,
               total_kv: int | None = None, device: torch.device | None = None) -> TreeAttentionPlan:
        """Plan a ragged batch (``tree_attention``); totals, when given, are checked against the indptrs."""
        q_indptr = check_index_tensor(q_indptr, "q_indptr", device=device)
        device = q_indptr.device
        kv_indptr = check_index_tensor(kv_indptr, "kv_indptr", device=device)
        q_host = _check_indptr(q_indptr, "q_indptr", None, total_q, "q.shape[0]")
        kv_host = _check_indptr(kv_indptr, "kv_indptr", q_host.shape[0] - 1, total_kv, "k.shape[0]")
        kv_lens = np.diff(kv_host)
        tree_indptr, tree_order, t_host = cls._trees(q_host, tree_indptr, tree_order, device, kv_lens)
        return cls("ragged", device, q_indptr, tree_indptr, tree_order, q_host[:-1], np.diff(q_host), kv_lens,
                   t_host[:-1], np.diff(t_host), kv_indptr=kv_indptr, kv_starts=kv_host[:-1])

    @classmethod
    def paged(cls, q_indptr, page_indptr, page_indices, last_page_len, tree_indptr, tree_order, *,
              page_size: int, num_pages: int, total_q: int | None = None,
              device: torch.device | None = None) -> TreeAttentionPlan:
        """Plan a paged batch (``paged_tree_attention``) over a pool of ``num_pages`` pages of ``page_size``."""
        q_indptr = check_index_tensor(q_indptr, "q_indptr", device=device)
        device = q_indptr.device
        page_indptr = check_index_tensor(page_indptr, "page_indptr", device=device)
        page_indices = check_index_tensor(page_indices, "page_indices", device=device)
        last_page_len = check_index_tensor(last_page_len, "last_page_len", device=device)
        q_host = _check_indptr(q_indptr, "q_indptr", None, total_q, "q.shape[0]")
        batch = q_host.shape[0] - 1
        p_host = _check_indptr(page_indptr, "page_indptr", batch, page_indices.shape[0], "page_indices.shape[0]")
        ids = page_indices.cpu().numpy().astype(np.int64)
        if ids.size and (ids.min() < 0 or ids.max() >= num_pages):
            bad = int(np.nonzero((ids < 0) | (ids >= num_pages))[0][0])
            raise ValueError(f"page_indices[{bad}] = {ids[bad]} is out of range for kv_pages with {num_pages} pages")
        if last_page_len.shape[0] != batch:
            raise ValueError(f"last_page_len has length {last_page_len.shape[0]}, expected batch_size = {batch}")
        last = last_page_len.cpu().numpy().astype(np.int64)
        npages = np.diff(p_host)
        for b in range(batch):
            lo = 1 if npages[b] else 0
            hi = page_size if npages[b] else 0
            if not lo <= last[b] <= hi:
                raise ValueError(
                    f"last_page_len[{b}] = {last[b]} must be in [{lo}, {hi}] for a request with {npages[b]} pages "
                    f"of size {page_size}"
                )
        kv_lens = np.where(npages > 0, (npages - 1) * page_size + last, 0)
        tree_indptr, tree_order, t_host = cls._trees(q_host, tree_indptr, tree_order, device, kv_lens)
        return cls("paged", device, q_indptr, tree_indptr, tree_order, q_host[:-1], np.diff(q_host), kv_lens,
                   t_host[:-1], np.diff(t_host), page_indptr=page_indptr, page_indices=page_indices,
                   last_page_len=last_page_len, page_size=page_size, page_starts=p_host[:-1], num_pages=npages,
                   page_indices_host=ids)

    def same_q_and_kv_layout(self) -> bool:
        return self.kv_starts is not None and np.array_equal(self.q_starts, self.kv_starts) and np.array_equal(self.qo_lens, self.kv_lens)
