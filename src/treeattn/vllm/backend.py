"""treeattn as a vLLM attention backend (the contract of ``vllm/v1/attention/backend.py``, vLLM 0.32).

- **Cache**: vLLM allocates it as for ``CPU_ATTN`` (layout ``LBHNC``, one ``[num_blocks, h_kv,
  block_size, 2 * head_size]`` tensor per layer). Where vLLM's own CPU kernel is its ``vec`` /
  ``vec16`` one (fp32 on x86, 16-bit without AMX; ``shared_cpu_isa``), the cells are exactly vLLM's
  (K dims-major, then V rows), written by vLLM's own store op: a step without draft trees (prefills,
  plain decoding, a step the gate kept plain) runs vLLM's own kernel, so it costs what plain vLLM
  costs, and treeattn's kernels read the same cells for tree steps (K through its dim stride).
  Elsewhere (CUDA, vLLM's ``amx`` packing, forced ``kernels``) each cell is treeattn's own: K rows
  then V rows, and every step runs treeattn. ``batch.split_kv_cache`` views either as an ``HND`` pair.
- **Builder**: once per step, vLLM's batch becomes one ``TreeAttentionPlan`` (``batch.step_plan``),
  shared by every layer of the KV cache group; with tree speculation (``treeattn.vllm.speculative``)
  the requests' draft trees go into it. A plain step on vLLM's cells builds vLLM's metadata instead.
- **Impl**: ``do_kv_cache_update`` stores the new K/V by vLLM's ``slot_mapping``; ``forward`` is
  one call into vLLM's output buffer: the first layer of a step checks and dispatches it
  (``prepare_paged_tree_attention``), every layer runs it with no other host work.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import ClassVar

import numpy as np
import torch
from vllm import _custom_ops as vllm_ops
from vllm import envs
from vllm.config import VllmConfig, get_layers_from_vllm_config
from vllm.forward_context import get_forward_context, is_forward_context_available
from vllm.logger import init_logger
from vllm.model_executor.layers.attention import Attention
from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionCGSupport,
    AttentionImpl,
    AttentionMetadata,
    AttentionMetadataBuilder,
    AttentionType,
    CommonAttentionMetadata,
)
from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend, _get_attn_isa
from vllm.v1.attention.backends.utils import get_num_attention_heads_from_layers
from vllm.v1.kv_cache_interface import AttentionSpec, KVCacheLayout

from ..layout import PagedKV, SlotIndex
from ..ops import prepare_paged_tree_attention
from ..plan import TreeAttentionPlan
from .batch import move_tokens, split_kv_cache, step_plan
from .speculative import step_trees

logger = init_logger("vllm.treeattn")


class _DropThreadWarning(logging.Filter):
    """vLLM's CPU worker binds its OpenMP threads and replaces ``torch.set_num_threads`` with a warning.
    treeattn's CPU backend asks for one thread around small ops, twice per layer: inside the worker the
    request is ignored (the bound threads stay, which is what vLLM wants), so its warning is only noise."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "torch.set_num_threads" not in record.getMessage()


logging.getLogger("vllm.v1.worker.cpu_worker").addFilter(_DropThreadWarning())


def shared_cpu_isa(dtype: torch.dtype, block_size: int, head_size: int, device: torch.device | str,
                   kernels: str | None = None) -> str | None:
    """The ISA of vLLM's own CPU kernel for this cache when treeattn shares its cells, else None.

    vLLM's ``vec`` and ``vec16`` kernels keep a cell's K dims-major and its V as rows, which treeattn's
    CPU kernels read; its ``amx`` kernel packs K in tiles of its own. A forced ``TreeAttentionImpl.kernels``
    (``kernels``, e.g. Triton, which needs K rows) keeps treeattn's own cells."""
    if torch.device(device).type != "cpu" or kernels is not None:
        return None
    if head_size not in CPUAttentionBackend.get_supported_head_sizes():
        return None
    isa = _get_attn_isa(dtype, block_size, head_size, "auto")
    return isa if (isa == "vec" and block_size % 32 == 0) or (isa == "vec16" and block_size % 16 == 0) else None


def _is_chain(parents) -> bool:
    """A tree that is a chain over the new tokens is causal attention: vLLM's kernel computes it."""
    return parents is None or len(parents) <= 1 or bool((np.asarray(parents) == np.arange(-1, len(parents) - 1)).all())


@dataclass(frozen=True)
class _VllmStep:
    """A step without draft trees on vLLM's own cells, as vLLM's CPU kernel takes it."""

    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    scheduler_metadata: torch.Tensor


@dataclass
class TreeAttentionMetadata(AttentionMetadata):
    plan: TreeAttentionPlan | None  # None: a step run by vLLM's own kernel (``vllm``)
    num_actual_tokens: int  # rows vLLM may pad past the plan's are left untouched
    # The step's attention call, checked and dispatched by the first layer and run by every layer
    # alike (with an LSE buffer they share: vLLM reads only the output), by the layers' common shape.
    calls: dict = field(default_factory=dict)
    store: _StoreIndex | None = None  # where this step's new K/V go, for every layer
    vllm: _VllmStep | None = None


@dataclass(frozen=True)
class _StoreIndex:
    """vLLM's slot mapping as treeattn stores by it: the rows to keep (None: all; vLLM marks padding
    tokens with slot -1) and their (page, offset), built on the mapping's device (no host round trip)."""

    source: tuple[int, int]  # (data_ptr, length) of the slot mapping it was built from
    rows: torch.Tensor | None
    index: SlotIndex

    @classmethod
    def build(cls, slot_mapping: torch.Tensor, page_size: int) -> _StoreIndex:
        keep = slot_mapping >= 0
        rows = None if bool(keep.all()) else keep.nonzero().squeeze(1)
        slot = (slot_mapping if rows is None else slot_mapping[rows]).long()
        return cls((slot_mapping.data_ptr(), slot_mapping.shape[0]), rows, SlotIndex(slot // page_size, slot % page_size))


@dataclass(frozen=True)
class _Cells:
    """A layer's cache: ``pages`` as treeattn reads it; ``vllm_views`` the ``(key_cache, value_cache)`` views
    vLLM's own CPU ops take, used when ``isa`` (``shared_cpu_isa``) is not None."""

    key: tuple
    isa: str | None
    pages: PagedKV
    vllm_views: tuple[torch.Tensor, torch.Tensor]


class TreeAttentionMetadataBuilder(AttentionMetadataBuilder[TreeAttentionMetadata]):
    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.NEVER  # the plan is host work

    def __init__(self, kv_cache_spec: AttentionSpec, layer_names: list[str], vllm_config: VllmConfig,
                 device: torch.device) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self.page_size = kv_cache_spec.block_size
        self._layers = get_layers_from_vllm_config(vllm_config, Attention, layer_names)
        dtype = vllm_config.model_config.dtype
        self.isa = shared_cpu_isa(dtype, self.page_size, kv_cache_spec.head_size, device, TreeAttentionImpl.kernels)
        self._heads = get_num_attention_heads_from_layers(vllm_config, layer_names) or \
            vllm_config.model_config.get_num_attention_heads(vllm_config.parallel_config)
        self._dtype, self._head_size, self._kv_heads = dtype, kv_cache_spec.head_size, kv_cache_spec.num_kv_heads
        if self.isa is not None:  # what vLLM's own builder gives its kernel
            windows = {getattr(layer.impl, "sliding_window", None) for layer in self._layers.values()}
            self._window = (next(iter(windows)) or -1) if len(windows) == 1 else -1
        self._warm_up()

    def _warm_up(self) -> None:
        """One tiny tree step through the kernels this engine will run, now: a first use builds or loads the
        native kernel and checks its brgemm path (seconds, on a first build minutes), which inside a
        served step would stall the requests and teach the step gate that trees cost that much."""
        if self.device.type != "cpu":
            return
        size, heads, kv_heads, d = self.page_size, self._heads, self._kv_heads, self._head_size
        cache = torch.randn(2, kv_heads, size, 2 * d).to(self._dtype)
        pages = PagedKV.wrap(split_kv_cache(cache, self.isa is not None), "HND")
        plan = step_plan(torch.tensor([0, 3]), torch.tensor([size + 3]), torch.tensor([[0, 1]]), page_size=size,
                         num_pages=2, trees=[np.array([-1, 0, 0])])
        q = torch.randn(3, heads, d).to(self._dtype)
        prepare_paged_tree_attention(q, pages, sm_scale=d ** -0.5, plan=plan, backend=TreeAttentionImpl.kernels
                                     ).run(q, pages)

    def _num_pages(self) -> int:
        # The group's layers share one block pool: any layer's cache tells how many pages exist.
        caches = [layer.kv_cache for layer in self._layers.values() if layer.kv_cache.dim() == 4]
        return caches[0].shape[0] if caches else 0

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> TreeAttentionMetadata:
        m = common_attn_metadata
        if isinstance(m.causal, torch.Tensor) or not m.causal:
            raise NotImplementedError("treeattn's vLLM backend serves causal decoder attention only")
        trees = step_trees(m.num_reqs)
        if self.isa is not None and (trees is None or all(_is_chain(t) for t in trees)):
            schedule = vllm_ops.cpu_attn_get_scheduler_metadata(
                num_reqs=m.num_reqs, num_heads=self._heads, num_kv_heads=self._kv_heads, head_dim=self._head_size,
                seq_lens=m.seq_lens, dtype=self._dtype, query_start_loc=m.query_start_loc, causal=True,
                sliding_window_size=self._window, isa=self.isa, enable_kv_split=envs.VLLM_CPU_ATTN_SPLIT_KV,
                dynamic_causal=None, kv_cache_dtype="auto")
            step = _VllmStep(m.query_start_loc, m.seq_lens, m.block_table_tensor, schedule)
            return TreeAttentionMetadata(plan=None, num_actual_tokens=m.num_actual_tokens, vllm=step)
        plan = step_plan(m.query_start_loc_cpu, m.seq_lens.cpu(), m.block_table_tensor[: m.num_reqs].cpu(),
                         page_size=self.page_size, num_pages=self._num_pages(), trees=trees, device=self.device)
        store = None if self.isa is not None else _StoreIndex.build(m.slot_mapping, self.page_size)  # vLLM's op stores
        return TreeAttentionMetadata(plan=plan, num_actual_tokens=m.num_actual_tokens, store=store)


class TreeAttentionImpl(AttentionImpl[TreeAttentionMetadata]):
    # None: treeattn's capability dispatch picks the kernel (Triton on CUDA; on the CPU the native C++
    # kernel, else PyTorch). A backend name forces one, e.g. "triton" on CPU tensors under
    # TRITON_INTERPRET=1, which is how the CUDA path is checked on a machine without a GPU.
    kernels: str | None = None

    def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: int | None = None,
                 alibi_slopes: list[float] | None = None, sliding_window: int | None = None,
                 kv_cache_dtype: str = "auto", logits_soft_cap: float | None = None,
                 attn_type: str = AttentionType.DECODER, kv_sharing_target_layer_name: str | None = None,
                 sinks: torch.Tensor | None = None) -> None:
        unsupported = [name for name, used in (
            ("ALiBi", alibi_slopes is not None),
            (f"attention type {attn_type}", attn_type != AttentionType.DECODER),
            (f"kv_cache_dtype={kv_cache_dtype!r}", kv_cache_dtype != "auto"),
        ) if used]
        if unsupported:
            raise NotImplementedError(f"treeattn's vLLM backend does not support {', '.join(unsupported)}; "
                                      "unset TREEATTN_VLLM to use vLLM's own attention")
        # vLLM's variants mean what treeattn's do: a window of W keys ending at the query's own position,
        # scores soft-capped after scaling, one sink logit per query head (a weight vLLM loads later).
        self.sliding_window = sliding_window if sliding_window and sliding_window > 0 else None
        self.logit_softcap = float(logits_soft_cap) if logits_soft_cap else None
        self.sinks = sinks
        self.num_heads, self.head_size, self.scale = num_heads, head_size, float(scale)
        self.num_kv_heads = num_kv_heads or num_heads
        self.kv_cache_dtype = kv_cache_dtype
        self.kv_sharing_target_layer_name = kv_sharing_target_layer_name
        self._cells: _Cells | None = None  # this layer's cache as treeattn and vLLM see it, made once
        logger.info_once("Using treeattn attention backend.")

    def _cache(self, kv_cache: torch.Tensor) -> _Cells:
        """The layer's cache seen as pages; vLLM hands the same tensor every step."""
        key = (kv_cache.data_ptr(), tuple(kv_cache.shape), kv_cache.dtype)
        if self._cells is None or self._cells.key != key:
            isa = shared_cpu_isa(kv_cache.dtype, kv_cache.shape[2], kv_cache.shape[3] // 2, kv_cache.device,
                                 self.kernels)
            self._cells = _Cells(key, isa, PagedKV.wrap(split_kv_cache(kv_cache, isa is not None), "HND"),
                                 split_kv_cache(kv_cache))
        return self._cells

    def move_tokens(self, kv_cache: torch.Tensor, src_slots: torch.Tensor, dst_slots: torch.Tensor) -> None:
        """Copy the K/V of ``src_slots`` to ``dst_slots`` in this layer's cache (a tree step's accepted path)."""
        move_tokens(kv_cache, src_slots, dst_slots, self._cache(kv_cache).isa is not None)

    def do_kv_cache_update(self, layer: torch.nn.Module, key: torch.Tensor, value: torch.Tensor,
                           kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        cells = self._cache(kv_cache)
        if cells.isa is not None:  # vLLM's cells: vLLM's own store
            vllm_ops.cpu_attn_reshape_and_cache(key, value, *cells.vllm_views, slot_mapping, cells.isa,
                                                k_scale=layer._k_scale_float, v_scale=layer._v_scale_float,
                                                kv_cache_dtype="auto")
            return
        pages = cells.pages
        # The step's store index, built once by the builder from this same mapping; else built here.
        metadata = get_forward_context().attn_metadata if is_forward_context_available() else None
        if isinstance(metadata, dict):
            metadata = metadata.get(getattr(layer, "layer_name", None))
        store = getattr(metadata, "store", None)
        if store is None or store.source != (slot_mapping.data_ptr(), slot_mapping.shape[0]):
            store = _StoreIndex.build(slot_mapping, pages.page_size)
        n = slot_mapping.shape[0]
        key, value = key[:n], value[:n]
        if store.rows is not None:
            key, value = key[store.rows], value[store.rows]
        pages.write(store.index, key, value)

    def forward(self, layer, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                attn_metadata: TreeAttentionMetadata | None, output: torch.Tensor,
                output_scale: torch.Tensor | None = None,
                output_block_scale: torch.Tensor | None = None) -> torch.Tensor:
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("treeattn's vLLM backend does not fuse output quantization")
        if attn_metadata is None:  # vLLM's profiling run: no batch, nothing to attend
            return output
        if attn_metadata.plan is None:
            return self._vllm_forward(layer, query, kv_cache, attn_metadata, output)
        plan, rows = attn_metadata.plan, attn_metadata.plan.total_q
        q, pages = query[:rows], self._cache(kv_cache).pages
        key = (tuple(q.shape), q.dtype, self.scale, self.kernels, self.sliding_window, self.logit_softcap,
               None if self.sinks is None else id(self.sinks))
        if key not in attn_metadata.calls:  # index arrays None: the plan's own (built once per step)
            call = prepare_paged_tree_attention(q, pages, sm_scale=self.scale, plan=plan, backend=self.kernels,
                                                sliding_window=self.sliding_window,
                                                logit_softcap=self.logit_softcap,
                                                sinks=None if self.sinks is None else self.sinks.float())
            attn_metadata.calls[key] = call, torch.empty(q.shape[:2], dtype=torch.float32, device=q.device)
        call, lse = attn_metadata.calls[key]
        call.run(q, pages, out=output[:rows], lse=lse)
        return output

    def _vllm_forward(self, layer, query: torch.Tensor, kv_cache: torch.Tensor, metadata: TreeAttentionMetadata,
                      output: torch.Tensor) -> torch.Tensor:
        """A step without trees on vLLM's cells: vLLM's own CPU kernel, as its ``CPU_ATTN`` backend calls it."""
        step, n = metadata.vllm, metadata.num_actual_tokens
        sinks = self.sinks
        if sinks is not None and sinks.dtype not in (torch.bfloat16, torch.float32):
            sinks = sinks.float()
        k_cache, v_cache = self._cache(kv_cache).vllm_views
        vllm_ops.cpu_attention_with_kv_cache(
            query=query[:n], key_cache=k_cache, value_cache=v_cache, output=output[:n],
            query_start_loc=step.query_start_loc, seq_lens=step.seq_lens, scale=self.scale, causal=True,
            alibi_slopes=None, sliding_window=self.sliding_window or -1, block_table=step.block_table,
            softcap=self.logit_softcap or 0.0, scheduler_metadata=step.scheduler_metadata, s_aux=sinks,
            dynamic_causal=None, k_scale=layer._k_scale_float, v_scale=layer._v_scale_float, kv_cache_dtype="auto")
        return output


class TreeAttentionBackend(AttentionBackend):
    """Base of the registered classes; ``get_name`` must be the enum member they are registered as."""

    forward_includes_kv_cache_update: bool = False
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16, torch.float32]
    supported_kv_cache_dtypes: ClassVar[list[str]] = ["auto"]

    @classmethod
    def supports_sliding_window(cls) -> bool:
        return True

    @classmethod
    def supports_sink(cls) -> bool:
        return True

    @classmethod
    def supported_kv_cache_layouts(cls) -> tuple[KVCacheLayout, ...]:
        return (KVCacheLayout.LBHNC,)  # see split_kv_cache

    @staticmethod
    def get_builder_cls() -> type[TreeAttentionMetadataBuilder]:
        return TreeAttentionMetadataBuilder

    @staticmethod
    def get_impl_cls() -> type[TreeAttentionImpl]:
        return TreeAttentionImpl


class TreeAttentionCPUBackend(TreeAttentionBackend):
    """Registered as ``CPU_ATTN``: the CPU platform always picks that member."""

    @staticmethod
    def get_name() -> str:
        return "CPU_ATTN"


class TreeAttentionCUDABackend(TreeAttentionBackend):
    """Registered as ``CUSTOM`` on CUDA (``attention_backend="CUSTOM"``); runs the Triton kernels."""

    @staticmethod
    def get_name() -> str:
        return "CUSTOM"
