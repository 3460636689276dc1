"""RoPE against float64 formulas written independently from tvm-semantics.md §4."""

import math

import numpy as np
import pytest
import torch

import treeattn

D = 64
LLAMA = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 512}


def expected_angles(kind: str, p: dict, positions, theta: float, scale: float, d: int = D):
    """[L, d] float64 angles and the cos/sin multiplier, straight from the spec's formulas."""
    j = np.arange(d)
    s = np.asarray(positions, dtype=np.float64)[:, None] * scale
    e_mod = (2 * j % d) / d
    mu = 1.0
    if kind == "default":
        g = theta ** -e_mod
    elif kind == "gptj":
        g = theta ** -((2 * (j // 2)) % d / d)
    elif kind in ("llama3", "llama4"):
        f0 = theta ** -(e_mod if kind == "llama3" else 2 * (j // 2) / d)
        F, lf, hf, L = p["factor"], p["low_freq_factor"], p["high_freq_factor"], p["original_max_position_embeddings"]
        if kind == "llama4" and lf == hf:
            g = np.where(2 * math.pi / f0 > L / lf, f0 / F, f0)
        else:
            sigma = np.clip(L / (2 * math.pi) / (hf - lf) * f0 - lf / (hf - lf), 0, 1)
            g = (1 - sigma) * f0 / F + sigma * f0
    elif kind == "longrope":
        g = theta ** -e_mod
        ratio = p["max_position_embeddings"] / p["original_max_position_embeddings"]
        mu = math.sqrt(1 + math.log(ratio) / math.log(p["original_max_position_embeddings"])) if ratio > 1 else 1.0
    elif kind == "yarn":
        F, L = p["factor"], p["original_max_position_embeddings"]
        inv_log = 1 / (2 * math.log(theta))
        f_x = theta ** -e_mod
        low = max(d * math.log(L / (p["beta_fast"] * 2 * math.pi)) * inv_log, 0)
        high = min(d * math.log(L / (p["beta_slow"] * 2 * math.pi)) * inv_log, d - 1)
        if low == high:
            high += 0.001
        mask = 1 - np.clip((j - low) / (high - low), 0, 1)  # the full-index ramp (TVM's quirk)
        g = f_x / F * (1 - mask) + f_x * mask
    return s * g[None, :], mu


CASES = [
    ("default", {}),
    ("gptj", {"rope_type": "gptj"}),
    ("llama3", {"rope_type": "llama3", **LLAMA}),
    ("llama4", {"rope_type": "llama4", **LLAMA}),
    ("llama4", {"rope_type": "llama4", **LLAMA, "high_freq_factor": 1.0}),
    ("longrope", {"rope_type": "longrope", "max_position_embeddings": 8192, "original_max_position_embeddings": 512}),
    ("longrope", {"rope_type": "longrope", "max_position_embeddings": 256, "original_max_position_embeddings": 512}),
    ("yarn", {"rope_type": "yarn", "factor": 4.0, "beta_fast": 32, "beta_slow": 1, "original_max_position_embeddings": 512}),
]


@pytest.mark.parametrize("kind,scaling", CASES, ids=lambda c: str(c) if isinstance(c, str) else "")
@pytest.mark.parametrize("theta,scale", [(1e4, 1.0), (5e5, 0.5)])
def test_rotation_matches_spec_formula(kind, scaling, theta, scale):
    gen = torch.Generator().manual_seed(1)
    positions = torch.tensor([0, 1, 7, 100, 1000, 4095, 30000], dtype=torch.int32)
    x = torch.randn(len(positions), 3, D, generator=gen)
    y = treeattn.RoPE(theta, scale, scaling).apply(x, positions)
    angle, mu = expected_angles(kind, scaling, positions.numpy(), theta, scale)
    xd = x.double().numpy()
    half = D // 2
    partner = np.concatenate([-xd[..., half:], xd[..., :half]], axis=-1)
    expected = mu * np.cos(angle)[:, None] * xd + mu * np.sin(angle)[:, None] * partner
    # fp32 angles at position p carry ~p * 6e-8 rad of rounding: the tolerance grows with it
    np.testing.assert_allclose(y.double().numpy(), expected, atol=3e-3 * mu * 4, rtol=0)
    np.testing.assert_allclose(y[:4].double().numpy(), expected[:4], atol=2e-5 * mu * 4, rtol=0)


def test_default_equals_hf_rotate_half():
    d, theta = 32, 10000.0
    pos = torch.arange(50)
    x = torch.randn(50, 2, d, dtype=torch.float64).float()
    inv_freq = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    emb = torch.cat([pos[:, None] * inv_freq, pos[:, None] * inv_freq], dim=-1)
    rotate_half = torch.cat([-x[..., d // 2:], x[..., : d // 2]], dim=-1).double()
    expected = x.double() * emb.cos()[:, None] + rotate_half * emb.sin()[:, None]
    torch.testing.assert_close(treeattn.RoPE(theta).apply(x, pos).double(), expected, atol=2e-5, rtol=0)


def test_rounds_to_storage_dtype_after_fp32_rotation():
    pos = torch.tensor([3, 900, 5000])
    x = torch.randn(3, 2, 16).half()
    rope = treeattn.RoPE(10000.0)
    y = rope.apply(x, pos)
    assert y.dtype == torch.float16
    assert torch.equal(y, rope.apply(x.float(), pos).half())


def test_yarn_default_inv_theta_log_scale_is_tvm_fill():
    rope = treeattn.RoPE(5e5, 1.0, {"rope_type": "yarn", "factor": 4.0, "beta_fast": 32, "beta_slow": 1,
                                   "original_max_position_embeddings": 512})
    assert rope.scaling["inv_theta_log_scale"] == pytest.approx(1 / (2 * math.log(5e5)))


@pytest.mark.parametrize("kwargs,message", [
    ({"scaling": {"rope_type": "dynamic"}}, "not supported"),
    ({"scaling": {"rope_type": "llama3", "factor": 8.0}}, "missing"),
    ({"scaling": {"rope_type": "llama3", **LLAMA, "high_freq_factor": 1.0}}, "high_freq_factor != low_freq_factor"),
    ({"scaling": {"rope_type": "yarn", "factor": 2.0}}, "missing beta_fast"),
    ({"scaling": {"rope_type": "yarn", "factor": 2.0, "beta_fast": 0, "beta_slow": 1,
                  "original_max_position_embeddings": 512}}, r"scaling\['beta_fast'\] must be a finite number > 0"),
    ({"scaling": {"rope_type": "llama4", **LLAMA, "factor": float("inf")}}, r"scaling\['factor'\]"),
    ({"scaling": {"rope_type": "longrope", "max_position_embeddings": 4096, "original_max_position_embeddings": 1}},
     "original_max_position_embeddings > 1"),
    ({"theta": 0.5}, "theta"),
    ({"scale": 0.0}, "scale"),
])
def test_bad_configs_are_clear_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        treeattn.RoPE(**kwargs)


def test_odd_head_dim_is_rejected():
    with pytest.raises(ValueError, match="even head dim"):
        treeattn.RoPE().apply(torch.randn(2, 1, 5), torch.tensor([0, 1]))


YARN = {"rope_type": "yarn", "factor": 4.0, "beta_fast": 32, "beta_slow": 1, "original_max_position_embeddings": 512}


@pytest.mark.parametrize("kwargs,error,message", [
    ({"scaling": {"rope_type": "llama3", **LLAMA, "factor": "8"}}, TypeError, r"scaling\['factor'\] must be a real number"),
    ({"scaling": {"rope_type": "llama3", **LLAMA, "factor": True}}, TypeError, r"scaling\['factor'\] must be a real"),
    ({"scaling": {**YARN, "inv_theta_log_scale": float("nan")}}, ValueError, r"scaling\['inv_theta_log_scale'\]"),
    ({"scaling": {**YARN, "inv_theta_log_scale": -1.0}}, ValueError, r"scaling\['inv_theta_log_scale'\]"),
    ({"theta": "1e4"}, TypeError, "theta must be a real number"),
    ({"theta": True}, TypeError, "theta must be a real number"),
    ({"scale": None}, TypeError, "scale must be a real number"),
    ({"theta": float("nan")}, ValueError, "theta must be a finite number > 1"),
    ({"scaling": [("rope_type", "llama3")]}, TypeError, "scaling must be a dict"),
])
def test_bad_numbers_are_typed_errors(kwargs, error, message):
    """Issue 15 defect 8: a yarn log scale of NaN gave NaN output; non-numbers now fail as TypeError."""
    with pytest.raises(error, match=message):
        treeattn.RoPE(**kwargs)


def test_numpy_scalars_are_numbers():
    """Issue 15 defect 8: np.float32 theta was rejected with a message saying it was not finite."""
    rope = treeattn.RoPE(np.float32(5e5), np.float64(0.5), {**YARN, "factor": np.float32(4.0), "beta_fast": np.int64(32)})
    assert rope == treeattn.RoPE(5e5, 0.5, YARN)
    assert type(rope.theta) is float and type(rope.scaling["factor"]) is float
    x, pos = torch.randn(3, 2, 16), torch.tensor([0, 5, 9])
    assert torch.equal(rope.apply(x, pos), treeattn.RoPE(5e5, 0.5, YARN).apply(x, pos))


@pytest.mark.parametrize("x,positions,error,message", [
    (torch.randn(3, 16), torch.tensor([0, 1, 2]), ValueError, r"x must be 3-D \[L, H, d\], got shape \(3, 16\)"),
    (torch.randn(1, 3, 3, 16), torch.tensor([0]), ValueError, "x must be 3-D"),
    (torch.arange(48).reshape(3, 1, 16), torch.tensor([0, 1, 2]), TypeError, "x must be a float tensor"),
    (torch.randn(3, 1, 16), torch.tensor([0.0, 1.5, 2.0]), TypeError, "positions must be an integer tensor"),
    (torch.randn(3, 1, 16), torch.tensor([True, False, True]), TypeError, "positions must be an integer tensor"),
    (torch.randn(3, 1, 16), [0, 1, 2], TypeError, "positions must be an integer tensor"),
    (torch.randn(3, 1, 16), torch.tensor([[0, 1, 2]]), ValueError, "positions must be 1-D"),
    (torch.randn(3, 1, 16), torch.tensor([0, 1]), ValueError, r"positions must have shape \[3\]"),
])
def test_apply_checks_its_inputs(x, positions, error, message):
    """Issue 15 defect 8: apply on a 2-D [3, 16] tensor returned a [3, 3, 16] result, and
    fractional positions were silently accepted."""
    with pytest.raises(error, match=message):
        treeattn.RoPE().apply(x, positions)


def test_tiny_positive_values_and_large_positions_stay_finite():
    rope = treeattn.RoPE(1e4, 1e-30)
    y = rope.apply(torch.randn(2, 1, 8), torch.tensor([0, 10**6]))
    assert torch.isfinite(y).all()
