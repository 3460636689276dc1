"""Medusa-style draft heads on the model's own LM head, self-distilled on the CPU.

Head ``j`` guesses the token ``j + 2`` positions after the one whose final hidden state ``h`` it
reads (the model itself predicts ``j = -1``, the next token): ``logits_j = lm_head(h + silu(W_j h +
c_j))``. Reusing the model's frozen LM head keeps a head at ``hidden² + hidden`` parameters (332k
for SmolLM2-135M: 0.66 MB in float16) instead of Medusa's own ``hidden x vocab`` projection (28M).
``W_j`` starts at zero, so an untrained head repeats the model's own next-token guess.

Training data is the model's own greedy output (``self_distill``): for greedy decoding, the token a
head must guess is exactly what the model will emit, so the model's text is the right target.
``train_heads`` fits the heads by cross-entropy on those tokens; ``HeadDrafter`` drafts with them.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from .adaptive import Candidates, grow
from .drafters import as_context
from .verify import DraftTree

__all__ = [
    "DEFAULT_HEADS",
    "PACKAGED_HEADS",
    "PROMPTS_FILE",
    "DraftHeads",
    "HeadDrafter",
    "TrainState",
    "causal_hidden_states",
    "find_heads",
    "head_accuracy",
    "head_examples",
    "load_heads",
    "save_heads",
    "self_distill",
    "train_heads",
]

_DATA = Path(__file__).parent / "data"
PROMPTS_FILE = _DATA / "prompts.txt"  # the training prompts shipped with treeattn
PACKAGED_HEADS = _DATA / "smollm2-135m-heads.pt"  # SmolLM2-135M heads shipped with treeattn
# Where ``treeattn train-heads`` writes by default (the user's own heads win over the shipped ones).
DEFAULT_HEADS = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "treeattn" / "smollm2-135m-heads.pt"

Progress = Callable[[int, int, str], None]  # (done, total, message)


class DraftHeads(nn.Module):
    """``num_heads`` residual SiLU blocks (``hidden_size x hidden_size`` each) before a shared, frozen
    LM head passed in at call time (``lm_head(x) -> logits``, e.g. ``HFTreeModel.logits``)."""

    def __init__(self, hidden_size: int, num_heads: int = 3):
        super().__init__()
        if not isinstance(hidden_size, int) or hidden_size < 1:
            raise ValueError(f"hidden_size must be an int >= 1, got {hidden_size!r}")
        if not isinstance(num_heads, int) or num_heads < 1:
            raise ValueError(f"num_heads must be an int >= 1, got {num_heads!r}")
        self.hidden_size = hidden_size
        self.blocks = nn.ModuleList(nn.Linear(hidden_size, hidden_size) for _ in range(num_heads))
        for block in self.blocks:  # an untrained head is the model's own next-token head
            nn.init.zeros_(block.weight)
            nn.init.zeros_(block.bias)

    @property
    def num_heads(self) -> int:
        return len(self.blocks)

    def forward(self, hidden: torch.Tensor, lm_head: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """``[num_heads, R, V]`` float32 logits for ``hidden [R, hidden_size]``."""
        w = self.blocks[0].weight
        h = hidden.to(device=w.device, dtype=w.dtype)
        return torch.stack([lm_head(h + F.silu(block(h))).float() for block in self.blocks])


def save_heads(heads: DraftHeads, path: str | Path, **metadata) -> None:
    """Save ``heads`` in float16 (what drafting needs) with ``metadata`` (how they were made)."""
    state = {k: v.detach().to(torch.float16).cpu() for k, v in heads.state_dict().items()}
    torch.save({"format": "treeattn-draft-heads-1", "hidden_size": heads.hidden_size,
                "num_heads": heads.num_heads, "state_dict": state, "metadata": metadata}, Path(path))


def load_heads(path: str | Path, *, dtype: torch.dtype = torch.float32) -> tuple[DraftHeads, dict]:
    """``(heads, metadata)`` from ``save_heads``; ``ValueError`` for a file of another kind."""
    blob = torch.load(Path(path), map_location="cpu", weights_only=True)
    if not isinstance(blob, dict) or blob.get("format") != "treeattn-draft-heads-1":
        raise ValueError(f"{path} is not a treeattn draft-heads file (saved by save_heads)")
    heads = DraftHeads(int(blob["hidden_size"]), int(blob["num_heads"]))
    heads.load_state_dict({k: v.to(dtype) for k, v in blob["state_dict"].items()})
    return heads.to(dtype).eval(), dict(blob["metadata"])


def find_heads() -> Path | None:
    """The SmolLM2-135M heads to use: the user's (``DEFAULT_HEADS``), else the shipped ones, else None."""
    return next((p for p in (DEFAULT_HEADS, PACKAGED_HEADS) if p.is_file()), None)


class HeadDrafter:
    """Drafts from ``DraftHeads``: a tree whose depth-``j + 1`` nodes are head ``j``'s ``top_k``
    guesses, grown best first by the product of the heads' probabilities, ``budget`` nodes at most
    (the root included). Needs the target's hidden states (``generate`` passes them).
    Implements ``Drafter`` and ``ScoringDrafter`` (calibration bucket: head and probability decile).
    """

    def __init__(self, heads: DraftHeads, lm_head: Callable[[torch.Tensor], torch.Tensor], *, budget: int = 32,
                 top_k: int = 4):
        if not isinstance(heads, DraftHeads):
            raise TypeError(f"heads must be DraftHeads, got {type(heads).__name__}")
        for name, value in (("budget", budget), ("top_k", top_k)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        self.heads, self.lm_head, self.budget, self.top_k = heads, lm_head, budget, top_k

    def __repr__(self) -> str:
        return f"HeadDrafter(num_heads={self.heads.num_heads}, budget={self.budget}, top_k={self.top_k})"

    @torch.inference_mode()
    def candidates(self, contexts: Sequence[np.ndarray], hidden: torch.Tensor | None = None) -> list[Candidates]:
        if hidden is None or hidden.dim() != 2 or hidden.shape[0] != len(contexts):
            raise ValueError(f"HeadDrafter needs the target's hidden states, hidden=[{len(contexts)}, hidden_size]")
        probs = torch.softmax(self.heads(hidden, self.lm_head), dim=-1)  # [H, B, V]
        top = torch.topk(probs, self.top_k, dim=-1)
        p_all, tok_all = top.values.permute(1, 0, 2).cpu().numpy(), top.indices.permute(1, 0, 2).cpu().numpy()
        out = []
        for b, context in enumerate(contexts):
            root = int(as_context(context, f"contexts[{b}]")[-1])
            p, tok = p_all[b].astype(np.float64), tok_all[b].tolist()

            def expand(ref, p=p, tok=tok):
                depth, score = (0, 1.0) if ref is None else ref[:2]
                if depth == self.heads.num_heads:
                    return []
                return [(score * p[depth, r], tok[depth][r], (depth + 1, score * p[depth, r], p[depth, r]))
                        for r in range(self.top_k)]

            tokens, parents, refs = grow(root, expand, self.budget)
            keys, prior = np.zeros(len(tokens), np.int64), np.ones(len(tokens))
            for i in range(1, len(tokens)):
                depth, _, edge_p = refs[i]
                keys[i], prior[i] = (depth - 1) * 100 + min(int(edge_p * 10), 9), edge_p
            out.append(Candidates(DraftTree(np.array(tokens), np.array(parents)), keys, prior))
        return out

    def propose(self, contexts: Sequence[np.ndarray], hidden: torch.Tensor | None = None) -> list[DraftTree]:
        return [c.tree for c in self.candidates(contexts, hidden)]


# ---------------------------------------------------------------------- self-distillation


def self_distill(model, prompts: Sequence[Sequence[int]], *, max_new_tokens: int = 96, batch_size: int = 16,
                 stop_tokens: Sequence[int] = (), done: Sequence[list[int]] = (),
                 progress: Progress | None = None, on_batch: Callable[[list[list[int]]], None] | None = None
                 ) -> list[list[int]]:
    """The model's greedy continuation of every prompt, ``batch_size`` prompts per ``generate`` call.

    ``done`` holds the continuations of the first prompts from an earlier, interrupted run (they are
    kept); ``on_batch(all_so_far)`` is called after each batch (to checkpoint).
    """
    from .generate import generate

    outputs = [list(o) for o in done]
    for start in range(len(outputs), len(prompts), batch_size):
        chunk = [list(p) for p in prompts[start:start + batch_size]]
        result = generate(model, chunk, max_new_tokens=max_new_tokens, stop_tokens=stop_tokens)
        outputs.extend(result.tokens)
        if on_batch is not None:
            on_batch(outputs)
        if progress is not None:
            progress(len(outputs), len(prompts), f"{result.num_tokens / result.elapsed_s:.0f} tokens/s")
    return outputs


def causal_hidden_states(model, tokens: Sequence[int]) -> torch.Tensor:
    """Final hidden states ``[T, hidden]`` of one sequence: one causal forward of ``model`` (a
    ``TreeModel``) on a scratch cache."""
    ids = torch.as_tensor(list(tokens), dtype=torch.int64)
    page_size = 16
    cache = model.new_cache(-(-ids.numel() // page_size), page_size=page_size)
    cache.add_sequence(0)
    with torch.inference_mode():
        hidden = model.forward(cache, [0], ids, [ids.numel()]).hidden
    return hidden.clone()  # outside inference mode: a normal tensor that training can use


def head_examples(model, prompts: Sequence[Sequence[int]], outputs: Sequence[Sequence[int]], num_heads: int,
                  progress: Progress | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Training rows: ``hidden [R, hidden]`` at every position whose next token is an output token,
    and ``targets [R, num_heads]``: the token ``j + 2`` positions later (``-100`` past the end)."""
    xs, ys = [], []
    for i, (prompt, out) in enumerate(zip(prompts, outputs)):
        seq = list(prompt) + list(out)
        first = len(prompt) - 1  # this position predicts the first output token
        if len(out) < 2:
            continue
        hidden = causal_hidden_states(model, seq[:-1])[first:]  # positions first .. len(seq) - 2
        rows = hidden.shape[0]
        target = torch.full((rows, num_heads), -100, dtype=torch.int64)
        seq_t = torch.tensor(seq)
        for j in range(num_heads):
            idx = torch.arange(rows) + first + 2 + j
            ok = idx < len(seq)
            target[ok, j] = seq_t[idx[ok]]
        xs.append(hidden)
        ys.append(target)
        if progress is not None:
            progress(i + 1, len(prompts), "")
    return torch.cat(xs), torch.cat(ys)


@dataclass
class TrainState:
    """What a resumed training run needs: epochs done, the loss of each step, optimizer state."""

    epoch: int = 0
    losses: list[float] = field(default_factory=list)
    optimizer: dict | None = None


def _loss(heads: DraftHeads, lm_head, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    logits = heads(x, lm_head)  # [H, R, V]
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.t().reshape(-1), ignore_index=-100)


def train_heads(heads: DraftHeads, lm_head, x: torch.Tensor, y: torch.Tensor, *, epochs: int = 4,
                batch_rows: int = 256, lr: float = 1e-3, seed: int = 0, state: TrainState | None = None,
                progress: Progress | None = None, on_epoch: Callable[[TrainState], None] | None = None) -> TrainState:
    """Fit ``heads`` (AdamW, cosine decay) to ``(x, y)`` from ``head_examples``; the LM head stays frozen.

    Resumes from ``state`` (epochs already done are skipped; the shuffles are seeded per epoch, so a
    resumed run sees the same batches); ``on_epoch(state)`` after each epoch (to checkpoint).
    """
    if x.dim() != 2 or y.dim() != 2 or x.shape[0] != y.shape[0] or y.shape[1] != heads.num_heads:
        raise ValueError(f"x must be [R, hidden] and y [R, {heads.num_heads}], got {tuple(x.shape)} and {tuple(y.shape)}")
    state = state or TrainState()
    opt = torch.optim.AdamW(heads.parameters(), lr=lr, weight_decay=0.0)
    if state.optimizer is not None:
        opt.load_state_dict(state.optimizer)
    steps_per_epoch = -(-x.shape[0] // batch_rows)
    total = epochs * steps_per_epoch
    heads.train()
    for epoch in range(state.epoch, epochs):
        order = torch.randperm(x.shape[0], generator=torch.Generator().manual_seed(seed + epoch))
        for s in range(steps_per_epoch):
            step = epoch * steps_per_epoch + s
            for group in opt.param_groups:
                group["lr"] = lr * 0.5 * (1 + math.cos(math.pi * step / total))  # a float: checkpoints load weights-only
            rows = order[s * batch_rows:(s + 1) * batch_rows]
            loss = _loss(heads, lm_head, x[rows], y[rows])
            opt.zero_grad()
            loss.backward()
            opt.step()
            state.losses.append(loss.item())
            if progress is not None:
                progress(step + 1, total, f"epoch {epoch + 1}/{epochs}, loss {state.losses[-1]:.3f}")
        state.epoch = epoch + 1
        state.optimizer = opt.state_dict()
        if on_epoch is not None:
            on_epoch(state)
    heads.eval()
    return state


@torch.inference_mode()
def head_accuracy(heads: DraftHeads, lm_head, x: torch.Tensor, y: torch.Tensor, top_k: int = 1,
                  batch_rows: int = 512) -> list[float]:
    """Per head, the share of rows whose target is among the head's ``top_k`` guesses."""
    hits = torch.zeros(heads.num_heads)
    count = (y >= 0).sum(0).float()
    for s in range(0, x.shape[0], batch_rows):
        logits = heads(x[s:s + batch_rows], lm_head)
        top = torch.topk(logits, top_k, dim=-1).indices  # [H, R, k]
        target = y[s:s + batch_rows].t()[..., None]
        hits += ((top == target).any(-1) & (target[..., 0] >= 0)).sum(-1).float()
    return (hits / count.clamp(min=1)).tolist()
