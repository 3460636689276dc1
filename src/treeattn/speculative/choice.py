"""A drafter by name: ``ngram``, ``suffix``, ``heads`` or ``auto`` (what ``treeattn demo --drafter`` and
``treeattn.vllm.tree_speculative_config(drafter=...)`` accept), built for a target from its vocabulary
weights (the input embeddings and the LM head, which a draft head reads)."""

from __future__ import annotations

from pathlib import Path

from .adaptive import AdaptiveDrafter, CostModel
from .drafters import NGramDrafter
from .heads import HeadDrafter, VocabWeights, find_heads, load_heads
from .suffix import SuffixDrafter

__all__ = ["DRAFTERS", "build_drafter", "heads_file", "heads_mismatch"]

DRAFTERS = ("ngram", "suffix", "heads", "auto")


def heads_mismatch(heads, metadata: dict, weights: VocabWeights, model_name: str | None) -> str | None:
    """Why a draft head cannot draft for the model of ``weights`` (``None``: it can). A head file names
    the model it was trained for (``treeattn train-heads`` writes it), checked when ``model_name`` is
    given; its hidden size and vocabulary must fit, as it reads that model's states, embeddings and LM head."""
    made_for = metadata.get("model")
    if model_name is not None and made_for is not None and made_for != model_name:
        return f"the draft head was trained for {made_for}, not {model_name}"
    try:
        heads.check_model(weights)
    except ValueError as exc:
        return str(exc)
    return None


def heads_file(kind: str, heads: Path | None) -> Path | None:
    """The draft-head file drafter ``kind`` (``heads`` or ``auto``) would use: ``heads``, else
    ``find_heads()``; ``ValueError`` when ``heads`` is missing, or ``kind`` is ``heads`` and there is none."""
    if heads is not None and not Path(heads).is_file():
        raise ValueError(f"heads: no such file {heads}")
    path = Path(heads) if heads is not None else find_heads()
    if kind == "heads" and path is None:
        raise ValueError("drafter 'heads' needs a trained draft head: run `treeattn train-heads` first "
                         "(or pass a heads file)")
    return path


def build_drafter(kind: str, weights: VocabWeights | None, budget: int, *, heads: Path | None = None,
                  full_trees: bool = False, model_name: str | None = None):
    """``(drafter, description)`` for drafter ``kind``: adaptive trees of up to ``budget`` nodes, or
    the drafter's whole trees with ``full_trees``.

    ``weights``: the target's ``(embeddings, lm_head)`` (a draft head drafts in their dtype); only
    ``heads`` and ``auto`` read them (None for the others).
    ``heads``: the draft-head file (default ``find_heads()``, SmolLM2's). ``ValueError`` when ``kind``
    is ``heads`` and there is none, or it does not fit the target (another hidden size or vocabulary,
    or made for another model than ``model_name``, when given). ``auto`` is suffix + head, or suffix
    alone without a usable head (and the description says why).
    """
    if kind not in DRAFTERS:
        raise ValueError(f"drafter must be one of {', '.join(DRAFTERS)}, got {kind!r}")
    if kind in ("heads", "auto") and weights is None:
        raise ValueError(f"drafter {kind!r} reads the target's embeddings and LM head: weights must be given")
    heads_path = heads_file(kind, heads) if kind in ("heads", "auto") else None
    sources, skipped = [], ""
    if kind == "ngram":
        sources.append(NGramDrafter(budget))
    if kind in ("suffix", "auto"):
        sources.append(SuffixDrafter(budget))
    if kind in ("heads", "auto") and heads_path is not None:
        try:
            trained, metadata = load_heads(heads_path, dtype=weights[0].dtype)
            why = heads_mismatch(trained, metadata, weights, model_name)
        except ValueError as exc:  # e.g. Medusa heads from an older treeattn in the user's cache
            why = str(exc)
        if why is None:
            sources.append(HeadDrafter(trained, weights, budget=budget))
        elif kind == "heads":
            raise ValueError(f"drafter 'heads': {heads_path}: {why}; pick another drafter")
        else:
            skipped = f" (no draft head: {why})"
    names = " + ".join(type(s).__name__ for s in sources)
    if full_trees:
        if len(sources) > 1:
            raise ValueError("full trees verify one drafter's whole trees: pick ngram, suffix or heads")
        return sources[0], f"{names}, full {budget}-node trees{skipped}"
    return (AdaptiveDrafter(*sources, cost=CostModel(), max_nodes=budget),
            f"{names}, adaptive trees of up to {budget} nodes{skipped}")
