"""Weight-only int8 linears (a drafter's decoding kernel on CPU): the product by the dequantized
weight, close to the float layer's, float gradients when training, and the one-line refusals."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from bastion.models.int8_linear import Int8Linear, int8_weights, quantize_linears, quantize_weight
from tests.helpers import assert_trains_like_linear


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 3, 8])
def test_int8_linear_multiplies_by_its_dequantized_weight(dtype, bias, rows):
    torch.manual_seed(0)
    linear = nn.Linear(96, 200, bias=bias).to(dtype)
    int8 = Int8Linear(linear)
    assert int8.int8.dtype == torch.int8 and int8.scales.shape == (200,) and int8.weight is linear.weight
    x = torch.randn(2, rows, 96, dtype=dtype)
    with torch.inference_mode():
        out = int8(x)
        dequantized = F.linear(x.float(), int8.int8.float() * int8.scales.float()[:, None], None if linear.bias is None else linear.bias.float())
    assert out.dtype == dtype and out.shape == (2, rows, 200)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), dequantized.float(), rtol=tol, atol=tol)
    # and within the rounding of one int8 step per weight of the float layer
    step = (linear.weight.float().abs().amax(1) / 127)[None, None, :]
    bound = 0.5 * step * x.float().abs().sum(-1, keepdim=True) + tol
    assert ((out.float() - linear(x).float()).abs() <= bound).all()


def test_quantize_weight_keeps_each_rows_largest_weight_exact():
    weight = torch.tensor([[0.5, -1.0, 0.25], [3.0, 0.0, -1.5], [0.0, 0.0, 0.0]])
    int8, scales = quantize_weight(weight)
    assert int8.abs().amax(1).tolist() == [127, 127, 0]
    torch.testing.assert_close(int8[:2].float() * scales[:2, None], weight[:2], rtol=0, atol=float(scales.max()) / 2)


def test_int8_linear_trains_like_linear():
    assert_trains_like_linear(Int8Linear)


def test_quantize_linears_swaps_every_linear_and_keeps_the_state_dict():
    model = nn.Sequential(nn.Linear(8, 8), nn.SiLU(), nn.Linear(8, 4, bias=False))
    keys = model.state_dict().keys()
    quantize_linears(model)
    assert type(model[0]) is Int8Linear and type(model[2]) is Int8Linear and model.state_dict().keys() == keys


def test_int8_weights_auto_runs_where_the_kernel_is_fast_and_true_is_refused_where_it_does_not_run():
    assert int8_weights("auto", nn.Linear(4, 4).bfloat16()) and int8_weights("auto", nn.Linear(4, 4).half())
    assert not int8_weights("auto", nn.Linear(4, 4))  # float32 activations: the kernel's slow path
    assert int8_weights(True, nn.Linear(4, 4))  # but it runs, when asked for
    assert not int8_weights("auto", nn.Linear(4, 4).double()) and not int8_weights(False, nn.Linear(4, 4))
    with pytest.raises(ValueError, match="drafter.int8=true needs a drafter on a CPU in float32, bfloat16 or float16"):
        int8_weights(True, nn.Linear(4, 4).double())
    with pytest.raises(ValueError, match="drafter.int8 must be true, false or auto"):
        int8_weights("yes", nn.Linear(4, 4))
