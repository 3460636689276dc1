"""A plain model of ``treeattn.PagedKVCache`` for its tests, written without the cache's code.

Each sequence keeps its tokens' K/V (per layer, as stored: after RoPE when the model ropes) in
Python lists, its committed length and its uncommitted tree as a parent list. Attention is a dense
float64 softmax over the sequence's logical keys with the tree mask from ``treeattn.ancestor_mask``.
``ModelCache.forward`` drives the real cache through one forward and checks every layer's output
against this model; ``check`` compares lengths, stored K/V and page accounting.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

import treeattn
from tests.helpers import TOL


@dataclass
class ModelSeq:
    k: list[list[torch.Tensor]]  # [layer][position] -> [h_kv, d]
    v: list[list[torch.Tensor]]
    committed: int = 0
    tree: list[int] | None = None

    @property
    def length(self) -> int:
        return len(self.k[0])

    def copy(self) -> ModelSeq:
        return ModelSeq([list(x) for x in self.k], [list(x) for x in self.v], self.committed,
                        None if self.tree is None else list(self.tree))


def depths(parents: list[int]) -> list[int]:
    out: list[int] = []
    for p in parents:
        out.append(0 if p < 0 else out[p] + 1)
    return out


def rotate(x: torch.Tensor, positions: list[int], theta: float) -> torch.Tensor:
    """Default rotate-half RoPE, as TVM's test helper: fp32 math, rounded to ``x.dtype``."""
    d = x.shape[-1]
    inv_freq = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
    freqs = torch.tensor(positions, dtype=torch.float32)[:, None] * inv_freq[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)[:, None, :]
    xf = x.float()
    rotated = torch.cat([-xf[..., d // 2:], xf[..., :d // 2]], dim=-1)
    return (xf * emb.cos() + rotated * emb.sin()).to(x.dtype)


def dense_attention(q, k, v, mask, sm_scale, softcap=None, sinks=None):
    """float64 ``softmax(sm_scale q k^T + mask) v``; q [T, h_q, d], k [L, h_kv, d], v [L, h_kv, d_v], mask
    bool [T, L]. Query head ``h`` reads KV head ``h // (h_q // h_kv)``. ``softcap``: scores -> c tanh(s / c);
    ``sinks [h_q]``: one more logit per head whose value is 0."""
    rows, h_q, d = q.shape
    h_kv = k.shape[1]
    qg = q.double().reshape(rows, h_kv, h_q // h_kv, d).permute(1, 2, 0, 3)  # [h_kv, group, T, d]
    scores = qg @ k.double().permute(1, 2, 0)[:, None] * sm_scale  # [h_kv, group, T, L]
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is not None:  # as GPT-OSS does it: a column of sink logits, dropped after the softmax
        column = sinks.double().reshape(h_kv, h_q // h_kv, 1, 1).expand(-1, -1, rows, 1)
        p = torch.softmax(torch.cat([scores, column], dim=-1), dim=-1)[..., :-1]
    else:
        p = torch.softmax(scores, dim=-1)
    out = p @ v.double().permute(1, 0, 2)[:, None]  # [h_kv, group, T, d_v]
    return out.permute(2, 0, 1, 3).reshape(rows, h_q, -1)


@dataclass
class ModelCache:
    num_layers: int
    h_q: int
    h_kv: int
    d: int
    page_size: int
    num_pages: int
    dtype: torch.dtype = torch.float32
    rope_theta: float | None = None  # when set, the cache under test was built with RoPE(theta)
    device: str = "cpu"  # the cache's device; the model itself stays on the CPU
    variants: dict = field(default_factory=dict)  # layer -> attention() keywords (sliding_window, ...)
    v_dim: int | None = None  # an MLA cache: V is the first v_dim dims of K
    seqs: dict = field(default_factory=dict)

    def add(self, cache, sid) -> None:
        cache.add_sequence(sid)
        self.seqs[sid] = ModelSeq([[] for _ in range(self.num_layers)], [[] for _ in range(self.num_layers)])

    def fork(self, cache, parent, child, fork_pos=None) -> None:
        cache.fork_sequence(parent, child, fork_pos)
        src = self.seqs[parent]
        pos = src.length if fork_pos is None else fork_pos
        self.seqs[child] = ModelSeq([x[:pos] for x in src.k], [x[:pos] for x in src.v], pos)

    def remove(self, cache, sid) -> None:
        cache.remove_sequence(sid)
        del self.seqs[sid]

    def pop(self, cache, sid, n) -> None:
        cache.pop(sid, n)
        s = self.seqs[sid]
        keep = s.length - n
        s.k, s.v = [x[:keep] for x in s.k], [x[:keep] for x in s.v]
        s.committed = keep

    def positions(self, sid, append: int, new_parents: list[int] | None) -> list[int]:
        s = self.seqs[sid]
        if new_parents is None:
            return list(range(s.length, s.length + append))
        return [s.committed + x for x in depths((s.tree or []) + list(new_parents))[-append:]]

    def forward(self, cache, ids, lengths, trees, gen: torch.Generator, *, sm_scale=None,
                fail_layer: int | None = None, abort_after: int | None = None) -> None:
        """One forward through ``cache``, each layer's output checked against the model.

        ``fail_layer``: first call that layer with a wrong-shaped ``k`` (must raise, change nothing).
        ``abort_after``: run that many layers, then ``abort_forward`` (the model stays unchanged).
        """
        trees = [None] * len(ids) if trees is None else trees
        info = cache.begin_forward(ids, lengths, trees)
        expected_pos = [p for sid, a, t in zip(ids, lengths, trees) for p in self.positions(sid, a, t)]
        assert info.positions.cpu().tolist() == expected_pos
        total = sum(lengths)
        scale = 1.0 / math.sqrt(self.d) if sm_scale is None else sm_scale
        staged = {sid: self.seqs[sid].copy() for sid in ids}
        for sid, t in zip(ids, trees):
            if t is not None:
                staged[sid].tree = (staged[sid].tree or []) + list(t)
        layers = range(self.num_layers) if abort_after is None else range(abort_after)
        for layer in layers:
            q = torch.randn(total, self.h_q, self.d, generator=gen).to(self.dtype)
            k = torch.randn(total, self.h_kv, self.d, generator=gen).to(self.dtype)
            v = torch.randn(total, self.h_kv, self.d, generator=gen).to(self.dtype)
            qd, kd, vd = q.to(self.device), k.to(self.device), v.to(self.device)
            variant = self.variants.get(layer, {})
            if self.v_dim is not None:
                vd, v = None, None  # stored as K's first v_dim dims
            if layer == fail_layer:
                try:
                    cache.attention(layer, qd, kd[:, :1], vd, sm_scale=sm_scale)
                except ValueError:
                    pass
                else:
                    raise AssertionError("attention accepted a k with the wrong number of heads")
            out = cache.attention(layer, qd, kd, vd, sm_scale=sm_scale, **variant).cpu()
            assert out.dtype == self.dtype and out.shape == (total, self.h_q, self.v_dim or self.d)
            if self.rope_theta is not None:
                q, k = rotate(q, expected_pos, self.rope_theta), rotate(k, expected_pos, self.rope_theta)
            if self.v_dim is not None:
                v = k[..., :self.v_dim]
            row = 0
            for sid, a in zip(ids, lengths):
                s = staged[sid]
                s.k[layer] += list(k[row:row + a])
                s.v[layer] += list(v[row:row + a])
                keys, vals = torch.stack(s.k[layer]), torch.stack(s.v[layer])
                tree = s.tree if s.tree is not None else list(range(-1, a - 1))  # plain: a chain
                mask = torch.ones(a, s.length, dtype=torch.bool)
                mask[:, s.length - len(tree):] = treeattn.ancestor_mask(treeattn.tree_order(tree))[len(tree) - a:]
                if variant.get("sliding_window") is not None:  # positions: prefix j at j, node i at prefix + depth
                    key_pos = torch.tensor(list(range(s.length - len(tree)))
                                           + [s.length - len(tree) + x for x in depths(tree)])
                    row_pos = torch.tensor(expected_pos[row:row + a])
                    mask &= key_pos[None, :] > row_pos[:, None] - variant["sliding_window"]
                ref = dense_attention(q[row:row + a], keys, vals, mask, scale, variant.get("logit_softcap"),
                                      variant.get("sinks"))
                atol, rtol = TOL[self.dtype]
                torch.testing.assert_close(out[row:row + a].double(), ref, atol=atol, rtol=rtol,
                                           msg=lambda m, sid=sid, layer=layer: f"sequence {sid}, layer {layer}: {m}")
                row += a
        if abort_after is not None:
            cache.abort_forward()
            return
        cache.end_forward()
        for sid in ids:
            s = staged[sid]
            if s.tree is None:
                s.committed = s.length
            self.seqs[sid] = s

    def commit(self, cache, ids, leaves) -> None:
        cache.commit_accepted(ids, leaves)
        for sid, leaf in zip(ids, leaves):
            s = self.seqs[sid]
            path = []
            while leaf >= 0:
                path.append(leaf)
                leaf = s.tree[leaf]
            keep = [s.committed + node for node in reversed(path)]
            s.k = [x[:s.committed] + [x[i] for i in keep] for x in s.k]
            s.v = [x[:s.committed] + [x[i] for i in keep] for x in s.v]
            s.committed, s.tree = s.length, None

    def check(self, cache, *, exact: bool = True) -> None:
        """Lengths, stored K/V of every layer, and page accounting."""
        assert set(cache.seq_ids) == set(self.seqs)
        used = set()
        for sid, s in self.seqs.items():
            assert cache.seq_len(sid) == s.length and cache.committed_len(sid) == s.committed
            pages = cache.page_indices(sid)
            assert len(pages) == -(-s.length // self.page_size) and len(set(pages)) == len(pages)
            used.update(pages)
            for layer in range(self.num_layers):
                k, v = (x.cpu() for x in cache.get_kv(sid, layer))
                want_k = torch.stack(s.k[layer]) if s.length else k.new_zeros(0, self.h_kv, self.d)
                want_v = torch.stack(s.v[layer]) if s.length else v.new_zeros(0, self.h_kv, self.v_dim or self.d)
                if exact:
                    assert torch.equal(k, want_k) and torch.equal(v, want_v), f"stored K/V of sequence {sid}, layer {layer}"
                else:
                    torch.testing.assert_close(k, want_k, atol=1e-3, rtol=1e-3)
                    torch.testing.assert_close(v, want_v, atol=0, rtol=0)
        assert cache.num_free_pages == self.num_pages - len(used), "shared pages must be counted once"
