"""Paged KV cache for tree speculative decoding: draft trees over several forwards, then commit."""

from .cache import ForwardInfo, PagedKVCache
from .pages import OutOfPagesError

__all__ = ["ForwardInfo", "OutOfPagesError", "PagedKVCache"]
