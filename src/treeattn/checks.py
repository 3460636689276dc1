"""Argument coercion shared by the public API: ints, reals and integer vectors, taken exactly.

Each helper returns a plain Python / numpy value or raises ``TypeError``/``ValueError`` naming the
argument, and refuses anything a cast would silently change: floats where ints are expected (1.5
must not become 1), bools (``True`` is not a count), unsigned values past int64 (``2**64 - 1`` must
not wrap to -1), strings where numbers are expected.
"""

from __future__ import annotations

import operator
from numbers import Real

import numpy as np
import torch


def as_index(x, name: str) -> int:
    """A Python int from an int-like ``x`` (numpy and 0-d integer tensors too)."""
    if isinstance(x, (bool, np.bool_)):
        raise TypeError(f"{name} must be an int, got a bool")
    try:
        return operator.index(x)
    except TypeError:
        raise TypeError(f"{name} must be an int, got {type(x).__name__} {x!r}") from None


def as_real(x, name: str) -> float:
    """A Python float from a real number (numpy floats and ints too)."""
    if isinstance(x, (bool, np.bool_)) or not isinstance(x, Real):
        raise TypeError(f"{name} must be a real number, got {type(x).__name__} {x!r}")
    return float(x)


def int_vector(x, name: str) -> np.ndarray:
    """``x`` (list, numpy array, tensor) as a 1-D int64 numpy array."""
    if isinstance(x, torch.Tensor):
        if x.is_floating_point() or x.is_complex() or x.dtype == torch.bool:
            raise TypeError(f"{name} must hold integers, got dtype {x.dtype}")
        x = x.detach().cpu().numpy()
    elif isinstance(x, (list, tuple)):  # numpy would read a bool among ints as 0 or 1
        flags = [i for i, v in enumerate(x) if isinstance(v, (bool, np.bool_))]
        if flags:
            raise TypeError(f"{name}[{flags[0]}] must be an int, got a bool")
    try:
        arr = np.asarray(x)
    except ValueError:  # numpy's "inhomogeneous shape": a nested list of unequal lengths
        raise ValueError(f"{name} must be a 1-D sequence of ints, got a ragged nested sequence") from None
    if arr.ndim == 0:
        raise TypeError(f"{name} must be a 1-D sequence of ints, got {type(x).__name__}")
    if arr.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape {tuple(arr.shape)}")
    if arr.size == 0:
        return np.zeros(0, dtype=np.int64)
    if not np.issubdtype(arr.dtype, np.integer):
        raise TypeError(f"{name} must hold integers, got {arr.dtype}")
    if arr.dtype == np.uint64:  # the int64 cast would wrap 2**64 - 1 to -1
        big = np.flatnonzero(arr > np.iinfo(np.int64).max)
        if big.size:
            raise ValueError(f"{name}[{int(big[0])}] = {int(arr[big[0]])} is outside the int64 range")
    return arr.astype(np.int64, copy=False)
