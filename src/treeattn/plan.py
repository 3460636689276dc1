"""Per-step metadata: validate the index arrays once, then run every layer against the result.

A forward step of a model calls tree attention once per layer with the same ``indptr``/tree/page
arrays. Checking those arrays needs their values on the host (one device sync on CUDA), so it is
done once here, FlashInfer-style: ``plan = TreeAttentionPlan.ragged(...)`` then pass ``plan=`` to
every call. The public functions build a plan themselves when none is given. Index arrays given as
numpy arrays or lists (as the KV cache does every step) are checked on the host and uploaded once,
with no device-to-host copy at all.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, NamedTuple

import numpy as np
import torch

from .tree import MAX_TREE_SIZE, check_tree_order, path_sums

_INT_DTYPES = (torch.int32, torch.int64)


def _host_ints(x: Any, name: str) -> np.ndarray:
    """A list or numpy array of integers as int64 numpy (floats refused: casting would truncate)."""
    arr = np.asarray(x)
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        raise TypeError(f"{name} must hold integers, got {arr.dtype}")
    return arr.astype(np.int64)


def check_index_tensor(x: Any, name: str, *, ndim: int = 1, device: torch.device | None = None) -> torch.Tensor:
    """An int32 index tensor on ``device`` (int64 accepted and narrowed; Python lists too)."""
    if isinstance(x, (list, tuple, np.ndarray)):
        x = torch.as_tensor(_host_ints(x, name), device=device)
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


def _index_pair(x: Any, name: str, *, ndim: int = 1, device: torch.device | None = None) -> tuple[torch.Tensor, np.ndarray]:
    """``check_index_tensor`` plus the values as int64 on the host, with one transfer: host input
    (lists, numpy: what the KV cache passes every step) is checked there and uploaded once; a
    tensor is downloaded once. Never a round trip host -> device -> host (a sync each on CUDA).
    The tensor returned never aliases the caller's: a plan owns its arrays."""
    if isinstance(x, (list, tuple, np.ndarray)):
        host = _host_ints(x, name)
        tensor = check_index_tensor(torch.from_numpy(host), name, ndim=ndim)
        return (tensor if device is None else tensor.to(device)), host
    tensor = check_index_tensor(x, name, ndim=ndim, device=device)
    if tensor.device.type == "meta":
        raise ValueError(f"{name} is a meta tensor, which holds no values; index arrays need real values")
    if tensor is x:
        tensor = tensor.clone()
    return tensor, tensor.cpu().numpy().astype(np.int64)


class _Input(NamedTuple):
    """What a plan was built from, to recognise the same array when it is passed again."""

    source: Any
    version: int | None  # torch's in-place-modification counter of a tensor source
    host: np.ndarray

    @classmethod
    def of(cls, source: Any, host: np.ndarray) -> _Input:
        # A tensor made under inference_mode (vLLM's step metadata) has no version counter: a CPU one is
        # recognised by its values instead (see TreeAttentionPlan.check_inputs).
        tracked = isinstance(source, torch.Tensor) and not source.is_inference()
        return cls(source, source._version if tracked else None, host)


def _positive_int(x: Any, name: str, minimum: int = 1) -> int:
    if isinstance(x, bool) or not isinstance(x, (int, np.integer)):
        raise TypeError(f"{name} must be an int, got {type(x).__name__}")
    if x < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {x}")
    return int(x)


def _check_indptr(host: np.ndarray, name: str, batch_size: int | None, total: int | None, what: str) -> np.ndarray:
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


@dataclass(eq=False)
class TreeAttentionPlan:
    """Validated metadata of one batch: device index tensors plus their host copies.

    ``kind`` is ``"ragged"`` (keys and values in ``k``/``v`` tensors) or ``"paged"``.
    Host arrays are int64 numpy arrays of length ``batch_size``. Backends keep what they derive
    from a plan (work lists, device tables) through ``state``: built once, shared by every layer
    and every thread. A plan keeps its own copies of the index arrays, so changing the caller's
    arrays afterwards cannot change it (``check_inputs`` catches a mismatch).
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
    page_id_bound: int = 0  # one past the largest page id used: a reused plan needs kv_pages this large
    _inputs: dict[str, _Input] = field(default_factory=dict, repr=False)
    _states: dict[tuple, Any] = field(default_factory=dict, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @property
    def batch_size(self) -> int:
        return int(self.qo_lens.shape[0])

    @cached_property
    def total_q(self) -> int:
        return int(self.qo_lens.sum())

    @cached_property
    def total_kv(self) -> int:
        return int(self.kv_lens.sum())

    @staticmethod
    def _trees(q_host, tree_indptr, tree_order, device, kv_lens) -> tuple[torch.Tensor, torch.Tensor, np.ndarray]:
        batch = q_host.shape[0] - 1
        tree_indptr, t_host = _index_pair(tree_indptr, "tree_indptr", device=device)
        tree_order, order_host = _index_pair(tree_order, "tree_order", ndim=2, device=device)
        if tree_order.shape[1] != 2:
            raise ValueError(f"tree_order must have shape [N, 2] (enter, exit), got {tuple(tree_order.shape)}")
        t_host = _check_indptr(t_host, "tree_indptr", batch, tree_order.shape[0], "tree_order.shape[0]")
        qo, n = np.diff(q_host), np.diff(t_host)
        too_big = np.flatnonzero(n > MAX_TREE_SIZE)
        if too_big.size:
            b = int(too_big[0])
            raise ValueError(f"request {b}: tree of {n[b]} nodes exceeds the maximum {MAX_TREE_SIZE}")
        misplaced = np.flatnonzero((n > 0) & ((qo > n) | (n > kv_lens)))  # n == 0: no mask, plain full attention
        if misplaced.size:
            b = int(misplaced[0])
            raise ValueError(
                f"request {b}: need qo_len <= tree size <= kv_len (query rows are the last tree nodes, "
                f"the tree is the last KV positions), got qo_len={qo[b]}, tree size={n[b]}, kv_len={kv_lens[b]}"
            )
        check_tree_order(order_host, t_host[:-1], n)
        return tree_indptr, tree_order, t_host, order_host

    @classmethod
    def ragged(cls, q_indptr, kv_indptr, tree_indptr, tree_order, *, total_q: int | None = None,
               total_kv: int | None = None, device: torch.device | None = None) -> TreeAttentionPlan:
        """Plan a ragged batch (``tree_attention``); totals, when given, are checked against the indptrs."""
        q_src, kv_src = q_indptr, kv_indptr
        q_indptr, q_host = _index_pair(q_indptr, "q_indptr", device=device)
        device = q_indptr.device
        kv_indptr, kv_host = _index_pair(kv_indptr, "kv_indptr", device=device)
        q_host = _check_indptr(q_host, "q_indptr", None, total_q, "q.shape[0]")
        kv_host = _check_indptr(kv_host, "kv_indptr", q_host.shape[0] - 1, total_kv, "k.shape[0]")
        kv_lens = np.diff(kv_host)
        sources = {"q_indptr": q_src, "kv_indptr": kv_src, "tree_indptr": tree_indptr, "tree_order": tree_order}
        tree_indptr, tree_order, t_host, order_host = cls._trees(q_host, tree_indptr, tree_order, device, kv_lens)
        plan = cls("ragged", device, q_indptr, tree_indptr, tree_order, q_host[:-1], np.diff(q_host), kv_lens,
                   t_host[:-1], np.diff(t_host), kv_indptr=kv_indptr, kv_starts=kv_host[:-1])
        plan._record(sources, q_indptr=q_host, kv_indptr=kv_host, tree_indptr=t_host, tree_order=order_host)
        return plan

    @classmethod
    def _ragged_unchecked(cls, q_indptr: np.ndarray, kv_indptr: np.ndarray, tree_indptr: np.ndarray,
                          tree_order: np.ndarray, device: torch.device) -> TreeAttentionPlan:
        """``ragged`` for host int64 arrays that a treeattn module built itself and vouches for, with no
        checks (a draft head's cache plans every drafting level, where ``ragged``'s checks took as long
        as the attention): pass it to ``tree_attention`` with ``None`` for the arrays."""
        up = lambda host: torch.from_numpy(host.astype(np.int32)).to(device)
        plan = cls("ragged", device, up(q_indptr), up(tree_indptr), up(tree_order), q_indptr[:-1], np.diff(q_indptr),
                   np.diff(kv_indptr), tree_indptr[:-1], np.diff(tree_indptr), kv_indptr=up(kv_indptr),
                   kv_starts=kv_indptr[:-1])
        plan._record(dict.fromkeys(("q_indptr", "kv_indptr", "tree_indptr", "tree_order")), q_indptr=q_indptr,
                     kv_indptr=kv_indptr, tree_indptr=tree_indptr, tree_order=tree_order)
        return plan

    @classmethod
    def paged(cls, q_indptr, page_indptr, page_indices, last_page_len, tree_indptr, tree_order, *,
              page_size: int, num_pages: int, total_q: int | None = None,
              device: torch.device | None = None) -> TreeAttentionPlan:
        """Plan a paged batch (``paged_tree_attention``) over a pool of ``num_pages`` pages of ``page_size``."""
        sources = {"q_indptr": q_indptr, "page_indptr": page_indptr, "page_indices": page_indices,
                   "last_page_len": last_page_len, "tree_indptr": tree_indptr, "tree_order": tree_order}
        page_size = _positive_int(page_size, "page_size")
        num_pages = _positive_int(num_pages, "num_pages", minimum=0)
        q_indptr, q_host = _index_pair(q_indptr, "q_indptr", device=device)
        device = q_indptr.device
        page_indptr, p_host = _index_pair(page_indptr, "page_indptr", device=device)
        page_indices, ids = _index_pair(page_indices, "page_indices", device=device)
        last_page_len, last = _index_pair(last_page_len, "last_page_len", device=device)
        q_host = _check_indptr(q_host, "q_indptr", None, total_q, "q.shape[0]")
        batch = q_host.shape[0] - 1
        p_host = _check_indptr(p_host, "page_indptr", batch, page_indices.shape[0], "page_indices.shape[0]")
        if ids.size and (ids.min() < 0 or ids.max() >= num_pages):
            bad = int(np.nonzero((ids < 0) | (ids >= num_pages))[0][0])
            raise ValueError(f"page_indices[{bad}] = {ids[bad]} is out of range for kv_pages with {num_pages} pages")
        if last_page_len.shape[0] != batch:
            raise ValueError(f"last_page_len has length {last_page_len.shape[0]}, expected batch_size = {batch}")
        npages = np.diff(p_host)
        lo, hi = (npages > 0).astype(np.int64), np.where(npages > 0, page_size, 0)  # [0, 0] without pages
        bad_last = np.flatnonzero((last < lo) | (last > hi))
        if bad_last.size:
            b = int(bad_last[0])
            raise ValueError(
                f"last_page_len[{b}] = {last[b]} must be in [{lo[b]}, {hi[b]}] for a request with {npages[b]} pages "
                f"of size {page_size}"
            )
        kv_lens = np.where(npages > 0, (npages - 1) * page_size + last, 0)
        tree_indptr, tree_order, t_host, order_host = cls._trees(q_host, tree_indptr, tree_order, device, kv_lens)
        plan = cls("paged", device, q_indptr, tree_indptr, tree_order, q_host[:-1], np.diff(q_host), kv_lens,
                   t_host[:-1], np.diff(t_host), page_indptr=page_indptr, page_indices=page_indices,
                   last_page_len=last_page_len, page_size=page_size, page_starts=p_host[:-1], num_pages=npages,
                   page_indices_host=ids, page_id_bound=int(ids.max()) + 1 if ids.size else 0)
        plan._record(sources, q_indptr=q_host, page_indptr=p_host, page_indices=ids, last_page_len=last,
                     tree_indptr=t_host, tree_order=order_host)
        return plan

    @cached_property
    def node_depths(self) -> np.ndarray:
        """Depth of every tree node (roots 0), int64 ``[N]`` in ``tree_order``'s rows: its ancestors-or-self
        counted by the interval test, less one."""
        order = self._inputs["tree_order"].host.reshape(-1, 2)
        indptr = np.concatenate([self.tree_starts, [order.shape[0]]])
        return path_sums(order, indptr, np.ones(order.shape[0])).astype(np.int64) - 1

    @cached_property
    def row_positions(self) -> np.ndarray:
        """Position of every query row, int64 ``[total_q]``: its node's ``prefix + depth``; without a tree,
        the last key's ``kv_len - 1`` (the window's positions; ``positions`` states the whole rule)."""
        req = np.repeat(np.arange(self.batch_size), self.qo_lens)
        local = np.arange(req.shape[0]) - self.q_starts[req]  # q_indptr starts at 0: rows are contiguous
        n, kv = self.tree_sizes[req], self.kv_lens[req]
        pos = kv - 1
        tree = n > 0
        node = (self.tree_starts[req] + local + n - self.qo_lens[req])[tree]  # row r is node r + n - qo_len
        pos[tree] = (kv - n)[tree] + self.node_depths[node]
        return pos

    def positions(self, b: int) -> tuple[np.ndarray, np.ndarray]:
        """Request ``b``'s positions (for sliding windows): ``(row positions [qo_len], key positions [kv_len])``.
        Prefix key ``j`` is at ``j``, tree node ``i`` at ``prefix + depth(i)``, a query row at its node's
        position; without a tree every row sits at the last key's position ``kv_len - 1``."""
        qs, qo, kv, n, start = (int(x[b]) for x in (self.q_starts, self.qo_lens, self.kv_lens, self.tree_sizes,
                                                    self.tree_starts))
        keys = np.arange(kv, dtype=np.int64)
        keys[kv - n:] = kv - n + self.node_depths[start:start + n]
        return self.row_positions[qs:qs + qo], keys

    def same_q_and_kv_layout(self) -> bool:
        return self.kv_starts is not None and np.array_equal(self.q_starts, self.kv_starts) and np.array_equal(self.qo_lens, self.kv_lens)

    # ------------------------------------------------------------------ inputs passed with plan=

    def _record(self, sources: dict[str, Any], **hosts: np.ndarray) -> None:
        self._inputs = {name: _Input.of(sources[name], host) for name, host in hosts.items()}

    def check_inputs(self, **arrays: Any) -> None:
        """Index arrays passed together with this plan must be the ones it was built from: the same
        tensor, unchanged since (free to check), or equal values when they live on the host or the
        CPU. ``None`` means "the plan's own". Anything else raises ``ValueError``: a plan never
        silently overrides the arrays of a call."""
        for name, x in arrays.items():
            if x is None:
                continue
            rec = self._inputs[name]
            if x is rec.source:
                if rec.version is not None and x._version == rec.version:
                    continue
                if rec.version is None and not (isinstance(x, torch.Tensor) and x.device.type == "cpu"):
                    continue  # untracked: a host array, or a device tensor made under inference_mode
            if isinstance(x, torch.Tensor) and x.device.type != "cpu":
                raise ValueError(f"{name} is not the tensor this plan was built from, or was changed in place since: "
                                 f"pass None (the plan's own {name}) or build a new plan")
            host = (x.detach().numpy() if isinstance(x, torch.Tensor) else np.asarray(x)).astype(np.int64).reshape(-1)
            if host.shape != rec.host.reshape(-1).shape or not np.array_equal(host, rec.host.reshape(-1)):
                raise ValueError(f"{name} holds other values than the {name} this plan was built from: pass None "
                                 f"(the plan's own) or build a new plan with TreeAttentionPlan.{self.kind}(...)")

    # ------------------------------------------------------------------ backend state

    def state(self, backend, spec) -> Any:
        """The per-step state ``backend`` (a ``backends.Backend``) derives from this plan for calls like
        ``spec`` (an ``AttentionSpec``): built on first use (under a lock, so threads sharing the plan build
        it once) and reused by every later layer. The plan sits below the backends: it names neither. Keyed
        by the backend object: two configured differently (``NativeBackend(isa=...)``) derive their own."""
        key = (backend, spec)
        try:
            return self._states[key]
        except KeyError:
            pass
        with self._lock:
            if key not in self._states:
                self._states[key] = backend.plan(self, spec)
            return self._states[key]
