"""``FeatureHistory``: each request's target features by position, as runners write them (appends,
positions computed again, gaps), against a plain model of what each position holds."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from treeattn.speculative.features import FeatureHistory, TargetFeatures

WIDTH = 3


@st.composite
def writes(draw):
    """(request, where, rows): ``where`` picks the position relative to the request's span."""
    return draw(st.lists(st.tuples(st.sampled_from("ab"), st.sampled_from(["end", "inside", "before", "gap"]),
                                   st.integers(1, 40), st.integers(0, 1000)), min_size=1, max_size=25))


@settings(max_examples=150, deadline=None)
@given(writes())
def test_history_holds_the_last_write_of_each_position_since_its_start(ops):
    history = FeatureHistory(("final",))
    model: dict[str, tuple[int, list[float]]] = {}  # request -> (start, value of each position from start)
    for request, where, n, salt in ops:
        start, values = model.get(request, (0, []))
        end = start + len(values)
        position = {"end": end, "inside": start + salt % (len(values) + 1), "before": max(start - 1 - salt % 5, 0),
                    "gap": end + 1 + salt % 7}[where]
        new = [float(salt * 100 + i) for i in range(n)]
        if start <= position <= end and request in model:
            model[request] = (start, values[:position - start] + new)
        else:
            model[request] = (position, new)
        history.write(request, position, torch.tensor(new)[:, None].expand(n, WIDTH))
        for name, (first, held) in model.items():
            assert history.end(name) == first + len(held)
            got = history.features([name])
            assert got.starts == [first] and got.seq_ids == [(history.run, name)]
            assert got.rows[0][:, 0].tolist() == held and got.rows[0].shape == (len(held), WIDTH)
            assert got.live == {(history.run, r) for r in model}


def test_forget_frees_a_request_and_target_features_check_their_lengths():
    history = FeatureHistory((0,))
    history.write("a", 4, torch.ones(2, 1))
    history.write("b", 0, torch.ones(3, 1))
    history.forget("a")
    history.forget("never written")  # no error
    assert "a" not in history and history.end("a") is None and history.features(["b"]).live == {(history.run, "b")}
    history.write("c", 0, torch.ones(1, 1))
    history.keep_only({"c": "a runner's live requests"})
    assert "b" not in history and "c" in history
    with pytest.raises(ValueError, match="one feature tensor and start per request, got 1 tensors and 2 starts"):
        TargetFeatures((0,), ["b"], [torch.ones(3, 1)], starts=[0, 1])
    picked = TargetFeatures((0,), ["x", "y"], [torch.ones(3, 1), torch.ones(1, 1)], starts=[5, 0])[[1, 0]]
    assert picked.seq_ids == ["y", "x"] and picked.starts == [0, 5]
