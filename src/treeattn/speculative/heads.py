"""An EAGLE-style draft head on the model's own features, self-distilled on the CPU.

The head is one small network ``f`` that guesses the target's next final hidden state from the
current one and the token that follows it: ``h'_{t+1} = f(h_t, embed(x_{t+1}))``; the target's own
(frozen) LM head turns a guessed state into a guessed next token. Applied again on its own guess it
drafts a whole tree, every node conditioned on the tokens on its path (Medusa heads, which guess
``t + 2, t + 3, ...`` from ``h_t`` alone, cannot: on SmolLM2 they reached 19% / 9% / 6% top-1 and
lost speed). ``f`` is a fusing linear layer and a residual SwiGLU block (2.6M parameters at SmolLM2's
hidden size 576), with no attention: the target's state already holds the context.

A draft head only ever scores its ``vocab`` shortlist (the tokens the model wrote most often in its
training answers, FR-Spec's frequency-ranked draft vocabulary): a node then costs a ``vocab x
hidden`` product instead of the full LM head's (4096 instead of 49152 rows for SmolLM2).

Training data is the model's own greedy output (``self_distill``): for greedy decoding the token a
draft must guess is exactly what the model will emit. ``train_heads`` unrolls ``f`` over ``depth``
steps on those answers (each step fed its own previous guess, as when drafting) and fits the tokens
by cross-entropy and the target's states by a smooth L1 loss; ``HeadDrafter`` drafts with it.
"""

from __future__ import annotations

import copy
import json
import math
import os
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ..packed_linear import pack_linears
from .adaptive import Candidates, grow
from .drafters import as_context
from .verify import DraftTree

__all__ = [
    "DEFAULT_EAGLE3",
    "DEFAULT_HEADS",
    "PACKAGED_EAGLE3",
    "PACKAGED_HEADS",
    "PROMPTS_FILE",
    "DraftHeads",
    "HeadData",
    "HeadDrafter",
    "TrainState",
    "best_candidates",
    "causal_hidden_states",
    "expand_frontier",
    "find_heads",
    "usable_heads",
    "fit",
    "head_accuracy",
    "head_examples",
    "load_heads",
    "save_heads",
    "self_distill",
    "shortlist",
    "train_heads",
]

_DATA = Path(__file__).parent / "data"
PROMPTS_FILE = _DATA / "prompts.txt"  # the training prompts shipped with treeattn
# SmolLM2-135M's draft heads shipped with treeattn: a treeattn head file and an EAGLE-3 checkpoint folder.
PACKAGED_HEADS = _DATA / "smollm2-135m-heads.pt"
PACKAGED_EAGLE3 = _DATA / "smollm2-135m-eagle3"
# Where ``treeattn train-heads`` writes by default (the user's own head wins over the shipped one).
DEFAULT_HEADS = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "treeattn" / "smollm2-135m-heads.pt"
DEFAULT_EAGLE3 = DEFAULT_HEADS.with_name("smollm2-135m-eagle3")  # ``--arch eagle3``: a checkpoint folder
_FORMAT = "treeattn-draft-head-2"

Progress = Callable[[int, int, str], None]  # (done, total, message)
VocabWeights = tuple[torch.Tensor, torch.Tensor]  # (input embeddings [V, H], LM head weight [V, H])


class DraftHeads(nn.Module):
    """The draft network ``f(h, e) -> h'`` over ``hidden_size`` states, scoring the ``vocab`` shortlist
    (token ids, most likely first) through the target's LM head. ``depth``: how many steps it was
    trained to unroll (and drafts at most)."""

    def __init__(self, hidden_size: int, vocab: Sequence[int] | torch.Tensor, *, depth: int = 4,
                 inner_size: int | None = None):
        super().__init__()
        for name, value in (("hidden_size", hidden_size), ("depth", depth)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        vocab = torch.as_tensor(vocab, dtype=torch.int64).flatten()
        if vocab.numel() < 2 or (vocab < 0).any() or vocab.unique().numel() != vocab.numel():
            raise ValueError("vocab must hold at least two distinct token ids >= 0")
        if inner_size is not None and (not isinstance(inner_size, int) or inner_size < 1):
            raise ValueError(f"inner_size must be an int >= 1 (or None: twice hidden_size), got {inner_size!r}")
        inner = inner_size or 2 * hidden_size
        self.hidden_size, self.depth = hidden_size, depth
        self.register_buffer("vocab", vocab)
        self.fuse = nn.Linear(2 * hidden_size, hidden_size)
        self.norm = nn.RMSNorm(hidden_size)
        self.gate_up = nn.Linear(hidden_size, 2 * inner, bias=False)
        self.down = nn.Linear(inner, hidden_size, bias=False)

    @property
    def inner_size(self) -> int:
        return self.down.in_features

    def forward(self, hidden: torch.Tensor, token_embeddings: torch.Tensor) -> torch.Tensor:
        """The guessed next states ``[R, hidden_size]`` after ``hidden [R, hidden_size]`` and the
        embeddings of the tokens that follow them ``[R, hidden_size]``."""
        x = self.fuse(torch.cat([hidden, token_embeddings], dim=-1))
        gate, up = self.gate_up(self.norm(x)).chunk(2, dim=-1)
        return x + self.down(F.silu(gate) * up)

    def check_model(self, weights: VocabWeights) -> None:
        """``ValueError`` unless ``weights`` (a model's ``vocab_weights()``) fit this head."""
        embed, lm = weights
        for what, w in (("hidden states", lm), ("token embeddings", embed)):
            if w.shape[-1] != self.hidden_size:
                raise ValueError(f"the draft head reads {what} of size {self.hidden_size}, the model's are {w.shape[-1]}")
        if int(self.vocab.max()) >= min(embed.shape[0], lm.shape[0]):
            raise ValueError(f"the draft head's vocabulary has token {int(self.vocab.max())}, "
                             f"beyond the model's {min(embed.shape[0], lm.shape[0])} tokens")


def shortlist(outputs: Sequence[Sequence[int]], vocab_size: int, size: int = 4096) -> list[int]:
    """A draft vocabulary of ``size`` token ids: those in ``outputs`` by falling count, then the
    lowest ids not seen (byte-level BPE numbers its most frequent merges first)."""
    if not isinstance(size, int) or size < 2:
        raise ValueError(f"size must be an int >= 2, got {size!r}")
    size = min(size, vocab_size)
    counts = Counter(t for out in outputs for t in out if 0 <= t < vocab_size)
    ids = [t for t, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))][:size]
    seen = set(ids)
    ids += [t for t in range(vocab_size) if t not in seen][:size - len(ids)]
    return ids


def save_heads(heads: DraftHeads, path: str | Path, **metadata) -> None:
    """Save ``heads`` in float16 (what drafting needs) with ``metadata`` (how it was made)."""
    state = {k: (v if k == "vocab" else v.detach().to(torch.float16)).cpu() for k, v in heads.state_dict().items()}
    torch.save({"format": _FORMAT, "hidden_size": heads.hidden_size, "depth": heads.depth,
                "inner_size": heads.inner_size, "state_dict": state, "metadata": metadata}, Path(path))


def load_heads(path: str | Path, *, dtype: torch.dtype = torch.float32) -> tuple[DraftHeads, dict]:
    """``(heads, metadata)`` from ``save_heads``; ``ValueError`` for a file of another kind."""
    try:
        blob = torch.load(Path(path), map_location="cpu", weights_only=True)
    except Exception as exc:  # truncated, corrupt or not a torch file at all
        raise ValueError(f"{path} is not a readable treeattn draft-head file ({type(exc).__name__}: {exc})") from None
    if not isinstance(blob, dict) or blob.get("format") != _FORMAT:
        older = isinstance(blob, dict) and str(blob.get("format", "")).startswith("treeattn-draft-heads")
        why = "was made by an older treeattn (Medusa heads): rerun `treeattn train-heads`" if older else \
            "is not a treeattn draft-head file (saved by save_heads)"
        raise ValueError(f"{path} {why}")
    try:
        state = blob["state_dict"]
        heads = DraftHeads(int(blob["hidden_size"]), state["vocab"], depth=int(blob["depth"]),
                           inner_size=int(blob["inner_size"]))
        heads.load_state_dict(state)
        metadata = dict(blob["metadata"])
    except (KeyError, TypeError, RuntimeError) as exc:
        raise ValueError(f"{path} is a damaged treeattn draft-head file ({type(exc).__name__}: {exc})") from None
    return heads.to(dtype).eval(), metadata


def find_heads(*, eagle3: bool = True) -> Path | None:
    """SmolLM2-135M's draft head: the first of ``usable_heads(eagle3=)``, or None."""
    return next(iter(usable_heads(eagle3=eagle3)), None)


def usable_heads(*, eagle3: bool = True) -> list[Path]:
    """SmolLM2-135M's draft heads that look usable, best first: the user's own (``treeattn train-heads``
    writes them: the EAGLE-3 folder ``DEFAULT_EAGLE3``, then the head file ``DEFAULT_HEADS``), then the
    shipped ones (``PACKAGED_EAGLE3``, ``PACKAGED_HEADS``). A head file counts if it loads (an older
    treeattn's Medusa heads do not), a folder if its ``config.json`` is a JSON object and it holds
    ``model.safetensors`` (whether it fits a target is the caller's check). ``eagle3=False`` passes
    over the folders (an EAGLE-3 head needs its target's depth to be checked against it)."""
    found = []
    for path in (DEFAULT_EAGLE3, DEFAULT_HEADS, PACKAGED_EAGLE3, PACKAGED_HEADS):
        if path.is_dir():
            if eagle3 and _is_checkpoint_folder(path):
                found.append(path)
        elif path.is_file():
            try:
                load_heads(path)
            except ValueError:
                continue
            found.append(path)
    return found


def _is_checkpoint_folder(path: Path) -> bool:
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(config, dict) and (path / "model.safetensors").is_file()


Drafted = list[tuple[int, int, float, float]]  # per node: (parent node, token, probability given the parent, path score)


def expand_frontier(nodes: list[Drafted], owner: Sequence[int], front: Sequence[int], probs: np.ndarray,
                    picks: np.ndarray, width: int, min_score: float) -> list[tuple[int, int, int, int]]:
    """One level of EAGLE-2's dynamic tree: record frontier row ``row``'s ``k`` guesses (``probs`` /
    ``picks [rows, k]``, best first) as children of node ``front[row]`` of context ``owner[row]``, then
    return the next frontier, ``(row, rank, context, node)`` of each context's ``width`` best children
    by path score, those under ``min_score`` left out (so unlikely a node would never be verified)."""
    children: list[list[tuple[float, int, int, int]]] = [[] for _ in nodes]  # (score, node, row, rank)
    for row, (b, parent) in enumerate(zip(owner, front)):
        score = nodes[b][parent][3]
        for r in range(picks.shape[1]):
            nodes[b].append((parent, int(picks[row, r]), float(probs[row, r]), score * probs[row, r]))
            children[b].append((score * probs[row, r], len(nodes[b]) - 1, row, r))
    return [(row, r, b, node) for b in range(len(nodes))
            for score, node, row, r in sorted(children[b], key=lambda c: -c[0])[:width] if score >= min_score]


def best_candidates(drafted: Drafted, budget: int) -> Candidates:
    """The ``budget`` best of a context's drafted nodes (``grow`` keeps every kept node's parent),
    bucketed for calibration by depth and probability decile."""
    kids: dict[int, list[int]] = {}
    for i, (parent, *_rest) in enumerate(drafted[1:], start=1):
        kids.setdefault(parent, []).append(i)
    tokens, parents, refs = grow(drafted[0][1], lambda ref: [(drafted[i][3], drafted[i][1], i)
                                                              for i in kids.get(0 if ref is None else ref, [])],
                                 budget)
    depth = {0: 0}
    keys, prior = np.zeros(len(tokens), np.int64), np.ones(len(tokens))
    for i in range(1, len(tokens)):
        node = refs[i]
        depth[node] = depth[drafted[node][0]] + 1
        p = drafted[node][2]
        keys[i], prior[i] = (depth[node] - 1) * 100 + min(int(p * 10), 9), p
    return Candidates(DraftTree(np.array(tokens), np.array(parents)), keys, prior)


class HeadDrafter:
    """Drafts from ``DraftHeads`` (EAGLE-2's dynamic tree): from each context's last token, every
    depth expands the ``width`` best nodes of the previous depth (by the product of the head's
    probabilities along their path) into their ``top_k`` best next tokens, in one batched step for all
    contexts, and stops where no node's path probability reaches ``min_score`` (each depth costs a
    pass over the head's and the shortlist's weights); the tree is then the ``budget`` best nodes
    (the root included). The defaults measured best for SmolLM2 on a 2-core CPU (adaptive trees
    there verify 5-6 nodes: a wider or deeper search costs more drafting than it adds).
    ``weights`` is the target's ``vocab_weights()``; drafting needs its hidden states (``generate``
    passes them). Implements ``Drafter`` and ``ScoringDrafter`` (calibration bucket: depth and
    probability decile).

    ``dtype``: what the head computes in: None for the head's own dtype, or ``"fastest"``: the
    faster of that and bfloat16, timed here on one drafting depth (a depth reads the head's and the
    shortlist's weights whatever its rows, 20 MB for SmolLM2's head in float32: with AMX, 16 rows took
    0.37 ms in bfloat16 against 0.91 in float32; without bfloat16 units the head's own dtype wins). Drafting in
    bfloat16 changes a few draft trees, never the output: verification decides.
    """

    def __init__(self, heads: DraftHeads, weights: VocabWeights, *, budget: int = 32, top_k: int = 3,
                 width: int = 2, min_score: float = 0.05, dtype: torch.dtype | str | None = None):
        if not isinstance(heads, DraftHeads):
            raise TypeError(f"heads must be DraftHeads, got {type(heads).__name__}")
        for name, value in (("budget", budget), ("top_k", top_k), ("width", width)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if not 0 <= min_score < 1:
            raise ValueError(f"min_score must be in [0, 1), got {min_score!r}")
        if not (dtype is None or dtype == "fastest" or isinstance(dtype, torch.dtype)):
            raise ValueError(f"dtype must be None, 'fastest' or a torch.dtype, got {dtype!r}")
        heads.check_model(weights)
        self.budget, self.top_k, self.width, self.min_score = budget, top_k, width, float(min_score)
        own = heads.fuse.weight.dtype
        self._use(heads, weights, own if dtype in (None, "fastest") else dtype)
        if dtype == "fastest" and own != torch.bfloat16 and weights[0].device.type == "cpu":
            seconds = self._depth_seconds()
            kept = self.heads, self.embed, self.project
            self._use(heads, weights, torch.bfloat16)
            if not self._depth_seconds() < seconds:
                self.heads, self.embed, self.project = kept

    def _use(self, heads: DraftHeads, weights: VocabWeights, dtype: torch.dtype) -> None:
        """Draft with a copy of ``heads`` in ``dtype`` (``heads`` stays as it was)."""
        # Drafting runs a few rows at a time, where PyTorch's CPU matmuls are slowest: the head and the
        # shortlist's rows of the LM head run on oneDNN-packed weights.
        embed, lm = weights
        self.heads = copy.deepcopy(heads).eval().to(embed.device, dtype)  # on the target's device, as its states
        self.embed = embed.detach().to(dtype)
        self.project = nn.Sequential(nn.utils.skip_init(nn.Linear, heads.hidden_size, heads.vocab.numel(), bias=False,
                                                        dtype=dtype))  # its weight is set next: no random init
        self.project[0].weight = nn.Parameter(lm.detach()[self.heads.vocab].to(dtype), requires_grad=False)
        pack_linears(self.heads)
        pack_linears(self.project)

    @torch.inference_mode()
    def _depth_seconds(self, rows: int = 16, repeats: int = 5) -> float:
        """The best of ``repeats`` timings of one drafting depth over ``rows`` rows (after a warm-up)."""
        numbers = torch.Generator(self.embed.device).manual_seed(0)  # the caller's random stream is left alone
        state = torch.randn(rows, self.heads.hidden_size, generator=numbers, device=self.embed.device).to(self.embed.dtype)
        tokens = torch.arange(rows, device=self.embed.device)
        best = math.inf
        for _ in range(repeats + 1):
            start = time.perf_counter()
            torch.topk(torch.softmax(self.project(self.heads(state, self.embed[tokens])), dim=-1), self.top_k, dim=-1)
            best = min(best, time.perf_counter() - start)
        return best

    def __repr__(self) -> str:
        return f"HeadDrafter(depth={self.heads.depth}, vocab={self.heads.vocab.numel()}, budget={self.budget}, " \
               f"top_k={self.top_k}, width={self.width}, min_score={self.min_score}, dtype={self.embed.dtype})"

    @torch.inference_mode()
    def candidates(self, contexts: Sequence[np.ndarray], hidden: torch.Tensor | None = None, *,
                   floor: float = 0.0) -> list[Candidates]:
        """``ScoringDrafter``; a depth whose every path probability is below ``min_score`` or ``floor``
        (what the caller would not verify) is not drafted."""
        n = len(contexts)
        if hidden is None or hidden.dim() != 2 or hidden.shape != (n, self.heads.hidden_size):
            raise ValueError(f"HeadDrafter needs the target's hidden states, hidden=[{n}, {self.heads.hidden_size}]")
        roots = [int(as_context(c, f"contexts[{b}]")[-1]) for b, c in enumerate(contexts)]
        if n == 0:
            return []
        nodes: list[Drafted] = [[(-1, r, 1.0, 1.0)] for r in roots]
        owner = list(range(n))  # the frontier's rows: their context, node, state and token
        front = [0] * n
        state = hidden.to(self.embed.dtype)
        tokens = torch.tensor(roots, device=self.embed.device)
        k = min(self.top_k, self.heads.vocab.numel())
        levels = min(self.heads.depth, self.budget - 1)
        for _ in range(levels):
            state = self.heads(state, self.embed[tokens])
            top = torch.topk(torch.softmax(self.project(state), dim=-1), k, dim=-1)
            probs, picks = top.values.double().cpu().numpy(), self.heads.vocab[top.indices].cpu().numpy()
            chosen = expand_frontier(nodes, owner, front, probs, picks, self.width, max(self.min_score, floor))
            if not chosen:
                break
            rows, ranks, owner, front = (list(column) for column in zip(*chosen))
            state = state[torch.tensor(rows, device=state.device)]
            tokens = torch.from_numpy(picks[rows, ranks]).to(self.embed.device)
        return [best_candidates(drafted, self.budget) for drafted in nodes]

    def propose(self, contexts: Sequence[np.ndarray], hidden: torch.Tensor | None = None) -> list[DraftTree]:
        return [c.tree for c in self.candidates(contexts, hidden)]


# ---------------------------------------------------------------------- self-distillation


def self_distill(model, prompts: Sequence[Sequence[int]], *, max_new_tokens: int = 96, batch_size: int = 16,
                 stop_tokens: Sequence[int] = (), done: Sequence[list[int]] = (),
                 progress: Progress | None = None, on_batch: Callable[[list[list[int]]], None] | None = None,
                 sampling=None, seed: int = 0) -> list[list[int]]:
    """The model's greedy continuation of every prompt, ``batch_size`` prompts per ``generate`` call;
    with ``sampling`` (``SamplingParams``) a sampled one instead, each batch from its own seed
    (``seed`` + its first prompt's index, so a resumed run samples what an uninterrupted one would).

    ``done`` holds the continuations of the first prompts from an earlier, interrupted run (they are
    kept); ``on_batch(all_so_far)`` is called after each batch (to checkpoint).
    """
    from .generate import generate

    outputs = [list(o) for o in done]
    for start in range(len(outputs), len(prompts), batch_size):
        chunk = [list(p) for p in prompts[start:start + batch_size]]
        generator = None if sampling is None else torch.Generator().manual_seed(seed + start)
        result = generate(model, chunk, max_new_tokens=max_new_tokens, stop_tokens=stop_tokens, sampling=sampling,
                          generator=generator)
        outputs.extend(result.tokens)
        if on_batch is not None:
            on_batch(outputs)
        if progress is not None:
            progress(len(outputs), len(prompts), f"{result.num_tokens / result.elapsed_s:.0f} tokens/s")
    return outputs


def causal_hidden_states(model, tokens: Sequence[int], feature_layers: Sequence | None = None) -> torch.Tensor:
    """Final hidden states ``[T, hidden]`` of one sequence: one causal forward of ``model`` (a
    ``TreeModel``) on a scratch cache; with ``feature_layers``, those layers' states concatenated
    instead (``ModelOutput.features``)."""
    ids = torch.as_tensor(list(tokens), dtype=torch.int64)
    page_size = 16
    cache = model.new_cache(-(-ids.numel() // page_size), page_size=page_size)
    cache.add_sequence(0)
    with torch.inference_mode():
        if feature_layers is None:
            hidden = model.forward(cache, [0], ids, [ids.numel()]).hidden
        else:
            # The LM head on one row, not all: its logits are not wanted (9% of a SmolLM2 answer's forward).
            last = torch.tensor([ids.numel() - 1])
            hidden = model.forward(cache, [0], ids, [ids.numel()], logits_rows=last, feature_layers=feature_layers).features
    return hidden.clone()  # outside inference mode: a normal tensor that training can use


@dataclass(frozen=True)
class HeadData:
    """The target's states along its answers, flattened: ``hidden[j]`` is the state at one answer
    position and ``next_token[j]`` the token the model wrote after it; ``end[j]`` is where ``j``'s
    answer ends in the flat arrays (so ``j + d`` belongs to the same answer while ``j + d < end[j]``)."""

    hidden: torch.Tensor  # [N, hidden]
    next_token: torch.Tensor  # int64 [N]
    end: torch.Tensor  # int64 [N]

    def __post_init__(self) -> None:
        n = self.hidden.shape[0]
        if self.hidden.dim() != 2 or self.next_token.shape != (n,) or self.end.shape != (n,):
            raise ValueError(f"HeadData needs hidden [N, H], next_token [N] and end [N], got "
                             f"{tuple(self.hidden.shape)}, {tuple(self.next_token.shape)}, {tuple(self.end.shape)}")

    def __len__(self) -> int:
        return self.hidden.shape[0]

    def unroll(self, rows: torch.Tensor, depth: int):
        """For ``rows`` and each step ``d < depth``: the token fed at that step ``[R, depth]``, the state
        and token to guess ``[R, depth, hidden]`` and ``[R, depth]`` (``-100`` past the answer's end)."""
        steps = rows[:, None] + torch.arange(depth)  # step d feeds next_token[j + d], guesses j + d + 1
        n = len(self)
        feed = self.next_token[steps.clamp(max=n - 1)]
        target = (steps + 1).clamp(max=n - 1)
        valid = (steps + 1) < self.end[rows][:, None]
        return feed, self.hidden[target], torch.where(valid, self.next_token[target], -100)


def head_examples(model, prompts: Sequence[Sequence[int]], outputs: Sequence[Sequence[int]],
                  progress: Progress | None = None) -> HeadData:
    """``HeadData`` of ``model``'s answers ``outputs`` to ``prompts`` (one causal forward each): every
    position from the prompt's last token to the answer's second-to-last."""
    if len(prompts) != len(outputs):
        raise ValueError(f"prompts and outputs must pair up, got {len(prompts)} and {len(outputs)}")
    hidden, nxt, end = [], [], []
    total = 0
    for i, (prompt, out) in enumerate(zip(prompts, outputs)):
        if len(prompt) == 0:
            raise ValueError(f"prompts[{i}] is empty: an answer needs the prompt token that predicted it")
        if len(out) >= 2:
            seq = list(prompt) + list(out)
            first = len(prompt) - 1  # this position's next token is the answer's first
            hidden.append(causal_hidden_states(model, seq[:-1])[first:])
            nxt.append(torch.tensor(seq[first + 1:]))
            total += len(out)
            end.append(torch.full((len(out),), total))
        if progress is not None:
            progress(i + 1, len(prompts), "")
    if not hidden:
        raise ValueError("no answer has two tokens or more: nothing to train on")
    return HeadData(torch.cat(hidden), torch.cat(nxt), torch.cat(end))


@dataclass
class TrainState:
    """What a resumed training run needs: epochs done (and batches done of the next one, when it was
    checkpointed within an epoch), the loss of each step, optimizer state."""

    epoch: int = 0
    batch: int = 0
    losses: list[float] = field(default_factory=list)
    optimizer: dict | None = None


def _unrolled(heads: DraftHeads, embed: torch.Tensor, data: HeadData, rows: torch.Tensor):
    """Per draft step: the guessed states ``[R, hidden]``, the true ones, the token targets as
    shortlist positions (``-100`` where the answer ended or the token is not on the shortlist) and
    whether the answer goes on that far."""
    depth = heads.depth
    dtype = heads.fuse.weight.dtype
    index = torch.full((embed.shape[0],), -100, dtype=torch.int64)
    index[heads.vocab] = torch.arange(heads.vocab.numel())
    feed, true_states, tokens = data.unroll(rows, depth)
    targets = torch.where(tokens >= 0, index[tokens.clamp(min=0)], -100)
    embed, true_states = embed.to(dtype), true_states.to(dtype)
    state, steps = data.hidden[rows].to(dtype), []
    for d in range(depth):
        state = heads(state, embed[feed[:, d]])
        steps.append((state, true_states[:, d], targets[:, d], tokens[:, d] >= 0))
    return steps


def _shortlist_head(heads: DraftHeads, weights: VocabWeights) -> torch.Tensor:
    """The LM head's rows of the head's shortlist, in its dtype: what scores a guessed state."""
    return weights[1][heads.vocab].to(heads.fuse.weight.dtype)


def _loss(heads: DraftHeads, embed: torch.Tensor, out: torch.Tensor, data: HeadData, rows: torch.Tensor) -> torch.Tensor:
    total = torch.zeros(())
    for state, true_state, target, _ in _unrolled(heads, embed, data, rows):
        ok = target >= 0
        if ok.any():  # tokens by cross-entropy, states (EAGLE's feature regression) by smooth L1
            total = total + F.cross_entropy(state[ok] @ out.t(), target[ok]) + \
                F.smooth_l1_loss(state[ok], true_state[ok])
    return total / heads.depth


def train_heads(heads: DraftHeads, weights: VocabWeights, data: HeadData, *, epochs: int = 6,
                batch_rows: int = 256, lr: float = 1e-3, seed: int = 0, state: TrainState | None = None,
                progress: Progress | None = None, on_checkpoint: Callable[[TrainState], None] | None = None,
                checkpoint_s: float = 600.0) -> TrainState:
    """Fit ``heads`` (AdamW, cosine decay) to ``data`` from ``head_examples``; ``weights`` (the model's
    ``vocab_weights()``) stay frozen.

    Resumes from ``state``; ``on_checkpoint(state)`` after each epoch and every ``checkpoint_s`` seconds
    within one (``fit``).
    """
    if not isinstance(data, HeadData):
        raise TypeError(f"data must be HeadData (from head_examples), got {type(data).__name__}")
    for name, value in (("epochs", epochs), ("batch_rows", batch_rows)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    heads.check_model(weights)
    embed, out = weights[0].detach(), _shortlist_head(heads, weights).detach()
    heads.train()
    state = fit(heads.parameters(), len(data), lambda rows: _loss(heads, embed, out, data, rows), epochs=epochs,
                batch=batch_rows, lr=lr, seed=seed, state=state, progress=progress, on_checkpoint=on_checkpoint,
                checkpoint_s=checkpoint_s)
    heads.eval()
    return state


def fit(params, num_items: int, batch_loss: Callable[[torch.Tensor], torch.Tensor], *, epochs: int, batch: int,
        lr: float, seed: int, state: TrainState | None, progress: Progress | None,
        on_checkpoint: Callable[[TrainState], None] | None, checkpoint_s: float = 600.0) -> TrainState:
    """Minimise ``batch_loss(indices)`` over ``epochs`` shuffles of ``num_items`` training items,
    ``batch`` per update, by AdamW on ``params`` with cosine decay from ``lr``.

    Resumes from ``state`` at the batch where it stopped (the shuffles are seeded per epoch, so a
    resumed run sees the same batches and ends where an uninterrupted one does);
    ``on_checkpoint(state)`` after each epoch and, within one, after the first batch that ends
    ``checkpoint_s`` seconds after the last checkpoint (an epoch of EAGLE-3 training on 14,000
    answers takes half an hour on 2 cores: an interrupt loses 10 minutes at most).
    """
    state = state or TrainState()
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    if state.optimizer is not None:
        opt.load_state_dict(state.optimizer)
    steps_per_epoch = -(-num_items // batch)
    total = epochs * steps_per_epoch
    last = time.perf_counter()

    def checkpoint() -> None:
        nonlocal last
        state.optimizer = opt.state_dict()
        if on_checkpoint is not None:
            on_checkpoint(state)
        last = time.perf_counter()

    for epoch in range(state.epoch, epochs):
        order = torch.randperm(num_items, generator=torch.Generator().manual_seed(seed + epoch))
        for s in range(state.batch, steps_per_epoch):
            step = epoch * steps_per_epoch + s
            for group in opt.param_groups:
                group["lr"] = lr * 0.5 * (1 + math.cos(math.pi * step / total))  # a float: checkpoints load weights-only
            loss = batch_loss(order[s * batch:(s + 1) * batch])
            opt.zero_grad()
            loss.backward()
            opt.step()
            state.losses.append(loss.item())
            if progress is not None:
                progress(step + 1, total, f"epoch {epoch + 1}/{epochs}, loss {state.losses[-1]:.3f}")
            state.batch = s + 1
            if state.batch < steps_per_epoch and time.perf_counter() - last >= checkpoint_s:
                checkpoint()
        state.epoch, state.batch = epoch + 1, 0
        checkpoint()
    return state


@torch.inference_mode()
def head_accuracy(heads: DraftHeads, weights: VocabWeights, data: HeadData, top_k: int = 1,
                  batch_rows: int = 512) -> list[float]:
    """Per draft step ``d``, the share of positions whose token ``d + 1`` ahead the head has among its
    ``top_k`` guesses, every step fed the true tokens before it (the path a draft must match) and the
    head's own states (as when drafting). Tokens off the shortlist count as misses."""
    out = _shortlist_head(heads, weights)
    top_k = min(top_k, heads.vocab.numel())
    hits, count = torch.zeros(heads.depth), torch.zeros(heads.depth)
    for s in range(0, len(data), batch_rows):
        rows = torch.arange(s, min(s + batch_rows, len(data)))
        for d, (state, _, target, answered) in enumerate(_unrolled(heads, weights[0], data, rows)):
            top = torch.topk(state @ out.t(), top_k, dim=-1).indices
            hits[d] += ((top == target[:, None]).any(-1) & (target >= 0)).sum()
            count[d] += answered.sum()
    return (hits / count.clamp(min=1)).tolist()
