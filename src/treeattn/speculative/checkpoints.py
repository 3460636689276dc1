"""Load published draft-head checkpoints: EAGLE-3, EAGLE-1/2 and Medusa, in the formats engines load.

``load_draft_head(path, target=...)`` reads a folder (``config.json`` plus ``model.safetensors``,
sharded ``*.safetensors`` with ``model.safetensors.index.json``, ``pytorch_model.bin`` (sharded with
its index) or Medusa's ``medusa_lm_head.safetensors`` / ``.pt``) or a single weights file, recognises
the format from the tensor names, checks it against the target and returns an ``Eagle3Head``,
``EagleHead`` or ``MedusaHeads``.

The same thing under each engine's names (tensor names after a leading ``model.`` is stripped):

EAGLE-3
  * decoder layer: ``midlayer.*`` (EAGLE ``cnets.py``, SGLang, SpecForge); ``layers.0.*`` (vLLM, which
    maps ``midlayer.`` onto it; speculators). q/k/v read ``2 * hidden_size``.
  * feature fusion: ``fc.weight`` ``[hidden, num_aux * target_hidden_size]`` everywhere; SGLang adds
    ``fc.bias`` when the config says ``bias``; vLLM's variants add ``input_norm.weight``
    (``norm_before_fc``) or ``fc_norm.{i}.weight`` (``fc_norm``).
  * draft vocabulary: ``draft_vocab_size``; ``lm_head.weight`` ``[draft_vocab_size, hidden]``.
  * draft id -> target id: ``d2t`` (an offset: target = i + d2t[i]); vLLM renames it
    ``draft_id_to_target_id``, SGLang keeps ``hot_token_id = d2t + arange``. ``t2d`` (bool over the
    target vocabulary) is EAGLE's; vLLM and SGLang skip it. All ignore both when the vocabularies agree.
  * target feature width: ``target_hidden_size`` (default ``hidden_size``).
  * aux layers: EAGLE fixes boundaries (2, N // 2, N - 3); vLLM and SGLang read
    ``eagle_aux_hidden_state_layer_ids`` (top level or in ``eagle_config``; vLLM also
    ``num_aux_hidden_states``). vLLM counts id i as the input of layer i (a boundary); SGLang
    historically as the output of layer i (boundary i + 1), now only when the first id is 1.
  * residual from the normed feature: vLLM ``norm_before_residual`` (speculators' default: true).
EAGLE-1/2
  * ``fc.weight`` ``[hidden, 2 * hidden]`` and ``fc.bias`` (EAGLE ``cnets1.py``, config ``bias``,
    default true; vLLM's ``llama_eagle.py`` builds fc without a bias); ``layers.0.*`` without
    ``input_layernorm``; ``embed_tokens.weight`` optional; no ``lm_head`` (the target's).
Medusa
  * head j's block l: ``{j}.{l}.linear.weight/bias`` (FasterDecoding ``medusa_lm_head.*``;
    ``medusa_head.`` in front in a Medusa-2 model); vLLM ``blocks.{j}.layers.{l}.weight/bias``
    (bias only with ``medusa_fc_bias``). treeattn: ``medusa_head.{j}.{l}.linear.*``.
  * head j's vocabulary projection: ``{j}.{L}.weight`` (FasterDecoding); vLLM ``lm_heads.{j}.weight``.
  * shape: ``medusa_num_heads`` / ``medusa_num_layers`` (FasterDecoding), ``num_heads`` /
    ``num_hidden_layers`` (vLLM's ``MedusaConfig``, which renames the former).

Embeddings (``embed_tokens.weight``) and, when a head has none, the LM head come from the target, as
every engine does when the checkpoint lacks them. The speculators format (``speculators_model_type``
``eagle3``, a ``transformer_layer_config``) and vLLM's ``EAGLEConfig`` (a nested ``model`` config) are
flattened onto the same fields.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from .drafters import MedusaHeads
from .eagle import Eagle3Head, EagleHead, HeadConfig, default_aux_layers

__all__ = ["DraftTarget", "load_draft_head"]

_WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json",
                 "medusa_lm_head.safetensors", "medusa_lm_head.pt")
_MEDUSA = (re.compile(r"(\d+)\.(\d+)\.linear\.(weight|bias)"), re.compile(r"(\d+)\.(\d+)\.(weight)"),
           re.compile(r"blocks\.(\d+)\.layers\.(\d+)\.(weight|bias)"), re.compile(r"lm_heads\.(\d+)\.(weight)"))


@dataclass(frozen=True)
class DraftTarget:
    """What a draft head needs from its target: sizes to check, and the weights it shares.

    ``num_layers``: decoder layers (EAGLE-3's aux boundaries must lie in ``[0, num_layers]``);
    ``embed`` / ``lm_head``: ``[vocab_size, hidden_size]`` weights, ``None`` if not at hand.
    ``load_draft_head`` also takes an HF causal LM or a ``treeattn.hf.HFTreeModel`` and reads these
    from it.
    """

    hidden_size: int
    vocab_size: int
    num_layers: int
    embed: torch.Tensor | None = None
    lm_head: torch.Tensor | None = None


def as_draft_target(target) -> DraftTarget:
    """``target`` (``DraftTarget``, ``HFTreeModel`` or HF causal LM) as a ``DraftTarget``."""
    if isinstance(target, DraftTarget):
        return target
    if hasattr(target, "vocab_weights") and hasattr(target, "config"):  # treeattn.hf.HFTreeModel
        config, (embed, head) = target.config, target.vocab_weights()
    elif hasattr(target, "get_input_embeddings") and hasattr(target, "config"):  # an HF PreTrainedModel
        config = target.config.get_text_config() if hasattr(target.config, "get_text_config") else target.config
        out = target.get_output_embeddings()
        embed, head = target.get_input_embeddings().weight.detach(), None if out is None else out.weight.detach()
    else:
        raise TypeError(f"target must be a DraftTarget, a treeattn.hf.HFTreeModel or an HF causal LM, got "
                        f"{type(target).__name__}")
    return DraftTarget(config.hidden_size, config.vocab_size, config.num_hidden_layers, embed, head)


def load_draft_head(path, *, target=None, dtype: torch.dtype | None = None, device: torch.device | str = "cpu",
                    aux_ids: str = "boundary"):
    """The draft head stored at ``path`` (a folder or a weights file), in eval mode.

    ``target`` (``DraftTarget``, ``HFTreeModel`` or HF causal LM) is checked against the head
    (hidden size, vocabulary, EAGLE-3's aux layers) and lends its embeddings / LM head where the
    checkpoint has none; without it a head that needs them cannot be built. ``dtype``: the
    parameters' dtype (``None``: the checkpoint's). ``aux_ids`` says what EAGLE-3's
    ``eagle_aux_hidden_state_layer_ids`` count: ``"boundary"`` (vLLM: id ``i`` is the input of layer
    ``i``) or ``"layer_output"`` (SGLang/SpecForge: the output of layer ``i``, boundary ``i + 1``).
    """
    if aux_ids not in ("boundary", "layer_output"):
        raise ValueError(f"aux_ids must be 'boundary' or 'layer_output', got {aux_ids!r}")
    config, tensors = _read(Path(path))
    spec = None if target is None else as_draft_target(target)
    names = set(tensors)
    if any(_medusa_key(n) for n in names):
        head = _medusa(config, tensors, spec)
    elif "layers.0.hidden_norm.weight" in names:
        head = _eagle3(config, tensors, spec, aux_ids)
    elif "fc.weight" in names and "layers.0.self_attn.q_proj.weight" in names:
        head = _eagle(config, tensors, spec)
    else:
        shown = ", ".join(sorted(names)[:8]) + (", ..." if len(names) > 8 else "")
        raise ValueError(f"{path}: not a draft head this loader knows. Looked for EAGLE-3 (midlayer.* or layers.0.* "
                         "with hidden_norm, fc.weight, lm_head.weight, d2t/t2d), EAGLE-1/2 (fc.weight, fc.bias, "
                         "layers.0.*) and Medusa ({j}.{l}.linear.*, {j}.{L}.weight, blocks.*/lm_heads.*, "
                         f"medusa_head.*); found tensors: {shown}")
    dtype = dtype or next(t.dtype for t in tensors.values() if t.is_floating_point())
    return head.to(device=device, dtype=dtype).eval()


def _read(path: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """``(config dict, tensors)`` of a folder or a single weights file."""
    if path.is_dir():
        found = [path / f for f in _WEIGHT_FILES if (path / f).is_file()]
        if not found:
            raise FileNotFoundError(f"{path} holds none of {', '.join(_WEIGHT_FILES)}")
        weights = found[0]
        config_file = path / "config.json"
        config = json.loads(config_file.read_text()) if config_file.is_file() else {}
    elif path.is_file():
        weights, config = path, {}
    else:
        raise FileNotFoundError(f"no draft-head checkpoint at {path}")
    if weights.name.endswith(".index.json"):
        shards = sorted(set(json.loads(weights.read_text())["weight_map"].values()))
        tensors = {}
        for shard in shards:
            tensors.update(_load_file(weights.parent / shard))
    else:
        tensors = _load_file(weights)
    # One naming for every engine: no "model." prefix, EAGLE's/SGLang's midlayer as vLLM's layers.0
    return _flatten_config(config), {re.sub(r"^midlayer\.", "layers.0.", re.sub(r"^model\.", "", k)): v
                                     for k, v in tensors.items()}


def _load_file(file: Path) -> dict[str, torch.Tensor]:
    if file.suffix == ".safetensors":
        try:
            from safetensors.torch import load_file
        except ImportError:
            raise ImportError(f"reading {file} needs the safetensors package (pip install safetensors)") from None
        return load_file(str(file))
    state = torch.load(file, map_location="cpu", weights_only=True)
    if not isinstance(state, Mapping) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise ValueError(f"{file} must hold a state dict (names -> tensors)")
    return dict(state)


def _flatten_config(config: dict) -> dict:
    """One flat dict of a head's fields from HF, vLLM ``EAGLEConfig`` or speculators configs."""
    if "speculators_model_type" in config:
        if config["speculators_model_type"] != "eagle3":
            raise ValueError(f"speculators_model_type {config['speculators_model_type']!r} is not supported; "
                             "only 'eagle3' heads load here")
        flat = dict(config.get("transformer_layer_config", {}))
        flat.update({k: v for k, v in config.items() if k != "transformer_layer_config"})
        flat.setdefault("norm_before_residual", True)  # vLLM's speculators reader defaults it on
        return flat
    if isinstance(config.get("model"), dict):  # vLLM's EAGLEConfig: the draft's own config nested under "model"
        flat = dict(config["model"])
        flat.update({k: v for k, v in config.items() if k not in ("model", "architectures", "model_type")})
        return flat
    return config


def _medusa_key(name: str) -> bool:
    return name.startswith(("medusa_head.", "medusa_heads.")) or any(p.fullmatch(name) for p in _MEDUSA)


def _field(config: dict, name: str, default=None, where: str = ""):
    """``config[name]``, or the same field inside ``eagle_config`` (vLLM reads both)."""
    eagle = config.get("eagle_config") or {}
    value = config.get(name, eagle.get(name, default))
    if value is None and default is None and where:
        raise ValueError(f"config.json has no {name!r} ({where})")
    return value


def _mismatch(field: str, ours, theirs) -> None:
    if ours != theirs:
        raise ValueError(f"draft head does not fit the target: checkpoint {field} = {ours}, target's = {theirs}")


def _head_config(config: dict, tensors: dict, **extra) -> HeadConfig:
    if not config:
        raise ValueError("an EAGLE head needs its config.json (hidden sizes, heads, RoPE) next to the weights")
    layers = config.get("num_hidden_layers", 1)
    if layers != 1:
        raise ValueError(f"config num_hidden_layers = {layers}: only single-layer EAGLE heads are implemented")
    rope = config.get("rope_parameters") or {}  # transformers 5 keeps theta and scaling together
    scaling = config.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
    q = tensors["layers.0.self_attn.q_proj.weight"]
    k = tensors["layers.0.self_attn.k_proj.weight"]
    heads = _field(config, "num_attention_heads", where="attention heads")
    head_dim = config.get("head_dim") or q.shape[0] // heads
    return HeadConfig(
        hidden_size=_field(config, "hidden_size", where="the head's width"),
        intermediate_size=tensors["layers.0.mlp.gate_proj.weight"].shape[0],
        num_attention_heads=heads, num_key_value_heads=k.shape[0] // head_dim, head_dim=head_dim,
        vocab_size=_field(config, "vocab_size", where="the target's vocabulary"),
        rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
        rope_theta=float(config.get("rope_theta", rope.get("rope_theta", 10000.0))),
        rope_scaling=scaling, qkv_bias="layers.0.self_attn.q_proj.bias" in tensors,
        o_bias="layers.0.self_attn.o_proj.bias" in tensors, **extra)


def _take(tensors: dict, name: str, spec: DraftTarget | None, shared: str) -> torch.Tensor:
    """A weight from the checkpoint, else the target's ``shared`` one."""
    if name in tensors:
        return tensors[name]
    weight = None if spec is None else getattr(spec, shared)
    if weight is None:
        raise ValueError(f"the checkpoint has no {name!r}; pass target= (a model with {shared}) to share the target's")
    return weight


def _fill(head: torch.nn.Module, state: dict, kind: str) -> None:
    """Load ``state`` into ``head``, naming any missing or unexpected tensor."""
    expected = head.state_dict()
    missing, unexpected = sorted(set(expected) - set(state)), sorted(set(state) - set(expected))
    if missing or unexpected:
        raise ValueError(f"{kind} checkpoint does not match its config: missing {missing or 'nothing'}, "
                         f"unexpected {unexpected or 'nothing'}")
    for name, value in state.items():  # shapes are checked here, by name
        if value.shape != expected[name].shape:
            raise ValueError(f"{kind} checkpoint tensor {name!r} has shape {tuple(value.shape)}, the config implies "
                             f"{tuple(expected[name].shape)}")
    head.load_state_dict({k: v.to(expected[k].dtype) for k, v in state.items()})


def _eagle3(config: dict, tensors: dict, spec: DraftTarget | None, aux_ids: str) -> Eagle3Head:
    if _field(config, "use_aux_hidden_state", True) is False:
        raise ValueError("config use_aux_hidden_state = false (a head without fused target layers) is not supported")
    ids = _field(config, "eagle_aux_hidden_state_layer_ids")
    if ids is not None and aux_ids == "layer_output":
        ids = [i + 1 for i in ids]
    target_hidden = config.get("target_hidden_size")
    num_aux = len(ids) if ids else config.get("num_aux_hidden_states", 3)
    if spec is not None:
        _mismatch("target_hidden_size" if target_hidden else "hidden_size", target_hidden or config.get("hidden_size"),
                  spec.hidden_size)
        _mismatch("vocab_size", config.get("vocab_size"), spec.vocab_size)
        if ids is None:
            ids = default_aux_layers(spec.num_layers)
        bad = [i for i in ids if not 0 <= i <= spec.num_layers]
        if bad or len(set(ids)) != len(ids):
            raise ValueError(f"draft head does not fit the target: aux layer boundaries {list(ids)} must be distinct and "
                             f"in [0, num_layers = {spec.num_layers}] (eagle_aux_hidden_state_layer_ids, counted as "
                             f"aux_ids={aux_ids!r})")
    cfg = _head_config(config, tensors, draft_vocab_size=_field(config, "draft_vocab_size"),
                       target_hidden_size=target_hidden, aux_layers=None if ids is None else tuple(ids), num_aux=num_aux,
                       **{k: bool(_field(config, k, False)) for k in ("norm_before_residual", "norm_before_fc", "fc_norm",
                                                                     "norm_output")},
                       logit_scale=float(config.get("logit_scale", 1.0)))
    head = Eagle3Head(cfg)
    state = dict(tensors)
    state["embed_tokens.weight"] = _take(tensors, "embed_tokens.weight", spec, "embed")
    if "lm_head.weight" not in state:  # SGLang: tied to the embeddings, or the target's when no draft vocabulary
        tied = config.get("tie_word_embeddings") and cfg.vocab_size_draft == cfg.vocab_size
        state["lm_head.weight"] = state["embed_tokens.weight"] if tied else _take(tensors, "lm_head.weight", spec, "lm_head")
    if cfg.vocab_size_draft == cfg.vocab_size:  # the engines ignore the maps of a full draft vocabulary
        state.pop("d2t", None)
        state.pop("t2d", None)
    _fill(head, state, "EAGLE-3")
    if hasattr(head, "d2t"):
        _check_vocab_maps(head)
    return head


def _check_vocab_maps(head: Eagle3Head) -> None:
    """``d2t`` must map the draft vocabulary onto distinct target ids, and ``t2d`` mark exactly those."""
    targets = head.to_target(torch.arange(head.d2t.shape[0]))
    vocab = head.config.vocab_size
    if int(targets.min()) < 0 or int(targets.max()) >= vocab or targets.unique().numel() != targets.numel():
        raise ValueError(f"checkpoint d2t maps draft ids to target ids outside [0, {vocab}) or onto the same id twice")
    marked = torch.zeros(vocab, dtype=torch.bool)
    marked[targets] = True
    if not torch.equal(marked, head.t2d.cpu()):
        raise ValueError("checkpoint t2d does not mark exactly the target ids that d2t maps the draft vocabulary to")


def _eagle(config: dict, tensors: dict, spec: DraftTarget | None) -> EagleHead:
    hidden = tensors["fc.weight"].shape[0]
    config = {"hidden_size": hidden, **config}
    if spec is not None:
        _mismatch("hidden_size", config["hidden_size"], spec.hidden_size)
        _mismatch("vocab_size", config.get("vocab_size"), spec.vocab_size)
    cfg = _head_config(config, tensors, fc_bias="fc.bias" in tensors)
    head = EagleHead(cfg)
    state = dict(tensors)
    state["embed_tokens.weight"] = _take(tensors, "embed_tokens.weight", spec, "embed")
    state["lm_head.weight"] = _take(tensors, "lm_head.weight", spec, "lm_head")
    _fill(head, state, "EAGLE-1/2")
    return head


def _medusa(config: dict, tensors: dict, spec: DraftTarget | None) -> MedusaHeads:
    """Map any Medusa naming onto ``MedusaHeads``' ``medusa_head.{j}.{l}.linear.*`` / ``medusa_head.{j}.{L}.weight``."""
    if "token_map" in tensors:
        raise ValueError("Medusa checkpoint has a token_map (vLLM's truncated vocabulary): not supported by MedusaHeads")
    named = {k: v for k, v in tensors.items() if k.startswith(("medusa_head.", "medusa_heads."))}
    source = {k.split(".", 1)[1]: v for k, v in named.items()} if named else tensors  # Medusa-2 keeps the base model too
    blocks, vocab = {}, {}
    for name, value in source.items():
        match = next((m for p in _MEDUSA if (m := p.fullmatch(name))), None)
        if match is None:
            raise ValueError(f"Medusa checkpoint has an unexpected tensor {name!r}")
        groups = match.groups()
        if name.startswith("lm_heads."):
            vocab[int(groups[0])] = value
        elif "linear" in name or name.startswith("blocks."):
            blocks[(int(groups[0]), int(groups[1]), groups[2])] = value
        else:
            vocab[int(groups[0])] = (int(groups[1]), value)  # the block count is checked below
    num_heads = len(vocab)
    num_layers = 1 + max((layer for _, layer, _ in blocks), default=-1)
    # vLLM's MedusaConfig renames the fields; a Medusa-2 config's num_hidden_layers is the base model's.
    vllm = config.get("model_type") == "medusa"
    for field, value, vllm_field in (("medusa_num_heads", num_heads, "num_heads"),
                                     ("medusa_num_layers", num_layers, "num_hidden_layers")):
        declared = config.get(field, config.get(vllm_field) if vllm else None)
        if declared is not None and declared != value:
            raise ValueError(f"Medusa config {field} = {declared}, but the checkpoint holds {value}")
    if sorted(vocab) != list(range(num_heads)) or num_heads == 0:
        raise ValueError(f"Medusa checkpoint must hold vocabulary projections for heads 0..n-1, got {sorted(vocab)}")
    state = {}
    for j, entry in vocab.items():
        if isinstance(entry, tuple):
            index, entry = entry
            if index != num_layers:
                raise ValueError(f"Medusa head {j}'s projection is {j}.{index}.weight, expected {j}.{num_layers}.weight "
                                 f"after {num_layers} blocks")
        state[f"medusa_head.{j}.{num_layers}.weight"] = entry
    vocab_size, hidden = state["medusa_head.0." + str(num_layers) + ".weight"].shape
    if spec is not None:
        _mismatch("hidden_size", hidden, spec.hidden_size)
        _mismatch("vocab_size", vocab_size, spec.vocab_size)
    for (j, layer, kind), value in blocks.items():
        state[f"medusa_head.{j}.{layer}.linear.{kind}"] = value
    for j in range(num_heads):  # vLLM's blocks may have no bias (medusa_fc_bias false): a zero bias is the same
        for layer in range(num_layers):
            state.setdefault(f"medusa_head.{j}.{layer}.linear.bias", torch.zeros(hidden))
    head = MedusaHeads(hidden, vocab_size, num_heads=num_heads, num_layers=num_layers)
    _fill(head, state, "Medusa")
    return head
