"""Backend registry and capability dispatch (xFormers-style: each backend declares what it serves).

``select(name, spec)`` returns the backend for a call: the named one if it can serve the call, or
with ``name=None`` the fastest capable one, in the order of ``BACKENDS`` (Triton, the native C++
CPU kernel, then the PyTorch CPU backend). The float64 reference serves every call but is only
used when asked for by name. When nothing fits, the error lists why each backend cannot run.
"""

from __future__ import annotations

import importlib

import torch

from .base import AttentionSpec, Backend

__all__ = ["BACKENDS", "AttentionSpec", "Backend", "available_backends", "get_backend", "select"]

# Fastest first: backend=None takes the first capable one that may be picked automatically.
BACKENDS = ("triton", "native", "cpu", "reference")
_CLASSES = {"triton": ("treeattn.backends.triton", "TritonBackend"),
            "native": ("treeattn.backends.native", "NativeBackend"),
            "cpu": ("treeattn.backends.cpu", "CpuBackend"),
            "reference": ("treeattn.backends.reference", "ReferenceBackend")}
_instances: dict[str, Backend] = {}


def get_backend(name: str) -> Backend:
    """The backend called ``name`` (imported on first use)."""
    if name not in _CLASSES:
        raise ValueError(f"backend must be one of {', '.join(BACKENDS)} or None, got {name!r}")
    if name not in _instances:
        module, cls = _CLASSES[name]
        _instances[name] = getattr(importlib.import_module(module), cls)()
    return _instances[name]


def _why_not(backend: Backend, spec: AttentionSpec) -> str | None:
    return backend.unavailable() or backend.unsupported(spec)


_chosen: dict[tuple[str | None, AttentionSpec], Backend] = {}


def select(name: str | Backend | None, spec: AttentionSpec) -> Backend:
    """The backend that runs ``spec``: ``name``'s if it can, else the fastest capable one for ``None``; a
    ``Backend`` object (``NativeBackend(isa="avx2")``: one configured otherwise than the registry's) runs
    as it is, if it can. Capabilities do not change while the process runs, so a choice by name is
    remembered (every layer of every step asks again)."""
    if isinstance(name, Backend):
        return _capable(name, spec)
    key = (name, spec)
    chosen = _chosen.get(key)
    if chosen is None:
        chosen = _chosen[key] = _select(name, spec)
    return chosen


def _capable(backend: Backend, spec: AttentionSpec) -> Backend:
    reason = _why_not(backend, spec)
    if reason:
        raise ValueError(f"backend={backend.name!r} cannot run this call ({spec.describe()}): {reason}")
    return backend


def _select(name: str | None, spec: AttentionSpec) -> Backend:
    if name is not None:
        return _capable(get_backend(name), spec)
    reasons = []
    for candidate in BACKENDS:
        backend = get_backend(candidate)
        reason = _why_not(backend, spec) or (None if backend.auto else backend.manual_reason)
        if reason is None:
            return backend
        reasons.append(f"  {candidate}: {reason}")
    raise ValueError(f"no backend can run this call ({spec.describe()}):\n" + "\n".join(reasons))


def available_backends(device: torch.device | str = "cpu") -> list[str]:
    """Backends that can run plain fp32 tree attention on ``device`` here (the reference always can)."""
    device = torch.device(device)
    spec = AttentionSpec(device, torch.float32, 2, 1, 64, 64)
    return [n for n in BACKENDS if _why_not(get_backend(n), spec) is None]
