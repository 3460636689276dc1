"""The published EAGLE draft heads (EAGLE-1/2 and EAGLE-3) as modules with their own tree-aware KV cache.

Both heads are one Llama decoder layer that reads, per position ``p``, a feature vector of position
``p`` and the embedding of the token at ``p + 1``, and returns a state for ``p + 1`` from which the
next token is scored. They differ in what they read and how they score:

* ``Eagle3Head`` (vLLM ``llama_eagle3.py``, SGLang ``llama_eagle3.py``, EAGLE ``cnets.py``): a context
  row's feature is the concatenation of the target's hidden states at ``len(aux_layers)`` (default 3)
  layer boundaries, fused by ``fc`` (``3 * target_hidden -> hidden``, no bias); a draft row's is the
  head's own previous state (``hidden`` wide, no ``fc``). The layer attends over
  ``cat(input_layernorm(embed), hidden_norm(feature))`` (q/k/v projections ``2 * hidden`` wide), the
  residual is the un-normed feature (``norm_before_residual``: the normed one), then a SwiGLU MLP. The
  state fed back is the layer's output before the final ``norm``; the LM head reads ``norm(state)``
  over a ``draft_vocab_size`` vocabulary whose id ``i`` is target id ``i + d2t[i]``.
* ``EagleHead`` (EAGLE-1/2; vLLM ``llama_eagle.py``, EAGLE ``cnets1.py``): every row's feature is
  ``hidden`` wide (the target's final-norm hidden state for context rows, the head's output for draft
  rows), fused with the embedding by ``fc(cat(embed, feature))`` (``2 * hidden -> hidden``, bias as the
  checkpoint has it); one Llama layer without ``input_layernorm``; no final norm: the target's own LM
  head scores the output directly.

**Aux layers (EAGLE-3).** ``aux_layers`` are *boundary* indices: boundary ``i`` is the residual stream
entering decoder layer ``i`` (the output of layer ``i - 1``; 0 is the embeddings, ``N`` the last
layer's output before the final norm), i.e. HF's ``output_hidden_states[i]`` for ``i < N`` (HF's
``[N]`` is after the final norm: boundary ``N`` needs a hook on the last layer). The
default is ``(2, N // 2, N - 3)`` (EAGLE's ``modeling_llama_kv.py``, vLLM's
``get_eagle3_default_aux_hidden_state_layers``, SGLang's default), and features are concatenated in
ascending boundary order, as all three capture them in their layer loops.

**Positions.** Row ``p`` pairs feature ``p`` with token ``p + 1`` and sits at RoPE position ``p`` (vLLM
shifts the input ids left and keeps the target positions; EAGLE numbers the shifted rows from 0). A
sequence whose ``L`` context rows are cached puts a draft node at ``L + depth`` (first-level nodes at
depth 0), as EAGLE's ``topK_genrate`` does.

**Cache.** ``HeadKVCache`` keeps, per sequence, a dense K/V buffer: the committed context rows, then
the current draft tree. A context append (``tree_parents=None``) discards the draft tree (its rows were
computed from drafted states, not target features) and appends causally; a tree append adds nodes
that see every committed row plus their own ancestors in the tree (EAGLE's ``tree_mask``). Attention
runs through ``treeattn.tree_attention`` (a context append is a chain).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ..checks import int_vector
from ..ops import tree_attention
from ..plan import TreeAttentionPlan
from ..tree import chain_chunks, encode_trees

__all__ = ["Eagle3Head", "EagleHead", "HeadConfig", "HeadKVCache", "HeadOutput", "default_aux_layers"]

_ROPE_TYPES = ("default", "linear", "llama3")


def default_aux_layers(num_target_layers: int) -> tuple[int, ...]:
    """EAGLE-3's default boundaries ``(2, N // 2, N - 3)`` for a target of ``N`` decoder layers."""
    n = num_target_layers
    return (2, n // 2, n - 3)


@dataclass(frozen=True)
class HeadConfig:
    """The shape of a draft head, in the field names of HF's ``LlamaConfig``.

    ``vocab_size`` is the target's vocabulary. EAGLE-3 only: ``draft_vocab_size`` (``None``: the
    target's), ``target_hidden_size`` (``None``: ``hidden_size``), ``aux_layers`` (boundary indices,
    see the module doc; ``None``: the defaults for the target's depth, fixed when the head meets
    it), ``num_aux`` (how many feature vectors a context row concatenates), the variant flags vLLM
    reads (``norm_before_residual``, ``norm_before_fc``, ``fc_norm``, ``norm_output``) and
    ``logit_scale``. EAGLE-1/2 only: ``fc_bias``. Both: ``qkv_bias`` / ``o_bias`` (vLLM's
    ``attention_bias`` gives both, EAGLE's ``qkv_bias`` the first).
    ``rope_scaling`` may be ``None`` or of type ``linear`` or ``llama3`` (HF's formulas).
    """

    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int
    head_dim: int | None = None
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: Mapping | None = None
    draft_vocab_size: int | None = None
    target_hidden_size: int | None = None
    aux_layers: tuple[int, ...] | None = None
    num_aux: int = 3
    norm_before_residual: bool = False
    norm_before_fc: bool = False
    fc_norm: bool = False
    norm_output: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    logit_scale: float = 1.0
    fc_bias: bool = True

    def __post_init__(self):
        for name in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "vocab_size",
                     "num_aux"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                             f"num_key_value_heads ({self.num_key_value_heads})")
        if self.head_dim is None and self.hidden_size % self.num_attention_heads:
            raise ValueError(f"hidden_size ({self.hidden_size}) must be a multiple of num_attention_heads "
                             f"({self.num_attention_heads}) when head_dim is not given")
        if not 1 <= self.vocab_size_draft <= self.vocab_size:
            raise ValueError(f"draft_vocab_size must be in [1, vocab_size = {self.vocab_size}], got {self.draft_vocab_size}")
        if self.aux_layers is not None:
            if len(self.aux_layers) != self.num_aux or len(set(self.aux_layers)) != len(self.aux_layers):
                raise ValueError(f"aux_layers must be {self.num_aux} distinct boundary indices, got {self.aux_layers}")
            object.__setattr__(self, "aux_layers", tuple(sorted(int(i) for i in self.aux_layers)))
        _inv_freq(self.dim, self.rope_theta, self.rope_scaling)  # reject an unsupported RoPE now, not at the first forward

    @property
    def dim(self) -> int:
        """Attention head dim."""
        return self.head_dim or self.hidden_size // self.num_attention_heads

    @property
    def vocab_size_draft(self) -> int:
        return self.vocab_size if self.draft_vocab_size is None else self.draft_vocab_size

    @property
    def feature_size(self) -> int:
        """Width of an EAGLE-3 context row's feature: ``num_aux * target_hidden_size``."""
        return self.num_aux * (self.target_hidden_size or self.hidden_size)


def _inv_freq(dim: int, theta: float, scaling: Mapping | None) -> torch.Tensor:
    """HF's float32 inverse frequencies (``_compute_default/linear/llama3_parameters``)."""
    if dim % 2:
        raise ValueError(f"RoPE needs an even head dim, got {dim}")
    inv = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    kind = None if not scaling else scaling.get("rope_type", scaling.get("type", "default"))
    if kind in (None, "default"):
        return inv
    if kind == "linear":
        return inv / float(scaling["factor"])
    if kind == "llama3":
        factor, low, high = (float(scaling[k]) for k in ("factor", "low_freq_factor", "high_freq_factor"))
        old_len = float(scaling["original_max_position_embeddings"])
        wavelen = 2 * torch.pi / inv
        scaled = torch.where(wavelen > old_len / low, inv / factor, inv)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        return torch.where(medium, smoothed, scaled)
    raise ValueError(f"rope_scaling type {kind!r} is not supported by the draft heads; expected one of "
                     f"{', '.join(_ROPE_TYPES)} (dynamic/yarn/longrope heads are not implemented)")


def _rope(positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cos, sin)`` ``[R, 1, d]`` for ``positions [R]``, computed in float32 as HF and vLLM, then cast."""
    freqs = positions.to(torch.float32)[:, None] * inv_freq.to(positions.device)[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]
    return emb.cos().to(dtype), emb.sin().to(dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE of ``x [R, heads, d]`` by its rows' ``_rope``."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class RMSNorm(nn.Module):
    """Llama's RMSNorm: normalise in float32, cast back, then scale (HF ``LlamaRMSNorm``)."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * F.rms_norm(x.float(), x.shape[-1:], eps=self.eps).to(x.dtype)


class _Attention(nn.Module):
    def __init__(self, cfg: HeadConfig, in_size: int):
        super().__init__()
        d = cfg.dim
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, d
        self.q_proj = nn.Linear(in_size, self.num_heads * d, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(in_size, self.num_kv_heads * d, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(in_size, self.num_kv_heads * d, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(self.num_heads * d, cfg.hidden_size, bias=cfg.o_bias)
        # A plain float32 tensor, not a buffer: module.to(bfloat16) must not round the frequencies.
        self.inv_freq = _inv_freq(d, cfg.rope_theta, cfg.rope_scaling)
        self._rope_table: tuple[torch.Tensor, torch.Tensor] | None = None
        self.qkv_proj: nn.Linear | None = None  # fuse()

    def fuse(self) -> None:
        """Compute q, k and v in one product (``qkv_proj``, the three dropped), for inference."""
        if self.qkv_proj is not None:  # fused already
            return
        self.qkv_proj = _stacked(self.q_proj, self.k_proj, self.v_proj)
        del self.q_proj, self.k_proj, self.v_proj

    def rope(self, step: _Step, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``_rope`` of the step's positions, read from a table of every position below the step's end
        (kept, grown by doubling): a drafting level rotates a few rows, where computing their angles
        took a dozen small ops. The table's rows are ``_rope``'s own, bit for bit."""
        table = self._rope_table
        if table is None or table[0].shape[0] < step.end or table[0].dtype != dtype or \
                table[0].device != step.positions.device:
            size = max(step.end, 256, 0 if table is None else 2 * table[0].shape[0])
            table = self._rope_table = _rope(torch.arange(size, device=step.positions.device), self.inv_freq, dtype)
        return table[0][step.positions], table[1][step.positions]

    def forward(self, x: torch.Tensor, cache: HeadKVCache, step: _Step) -> torch.Tensor:
        rows, d = x.shape[0], self.head_dim
        rope = self.rope(step, x.dtype)  # once for q and k
        if self.qkv_proj is None:
            q = _rotate(self.q_proj(x).view(rows, self.num_heads, d), *rope)
            k = _rotate(self.k_proj(x).view(rows, self.num_kv_heads, d), *rope)
            v = self.v_proj(x).view(rows, self.num_kv_heads, d)
        else:  # q and k side by side: one rotation
            qk, v = self.qkv_proj(x).split([(self.num_heads + self.num_kv_heads) * d, self.num_kv_heads * d], dim=-1)
            q, k = _rotate(qk.view(rows, self.num_heads + self.num_kv_heads, d), *rope).split(
                [self.num_heads, self.num_kv_heads], dim=1)
            v = v.view(rows, self.num_kv_heads, d)
        return self.o_proj(cache.attend(step, q, k, v).reshape(rows, self.num_heads * d))


class _MLP(nn.Module):
    def __init__(self, cfg: HeadConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.gate_up_proj: nn.Linear | None = None  # fuse()

    def fuse(self) -> None:
        """Compute gate and up in one product (``gate_up_proj``, the two dropped), for inference."""
        if self.gate_up_proj is not None:  # fused already
            return
        self.gate_up_proj = _stacked(self.gate_proj, self.up_proj)
        del self.gate_proj, self.up_proj

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up_proj is None:
            return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


def _stacked(*linears: nn.Linear) -> nn.Linear:
    """One frozen linear layer computing ``linears`` (same input) side by side, their outputs
    concatenated (vLLM's ``QKVParallelLinear`` / ``MergedColumnParallelLinear``): a drafting level runs
    each product on a few rows, where every call costs about as much as its arithmetic."""
    weight = torch.cat([linear.weight.detach() for linear in linears])
    stacked = nn.Linear(weight.shape[1], weight.shape[0], bias=linears[0].bias is not None, device="meta")
    stacked.weight = nn.Parameter(weight, requires_grad=False)
    if stacked.bias is not None:
        stacked.bias = nn.Parameter(torch.cat([linear.bias.detach() for linear in linears]), requires_grad=False)
    return stacked


class _Layer(nn.Module):
    """The head's decoder layer. EAGLE-3's reads ``cat(input_layernorm(embed), hidden_norm(h))``;
    EAGLE-1's reads ``h`` as it is (its first layer has no ``input_layernorm``)."""

    def __init__(self, cfg: HeadConfig, eagle3: bool):
        super().__init__()
        h = cfg.hidden_size
        self.self_attn = _Attention(cfg, 2 * h if eagle3 else h)
        self.mlp = _MLP(cfg)
        if eagle3:
            self.input_layernorm = RMSNorm(h, cfg.rms_norm_eps)
            self.hidden_norm = RMSNorm(h, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(h, cfg.rms_norm_eps)

    def forward(self, attn_in: torch.Tensor, residual: torch.Tensor, cache: HeadKVCache, step: _Step) -> torch.Tensor:
        h = residual + self.self_attn(attn_in, cache, step)
        return h + self.mlp(self.post_attention_layernorm(h))


@dataclass(frozen=True)
class HeadOutput:
    """``hidden [R, H]``: the state a child row reads as its feature; ``final [R, H]``: what the LM
    head reads (``head.logits(out.final)``)."""

    hidden: torch.Tensor
    final: torch.Tensor


class _DraftHead(nn.Module):
    """What both heads share: the cache protocol, input checks and the draft -> target id map."""

    def __init__(self, cfg: HeadConfig, eagle3: bool):
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList([_Layer(cfg, eagle3)])

    def fuse_projections(self) -> None:
        """Stack the layer's q/k/v and gate/up projections into one product each, for inference (a
        drafting copy): the head then no longer saves, loads or trains by its checkpoint's names."""
        for layer in self.layers:
            layer.self_attn.fuse()
            layer.mlp.fuse()

    @property
    def compute_dtype(self) -> torch.dtype:
        """What the layer computes in: its weights' dtype (the embeddings, the target's, may differ)."""
        return self.fc.weight.dtype

    def new_cache(self, *, backend: str | None = None) -> HeadKVCache:
        """An empty ``HeadKVCache`` in this head's compute dtype and device."""
        w = self.fc.weight
        return HeadKVCache(self.config.num_key_value_heads, self.config.dim, dtype=w.dtype, device=w.device,
                           backend=backend)

    def _inputs(self, cache, seq_ids, hidden, token_ids, append_lengths, tree_parents, feature_size):
        if not isinstance(cache, HeadKVCache):
            raise TypeError(f"cache must be a HeadKVCache (head.new_cache()), got {type(cache).__name__}")
        step = cache.prepare(seq_ids, append_lengths, tree_parents)
        rows = int(step.lengths.sum())
        if not isinstance(hidden, torch.Tensor) or hidden.dim() != 2 or tuple(hidden.shape) != (rows, feature_size):
            what = "target features" if tree_parents is None else "the head's own states (HeadOutput.hidden)"
            got = tuple(hidden.shape) if isinstance(hidden, torch.Tensor) else type(hidden).__name__
            raise ValueError(f"hidden must be [{rows}, {feature_size}] ({what}), got {got}")
        ids = torch.as_tensor(token_ids)
        if ids.dim() != 1 or ids.shape[0] != rows or ids.is_floating_point():
            raise ValueError(f"token_ids must be {rows} integer ids (the token after each row's position), "
                             f"got shape {tuple(ids.shape)} ({ids.dtype})")
        if rows and (int(ids.min()) < 0 or int(ids.max()) >= self.config.vocab_size):
            raise ValueError(f"token_ids must be target ids in [0, {self.config.vocab_size}), got "
                             f"{int(ids.min())}..{int(ids.max())}")
        w = self.fc.weight
        embeds = self.embed_tokens(ids.to(device=self.embed_tokens.weight.device, dtype=torch.long))
        return step, hidden.to(w.dtype), embeds.to(device=w.device, dtype=w.dtype)


class Eagle3Head(_DraftHead):
    """An EAGLE-3 draft head (module doc); parameter names are vLLM's after its ``midlayer.`` ->
    ``layers.0.`` mapping, with q/k/v and gate/up unstacked as in HF checkpoints."""

    def __init__(self, cfg: HeadConfig):
        super().__init__(cfg, eagle3=True)
        target_hidden = cfg.target_hidden_size or cfg.hidden_size
        if cfg.norm_before_fc:
            self.input_norm = RMSNorm(cfg.feature_size, cfg.rms_norm_eps)
        if cfg.fc_norm:
            self.fc_norm = nn.ModuleList(RMSNorm(target_hidden, cfg.rms_norm_eps) for _ in range(cfg.num_aux))
        self.fc = nn.Linear(cfg.feature_size, cfg.hidden_size, bias=False)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size_draft, bias=False)
        # Both engines map draft ids only when the draft vocabulary is smaller (EAGLE deletes d2t/t2d otherwise).
        if cfg.vocab_size_draft < cfg.vocab_size:
            self.register_buffer("d2t", torch.zeros(cfg.vocab_size_draft, dtype=torch.long))
            self.register_buffer("t2d", torch.zeros(cfg.vocab_size, dtype=torch.bool))

    def fuse(self, features: torch.Tensor) -> torch.Tensor:
        """``[R, num_aux * target_hidden]`` target features -> ``[R, hidden]`` (vLLM ``combine_hidden_states``)."""
        if self.config.norm_before_fc:
            features = self.input_norm(features)
        if self.config.fc_norm:
            chunks = features.chunk(self.config.num_aux, dim=-1)
            features = torch.cat([norm(c) for norm, c in zip(self.fc_norm, chunks)], dim=-1)
        return self.fc(features)

    def forward(self, cache: HeadKVCache, seq_ids: Sequence, hidden: torch.Tensor, token_ids,
                append_lengths: Sequence[int], tree_parents: Sequence | None = None) -> HeadOutput:
        """Append rows for ``seq_ids`` (packed, ``append_lengths[b]`` each) and run the head on them.

        Context rows (``tree_parents=None``): ``hidden`` holds the target features of positions
        ``L .. L + a - 1`` (``config.feature_size`` wide, the ``aux_layers`` boundaries concatenated in
        ascending order) and ``token_ids`` the tokens at ``L + 1 .. L + a``; they are committed.
        Draft rows: ``tree_parents[b]`` gives each new node's parent index in the sequence's draft tree
        (existing nodes first; -1 = a first-level node), ``hidden`` the parent's ``HeadOutput.hidden``
        (for a first-level node: the last context row's) and ``token_ids`` the node's drafted token.
        """
        step, hidden, embeds = self._inputs(cache, seq_ids, hidden, token_ids, append_lengths, tree_parents,
                                            self.config.feature_size if tree_parents is None else self.config.hidden_size)
        if tree_parents is None:
            hidden = self.fuse(hidden)
        layer = self.layers[0]
        normed = layer.hidden_norm(hidden)
        residual = normed if self.config.norm_before_residual else hidden
        out = layer(torch.cat((layer.input_layernorm(embeds), normed), dim=-1), residual, cache, step)
        final = self.norm(out)
        return HeadOutput(final if self.config.norm_output else out, final)

    def logits(self, final: torch.Tensor) -> torch.Tensor:
        """float32 ``[R, draft_vocab_size]`` logits (draft ids; ``to_target`` maps them)."""
        logits = self.lm_head(final).float()
        return logits if self.config.logit_scale == 1.0 else logits * self.config.logit_scale

    def to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Target token ids of draft ids: ``i + d2t[i]`` (the identity when the vocabularies agree)."""
        if not hasattr(self, "d2t"):
            return draft_ids
        return draft_ids + self.d2t[draft_ids]

    def target_logits(self, final: torch.Tensor) -> torch.Tensor:
        """float32 ``[R, vocab_size]`` logits over target ids, ``-inf`` outside the draft vocabulary
        (vLLM's ``compute_logits``)."""
        logits = self.logits(final)
        if not hasattr(self, "d2t"):
            return logits
        full = logits.new_full((logits.shape[0], self.config.vocab_size), float("-inf"))
        full[:, self.to_target(torch.arange(logits.shape[1], device=logits.device))] = logits
        return full


class EagleHead(_DraftHead):
    """An EAGLE-1/2 draft head (module doc); ``lm_head`` is the target's, set by the loader."""

    def __init__(self, cfg: HeadConfig):
        super().__init__(cfg, eagle3=False)
        self.fc = nn.Linear(2 * cfg.hidden_size, cfg.hidden_size, bias=cfg.fc_bias)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def forward(self, cache: HeadKVCache, seq_ids: Sequence, hidden: torch.Tensor, token_ids,
                append_lengths: Sequence[int], tree_parents: Sequence | None = None) -> HeadOutput:
        """As ``Eagle3Head.forward``, except that a context row's feature is the target's final-norm
        hidden state (``hidden_size`` wide) and both kinds of row go through ``fc``."""
        step, hidden, embeds = self._inputs(cache, seq_ids, hidden, token_ids, append_lengths, tree_parents,
                                            self.config.hidden_size)
        x = self.fc(torch.cat((embeds, hidden), dim=-1))
        out = self.layers[0](x, x, cache, step)
        return HeadOutput(out, out)

    def logits(self, final: torch.Tensor) -> torch.Tensor:
        """float32 ``[R, vocab_size]`` logits from the target's LM head (which may be in another dtype)."""
        return self.lm_head(final.to(self.lm_head.weight.dtype)).float()

    def to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """EAGLE-1 drafts in the target's vocabulary: the identity."""
        return draft_ids

    target_logits = logits


@dataclass
class _Seq:
    k: torch.Tensor  # [capacity, h_kv, d], RoPE applied
    v: torch.Tensor
    length: int = 0  # committed context rows
    parents: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))  # the current draft tree


@dataclass(frozen=True)
class _Step:
    """A validated append, not yet applied: ``HeadKVCache.attend`` applies it."""

    seqs: list
    lengths: np.ndarray
    trees: list | None  # per sequence, the whole draft tree after the append (None: context rows)
    encoded: tuple[np.ndarray, np.ndarray] | None  # the trees' (tree_indptr, tree_order), from encode_trees
    positions: torch.Tensor
    end: int  # one past the largest position


class HeadKVCache:
    """A draft head's K/V per sequence: committed context rows, then the current draft tree (module doc)."""

    def __init__(self, num_kv_heads: int, head_dim: int, *, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu", backend: str | None = None):
        self.num_kv_heads, self.head_dim = num_kv_heads, head_dim
        self.dtype, self.device, self.backend = dtype, torch.device(device), backend
        self._seqs: dict = {}

    def add_sequence(self, seq_id) -> None:
        if seq_id in self._seqs:
            raise ValueError(f"sequence {seq_id!r} is already in the cache")
        empty = torch.zeros(0, self.num_kv_heads, self.head_dim, dtype=self.dtype, device=self.device)
        self._seqs[seq_id] = _Seq(empty, empty.clone())

    def remove_sequence(self, seq_id) -> None:
        self._seq(seq_id)
        del self._seqs[seq_id]

    def seq_len(self, seq_id) -> int:
        """Committed context rows of ``seq_id``."""
        return self._seq(seq_id).length

    def tree_parents(self, seq_id) -> np.ndarray:
        """The parent array of ``seq_id``'s current draft tree (-1: a first-level node)."""
        return self._seq(seq_id).parents.copy()

    def _seq(self, seq_id) -> _Seq:
        try:
            return self._seqs[seq_id]
        except (KeyError, TypeError):
            raise KeyError(f"sequence {seq_id!r} is not in the cache (add_sequence first)") from None

    def prepare(self, seq_ids: Sequence, append_lengths: Sequence[int], tree_parents: Sequence | None) -> _Step:
        """Check an append and compute its rows' positions; nothing changes until ``attend``."""
        seq_ids = list(seq_ids)
        if len(set(seq_ids)) != len(seq_ids):
            raise ValueError(f"seq_ids must be distinct, got {seq_ids}")
        seqs = [self._seq(s) for s in seq_ids]
        lengths = int_vector(append_lengths, "append_lengths")
        if lengths.shape[0] != len(seqs) or (lengths < 0).any():
            raise ValueError(f"append_lengths must hold {len(seqs)} counts >= 0 (one per sequence), got {lengths.tolist()}")
        if tree_parents is None:
            positions = [np.arange(s.length, s.length + n) for s, n in zip(seqs, lengths)]
            return _Step(seqs, lengths, None, None, *_positions(positions, self.device))
        if len(tree_parents) != len(seqs):
            raise ValueError(f"tree_parents must hold one parent array per sequence ({len(seqs)}), got {len(tree_parents)}")
        trees = []
        for b, (s, n, new) in enumerate(zip(seqs, lengths, tree_parents)):
            new = int_vector(new, f"tree_parents[{b}]")
            if new.shape[0] != n:
                raise ValueError(f"tree_parents[{b}] has {new.shape[0]} entries, append_lengths[{b}] = {n}")
            old = s.parents.shape[0]
            bad = np.flatnonzero((new < -1) | (new >= old + np.arange(n)))
            if bad.size:
                i = int(bad[0])
                raise ValueError(f"tree_parents[{b}][{i}] = {int(new[i])}: a parent must be -1 or an earlier node of the "
                                 f"draft tree, index < {old + i} ({old} nodes drafted before this append)")
            trees.append(np.concatenate([s.parents, new]))
        indptr, order, depth = encode_trees(trees, "tree_parents")  # one pass for the batch, reused by attend
        positions = [s.length + depth[indptr[b] + s.parents.shape[0]:indptr[b + 1]] for b, s in enumerate(seqs)]
        return _Step(seqs, lengths, trees, (indptr, order), *_positions(positions, self.device))

    def attend(self, step: _Step, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Store the step's rows' K/V (RoPE applied) and attend: ``q [R, h_q, d]`` -> ``[R, h_q, d]``."""
        keys, values, orders, q_indptr, kv_indptr = [], [], [], [0], [0]
        start = 0
        for b, (s, n) in enumerate(zip(step.seqs, step.lengths.tolist())):
            if step.trees is None:  # context rows: drop the draft tree, append causally and commit
                s.parents = s.parents[:0]
                at = s.length
                s.length += n
                requests = chain_chunks(n)  # a long prompt's first append: chains, each seeing the rows before it
            else:
                at, s.parents = s.length + s.parents.shape[0], step.trees[b]
                indptr, encoded = step.encoded
                requests = [(0, encoded[indptr[b]:indptr[b + 1]])] if n else []
            _reserve(s, at + n)
            s.k[at:at + n], s.v[at:at + n] = k[start:start + n], v[start:start + n]
            start += n
            for lo, order in requests:
                rows = min(n - lo, order.shape[0])  # a tree's query rows are its last n nodes
                total = at + lo + rows
                keys.append(s.k[:total])
                values.append(s.v[:total])
                orders.append(order)
                q_indptr.append(q_indptr[-1] + rows)
                kv_indptr.append(kv_indptr[-1] + total)
        if not orders:
            return q.new_zeros(q.shape)
        # The cache built these arrays from appends it checked: planned without tree_attention's checks.
        plan = TreeAttentionPlan._ragged_unchecked(np.array(q_indptr), np.array(kv_indptr),
                                                   np.cumsum([0] + [len(o) for o in orders]), np.concatenate(orders),
                                                   q.device)
        # One sequence (drafting for one request) attends to its buffer's rows in place.
        keys, values = (keys[0], values[0]) if len(keys) == 1 else (torch.cat(keys), torch.cat(values))
        out, _ = tree_attention(q, None, keys, values, None, None, None, backend=self.backend, plan=plan)
        return out


def _positions(parts: list, device: torch.device) -> tuple[torch.Tensor, int]:
    """The rows' positions on ``device`` and one past the largest (0 for none)."""
    positions = np.concatenate(parts).astype(np.int64) if parts else np.zeros(0, np.int64)
    return torch.from_numpy(positions).to(device), int(positions.max()) + 1 if positions.size else 0


def _reserve(s: _Seq, rows: int) -> None:
    """Grow ``s``'s buffers to hold ``rows`` (doubling, so appends cost amortised O(1) copies per row)."""
    if rows <= s.k.shape[0]:
        return
    cap = max(rows, 2 * s.k.shape[0], 16)
    for name in ("k", "v"):
        old = getattr(s, name)
        new = old.new_zeros((cap, *old.shape[1:]))
        new[:old.shape[0]] = old
        setattr(s, name, new)
