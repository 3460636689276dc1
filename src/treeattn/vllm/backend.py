"""treeattn as a vLLM attention backend (the contract of ``vllm/v1/attention/backend.py``, vLLM 0.32).

- **Cache**: vLLM allocates it as for ``CPU_ATTN`` (layout ``LBHNC``, one ``[num_blocks, h_kv,
  block_size, 2 * head_size]`` tensor per layer); ``batch.split_kv_cache`` views each
  ``(block, head)`` cell as plain K rows then V rows, treeattn's ``HND`` pair, so the kernels read
  and write vLLM's tensor in place. Inside a cell the bytes differ from ``CPU_ATTN``'s (which packs
  K per CPU ISA, e.g. transposed), so tools that parse ``CPU_ATTN`` pages (its NIXL connector) do
  not apply.
- **Builder**: once per step, vLLM's batch becomes one ``TreeAttentionPlan`` (``batch.step_plan``),
  shared by every layer of the KV cache group; with tree speculation (``treeattn.vllm.speculative``)
  the requests' draft trees go into it.
- **Impl**: ``do_kv_cache_update`` stores the new K/V by vLLM's ``slot_mapping``; ``forward`` is
  one call into vLLM's output buffer: the first layer of a step checks and dispatches it
  (``prepare_paged_tree_attention``), every layer runs it with no other host work.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import ClassVar

import torch
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
from vllm.v1.kv_cache_interface import AttentionSpec, KVCacheLayout

from ..layout import PagedKV, SlotIndex
from ..ops import prepare_paged_tree_attention
from ..plan import TreeAttentionPlan
from .batch import split_kv_cache, step_plan
from .speculative import step_trees

logger = init_logger("vllm.treeattn")


class _DropThreadWarning(logging.Filter):
    """vLLM's CPU worker binds its OpenMP threads and replaces ``torch.set_num_threads`` with a warning.
    treeattn's CPU backend asks for one thread around small ops, twice per layer: inside the worker the
    request is ignored (the bound threads stay, which is what vLLM wants), so its warning is only noise."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "torch.set_num_threads" not in record.getMessage()


logging.getLogger("vllm.v1.worker.cpu_worker").addFilter(_DropThreadWarning())


@dataclass
class TreeAttentionMetadata(AttentionMetadata):
    plan: TreeAttentionPlan
    num_actual_tokens: int  # rows vLLM may pad past the plan's are left untouched
    # The step's attention call, checked and dispatched by the first layer and run by every layer
    # alike (with an LSE buffer they share: vLLM reads only the output), by the layers' common shape.
    calls: dict = field(default_factory=dict)
    store: _StoreIndex | None = None  # where this step's new K/V go, for every layer


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


class TreeAttentionMetadataBuilder(AttentionMetadataBuilder[TreeAttentionMetadata]):
    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.NEVER  # the plan is host work

    def __init__(self, kv_cache_spec: AttentionSpec, layer_names: list[str], vllm_config: VllmConfig,
                 device: torch.device) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self.page_size = kv_cache_spec.block_size
        self._layers = get_layers_from_vllm_config(vllm_config, Attention, layer_names)

    def _num_pages(self) -> int:
        # The group's layers share one block pool: any layer's cache tells how many pages exist.
        caches = [layer.kv_cache for layer in self._layers.values() if layer.kv_cache.dim() == 4]
        return caches[0].shape[0] if caches else 0

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> TreeAttentionMetadata:
        m = common_attn_metadata
        if isinstance(m.causal, torch.Tensor) or not m.causal:
            raise NotImplementedError("treeattn's vLLM backend serves causal decoder attention only")
        plan = step_plan(m.query_start_loc_cpu, m.seq_lens.cpu(), m.block_table_tensor[: m.num_reqs].cpu(),
                         page_size=self.page_size, num_pages=self._num_pages(), trees=step_trees(m.num_reqs),
                         device=self.device)
        return TreeAttentionMetadata(plan=plan, num_actual_tokens=m.num_actual_tokens,
                                     store=_StoreIndex.build(m.slot_mapping, self.page_size))


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
        self._pages: tuple[tuple, PagedKV] | None = None  # this layer's cache seen as pages, made once
        logger.info_once("Using treeattn attention backend.")

    def _paged(self, kv_cache: torch.Tensor) -> PagedKV:
        """The layer's cache as treeattn pages; vLLM hands the same tensor every step."""
        key = (kv_cache.data_ptr(), tuple(kv_cache.shape), kv_cache.dtype)
        if self._pages is None or self._pages[0] != key:
            self._pages = (key, PagedKV.wrap(split_kv_cache(kv_cache), "HND"))
        return self._pages[1]

    def do_kv_cache_update(self, layer: torch.nn.Module, key: torch.Tensor, value: torch.Tensor,
                           kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        pages = self._paged(kv_cache)
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
        plan, rows = attn_metadata.plan, attn_metadata.plan.total_q
        q, pages = query[:rows], self._paged(kv_cache)
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
