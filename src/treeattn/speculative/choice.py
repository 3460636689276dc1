"""A drafter by name: ``ngram``, ``suffix``, ``heads`` or ``auto`` (what ``treeattn demo --drafter`` and
``treeattn.vllm.tree_speculative_config(drafter=...)`` accept), built for a target from its vocabulary
weights (the input embeddings and the LM head, which a draft head reads), or with a published draft
head (``load_draft_head``) in place of treeattn's own."""

from __future__ import annotations

import json
from pathlib import Path

from .adaptive import AdaptiveDrafter, CostModel
from .checkpoints import DraftTarget, load_draft_head
from .drafters import MedusaHeads, NGramDrafter, StaticTreeDrafter
from .eagle import Eagle3Head, EagleHead
from .eagle_drafter import EagleDrafter
from .heads import HeadDrafter, VocabWeights, load_heads, usable_heads
from .suffix import SuffixDrafter

__all__ = ["DRAFTERS", "build_drafter", "head_paths", "heads_mismatch", "load_for_target", "medusa_choices",
           "published_drafter"]

DRAFTERS = ("ngram", "suffix", "heads", "auto")


def heads_mismatch(heads, metadata: dict, weights: VocabWeights, model_name: str | None) -> str | None:
    """Why a draft head cannot draft for the model of ``weights`` (``None``: it can). A head file names
    the model it was trained for (``treeattn train-heads`` writes it), checked when ``model_name`` is
    given; its hidden size and vocabulary must fit, as it reads that model's states, embeddings and LM head."""
    why = _made_for_another(metadata.get("model"), model_name)
    if why is not None:
        return why
    try:
        heads.check_model(weights)
    except ValueError as exc:
        return str(exc)
    return None


def _made_for_another(made_for: str | None, model_name: str | None) -> str | None:
    if model_name is not None and made_for is not None and made_for != model_name:
        return f"the draft head was trained for {made_for}, not {model_name}"
    return None


def head_paths(kind: str, heads: Path | None, *, eagle3: bool = True) -> list[Path]:
    """The draft heads drafter ``kind`` (``heads`` or ``auto``) tries, in order: ``heads`` (a treeattn
    head file, or the EAGLE-3 folder of ``treeattn train-heads --arch eagle3``), else
    ``usable_heads(eagle3=)``; ``ValueError`` when ``heads`` is missing, or ``kind`` is ``heads`` and
    there is none."""
    if heads is not None and not Path(heads).exists():
        raise ValueError(f"heads: no such file or folder {heads}")
    paths = [Path(heads)] if heads is not None else usable_heads(eagle3=eagle3)
    if kind == "heads" and not paths:
        raise ValueError("drafter 'heads' needs a trained draft head: run `treeattn train-heads` first "
                         "(or pass a heads file or EAGLE-3 folder)")
    return paths


def load_for_target(path, weights: VocabWeights, num_layers: int):
    """``load_draft_head(path)`` checked against (and sharing the weights of) a target with these
    ``(embeddings, lm_head)`` weights and ``num_layers`` decoder layers, in the weights' dtype and device."""
    embed, lm_head = weights
    return load_draft_head(path, target=DraftTarget(embed.shape[1], embed.shape[0], num_layers, embed, lm_head),
                           dtype=embed.dtype, device=embed.device)


def medusa_choices(num_heads: int, budget: int, width: int = 3) -> list[tuple[int, ...]]:
    """A static tree for Medusa heads within ``budget`` nodes: a spine of every head's best guess with
    ``width`` alternatives at each depth, ``(r,), (0, r), (0, 0, r), ...`` (shallow nodes first)."""
    return [(0,) * d + (r,) for d in range(num_heads) for r in range(width)][:budget - 1]


def published_drafter(head, budget: int, *, full_trees: bool = False):
    """The drafter of a published head from ``load_draft_head``: ``EagleDrafter`` for EAGLE-3 and
    EAGLE-1/2 heads, a static ``medusa_choices`` tree for Medusa heads (which do not score their guesses,
    so they need ``full_trees``)."""
    if isinstance(head, (Eagle3Head, EagleHead)):
        return EagleDrafter(head, budget=budget, dtype="fastest")
    if not isinstance(head, MedusaHeads):
        raise TypeError(f"draft_head must be a head from load_draft_head, got {type(head).__name__}")
    if not full_trees or budget < 2:
        raise ValueError("Medusa heads do not score their guesses: they draft whole static trees (full trees, "
                         "a budget of 2 nodes or more)")
    return StaticTreeDrafter(medusa_choices(len(head.medusa_head), budget), head)


def build_drafter(kind: str, weights: VocabWeights | None, budget: int, *, heads: Path | None = None,
                  draft_head=None, full_trees: bool = False, model_name: str | None = None,
                  num_layers: int | None = None):
    """``(drafter, description)`` for drafter ``kind``: adaptive trees of up to ``budget`` nodes, or
    the drafter's whole trees with ``full_trees``.

    ``weights``: the target's ``(embeddings, lm_head)`` (a draft head drafts in their dtype); only
    ``heads`` and ``auto`` read them (None for the others).
    ``heads``: the draft head, a treeattn head file or an EAGLE-3 folder from ``treeattn train-heads``
    (default: the first of ``usable_heads()``, SmolLM2's, that fits the target). An EAGLE-3 head reads
    the target's layers: it is checked against the target's ``num_layers`` decoder layers, and without
    them the default passes over it. ``ValueError`` when ``kind`` is ``heads`` and none fits the target
    (another hidden size, vocabulary or depth, or made for another model than ``model_name``, when
    given). ``auto`` is suffix + head, or suffix alone without a usable head (and the description says
    why: the first head's reason).
    ``draft_head``: a published head (``load_draft_head(path, target=model)``, checked against the
    model there) that drafts in place of treeattn's own, for ``heads`` and ``auto``.
    """
    if kind not in DRAFTERS:
        raise ValueError(f"drafter must be one of {', '.join(DRAFTERS)}, got {kind!r}")
    if draft_head is not None:
        if kind not in ("heads", "auto") or heads is not None:
            raise ValueError(f"a published draft head (--draft-head) drafts for drafter heads or auto, in place of "
                             f"treeattn's head (--heads); got drafter {kind!r}"
                             + (f" and heads {heads}" if heads is not None else ""))
        published = published_drafter(draft_head, budget, full_trees=full_trees)
        sources = ([SuffixDrafter(budget)] if kind == "auto" else []) + [published]
        return _combine(sources, budget, full_trees, "")
    if kind in ("heads", "auto") and weights is None:
        raise ValueError(f"drafter {kind!r} reads the target's embeddings and LM head: weights must be given")
    paths = head_paths(kind, heads, eagle3=num_layers is not None) if kind in ("heads", "auto") else []
    sources, skipped = [], ""
    if kind == "ngram":
        sources.append(NGramDrafter(budget))
    if kind in ("suffix", "auto"):
        sources.append(SuffixDrafter(budget))
    reasons = []  # per head tried: why it cannot draft for this target
    for path in paths:
        try:
            if path.is_dir():
                drafter, why = _eagle3_drafter(path, weights, budget, model_name, num_layers, full_trees)
            else:
                drafter, why = _heads_drafter(path, weights, budget, model_name)
        except (OSError, ValueError) as exc:  # e.g. Medusa heads from an older treeattn in the user's cache
            drafter, why = None, str(exc)
        if why is None:
            sources.append(drafter)
            break
        reasons.append(f"{path}: {why}")
    else:
        if reasons and kind == "heads":
            raise ValueError(f"drafter 'heads': {reasons[0]}; pick another drafter")
        if reasons:
            skipped = f" (no draft head: {reasons[0]})"
    return _combine(sources, budget, full_trees, skipped)


def _heads_drafter(path: Path, weights: VocabWeights, budget: int, model_name: str | None):
    """``(HeadDrafter, None)`` for the treeattn head file at ``path``, or ``(None, why not)``."""
    trained, metadata = load_heads(path, dtype=weights[0].dtype)
    why = heads_mismatch(trained, metadata, weights, model_name)
    return (HeadDrafter(trained, weights, budget=budget, dtype="fastest"), None) if why is None else (None, why)


def _eagle3_drafter(path: Path, weights: VocabWeights, budget: int, model_name: str | None, num_layers: int | None,
                    full_trees: bool):
    """``(EagleDrafter, None)`` for the EAGLE-3 folder ``treeattn train-heads --arch eagle3`` wrote at
    ``path`` (its ``config.json`` names the model it was trained for; a folder that does not name one is
    checked by its sizes only), or ``(None, why not)``."""
    if num_layers is None:
        return None, "an EAGLE-3 head is checked against its target's decoder layers: give num_layers"
    config = json.loads((path / "config.json").read_text())
    metadata = config.get("treeattn") if isinstance(config, dict) else None
    why = _made_for_another(metadata.get("model") if isinstance(metadata, dict) else None, model_name)
    if why is not None:
        return None, why
    try:
        head = load_for_target(path, weights, num_layers)
    except (OSError, ValueError) as exc:  # e.g. a head for another hidden size, or aux layers beyond the target's
        return None, str(exc)
    except Exception as exc:  # a damaged weights file fails in the safetensors reader's own ways
        return None, f"not a readable checkpoint ({type(exc).__name__}: {exc})"
    if not isinstance(head, Eagle3Head):
        return None, (f"a {type(head).__name__}, not an EAGLE-3 head: a published head drafts as a draft_head "
                      "(--draft-head)")
    return published_drafter(head, budget, full_trees=full_trees), None


def _combine(sources: list, budget: int, full_trees: bool, skipped: str):
    """``(drafter, description)``: the one source's whole trees, or all sources adaptive."""
    names = " + ".join(type(s).__name__ for s in sources)
    if full_trees:
        if len(sources) > 1:
            raise ValueError("full trees verify one drafter's whole trees: pick ngram, suffix or heads")
        return sources[0], f"{names}, full {budget}-node trees{skipped}"
    return (AdaptiveDrafter(*sources, cost=CostModel(), max_nodes=budget),
            f"{names}, adaptive trees of up to {budget} nodes{skipped}")
