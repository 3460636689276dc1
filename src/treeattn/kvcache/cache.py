"""Paged KV cache for tree speculative decoding: draft trees over several rounds, then commit.

The runtime TVM's ``PagedKVCache`` provides around its tree kernels (docs/semantics.md, "KV-cache
runtime"), with its runtime bugs fixed: every sequence of a commit is compacted (Q1), trees keep their masks
whatever else is in the batch (Q2), node indices are relative to the whole uncommitted tree and a
commit drops all of it but the accepted path (Q3), and plain appends are always causal (Q4).

A step of tree speculative decoding::

    info = cache.begin_forward(ids, lengths, tree_parents=[parents_0, parents_1, ...])
    for layer in range(num_layers):          # rope q/k at info.positions (or pass rope= to the cache)
        out = cache.attention(layer, q, k, v)
    cache.end_forward()
    cache.commit_accepted(ids, leaves)       # leaf index per sequence, -1 keeps no draft token

Semantics, precisely:

* ``tree_parents[b]`` is a parent array over sequence ``b``'s new tokens, in the indices of the
  sequence's *accumulated uncommitted tree*: the nodes of earlier rounds come first, then the new
  ones, and ``-1`` makes a node a child of the committed prefix. A ``None`` entry (or
  ``tree_parents=None``) is a plain causal append that needs no commit; it is an error while the
  sequence has an uncommitted tree. A tree that happens to be a chain is still a tree: it stays
  uncommitted until ``commit_accepted``.
* Each new token sees the whole committed prefix and its own ancestors-or-self in the tree; its
  RoPE position is ``committed_len + depth`` (``info.positions``), its final position if accepted.
* ``commit_accepted`` keeps the root-to-leaf path, moves it to positions ``committed_len ..
  committed_len + depth`` (one batched copy over all layers) and drops the rest of the tree.
* ``fork_sequence`` shares the parent's pages copy-on-write (reference counts), including a
  partially filled last page: whichever sequence writes first into a shared page copies it (one
  page, all layers). Forking a sequence with an uncommitted tree is an error.
* Misuse raises ``ValueError``/``TypeError`` (bad arguments), ``RuntimeError`` (wrong call order)
  or ``OutOfPagesError`` (a ``RuntimeError`` with ``needed``/``free``), always before anything
  changes. Between ``begin_forward`` and ``end_forward`` only ``attention``, ``end_forward``,
  ``abort_forward`` and read-only queries are allowed. Layers may run in any order, each exactly
  once; a failed ``attention`` call leaves its layer not run and can be retried (it may already have
  stored that layer's new K/V, in slots only this forward owns, which the retry overwrites).
  ``end_forward`` refuses while a layer has not run; ``abort_forward`` rolls the whole forward back.
"""

from __future__ import annotations

import functools
import operator
import threading
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from .. import ops
from ..backends import AttentionSpec, select
from ..checks import int_vector
from ..layout import PagedKV, slots
from ..ops import FLOAT_DTYPES, check_float, check_heads, resolve_sm_scale
from ..rope import RoPE
from ..tree import TokenTree, ancestor_path, as_parents, encode_trees
from .pages import OutOfPagesError, PagePool, SequenceState, num_pages_for
from .step import Step, StepPlan, plan_step

__all__ = ["ForwardInfo", "OutOfPagesError", "PagedKVCache"]


@dataclass(frozen=True, eq=False)
class ForwardInfo:
    """What ``begin_forward`` planned. Sequence ``b``'s tokens are rows ``q_indptr[b]:q_indptr[b+1]``
    of ``q``/``k``/``v``; ``positions`` (int32, on the cache's device) is each new token's RoPE position."""

    seq_ids: tuple
    append_lengths: tuple[int, ...]
    q_indptr: torch.Tensor
    positions: torch.Tensor

    @property
    def num_tokens(self) -> int:
        return sum(self.append_lengths)


@dataclass(eq=False)
class _OpenForward:
    """The cache's state between ``begin_forward`` and ``end_forward``/``abort_forward``."""

    info: ForwardInfo
    step: StepPlan
    seqs: list[SequenceState]
    undo: list[tuple[int, tuple]]  # per sequence: length and tree state before the forward
    done: np.ndarray  # bool per layer
    thread: int  # the thread that opened it: only it may run the layers
    cos_sin: tuple[torch.Tensor, torch.Tensor] | None = None  # with rope: computed by the first layer, shared


def _exclusive(method):
    """Run ``method`` holding the cache's lock, failing at once if another thread holds it: the cache
    is not thread-safe (a forward spans many calls), so concurrent use is an error, not a silent mix."""

    @functools.wraps(method)
    def run(self, *args, **kwargs):
        if not self._lock.acquire(blocking=False):
            raise RuntimeError(f"PagedKVCache.{method.__name__}() was called while another thread is using this "
                               "cache; a cache is not thread-safe: use one cache per thread or serialise the calls")
        try:
            fwd = self._fwd
            if fwd is not None and fwd.thread != threading.get_ident():
                raise RuntimeError(f"PagedKVCache.{method.__name__}() was called from another thread than the one "
                                   "that opened the forward (begin_forward); a cache is not thread-safe")
            return method(self, *args, **kwargs)
        finally:
            self._lock.release()

    return run


def _int(x, name: str) -> int:
    if isinstance(x, bool):
        raise TypeError(f"{name} must be an int, got a bool")
    try:
        return operator.index(x)
    except TypeError:
        raise TypeError(f"{name} must be an int, got {type(x).__name__}") from None


def _int_vector(x, name: str) -> np.ndarray:
    """A 1-D int64 array from a list, numpy array, tensor or ``TokenTree`` (values unchecked)."""
    return int_vector(x.parents if isinstance(x, TokenTree) else x, name)


def _id_list(seq_ids, name: str) -> list:
    if isinstance(seq_ids, (torch.Tensor, np.ndarray)):
        seq_ids = seq_ids.tolist()
    if isinstance(seq_ids, (str, bytes)) or not isinstance(seq_ids, Sequence):
        raise TypeError(f"{name} must be a list of sequence ids, got {type(seq_ids).__name__}")
    return list(seq_ids)


class PagedKVCache:
    """Paged K/V storage for ``num_layers`` layers with draft-tree forwards and commits.

    ``kv_pages`` is one ``[num_layers, num_pages, 2, num_kv_heads, page_size, head_dim]`` tensor, so
    ``kv_pages[layer]`` is exactly the layout ``treeattn.paged_tree_attention`` reads.
    ``backend`` picks the kernels (``None``: the fastest for ``device``). With ``rope``, ``attention``
    rotates q and k at ``info.positions`` and the cache stores rotated keys (TVM's NORMAL mode);
    without it the caller rotates them. ``first_round`` picks how a tree's first round attends:
    ``"paged"`` (append its K/V, then one paged tree-attention call; the faster one on CPU, see
    ``bench/results/cache.md``) or ``"merge"`` (TVM's path: ragged attention over the new tokens,
    unmasked paged attention over the prefix, LSE merge). Later rounds always append first.
    ``num_q_heads`` (optional) lets ``begin_forward`` do the backends' per-step host work for the
    whole forward, so that ``attention`` only runs kernels.

    Attention variants are per layer, passed to ``attention`` (Gemma alternates sliding-window and
    global layers). ``v_head_dim < head_dim`` makes an MLA cache: it stores one latent per token and
    head, ``kv_pages`` is ``[num_layers, num_pages, num_kv_heads, page_size, head_dim]`` and V is the
    latent's first ``v_head_dim`` dims (``attention`` then takes ``v=None``).

    Thread safety: a cache is used by one thread at a time. A call made while another thread is inside
    the cache, or a layer run by another thread than the one that opened the forward, raises
    ``RuntimeError`` at once (nothing changes); use one cache per thread or serialise the calls.
    """

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, *, num_pages: int, page_size: int = 16,
                 dtype: torch.dtype = torch.float16, device: torch.device | str = "cpu", backend: str | None = None,
                 rope: RoPE | None = None, first_round: str = "paged", num_q_heads: int | None = None,
                 v_head_dim: int | None = None):
        sizes = {"num_layers": num_layers, "num_kv_heads": num_kv_heads, "head_dim": head_dim,
                 "num_pages": num_pages, "page_size": page_size}
        for name, value in (("num_q_heads", num_q_heads), ("v_head_dim", v_head_dim)):
            if value is not None:
                sizes[name] = value
        for name, value in sizes.items():
            if _int(value, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if dtype not in FLOAT_DTYPES:
            raise TypeError(f"dtype must be float16, bfloat16 or float32, got {dtype}")
        if rope is not None:
            if not isinstance(rope, RoPE):
                raise TypeError(f"rope must be a treeattn.RoPE or None, got {type(rope).__name__}")
            if head_dim % 2:
                raise ValueError(f"rope needs an even head_dim, got {head_dim}")
        if first_round not in ("merge", "paged"):
            raise ValueError(f"first_round must be 'merge' or 'paged', got {first_round!r}")
        self.num_layers, self.num_kv_heads, self.head_dim = num_layers, num_kv_heads, head_dim
        self.page_size, self.dtype, self.rope, self.first_round = page_size, dtype, rope, first_round
        self.v_head_dim = head_dim if v_head_dim is None else v_head_dim
        if self.v_head_dim > head_dim:
            raise ValueError(f"v_head_dim = {v_head_dim} must be <= head_dim = {head_dim} (an MLA cache's V is the "
                             "first v_head_dim dims of the latent K)")
        self.latent = self.v_head_dim != head_dim
        pair = () if self.latent else (2,)
        self.kv_pages = torch.zeros(num_layers, num_pages, *pair, num_kv_heads, page_size, head_dim, dtype=dtype,
                                    device=device)
        self.device = self.kv_pages.device
        if num_q_heads is not None and num_q_heads % num_kv_heads:
            raise ValueError(f"num_q_heads = {num_q_heads} must be a multiple of num_kv_heads = {num_kv_heads}")
        # Fail now, not at the first attention(), if the backend cannot serve this cache (without
        # num_q_heads the check assumes one query head per KV head).
        select(backend, AttentionSpec(self.device, dtype, num_q_heads or num_kv_heads, num_kv_heads, head_dim,
                                      self.v_head_dim, page_size=page_size))
        self.backend, self.num_q_heads = backend, num_q_heads
        self._layers = [self._pages(self.kv_pages[layer]) for layer in range(num_layers)]
        # Every layer's pages as one pool (layer l's page p is page l * num_pages + p): one copy moves a
        # token in all layers at once.
        self._all_layers = self._pages(self.kv_pages.flatten(0, 1))
        self._pool = PagePool(num_pages)
        self._seqs: dict[Hashable, SequenceState] = {}
        self._fwd: _OpenForward | None = None
        self._lock = threading.Lock()

    def _pages(self, storage: torch.Tensor) -> PagedKV:
        """The page view of some layers' storage: TVM's combined layout, or an MLA latent with V a view of it."""
        if self.latent:
            return PagedKV.wrap((storage, storage[..., :self.v_head_dim]), "HND")
        return PagedKV.wrap(storage)

    # ------------------------------------------------------------------ queries

    @property
    def num_pages(self) -> int:
        return self._pool.num_pages

    @property
    def num_free_pages(self) -> int:
        return self._pool.num_free

    @property
    def seq_ids(self) -> tuple:
        return tuple(self._seqs)

    @property
    def in_forward(self) -> bool:
        """True between ``begin_forward`` and ``end_forward``/``abort_forward``."""
        return self._fwd is not None

    def __contains__(self, seq_id) -> bool:
        return seq_id in self._seqs

    def seq_len(self, seq_id) -> int:
        """Tokens stored for ``seq_id``, an uncommitted tree included."""
        return self._get(seq_id).length

    def committed_len(self, seq_id) -> int:
        """Tokens of ``seq_id`` before its uncommitted tree (all of them when none is pending)."""
        return self._get(seq_id).committed_len

    def page_indices(self, seq_id) -> list[int]:
        """The page ids holding ``seq_id``'s tokens, in order (pages may be shared with forks)."""
        return self._get(seq_id).pages.tolist()

    @_exclusive
    def get_kv(self, seq_id, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of ``seq_id``'s keys and values at ``layer``: ``k, v [seq_len, h_kv, d]``."""
        self._no_forward("get_kv")
        s, layer = self._get(seq_id), self._layer(layer)
        return self._layers[layer].gather(s.pages, s.length)

    # ------------------------------------------------------------------ sequences

    @_exclusive
    def add_sequence(self, seq_id) -> None:
        self._no_forward("add_sequence")
        self._check_new_id(seq_id)
        self._seqs[seq_id] = SequenceState(np.zeros(0, dtype=np.int64))

    @_exclusive
    def fork_sequence(self, parent_id, child_id, fork_pos: int | None = None) -> None:
        """New sequence ``child_id`` holding the parent's first ``fork_pos`` tokens (default: all),
        sharing its pages copy-on-write."""
        self._no_forward("fork_sequence")
        parent = self._get(parent_id)
        self._check_new_id(child_id)
        if parent.tree is not None:
            raise ValueError(f"cannot fork sequence {parent_id!r}: it has an uncommitted draft tree of "
                             f"{parent.tree_size} tokens; call commit_accepted first")
        pos = parent.length if fork_pos is None else _int(fork_pos, "fork_pos")
        if not 0 <= pos <= parent.length:
            raise ValueError(f"fork_pos = {pos} must be in [0, {parent.length}] (the length of sequence {parent_id!r})")
        pages = parent.pages[:num_pages_for(pos, self.page_size)].copy()
        self._pool.share(pages)
        self._seqs[child_id] = SequenceState(pages, pos)

    @_exclusive
    def remove_sequence(self, seq_id) -> None:
        """Drop ``seq_id`` (an uncommitted tree included) and release its pages."""
        self._no_forward("remove_sequence")
        self._get(seq_id)
        self._pool.release(self._seqs.pop(seq_id).pages)

    @_exclusive
    def pop(self, seq_id, n: int) -> None:
        """Remove the last ``n`` committed tokens of ``seq_id``."""
        self._no_forward("pop")
        s = self._get(seq_id)
        n = _int(n, "n")
        if s.tree is not None:
            raise ValueError(f"cannot pop from sequence {seq_id!r}: it has an uncommitted draft tree; "
                             "call commit_accepted first (leaf -1 drops the whole tree)")
        if not 0 <= n <= s.length:
            raise ValueError(f"n = {n} must be in [0, {s.length}] (the length of sequence {seq_id!r})")
        self._truncate(s, s.length - n)

    # ------------------------------------------------------------------ forward

    @_exclusive
    def begin_forward(self, seq_ids, append_lengths, tree_parents=None) -> ForwardInfo:
        """Reserve pages and plan one forward that appends ``append_lengths[b]`` tokens to ``seq_ids[b]``."""
        self._no_forward("begin_forward")
        ids = self._batch(seq_ids)
        lengths = _int_vector(append_lengths, "append_lengths")
        if lengths.shape[0] != len(ids):
            raise ValueError(f"append_lengths has {lengths.shape[0]} entries but seq_ids has {len(ids)}")
        if (lengths < 1).any():
            b = int(np.flatnonzero(lengths < 1)[0])
            raise ValueError(f"append_lengths[{b}] = {lengths[b]} must be >= 1")
        lengths = lengths.tolist()
        seqs = [self._seqs[i] for i in ids]
        trees = self._new_trees(ids, seqs, lengths, tree_parents)

        ps = self.page_size
        grow = [num_pages_for(s.length + a, ps) - s.pages.shape[0] for s, a in zip(seqs, lengths)]
        # A sequence that will write into a partially filled page shared with a fork copies it first.
        cow = [b for b, s in enumerate(seqs) if s.length % ps and self._pool.refcount[s.pages[-1]] > 1]
        needed = sum(grow) + len(cow)
        if needed > self._pool.num_free:
            raise OutOfPagesError(needed, self._pool.num_free, self.num_pages,
                                  f"this forward ({sum(lengths)} new tokens)")

        # Every sequence's accumulated tree encoded in one call (no per-node or per-tree Python loop).
        indptr, orders, depths = encode_trees([p for p in trees if p is not None], name="tree_parents")
        states, positions, t = [], [], 0
        for s, a, parents in zip(seqs, lengths, trees):
            if parents is None:
                states.append(s.tree_state())
                positions.append(np.arange(s.length, s.length + a))
            else:
                lo, hi = indptr[t], indptr[t + 1]
                t += 1
                states.append((parents, orders[lo:hi], depths[lo:hi]))
                positions.append(s.committed_len + depths[hi - a:hi])

        fresh = self._pool.allocate(needed)
        cow_dst = dict(zip(cow, fresh[:len(cow)].tolist()))
        tables, taken = [], len(cow)
        for b, (s, g) in enumerate(zip(seqs, grow)):
            pages = s.pages.copy()
            if b in cow_dst:
                pages[-1] = cow_dst[b]
            tables.append(np.concatenate([pages, fresh[taken:taken + g]]))
            taken += g
        steps = [Step(t, s.length, s.length + a, None if parents is None else st[1])
                 for t, s, a, parents, st in zip(tables, seqs, lengths, trees, states)]
        try:
            step = plan_step(steps, page_size=ps, num_pages=self.num_pages, device=self.device,
                             merge_first_round=self.first_round == "merge")
            if self.num_q_heads is not None:  # the backends' per-step host work, now rather than in layer 0
                for plan in (step.paged, step.ragged):
                    if plan is not None:
                        ops.prepare_plan(plan, num_q_heads=self.num_q_heads, num_kv_heads=self.num_kv_heads,
                                         head_dim=self.head_dim, dtype=self.dtype, backend=self.backend)
        except BaseException:
            self._pool.release(fresh)
            raise

        # Nothing below can fail on valid state: commit the new state.
        if cow:
            src = np.asarray([seqs[b].pages[-1] for b in cow], dtype=np.int64)
            dst = np.asarray(list(cow_dst.values()), dtype=np.int64)
            self._copy_slots(self._page_slots(src), self._page_slots(dst))
            self._pool.release(src)
        undo = [(s.length, s.tree_state()) for s in seqs]
        for s, t, a, st in zip(seqs, tables, lengths, states):
            s.pages, s.length = t, s.length + a
            s.set_tree(st)
        q_indptr = np.concatenate([[0], np.cumsum(lengths)])
        info = ForwardInfo(tuple(ids), tuple(lengths), torch.from_numpy(q_indptr.astype(np.int32)).to(self.device),
                           torch.from_numpy(np.concatenate(positions).astype(np.int32)).to(self.device))
        self._fwd = _OpenForward(info, step, seqs, undo, np.zeros(self.num_layers, dtype=bool),
                                 threading.get_ident())
        return info

    @_exclusive
    def attention(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None, *,
                  sm_scale: float | None = None, sliding_window: int | None = None,
                  logit_softcap: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
        """Store this layer's new ``k, v [T, h_kv, d]`` and return the attention of ``q [T, h_q, d]``.

        Row ``t`` attends to its sequence's committed prefix and its tree ancestors-or-self (plain
        appends: causal). ``sliding_window``, ``logit_softcap`` and ``sinks`` are this layer's variants
        (see ``treeattn.tree_attention``; positions are the tokens' positions in their sequence). An MLA
        cache takes ``v=None``. Everything is checked before anything is written.
        """
        fwd = self._fwd
        if fwd is None:
            raise RuntimeError("attention() needs an open forward: call begin_forward(...) first")
        layer = self._layer(layer)
        if fwd.done[layer]:
            raise RuntimeError(f"layer {layer} already ran in this forward; each layer runs once between "
                               "begin_forward and end_forward")
        self._check_qkv(q, k, v, fwd.info.num_tokens)
        sm_scale = resolve_sm_scale(sm_scale, self.head_dim)
        sinks = ops.check_variants(sliding_window, logit_softcap, sinks, q.shape[1], q.device)
        step = fwd.step
        if sliding_window is not None and not step.append_first:
            raise ValueError("sliding_window needs first_round='paged' (the default): the merge path attends the "
                             "prefix without the rows' positions")
        if self.rope is not None:
            if fwd.cos_sin is None:
                fwd.cos_sin = self.rope.cos_sin(fwd.info.positions, self.head_dim)
            q, k = RoPE.rotate(q, *fwd.cos_sin), RoPE.rotate(k, *fwd.cos_sin)
        if self.latent:
            v = k[..., :self.v_head_dim]
        kv, backend = self._layers[layer], self.backend
        variants = dict(sm_scale=sm_scale, logit_softcap=logit_softcap, backend=backend)
        # The same public calls users make, with the step's plans (index arrays: the plans' own).
        if step.append_first:
            kv.write(step.new_slots, k, v)
            out, _ = ops.paged_tree_attention(q, None, kv, None, None, None, None, None, plan=step.paged,
                                              sliding_window=sliding_window, sinks=sinks, **variants)
        else:  # the sinks join one part only, so that the merge counts them once
            out, lse = ops.tree_attention(q, None, k, v, None, None, None, plan=step.ragged, sinks=sinks, **variants)
            if step.paged is not None:
                prefix_out, prefix_lse = ops.paged_tree_attention(q, None, kv, None, None, None, None, None,
                                                                  plan=step.paged, **variants)
                ops.merge_state(out, lse, prefix_out, prefix_lse, out=out, lse=lse, backend=backend)
            kv.write(step.new_slots, k, v)
        fwd.done[layer] = True
        return out

    @_exclusive
    def end_forward(self) -> None:
        """Close the forward; every layer must have run."""
        if self._fwd is None:
            raise RuntimeError("end_forward() without begin_forward()")
        missing = np.flatnonzero(~self._fwd.done).tolist()
        if missing:
            raise RuntimeError(f"layers {missing} have not run attention() in this forward; run them, or "
                               "call abort_forward() to undo the forward")
        self._fwd = None

    @_exclusive
    def abort_forward(self) -> None:
        """Undo the open forward: its tokens are dropped and trees are as before ``begin_forward``."""
        if self._fwd is None:
            raise RuntimeError("abort_forward() without begin_forward()")
        for s, (length, tree) in zip(self._fwd.seqs, self._fwd.undo):
            self._truncate(s, length)
            s.set_tree(tree)
        self._fwd = None

    @_exclusive
    def commit_accepted(self, seq_ids, leaf_indices) -> None:
        """Keep, for each sequence, the path from its tree's root to ``leaf_indices[b]`` (-1: nothing).

        Leaf indices are tree-relative over all rounds since the last commit. The path moves to
        positions ``committed_len ..`` in one batched copy; the rest of the tree is dropped.
        """
        self._no_forward("commit_accepted")
        ids = self._batch(seq_ids)
        leaves = _int_vector(leaf_indices, "leaf_indices")
        if leaves.shape[0] != len(ids):
            raise ValueError(f"leaf_indices has {leaves.shape[0]} entries but seq_ids has {len(ids)}")
        seqs = [self._seqs[i] for i in ids]
        for b, (sid, s, leaf) in enumerate(zip(ids, seqs, leaves.tolist())):
            if s.tree is None:
                raise ValueError(f"sequence {sid!r} has no uncommitted draft tree to commit")
            if not -1 <= leaf < s.tree_size:
                raise ValueError(f"leaf_indices[{b}] = {leaf} is out of range for sequence {sid!r}'s tree of "
                                 f"{s.tree_size} nodes (-1 keeps none)")
        src, dst, kept = [], [], []
        for s, leaf in zip(seqs, leaves.tolist()):
            base, path = s.committed_len, np.zeros(0, dtype=np.int64)
            if leaf >= 0:  # ancestors-or-self of the leaf, root first
                path = ancestor_path(s.order, leaf)
                moved = np.flatnonzero(path != np.arange(path.shape[0]))
                src.append(slots(s.pages, base + path[moved], self.page_size))
                dst.append(slots(s.pages, base + moved, self.page_size))
            kept.append(base + path.shape[0])
        # The tree's slots are this sequence's own: its forwards copied any shared page before writing,
        # and a sequence with a tree cannot be forked. So the compaction writes in place.
        src = np.concatenate(src) if src else np.zeros(0, dtype=np.int64)
        if src.size:
            self._copy_slots(src, np.concatenate(dst))
        for s, length in zip(seqs, kept):
            self._truncate(s, length)
            s.set_tree((None, None, None))

    # ------------------------------------------------------------------ internals

    def _get(self, seq_id) -> SequenceState:
        try:
            return self._seqs[seq_id]
        except KeyError:
            raise ValueError(f"unknown sequence id {seq_id!r}") from None
        except TypeError:
            raise TypeError(f"sequence ids must be hashable, got {type(seq_id).__name__}") from None

    def _check_new_id(self, seq_id) -> None:
        try:
            exists = seq_id in self._seqs
        except TypeError:
            raise TypeError(f"sequence ids must be hashable, got {type(seq_id).__name__}") from None
        if exists:
            raise ValueError(f"sequence id {seq_id!r} already exists")

    def _batch(self, seq_ids) -> list:
        ids = _id_list(seq_ids, "seq_ids")
        if not ids:
            raise ValueError("seq_ids is empty")
        for sid in ids:
            self._get(sid)
        if len(set(ids)) != len(ids):
            dup = next(i for i in ids if ids.count(i) > 1)
            raise ValueError(f"seq_ids lists sequence {dup!r} more than once")
        return ids

    def _layer(self, layer) -> int:
        layer = _int(layer, "layer")
        if not 0 <= layer < self.num_layers:
            raise ValueError(f"layer = {layer} is out of range for a cache of {self.num_layers} layers")
        return layer

    def _no_forward(self, what: str) -> None:
        if self._fwd is not None:
            raise RuntimeError(f"{what}() is not allowed while a forward is open; call end_forward() "
                               "(or abort_forward()) first")

    def _new_trees(self, ids, seqs, lengths, tree_parents) -> list[np.ndarray | None]:
        """Per sequence: its accumulated tree's parent array after this forward, or None (plain)."""
        if tree_parents is None:
            entries = [None] * len(ids)
        else:
            if isinstance(tree_parents, (torch.Tensor, np.ndarray, TokenTree)) or not isinstance(tree_parents, Sequence):
                raise TypeError("tree_parents must be None or a list with one parent array (or None) per sequence")
            entries = list(tree_parents)
            if len(entries) != len(ids):
                raise ValueError(f"tree_parents has {len(entries)} entries but seq_ids has {len(ids)}")
        trees = []
        for b, (sid, s, a, raw) in enumerate(zip(ids, seqs, lengths, entries)):
            if raw is None:
                if s.tree is not None:
                    raise ValueError(
                        f"sequence {sid!r} has an uncommitted draft tree of {s.tree_size} tokens, so a plain "
                        f"append is not allowed: pass tree_parents[{b}] to grow the tree, or commit_accepted first")
                trees.append(None)
                continue
            new = _int_vector(raw, f"tree_parents[{b}]")
            if new.shape[0] != a:
                raise ValueError(f"tree_parents[{b}] has {new.shape[0]} entries but append_lengths[{b}] = {a}")
            old = s.tree_size
            bad = np.flatnonzero((new < -1) | (new >= old + np.arange(a)))
            if bad.size:
                j = int(bad[0])
                earlier = f"; the {old} nodes of earlier rounds come first" if old else ""
                raise ValueError(
                    f"tree_parents[{b}][{j}] = {new[j]}: a parent must be -1 (a root on the committed prefix) "
                    f"or an earlier node of sequence {sid!r}'s uncommitted tree (< {old + j}{earlier})")
            combined = new if s.tree is None else np.concatenate([s.tree, new])
            trees.append(as_parents(combined, name=f"the uncommitted tree of sequence {sid!r}"))
        return trees

    def _check_qkv(self, q, k, v, rows: int) -> None:
        if self.latent and v is not None:
            raise ValueError("this MLA cache stores V as the first v_head_dim dims of K: pass v=None")
        if not self.latent and v is None:
            raise ValueError("v is required (only an MLA cache, with v_head_dim < head_dim, takes v=None)")
        for name, x in (("q", q), ("k", k), ("v", v)):
            if x is None:
                continue
            check_float(x, name, 3)
            if x.dtype != self.dtype:
                raise TypeError(f"{name} has dtype {x.dtype}, but the cache stores {self.dtype}")
            if x.device != self.device:
                raise ValueError(f"{name} is on {x.device}, but the cache is on {self.device}")
            heads = q.shape[1] if name == "q" else self.num_kv_heads
            if tuple(x.shape) != (rows, heads, self.head_dim):
                raise ValueError(f"{name} must have shape {(rows, heads, self.head_dim)} (new tokens of this "
                                 f"forward, {'query' if name == 'q' else 'KV'} heads, head_dim), got {tuple(x.shape)}")
        check_heads(q.shape[1], self.num_kv_heads, q.shape[2], self.head_dim, "the cache")

    def _page_slots(self, pages: np.ndarray) -> np.ndarray:
        """Every slot of ``pages``, page by page."""
        return (pages[:, None] * self.page_size + np.arange(self.page_size)).ravel()

    def _copy_slots(self, src: np.ndarray, dst: np.ndarray) -> None:
        """Copy K/V of every layer from slots ``src`` to ``dst`` (all sources read before any write)."""
        layer_base = (np.arange(self.num_layers) * self.num_pages * self.page_size)[:, None]
        self._all_layers.copy((layer_base + src).ravel(), (layer_base + dst).ravel())

    def _truncate(self, s: SequenceState, length: int) -> None:
        keep = num_pages_for(length, self.page_size)
        self._pool.release(s.pages[keep:])
        s.pages, s.length = s.pages[:keep], length
