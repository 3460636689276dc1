"""A compact Llama-family decoder whose attention runs through ``treeattn.PagedKVCache``.

Covers Llama 2/3 (incl. llama3 RoPE scaling), SmolLM, Mistral-style GQA without sliding window,
Qwen2 (q/k/v biases) and Qwen3 (per-head q/k RMSNorm). Weights come from a Hugging Face
``transformers`` model or its state dict (GGUF files load through
``AutoModelForCausalLM.from_pretrained(dir, gguf_file=...)``, which dequantises them).

One ``forward`` runs a batch of sequences, each appending either a causal chunk (prefill, plain
decoding) or a draft tree (``tree_parents``), as one packed ``[sum(lengths), hidden]`` activation:
every matmul sees all tokens of the batch at once and only attention is per sequence (the cache's
tree kernels). Per forward, RoPE cos/sin are computed once for all layers.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..kvcache import ForwardInfo, PagedKVCache
from ..rope import RoPE

__all__ = ["LlamaConfig", "LlamaTreeModel", "ModelOutput", "rope_from_hf"]

Attention = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def rope_from_hf(config) -> RoPE:
    """``treeattn.RoPE`` for an HF config (``rope_parameters`` in transformers 5, ``rope_theta`` /
    ``rope_scaling`` before). Supported: default, linear and llama3 scaling, which match HF exactly;
    others differ between HF and TVM (yarn's attention factor, dynamic NTK) and are refused."""
    partial = getattr(config, "partial_rotary_factor", None)
    if partial is None:
        partial = (getattr(config, "rope_parameters", None) or {}).get("partial_rotary_factor")
    if partial is not None and partial != 1.0:  # RoPE here rotates the whole head dim, as TVM's kernels do
        raise ValueError(f"partial_rotary_factor = {partial} is not supported (RoPE rotates the full head dim)")
    params = dict(getattr(config, "rope_parameters", None) or {})
    if not params:
        params = dict(getattr(config, "rope_scaling", None) or {})
        params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    theta = float(params.pop("rope_theta", getattr(config, "rope_theta", 10000.0)))
    kind = params.get("rope_type", params.get("type", "default")) or "default"
    if kind == "default":
        return RoPE(theta)
    if kind == "linear":
        return RoPE(theta, scale=1.0 / float(params["factor"]))
    if kind == "llama3":
        keys = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
        return RoPE(theta, scaling={"rope_type": "llama3", **{k: params[k] for k in keys}})
    raise ValueError(f"rope_type {kind!r} is not supported by LlamaTreeModel (supported: default, linear, llama3)")


@dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope: RoPE

    @classmethod
    def from_hf(cls, config) -> LlamaConfig:
        window = getattr(config, "sliding_window", None) if getattr(config, "use_sliding_window", True) else None
        if window:
            raise ValueError(f"sliding-window attention (sliding_window={window}) is not supported")
        act = getattr(config, "hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"hidden_act {act!r} is not supported (Llama-family models use silu)")
        heads = config.num_attention_heads
        return cls(
            vocab_size=config.vocab_size,
            hidden_size=config.hidden_size,
            num_layers=config.num_hidden_layers,
            num_heads=heads,
            num_kv_heads=getattr(config, "num_key_value_heads", None) or heads,
            head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
            intermediate_size=config.intermediate_size,
            rms_norm_eps=float(config.rms_norm_eps),
            rope=rope_from_hf(config),
        )


@dataclass(frozen=True)
class _Layer:
    """One decoder layer; projection weights are stored transposed, ``[in, out]`` (see ``_linear``)."""

    attn_norm: torch.Tensor
    qkv: torch.Tensor  # q, k and v projections stacked: one matmul
    qkv_bias: torch.Tensor | None
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    o: torch.Tensor
    o_bias: torch.Tensor | None
    mlp_norm: torch.Tensor
    gate_up: torch.Tensor  # gate and up projections stacked: one matmul
    gate_up_bias: torch.Tensor | None
    down: torch.Tensor
    down_bias: torch.Tensor | None


@dataclass(frozen=True)
class ModelOutput:
    """``logits [R, V]`` (float32) and final-norm ``hidden [R, hidden_size]`` of the requested rows."""

    logits: torch.Tensor
    hidden: torch.Tensor


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # HF's order of operations: normalise in fp32, round to the activation dtype, then scale.
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def _linear(x: torch.Tensor, weight_t: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ weight_t (+ bias)`` with the weight stored ``[in, out]``: for the few-row activations
    of decoding (1 to ~32 tokens) MKL's sgemm runs 10-30% faster on this layout than on
    ``F.linear``'s ``[out, in]`` (measured on SmolLM2's shapes, 1-2 threads)."""
    return x @ weight_t if bias is None else torch.addmm(bias, x, weight_t)


def _cat_or_none(tensors: Sequence[torch.Tensor | None], sizes: Sequence[int], like: torch.Tensor) -> torch.Tensor | None:
    if all(t is None for t in tensors):
        return None
    return torch.cat([like.new_zeros(n) if t is None else t for t, n in zip(tensors, sizes)])


class LlamaTreeModel:
    """Llama-family decoder for tree speculative decoding; attention through a ``PagedKVCache``.

    ``weights`` uses Hugging Face parameter names (``model.layers.{i}.self_attn.q_proj.weight``, ...).
    """

    def __init__(self, config: LlamaConfig, weights: Mapping[str, torch.Tensor], *, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu"):
        self.config, self.dtype, self.device = config, dtype, torch.device(device)
        c = config

        def get(name: str, required: bool = True) -> torch.Tensor | None:
            t = weights.get(name)
            if t is None:
                if required:
                    raise ValueError(f"weights has no {name!r}")
                return None
            return t.detach().to(device=self.device, dtype=dtype).contiguous()

        self.embed = get("model.embed_tokens.weight")
        if tuple(self.embed.shape) != (c.vocab_size, c.hidden_size):
            raise ValueError(f"model.embed_tokens.weight has shape {tuple(self.embed.shape)}, "
                             f"expected {(c.vocab_size, c.hidden_size)}")
        lm_head = get("lm_head.weight", required=False)
        self.lm_head_t = (self.embed if lm_head is None else lm_head).t().contiguous()  # tied: a transposed copy
        self.final_norm = get("model.norm.weight")
        qkv_sizes = (c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.num_kv_heads * c.head_dim)
        self.layers: list[_Layer] = []
        for i in range(c.num_layers):
            p = f"model.layers.{i}."
            attn = [p + f"self_attn.{n}_proj" for n in "qkv"]
            mlp = [p + "mlp.gate_proj", p + "mlp.up_proj"]
            qkv = torch.cat([get(n + ".weight") for n in attn]).t().contiguous()
            if qkv.shape[1] != sum(qkv_sizes):
                raise ValueError(f"layer {i}: q/k/v projections have {qkv.shape[1]} rows, expected {sum(qkv_sizes)}")
            self.layers.append(_Layer(
                attn_norm=get(p + "input_layernorm.weight"),
                qkv=qkv,
                qkv_bias=_cat_or_none([get(n + ".bias", False) for n in attn], qkv_sizes, qkv),
                q_norm=get(p + "self_attn.q_norm.weight", False),
                k_norm=get(p + "self_attn.k_norm.weight", False),
                o=get(p + "self_attn.o_proj.weight").t().contiguous(),
                o_bias=get(p + "self_attn.o_proj.bias", False),
                mlp_norm=get(p + "post_attention_layernorm.weight"),
                gate_up=torch.cat([get(n + ".weight") for n in mlp]).t().contiguous(),
                gate_up_bias=_cat_or_none([get(n + ".bias", False) for n in mlp], (c.intermediate_size,) * 2, qkv),
                down=get(p + "mlp.down_proj.weight").t().contiguous(),
                down_bias=get(p + "mlp.down_proj.bias", False),
            ))

    # ------------------------------------------------------------------ construction

    @classmethod
    def from_hf(cls, model, *, dtype: torch.dtype | None = None, device: torch.device | str | None = None) -> LlamaTreeModel:
        """From a ``transformers`` causal LM (``LlamaForCausalLM``, ``Qwen2ForCausalLM``, ...)."""
        first = next(model.parameters())
        return cls(LlamaConfig.from_hf(model.config), model.state_dict(), dtype=dtype or first.dtype,
                   device=device or first.device)

    @classmethod
    def from_pretrained(cls, path: str, *, gguf_file: str | None = None, dtype: torch.dtype = torch.float32,
                        device: torch.device | str = "cpu") -> LlamaTreeModel:
        """Load with ``transformers.AutoModelForCausalLM`` (local files; GGUF via ``gguf_file``)."""
        from transformers import AutoModelForCausalLM

        kwargs = {"gguf_file": gguf_file} if gguf_file else {}
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **kwargs)
        return cls.from_hf(hf, dtype=dtype, device=device)

    def new_cache(self, num_pages: int, *, page_size: int = 16, backend: str | None = None) -> PagedKVCache:
        c = self.config
        return PagedKVCache(c.num_layers, c.num_kv_heads, c.head_dim, num_pages=num_pages, page_size=page_size,
                            dtype=self.dtype, device=self.device, backend=backend, num_q_heads=c.num_heads)

    # ------------------------------------------------------------------ compute

    def hidden_states(self, input_ids: torch.Tensor, positions: torch.Tensor, attention: Attention) -> torch.Tensor:
        """Final-norm hidden states ``[T, hidden]`` of packed tokens at RoPE ``positions``.

        ``attention(layer, q, k, v)`` gets RoPE'd ``q [T, h_q, d]``, ``k/v [T, h_kv, d]`` and returns
        ``[T, h_q, d]``: ``PagedKVCache.attention`` in ``forward``, any dense attention in tests.
        """
        c = self.config
        t = input_ids.shape[0]
        nq, nkv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        cos, sin = c.rope.cos_sin(positions.to(self.device), c.head_dim)
        x = F.embedding(input_ids.to(self.device), self.embed)
        for i, layer in enumerate(self.layers):
            h = _rms_norm(x, layer.attn_norm, c.rms_norm_eps)
            qkv = _linear(h, layer.qkv, layer.qkv_bias)
            q = qkv[:, :nq].view(t, c.num_heads, c.head_dim)
            k = qkv[:, nq:nq + nkv].view(t, c.num_kv_heads, c.head_dim)
            v = qkv[:, nq + nkv:].reshape(t, c.num_kv_heads, c.head_dim)
            if layer.q_norm is not None:
                q = _rms_norm(q, layer.q_norm, c.rms_norm_eps)
            if layer.k_norm is not None:
                k = _rms_norm(k, layer.k_norm, c.rms_norm_eps)
            attn = attention(i, RoPE.rotate(q, cos, sin), RoPE.rotate(k, cos, sin), v)
            x = x + _linear(attn.reshape(t, nq), layer.o, layer.o_bias)
            h = _rms_norm(x, layer.mlp_norm, c.rms_norm_eps)
            gate_up = _linear(h, layer.gate_up, layer.gate_up_bias)
            gate, up = gate_up.split(c.intermediate_size, dim=-1)
            x = x + _linear(F.silu(gate) * up, layer.down, layer.down_bias)
        return _rms_norm(x, self.final_norm, c.rms_norm_eps)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return _linear(hidden, self.lm_head_t, None).float()

    @torch.inference_mode()
    def forward(self, cache: PagedKVCache, seq_ids: Sequence, input_ids: torch.Tensor, append_lengths: Sequence[int],
                tree_parents: Sequence | None = None, *, logits_rows: torch.Tensor | None = None) -> ModelOutput:
        """Append ``input_ids`` (packed, ``append_lengths[b]`` tokens for ``seq_ids[b]``) and run the model.

        ``tree_parents`` is passed to ``cache.begin_forward``: ``None`` appends causally (prefill,
        plain decoding), a parent array per sequence appends a draft tree that stays uncommitted until
        ``cache.commit_accepted``. Logits are computed for ``logits_rows`` only (default: all rows),
        e.g. each prompt's last token after a prefill.
        """
        info: ForwardInfo = cache.begin_forward(seq_ids, append_lengths, tree_parents)
        try:
            hidden = self.hidden_states(input_ids, info.positions, cache.attention)
        except BaseException:
            cache.abort_forward()
            raise
        cache.end_forward()
        if logits_rows is not None:
            hidden = hidden[logits_rows.to(self.device)]
        return ModelOutput(self.logits(hidden), hidden)
