"""Linear layers on oneDNN-prepacked weights (``treeattn.packed_linear.pack_linears``): exact to float32 rounding
against float64 references, tied weights stay tied, repacked when the weight changes, autograd
untouched, and speculative decoding on a packed model still equals greedy.

Budget: ~5 s on 2 cores.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.helpers import VOCAB, tiny_hf
from treeattn.hf import HFTreeModel
from treeattn.packed_linear import PackedLinear, pack_linears
from treeattn.speculative.drafters import NGramDrafter
from treeattn.speculative.generate import generate

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="PyTorch built without oneDNN")


def reference(x, linear):
    out = x.double() @ linear.weight.double().t()
    return out if linear.bias is None else out + linear.bias.double()


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("rows", [1, 2, 7, 16, 33, 130])
def test_packed_linear_matches_float64(rows, bias):
    torch.manual_seed(rows)
    linear = nn.Linear(96, 200, bias=bias)
    packed = PackedLinear.of(linear)
    assert packed.weight is linear.weight and packed._packed is not None
    x = torch.randn(rows, 96)
    with torch.inference_mode():
        got = packed(x)
        got3 = packed(x.reshape(1, rows, 96))
    torch.testing.assert_close(got.double(), reference(x, linear), atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(got3[0], got)


def test_a_changed_weight_is_repacked_and_an_unpackable_one_falls_back():
    linear = nn.Linear(64, 32)
    packed = PackedLinear.of(linear)
    x = torch.randn(3, 64)
    with torch.no_grad():
        linear.weight.mul_(-2.0)  # in place: the packed copy is stale
        torch.testing.assert_close(packed(x).double(), reference(x, linear), atol=1e-4, rtol=1e-5)
        packed.double()  # a dtype oneDNN does not pack: F.linear
        torch.testing.assert_close(packed(x.double()), reference(x, packed), atol=1e-10, rtol=1e-10)


def test_a_weight_written_through_data_is_seen_after_repack():
    linear = nn.Linear(64, 32)
    model = nn.Sequential(linear)
    pack_linears(model)
    x = torch.randn(3, 64)
    linear.weight.data.copy_(torch.randn(32, 64))  # bypasses the version counter
    model[0].repack()
    with torch.inference_mode():
        torch.testing.assert_close(model(x).double(), reference(x, linear), atol=1e-4, rtol=1e-5)
    linear.weight.data.mul_(3.0)
    assert pack_linears(model) == 0  # repacks the layers already packed
    with torch.inference_mode():
        torch.testing.assert_close(model(x).double(), reference(x, linear), atol=1e-4, rtol=1e-5)


def test_a_plain_constructed_layer_packs_lazily_and_hooked_layers_are_left_alone():
    torch.manual_seed(0)
    lazy = PackedLinear(16, 8).eval()
    x = torch.randn(2, 16)
    with torch.inference_mode():
        torch.testing.assert_close(lazy(x).double(), reference(x, lazy), atol=1e-5, rtol=1e-5)
    hooked = nn.Sequential(nn.Linear(16, 8).eval(), nn.Linear(8, 4))
    hooked[0].register_forward_hook(lambda *args: None)
    assert pack_linears(hooked) == 1 and type(hooked[0]) is nn.Linear and isinstance(hooked[1], PackedLinear)
    assert not hooked[1].training or hooked.training  # the layer keeps its train/eval mode
    plain = nn.Linear(16, 8).eval()
    assert PackedLinear.of(plain).training is False


def test_skipped_modules_and_everything_inside_them_are_left_alone():
    shared = nn.Sequential(nn.Linear(16, 8), nn.Sequential(nn.Linear(8, 8)))  # e.g. another model's layers
    model = nn.Sequential(nn.Linear(16, 16), shared, nn.Linear(8, 4))
    assert pack_linears(model, skip=[shared]) == 2
    assert isinstance(model[0], PackedLinear) and isinstance(model[2], PackedLinear)
    assert type(shared[0]) is nn.Linear and type(shared[1][0]) is nn.Linear and model[1] is shared


def test_a_trainable_bias_gets_its_gradient():
    linear = nn.Linear(16, 8)
    linear.weight.requires_grad_(False)  # BitFit: only biases train
    packed = PackedLinear.of(linear)
    packed(torch.randn(4, 16)).sum().backward()
    torch.testing.assert_close(linear.bias.grad, torch.full((8,), 4.0))


def test_autograd_runs_through_f_linear():
    torch.manual_seed(0)
    linear = nn.Linear(16, 8)
    packed = PackedLinear.of(linear)
    x = torch.randn(4, 16, requires_grad=True)
    packed(x).square().sum().backward()
    want = x.detach().clone().requires_grad_()
    nn.functional.linear(want, linear.weight.detach(), linear.bias.detach()).square().sum().backward()
    torch.testing.assert_close(x.grad, want.grad)
    assert linear.weight.grad is not None


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_packed_model_logits_and_tied_weights(kind):
    plain, model = tiny_hf(kind), tiny_hf(kind)
    linears = sum(type(m) is nn.Linear for m in model.modules())
    assert pack_linears(model) == linears and pack_linears(model) == 0  # packed once
    assert all(type(m) is not nn.Linear for m in model.modules())
    head = model.get_output_embeddings()
    assert isinstance(head, PackedLinear)
    if model.config.tie_word_embeddings:
        assert head.weight is model.get_input_embeddings().weight
    ids = torch.randint(0, VOCAB, (2, 11), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        torch.testing.assert_close(model(ids).logits, plain(ids).logits, atol=2e-5, rtol=1e-4)


def test_speculative_decoding_on_a_packed_model_equals_greedy():
    hf = tiny_hf("llama")
    pack_linears(hf)
    model = HFTreeModel(hf)
    prompts = [[5, 6, 7, 5, 6, 7, 5, 6], [9, 3, 9, 3, 9]]
    plain = generate(model, prompts, max_new_tokens=24)
    spec = generate(model, prompts, max_new_tokens=24, drafter=NGramDrafter(8))
    assert spec.tokens == plain.tokens
    with torch.no_grad():
        want = tiny_hf("llama").generate(torch.tensor([prompts[0]]), max_new_tokens=24, do_sample=False)
    assert plain.tokens[0] == want[0, len(prompts[0]):].tolist()
