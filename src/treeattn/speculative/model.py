"""The model protocol ``generate`` drives: ``new_cache`` and ``forward`` returning a ``ModelOutput``.

``treeattn.hf.HFTreeModel`` implements it for any HF transformers causal LM (treeattn has no model
code of its own; ``treeattn.models.load_smollm2`` and ``load_model`` return one).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

__all__ = ["ModelOutput", "TreeCacheLike", "TreeModel"]


@dataclass(frozen=True)
class ModelOutput:
    """``logits [R, V]`` (float32) and final-norm ``hidden [R, hidden_size]`` of the requested rows;
    ``features [T, width]``: the ``feature_layers`` asked for, of every appended row (else None)."""

    logits: torch.Tensor
    hidden: torch.Tensor
    features: torch.Tensor | None = None


@runtime_checkable
class TreeCacheLike(Protocol):
    """What ``generate`` calls on the cache a model made: a ``PagedKVCache`` or ``treeattn.hf.TreeCache``."""

    def add_sequence(self, seq_id) -> None: ...

    def commit_accepted(self, seq_ids, leaf_indices) -> None: ...


@runtime_checkable
class TreeModel(Protocol):
    """A target model for tree speculative decoding.

    ``forward`` appends ``input_ids`` (packed, ``append_lengths[b]`` tokens for ``seq_ids[b]``) to
    ``cache``: causally with ``tree_parents=None`` (prefill, plain decoding), else one draft tree per
    sequence that stays uncommitted until ``cache.commit_accepted``. It returns the logits and final
    hidden states of ``logits_rows`` (default: every row). ``feature_layers`` (only passed when a
    drafter reads them, so a model may leave it out): ``ModelOutput.features`` of every appended row,
    those layers' states concatenated (``treeattn.speculative.features``).
    """

    def new_cache(self, num_pages: int, *, page_size: int = 16, backend: str | None = None) -> TreeCacheLike: ...

    def forward(self, cache, seq_ids: Sequence, input_ids: torch.Tensor, append_lengths: Sequence[int],
                tree_parents: Sequence | None = None, *, logits_rows: torch.Tensor | None = None,
                feature_layers: Sequence | None = None) -> ModelOutput: ...
