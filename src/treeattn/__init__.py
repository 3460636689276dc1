"""treeattn: exact, fast tree attention for tree-based speculative decoding.

The operators (``tree_attention``, ``paged_tree_attention``, ``merge_state``; for engines that run
one step's paged call in many layers, ``prepare_paged_tree_attention`` once and ``PagedCall.run``
per layer) with their per-step plan (``TreeAttentionPlan``) and page layouts (``PagedKV``); trees (``TokenTree``, ``tree_order``,
``pack_trees``); RoPE; the paged KV cache with draft trees (``PagedKVCache``); and speculative
decoding's draft trees and drafters (``DraftTree``, ``Drafter``, ``NGramDrafter``, ...).
"""

from .kvcache import OutOfPagesError, PagedKVCache
from .layout import PagedKV
from .ops import PagedCall, merge_state, paged_tree_attention, prepare_paged_tree_attention, prepare_plan, tree_attention
from .plan import TreeAttentionPlan
from .rope import RoPE
from .speculative import Drafter, DraftTree, MedusaHeads, NGramDrafter, SamplingParams, StaticTreeDrafter, verify
from .tree import TokenTree, ancestor_mask, pack_trees, tree_depths, tree_order

__version__ = "0.1.0"

__all__ = [
    "DraftTree",
    "Drafter",
    "MedusaHeads",
    "NGramDrafter",
    "OutOfPagesError",
    "PagedCall",
    "PagedKV",
    "PagedKVCache",
    "RoPE",
    "SamplingParams",
    "StaticTreeDrafter",
    "TokenTree",
    "TreeAttentionPlan",
    "ancestor_mask",
    "merge_state",
    "pack_trees",
    "paged_tree_attention",
    "prepare_paged_tree_attention",
    "prepare_plan",
    "tree_attention",
    "tree_depths",
    "tree_order",
    "verify",
]
