"""treeattn: exact, fast tree attention for tree-based speculative decoding."""

from .kvcache import OutOfPagesError, PagedKVCache
from .ops import merge_state, paged_tree_attention, tree_attention
from .plan import TreeAttentionPlan
from .rope import RoPE
from .tree import TokenTree, ancestor_mask, pack_trees, tree_depths, tree_order

__version__ = "0.1.0"

__all__ = [
    "OutOfPagesError",
    "PagedKVCache",
    "RoPE",
    "TokenTree",
    "TreeAttentionPlan",
    "ancestor_mask",
    "merge_state",
    "pack_trees",
    "paged_tree_attention",
    "tree_attention",
    "tree_depths",
    "tree_order",
]
