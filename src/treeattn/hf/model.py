"""An HF causal LM seen through treeattn's model protocol (``new_cache`` and ``forward``,
``treeattn.speculative.model.TreeModel``), so that ``treeattn.speculative.generate`` drives it."""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Sequence

import torch

from ..speculative.features import FINAL, check_feature_layers
from ..speculative.model import ModelOutput
from .attention import ATTN_IMPLEMENTATION, TreeCache, active_cache

__all__ = ["HFTreeModel", "check_model"]

_ATTENTION_LAYERS = {"full_attention", "sliding_attention"}


def check_model(model) -> None:
    """Raise ``TypeError``/``ValueError`` naming why ``model`` cannot verify trees through treeattn."""
    from transformers import PreTrainedModel

    if not isinstance(model, PreTrainedModel):
        raise TypeError(f"model must be a transformers PreTrainedModel, got {type(model).__name__}")
    name, config = type(model).__name__, model.config.get_text_config()
    if getattr(model.config, "is_encoder_decoder", False):
        raise ValueError(f"{name} is an encoder-decoder model; treeattn verifies trees on decoder-only models")
    if not model.can_generate():
        raise ValueError(f"{name} has no language-model head (it cannot generate); load it with "
                         "AutoModelForCausalLM")
    if getattr(config, "attention_chunk_size", None):
        raise ValueError(f"{name} uses chunked attention (attention_chunk_size), which treeattn does not provide")
    if getattr(config, "use_bidirectional_attention", False) or not getattr(config, "is_causal", True):
        raise ValueError(f"{name} is configured for bidirectional attention; tree verification needs a causal model")
    other = sorted(set(getattr(config, "layer_types", None) or ()) - _ATTENTION_LAYERS)
    if other:
        raise ValueError(f"{name} has layers of type {other} (recurrent or hybrid): their state cannot branch "
                         "into a tree; treeattn verifies trees on attention-only models")
    blocked = _attention_not_pluggable(model)
    if blocked:
        raise ValueError(f"{blocked}, so treeattn cannot supply its attention (checked as HF does before it "
                         "accepts a registered attention implementation such as 'treeattn')")


def _attention_not_pluggable(model) -> str | None:
    """Why HF would refuse a registered attention implementation for ``model`` (or a sub-model), else None.

    HF's own test (``_can_set_attn_implementation``) reads each model class's modeling source: a module
    that defines ``*Attention*(nn.Module)`` classes must call ``ALL_ATTENTION_FUNCTIONS.get_interface``.
    (``_supports_attention_backend`` is a different flag, vLLM's transformers backend's, left False by
    models such as StableLM whose attention does go through the interface.)"""
    from transformers import PreTrainedModel

    for module in model.modules():
        cls = type(module)
        if not isinstance(module, PreTrainedModel):
            continue
        can_set = getattr(cls, "_can_set_attn_implementation", None)
        pluggable = can_set() if can_set is not None else cls._supports_attention_backend
        if not pluggable:
            return (f"{cls.__name__}'s modeling code ({cls.__module__}) has attention layers that do not call "
                    "ALL_ATTENTION_FUNCTIONS.get_interface(...)")
    return None


class HFTreeModel:
    """Runs ``model`` (an HF causal LM) with the ``"treeattn"`` attention on a ``TreeCache``.

    ``forward`` packs every sequence's new tokens into one row (``input_ids [1, T]``) at the tree
    positions the cache planned, so RoPE of any kind (partial, scaled, per layer type) is the model's own.
    A forward outside ``attention()`` switches the model to "treeattn" for its own duration (about
    1.5 ms per forward): callers that run many wrap them in ``with tree_model.attention():``.
    ``config`` is the model's text config; ``logits(hidden)`` its LM head, ``vocab_weights()`` its
    embeddings and LM head weight (for draft heads).
    """

    def __init__(self, model):
        check_model(model)
        self.model = model
        first = next(model.parameters())
        self.dtype, self.device = first.dtype, first.device
        # transformers renamed forward's past_key_values to cache (5.2x); pass whichever this version takes.
        params = inspect.signature(model.forward).parameters
        self._cache_kwarg = "cache" if "cache" in params else "past_key_values"
        self.config = model.config.get_text_config()

    def __repr__(self) -> str:
        return f"HFTreeModel({type(self.model).__name__})"

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits of final hidden states ``[R, hidden_size]``: the model's LM head (and its final
        logit soft-cap, if any). Draft heads draft through it; drafts only change speed, never the output."""
        head = self.model.get_output_embeddings()
        hidden = hidden.to(dtype=head.weight.dtype, device=head.weight.device)
        if isinstance(head, torch.nn.Linear):  # frozen: training heads through it computes no weight gradient
            bias = None if head.bias is None else head.bias.detach()
            logits = torch.nn.functional.linear(hidden, head.weight.detach(), bias).float()
        else:
            logits = head(hidden).float()
        cap = getattr(self.config, "final_logit_softcapping", None)
        return torch.tanh(logits / cap) * cap if cap else logits

    def vocab_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(embeddings, lm_head)``: the input token embeddings and the LM head's weight, ``[V, hidden_size]``
        each, detached: what a feature-level draft head (``speculative.heads``) reads tokens and writes logits with
        (without an LM head bias or a final logit soft-cap: drafts only steer speed, never the output)."""
        embed = self.model.get_input_embeddings().weight.detach()
        return embed, self.model.get_output_embeddings().weight.detach()

    def new_cache(self, num_pages: int, *, page_size: int = 16, backend: str | None = None) -> TreeCache:
        return TreeCache(self.model.config, num_pages=num_pages, page_size=page_size, dtype=self.dtype,
                         device=self.device, backend=backend)

    @contextlib.contextmanager
    def attention(self):
        """The model runs "treeattn" inside, and whatever it ran before afterwards."""
        before = self.model.config._attn_implementation
        if before == ATTN_IMPLEMENTATION:
            yield
            return
        self.model.set_attn_implementation(ATTN_IMPLEMENTATION)
        try:
            yield
        finally:
            self.model.set_attn_implementation(before)

    @torch.inference_mode()
    def forward(self, cache: TreeCache, seq_ids: Sequence, input_ids: torch.Tensor, append_lengths: Sequence[int],
                tree_parents: Sequence | None = None, *, logits_rows: torch.Tensor | None = None,
                feature_layers: Sequence | None = None) -> ModelOutput:
        """Append ``input_ids`` (packed, ``append_lengths[b]`` for ``seq_ids[b]``); logits and last hidden states
        of ``logits_rows`` (default: all), and ``feature_layers`` of every row: ``TreeModel.forward`` on an HF model."""
        if self.model.config._attn_implementation != ATTN_IMPLEMENTATION:
            with self.attention():
                return self.forward(cache, seq_ids, input_ids, append_lengths, tree_parents, logits_rows=logits_rows,
                                    feature_layers=feature_layers)
        layers = None if feature_layers is None else check_feature_layers(feature_layers, self.config.num_hidden_layers)
        info = cache.paged.begin_forward(seq_ids, append_lengths, tree_parents)
        rows = 0 if logits_rows is None else logits_rows.to(self.device)  # 0: HF's "all rows"
        try:
            with active_cache(cache), self._last_layer_output(layers) as last:
                out = self.model(input_ids=input_ids.to(self.device)[None], position_ids=info.positions.long()[None],
                                 use_cache=True, logits_to_keep=rows, output_hidden_states=True,
                                 treeattn_cache=cache, **{self._cache_kwarg: cache})
        except BaseException:
            cache.paged.abort_forward()
            raise
        cache.paged.end_forward()
        states = out.hidden_states
        hidden = states[-1][0]
        features = None
        if layers is not None:  # HF's hidden_states[i] is boundary i for i < N; [N] is after the final norm
            n = self.config.num_hidden_layers
            features = torch.cat([hidden if layer == FINAL else last[0][0] if layer == n else states[layer][0]
                                  for layer in layers], dim=-1)
        if logits_rows is not None:
            hidden = hidden[rows]
        return ModelOutput(out.logits[0].float(), hidden, features)

    @contextlib.contextmanager
    def _last_layer_output(self, layers):
        """Yields a list that holds, after the forward, the last decoder layer's output (boundary ``N``,
        before the final norm; HF's hidden states end after it) when ``layers`` asks for it."""
        captured: list[torch.Tensor] = []
        if layers is None or self.config.num_hidden_layers not in layers:
            yield captured
            return
        decoder_layers = getattr(self.model.get_decoder(), "layers", None)
        if not isinstance(decoder_layers, torch.nn.ModuleList):
            raise ValueError(f"feature_layers: boundary {self.config.num_hidden_layers} (the last layer's output before "
                             f"the final norm) is read from the decoder's .layers, which {type(self.model).__name__} "
                             "does not have")
        hook = decoder_layers[-1].register_forward_hook(
            lambda _module, _args, output: captured.append(output[0] if isinstance(output, tuple) else output))
        try:
            yield captured
        finally:
            hook.remove()
