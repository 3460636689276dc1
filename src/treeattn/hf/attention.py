"""The ``"treeattn"`` attention implementation for HF transformers, and the HF ``Cache`` it runs on.

The split between the two objects follows from one fact: ``PagedKVCache.attention`` stores a layer's
new K/V and attends in one call, with the step's plan (which tokens form which tree, which slots
they go to). So the cache is only the HF face of that plan, and the attention function does the work:

* ``TreeCache`` (an HF ``Cache``, one ``_TreeLayer`` per decoder layer, in order) owns a
  ``PagedKVCache``. Its ``update`` stores nothing and returns the new K/V unchanged, so each model's
  own code hands them on to the attention function as it would to SDPA.
* ``tree_attention_forward`` (registered as ``"treeattn"``) gets q/k/v after the model's RoPE,
  which HF computed from the tree positions passed as ``position_ids``; it calls
  ``PagedKVCache.attention`` for ``module.layer_idx`` with the layer's own variants (scale,
  sliding window, soft-cap, sinks) and returns ``[1, T, h_q, d]``. It finds the cache in the
  ``treeattn_cache`` keyword, which most HF models pass down to the attention function unchanged,
  or else in ``active_cache`` (set for the forward by ``HFTreeModel``): some models (StableLM) call
  the attention interface but drop the keywords on the way down.
* The registered mask function builds nothing: the tree structure lives in the cache's plan.

Tokens of all sequences are packed along the sequence axis of a batch of one (``input_ids [1, T]``),
so ragged prompts and trees of different sizes need no padding.
"""

from __future__ import annotations

import contextlib
import contextvars

import torch
from transformers import AttentionInterface
from transformers.cache_utils import Cache, CacheLayerMixin
from transformers.masking_utils import AttentionMaskInterface

from ..kvcache import PagedKVCache

__all__ = ["ATTN_IMPLEMENTATION", "TreeCache", "active_cache", "tree_attention_forward"]

ATTN_IMPLEMENTATION = "treeattn"
_ACTIVE: contextvars.ContextVar[TreeCache | None] = contextvars.ContextVar("treeattn_active_cache", default=None)


class _TreeLayer(CacheLayerMixin):
    """HF's per-layer view of a ``TreeCache``: the storage is the shared ``PagedKVCache``. It holds that,
    not the ``TreeCache``, whose layers hold it: a cycle would keep a finished generation's whole KV
    cache (GBs for a batch) alive until Python's cyclic collector happened to run."""

    def __init__(self, paged: PagedKVCache, is_sliding: bool):
        super().__init__()
        self.paged, self.is_sliding = paged, is_sliding
        self.is_initialized = True

    def lazy_initialization(self, key_states, value_states) -> None:
        pass

    def update(self, key_states, value_states, *args, **kwargs):
        # The attention function stores them: PagedKVCache writes and attends in one planned call.
        return key_states, value_states

    def get_seq_length(self) -> int:
        return max((self.paged.seq_len(s) for s in self.paged.seq_ids), default=0)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return query_length, 0  # asked by HF's mask builder, whose "treeattn" mask is None anyway

    def get_max_length(self) -> int:
        return -1


class TreeCache(Cache):
    """An HF ``Cache`` for one model whose storage is a ``treeattn.PagedKVCache`` (``.paged``).

    Sequences, forwards and commits are the paged cache's (``add_sequence``, ``commit_accepted`` and
    ``remove_sequence`` are forwarded for convenience); ``update`` stores nothing (see the module doc).
    """

    def __init__(self, config, *, num_pages: int, page_size: int = 16, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu", backend: str | None = None):
        config = config.get_text_config()
        num_q_heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_q_heads
        num_kv_heads = getattr(config, "num_key_value_heads", None) or num_q_heads
        if getattr(config, "kv_lora_rank", None):  # MLA: HF expands the latent into K/V for every query head
            num_kv_heads, head_dim = num_q_heads, config.qk_nope_head_dim + config.qk_rope_head_dim
        types = getattr(config, "layer_types", None) or ["full_attention"] * config.num_hidden_layers
        self.paged = PagedKVCache(config.num_hidden_layers, num_kv_heads, head_dim, num_pages=num_pages,
                                  page_size=page_size, dtype=dtype, device=device, backend=backend,
                                  num_q_heads=num_q_heads)
        super().__init__(layers=[_TreeLayer(self.paged, t == "sliding_attention") for t in types])

    def add_sequence(self, seq_id) -> None:
        self.paged.add_sequence(seq_id)

    def remove_sequence(self, seq_id) -> None:
        self.paged.remove_sequence(seq_id)

    def commit_accepted(self, seq_ids, leaf_indices) -> None:
        self.paged.commit_accepted(seq_ids, leaf_indices)


def tree_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                           attention_mask, *, scaling: float | None = None, dropout: float = 0.0,
                           sliding_window: int | None = None, softcap: float | None = None,
                           s_aux: torch.Tensor | None = None, treeattn_cache: TreeCache | None = None,
                           **kwargs) -> tuple[torch.Tensor, None]:
    """HF attention function: ``query [1, h_q, T, d]``, ``key/value [1, h_kv, T, d]`` -> ``[1, T, h_q, d]``."""
    if treeattn_cache is None:
        treeattn_cache = _ACTIVE.get()
    if not isinstance(treeattn_cache, TreeCache):
        raise ValueError("attn_implementation 'treeattn' runs only inside treeattn.hf.speculative_generate (it needs "
                         "the treeattn_cache keyword, a TreeCache); switch the model back with "
                         "model.set_attn_implementation('sdpa') to call it otherwise")
    if query.shape[0] != 1:
        raise ValueError(f"'treeattn' packs all sequences into a batch of one, got a batch of {query.shape[0]}")
    if dropout:
        raise ValueError("'treeattn' is for inference: call model.eval() (attention dropout is on)")
    if attention_mask is not None:  # HF's mask builders give None for "treeattn": this model made its own
        raise ValueError(f"{type(module).__name__} builds its own attention mask, which 'treeattn' cannot honour "
                         "(it attends by the cache's tree structure)")
    sinks = None if s_aux is None else s_aux.detach().float()
    # PagedKVCache keeps K and V at one head dim (or an MLA latent with V a view of K, a form HF's MLA code,
    # which hands over K/V already expanded per head, cannot use): a narrower V is stored zero-padded.
    v_dim = value.shape[-1]
    if v_dim < key.shape[-1]:
        value = torch.nn.functional.pad(value, (0, key.shape[-1] - v_dim))
    out = treeattn_cache.paged.attention(module.layer_idx, query[0].transpose(0, 1), key[0].transpose(0, 1),
                                         value[0].transpose(0, 1), sm_scale=scaling, sliding_window=sliding_window,
                                         logit_softcap=softcap, sinks=sinks)
    return out[..., :v_dim].unsqueeze(0), None


@contextlib.contextmanager
def active_cache(cache: TreeCache):
    """The cache that ``tree_attention_forward`` uses, in this thread and task, where a model did not pass
    ``treeattn_cache`` down to its attention function."""
    token = _ACTIVE.set(cache)
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def _no_mask(*args, **kwargs) -> None:
    """The "treeattn" mask: none, the attention function reads the tree from the cache's plan."""
    return None


AttentionInterface.register(ATTN_IMPLEMENTATION, tree_attention_forward)
AttentionMaskInterface.register(ATTN_IMPLEMENTATION, _no_mask)
