"""treeattn.PagedKVCache: TVM's KV-cache tree scenarios, regressions for TVM's runtime bugs Q1–Q4
(docs/semantics.md, "TVM's runtime bugs"), copy-on-write forks, long appends, and misuse that must leave the cache unchanged.

Every forward is checked layer by layer against the dense float64 model in ``cache_model.py``.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

import treeattn
from tests.cache_model import ModelCache
from tests.helpers import binary, chain, forest, star
from treeattn import OutOfPagesError, PagedKVCache, TokenTree
from treeattn.tree import CHAIN_CHUNK

BACKENDS = ["reference"] + (["cpu"] if importlib.util.find_spec("treeattn.backends.cpu") else [])


pytestmark = pytest.mark.usefixtures("one_thread")


def make(*, layers=2, h_q=4, h_kv=2, d=16, page_size=4, num_pages=64, dtype=torch.float32, rope_theta=None,
         backend="reference", device="cpu", **kwargs):
    rope = None if rope_theta is None else treeattn.RoPE(rope_theta)
    cache = PagedKVCache(layers, h_kv, d, num_pages=num_pages, page_size=page_size, dtype=dtype, device=device,
                         backend=backend, rope=rope, **kwargs)
    return cache, ModelCache(layers, h_q, h_kv, d, page_size, num_pages, dtype, rope_theta, device=device)


def gen(seed=0):
    return torch.Generator().manual_seed(seed)


def prefill(cache, model, lengths, g):
    for sid in range(len(lengths)):
        model.add(cache, sid)
    model.forward(cache, list(range(len(lengths))), lengths, None, g)


# ---------------------------------------------------------------- TVM's test_paged_attention_kv_cache_tree_attn

TVM_CONFIGS = [pytest.param(64, torch.float32, id="d64-fp32"), pytest.param(128, torch.float16, id="d128-fp16")]


def tvm_cache(d, dtype, backend, device="cpu", **kwargs):
    """TVM's test configuration: 4 layers, 32 query / 4 KV heads, pages of 16, NORMAL RoPE theta 1e4."""
    return make(layers=4, h_q=32, h_kv=4, d=d, page_size=16, num_pages=128, dtype=dtype, rope_theta=1e4,
                backend=backend, device=device, **kwargs)


def decode_rounds(cache, model, g, rounds=5):
    ids = list(model.seqs)
    for _ in range(rounds):
        model.forward(cache, ids, [1] * len(ids), None, g)
        model.check(cache, exact=False)


@pytest.mark.parametrize("first_round", ["paged", "merge"])
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("d,dtype", TVM_CONFIGS)
def test_tvm_tree_scenario(d, dtype, backend, first_round):
    cache, model = tvm_cache(d, dtype, backend, first_round=first_round)
    g = gen(1)
    prefill(cache, model, [10, 20, 30, 40], g)
    trees = [binary(7), binary(15), chain(10), forest(binary(7), binary(7))]
    model.forward(cache, [0, 1, 2, 3], [7, 15, 10, 14], trees, g)
    model.check(cache, exact=False)
    model.commit(cache, [0, 1, 2, 3], [6, 11, 6, 13])  # leaf 13 is in the forest's second tree: 7 -> 9 -> 13
    assert [cache.seq_len(i) for i in range(4)] == [10 + 3, 20 + 4, 30 + 7, 40 + 3]
    model.check(cache, exact=False)
    decode_rounds(cache, model, g)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("d,dtype", TVM_CONFIGS)
def test_tvm_chain_scenario(d, dtype, backend):
    cache, model = tvm_cache(d, dtype, backend)
    g = gen(2)
    prefill(cache, model, [10, 20, 30, 40], g)
    model.forward(cache, [0, 1, 2, 3], [7, 15, 10, 14], [chain(7), chain(15), chain(10), chain(14)], g)
    model.commit(cache, [0, 1, 2, 3], [2, 6, -1, 4])  # a leaf on a chain copies nothing
    assert [cache.seq_len(i) for i in range(4)] == [13, 27, 30, 45]
    model.check(cache, exact=False)
    decode_rounds(cache, model, g)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("d,dtype", TVM_CONFIGS)
def test_tvm_growing_tree_scenario(d, dtype, backend):
    """Five rounds grow a complete binary tree level by level (round i adds 2^i nodes), one commit."""
    cache, model = tvm_cache(d, dtype, backend)
    g = gen(3)
    prefill(cache, model, [10, 20, 30, 40], g)
    full = [(k - 1) // 2 for k in range(31)]  # full[0] = -1
    for i in range(5):
        new = full[2**i - 1:2**(i + 1) - 1]
        info_positions = model.positions(0, len(new), new)
        assert info_positions == [10 + i] * len(new)  # every node of level i sits at committed_len + i
        model.forward(cache, [0, 1, 2, 3], [len(new)] * 4, [new] * 4, g)
        model.check(cache, exact=False)
    # Tree-relative leaves over all rounds (TVM's Q3 read them relative to the last round only).
    model.commit(cache, [0, 1, 2, 3], [2, 6, -1, 4])
    assert [cache.seq_len(i) for i in range(4)] == [10 + 2, 20 + 3, 30, 40 + 3]
    model.check(cache, exact=False)
    decode_rounds(cache, model, g)


# ---------------------------------------------------------------- attention variants per layer


@pytest.mark.parametrize("backend", BACKENDS)
def test_per_layer_variants_over_multi_round_trees(backend):
    """Gemma-like alternation (sliding window, soft-capping, sinks) across layers, with a tree grown over two
    rounds, a fork, a commit and decoding: every layer's output against the dense model."""
    sinks = torch.randn(4, generator=gen(9)) * 2
    cache, model = make(layers=4, backend=backend, rope_theta=1e4, num_pages=96)
    model.variants = {0: dict(sliding_window=3), 1: dict(logit_softcap=5.0),
                      2: dict(sliding_window=8, logit_softcap=20.0, sinks=sinks), 3: dict(sinks=sinks)}
    g = gen(4)
    prefill(cache, model, [11, 5], g)
    model.forward(cache, [0, 1], [7, 3], [binary(7), chain(3)], g)
    model.forward(cache, [0, 1], [2, 2], [[3, 7], [2, -1]], g)  # grow: node 7 under 3, 8 under 7
    model.commit(cache, [0, 1], [8, 4])
    model.fork(cache, 0, 2)
    decode_rounds(cache, model, g, rounds=3)
    model.check(cache, exact=False)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("first_round", ["paged", "merge"])
def test_mla_cache_stores_one_latent(backend, first_round):
    """v_head_dim < head_dim: one latent per token, V its first dims; attention takes v=None."""
    cache = PagedKVCache(2, 1, 24, num_pages=32, page_size=4, dtype=torch.float32, backend=backend, v_head_dim=16,
                         first_round=first_round)
    assert tuple(cache.kv_pages.shape) == (2, 32, 1, 4, 24)
    model = ModelCache(2, 4, 1, 24, 4, 32, v_dim=16, variants={1: dict(sinks=torch.randn(4, generator=gen(2)))})
    g = gen(5)
    prefill(cache, model, [9, 6], g)
    model.forward(cache, [0, 1], [5, 3], [binary(5), star(3)], g)
    model.commit(cache, [0, 1], [3, 2])
    decode_rounds(cache, model, g, rounds=2)
    with pytest.raises(ValueError, match="pass v=None"):
        cache.begin_forward([0], [1])
        try:
            cache.attention(0, torch.randn(1, 4, 24), torch.randn(1, 1, 24), torch.randn(1, 1, 24))
        finally:
            cache.abort_forward()


def test_a_window_needs_the_paged_first_round():
    cache, model = make(first_round="merge")
    g = gen(6)
    prefill(cache, model, [6], g)
    cache.begin_forward([0], [3], [chain(3)])
    with pytest.raises(ValueError, match="sliding_window needs first_round='paged'"):
        cache.attention(0, torch.randn(3, 4, 16), torch.randn(3, 2, 16), torch.randn(3, 2, 16), sliding_window=2)
    cache.abort_forward()


# ---------------------------------------------------------------- TVM runtime bugs Q1–Q4, fixed


@pytest.mark.parametrize("order", ["chain last", "chain first"])
def test_q1_every_sequence_is_compacted(order):
    cache, model = make()
    g = gen(4)
    prefill(cache, model, [5, 9], g)
    ids, trees, leaves = [0, 1], [binary(7), chain(4)], [6, 3]
    if order == "chain first":
        ids, trees, leaves = ids[::-1], trees[::-1], leaves[::-1]
    model.forward(cache, ids, [len(t) for t in trees], trees, g)
    model.commit(cache, ids, leaves)
    assert cache.seq_len(0) == 5 + 3 and cache.seq_len(1) == 9 + 4
    model.check(cache)


@pytest.mark.parametrize("first_round", ["merge", "paged"])
def test_q2_forked_sequences_keep_their_tree_masks(first_round):
    cache, model = make(first_round=first_round)
    g = gen(5)
    prefill(cache, model, [20], g)
    model.fork(cache, 0, 1, 13)  # forks inside a page: the partial page is shared copy-on-write
    model.forward(cache, [0, 1], [7, 4], [binary(7), star(4)], g)
    model.forward(cache, [1, 0], [2, 3], [[-1, 4], [6, 6, 2]], g)  # round 2 refers to round-1 nodes
    model.check(cache)
    model.commit(cache, [0, 1], [8, 4])
    model.check(cache)
    model.forward(cache, [0, 1], [1, 1], None, g)
    model.check(cache)


@pytest.mark.parametrize("leaf,kept", [(2, 2), (5, 3), (6, 1), (4, 4), (-1, 0)])
def test_q3_multi_round_commit_is_tree_relative(leaf, kept):
    cache, model = make()
    g = gen(6)
    prefill(cache, model, [9], g)
    model.forward(cache, [0], [3], [[-1, 0, 0]], g)
    model.forward(cache, [0], [4], [[1, 3, 2, -1]], g)  # nodes 3..6: 3<-1, 4<-3, 5<-2, 6 a new root
    assert cache.seq_len(0) == 16 and cache.committed_len(0) == 9
    model.commit(cache, [0], [leaf])  # a leaf from round 1 drops all of round 2 too
    assert cache.seq_len(0) == 9 + kept
    model.check(cache)
    model.forward(cache, [0], [2], None, g)
    model.check(cache)


def test_q4_uncommitted_chain_then_chain_stays_causal():
    cache, model = make()
    g = gen(7)
    prefill(cache, model, [5], g)
    model.forward(cache, [0], [3], [chain(3)], g)
    with pytest.raises(ValueError, match="uncommitted draft tree"):
        cache.begin_forward([0], [3])  # a plain append would treat the drafts as accepted
    model.forward(cache, [0], [3], [[2, 3, 4]], g)  # continues the chain; checked causal by the model
    model.commit(cache, [0], [5])
    assert cache.seq_len(0) == 11
    model.check(cache)


# ---------------------------------------------------------------- forks, long appends, aborts


def test_fork_shares_pages_copy_on_write():
    cache, model = make(num_pages=16)
    g = gen(8)
    prefill(cache, model, [10], g)  # pages of 4: two full pages and one holding 2 tokens
    free = cache.num_free_pages
    model.fork(cache, 0, 1)
    assert cache.num_free_pages == free and cache.page_indices(1) == cache.page_indices(0)
    model.forward(cache, [1], [1], None, g)  # writes into the shared partial page: copies it
    assert cache.num_free_pages == free - 1
    assert cache.page_indices(1)[:2] == cache.page_indices(0)[:2] and cache.page_indices(1)[2] != cache.page_indices(0)[2]
    model.forward(cache, [0], [3], [star(3)], g)  # the parent's page is its own again: no copy
    assert cache.num_free_pages == free - 2
    model.check(cache)
    model.fork(cache, 1, 2, fork_pos=5)
    model.remove(cache, 1)
    model.check(cache)
    for sid in (0, 2):
        model.remove(cache, sid)
    assert cache.num_free_pages == 16


@pytest.mark.parametrize("first_round", ["merge", "paged"])
def test_long_plain_append_is_causal_in_chunks(first_round):
    cache, model = make(page_size=16, num_pages=200, first_round=first_round)
    g = gen(9)
    model.add(cache, 0)
    model.add(cache, 1)
    model.forward(cache, [0, 1], [CHAIN_CHUNK * 2 + 37, 5], None, g)
    model.forward(cache, [1, 0], [CHAIN_CHUNK + 1, 3], None, g)
    model.check(cache)


def test_tree_parents_accepts_token_trees_and_tensors_and_mixed_batches():
    cache, model = make()
    g = gen(10)
    prefill(cache, model, [3, 4, 5], g)
    tree = TokenTree.from_choices([(0,), (1,), (0, 0)])
    info = cache.begin_forward([2, 0, 1], [4, 2, 3], [tree, None, torch.tensor([-1, 0, 0])])
    assert info.q_indptr.tolist() == [0, 4, 6, 9]
    assert info.positions.tolist() == [5, 6, 6, 7, 3, 4, 4, 5, 5]
    cache.abort_forward()
    model.forward(cache, [2, 0, 1], [4, 2, 3], [tree.parents.tolist(), None, [-1, 0, 0]], g)
    model.check(cache)


def test_abort_forward_restores_everything():
    cache, model = make()
    g = gen(11)
    prefill(cache, model, [6, 3], g)
    model.forward(cache, [0], [3], [[-1, 0, 1]], g)
    before = snapshot(cache)
    free = cache.num_free_pages
    model.forward(cache, [0, 1], [2, 4], [[0, 3], None], g, abort_after=1)
    assert snapshot(cache)[:3] == before[:3] and cache.num_free_pages == free
    model.check(cache)  # the tree is back: it can grow and commit
    model.forward(cache, [0], [1], [[1]], g)
    model.commit(cache, [0], [3])
    model.check(cache)


# ---------------------------------------------------------------- misuse: clear errors, nothing changed


def snapshot(cache):
    seqs = tuple((sid, cache.seq_len(sid), cache.committed_len(sid), tuple(cache.page_indices(sid)))
                 for sid in cache.seq_ids)
    return seqs, cache.num_free_pages, cache.in_forward, cache.kv_pages.clone()


def assert_unchanged(cache, before):
    after = snapshot(cache)
    assert after[:3] == before[:3]
    assert torch.equal(after[3], before[3])


@pytest.fixture
def busy():
    """Sequence 0 committed (10 tokens), 1 holds a draft tree (binary-7 over 6), 2 forked from 0 at 7."""
    cache, model = make(num_pages=12)
    g = gen(12)
    prefill(cache, model, [10, 6], g)
    model.forward(cache, [1], [7], [binary(7)], g)
    model.fork(cache, 0, 2, 7)
    return cache


MISUSE = {
    "add existing": (lambda c: c.add_sequence(0), ValueError, "already exists"),
    "add unhashable": (lambda c: c.add_sequence([1]), TypeError, "hashable"),
    "fork unknown": (lambda c: c.fork_sequence(9, 10), ValueError, "unknown sequence id 9"),
    "fork onto existing": (lambda c: c.fork_sequence(0, 2), ValueError, "already exists"),
    "fork a tree": (lambda c: c.fork_sequence(1, 10), ValueError, "uncommitted draft tree"),
    "fork past the end": (lambda c: c.fork_sequence(0, 10, 11), ValueError, r"fork_pos = 11 must be in \[0, 10\]"),
    "fork negative": (lambda c: c.fork_sequence(0, 10, -1), ValueError, "fork_pos"),
    "remove unknown": (lambda c: c.remove_sequence("x"), ValueError, "unknown sequence id 'x'"),
    "pop a tree": (lambda c: c.pop(1, 1), ValueError, "commit_accepted first"),
    "pop too many": (lambda c: c.pop(0, 11), ValueError, r"n = 11 must be in \[0, 10\]"),
    "pop float": (lambda c: c.pop(0, 1.0), TypeError, "n must be an int"),
    "forward unknown": (lambda c: c.begin_forward([0, 7], [1, 1]), ValueError, "unknown sequence id 7"),
    "forward duplicate": (lambda c: c.begin_forward([0, 0], [1, 1]), ValueError, "more than once"),
    "forward empty": (lambda c: c.begin_forward([], []), ValueError, "empty"),
    "lengths mismatch": (lambda c: c.begin_forward([0, 2], [1]), ValueError, "append_lengths has 1 entries"),
    "length zero": (lambda c: c.begin_forward([0, 2], [1, 0]), ValueError, r"append_lengths\[1\] = 0"),
    "length float": (lambda c: c.begin_forward([0], [1.5]), TypeError, "append_lengths must hold integers"),
    "plain over a tree": (lambda c: c.begin_forward([0, 1], [1, 1]), ValueError, "uncommitted draft tree"),
    "flat parents": (lambda c: c.begin_forward([0], [2], [-1, 0]), ValueError, "tree_parents"),
    "parents count": (lambda c: c.begin_forward([0], [2], [[-1]]), ValueError, r"tree_parents\[0\] has 1 entries"),
    "parent not earlier": (lambda c: c.begin_forward([0], [2], [[-1, 1]]), ValueError, r"tree_parents\[0\]\[1\] = 1"),
    "parent below -1": (lambda c: c.begin_forward([0], [1], [[-2]]), ValueError, r"tree_parents\[0\]\[0\] = -2"),
    "parent past the tree": (lambda c: c.begin_forward([1], [1], [[7]]), ValueError, "earlier rounds come first"),
    "parents wrong type": (lambda c: c.begin_forward([0], [1], [[0.5]]), TypeError, "must hold integers"),
    "parents not a list": (lambda c: c.begin_forward([0], [1], torch.tensor([-1])), TypeError, "one parent array"),
    "out of pages": (lambda c: c.begin_forward([0, 2], [20, 2]), OutOfPagesError,
                     r"needs 7 new pages but only 5 of 12 are free"),
    "commit committed": (lambda c: c.commit_accepted([0], [0]), ValueError, "no uncommitted draft tree"),
    "commit leaf too big": (lambda c: c.commit_accepted([1], [7]), ValueError, r"leaf_indices\[0\] = 7 is out of range"),
    "commit leaf -2": (lambda c: c.commit_accepted([1], [-2]), ValueError, "out of range"),
    "commit mismatch": (lambda c: c.commit_accepted([1], [1, 2]), ValueError, "leaf_indices has 2 entries"),
    "attention outside forward": (lambda c: c.attention(0, *qkv(1)), RuntimeError, "begin_forward"),
    "end outside forward": (lambda c: c.end_forward(), RuntimeError, "without begin_forward"),
    "abort outside forward": (lambda c: c.abort_forward(), RuntimeError, "without begin_forward"),
    "get_kv bad layer": (lambda c: c.get_kv(0, 2), ValueError, "layer = 2 is out of range"),
    "get_kv unknown": (lambda c: c.get_kv(5, 0), ValueError, "unknown"),
}


def qkv(rows, h_q=4, h_kv=2, d=16, dtype=torch.float32, device="cpu"):
    g = gen(rows)
    return tuple(torch.randn(rows, h, d, generator=g).to(dtype).to(device) for h in (h_q, h_kv, h_kv))


@pytest.mark.parametrize("name", list(MISUSE))
def test_misuse_is_an_error_that_changes_nothing(busy, name):
    call, exc, match = MISUSE[name]
    before = snapshot(busy)
    with pytest.raises(exc, match=match):
        call(busy)
    assert_unchanged(busy, before)


IN_FORWARD = {
    "layer out of range": (lambda c: c.attention(2, *qkv(3)), ValueError, "layer = 2"),
    "layer bool": (lambda c: c.attention(True, *qkv(3)), TypeError, "layer must be an int"),
    "q rows": (lambda c: c.attention(0, *qkv(4)), ValueError, r"q must have shape \(3, 4, 16\)"),
    "k heads": (lambda c: c.attention(0, qkv(3)[0], qkv(3)[0], qkv(3)[2]), ValueError, "k must have shape"),
    "q heads not a multiple": (lambda c: c.attention(0, *qkv(3, h_q=3)), ValueError, "multiple"),
    "head dim": (lambda c: c.attention(0, *qkv(3, d=8)), ValueError, r"\(3, 4, 16\)"),
    "dtype": (lambda c: c.attention(0, *qkv(3, dtype=torch.float16)), TypeError, "cache stores torch.float32"),
    "int dtype": (lambda c: c.attention(0, *(x.int() for x in qkv(3))), TypeError, "float16, bfloat16 or float32"),
    "device": (lambda c: c.attention(0, *qkv(3, device="meta")), ValueError, "is on meta"),
    "sm_scale": (lambda c: c.attention(0, *qkv(3), sm_scale=-1.0), ValueError, "sm_scale"),
    "layer twice": (lambda c: c.attention(1, *qkv(3)), RuntimeError, "layer 1 already ran"),
    "end with a layer missing": (lambda c: c.end_forward(), RuntimeError, r"layers \[0\] have not run"),
    "begin again": (lambda c: c.begin_forward([0], [1]), RuntimeError, "while a forward is open"),
    "commit in forward": (lambda c: c.commit_accepted([1], [0]), RuntimeError, "while a forward is open"),
    "pop in forward": (lambda c: c.pop(0, 1), RuntimeError, "while a forward is open"),
    "get_kv in forward": (lambda c: c.get_kv(0, 0), RuntimeError, "while a forward is open"),
}


@pytest.mark.parametrize("name", list(IN_FORWARD))
def test_misuse_inside_a_forward(busy, name):
    busy.begin_forward([0, 1], [2, 1], [None, [4]])
    busy.attention(1, *qkv(3))
    call, exc, match = IN_FORWARD[name]
    before = snapshot(busy)
    with pytest.raises(exc, match=match):
        call(busy)
    assert_unchanged(busy, before)
    busy.attention(0, *qkv(3))  # the forward goes on
    busy.end_forward()
    assert busy.seq_len(0) == 12 and busy.seq_len(1) == 14 and busy.committed_len(1) == 6


def test_failure_mid_forward_leaves_cache_usable():
    cache, model = make(layers=3)
    g = gen(13)
    prefill(cache, model, [7, 12], g)
    model.forward(cache, [0, 1], [5, 2], [binary(5), None], g, fail_layer=1)  # checks the retry's output
    model.check(cache)


def test_constructor_checks_arguments():
    with pytest.raises(ValueError, match="num_pages must be >= 1"):
        PagedKVCache(2, 2, 16, num_pages=0)
    with pytest.raises(TypeError, match="dtype"):
        PagedKVCache(2, 2, 16, num_pages=4, dtype=torch.float64)
    with pytest.raises(ValueError, match="backend"):
        PagedKVCache(2, 2, 16, num_pages=4, backend="nope")
    with pytest.raises(ValueError, match="even head_dim"):
        PagedKVCache(2, 2, 15, num_pages=4, rope=treeattn.RoPE())
    with pytest.raises(ValueError, match="first_round"):
        PagedKVCache(2, 2, 16, num_pages=4, first_round="ragged")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_tree_scenario():
    cache, model = tvm_cache(128, torch.float16, None, device="cuda")
    g = gen(14)
    prefill(cache, model, [10, 20, 30, 40], g)
    full = [(k - 1) // 2 for k in range(15)]
    for i in range(4):
        new = full[2**i - 1:2**(i + 1) - 1]
        model.forward(cache, [0, 1, 2, 3], [len(new)] * 4, [new] * 4, g)
    model.commit(cache, [0, 1, 2, 3], [2, 6, -1, 4])
    model.check(cache, exact=False)
    decode_rounds(cache, model, g)
