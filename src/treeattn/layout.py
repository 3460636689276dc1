"""The paged KV layout: the one place where "page id + offset in page" becomes an address.

Every engine stores pages differently. treeattn reads all of them in place through one logical
view: K and V as strided tensors of shape ``[num_pages, page_size, num_kv_heads, head_dim]`` whose
last dimension is contiguous (vLLM's ``kv_cache_layout`` idea: one logical shape, a stride
permutation per layout); a pair's K alone may have strided head dims (vLLM's CPU cache stores each
page's K dims-major, ``[h_kv, d, page_size]``: the CPU backends read it, Triton refuses it). The
accepted inputs:

- TVM's combined tensor ``[num_pages, 2, h_kv, page_size, d]`` (index 0 = K, 1 = V), the default;
- ``(k_pages, v_pages)`` with ``kv_layout="NHD"``: each ``[num_pages, page_size, h_kv, d]``
  (vLLM, FlashInfer's default), or ``kv_layout="HND"``: each ``[num_pages, h_kv, page_size, d]``.
  K and V may be views into one bigger engine tensor (``buf[:, 0]``, ``buf[:, 1]`` of a
  ``[blocks, 2, page_size, h_kv, d]`` buffer) with any strides, and V may have its own head dim
  (MLA: ``v`` a view of ``k[..., :d_v]``). A token pool is page size 1.

A token of a request sits in *slot* ``page_id * page_size + offset``; ``slots`` maps a page table
and token positions to slots, and ``read``/``write``/``copy`` move tokens by slot. The kernels get
the same addressing as three element strides per tensor (``PagedKV.strides``), and K's dim stride.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

__all__ = ["KV_LAYOUTS", "PagedKV", "SlotIndex", "slots"]

KV_LAYOUTS = ("TVM", "NHD", "HND")
_FLOAT = (torch.float16, torch.bfloat16, torch.float32)


def slots(page_table: np.ndarray, positions: np.ndarray, page_size: int) -> np.ndarray:
    """Slot ``page * page_size + offset`` of each token position of a request whose pages are ``page_table``."""
    return page_table[positions // page_size] * page_size + positions % page_size


class SlotIndex(NamedTuple):
    """Slots as ``(page, offset)`` index tensors on the pages' device: compute once, read or write every layer."""

    page: torch.Tensor
    offset: torch.Tensor

    @classmethod
    def of(cls, slot_ids, page_size: int, device: torch.device | str) -> SlotIndex:
        s = torch.as_tensor(np.asarray(slot_ids, dtype=np.int64)).to(device)
        return cls(s // page_size, s % page_size)


def _check_pages(x, name: str, ndim: int, strided_dims: bool = False) -> torch.Tensor:
    """``strided_dims``: the head dims may lie any positive stride apart (K stored dims-major in each page,
    as vLLM's CPU cache does); otherwise they must be contiguous."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in _FLOAT:
        raise TypeError(f"{name} must be float16, bfloat16 or float32, got {x.dtype}")
    if x.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {tuple(x.shape)}")
    if x.numel() and strided_dims and x.stride(-1) < 1:
        raise ValueError(f"{name} must have a positive stride in its last dimension, got strides {x.stride()}")
    if x.numel() and not strided_dims and x.stride(-1) != 1:
        raise ValueError(f"{name} must have a contiguous last dimension (stride 1), got strides {x.stride()}")
    return x


@dataclass(frozen=True, eq=False)
class PagedKV:
    """K and V pages as logical ``[num_pages, page_size, num_kv_heads, head_dim]`` views (any strides).

    Build it with ``PagedKV.wrap(kv_pages, kv_layout)``; ``k``/``v`` are views of the caller's
    storage, so writes through ``write``/``copy`` land in the engine's own tensors.
    """

    k: torch.Tensor
    v: torch.Tensor
    layout: str

    @classmethod
    def wrap(cls, kv_pages, kv_layout: str | None = None) -> PagedKV:
        """Validate an engine's pages and view them logically; ``kv_pages`` is TVM's combined tensor or a
        ``(k_pages, v_pages)`` pair laid out as ``kv_layout`` (``"NHD"``, the default for a pair, or ``"HND"``)."""
        if isinstance(kv_pages, PagedKV):
            return kv_pages
        if isinstance(kv_pages, torch.Tensor):
            if kv_layout not in (None, "TVM"):
                raise ValueError(f"kv_layout={kv_layout!r} needs kv_pages=(k_pages, v_pages); a single tensor is "
                                 "TVM's combined [num_pages, 2, h_kv, page_size, d] layout (kv_layout='TVM')")
            pages = _check_pages(kv_pages, "kv_pages", 5)
            if pages.shape[1] != 2:
                raise ValueError("kv_pages must have shape [num_pages, 2, h_kv, page_size, d] (0 = K, 1 = V), "
                                 f"got {tuple(pages.shape)}")
            k, v, layout = pages[:, 0].transpose(1, 2), pages[:, 1].transpose(1, 2), "TVM"
        elif isinstance(kv_pages, (tuple, list)) and len(kv_pages) == 2:
            layout = "NHD" if kv_layout is None else kv_layout
            if layout not in ("NHD", "HND"):
                raise ValueError(f"kv_layout must be 'NHD' or 'HND' for a (k_pages, v_pages) pair, got {kv_layout!r}")
            k = _check_pages(kv_pages[0], "k_pages", 4, strided_dims=True)
            v = _check_pages(kv_pages[1], "v_pages", 4)
            if layout == "HND":
                k, v = k.transpose(1, 2), v.transpose(1, 2)
            if k.dtype != v.dtype or k.device != v.device:
                raise TypeError(f"k_pages and v_pages must share dtype and device, got {k.dtype} on {k.device} "
                                f"and {v.dtype} on {v.device}")
            if k.shape[:3] != v.shape[:3]:
                dims = "[num_pages, page_size, h_kv]" if layout == "NHD" else "[num_pages, h_kv, page_size]"
                raise ValueError(f"k_pages and v_pages must agree on {dims}, got {tuple(kv_pages[0].shape)} and "
                                 f"{tuple(kv_pages[1].shape)}")
        else:
            raise TypeError("kv_pages must be TVM's combined [num_pages, 2, h_kv, page_size, d] tensor or a "
                            f"(k_pages, v_pages) pair, got {type(kv_pages).__name__}")
        # (data_ptr cannot be traced by torch.compile: a compiled caller has validated its pages before)
        if not torch.compiler.is_compiling() and v.data_ptr() == k.data_ptr() and v.shape[3] > k.shape[3]:
            raise ValueError(f"v_pages starts where k_pages does (a view of it, as MLA's latent) but has head dim "
                             f"{v.shape[3]} > k's {k.shape[3]}: a view of K can only take K's first dims")
        if k.shape[1] < 1:
            raise ValueError(f"{'kv_pages' if layout == 'TVM' else 'k_pages'} has page_size 0")
        if k.shape[2] < 1 or k.shape[3] < 1 or v.shape[3] < 1:
            raise ValueError(f"pages need at least one KV head and a positive head dim, got K {tuple(k.shape)} "
                             f"and V {tuple(v.shape)} as [num_pages, page_size, h_kv, d]")
        return cls(k, v, layout)

    # ------------------------------------------------------------------ geometry

    @property
    def num_pages(self) -> int:
        return self.k.shape[0]

    @property
    def page_size(self) -> int:
        return self.k.shape[1]

    @property
    def num_kv_heads(self) -> int:
        return self.k.shape[2]

    @property
    def head_dim(self) -> int:
        return self.k.shape[3]

    @property
    def v_head_dim(self) -> int:
        return self.v.shape[3]

    @property
    def dtype(self) -> torch.dtype:
        return self.k.dtype

    @property
    def device(self) -> torch.device:
        return self.k.device

    @staticmethod
    def strides(x: torch.Tensor) -> tuple[int, int, int]:
        """Element strides ``(page, token, head)`` of ``k`` or ``v``: token ``t`` of page ``p``, head ``h``
        starts at ``p * page + t * token + h * head``."""
        return x.stride(0), x.stride(1), x.stride(2)

    # ------------------------------------------------------------------ tokens by slot

    def _index(self, slots_) -> SlotIndex:
        return slots_ if isinstance(slots_, SlotIndex) else SlotIndex.of(slots_, self.page_size, self.device)

    def read(self, slot_ids) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of the tokens in ``slot_ids`` (slot ids or a ``SlotIndex``): ``k [n, h_kv, d]``, ``v [n, h_kv, d_v]``."""
        page, offset = self._index(slot_ids)
        return self.k[page, offset], self.v[page, offset]

    def write(self, slot_ids, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store ``k [n, h_kv, d]`` and ``v [n, h_kv, d_v]`` into ``slot_ids`` (or a ``SlotIndex``), in place."""
        page, offset = self._index(slot_ids)
        self.k.index_put_((page, offset), k)
        if not self.shares_storage():
            self.v.index_put_((page, offset), v)

    def copy(self, src_slots, dst_slots) -> None:
        """Copy tokens from ``src_slots`` to ``dst_slots`` (every source is read before any write)."""
        k, v = self.read(src_slots)
        self.write(dst_slots, k, v)

    def gather(self, page_table, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A request's first ``length`` tokens, read from its ``page_table`` in order (copies)."""
        table = np.asarray(page_table, dtype=np.int64)
        return self.read(slots(table, np.arange(length), self.page_size))

    @staticmethod
    def gather_heads(x: torch.Tensor, page_ids: torch.Tensor, buf: torch.Tensor) -> torch.Tensor:
        """Copy pages ``page_ids`` of ``x`` (``k`` or ``v``) into ``buf`` (flat, large enough) and return them as
        ``[h_kv, len(page_ids) * page_size, d]`` with one key stride per head, as a flash kernel reads keys.

        One row gather when the layout allows: a ``[page_size, d]`` slab per (page, head) is contiguous in
        TVM's and the HND layout, a ``[page_size, h_kv, d]`` block per page in NHD (the result is then
        token-major). Other strides take a general, slower gather.
        """
        _, ps, h, d = x.shape
        n = page_ids.shape[0]
        sp, st, sh = PagedKV.strides(x)
        slab, block = ps * d, ps * h * d
        if st == d and sp % slab == 0 and sh % slab == 0:
            rows = x.as_strided((((x.shape[0] - 1) * sp + (h - 1) * sh) // slab + 1, slab), (slab, 1))
            index = (page_ids[None, :] * (sp // slab) + torch.arange(h)[:, None] * (sh // slab)).reshape(-1)
            out = buf[:h * n * slab].view(h * n, slab)
            torch.index_select(rows, 0, index, out=out)
            return out.view(h, n * ps, d)
        if sh == d and st == h * d and sp % block == 0:
            rows = x.as_strided(((x.shape[0] - 1) * sp // block + 1, block), (block, 1))
            out = buf[:n * block].view(n, block)
            torch.index_select(rows, 0, page_ids * (sp // block), out=out)
            return out.view(n * ps, h, d).transpose(0, 1)
        out = buf[:n * block].view(h, n, ps, d)
        torch.index_select(x.permute(2, 0, 1, 3), 1, page_ids, out=out)
        return out.view(h, n * ps, d)

    def shares_storage(self) -> bool:
        """True when V is a view of K's own values (MLA: V = the first ``d_v`` dims of the latent K),
        so writing K writes V too."""
        return (self.v.data_ptr() == self.k.data_ptr() and self.v.stride() == self.k.stride()
                and self.v.shape[3] <= self.k.shape[3])
