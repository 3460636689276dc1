"""``treeattn.vllm.batch``: vLLM's batch and cache as treeattn sees them (no vLLM needed).

A mixed vLLM step (prefill chunk, decode, chain and tree speculative verification, an idle request)
over a cache laid out as vLLM's ``CPU_ATTN`` pages must give dense attention (causal, or prefix plus
ancestors for a tree), also when runs are cut into several kernel requests.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from treeattn import paged_tree_attention
from treeattn.backends import available_backends
from treeattn.layout import PagedKV
from treeattn.tree import TokenTree
from treeattn.vllm.batch import move_tokens, split_kv_cache, step_plan

H_Q, H_KV, D, PAGE, BLOCKS = 4, 2, 16, 8, 40
# (cached tokens, new tokens): prefill chunk after a prefix, decode, verification of 1 + 3, idle, fresh
# prompt, then two draft trees (root first) crossing page boundaries
REQUESTS = [(11, 9), (40, 1), (17, 4), (10, 0), (0, 13), (20, 6), (5, 4)]
TREES = [None, None, None, None, None, [-1, 0, 0, 1, 2, 1], [-1, 0, 1, 0]]


def dense_attention(q, k, v, scale, parents=None):
    """Rows are the last ``len(q)`` positions of ``k``/``v``, causal or (``parents``) a tree over them;
    float64, GQA by contiguous groups."""
    group = H_Q // H_KV
    k, v = k.double().repeat_interleave(group, 1), v.double().repeat_interleave(group, 1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    prefix = k.shape[0] - q.shape[0]
    visible = torch.arange(k.shape[0])[None, :] <= torch.arange(prefix, k.shape[0])[:, None]
    if parents is not None:
        visible[:, prefix:] = TokenTree(parents).ancestor_mask()
    scores.masked_fill_(~visible, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


@pytest.mark.parametrize("backend", available_backends())
@pytest.mark.parametrize("chunk, dims_major", [(512, False), (3, False), (3, True)])
def test_mixed_step_is_causal_and_tree_attention(chunk, dims_major, backend, one_thread):
    if dims_major and backend == "triton":
        pytest.skip("Triton reads K rows: a dims-major K (vLLM's CPU cells) is refused, tested below")
    gen = torch.Generator().manual_seed(0)
    cache = torch.zeros(BLOCKS, H_KV, PAGE, 2 * D)  # one layer of vLLM's CPU_ATTN pages
    pages = PagedKV.wrap(split_kv_cache(cache, dims_major), "HND")
    free = iter(torch.randperm(BLOCKS, generator=gen).tolist())
    table = np.zeros((len(REQUESTS), 8), dtype=np.int32)
    qs, refs, slot_ids, new_k, new_v = [], [], [], [], []
    for b, ((cached, new), parents) in enumerate(zip(REQUESTS, TREES)):
        seq = cached + new
        table[b, : -(-seq // PAGE)] = [next(free) for _ in range(-(-seq // PAGE))]
        k, v = torch.randn(seq, H_KV, D, generator=gen), torch.randn(seq, H_KV, D, generator=gen)
        slots = table[b, np.arange(seq) // PAGE] * PAGE + np.arange(seq) % PAGE
        pages.write(slots[:cached], k[:cached], v[:cached])  # earlier steps
        slot_ids.append(slots[cached:]), new_k.append(k[cached:]), new_v.append(v[cached:])
        q = torch.randn(new, H_Q, D, generator=gen)
        qs.append(q)
        refs.append(dense_attention(q, k, v, 0.3, parents))
    pages.write(np.concatenate(slot_ids), torch.cat(new_k), torch.cat(new_v))  # this step, by slot mapping

    query_start_loc = np.concatenate([[0], np.cumsum([n for _, n in REQUESTS])])
    seq_lens = np.array([c + n for c, n in REQUESTS])
    plan = step_plan(torch.from_numpy(query_start_loc).int(), torch.from_numpy(seq_lens).int(),
                     torch.from_numpy(table), page_size=PAGE, num_pages=BLOCKS, trees=TREES, chunk=chunk)
    out, _ = paged_tree_attention(torch.cat(qs), None, split_kv_cache(cache, dims_major), None, None, None, None, None,
                                  kv_layout="HND", sm_scale=0.3, plan=plan, backend=backend)
    torch.testing.assert_close(out.double(), torch.cat(refs), atol=1e-5, rtol=1e-5)
    assert plan.batch_size == (len(REQUESTS) if chunk == 512 else 3 + 1 + 2 + 1 + 5 + 1 + 1)  # a tree is one piece


@pytest.mark.parametrize("dims_major", [False, True])
def test_move_tokens_copies_k_and_v_between_slots(dims_major):
    gen = torch.Generator().manual_seed(1)
    cache = torch.randn(4, H_KV, PAGE, 2 * D, generator=gen)
    pages = PagedKV.wrap(split_kv_cache(cache, dims_major), "HND")
    src, dst = torch.tensor([9, 14, 30]), torch.tensor([8, 9, 10])  # 9 is read before it is overwritten
    want_k, want_v = pages.read(src)
    untouched = cache.clone()
    move_tokens(cache, src, dst, dims_major)
    k, v = pages.read(dst)
    assert torch.equal(k, want_k) and torch.equal(v, want_v)
    others = torch.ones(4 * PAGE, dtype=torch.bool)
    others[dst] = False
    k_all, v_all = PagedKV.wrap(split_kv_cache(untouched, dims_major), "HND").read(torch.arange(4 * PAGE)[others])
    assert torch.equal(pages.read(torch.arange(4 * PAGE)[others])[0], k_all)
    assert torch.equal(pages.read(torch.arange(4 * PAGE)[others])[1], v_all)


def test_split_kv_cache_is_a_view_of_k_rows_then_v_rows():
    cache = torch.arange(2 * 3 * 4 * 2 * 5, dtype=torch.float32).view(2, 3, 4, 10)
    k, v = split_kv_cache(cache)
    assert k.data_ptr() == cache.data_ptr() and k.shape == v.shape == (2, 3, 4, 5)
    flat = cache.view(2, 3, 40)
    assert torch.equal(k.reshape(2, 3, 20), flat[..., :20]) and torch.equal(v.reshape(2, 3, 20), flat[..., 20:])


def test_split_kv_cache_dims_major_reads_k_as_vllms_cpu_kernels_store_it():
    """vLLM's vec / vec16 CPU kernels keep a cell's K as [head_size, block_size], then V as rows."""
    cache = torch.arange(2 * 3 * 4 * 2 * 5, dtype=torch.float32).view(2, 3, 4, 10)
    k, v = split_kv_cache(cache, dims_major=True)
    assert k.shape == v.shape == (2, 3, 4, 5) and k.stride(-1) == 4
    flat = cache.view(2, 3, 40)
    assert torch.equal(k.transpose(2, 3).reshape(2, 3, 20), flat[..., :20])
    assert torch.equal(v.reshape(2, 3, 20), flat[..., 20:])


@pytest.mark.parametrize("query_start_loc, seq_lens, blocks, trees, match", [
    ([0, 5], [4], 1, None, "new tokens <= seq_len"),
    ([0, 5], [40], 2, None, "fewer than seq_lens need"),
    ([0, 5], [5, 6], 2, None, "expected query_start_loc"),
    ([0, 3], [5], 1, [[-1, 0]], "trees\\[0\\] has 2 nodes"),
    ([0, 3], [5], 1, [None, None], "trees has 2 entries"),
    ([0, 3], [5], 1, [[-1, 0, 2]], "trees\\[0\\]\\[2\\]"),
])
def test_bad_batches_are_refused(query_start_loc, seq_lens, blocks, trees, match):
    with pytest.raises(ValueError, match=match):
        step_plan(query_start_loc, seq_lens, np.zeros((len(seq_lens), blocks), dtype=np.int32),
                  page_size=PAGE, num_pages=BLOCKS, trees=trees)
