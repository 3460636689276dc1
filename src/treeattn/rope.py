"""Rotary position embedding with TVM's exact frequency formulas (tvm-semantics.md §4).

Every ``rope_type`` is expressed as ``angle[p, j] = f(s_p, j)`` with ``s_p = float32(p) * scale``,
evaluated in float32 in the same operation order as TVM so that results match its kernels to fp32
rounding. The pairing is always rotate-half (``j`` with ``j +- d/2``), whatever the type, and the
rotated tensor is rounded to the input dtype before any dot product, as TVM does.

TVM quirks kept on purpose (they are what "faithful" means here): ``gptj`` and ``llama4`` assign
interleaved frequencies but still pair rotate-half; ``yarn`` evaluates its ramp at the full index
``j`` and applies no attention factor; ``longrope`` scales cos and sin by one constant and ignores
per-dimension factors.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

from .checks import as_index, as_real

_REQUIRED = {
    "gptj": (),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "llama4": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "longrope": ("max_position_embeddings", "original_max_position_embeddings"),
    "yarn": ("factor", "beta_fast", "beta_slow", "original_max_position_embeddings"),
}


class RoPE:
    """Rotate-half RoPE configuration: ``RoPE(theta=1e4, scale=1.0, scaling=None)``.

    ``scale`` multiplies the position (linear interpolation by a factor F is ``scale = 1/F``).
    ``scaling`` is TVM's / HF's ``rope_scaling`` dict: ``None`` or ``{}`` for the default, else it
    must name a ``rope_type`` in ``gptj, llama3, llama4, longrope, yarn`` with its parameters.
    For ``yarn``, ``inv_theta_log_scale`` defaults to ``1 / (2 ln theta)`` as TVM's KV cache fills it.
    Numbers may be any real type (numpy scalars included); a non-number is a ``TypeError``, a value
    out of range a ``ValueError``.
    """

    def __init__(self, theta: float = 10000.0, scale: float = 1.0, scaling: Mapping[str, Any] | None = None):
        theta, scale = as_real(theta, "theta"), as_real(scale, "scale")
        if not (math.isfinite(theta) and theta > 1.0):
            raise ValueError(f"theta must be a finite number > 1, got {theta!r}")
        if not (math.isfinite(scale) and scale > 0.0):
            raise ValueError(f"scale must be a finite number > 0, got {scale!r}")
        if scaling is not None and not isinstance(scaling, Mapping):
            raise TypeError(f"scaling must be a dict (HF's rope_scaling) or None, got {type(scaling).__name__}")
        scaling = dict(scaling or {})
        rope_type = scaling.get("rope_type", scaling.get("type"))
        if rope_type in (None, "default"):
            rope_type = "default"
        elif rope_type not in _REQUIRED:
            raise ValueError(
                f"scaling['rope_type'] = {rope_type!r} is not supported; "
                f"expected one of default, {', '.join(_REQUIRED)}"
            )
        else:
            missing = [k for k in _REQUIRED[rope_type] if k not in scaling]
            if missing:
                raise ValueError(f"scaling for rope_type {rope_type!r} is missing {', '.join(missing)}")
            # TVM divides by or takes logs of each of them (and of yarn's inv_theta_log_scale, if given)
            for key in _REQUIRED[rope_type] + (("inv_theta_log_scale",) if "inv_theta_log_scale" in scaling else ()):
                value = scaling[key] = as_real(scaling[key], f"scaling[{key!r}]")
                if not (math.isfinite(value) and value > 0):
                    raise ValueError(f"scaling[{key!r}] must be a finite number > 0, got {value!r}")
            if rope_type == "longrope" and scaling["original_max_position_embeddings"] <= 1:
                raise ValueError("longrope scaling needs original_max_position_embeddings > 1 (TVM divides by its log)")
            if rope_type == "llama3" and scaling["high_freq_factor"] == scaling["low_freq_factor"]:
                raise ValueError("llama3 scaling needs high_freq_factor != low_freq_factor (TVM divides by their difference)")
            if rope_type == "yarn":
                scaling.setdefault("inv_theta_log_scale", 1.0 / (2.0 * math.log(theta)))
        self.theta = float(theta)
        self.scale = float(scale)
        self.scaling = scaling
        self.rope_type = rope_type

    def __repr__(self) -> str:
        extra = f", scaling={self.scaling}" if self.scaling else ""
        return f"RoPE(theta={self.theta}, scale={self.scale}{extra})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, RoPE) and (self.theta, self.scale, self.scaling) == (other.theta, other.scale, other.scaling)

    def __hash__(self) -> int:
        return hash((self.theta, self.scale, tuple(sorted((k, str(v)) for k, v in self.scaling.items()))))

    @property
    def multiplier(self) -> float:
        """Factor on both cos and sin (``longrope``'s attention scaling; 1 otherwise)."""
        if self.rope_type != "longrope":
            return 1.0
        ratio = self.scaling["max_position_embeddings"] / self.scaling["original_max_position_embeddings"]
        if ratio <= 1.0:
            return 1.0
        return math.sqrt(1 + math.log(ratio) / math.log(self.scaling["original_max_position_embeddings"]))

    def frequencies(self, head_dim: int, device: torch.device | str = "cpu") -> tuple[torch.Tensor, bool]:
        """Per-dim float32 factor ``g [head_dim]`` and whether the angle is ``s / g`` (True) or ``s * g``.

        TVM divides by ``theta ** e`` for default/gptj/longrope and multiplies by a computed
        frequency for llama3/llama4/yarn; keeping the same form keeps fp32 rounding identical.
        """
        d = head_dim
        j = torch.arange(d, device=device, dtype=torch.int64)
        f32 = torch.float32
        theta = torch.tensor(self.theta, dtype=f32, device=device)
        mod_exp = ((j * 2) % d).to(f32) / d  # shared by j and j + d/2
        t = self.rope_type
        if t in ("default", "longrope"):
            return torch.pow(theta, mod_exp), True
        if t == "gptj":
            return torch.pow(theta, ((2 * (j // 2)) % d).to(f32) / d), True
        p = self.scaling
        if t in ("llama3", "llama4"):
            exp = mod_exp if t == "llama3" else (2 * (j // 2)).to(f32) / d
            orig = 1.0 / torch.pow(theta, exp)
            factor, lf, hf = float(p["factor"]), float(p["low_freq_factor"]), float(p["high_freq_factor"])
            big_l = float(p["original_max_position_embeddings"])
            if t == "llama4" and hf == lf:
                wavelength = (2 * math.pi) / orig
                return torch.where(wavelength > big_l / lf, orig / factor, orig), False
            inv_diff = 1.0 / (hf - lf)
            alpha, beta = big_l / (2 * math.pi) * inv_diff, lf * inv_diff
            smooth = torch.clamp(alpha * orig - beta, 0.0, 1.0)
            return (1.0 - smooth) * orig * (1.0 / factor) + smooth * orig, False
        # yarn
        power = torch.pow(theta, mod_exp)
        extra = 1.0 / power
        inter = 1.0 / (float(p["factor"]) * power)
        big_l, inv_log = float(p["original_max_position_embeddings"]), float(p["inv_theta_log_scale"])
        # TVM holds low/high as float32 constants and takes high - low in float32; rounding the
        # float64 difference instead moves the ramp by an ulp, visible at large positions.
        low = max(d * math.log(big_l / (p["beta_fast"] * 2 * math.pi)) * inv_log, 0.0)
        high = min(d * math.log(big_l / (p["beta_slow"] * 2 * math.pi)) * inv_log, d - 1.0)
        low, high = (torch.tensor(x, dtype=f32, device=device) for x in (low, high))
        if low == high:
            high += 0.001
        ramp = torch.clamp((j.to(f32) - low) / (high - low), 0.0, 1.0)
        mask = 1.0 - ramp
        return inter * (1 - mask) + extra * mask, False

    def cos_sin(self, positions: torch.Tensor, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
        """float32 ``cos, sin [L, head_dim]`` for integer positions ``[L]`` (multiplier included)."""
        head_dim = as_index(head_dim, "head_dim")
        if head_dim <= 0 or head_dim % 2:
            raise ValueError(f"RoPE needs an even head dim > 0, got {head_dim}")
        if not isinstance(positions, torch.Tensor) or positions.is_floating_point() or positions.is_complex() \
                or positions.dtype == torch.bool:
            raise TypeError("positions must be an integer tensor [L] (token positions are whole numbers), got "
                            f"{positions.dtype if isinstance(positions, torch.Tensor) else type(positions).__name__}")
        if positions.dim() != 1:
            raise ValueError(f"positions must be 1-D [L], got shape {tuple(positions.shape)}")
        g, divide = self.frequencies(head_dim, positions.device)
        s = positions.to(torch.float32)[:, None] * torch.tensor(self.scale, dtype=torch.float32)
        angle = s / g if divide else s * g
        mu = self.multiplier
        cos, sin = torch.cos(angle), torch.sin(angle)
        if mu != 1.0:
            cos, sin = cos * mu, sin * mu
        return cos, sin

    def apply(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Rotate ``x [L, H, d]`` at integer ``positions [L]``: computed in fp32, returned in ``x.dtype``."""
        if not isinstance(x, torch.Tensor) or not x.is_floating_point():
            raise TypeError(f"x must be a float tensor [L, H, d], got "
                            f"{x.dtype if isinstance(x, torch.Tensor) else type(x).__name__}")
        if x.dim() != 3:
            raise ValueError(f"x must be 3-D [L, H, d], got shape {tuple(x.shape)}")
        cos_sin = self.cos_sin(positions, x.shape[-1])
        if positions.shape[0] != x.shape[0] or positions.device != x.device:
            raise ValueError(f"positions must have shape [{x.shape[0]}] on {x.device} (one per row of x), got "
                             f"{tuple(positions.shape)} on {positions.device}")
        return self.rotate(x, *cos_sin)

    @staticmethod
    def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotate-half ``x [L, H, d]`` with precomputed ``cos_sin`` (fp32 ``[L, d]``), returned in
        ``x.dtype``: a model computes cos/sin once per forward and rotates every layer with them."""
        xf = x.float()
        half = x.shape[-1] // 2
        partner = torch.cat([-xf[..., half:], xf[..., :half]], dim=-1)
        return (cos[:, None, :] * xf + sin[:, None, :] * partner).to(x.dtype)
