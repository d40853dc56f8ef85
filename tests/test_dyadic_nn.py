"""Integer layers, loss and optimizer: clipping, the straight-through gradient with its clip mask,
the scale bookkeeping of a 3-layer network against hand-computed scales, overflow detection, and
the optimizer's shifts against torch.optim.SGD."""

import math
import warnings
from fractions import Fraction

import pytest
import torch

from lpsim import dyadic
from lpsim.dyadic import DyadicOverflowWarning, DyadicTensor
from lpsim.dyadic import nn as inn
from lpsim.dyadic.optim import SGD


def _int(values, dtype=torch.int32):
    return torch.tensor(values, dtype=dtype)


# ---- clipping and the gradient mask -------------------------------------------------------------


def test_requantize_clips_at_qmin_and_qmax_of_8_bit_signed():
    v = _int([-1000, -129, -128, -1, 0, 127, 128, 1000])
    out = dyadic.requantize(DyadicTensor(v, 3), 3, 8, signed=True)
    assert out.value.mantissa.tolist() == [-128, -128, -128, -1, 0, 127, 127, 127]
    assert out.clipped.tolist() == [True, True, False, False, False, False, True, True]


def test_requantize_clips_at_qmin_and_qmax_of_8_bit_unsigned():
    v = _int([-1000, -1, 0, 255, 256, 1000])
    out = dyadic.requantize(DyadicTensor(v, 0), 0, 8, signed=False)
    assert out.value.mantissa.tolist() == [0, 0, 0, 255, 255, 255]
    assert out.clipped.tolist() == [True, True, False, False, True, True]


def test_clip_after_rounding_up_to_qmax_plus_one_is_flagged():
    # 255 / 2 = 127.5 rounds (nearest, ties to even) to 128 = Qmax + 1: clipped to 127 and flagged.
    x = DyadicTensor(_int([255, 253]), 1)
    out = dyadic.requantize(x, 0, 8, rounding="nearest")
    assert out.value.mantissa.tolist() == [127, 126] and out.clipped.tolist() == [True, False]


def test_left_shift_clips_exactly_at_the_range():
    x = DyadicTensor(_int([1, -1, 2, 3, 0]), 0)
    out = dyadic.requantize(x, 6, 8, rounding="nearest")  # times 64
    assert out.value.mantissa.tolist() == [64, -64, 127, 127, 0]
    assert out.clipped.tolist() == [False, False, True, True, False]
    far = dyadic.requantize(DyadicTensor(_int([-1, 1]), 0), 63, 64, rounding="nearest")
    assert far.value.mantissa.tolist() == [-(2**63), 2**63 - 1]  # -2**63 fits exactly
    assert far.clipped.tolist() == [False, True]


def test_linear_backward_zeroes_the_gradient_where_the_forward_clip_fired():
    # W = identity with mantissa 64 at scale 6; x = [1, 2] at scale 0: acc = [64, 128] at scale 6.
    # With no forward shift the 8-bit output clips 128 to 127, so that output passes no gradient.
    layer = inn.Linear(
        2,
        2,
        bias=False,
        weight=torch.eye(2),
        weight_bits=8,
        headroom=0,
        forward_shift=0,
        backward_shift=0,
        rounding="nearest",
    )
    assert layer.weight.value.scale == 6
    assert layer.weight.value.mantissa.tolist() == [[64, 0], [0, 64]]
    y = layer(DyadicTensor(_int([[1, 2]]), 0))
    assert y.mantissa.tolist() == [[64, 127]] and y.scale == 6
    assert layer.stats.forward_clamps == 1
    dx = layer.backward(DyadicTensor(_int([[1, 1]]), 0))
    # g' = [1, 0]: dW = g'^T x = [[1, 2], [0, 0]] at scale 0; dx = g' W = [64, 0] at scale 6.
    assert layer.weight.grad.mantissa.tolist() == [[1, 2], [0, 0]] and layer.weight.grad.scale == 0
    assert dx.mantissa.tolist() == [[64, 0]] and dx.scale == 6


def test_relu_passes_the_gradient_only_where_the_input_was_positive():
    relu = inn.ReLU()
    y = relu(DyadicTensor(_int([[-3, 0, 5, 2]]), 4))
    assert y.mantissa.tolist() == [[0, 0, 5, 2]] and y.scale == 4
    g = relu.backward(DyadicTensor(_int([[7, 7, 7, -7]]), 9))
    assert g.mantissa.tolist() == [[0, 0, 7, -7]] and g.scale == 9


# ---- scale bookkeeping --------------------------------------------------------------------------


def _three_layers(forward_shifts, backward_shifts, **options):
    gen = torch.Generator().manual_seed(0)

    def weight(rows, cols, peak):  # uniform weights whose largest magnitude is exactly `peak`
        w = (torch.rand(rows, cols, generator=gen) * 2 - 1) * peak * 0.9
        w[0, 0] = peak
        return w

    sizes, peaks = [(4, 8), (8, 8), (8, 3)], [0.5, 0.75, 1.5]
    layers = []
    for (fan_in, fan_out), peak, fwd, bwd in zip(sizes, peaks, forward_shifts, backward_shifts):
        layers.append(
            inn.Linear(
                fan_in,
                fan_out,
                weight=weight(fan_out, fan_in, peak),
                bias_value=torch.full((fan_out,), peak / 4),
                forward_shift=fwd,
                backward_shift=bwd,
                **options,
            )
        )
        layers.append(inn.ReLU())
    return inn.Sequential(*layers[:-1])


def test_three_layer_scale_bookkeeping_matches_hand_computation():
    # Parameter scales, 16-bit with 2 bits of headroom: peak 0.5 and 0.75 have floor(log2) = -1,
    # so 16 - 2 + 1 - 2 = 13; peak 1.5 has floor(log2) = 0, so 12.
    model = _three_layers(forward_shifts=(14, 12, 11), backward_shifts=(9, 8, 7))
    l1, l2, l3 = model.modules[0], model.modules[2], model.modules[4]
    assert [m.weight.value.scale for m in (l1, l2, l3)] == [13, 13, 12]
    assert [m.bias.value.scale for m in (l1, l2, l3)] == [13, 13, 12]
    x = dyadic.from_float(torch.linspace(-2, 2, 16).reshape(4, 4), 8, scale=4).value
    y = model(x)
    # Forward: s_y = s_x + s_W - k_f: 4 + 13 - 14 = 3, 3 + 13 - 12 = 4, 4 + 12 - 11 = 5.
    assert y.scale == 5
    assert [m.stats.forward_shifts for m in (l1, l2, l3)] == [[14], [12], [11]]
    dx = model.backward(DyadicTensor(torch.ones(4, 3, dtype=torch.int32), 11))
    # Backward from g at scale 11, each layer's input scale being 4, 3, 4 (L1, L2, L3):
    #   L3: dW = 11 + 4 = 15, db = 11, dx = 11 + 12 - 7 = 16
    #   L2: dW = 16 + 3 = 19, db = 16, dx = 16 + 13 - 8 = 21
    #   L1: dW = 21 + 4 = 25, db = 21, dx = 21 + 13 - 9 = 25
    assert [m.weight.grad.scale for m in (l3, l2, l1)] == [15, 19, 25]
    assert [m.bias.grad.scale for m in (l3, l2, l1)] == [11, 16, 21]
    assert dx.scale == 25
    assert [m.stats.backward_shifts for m in (l1, l2, l3)] == [[9], [8], [7]]


def test_three_layer_forward_and_backward_approximate_float_autograd():
    # Wide integers (16-bit activations and errors, 64-bit accumulators) and nearest rounding:
    # the integer pass must then agree with float64 autograd on the same quantised parameters to
    # about 2**-12 relative, which catches any transposed, mis-scaled or mis-masked product.
    model = _three_layers(
        (None,) * 3,
        (None,) * 3,
        activation_bits=16,
        error_bits=16,
        accumulator_bits=64,
        rounding="nearest",
    )
    x = dyadic.from_float(torch.linspace(-2, 2, 16).reshape(4, 4), 16, rounding="nearest").value
    g = dyadic.from_float(torch.linspace(-1, 1, 12).reshape(4, 3), 16, rounding="nearest").value
    y = model(x)
    dx = model.backward(g)

    params = [
        (
            m.weight.value.to_float(torch.float64).requires_grad_(),
            m.bias.value.to_float(torch.float64).requires_grad_(),
        )
        for m in model.modules[::2]
    ]
    xf = x.to_float(torch.float64).requires_grad_()
    h = xf
    for i, (w, b) in enumerate(params):
        h = h @ w.T + b
        h = torch.relu(h) if i < 2 else h
    h.backward(g.to_float(torch.float64))

    def close(got: DyadicTensor, want: torch.Tensor):
        scale = want.abs().max().item()
        assert (got.to_float(torch.float64) - want).abs().max().item() <= 2**-12 * scale

    close(y, h.detach())
    close(dx, xf.grad)
    for m, (w, b) in zip(model.modules[::2], params):
        close(m.weight.grad, w.grad)
        close(m.bias.grad, b.grad)


def test_eval_mode_rounds_to_nearest_and_records_nothing():
    model = _three_layers((None,) * 3, (None,) * 3)
    x = dyadic.from_float(torch.linspace(-2, 2, 16).reshape(4, 4), 8).value
    model.eval()
    one, two = model(x), model(x)
    assert torch.equal(one.mantissa, two.mantissa)
    assert all(not s.forward_shifts for s in model.stats().values())
    with pytest.raises(RuntimeError, match="backward\\(\\) runs in training mode only"):
        model.backward(one)


@pytest.mark.parametrize("layer", [inn.Linear, inn.ReLU])
def test_backward_after_an_eval_forward_refuses_to_differentiate_the_earlier_training_input(layer):
    # An eval() forward keeps nothing: a backward then would use the input of the training forward
    # before it (x, not the last input -x) and record statistics; it raises, in eval mode and
    # after train() until a training forward.
    module = layer(4, 3) if layer is inn.Linear else layer()
    x = dyadic.from_float(torch.linspace(-2, 2, 8).reshape(2, 4), 8).value
    out = module(x)
    module.eval()
    module(x.with_mantissa(-x.mantissa))
    with pytest.raises(RuntimeError, match="backward\\(\\) runs in training mode only"):
        module.backward(out)
    module.train()
    with pytest.raises(RuntimeError, match="backward\\(\\) needs a forward\\(\\) first"):
        module.backward(out)
    if layer is inn.Linear:
        assert module.stats.backward_shifts == [] and module.weight.grad is None


@pytest.mark.parametrize("changed", ["input", "weight"])
def test_linear_backward_refuses_an_input_or_weight_changed_in_place_since_its_forward(changed):
    # backward differentiates the last forward(): an input (or weight) mantissa written in place
    # in between would give dW = g^T x and dx = g W of other values than the forward's, silently.
    # As torch's autograd, backward raises instead.
    layer = inn.Linear(2, 2, bias=False, weight=torch.tensor([[1.0, -2.0], [0.5, 1.0]]))
    x = DyadicTensor(_int([[1, 2], [3, 4]]), 0)
    out = layer(x)
    (x.mantissa if changed == "input" else layer.weight.value.mantissa).add_(1)
    with pytest.raises(RuntimeError, match=f"{changed} of the last forward.*changed in place"):
        layer.backward(out)
    with torch.inference_mode():  # inference tensors keep no version counter: nothing to check
        out = layer(DyadicTensor(_int([[1, 2], [3, 4]]), 0))
        assert layer.backward(out).shape == (2, 2)


def test_linear_backward_takes_the_weight_of_its_forward_when_the_value_was_replaced_since():
    # dx = g W is the gradient of the forward's product, with the weight the forward used: an
    # optimizer step (which replaces the parameter's value) between forward and backward must
    # not change it.
    weight = torch.tensor([[1.0, -2.0], [0.5, 1.0]])
    options = dict(bias=False, weight=weight, rounding="nearest", backward_shift=0, error_bits=16)
    replaced, kept = inn.Linear(2, 2, **options), inn.Linear(2, 2, **options)
    x = DyadicTensor(_int([[1, 2], [3, 4]]), 0)
    g = DyadicTensor(_int([[1, -1], [2, 3]]), 0)
    replaced(x), kept(x)
    forward_weight = replaced.weight.value.mantissa.tolist()
    replaced.weight.value = replaced.weight.value.with_mantissa(-replaced.weight.value.mantissa)
    dx = replaced.backward(g).mantissa.tolist()
    expected = [
        [sum(r[o] * forward_weight[o][i] for o in range(2)) for i in range(2)]
        for r in g.mantissa.tolist()
    ]
    assert dx == expected == kept.backward(g).mantissa.tolist()


def test_a_second_backward_without_zero_grad_raises_instead_of_dropping_the_first_gradient():
    # torch's autograd adds a second backward's gradients to .grad (gradient accumulation over
    # micro-batches). Integer backward() sets them: a second one over a kept gradient would keep
    # only the last micro-batch's, silently. It raises; after zero_grad() it gives gᵀx again.
    layer = inn.Linear(2, 2, weight=torch.tensor([[1.0, -2.0], [0.5, 1.0]]), bias_value=None)
    opt = SGD(layer.parameters(), lr_shift=0)
    x = DyadicTensor(_int([[1, 2], [3, 4]]), 0)
    g = DyadicTensor(_int([[1, -1], [2, 3]]), 0)
    layer(x)
    layer.backward(g)
    first = layer.weight.grad.mantissa.clone()
    layer(x)
    with pytest.raises(RuntimeError, match=r"\['weight', 'bias'\] still hold one.*zero_grad"):
        layer.backward(g)
    opt.zero_grad()
    layer.backward(g)
    rows = list(zip(g.mantissa.tolist(), x.mantissa.tolist()))
    expected = [[sum(gr[o] * xr[i] for gr, xr in rows) for i in range(2)] for o in range(2)]
    assert layer.weight.grad.mantissa.tolist() == first.tolist() == expected


def test_sequential_names_parameters_by_position():
    model = _three_layers((None,) * 3, (None,) * 3)
    assert [p.name for p in model.parameters()] == [
        "0.weight",
        "0.bias",
        "2.weight",
        "2.bias",
        "4.weight",
        "4.bias",
    ]


def _named_as_torch(torch_model: torch.nn.Module) -> list[str]:
    return [name for name, _ in torch_model.named_parameters()]


def test_sequential_names_parameters_as_torch_nn_sequential_does_however_often_wrapped():
    layers = [inn.Linear(2, 2), inn.ReLU(), inn.Linear(2, 2, bias=False)]
    twins = [torch.nn.Linear(2, 2), torch.nn.ReLU(), torch.nn.Linear(2, 2, bias=False)]
    inn.Sequential(*layers)
    model = inn.Sequential(*layers)  # the same modules again: named by their places here
    assert [p.name for p in model.parameters()] == _named_as_torch(torch.nn.Sequential(*twins))
    assert [n for n, _ in model.named_parameters()] == ["0.weight", "0.bias", "2.weight"]
    outer = inn.Sequential(inn.Linear(2, 2), model)
    torch_outer = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Sequential(*twins))
    assert [p.name for p in outer.parameters()] == _named_as_torch(torch_outer)
    assert _named_as_torch(torch_outer)[2:] == ["1.0.weight", "1.0.bias", "1.2.weight"]


def test_nested_sequential_reports_its_layers_stats_by_their_parameters_prefix():
    first, inner, last = inn.Linear(2, 2), inn.Linear(2, 2), inn.Linear(2, 2)
    model = inn.Sequential(first, inn.ReLU(), inn.Sequential(inner, inn.ReLU(), last))
    stats = model.stats()
    assert list(stats) == ["0", "2.0", "2.2"]
    assert all(s is m.stats for s, m in zip(stats.values(), (first, inner, last)))
    assert inner.weight.name == "2.0.weight" and last.bias.name == "2.2.bias"


@pytest.mark.parametrize("nested", [False, True])
def test_sequential_refuses_a_module_it_would_hold_twice(nested):
    # A shared layer keeps only its last input: the backward pass of its first place would use
    # the input of its second, and the gradients would be those of another network.
    layer = inn.Linear(2, 2)
    with pytest.raises(ValueError, match="Sequential takes each module once"):
        if nested:
            inn.Sequential(layer, inn.ReLU(), inn.Sequential(inn.ReLU(), layer))
        else:
            inn.Sequential(layer, inn.ReLU(), layer)
    relu = inn.ReLU()
    with pytest.raises(ValueError, match="Sequential takes each module once"):
        inn.Sequential(inn.Linear(2, 2), relu, inn.Linear(2, 2), relu)


# ---- overflow -----------------------------------------------------------------------------------


def test_int32_accumulation_overflow_raises_instead_of_wrapping():
    a = DyadicTensor(_int([[2**30, 2**30]]), 0)
    b = DyadicTensor(_int([[1], [1]]), 0)
    with pytest.raises(
        OverflowError,
        match=r"matmul: 1 result\(s\) outside \[-2147483648, "
        r"2147483647\]",
    ):
        dyadic.matmul(a, b)


def test_partial_sums_that_wrap_but_end_in_range_are_exact():
    # A 32-bit accumulator wraps after the second term and unwraps after the third: the total,
    # 2**30, is right, so no overflow is reported.
    a = DyadicTensor(_int([[2**30, 2**30, -(2**30)]]), 0)
    b = DyadicTensor(_int([[1], [1], [1]]), 0)
    assert dyadic.matmul(a, b).mantissa.tolist() == [[2**30]]


def test_matmul_stays_exact_when_partial_sums_pass_128_bits():
    # int64 operands: the first two products sum to 2**127, past a 128-bit accumulator; the total
    # is 0, and it must come out exact and in range.
    a = DyadicTensor(torch.full((1, 5), -(2**63), dtype=torch.int64), 0)
    b = DyadicTensor(torch.tensor([[-(2**63)], [-(2**63)], [2**63 - 1], [2**63 - 1], [2]]), 0)
    assert dyadic.matmul(a, b, accumulator_bits=64).mantissa.tolist() == [[0]]
    with pytest.raises(OverflowError):  # the first two terms alone: 2**127
        dyadic.matmul(
            DyadicTensor(a.mantissa[:, :2], 0), DyadicTensor(b.mantissa[:2], 0), accumulator_bits=64
        )


def test_elementwise_overflow_raises_or_saturates_with_a_warning():
    a = DyadicTensor(_int([2**31 - 1, 5]), 0)
    b = DyadicTensor(_int([1, 5]), 0)
    with pytest.raises(OverflowError, match=r"add: 1 result\(s\) outside"):
        dyadic.add(a, b)
    with pytest.warns(DyadicOverflowWarning, match=r"add: 1 result\(s\) outside .*saturated"):
        out = dyadic.add(a, b, overflow="saturate")
    assert out.mantissa.tolist() == [2**31 - 1, 10]
    with pytest.raises(OverflowError, match="mul"):
        dyadic.mul(a, a)


def _overflowing_layer(overflow):
    # 8-bit inputs times 16-bit weights summed over 8 terms need 26 bits: a 16-bit accumulator
    # cannot hold them.
    return inn.Linear(
        8, 2, weight=torch.ones(2, 8), bias=False, accumulator_bits=16, overflow=overflow
    )


def test_linear_accumulator_overflow_raises_by_default():
    x = DyadicTensor(torch.full((3, 8), 127, dtype=torch.int32), 0)
    with pytest.raises(
        OverflowError,
        match=r"Linear forward x W\^T: 6 result\(s\) outside "
        r"\[-32768, 32767\]",
    ):
        _overflowing_layer("raise")(x)


def test_linear_accumulator_overflow_is_counted_and_warned_under_saturate():
    layer = _overflowing_layer("saturate")
    x = DyadicTensor(torch.full((3, 8), 127, dtype=torch.int32), 0)
    with pytest.warns(DyadicOverflowWarning):
        layer(x)
    assert layer.stats.overflows == 6
    assert layer.stats.summary()["overflows"] == 6


def _bias_overflowing_layer(overflow):
    # W = b = 96 at scale 7 (8-bit, headroom 0): x = 21 gives x W = 2016, inside a 12-bit
    # accumulator's [-2048, 2047], and x W + b = 2112, outside it.
    return inn.Linear(
        1,
        1,
        weight=torch.tensor([[0.75]]),
        bias_value=torch.tensor([0.75]),
        weight_bits=8,
        headroom=0,
        accumulator_bits=12,
        rounding="nearest",
        overflow=overflow,
    )


def test_linear_bias_addition_is_checked_against_the_accumulator():
    x = DyadicTensor(_int([[21]]), 0)
    with pytest.raises(OverflowError, match=r"x W\^T \+ b: 1 result\(s\) outside \[-2048, 2047\]"):
        _bias_overflowing_layer("raise")(x)
    layer = _bias_overflowing_layer("saturate")
    with pytest.warns(DyadicOverflowWarning):
        y = layer(x)
    assert layer.stats.overflows == 1
    # The accumulator's 2047 at scale 7, requantised to 8 activation bits: saturated, not 2112.
    assert y.mantissa.item() * 2.0**-y.scale <= 2047 * 2.0**-7


def test_a_zero_bias_does_not_coarsen_the_weight_scale():
    torch.manual_seed(0)
    w = torch.empty(4, 8).uniform_(-0.01, 0.01)
    zero_bias = inn.Linear(8, 4, weight=w, bias_value=torch.zeros(4), weight_bits=16, headroom=2)
    no_bias = inn.Linear(8, 4, weight=w, bias=False, weight_bits=16, headroom=2)
    assert zero_bias.weight.value.scale == no_bias.weight.value.scale == dyadic.scale_for(w, 16) - 2
    assert torch.equal(zero_bias.weight.value.mantissa, no_bias.weight.value.mantissa)


# ---- loss and optimizer -------------------------------------------------------------------------


def test_mse_loss_and_gradient_by_hand():
    # y = [0.75, -0.25] (mantissas 3, -1 at scale 2), t = [1, 0]: e = [-0.25, -0.25],
    # L = (1/2N) sum e^2 = 1/16, dL/dy = e / N = e (N = 1), kept at scale 2.
    out = inn.mse_loss(DyadicTensor(_int([[3, -1]]), 2), DyadicTensor(_int([[1, 0]]), 0))
    assert out.loss == 0.0625
    assert out.grad.mantissa.tolist() == [[-1, -1]] and out.grad.scale == 2 and out.shift == 0


def test_mse_loss_divides_by_a_batch_that_is_not_a_power_of_two():
    # N = 3: e = [[-1, -1], [0, -4], [0, 0]] at scale 2; e / 3 = div(e, 3, p = 2): e * 4 / 3
    # rounded to nearest = [[-1, -1], [0, -5], [0, 0]] at scale 4. L = (1 + 1 + 16) / 16 / 6.
    y = DyadicTensor(_int([[3, -1], [0, 0], [4, 0]]), 2)
    t = DyadicTensor(_int([[1, 0], [0, 1], [1, 0]]), 0)
    out = inn.mse_loss(y, t, rounding="nearest")
    assert out.loss == pytest.approx(18 / 96, rel=0, abs=0)
    assert out.grad.mantissa.tolist() == [[-1, -1], [0, -5], [0, 0]] and out.grad.scale == 4
    power_of_two = inn.mse_loss(
        DyadicTensor(_int([[3, -1], [0, 0]]), 2), DyadicTensor(_int([[1, 0], [0, 1]]), 0)
    )
    assert power_of_two.grad.scale == 3  # N = 2: dividing is a scale change


@pytest.mark.parametrize("top", [2**31 - 1, -(2**31)])
def test_mse_loss_gradient_of_an_error_at_the_accumulators_edge_is_computed_not_refused(top):
    # N = 3, e = y - t in range of the 32-bit accumulator; e / N is smaller than e, but the
    # documented div(e, N, p = 2) forms e * 4 / 3, one bit wider than int32.
    y = DyadicTensor(_int([[top], [0], [0]]), 0)
    t = DyadicTensor(_int([[0], [0], [0]]), 0)
    out = inn.mse_loss(y, t, rounding="nearest", error_bits=8)
    quotient = Fraction(top * 4, 3)  # at scale 2
    q, frac = math.floor(quotient), quotient - math.floor(quotient)
    q += frac > Fraction(1, 2) or (frac == Fraction(1, 2) and q % 2 == 1)
    magnitude = max(q, -q - 1)
    shift = max(0, magnitude.bit_length() - 7)  # fit_shift to 8 bits
    scaled = Fraction(q, 2**shift)
    r, frac = math.floor(scaled), scaled - math.floor(scaled)
    r += frac > Fraction(1, 2) or (frac == Fraction(1, 2) and r % 2 == 1)
    r = min(max(r, -128), 127)
    assert out.shift == shift and out.grad.scale == 2 - shift
    assert out.grad.mantissa.tolist() == [[r], [0], [0]]
    assert out.loss == float(Fraction(top * top, 6))


def test_mse_loss_names_a_quotient_beyond_int64_under_a_64_bit_accumulator():
    # e = 2**63 - 1 fits the 64-bit accumulator; e * 4 / 3 (p = bits(3) = 2) does not fit int64.
    y = DyadicTensor(_int([[2**63 - 1], [0], [0]], torch.int64), 0)
    t = DyadicTensor(_int([[0], [0], [0]], torch.int64), 0)
    with pytest.raises(OverflowError, match=r"^mse_loss \(y - t\) / N: e 2\*\*2 / 3 .* at most 63"):
        inn.mse_loss(y, t, accumulator_bits=64, rounding="nearest")


def test_integer_sgd_with_momentum_equals_torch_sgd_on_exact_values():
    # lr 2**-2, momentum 1 - 2**-1 = 0.5; every intermediate is exact, so nearest rounding must
    # reproduce torch.optim.SGD's float updates exactly.
    w = inn.Parameter("w", DyadicTensor(_int([100, -100]), 10), bits=16)
    _three_steps_as_torch_sgd(w, DyadicTensor(_int([64, -32]), 10))
    assert w.value.mantissa.tolist() == [100 - 16 - 24 - 28, -100 + 8 + 12 + 14]


def _three_steps_as_torch_sgd(w, grad):
    """Three steps of lpsim.dyadic's SGD (lr 2**-2, momentum 1 - 2**-1, nearest) on w with the
    gradient grad, each checked against torch.optim.SGD's float step from w's initial values."""
    opt = SGD([w], lr_shift=2, momentum_shift=1, rounding="nearest")
    reference = w.value.to_float().requires_grad_()
    torch_opt = torch.optim.SGD([reference], lr=0.25, momentum=0.5)
    for _ in range(3):
        w.grad = grad
        opt.step()
        reference.grad = grad.to_float()
        torch_opt.step()
        assert w.value.to_float().tolist() == reference.detach().tolist()


def test_sgd_rounds_a_gradient_from_another_scale_onto_the_weight_grid_unbiased():
    # A gradient at scale 20 is 1/1024 of a weight step: stochastic rounding moves the weight by
    # the right amount on average.
    n = 1 << 14
    w = inn.Parameter("w", DyadicTensor(torch.zeros(n, dtype=torch.int32), 10), bits=16)
    w.grad = DyadicTensor(torch.full((n,), 3 * 1024 + 300, dtype=torch.int32), 20)
    torch.manual_seed(0)
    SGD([w], lr_shift=0).step()
    mean = -w.value.mantissa.double().mean().item()
    p = 300 / 1024
    assert abs(mean - (3 + p)) <= 4 * math.sqrt(p * (1 - p) / n)


def test_mse_loss_error_is_checked_against_the_accumulator():
    y = DyadicTensor(_int([[30000]]), 0)
    t = DyadicTensor(_int([[-30000]]), 0)  # both fit 16 bits; y - t = 60000 does not
    with pytest.raises(OverflowError, match=r"y - t: 1 result\(s\) outside \[-32768, 32767\]$"):
        inn.mse_loss(y, t, accumulator_bits=16, rounding="nearest")  # no overflow= to name


def test_mse_loss_counts_each_error_outside_the_accumulator_once():
    # An int64 output: y - t = 2**63 saturates int64 and lies outside the 32-bit accumulator;
    # it is one result outside the range, as is 2**40, and 5 is inside (Python's integers).
    y = DyadicTensor(torch.tensor([[2**63 - 1, 2**40, 5]], dtype=torch.int64), 0)
    t = DyadicTensor(_int([[-1, 0, 0]]), 0)
    errors = [a - b for a, b in zip(y.mantissa[0].tolist(), t.mantissa[0].tolist())]
    outside = sum(not -(2**31) <= e < 2**31 for e in errors)
    with pytest.raises(OverflowError, match=rf"y - t: {outside} result\(s\) outside"):
        inn.mse_loss(y, t, rounding="nearest")


def test_mse_loss_is_exact_where_the_sum_of_squares_passes_int64():
    # Four errors of -2**31: the sum of squares is 2**64, which int64 wraps to 0.
    y = DyadicTensor(torch.full((1, 4), -(2**31), dtype=torch.int64), 0)
    t = DyadicTensor(torch.zeros(1, 4, dtype=torch.int64), 0)
    assert inn.mse_loss(y, t, rounding="nearest").loss == 2.0**63
    big = DyadicTensor(torch.tensor([[2**40 + 2**31 - 1]], dtype=torch.int64), 0)
    zero = DyadicTensor(torch.zeros(1, 1, dtype=torch.int64), 0)
    loss = inn.mse_loss(big, zero, rounding="nearest", accumulator_bits=64).loss
    assert loss == float(Fraction((2**40 + 2**31 - 1) ** 2, 2))


def test_mse_loss_beyond_the_float64_range_reads_as_inf():
    # An error of 1 at scale -600 is 2**600: the loss 2**1200 / 2 rounds to inf in float64.
    y = DyadicTensor(torch.tensor([[1, 2]], dtype=torch.int32), -600)
    t = DyadicTensor(torch.tensor([[0, 2]], dtype=torch.int32), -600)
    out = inn.mse_loss(y, t, rounding="nearest")
    assert out.loss == math.inf and out.grad.mantissa.tolist() == [[1, 0]]
    assert out.grad.scale == -600


def test_mse_loss_refuses_an_empty_batch():
    empty = DyadicTensor(torch.zeros(0, 3, dtype=torch.int32), 0)
    with pytest.raises(ValueError, match="N >= 1"):
        inn.mse_loss(empty, empty)


def test_sgd_clips_gradients_and_weights_and_counts_them():
    w = inn.Parameter("w", DyadicTensor(_int([32767, 0, 5]), 4), bits=16)
    w.grad = DyadicTensor(_int([-1000, 1000, 1]), 4)
    opt = SGD([w], lr_shift=0, grad_bits=8, rounding="nearest")
    opt.step()
    # g = clip([-1000, 1000, 1]) = [-128, 127, 1]; W - g = [32895, -127, 4] -> 32895 clips to 32767.
    assert w.value.mantissa.tolist() == [32767, -127, 4]
    assert opt.stats["w"].gradient == 2 and opt.stats["w"].weight == 1
    opt.reset_stats()
    assert opt.stats["w"].gradient == 0


def test_momentum_shift_zero_means_no_momentum():
    w = inn.Parameter("w", DyadicTensor(_int([0]), 0), bits=16)
    opt = SGD([w], lr_shift=0, momentum_shift=0, rounding="nearest")
    for _ in range(3):
        w.grad = DyadicTensor(_int([2]), 0)
        opt.step()
    assert w.value.mantissa.tolist() == [-6]


# ---- learning ------------------------------------------------------------------------------------


def test_integer_network_learns_a_separable_problem():
    gen = torch.Generator().manual_seed(1)
    points = torch.randn(64, 2, generator=gen)
    labels = (points[:, 0] + points[:, 1] > 0).long()
    torch.manual_seed(1)
    model = inn.Sequential(inn.Linear(2, 8), inn.ReLU(), inn.Linear(8, 2))
    opt = SGD(model.parameters(), lr_shift=3, momentum_shift=1)
    x = dyadic.from_float(points, 8).value
    t = DyadicTensor(torch.nn.functional.one_hot(labels, 2).to(torch.int32), 0)
    losses = []
    for _ in range(60):
        out = inn.mse_loss(model(x), t)
        opt.zero_grad()
        model.backward(out.grad)
        opt.step()
        losses.append(out.loss)
    model.eval()
    accuracy = (model(x).mantissa.argmax(1) == labels).float().mean().item()
    assert losses[-1] < 0.5 * losses[0] and accuracy >= 0.9


def test_iris_experiment_runs_and_writes_its_table(tmp_path):
    from experiments.iris_int import run

    with warnings.catch_warnings():
        warnings.simplefilter("error", DyadicOverflowWarning)
        run.main(
            [
                "--seeds",
                "1",
                "--epochs",
                "12",
                "--log-every",
                "6",
                "--no-ablations",
                "--workers",
                "1",
                "--out",
                str(tmp_path),
            ]
        )
    text = (tmp_path / "iris_int.md").read_text()
    assert "| integer (16-bit weights), stochastic |" in text and "| float32 |" in text
    assert (tmp_path / "iris_int.png").stat().st_size > 10_000


def test_iris_experiment_keeps_the_callers_thread_count_when_a_run_fails(tmp_path):
    # A seed trained in this process runs on one thread; 32-bit weights overflow the 32-bit
    # accumulator in the first forward pass, and the OverflowError must not leave the caller's
    # process on that one thread.
    from experiments.iris_int import run

    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with pytest.raises(OverflowError, match="Linear forward"):
            run.main(
                ["--seeds", "1", "--epochs", "1", "--no-ablations", "--workers", "1"]
                + ["--weight-bits", "32", "--out", str(tmp_path)]
            )
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(threads)


def test_iris_8_bit_weights_are_on_a_grid_of_2_to_the_minus_6_in_every_layer_and_seed():
    # docs/integer.md: the 8-bit-weight ablation's quantum is 2**-6 everywhere, so an update
    # 2**-7 M moves a weight by half a quantum only when |M| reaches 64 quanta, 1 in value.
    from experiments.iris_int import run

    args = run.parser().parse_args([])
    for seed in range(10):
        model = run.integer_model(run.float_model(seed), args, run.PATHS["w8-nearest"])
        assert {p.value.scale for p in model.parameters()} == {6}, seed
        assert {p.bits for p in model.parameters()} == {8}


def test_sgd_keeps_its_counts_by_the_parameters_current_names():
    first, second = inn.Linear(2, 2), inn.Linear(2, 2)
    with pytest.raises(ValueError, match="distinct names.*'weight' 2 times"):
        SGD([*first.parameters(), *second.parameters()], lr_shift=4)
    opt = SGD(first.parameters(), lr_shift=4)  # made before Sequential names the parameters
    inn.Sequential(first, second)
    first.weight.grad = first.weight.value.with_mantissa(torch.ones(2, 2, dtype=torch.int32))
    opt.step()
    assert set(opt.stats) == {"0.weight", "0.bias"}


def test_sgd_refuses_a_parameter_wider_than_its_int32_arithmetic():
    # A 48-bit parameter's momentum and updates would be clipped to int32 without a report.
    wide = inn.Parameter("w", DyadicTensor(torch.zeros(1, dtype=torch.int64), 0), 48)
    with pytest.raises(ValueError, match=r"the bits of parameter 'w' must be in \[2, 32\]"):
        SGD([wide], lr_shift=0)


def test_sgd_momentum_of_an_int64_parameter_is_int32_and_its_overflow_is_reported():
    # M = G, then M = G - round(G / 2) + G = 3 * 2**30 + ... > 2**31 - 1: an int32 overflow, not an
    # update silently clipped to 2**31 - 1.
    p = inn.Parameter("w", DyadicTensor(torch.zeros(1, dtype=torch.int64), 0), 32)
    opt = SGD([p], lr_shift=0, momentum_shift=1, grad_bits=32, rounding="nearest")
    p.grad = DyadicTensor(torch.tensor([2**31 - 1], dtype=torch.int64), 0)
    opt.step()
    assert opt.momentum[0].dtype == torch.int32 and p.value.mantissa.tolist() == [-(2**31) + 1]
    with pytest.raises(OverflowError, match="SGD momentum: 1 result"):
        opt.step()


def test_sgd_refuses_a_gradient_of_another_shape():
    w = inn.Parameter("w", DyadicTensor(_int([1, 2, 3]), 4), bits=16)
    w.grad = DyadicTensor(torch.ones(2, 3, dtype=torch.int32), 4)
    with pytest.raises(ValueError, match=r"gradient of 'w' has shape \(2, 3\), its value \(3,\)"):
        SGD([w], lr_shift=0).step()


def test_mse_loss_checks_an_int64_output_against_the_accumulator_without_wrapping_it():
    # y = 2**32 + 1 does not fit the 32-bit accumulator: y - t = 2**32 must be reported, not
    # wrapped to int32 (where y reads as 1 and the error as 0).
    y = DyadicTensor(torch.tensor([[2**32 + 1]], dtype=torch.int64), 0)
    t = DyadicTensor(_int([[1]]), 0)
    with pytest.raises(OverflowError, match=r"y - t: 1 result\(s\) outside"):
        inn.mse_loss(y, t, rounding="nearest")
    # Within the range the int64 output keeps its value: e = 2**31 - 2 exactly.
    y = DyadicTensor(torch.tensor([[2**31 - 1]], dtype=torch.int64), 0)
    out = inn.mse_loss(y, t, rounding="nearest", error_bits=32)
    assert out.loss == float(Fraction((2**31 - 2) ** 2, 2))
    assert out.grad.mantissa.tolist() == [[2**31 - 2]] and out.grad.scale == 0


@pytest.mark.parametrize("overflow", ["raise", "saturate"])
def test_sgd_clips_a_weight_whose_update_leaves_int32_and_counts_it(overflow):
    # W - R(M 2**-lr_shift) = (2**31 - 1) + 10 is exact before the clip to W's 32 bits: the
    # weight clips to Qmax and counts as a weight clip; nothing overflows (no error, no warning).
    w = inn.Parameter("w", DyadicTensor(_int([2**31 - 1, 5, -(2**15)]), 0), bits=32)
    w.grad = DyadicTensor(_int([-10, 1, 2**31 - 1]), 0)
    opt = SGD([w], lr_shift=0, grad_bits=32, rounding="nearest", overflow=overflow)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt.step()
    exact = [2**31 - 1 + 10, 5 - 1, -(2**15) - (2**31 - 1)]
    lo, hi = -(2**31), 2**31 - 1
    assert w.value.mantissa.tolist() == [min(max(v, lo), hi) for v in exact]
    assert opt.stats["w"].weight == 2 and opt.stats["w"].gradient == 0


def test_mse_loss_rounds_a_subnormal_loss_once():
    # e = 2147482799 at scale 545: L = e**2 / 2 * 2**-1090 is subnormal in float64. Rounding
    # e**2 / 2 to 53 bits first and then to the subnormal grid rounds twice and misses by a unit.
    e = 2147482799
    y = DyadicTensor(torch.tensor([[e]], dtype=torch.int64), 545)
    t = DyadicTensor(torch.zeros(1, 1, dtype=torch.int64), 545)
    loss = inn.mse_loss(y, t, rounding="nearest", accumulator_bits=64).loss
    assert loss == float(Fraction(e * e, 2) / 2**1090)


def test_sgd_updates_a_per_channel_parameter_from_a_per_tensor_gradient_as_torch_sgd():
    # Rows at scales 10 and 4; the gradient has one scale (as Linear's are) and lands on each
    # row's grid exactly, so nearest rounding must reproduce torch.optim.SGD's float updates.
    w = inn.Parameter("w", DyadicTensor(_int([[100, -100], [7, 9]]), [10, 4], axis=0), bits=16)
    _three_steps_as_torch_sgd(w, DyadicTensor(_int([[64, -32], [1024, -2048]]), 10))
    assert w.value.scale.tolist() == [10, 4] and w.value.axis == 0
    assert w.value.mantissa.tolist() == [[100 - 68, -100 + 34], [7 - 17, 9 + 34]]


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2, torch.bfloat16], ids=str)
def test_linear_takes_initial_values_of_any_float_dtype_exactly(dtype):
    # weight and bias_value are any finite float tensors: the parameters are their exact values at
    # scale scale_for(weight and bias, 16) - headroom, rounded to nearest (ties to even).
    generator = torch.Generator().manual_seed(6)
    w = torch.randn(3, 4, generator=generator).to(dtype)
    b = torch.randn(3, generator=generator).to(dtype)
    layer = inn.Linear(4, 3, weight=w, bias_value=b, weight_bits=16, headroom=2)
    values = w.float().flatten().tolist() + b.float().tolist()
    scale = 16 - 2 - (math.frexp(max(abs(v) for v in values))[1] - 1) - 2
    mantissas = [round(Fraction(v) * 2**scale) for v in values]  # round() ties to even
    assert layer.weight.value.scale == layer.bias.value.scale == scale
    got = layer.weight.value.mantissa.flatten().tolist() + layer.bias.value.mantissa.tolist()
    assert got == mantissas
    with pytest.raises(ValueError, match="weight must be finite, found 12 NaN or Inf"):
        inn.Linear(4, 3, weight=torch.full((3, 4), math.nan).to(dtype))


def test_sgd_refuses_a_momentum_buffer_off_the_parameters_grid():
    # The rule keeps M at the weight's scale s_W. A state_dict() saved for a parameter at another
    # scale must not be carried on a grid of its own (here M would stay at scale 3 for ever).
    w = inn.Parameter("w", DyadicTensor(_int([100, -100]), 10), bits=16)
    opt = SGD([w], lr_shift=2, momentum_shift=1, rounding="nearest")
    other = {
        "momentum": [{"mantissa": _int([7, 9]), "scale": 3, "axis": None}],
        "stats": [{"gradient": 0, "weight": 0}],
    }
    opt.load_state_dict(other)
    w.grad = DyadicTensor(_int([0, 0]), 10)
    with pytest.raises(
        ValueError, match=r"momentum buffer of 'w' is \(2,\) at scale 3, the parameter \(2,\) at 10"
    ):
        opt.step()
    assert w.value.mantissa.tolist() == [100, -100]
    per_channel = dict(other, momentum=[{"mantissa": _int([7, 9]), "scale": [10, 10], "axis": 0}])
    opt.load_state_dict(per_channel)
    with pytest.raises(
        ValueError, match=r"at scale \[10, 10\] along axis 0, the parameter \(2,\) at 10"
    ):
        opt.step()
    # A buffer on the grid continues as torch.optim.SGD from that momentum: M = 0.5 M + 0,
    # W = W - M / 4, exact here.
    on_grid = dict(other, momentum=[{"mantissa": _int([8, -16]), "scale": 10, "axis": None}])
    opt.load_state_dict(on_grid)
    opt.step()
    assert opt.momentum[0].mantissa.tolist() == [4, -8]
    assert w.value.mantissa.tolist() == [100 - 1, -100 + 2]


def test_sgd_refuses_a_momentum_buffer_of_another_shape_than_its_parameter():
    # A value replaced by one of another shape: the old buffer must not broadcast into the new
    # parameter (here (3,) would spread over every row of (2, 3)).
    w = inn.Parameter("w", DyadicTensor(_int([100, -100, 4]), 10), bits=16)
    opt = SGD([w], lr_shift=2, momentum_shift=1, rounding="nearest")
    w.grad = DyadicTensor(_int([64, 64, 64]), 10)
    opt.step()
    w.value = DyadicTensor(torch.zeros(2, 3, dtype=torch.int32), 10)
    w.grad = DyadicTensor(torch.zeros(2, 3, dtype=torch.int32), 10)
    with pytest.raises(
        ValueError, match=r"'w' is \(3,\) at scale 10, the parameter \(2, 3\) at 10"
    ):
        opt.step()
    assert w.value.mantissa.tolist() == [[0, 0, 0], [0, 0, 0]]


def test_integer_sgd_resumed_from_its_state_dict_continues_bit_for_bit(tmp_path):
    """Momentum and stochastic roundings: six steps in one run equal three, a checkpoint (the
    values, the optimizer's state_dict and torch's generator state, through torch.save and
    torch.load's defaults) and three more with a fresh parameter and optimizer."""

    def gradient(step: int) -> DyadicTensor:
        g = torch.Generator().manual_seed(step)
        return DyadicTensor(torch.randint(-5000, 5000, (2, 8), generator=g, dtype=torch.int32), 17)

    def parameter(axis_scales) -> inn.Parameter:
        return inn.Parameter(
            "w", DyadicTensor(_int([list(range(-4, 4)), list(range(8))]), axis_scales, 0), bits=12
        )

    def optimizer(w):
        return SGD([w], lr_shift=1, momentum_shift=2, grad_bits=10, rounding="stochastic")

    def run(w, opt, steps) -> None:
        for step in steps:
            w.grad = gradient(step)
            opt.step()

    torch.manual_seed(0)
    w = parameter([10, 11])
    run(w, optimizer(w), range(6))
    uninterrupted = w.value.mantissa.clone()

    torch.manual_seed(0)
    w = parameter([10, 11])
    opt = optimizer(w)
    run(w, opt, range(3))
    checkpoint = {
        "value": (w.value.mantissa, w.value.scale, w.value.axis),
        "optimizer": opt.state_dict(),
        "rng": torch.get_rng_state(),
    }
    torch.save(checkpoint, tmp_path / "c")
    torch.manual_seed(123)  # a fresh process's generator
    loaded = torch.load(tmp_path / "c")
    w = inn.Parameter("w", DyadicTensor(*loaded["value"]), bits=12)
    opt = optimizer(w)
    opt.load_state_dict(loaded["optimizer"])
    torch.set_rng_state(loaded["rng"])
    run(w, opt, range(3, 6))
    assert torch.equal(w.value.mantissa, uninterrupted)
    assert opt.momentum[0] is not None
    with pytest.raises(ValueError, match="momentum buffers"):
        SGD([], lr_shift=1).load_state_dict(loaded["optimizer"])


# ---- a whole training step in Python integers ------------------------------------------------


class _IntegerStep:
    """Two training steps of Linear-ReLU-Linear, mse_loss and SGD in Python integers and
    fractions, each shift and rounding as docs/integer.md states it. A stochastic rounding uses
    the word i of a seed drawn from torch's generator, one seed per operation in the order the
    layers run them (an exact addition or subtraction draws one too)."""

    def __init__(self, rule: str):
        self.rule = rule

    def words(self, n: int) -> list[int]:
        if self.rule != "stochastic":
            return [0] * n
        from lpsim.reference import random_word

        seed = int(torch.randint(2**63 - 1, ()))
        return [random_word(seed, 0, i) for i in range(n)]

    def round(self, x: Fraction, word: int) -> int:
        q = math.floor(x)
        frac = x - q
        if self.rule == "down":
            return q
        if self.rule == "nearest":
            return q + (frac > Fraction(1, 2) or (frac == Fraction(1, 2) and q % 2 == 1))
        return q + (math.floor(frac * 2**32) + word >= 2**32)

    @staticmethod
    def clip(values: list[int], bits: int) -> list[int]:
        return [min(max(v, -(2 ** (bits - 1))), 2 ** (bits - 1) - 1) for v in values]

    def requantize(self, values, scale, target, bits) -> tuple[list[int], list[bool]]:
        rounded = [
            self.round(Fraction(v) * Fraction(2) ** (target - scale), w)
            for v, w in zip(values, self.words(len(values)))
        ]
        clipped = self.clip(rounded, bits)
        return clipped, [r != c for r, c in zip(rounded, clipped)]

    def exact(self) -> None:
        self.words(0)  # an addition of operands at one scale: exact, one seed drawn all the same

    @staticmethod
    def fit_shift(values: list[int], bits: int) -> int:
        k = 0
        while not all(-(2 ** (bits - 1)) <= v >> k <= 2 ** (bits - 1) - 1 for v in values):
            k += 1
        return k

    @staticmethod
    def product(a, b):  # row-major lists: a is (n, k), b is (k, m)
        return [[sum(x * y for x, y in zip(row, column)) for column in zip(*b)] for row in a]

    def linear_forward(self, layer: dict, x, s_x):
        n, out = len(x), len(layer["W"])
        s = s_x + layer["s"]
        acc = self.clip(sum(self.product(x, list(zip(*layer["W"]))), []), layer["acc"])
        bias, _ = self.requantize(layer["b"], layer["s"], s, layer["acc"])
        self.exact()
        acc = self.clip([v + bias[i % out] for i, v in enumerate(acc)], layer["acc"])
        k = layer["kf"] if layer["kf"] is not None else self.fit_shift(acc, layer["a"])
        y, clipped = self.requantize(acc, s, s - k, layer["a"])
        layer.update(x=x, s_x=s_x, clipped=clipped)
        return [y[i * out : (i + 1) * out] for i in range(n)], s - k

    def linear_backward(self, layer: dict, g, s_g):
        out = len(layer["W"])
        flat = [0 if c else v for v, c in zip(sum(g, []), layer["clipped"])]
        g = [flat[i * out : (i + 1) * out] for i in range(len(g))]
        layer["dW"] = self.clip(sum(self.product(list(zip(*g)), layer["x"]), []), layer["acc"])
        layer["s_dW"] = s_g + layer["s_x"]
        layer["db"], layer["s_db"] = self.clip([sum(c) for c in zip(*g)], layer["acc"]), s_g
        dx = self.clip(sum(self.product(g, layer["W"]), []), layer["acc"])
        s = s_g + layer["s"]
        k = layer["kb"] if layer["kb"] is not None else self.fit_shift(dx, layer["e"])
        dx, _ = self.requantize(dx, s, s - k, layer["e"])
        cols = len(layer["W"][0])
        return [dx[i * cols : (i + 1) * cols] for i in range(len(g))], s - k

    def mse_loss(self, y, s_y, target, error_bits):
        n = len(y)
        t, _ = self.requantize(sum(target, []), 0, s_y, 32)
        self.exact()
        e = [a - b for a, b in zip(sum(y, []), t)]
        loss = Fraction(sum(v * v for v in e), 2 * n) / Fraction(2) ** (2 * s_y)
        if n & (n - 1) == 0:
            g, s_g = e, s_y + n.bit_length() - 1
        else:  # div(e, N, p) with p = bits(N)
            p = n.bit_length()
            g = [self.round(Fraction(v * 2**p, n), w) for v, w in zip(e, self.words(len(e)))]
            s_g = s_y + p
        k = self.fit_shift(g, error_bits)
        g, _ = self.requantize(g, s_g, s_g - k, error_bits)
        c = len(y[0])
        return float(loss), [g[i * c : (i + 1) * c] for i in range(n)], s_g - k

    def sgd(self, w, layer, grad, s_grad, m, lr_shift=2, momentum_shift=1, grad_bits=8):
        s_w = layer["s"]
        g, _ = self.requantize(grad, s_grad, s_w, grad_bits)
        decay, _ = self.requantize(m, s_w + momentum_shift, s_w, 32)
        self.exact()
        m = self.clip([a - b for a, b in zip(m, decay)], 32)
        self.exact()
        m = self.clip([a + b for a, b in zip(m, g)], 32)
        update, _ = self.requantize(m, s_w + lr_shift, s_w, 32)
        self.exact()
        w, _ = self.requantize([a - b for a, b in zip(w, update)], s_w, s_w, layer["bits"])
        return w, m


@pytest.mark.parametrize("rule", ["stochastic", "nearest", "down"])
def test_two_training_steps_equal_python_integers_bit_for_bit(rule):
    # Fixed and fitted shifts (the fixed forward shift clips), a 12-bit accumulator that
    # saturates, a bias shifted right (an input at a negative scale), batches of 3 (the loss
    # divides) and 4 (a shift), 8-bit gradient clipping and momentum: every mantissa, scale and
    # the loss as the Python model has them.
    torch.manual_seed(5)
    options = dict(rounding=rule, overflow="saturate", accumulator_bits=12)
    first = inn.Linear(3, 5, weight_bits=8, activation_bits=6, forward_shift=4, **options)
    second = inn.Linear(
        5, 2, weight_bits=10, activation_bits=8, error_bits=6, backward_shift=3, **options
    )
    model = inn.Sequential(first, inn.ReLU(), second)
    opt = SGD(model.parameters(), lr_shift=2, momentum_shift=1, grad_bits=8, rounding=rule)
    python = _IntegerStep(rule)
    layers = [
        {
            "W": m.weight.value.mantissa.tolist(),
            "b": m.bias.value.mantissa.tolist(),
            "s": m.weight.value.scale,
            "a": m.activation_bits,
            "e": m.error_bits,
            "acc": 12,
            "kf": m.forward_shift,
            "kb": m.backward_shift,
            "bits": m.weight.bits,
        }
        for m in (first, second)
    ]
    momenta = None
    data = torch.Generator().manual_seed(6)
    for batch, scale in ((3, 4), (4, -2)):
        x = dyadic.from_float(torch.randn(batch, 3, generator=data) * 8, 8, scale).value
        labels = torch.randint(0, 2, (batch,), generator=data)
        t = DyadicTensor(torch.nn.functional.one_hot(labels, 2).to(torch.int32), 0)
        state = torch.get_rng_state()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DyadicOverflowWarning)
            out = inn.mse_loss(model(x), t, rounding=rule, error_bits=6)
            opt.zero_grad()
            model.backward(out.grad)
            opt.step()
        torch.set_rng_state(state)  # the Python model draws the same seeds
        h, s_h = python.linear_forward(layers[0], x.mantissa.tolist(), x.scale)
        positive = [[v > 0 for v in row] for row in h]
        h = [[max(v, 0) for v in row] for row in h]
        y, s_y = python.linear_forward(layers[1], h, s_h)
        loss, g, s_g = python.mse_loss(y, s_y, t.mantissa.tolist(), 6)
        assert out.loss == loss
        assert out.grad.mantissa.tolist() == g and out.grad.scale == s_g
        g, s_g = python.linear_backward(layers[1], g, s_g)
        g = [[v if p else 0 for v, p in zip(row, keep)] for row, keep in zip(g, positive)]
        python.linear_backward(layers[0], g, s_g)
        momenta = momenta or [[0] * (len(sum(lay["W"], [])) + len(lay["b"])) for lay in layers]
        for lay, m in zip(layers, momenta):
            cols = len(lay["W"][0])
            weight, bias = m[: len(lay["dW"])], m[len(lay["dW"]) :]
            w, weight = python.sgd(sum(lay["W"], []), lay, lay["dW"], lay["s_dW"], weight)
            b, bias = python.sgd(lay["b"], lay, lay["db"], lay["s_db"], bias)
            lay["W"] = [w[i * cols : (i + 1) * cols] for i in range(len(lay["W"]))]
            lay["b"], m[:] = b, weight + bias
        got = [p.value.mantissa.flatten().tolist() for p in model.parameters()]
        assert got == [v for lay in layers for v in (sum(lay["W"], []), lay["b"])]
    stats = model.stats()  # the run exercised every saturation and clip the model has
    assert stats["0"].forward_clamps and stats["2"].backward_clamps
    assert stats["0"].overflows and stats["2"].overflows and opt.stats["2.weight"].gradient
