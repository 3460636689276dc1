"""vLLM's cache and batch as treeattn sees them (no vLLM import: testable on its own).

vLLM 0.32 allocates each layer's cache as for ``CPU_ATTN`` (layout ``LBHNC``):
``[num_blocks, h_kv, block_size, 2 * head_size]``. A ``(block, head)`` cell holds the block's K, then
its V rows; K is either rows too (treeattn's own cell) or dims-major, ``[head_size, block_size]``, as
vLLM's own ``vec`` / ``vec16`` CPU kernels store it (``dims_major``). ``split_kv_cache`` views either
as treeattn's ``HND`` ``(k, v)`` pair, without a copy.

vLLM describes a step by ``query_start_loc`` (new tokens per request), ``seq_lens`` (cached +
new tokens) and a block table (page ids per request, page = block). Its attention is causal, and
a causal run of ``m`` new tokens after a cached prefix is exactly tree attention with a chain of
``m`` nodes as the last keys: prefill chunks, decodes (``m = 1``), prefix-cache hits (a longer
prefix) and chain speculative verification (``m = 1 + drafts``) are all the same case, so one
plan covers a mixed batch.

Tree speculation (``treeattn.vllm.speculative``) lays a request's draft tree out as its new tokens
(the root, i.e. the last sampled token, first; parents before children): that request's rows then
attend to its cached prefix plus their own ancestors, by the tree's ``(enter, exit)`` intervals.

A long run is cut into kernel requests of at most ``CHAIN_CHUNK`` rows on the same pages, each
seeing the keys before it plus a chain over itself, as the paged cache does (``kvcache.step``):
it keeps the masked part of every kernel request small.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from ..layout import PagedKV
from ..plan import TreeAttentionPlan
from ..tree import CHAIN_CHUNK, encode_trees

__all__ = ["move_tokens", "split_kv_cache", "step_plan"]


def split_kv_cache(kv_cache: torch.Tensor, dims_major: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``(k, v)``, each ``[num_blocks, h_kv, block_size, head_size]`` (HND), views of one layer's cache;
    with ``dims_major`` K's head dims lie ``block_size`` elements apart (each cell's K is ``[d, block_size]``)."""
    blocks, heads, block_size, two_d = kv_cache.shape
    k, v = kv_cache.view(blocks, heads, 2 * block_size, two_d // 2).chunk(2, dim=2)
    if dims_major:
        k = k.as_strided(k.shape, (k.stride(0), k.stride(1), 1, block_size))
    return k, v


def move_tokens(kv_cache: torch.Tensor, src_slots: torch.Tensor, dst_slots: torch.Tensor,
                dims_major: bool = False) -> None:
    """Copy the K/V of ``src_slots`` to ``dst_slots`` in one layer's cache (all sources read first)."""
    PagedKV.wrap(split_kv_cache(kv_cache, dims_major), "HND").copy(src_slots, dst_slots)


def _host(x, name: str) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        x = x.detach().cpu().numpy()
    arr = np.asarray(x)
    if arr.dtype.kind not in "iu":
        raise TypeError(f"{name} must hold integers, got {arr.dtype}")
    return arr.astype(np.int64, copy=False)


def step_plan(query_start_loc, seq_lens, block_table, *, page_size: int, num_pages: int,
              trees: Sequence[np.ndarray | None] | None = None, device: torch.device | str = "cpu",
              chunk: int = CHAIN_CHUNK) -> TreeAttentionPlan:
    """Plan attention of each request's new tokens over its pages: causal, or over a draft tree.

    ``query_start_loc [B+1]``, ``seq_lens [B]`` (including the new tokens) and
    ``block_table [B, max_blocks]`` as vLLM passes them; rows of the returned plan are the rows of
    vLLM's query in order. ``trees[b]``, when given and not None, is request ``b``'s parent array
    over its new tokens (``-1`` for the first, every other parent earlier). Shapes and ranges are
    validated by ``TreeAttentionPlan.paged``.
    """
    qsl, seq = _host(query_start_loc, "query_start_loc"), _host(seq_lens, "seq_lens")
    table = _host(block_table, "block_table")
    if qsl.ndim != 1 or seq.shape != (qsl.shape[0] - 1,) or table.ndim != 2 or table.shape[0] < seq.shape[0]:
        raise ValueError(f"expected query_start_loc [B+1], seq_lens [B] and block_table [B, blocks], got shapes "
                         f"{qsl.shape}, {seq.shape} and {table.shape}")
    qo = np.diff(qsl)
    if (qo < 0).any() or (seq < qo).any():
        raise ValueError("each request needs 0 <= new tokens <= seq_len")
    trees = list(trees) if trees is not None else [None] * qo.shape[0]
    if len(trees) != qo.shape[0]:
        raise ValueError(f"trees has {len(trees)} entries for {qo.shape[0]} requests")
    is_tree = np.array([t is not None for t in trees], dtype=bool)
    for b in np.flatnonzero(is_tree):
        if len(trees[b]) != qo[b]:
            raise ValueError(f"trees[{b}] has {len(trees[b])} nodes, but request {b} has {qo[b]} new tokens")

    # Cut request b's rows into ceil(qo / chunk) pieces (one empty piece when qo == 0); a tree is
    # one piece (its nodes see their ancestors, not the rows before them).
    pieces = np.where(is_tree, 1, np.maximum(1, -(-qo // chunk)))
    req = np.repeat(np.arange(qo.shape[0]), pieces)
    k = np.arange(req.shape[0]) - np.repeat(np.cumsum(pieces) - pieces, pieces)
    start = qsl[req] + k * chunk
    end = np.where(is_tree[req], qsl[req + 1], np.minimum(start + chunk, qsl[req + 1]))
    rows = end - start
    kv_len = seq[req] - (qsl[req + 1] - end)  # the keys before this piece's last row, itself included

    npages = -(-kv_len // page_size)
    if (npages > table.shape[1]).any():
        raise ValueError(f"block_table has {table.shape[1]} blocks per request, fewer than seq_lens need")
    last = np.where(npages > 0, kv_len - (npages - 1) * page_size, 0)
    page_indices = table[req][np.arange(table.shape[1])[None, :] < npages[:, None]]

    # Chain of ``rows`` nodes: node i enters at i and its subtree runs to the end of the chain.
    local = np.arange(int(rows.sum())) - np.repeat(np.cumsum(rows) - rows, rows)
    order = np.stack([local, np.repeat(rows, rows)], axis=1)
    if is_tree.any():  # a tree request is one piece, so its rows are its query rows
        _, tree_order, _ = encode_trees([trees[b] for b in np.flatnonzero(is_tree)], "trees")
        order[np.concatenate([np.arange(qsl[b], qsl[b + 1]) for b in np.flatnonzero(is_tree)])] = tree_order

    def i32(a):
        return np.ascontiguousarray(a, dtype=np.int32)

    q_indptr = i32(np.concatenate([[0], np.cumsum(rows)]))
    return TreeAttentionPlan.paged(
        q_indptr, i32(np.concatenate([[0], np.cumsum(npages)])), i32(page_indices), i32(last), q_indptr, i32(order),
        page_size=page_size, num_pages=num_pages, total_q=int(rows.sum()), device=torch.device(device))
