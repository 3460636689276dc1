"""Random tree-attention problems: tree shapes, ragged and paged batches, poisoned outputs.

Used by the test suite and by ``treeattn check``. A batch is a list of ``Request``s. Each request
has a prefix of ``prefix`` keys, then its tree (the last ``len(parents)`` keys), and ``qo`` query
rows (default: the whole tree), which are the last ``qo`` tree nodes. ``parents=()`` with
``qo > 0`` is a request without a tree (no mask).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from .layout import PagedKV, slots
from .tree import pack_trees

# ---------------------------------------------------------------- trees


def chain(n: int) -> list[int]:
    return list(range(-1, n - 1))


def star(n: int) -> list[int]:
    return [-1] + [0] * (n - 1)


def binary(n: int) -> list[int]:
    """Complete binary tree in level order (TVM's test trees): parent of k is (k - 1) // 2."""
    return [-1] + [(k - 1) // 2 for k in range(1, n)]


def forest(*trees: list[int]) -> list[int]:
    out: list[int] = []
    for t in trees:
        off = len(out)
        out += [p + off if p >= 0 else -1 for p in t]
    return out


def random_tree(rng: np.random.Generator, n: int, root_prob: float = 0.0) -> list[int]:
    """Random parent array; each node after the first is a root with ``root_prob``."""
    parents = [-1]
    for i in range(1, n):
        parents.append(-1 if rng.random() < root_prob else int(rng.integers(0, i)))
    return parents[:n]


# ---------------------------------------------------------------- batches


@dataclass
class Request:
    parents: list[int] | tuple = ()
    prefix: int = 0
    qo: int | None = None  # default: every tree node is a query row

    @property
    def n(self) -> int:
        return len(self.parents)

    @property
    def kv(self) -> int:
        return self.prefix + self.n

    @property
    def rows(self) -> int:
        return self.n if self.qo is None else self.qo


@dataclass
class Batch:
    requests: list[Request]
    q: torch.Tensor
    q_indptr: torch.Tensor
    k: torch.Tensor  # ragged keys, [sum kv, h_kv, d]
    v: torch.Tensor
    kv_indptr: torch.Tensor
    tree_indptr: torch.Tensor
    tree_order: torch.Tensor
    extra: dict = field(default_factory=dict)

    def ragged_args(self):
        return (self.q, self.q_indptr, self.k, self.v, self.kv_indptr, self.tree_indptr, self.tree_order)

    def paged_args(self):
        e = self.extra
        return (self.q, self.q_indptr, e["kv_pages"], e["page_indptr"], e["page_indices"], e["last_page_len"],
                self.tree_indptr, self.tree_order)


def _indptr(lengths) -> torch.Tensor:
    return torch.tensor([0, *np.cumsum(lengths, dtype=np.int64).tolist()], dtype=torch.int32)


def randn(gen: torch.Generator, shape, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(shape, generator=gen, dtype=torch.float32) * scale).to(dtype)


def make_batch(requests, *, h_q: int = 4, h_kv: int = 2, d: int = 64, dtype=torch.float32, seed: int = 0,
               page_size: int | None = None, spare_pages: int = 3, shuffle_pages: bool = True,
               device="cpu") -> Batch:
    """Random q/k/v for ``requests``; with ``page_size`` also a shuffled paged copy of the keys."""
    gen = torch.Generator().manual_seed(seed)
    for r in requests:
        if r.rows > max(r.n, 0) and r.n:
            raise ValueError(f"bad test request {r}: qo > tree size")
    rows = [r.rows for r in requests]
    kvs = [r.kv for r in requests]
    q = randn(gen, (sum(rows), h_q, d), dtype)
    k = randn(gen, (sum(kvs), h_kv, d), dtype)
    v = randn(gen, (sum(kvs), h_kv, d), dtype)
    tree_indptr, tree_order = pack_trees([list(r.parents) for r in requests])
    batch = Batch(list(requests), q, _indptr(rows), k, v, _indptr(kvs), tree_indptr, tree_order)
    if page_size is not None:
        batch.extra.update(paginate(k, v, kvs, page_size, gen, spare_pages, shuffle_pages))
    if device != "cpu":
        batch = to_device(batch, device)
    return batch


def paginate(k, v, kv_lens, page_size, gen, spare_pages=3, shuffle=True) -> dict:
    """Scatter ragged keys into TVM's ``[num_pages, 2, h_kv, page_size, d]`` pages with shuffled ids
    (unused slots hold large garbage, so a kernel that reads them fails)."""
    counts = [-(-n // page_size) for n in kv_lens]
    total = sum(counts) + spare_pages
    ids = torch.randperm(total, generator=gen) if shuffle else torch.arange(total)
    h_kv, d = k.shape[1], k.shape[2]
    pages = randn(gen, (total, 2, h_kv, page_size, d), k.dtype, scale=100.0)
    kv = PagedKV.wrap(pages)
    page_indices, start, used = [], 0, 0
    for n, c in zip(kv_lens, counts):
        mine = ids[used:used + c].numpy()
        used += c
        kv.write(slots(mine, np.arange(n), page_size), k[start:start + n], v[start:start + n])
        page_indices += mine.tolist()
        start += n
    last = [((n - 1) % page_size) + 1 if n else 0 for n in kv_lens]
    return {
        "kv_pages": pages,
        "page_indptr": _indptr(counts),
        "page_indices": torch.tensor(page_indices, dtype=torch.int32),
        "last_page_len": torch.tensor(last, dtype=torch.int32),
    }


def as_layout(kv_pages: torch.Tensor, layout: str):
    """TVM's combined pages in an engine's layout: ``"TVM"`` (unchanged), ``"NHD"``/``"HND"`` (a contiguous
    ``(k_pages, v_pages)`` pair), ``"views"`` (NHD K and V as strided views of one
    ``[num_pages, 2, page_size, h_kv, d]`` buffer, as vLLM allocates them), ``"interleaved"`` (NHD views of
    one ``[num_pages, page_size, h_kv, 2, d]`` buffer: K and V side by side in each head's row) or
    ``"own-strides"`` (a contiguous NHD K, and V a view with another page stride: K and V strided
    differently). Returns ``(kv_pages, kv_layout)``."""
    if layout == "TVM":
        return kv_pages, None
    k, v = kv_pages[:, 0], kv_pages[:, 1]  # [P, h_kv, page_size, d]
    if layout == "HND":
        return (k.contiguous(), v.contiguous()), "HND"
    if layout == "NHD":
        return (k.transpose(1, 2).contiguous(), v.transpose(1, 2).contiguous()), "NHD"
    if layout == "views":
        buf = kv_pages.transpose(2, 3).contiguous()  # [P, 2, page_size, h_kv, d]
        return (buf[:, 0], buf[:, 1]), "NHD"
    if layout == "interleaved":
        buf = kv_pages.permute(0, 3, 2, 1, 4).contiguous()  # [P, page_size, h_kv, 2, d]
        return (buf[..., 0, :], buf[..., 1, :]), "NHD"
    if layout == "own-strides":
        buf = torch.cat([kv_pages, kv_pages[:, :1]], dim=1).transpose(2, 3).contiguous()  # [P, 3, page_size, h_kv, d]
        return (buf[:, 0].contiguous(), buf[:, 1]), "NHD"
    raise ValueError(f"unknown layout {layout!r}")


def to_device(batch: Batch, device) -> Batch:
    move = lambda t: t.to(device) if isinstance(t, torch.Tensor) else t
    return Batch(batch.requests, *(move(t) for t in batch.ragged_args()),
                 extra={k: move(t) for k, t in batch.extra.items()})


def poisoned(like: torch.Tensor, shape=None, dtype=None) -> torch.Tensor:
    """An output buffer full of NaN, so anything a kernel forgets to write shows up."""
    return torch.full(shape if shape is not None else like.shape, float("nan"),
                      dtype=dtype or like.dtype, device=like.device)


def outputs_for(q: torch.Tensor, v_head_dim: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Poisoned ``out`` (``v_head_dim`` columns when V has a head dim of its own) and ``lse`` for ``q``."""
    out_shape = q.shape if v_head_dim is None else (*q.shape[:2], v_head_dim)
    return poisoned(q, out_shape), poisoned(q, q.shape[:2], torch.float32)


# Tolerances against the float64 reference, by dtype: (output atol, output rtol).
TOL = {torch.float32: (2e-5, 1e-5), torch.float16: (3e-3, 3e-3), torch.bfloat16: (2e-2, 2e-2)}
LSE_RTOL = 1e-3


def assert_close_to_reference(out, lse, ref_out, ref_lse, dtype) -> None:
    atol, rtol = TOL[dtype]
    assert not torch.isnan(out).any() and not torch.isnan(lse).any(), "output left unwritten (NaN poison)"
    torch.testing.assert_close(out.float().cpu(), ref_out.float().cpu(), atol=atol, rtol=rtol)
    torch.testing.assert_close(lse.cpu(), ref_lse.cpu(), atol=LSE_RTOL, rtol=LSE_RTOL)


# A batch that mixes the edge cases: forest, chain, star, qo < tree, no tree, no KV, qo 0.
MIXED = [
    Request(binary(7), prefix=17),
    Request(forest(binary(7), binary(7)), prefix=0),
    Request(chain(10), prefix=16),
    Request(star(9), prefix=1, qo=4),
    Request((), prefix=15, qo=3),
    Request((), prefix=0, qo=2),  # no keys at all: out 0, lse -5e4
    Request(chain(3), prefix=31, qo=0),  # no query rows
    Request([-1], prefix=32),
]
