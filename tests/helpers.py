"""Shared test cases: everything in ``treeattn.testing`` plus hypothesis strategies."""

from __future__ import annotations

from hypothesis import strategies as st

from treeattn.testing import *  # noqa: F403
from treeattn.testing import LSE_RTOL, MIXED, TOL, Batch, Request  # noqa: F401  (explicit for linters)


@st.composite
def parent_arrays(draw, min_size: int = 1, max_size: int = 64, forests: bool = True) -> list[int]:
    """Hypothesis strategy: valid parent arrays (forests when ``forests``)."""
    n = draw(st.integers(min_size, max_size))
    parents = []
    for i in range(n):
        lo = -1 if (forests or i == 0) else 0
        parents.append(draw(st.integers(lo, i - 1)) if i else -1)
    return parents
