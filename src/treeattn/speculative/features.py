"""Per-position target features for drafters that read more than the last final hidden state.

An EAGLE-3 head reads, at every accepted position, the target's residual stream at a few layer
boundaries; an EAGLE-1/2 head the final-norm hidden state of every accepted position. A drafter says
which with a ``target_features`` attribute (a tuple of *feature layers*: an int ``i`` is boundary
``i``, the input of decoder layer ``i`` (0: the embeddings, ``N``: the last layer's output before the
final norm); ``FINAL`` is the final-norm hidden state), and the runner then passes, as ``hidden``, a
``TargetFeatures``: per context, the features of every position but the last (the root, not run
through the target yet), the chosen layers concatenated in the order given. Drafters without the
attribute keep getting the plain ``[B, hidden_size]`` tensor, and the target computes nothing more.

The runner keeps each request's whole feature history (``FeatureHistory``), not only the rows of the
current step: an ``AdaptiveDrafter`` asks a later source only for some contexts, so a drafter may
skip steps and must catch up, and it can always rebuild a request from scratch. A history may start
after position 0 (``TargetFeatures.starts``): a serving engine that found a prompt's first tokens in
its prefix cache never computed their features. Requests are named by the runner (``seq_ids``), and
``live`` names every request it still runs, so that a drafter can free the state of the others.
"""

from __future__ import annotations

import itertools
import operator
from collections.abc import Hashable, Sequence

import numpy as np
import torch

__all__ = ["FINAL", "FeatureHistory", "TargetFeatures", "check_feature_layers", "wanted_features"]

FINAL = "final"  # the final-norm hidden state (what ``ModelOutput.hidden`` holds), as a feature layer

_RUNS = itertools.count()  # one per FeatureHistory: request names never repeat across runs


def check_feature_layers(layers, num_layers: int) -> tuple:
    """``layers`` as a non-empty tuple of distinct ``FINAL`` / boundary indices in ``[0, num_layers]``."""
    if isinstance(layers, (str, int)) or not isinstance(layers, Sequence) or not layers:
        raise ValueError(f"feature_layers must be a non-empty sequence of layer boundaries (ints) or {FINAL!r}, "
                         f"got {layers!r}")
    for layer in layers:
        ok = layer == FINAL if isinstance(layer, str) else \
            isinstance(layer, (int, np.integer)) and not isinstance(layer, bool) and 0 <= layer <= num_layers
        if not ok:
            raise ValueError(f"feature_layers entries must be {FINAL!r} or layer boundaries in [0, {num_layers}] "
                             f"(the target's num_hidden_layers), got {layer!r}")
    if len(set(layers)) != len(layers):
        raise ValueError(f"feature_layers must be distinct, got {list(layers)}")
    return tuple(layer if isinstance(layer, str) else int(layer) for layer in layers)


def wanted_features(drafter) -> tuple | None:
    """The feature layers ``drafter`` reads (its ``target_features``, or that of an ``AdaptiveDrafter``'s
    sources), or None when it reads the plain hidden states."""
    found = {getattr(d, "target_features", None) for d in (drafter, *getattr(drafter, "sources", ()))} - {None}
    if len(found) > 1:
        raise ValueError(f"the drafter's sources read different target features {sorted(map(str, found))}; "
                         "a runner provides one set")
    return found.pop() if found else None


class TargetFeatures:
    """What a feature-reading drafter gets as ``hidden``: ``rows[i]`` ``[len(contexts[i]) - 1 - starts[i],
    width]`` (position ``p``'s features in row ``p - starts[i]``) of request ``seq_ids[i]``; ``layers``:
    what was concatenated; ``starts``: each request's first position with features (default 0);
    ``live``: every request the runner still runs. ``features[index]`` (a list of positions) keeps
    those contexts, as ``AdaptiveDrafter`` indexes ``hidden``."""

    def __init__(self, layers: tuple, seq_ids: Sequence[Hashable], rows: Sequence[torch.Tensor],
                 live: frozenset | None = None, starts: Sequence[int] | None = None):
        if len(seq_ids) != len(rows) or (starts is not None and len(starts) != len(rows)):
            raise ValueError(f"TargetFeatures needs one feature tensor and start per request, got {len(rows)} "
                             f"tensors and {'no' if starts is None else len(starts)} starts for {len(seq_ids)} seq_ids")
        self.layers, self.seq_ids, self.rows = tuple(layers), list(seq_ids), list(rows)
        self.starts = [0] * len(self.rows) if starts is None else [int(s) for s in starts]
        self.live = frozenset(self.seq_ids) if live is None else live

    def __len__(self) -> int:
        return len(self.seq_ids)

    def __getitem__(self, index) -> TargetFeatures:
        picks = range(len(self))[index] if isinstance(index, slice) else [operator.index(i) for i in index]
        return TargetFeatures(self.layers, [self.seq_ids[i] for i in picks], [self.rows[i] for i in picks], self.live,
                              [self.starts[i] for i in picks])


class FeatureHistory:
    """Each request's features by position, in growing buffers (doubling: appends copy O(1) rows each).

    A request's rows cover positions ``[start, end)``. ``write`` at ``end`` appends; at an earlier
    position (a runner that computes positions again, e.g. vLLM after preempting a request) it
    overwrites from there; past ``end`` (positions whose features were never computed, e.g. a
    prefix-cache hit) the request starts over at that position."""

    def __init__(self, layers: tuple):
        self.layers = layers
        self.run = next(_RUNS)
        self._rows: dict[Hashable, torch.Tensor] = {}
        self._span: dict[Hashable, tuple[int, int]] = {}  # request -> (start, end) positions

    def __contains__(self, request: Hashable) -> bool:
        return request in self._rows

    def write(self, request: Hashable, position: int, rows: torch.Tensor) -> None:
        """Request ``request``'s features of positions ``position, position + 1, ...`` (one per row)."""
        start, end = self._span.get(request, (position, position))
        if not start <= position <= end:
            start = position
        n = position - start
        old = self._rows.get(request)
        if old is None or n + rows.shape[0] > old.shape[0]:
            new = rows.new_empty((max(2 * n, n + rows.shape[0], 16), rows.shape[1]))
            if old is not None and n:
                new[:n] = old[:n]
            self._rows[request] = old = new
        old[n:n + rows.shape[0]] = rows
        self._span[request] = (start, position + rows.shape[0])

    def end(self, request: Hashable) -> int | None:
        """The position after ``request``'s last row (None: it has none)."""
        span = self._span.get(request)
        return None if span is None else span[1]

    def forget(self, request: Hashable) -> None:
        """Drop a request that finished (no error if it has no features)."""
        self._rows.pop(request, None)
        self._span.pop(request, None)

    def keep_only(self, requests) -> None:
        """Forget every request not in ``requests`` (a container: the runner's live requests)."""
        for request in [r for r in self._rows if r not in requests]:
            self.forget(request)

    def features(self, requests: Sequence[Hashable]) -> TargetFeatures:
        """``TargetFeatures`` of ``requests``, named ``(run, request)``; every request held is live."""
        spans = [self._span[r] for r in requests]
        return TargetFeatures(self.layers, [(self.run, r) for r in requests],
                              [self._rows[r][:end - start] for r, (start, end) in zip(requests, spans)],
                              frozenset((self.run, r) for r in self._rows), [start for start, _ in spans])
