"""Linear layers with oneDNN-prepacked weights, for verifying trees (and drafting) on the CPU.

PyTorch's CPU ``F.linear`` runs a one-row input as a matrix-vector product but a few rows as a
general GEMM that repacks the weight on every call: on SmolLM2-135M (2 Zen 3 cores, fp32) a 2-token
forward took 1.5x a 1-token one, so every draft tree started half a step behind plain decoding.
oneDNN's inner product on a weight packed once (what vLLM's CPU backend and inductor's freezing pass
do) keeps few-row products near the cost of one row: packed, 2 tokens cost 1.05x one token and 8
tokens 1.25x (``bench/packed_linear.py``, ``bench/results/packed-linear.md``).

``pack_linears(model)`` swaps every plain ``nn.Linear`` of a CPU model whose weight oneDNN can pack
for a ``PackedLinear`` that shares its parameters (tied embeddings stay tied) and keeps one packed
copy of the weight (memory: one more copy of the linear weights). A packed layer repacks when its
weight is replaced or changed in place (its version counter moves: optimizer steps, ``copy_`` under
``no_grad``, ``load_state_dict``); a write through ``weight.data`` bypasses that counter, so call
``repack()`` (or ``pack_linears`` again) after one. It runs ``F.linear`` whenever autograd needs it,
so training is untouched.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["PackedLinear", "pack_linears"]


def _onednn_ops() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


class PackedLinear(nn.Linear):
    """An ``nn.Linear`` (same ``weight`` and ``bias`` parameters) whose inference forward runs oneDNN
    on a prepacked copy of the weight. Build it with ``PackedLinear.of(linear)``."""

    _packed: torch.Tensor | None = None
    _packed_for: tuple = ()  # built as a plain nn.Linear: packs on its first forward

    @classmethod
    def of(cls, linear: nn.Linear) -> PackedLinear:
        """``linear`` repacked; ``RuntimeError`` when oneDNN cannot pack or run its weight (device,
        dtype, ISA)."""
        packed = cls.__new__(cls)
        nn.Module.__init__(packed)
        packed.in_features, packed.out_features = linear.in_features, linear.out_features
        packed.weight, packed.bias = linear.weight, linear.bias
        packed.train(linear.training)
        packed.repack()
        with torch.inference_mode():  # some dtype/ISA pairs pack but cannot run: find out now
            torch.ops.mkldnn._linear_pointwise(torch.zeros(1, linear.in_features, dtype=linear.weight.dtype),
                                               packed._packed, None, "none", [], "")
        return packed

    def repack(self) -> None:
        """Pack the current weight (after a write through ``weight.data``, which is not seen otherwise)."""
        self._pack()

    def _key(self) -> tuple:
        w = self.weight
        return w.data_ptr(), w._version, w.dtype, w.device

    def _pack(self) -> None:
        self._packed_for = self._key()
        self._packed = None  # not packable (device, dtype, ISA): F.linear
        if self.weight.device.type != "cpu" or not _onednn_ops():
            raise RuntimeError("oneDNN packs weights of CPU tensors only")
        # The batch-size hint only picks the packed layout; 16 suits tree verification (1 to 64 rows).
        self._packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(), 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        trains = self.weight.requires_grad or (self.bias is not None and self.bias.requires_grad)
        if torch.is_grad_enabled() and (x.requires_grad or trains):
            return F.linear(x, self.weight, self.bias)  # oneDNN's op has no backward
        try:
            if self._packed_for != self._key():  # the weight was changed in place or replaced since packing
                self._pack()
        except RuntimeError:  # not packable any more (dtype, device) or not inspectable: F.linear
            self._packed = None
        if self._packed is None or x.dtype != self.weight.dtype:
            return F.linear(x, self.weight, self.bias)
        bias = None if self.bias is None else self.bias.detach()
        return torch.ops.mkldnn._linear_pointwise(x, self._packed, bias, "none", [], "")


def _hooked(module: nn.Module) -> bool:
    """Whether ``module`` runs hooks or an instance-level forward (accelerate's offloading, say) that a
    swap would drop."""
    return bool(module._forward_hooks or module._forward_pre_hooks or "forward" in module.__dict__)


def pack_linears(model: nn.Module, *, skip: Iterable[nn.Module] = ()) -> int:
    """Swap ``model``'s plain ``nn.Linear`` layers (without hooks) for ``PackedLinear`` where oneDNN can
    pack and run their weight (CPU; float32 everywhere, bfloat16 on AVX-512 machines) and repack the
    ``PackedLinear`` layers already there; returns how many were swapped. ``skip``: modules left as
    they are, with everything inside them (e.g. another model's layers that ``model`` shares, whose
    packed copy would cost their memory again)."""
    if not _onednn_ops():
        return 0
    skipped = {id(inner) for module in skip for inner in module.modules()}
    swapped = 0
    for parent in list(model.modules()):
        if id(parent) in skipped:
            continue
        for name, child in list(parent.named_children()):
            if id(child) in skipped:
                continue
            if isinstance(child, PackedLinear):
                with contextlib.suppress(RuntimeError):  # unpackable now: its forward runs F.linear
                    child.repack()
            if type(child) is not nn.Linear or _hooked(child):  # subclasses (quantized, LoRA) keep their forward
                continue
            try:
                setattr(parent, name, PackedLinear.of(child))
            except RuntimeError:  # this weight's device, dtype or this CPU: F.linear stays
                continue
            swapped += 1
    return swapped
