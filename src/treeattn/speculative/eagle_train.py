"""Self-distil an EAGLE-3 head (``Eagle3Head``) for a target on the CPU and save it as a standard
EAGLE-3 checkpoint folder (``config.json`` + ``model.safetensors``, EAGLE's ``midlayer.*`` names, which
EAGLE, SGLang, vLLM and ``load_draft_head`` all read).

**Data** (``eagle3_examples``): the target's own greedy answers (``heads.self_distill``), and along
each prompt + answer the target's features at the head's ``aux_layers`` boundaries. Row ``p`` of a
sequence pairs the features of position ``p`` with the token at ``p + 1`` (as ``Eagle3Head`` reads
them) and its step-1 output guesses the token at ``p + 2``.

**Training-time test** (EAGLE-3): step 1 runs every row on the target's features, causally. Step
``s > 1`` runs row ``q`` on the step-``s - 1`` output of row ``q - 1`` (the head's own state, as when
drafting) with the true token at ``q + 1``: this is the draft node at depth ``s - 1`` below the
last context row ``c = q - s + 1``, so it attends to context rows ``0..c`` and to the earlier steps'
rows on its own chain (row ``c + j`` of step ``j + 1``): EAGLE's causal-plus-diagonal mask. Its
RoPE position is ``q = c + depth``, ``Eagle3Head``'s draft position. Each step is fit by
cross-entropy to the target's next-token distribution ``s + 1`` ahead over the draft vocabulary
(EAGLE-3's loss: the target's LM head on its final hidden state there, ``teacher``), or without a
teacher to the target's token there, mapped into the draft vocabulary (tokens outside it are
skipped); each step weighted ``0.8 ** (s - 1)`` as EAGLE-3 does; only tokens of the answers count
(the prompts are context). A whole distribution says more per position than its top token: with
the few answers a CPU can write, it is what makes the head learn faster.

The training forward (``ttt_forward``) computes exactly what ``Eagle3Head.forward`` computes on a
context append followed by a chain of draft nodes (tests/test_train_eagle3.py checks it), so the
trained weights draft as trained.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from .eagle import Eagle3Head, HeadConfig, _rope, _rotate, default_aux_layers
from .features import FINAL
from .heads import Progress, TrainState, causal_hidden_states, fit

__all__ = ["STEP_WEIGHT", "Eagle3Data", "eagle3_accuracy", "eagle3_examples", "eagle3_loss", "eagle3_sequence", "new_eagle3_head",
           "save_eagle3", "train_eagle3", "ttt_forward"]

STEP_WEIGHT = 0.8  # EAGLE-3's per-step loss weight: step s counts 0.8 ** (s - 1)


@dataclass(frozen=True)
class Eagle3Data:
    """Per sequence (prompt + answer): ``tokens[i]`` ``[T]``, ``features[i]`` ``[T - 1, feature_size]``
    (positions ``0..T-2``, the aux-layer states concatenated in ascending order), ``first[i]``, the
    index in ``tokens[i]`` of the answer's first token (tokens before it are not trained on), and
    ``final[i]`` ``[T - 1, hidden]``, the target's final hidden states there (what a teacher's LM
    head turns into the target's distributions; ``None``: not kept)."""

    tokens: list[torch.Tensor]
    features: list[torch.Tensor]
    first: list[int]
    final: list[torch.Tensor] | None = None

    def __post_init__(self) -> None:
        if not (len(self.tokens) == len(self.features) == len(self.first)) or not self.tokens:
            raise ValueError("Eagle3Data needs tokens, features and first for at least one sequence, one each")
        if self.final is not None and len(self.final) != len(self.tokens):
            raise ValueError(f"Eagle3Data.final needs one tensor per sequence, got {len(self.final)} for "
                             f"{len(self.tokens)}")
        for i, (t, f) in enumerate(zip(self.tokens, self.features)):
            if f.dim() != 2 or f.shape[0] != t.numel() - 1:
                raise ValueError(f"features[{i}] must be [{t.numel() - 1}, width] (one row per position but the "
                                 f"last of tokens[{i}]), got {tuple(f.shape)}")
            if self.final is not None and (self.final[i].dim() != 2 or self.final[i].shape[0] != t.numel() - 1):
                raise ValueError(f"final[{i}] must be [{t.numel() - 1}, hidden], got {tuple(self.final[i].shape)}")

    def __len__(self) -> int:
        return len(self.tokens)

    def batch(self, index: Sequence[int], vocab_index: torch.Tensor, steps: int):
        """Sequences ``index`` padded to one length: features ``[B, n, F]``, the token each row reads
        ``[B, n]``, per step its draft-vocabulary target ``[steps, B, n]`` (``-100``: no loss) and
        whether it is a target token at all ``[steps, B, n]`` (for accuracy: off-vocabulary is a miss),
        and per row the target's final state that chose its target token ``[B, n, hidden]`` (row ``q``
        guesses token ``q + 2`` at every step, chosen at position ``q + 1``; None without ``final``)."""
        n = max(self.tokens[i].numel() - 1 for i in index)
        chose = None
        if self.final is not None:
            chose = torch.zeros(len(index), n, self.final[index[0]].shape[1], dtype=self.final[index[0]].dtype)
            for b, i in enumerate(index):
                chose[b, :self.final[i].shape[0] - 1] = self.final[i][1:]
        feats = torch.zeros(len(index), n, self.features[index[0]].shape[1], dtype=self.features[index[0]].dtype)
        reads = torch.zeros(len(index), n, dtype=torch.long)
        answer = torch.full((steps, len(index), n), -1, dtype=torch.long)  # target token ids, -1: none
        rows = torch.arange(n)
        for b, i in enumerate(index):
            tokens, m = self.tokens[i], self.tokens[i].numel() - 1
            feats[b, :m] = self.features[i]
            reads[b, :m] = tokens[1:]
            for s in range(steps):  # row q of step s + 1 guesses token q + 2 from context row q - s
                q = rows[s:m - 1]
                keep = q + 2 >= self.first[i]
                answer[s, b, q[keep]] = tokens[q[keep] + 2]
        valid = answer >= 0
        targets = torch.where(valid, vocab_index[answer.clamp(min=0)], -100)
        return feats, reads, targets, valid, chose


def eagle3_examples(model, prompts: Sequence[Sequence[int]], outputs: Sequence[Sequence[int]],
                    aux_layers: Sequence[int], progress: Progress | None = None,
                    dtype: torch.dtype = torch.float32) -> Eagle3Data:
    """``Eagle3Data`` of ``model``'s answers ``outputs`` to ``prompts`` (``eagle3_sequence`` each)."""
    if len(prompts) != len(outputs):
        raise ValueError(f"prompts and outputs must pair up, got {len(prompts)} and {len(outputs)}")
    rows = []
    for i, (prompt, out) in enumerate(zip(prompts, outputs)):
        if len(prompt) == 0:
            raise ValueError(f"prompts[{i}] is empty: an answer needs the prompt token that predicted it")
        rows.append(eagle3_sequence(model, prompt, out, aux_layers, dtype))
        if progress is not None:
            progress(i + 1, len(prompts), "")
    rows = [r for r in rows if r is not None]
    if not rows:
        raise ValueError("no answer has two tokens or more: nothing to train on")
    return Eagle3Data(*(list(field) for field in zip(*rows)))


def eagle3_sequence(model, prompt: Sequence[int], answer: Sequence[int], aux_layers: Sequence[int],
                    dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor, int, torch.Tensor] | None:
    """One sequence's ``Eagle3Data`` fields ``(tokens, features, first, final)``: one causal forward of
    ``model`` (a ``TreeModel`` that returns ``feature_layers``, e.g. ``treeattn.hf.HFTreeModel``) along
    ``prompt + answer``; None for an answer under two tokens (a step-1 row guesses two tokens ahead: it
    teaches nothing). The features are kept in ``dtype``: ``torch.bfloat16`` takes 3.5 KB a position
    for SmolLM2 instead of 6.9 (some GB for a few thousand answers) and loses nothing where the head's
    GEMMs round them to bfloat16 anyway (``train_eagle3``'s ``autocast``). The final hidden states (for
    a teacher) stay float32: the teacher's distributions are computed from them in float32."""
    if len(answer) < 2:
        return None
    seq = list(prompt) + list(answer)
    states = causal_hidden_states(model, seq[:-1], (*sorted(aux_layers), FINAL))
    hidden = states.shape[1] // (len(aux_layers) + 1)
    return torch.tensor(seq), states[:, :-hidden].to(dtype).contiguous(), len(prompt), states[:, -hidden:].contiguous()


def _rope_fields(config) -> tuple[float, dict | None]:
    """``(rope_theta, rope_scaling)`` of an HF config (transformers 4 fields or 5's ``rope_parameters``)."""
    d = config.to_dict()
    rope = d.get("rope_parameters") or {}
    scaling = d.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
    return float(d.get("rope_theta") or rope.get("rope_theta", 10000.0)), scaling


def new_eagle3_head(model, vocab: Sequence[int], aux_layers: Sequence[int] | None = None, *,
                    seed: int = 0) -> Eagle3Head:
    """A fresh ``Eagle3Head`` for ``model`` (an ``HFTreeModel``), shaped as the target's decoder
    layers (as EAGLE-3's released heads are), over the draft vocabulary ``vocab`` (target ids, e.g.
    ``heads.shortlist``; kept in ascending order as EAGLE-3's ``d2t`` is) at ``aux_layers`` boundaries
    (``None``: ``default_aux_layers``). Embeddings are the target's (frozen in training, left out of
    the checkpoint), the LM head starts from the target's rows of ``vocab``, the rest is HF Llama's
    init (normal, std 0.02) drawn from ``seed``."""
    config = model.config
    n = config.num_hidden_layers
    aux = tuple(default_aux_layers(n) if aux_layers is None else aux_layers)
    if len(aux) != 3 or len(set(aux)) != 3 or not all(isinstance(a, int) and 0 <= a <= n for a in aux):
        raise ValueError(f"aux_layers must be 3 distinct layer boundaries in [0, {n}] (the target's num_hidden_layers), "
                         f"got {aux}" + (" (the defaults do not fit a target this shallow: pass aux_layers)"
                                         if aux_layers is None else ""))
    ids = torch.as_tensor(list(vocab), dtype=torch.long).sort().values
    if ids.numel() < 2 or ids.unique().numel() != ids.numel() or int(ids[0]) < 0 or int(ids[-1]) >= config.vocab_size:
        raise ValueError(f"vocab must hold at least two distinct target ids in [0, {config.vocab_size})")
    theta, scaling = _rope_fields(config)
    cfg = HeadConfig(hidden_size=config.hidden_size, intermediate_size=config.intermediate_size,
                     num_attention_heads=config.num_attention_heads, num_key_value_heads=config.num_key_value_heads,
                     head_dim=getattr(config, "head_dim", None), vocab_size=config.vocab_size,
                     rms_norm_eps=float(config.rms_norm_eps), rope_theta=theta, rope_scaling=scaling,
                     draft_vocab_size=ids.numel(), aux_layers=aux)
    head = Eagle3Head(cfg)
    embed, lm = model.vocab_weights()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in head.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=g) * 0.02)
        head.embed_tokens.weight.copy_(embed)
        head.lm_head.weight.copy_(lm[ids])
        if hasattr(head, "d2t"):
            head.d2t.copy_(ids - torch.arange(ids.numel()))
            head.t2d.zero_()
            head.t2d[ids] = True
    head.embed_tokens.weight.requires_grad_(False)
    return head


def _vocab_index(head: Eagle3Head) -> torch.Tensor:
    """Target id -> draft id (``-100`` outside the draft vocabulary)."""
    index = torch.full((head.config.vocab_size,), -100, dtype=torch.long)
    draft = torch.arange(head.config.vocab_size_draft)
    index[head.to_target(draft).cpu()] = draft
    return index


def ttt_forward(head: Eagle3Head, features: torch.Tensor, reads: torch.Tensor, steps: int) -> list[torch.Tensor]:
    """The training-time test over a padded batch (module doc): ``features [B, n, feature_size]``,
    ``reads [B, n]`` (the token each row reads) -> per step ``s = 1..steps`` the final states ``[B, n,
    hidden]`` (``head.logits`` scores them). Row ``q`` of step ``s`` is valid for ``q >= s - 1``."""
    cfg, layer = head.config, head.layers[0]
    attn = layer.self_attn
    batch, n = reads.shape
    h, kv, d = attn.num_heads, attn.num_kv_heads, attn.head_dim
    positions = torch.arange(n)
    embeds = layer.input_layernorm(head.embed_tokens(reads))
    rope = _rope(positions.repeat(batch), attn.inv_freq, embeds.dtype)  # every step: the same positions
    hidden = head.fuse(features.to(embeds.dtype))
    keys: list[torch.Tensor] = []  # per earlier step: [B, n, h, d] K and V (KV heads repeated for the query heads)
    values: list[torch.Tensor] = []
    finals = []
    for s in range(steps):
        normed = layer.hidden_norm(hidden)
        x = torch.cat((embeds, normed), dim=-1)
        q = _rotate(attn.q_proj(x).view(batch * n, h, d), *rope).view(batch, n, h, d)
        k = _rotate(attn.k_proj(x).view(batch * n, kv, d), *rope).view(batch, n, kv, d)
        v = attn.v_proj(x).view(batch, n, kv, d)
        keys.append(k.repeat_interleave(h // kv, dim=2))
        values.append(v.repeat_interleave(h // kv, dim=2))
        # Row q of step s + 1 sees context rows 0..q - s (step 1's keys) and row q - s + j of each step j + 1.
        context = positions[None, :] <= positions[:, None] - s  # [query row, key row]; step 1: causal
        scores = [torch.einsum("bqhd,bkhd->bhqk", q, keys[0]).masked_fill(~context, float("-inf"))]
        diagonal = []
        for j in range(1, s + 1):
            shift = s - j
            k_j, v_j = (F.pad(t, (0, 0, 0, 0, shift, 0))[:, :n] for t in (keys[j], values[j]))  # row q reads row q - shift
            diagonal.append(v_j)
            scores.append(torch.einsum("bqhd,bqhd->bhq", q, k_j).masked_fill(positions < shift, float("-inf"))[..., None])
        probs = torch.softmax(torch.cat(scores, dim=-1) / math.sqrt(d), dim=-1)
        out = torch.einsum("bhqk,bkhd->bqhd", probs[..., :n], values[0])
        for j, v_j in enumerate(diagonal):
            out = out + probs[..., n + j].permute(0, 2, 1)[..., None] * v_j
        residual = normed if cfg.norm_before_residual else hidden
        mid = residual + attn.o_proj(out.reshape(batch, n, h * d))
        state = mid + layer.mlp(layer.post_attention_layernorm(mid))
        final = head.norm(state)
        finals.append(final)
        # the next step's row q reads this step's row q - 1 (its parent on the chain)
        hidden = F.pad(final if cfg.norm_output else state, (0, 0, 1, 0))[:, :n]
    return finals


def _teacher_rows(head: Eagle3Head, teacher: torch.Tensor | None, data: Eagle3Data) -> torch.Tensor | None:
    """The teacher's LM-head rows of the head's draft vocabulary ``[draft_vocab, hidden]`` (None: no teacher)."""
    if teacher is None:
        return None
    if data.final is None:
        raise ValueError("a teacher needs the target's final hidden states: Eagle3Data.final (eagle3_examples keeps them)")
    cfg = head.config
    if teacher.dim() != 2 or teacher.shape[0] != cfg.vocab_size or teacher.shape[1] != data.final[0].shape[1]:
        raise ValueError(f"teacher must be the target's LM head [{cfg.vocab_size}, {data.final[0].shape[1]}], got "
                         f"{tuple(teacher.shape)}")
    return teacher.detach()[head.to_target(torch.arange(cfg.vocab_size_draft)).cpu()].float()


def _batch_loss(head: Eagle3Head, data: Eagle3Data, index: Sequence[int], vocab_index: torch.Tensor,
                steps: int, teacher: torch.Tensor | None, autocast: torch.dtype | None = None) -> torch.Tensor:
    feats, reads, targets, _, chose = data.batch(index, vocab_index, steps)
    # The head's GEMMs in ``autocast`` (entered per batch: autocast caches each weight's cast until its
    # context ends, so one context around the whole training would keep the first step's weights); the
    # teacher and the loss in float32.
    with torch.autocast("cpu", dtype=autocast or torch.bfloat16, enabled=autocast is not None):
        finals = ttt_forward(head, feats, reads, steps)
        logits_per_step = [head.logits(final[targets[s] >= 0]) for s, final in enumerate(finals)]
    total = torch.zeros(())
    first = targets[0] >= 0  # every step's rows are among step 1's: row q guesses token q + 2 at every step
    if teacher is not None:  # the target's distribution over the draft vocabulary, from the state that chose the token
        wanted = torch.softmax(chose[first].float() @ teacher.T, dim=-1)
    for s, logits in enumerate(logits_per_step):
        ok = targets[s] >= 0
        if not ok.any():
            continue
        if teacher is None:
            loss = F.cross_entropy(logits.float(), targets[s][ok])
        else:
            loss = -(wanted[ok[first]] * torch.log_softmax(logits.float(), dim=-1)).sum(-1).mean()
        total = total + STEP_WEIGHT ** s * loss
    return total


def train_eagle3(head: Eagle3Head, data: Eagle3Data, *, steps: int = 4, epochs: int = 4, batch_size: int = 8,
                 lr: float = 1e-3, seed: int = 0, state: TrainState | None = None, progress: Progress | None = None,
                 on_checkpoint: Callable[[TrainState], None] | None = None, checkpoint_s: float = 600.0,
                 teacher: torch.Tensor | None = None, autocast: torch.dtype | None = None) -> TrainState:
    """Fit ``head`` to ``data`` with the training-time test over ``steps`` draft steps (AdamW, cosine
    decay; embeddings frozen), ``batch_size`` sequences per update. ``teacher``: the target's LM head
    ``[vocab, hidden]``, to fit the target's distributions (needs ``data.final``); ``None``: its tokens.
    ``autocast=torch.bfloat16``: the head's forward and backward GEMMs in bfloat16 (``torch.autocast``,
    one context per batch), weights, optimizer and loss in float32: on a 2-core Zen 4 (AVX512-BF16) 1.6x
    as fast, with the same held-out loss on a small set (21.31 against 21.32); don't wrap the call in an
    autocast context of your own (its weight-cast cache would keep the first step's weights).

    Resumes from ``state`` at the batch where it stopped (shuffles are seeded per epoch, so a resumed
    run sees the same batches and ends bit-identical); ``on_checkpoint(state)`` after each epoch and
    every ``checkpoint_s`` seconds within one (``heads.fit``).
    """
    if not isinstance(data, Eagle3Data):
        raise TypeError(f"data must be Eagle3Data (from eagle3_examples), got {type(data).__name__}")
    for name, value in (("steps", steps), ("epochs", epochs), ("batch_size", batch_size)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    if autocast not in (None, torch.bfloat16):
        raise ValueError(f"autocast must be None (float32) or torch.bfloat16, got {autocast!r}")
    if torch.is_autocast_enabled("cpu"):
        raise ValueError("train_eagle3 runs under an autocast context: its weight-cast cache would keep the first "
                         "step's weights; pass autocast=torch.bfloat16 instead")
    vocab_index, rows = _vocab_index(head), _teacher_rows(head, teacher, data)
    head.train()
    state = fit([p for p in head.parameters() if p.requires_grad], len(data),
                lambda index: _batch_loss(head, data, index.tolist(), vocab_index, steps, rows, autocast), epochs=epochs,
                batch=batch_size, lr=lr, seed=seed, state=state, progress=progress, on_checkpoint=on_checkpoint,
                checkpoint_s=checkpoint_s)
    head.eval()
    return state


@torch.no_grad()
def eagle3_loss(head: Eagle3Head, data: Eagle3Data, *, steps: int = 4, batch_size: int = 8,
                teacher: torch.Tensor | None = None) -> float:
    """The training loss (step-weighted cross-entropy, against ``teacher``'s distributions when given)
    of ``head`` on ``data``, averaged over batches."""
    vocab_index, rows = _vocab_index(head), _teacher_rows(head, teacher, data)
    losses = [_batch_loss(head, data, range(i, min(i + batch_size, len(data))), vocab_index, steps, rows).item()
              for i in range(0, len(data), batch_size)]
    return sum(losses) / len(losses)


@torch.no_grad()
def eagle3_accuracy(head: Eagle3Head, data: Eagle3Data, *, steps: int = 4, batch_size: int = 8) -> list[float]:
    """Per draft step, the share of answer tokens the head's top-1 guess hits, every step fed the true
    tokens before it (the path a draft must match) and the head's own states; tokens outside the
    draft vocabulary count as misses."""
    vocab_index = _vocab_index(head)
    hits, count = torch.zeros(steps), torch.zeros(steps)
    for i in range(0, len(data), batch_size):
        feats, reads, targets, valid, _ = data.batch(range(i, min(i + batch_size, len(data))), vocab_index, steps)
        for s, final in enumerate(ttt_forward(head, feats, reads, steps)):
            best = head.logits(final).argmax(-1)
            hits[s] += ((best == targets[s]) & valid[s]).sum()
            count[s] += valid[s].sum()
    return (hits / count.clamp(min=1)).tolist()


def save_eagle3(head: Eagle3Head, folder: str | Path, *, target_layers: int, dtype: torch.dtype = torch.bfloat16,
                **metadata) -> Path:
    """Write ``head`` as an EAGLE-3 checkpoint folder: ``config.json`` (HF Llama fields, EAGLE-3's
    ``draft_vocab_size``; the aux boundaries only when they are not the defaults for a target of
    ``target_layers`` decoder layers, which every engine assumes, since engines disagree on how to
    count explicit ids: written ones count boundaries, vLLM's way) and ``model.safetensors``
    (``midlayer.*``, ``fc``, ``norm``, ``lm_head``, ``d2t``/``t2d``; no embeddings: the target's).
    ``metadata`` (how it was made) goes into ``config.json`` under ``treeattn``."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    cfg = head.config
    config = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_act": "silu",
              "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size, "num_hidden_layers": 1,
              "num_attention_heads": cfg.num_attention_heads, "num_key_value_heads": cfg.num_key_value_heads,
              "head_dim": cfg.dim, "vocab_size": cfg.vocab_size, "draft_vocab_size": cfg.vocab_size_draft,
              "rms_norm_eps": cfg.rms_norm_eps, "rope_theta": cfg.rope_theta, "rope_scaling": cfg.rope_scaling,
              "tie_word_embeddings": False, "torch_dtype": str(dtype).removeprefix("torch."), "treeattn": metadata}
    if cfg.aux_layers != default_aux_layers(target_layers):
        config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": list(cfg.aux_layers)}
    tensors = {}
    for name, value in head.state_dict().items():
        if name == "embed_tokens.weight":
            continue
        value = value if name in ("d2t", "t2d") else value.to(dtype)
        tensors[name.replace("layers.0.", "midlayer.")] = value.detach().contiguous().cpu()
    save_file(tensors, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return folder
