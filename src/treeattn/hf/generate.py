"""``speculative_generate``: tree speculative decoding of an HF causal LM, laid out like ``model.generate``."""

from __future__ import annotations

import torch

from ..speculative import Drafter, NGramDrafter, SamplingParams, generate
from .model import HFTreeModel

__all__ = ["speculative_generate"]


def _prompts(input_ids, attention_mask) -> list[list[int]]:
    """Each row's real tokens: all of them, or those ``attention_mask`` keeps (left padding, as generate wants)."""
    if not isinstance(input_ids, torch.Tensor) or input_ids.ndim != 2 or input_ids.dtype not in (torch.int64,
                                                                                                  torch.int32):
        raise TypeError("input_ids must be an integer tensor [batch, prompt_len]")
    if input_ids.shape[0] == 0 or input_ids.shape[1] == 0:
        raise ValueError(f"input_ids must hold at least one token per row, got shape {tuple(input_ids.shape)}")
    ids = input_ids.cpu()
    if attention_mask is None:
        return ids.tolist()
    if not isinstance(attention_mask, torch.Tensor) or attention_mask.shape != input_ids.shape:
        raise ValueError(f"attention_mask must be a tensor of input_ids' shape {tuple(input_ids.shape)}")
    mask = attention_mask.cpu().bool()
    prompts = []
    for b in range(mask.shape[0]):
        n = int(mask[b].sum())
        if n == 0 or not mask[b, -n:].all():
            raise ValueError(f"attention_mask row {b} must keep a non-empty block of tokens at the end of the row "
                             "(left padding, as model.generate expects for decoder-only models)")
        prompts.append(ids[b, -n:].tolist())
    return prompts


# Settings of a generation config by which model.generate changes the model's logits before choosing;
# verification reads the raw logits, so a model configured with one of them is refused, not silently different.
_LOGITS_PROCESSORS = ("repetition_penalty", "no_repeat_ngram_size", "bad_words_ids", "sequence_bias", "min_length",
                      "min_new_tokens", "suppress_tokens", "begin_suppress_tokens", "forced_bos_token_id",
                      "forced_eos_token_id", "exponential_decay_length_penalty", "guidance_scale",
                      "encoder_repetition_penalty", "encoder_no_repeat_ngram_size")


def _check_generation_config(config) -> None:
    from transformers import GenerationConfig

    default = GenerationConfig()
    changed = {f: getattr(config, f, None) for f in _LOGITS_PROCESSORS if getattr(config, f, None) != getattr(default, f)}
    if changed:
        raise ValueError(f"the model's generation config sets {changed}, which model.generate applies to the logits; "
                         "speculative_generate verifies the raw logits: reset these in model.generation_config "
                         f"(defaults: {({f: getattr(default, f) for f in changed})})")


def _token_ids(value, name: str) -> list[int]:
    if value is None:
        return []
    ids = [value] if isinstance(value, int) else list(value.tolist() if isinstance(value, torch.Tensor) else value)
    if not all(isinstance(t, int) and t >= 0 for t in ids):
        raise ValueError(f"{name} must be a token id or a list of token ids, got {value!r}")
    return ids


@torch.inference_mode()
def speculative_generate(model, input_ids: torch.Tensor, *, max_new_tokens: int, drafter: Drafter | None = None,
                         attention_mask: torch.Tensor | None = None, temperature: float = 0.0, top_k: int = 0,
                         top_p: float = 1.0, generator: torch.Generator | None = None,
                         eos_token_id: int | list[int] | None = None) -> torch.LongTensor:
    """Generate with tree speculative decoding; returns ``[B, prompt_len + new]`` like ``model.generate``.

    Each step the ``drafter`` (default ``NGramDrafter()``; a published EAGLE-3 / EAGLE head drafts with
    ``EagleDrafter(load_draft_head(path, target=model))``) proposes one tree per unfinished row, one
    forward of ``model`` (attention ``"treeattn"`` for the duration of the call) verifies all of them,
    and the accepted path is committed. ``temperature == 0`` is greedy and token-identical to
    ``model.generate(do_sample=False)``; otherwise tokens are sampled from the target distribution
    (``top_k``, ``top_p``) with draws from ``generator``. A row stops after an ``eos_token_id``
    (default: the model's generation config); finished rows are padded with its ``pad_token_id``
    (else the first EOS), as ``model.generate`` pads them. A generation config that makes
    ``model.generate`` change the logits (repetition penalty, ...) is refused with a ``ValueError``.
    """
    tree_model = HFTreeModel(model)
    prompts = _prompts(input_ids, attention_mask)
    config = model.generation_config
    _check_generation_config(config)
    eos = _token_ids(config.eos_token_id if eos_token_id is None else eos_token_id, "eos_token_id")
    pad = config.pad_token_id if config.pad_token_id is not None else (eos[0] if eos else 0)
    sampling = SamplingParams(temperature, top_k, top_p) if temperature else None
    with tree_model.attention():
        result = generate(tree_model, prompts, max_new_tokens=max_new_tokens,
                          drafter=NGramDrafter() if drafter is None else drafter, sampling=sampling,
                          generator=generator, stop_tokens=eos)
    width = max(len(t) for t in result.tokens)
    new = torch.full((len(prompts), width), pad, dtype=input_ids.dtype)
    for b, tokens in enumerate(result.tokens):
        new[b, :len(tokens)] = torch.tensor(tokens, dtype=input_ids.dtype)
    return torch.cat([input_ids.cpu(), new], dim=1).to(input_ids.device)
