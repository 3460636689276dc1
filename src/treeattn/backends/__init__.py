"""Backend registry. A backend is a module exposing three functions over validated, planned inputs:

``tree_attention(q, k, v, plan, *, sm_scale, rope, q_positions, k_positions, out, lse)``,
``paged_tree_attention(q, kv_pages, plan, *, sm_scale, out, lse)`` and
``merge_state(out_a, lse_a, out_b, lse_b, *, out, lse)``; each writes ``out``/``lse`` in place.
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType

import torch

BACKENDS = ("reference", "cpu", "triton")
_MODULES = {"reference": "treeattn.reference", "cpu": "treeattn.backends.cpu", "triton": "treeattn.backends.triton"}


def triton_usable(device: torch.device) -> bool:
    """Triton runs on CUDA tensors, or on CPU tensors through its interpreter (``TRITON_INTERPRET=1``)."""
    if importlib.util.find_spec("triton") is None:
        return False
    return device.type == "cuda" or (device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1")


def available_backends(device: torch.device | str = "cpu") -> list[str]:
    device = torch.device(device)
    names = ["reference"]
    if device.type == "cpu":
        names.append("cpu")
    if triton_usable(device):
        names.append("triton")
    return names


def default_backend(device: torch.device) -> str:
    return "triton" if device.type == "cuda" else "cpu"


def get_backend(name: str | None, device: torch.device) -> ModuleType:
    """The backend module for ``name`` (``None``: the fastest one for ``device``)."""
    if name is None:
        name = default_backend(device)
    if name not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(BACKENDS)} or None, got {name!r}")
    if name == "cpu" and device.type != "cpu":
        raise ValueError(f"backend='cpu' needs CPU tensors, got tensors on {device}")
    if name == "triton" and not triton_usable(device):
        if importlib.util.find_spec("triton") is None:
            raise ValueError("backend='triton' needs the triton package: pip install 'treeattn[triton]'")
        raise ValueError(
            f"backend='triton' needs CUDA tensors (got {device}); on CPU set TRITON_INTERPRET=1 "
            "before importing triton to run the kernels in Triton's interpreter"
        )
    return importlib.import_module(_MODULES[name])
