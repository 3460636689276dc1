"""The oracle for per-position target features: HF's own hidden states (no hypothesis, no vLLM: both venvs
import it)."""

from __future__ import annotations

import torch

from treeattn.speculative import FINAL


def reference_features(hf_model, context, layers) -> torch.Tensor:
    """The target's features of every position of ``context``, straight from HF: ``hidden_states[i]`` is
    boundary ``i < N``, the last layer's own output boundary ``N``, ``hidden_states[N]`` the final norm's."""
    captured = []
    hook = hf_model.model.layers[-1].register_forward_hook(lambda _m, _a, out: captured.append(out))
    try:
        with torch.no_grad():
            states = hf_model(torch.tensor([list(context)]), output_hidden_states=True).hidden_states
    finally:
        hook.remove()
    n = hf_model.config.num_hidden_layers
    pick = {FINAL: states[n][0], n: captured[0][0]}
    return torch.cat([pick[layer] if layer in pick else states[layer][0] for layer in layers], dim=-1)
