"""Delayed scaling (lpsim.delayed_scaling): the quantisation against ml_dtypes' float8 casts bit for
bit, the amax history and scale update against a float32 model of Transformer Engine's published
amax_and_scale_update, state in Quantizer, inject and OptimLP, and the errors."""

from __future__ import annotations

import copy
import math
from fractions import Fraction

import ml_dtypes
import numpy as np
import pytest
import torch
from torch import nn

import lpsim
from lpsim.delayed_scaling import DelayedScaler, DelayedScaling
from lpsim.nn import LayerQuantization, Quantizer, inject, quantizer, remove
from lpsim.optim import OptimLP

E4M3 = lpsim.Float(4, 3, special="fn")
E5M2 = lpsim.Float(5, 2)
ML_DTYPES = {E4M3: ml_dtypes.float8_e4m3fn, E5M2: ml_dtypes.float8_e5m2}


def _heavy(n: int, seed: int, spread: float = 4.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, generator=g) * torch.exp2(spread * torch.randn(n, generator=g))


class _TransformerEngineModel:
    """Transformer Engine's amax_and_scale_update restated in numpy float32: the history rolled
    (newest first), reduced by fmaxf from 0 (NaN ignored) or the newest entry, and
    scale = (fp8_max * 2**-margin) / amax unless amax is zero or not finite."""

    def __init__(self, fp8_max: float, length: int, reduction: str, margin: float):
        self.history = np.zeros(length, np.float32)
        self.scale = np.float32(1.0)
        self.scale_inverse = np.float32(1.0)
        self.scaled_max = np.float32(fp8_max) * np.float32(2.0**-margin)
        self.reduction = reduction

    def record(self, amax: float) -> None:
        self.history = np.concatenate([[np.float32(amax)], self.history[:-1]]).astype(np.float32)
        if self.reduction == "max":
            a = np.float32(0.0)
            for v in self.history:
                a = np.fmax(a, v)
        else:
            a = self.history[0]
        if np.isfinite(a) and a > 0:
            self.scale = np.float32(self.scaled_max / a)
            self.scale_inverse = np.float32(np.float32(1.0) / self.scale)


def _expected(x: torch.Tensor, element, scale, scale_inverse) -> np.ndarray:
    """float32(float8(clip(float32(x * scale))) * scale_inverse): ml_dtypes' cast, saturated."""
    y = (x.numpy() * np.float32(scale)).astype(np.float32)
    top = np.float32(element.max)
    q = np.clip(y, -top, top).astype(ML_DTYPES[element]).astype(np.float32)
    return (q * np.float32(scale_inverse)).astype(np.float32)


def _same_bits(a: torch.Tensor, b: np.ndarray) -> bool:
    return torch.equal(a.view(torch.int32), torch.from_numpy(b).view(torch.int32))


@pytest.mark.parametrize("element", [E4M3, E5M2])
@pytest.mark.parametrize(("reduction", "length", "margin"), [("max", 4, 0), ("most_recent", 3, 1)])
def test_quantisation_and_scale_update_match_ml_dtypes_and_transformer_engine_bit_for_bit(
    element, reduction, length, margin
):
    scaler = DelayedScaling(element, history_length=length, reduction=reduction, margin=margin)
    state = scaler.scaler()
    model = _TransformerEngineModel(element.max, length, reduction, margin)
    spreads = [0.5, 2.0, 6.0, 1.0, 0.0, 3.0, 8.0, 1.0]
    for step, spread in enumerate(spreads):
        x = _heavy(4096, step, spread) * (10.0 ** (step % 5 - 2))
        if step == 4:
            x = torch.zeros(4096)  # amax 0: the scale stays
        out = state(x)
        assert _same_bits(out, _expected(x, element, model.scale, model.scale_inverse)), step
        model.record(float(x.abs().max()))
        assert _same_bits(state.amax_history, model.history)
        assert _same_bits(state.scale.reshape(1), np.array([model.scale]))
        assert _same_bits(state.scale_inverse.reshape(1), np.array([model.scale_inverse]))
    assert int(state.calls) == len(spreads)


def test_infinite_and_nan_amaxes_keep_the_scale_as_transformer_engine_does():
    for reduction in ("max", "most_recent"):
        state = DelayedScaling(E4M3, history_length=3, reduction=reduction).scaler()
        model = _TransformerEngineModel(448.0, 3, reduction, 0)
        for x in (torch.full((8,), 2.0), torch.tensor([1.0, math.inf]), torch.tensor([math.nan])):
            state(x)
            model.record(float(x.abs().max()))
            assert float(state.scale) == float(model.scale), (reduction, x)
        # max keeps the Inf for the history's length; most_recent sees the NaN-only tensor's amax, 0
        assert float(state.scale) == 224.0


def test_an_amax_too_small_for_a_finite_scale_gives_float32_max_and_keeps_zeros_zero():
    # 448 / 1e-40 overflows float32: the scale is float32's largest finite number, not Inf (whose
    # next call turned 0 into NaN and every other element into 0).
    largest = torch.finfo(torch.float32).max
    for dtype in (torch.float32, torch.float64):
        state = DelayedScaling(E4M3, history_length=2).scaler()
        state(torch.tensor([1e-40, 0.0], dtype=dtype))
        assert state.scale.item() == largest
        assert torch.equal(state.scale_inverse, 1 / torch.tensor(largest))
        x = torch.tensor([1e-40, 0.0, -0.0, -3e-40], dtype=dtype)
        y = state(x)
        saturating = lpsim.Float(4, 3, special="fn", saturate=True)
        elements = lpsim.quantize(x * torch.tensor(largest, dtype=dtype), saturating)
        expected = elements * state.scale_inverse.to(dtype)
        bits = torch.int64 if dtype == torch.float64 else torch.int32
        assert torch.equal(y.view(bits), expected.view(bits))
        assert not y.isnan().any() and y[0] > 0 and y[3] < 0


def test_a_margin_on_a_huge_amax_keeps_scale_inverse_finite_and_finite_values_finite():
    """448 * 2**-10 / 3e38 lies below 2**-128, where float32's reciprocal is Inf: the scale is
    raised to 2**-128 + 2**-149, the smallest float32 with a finite reciprocal, and the next call
    decodes every element (E4M3 via ml_dtypes) by that finite reciprocal. Before, scale_inverse
    was Inf: 3e38 decoded to Inf and 1.0 and 0.0 to NaN."""
    scaler = DelayedScaling(E4M3, margin=10).scaler()
    x = torch.tensor([3e38, 1.0, 0.0, -2e38, 1e38])
    scaler(x)
    smallest = np.float32(2.0**-128 + 2.0**-149)
    assert np.float32(448 * 2.0**-10) / np.float32(3e38) < smallest  # the premise
    assert np.isinf(np.float32(1) / np.float32(2.0**-128))
    assert scaler.scale.item() == smallest
    inverse = np.float32(1) / smallest
    assert scaler.scale_inverse.item() == inverse and np.isfinite(inverse)
    y = scaler(x)
    products = x.numpy() * smallest
    elements = products.astype(ml_dtypes.float8_e4m3fn).astype(np.float32)
    assert torch.equal(y, torch.from_numpy(elements * inverse))
    assert bool(y.isfinite().all())


def test_finite_values_whose_scaled_product_overflows_float32_saturate_as_transformer_engine():
    # After an amax of 1e-36 the scale is float32's largest finite number, and x * scale overflows
    # float32 for |x| >= 1. Transformer Engine's cast to FP8 saturates (satfinite) what the
    # product overflows to; an E5M2 element with Inf codes once kept it as Inf, so a finite input
    # decoded to Inf.
    for element in (E4M3, E5M2):
        state = DelayedScaling(element, history_length=2).scaler()
        state(torch.tensor([1e-36]))
        scale, scale_inverse = state.scale.numpy(), state.scale_inverse.numpy()
        x = torch.tensor([1.0, -2.0, 3e38, -3e38, 1e-36, 0.0])
        with np.errstate(over="ignore"):
            expected = _expected(x, element, scale, scale_inverse)
        assert np.isfinite(expected).all()
        assert _same_bits(state(x), expected), element


def test_nan_elements_are_left_out_of_the_amax_as_transformer_engine_amax_does():
    # Transformer Engine takes a tensor's amax with fmaxf from 0, which skips NaN: [2, NaN, -3]
    # has amax 3 and a NaN-only tensor amax 0. The whole amax was once NaN, so most_recent kept
    # the old scale and max counted the tensor as 0.
    for reduction in ("max", "most_recent"):
        state = DelayedScaling(E4M3, history_length=3, reduction=reduction).scaler()
        model = _TransformerEngineModel(448.0, 3, reduction, 0)
        for x in (torch.tensor([2.0, math.nan, -3.0]), torch.tensor([math.nan]), torch.ones(2)):
            state(x)
            amax = np.float32(0.0)
            for v in x.abs().numpy():
                amax = np.fmax(amax, v)
            model.record(float(amax))
            assert _same_bits(state.amax_history, model.history), (reduction, x)
            assert float(state.scale) == float(model.scale), (reduction, x)
    assert state.amax_history.tolist()[:2] == [1.0, 0.0]


def test_first_call_uses_scale_one_and_each_call_the_scale_of_the_calls_before():
    state = DelayedScaling(E4M3, history_length=8).scaler()
    assert state(torch.tensor([1000.0])).item() == 448.0  # scale 1: saturates
    assert float(state.scale) == np.float32(448.0) / np.float32(1000.0)
    assert state(torch.tensor([1000.0])).item() == pytest.approx(1000.0, rel=2**-3)


def test_max_reduction_remembers_history_length_calls():
    state = DelayedScaling(E4M3, history_length=2).scaler()
    for amax in (64.0, 1.0, 1.0):
        state(torch.tensor([amax]))
    assert float(state.scale) == 448.0  # 64 has left the history of 2
    state = DelayedScaling(E4M3, history_length=3).scaler()
    for amax in (64.0, 1.0, 1.0):
        state(torch.tensor([amax]))
    assert float(state.scale) == 7.0  # 448 / 64


def test_margin_leaves_headroom_of_a_power_of_two():
    plain, margin = (DelayedScaling(E4M3, margin=m).scaler() for m in (0, 2))
    for state in (plain, margin):
        state(torch.tensor([3.0]))
    assert float(margin.scale) * 4 == float(plain.scale)


def test_a_zero_amax_enters_the_history_unlike_transformer_engines_fused_pytorch_update():
    """A tensor of zeros records amax 0 and rolls the history, as Transformer Engine's per-tensor
    amax_and_scale_update and its JAX quantizers do. Its PyTorch modules' fused update skips a
    tensor whose amax is 0 (its sign of a tensor not quantised in the step): no roll, the scale
    kept. Under "max" the two differ, as the docs say: 448 here, 7 there."""
    amaxes = (64.0, 1.0, 1.0, 0.0, 1.0)
    state = DelayedScaling(E4M3, history_length=3).scaler()
    rolling = _TransformerEngineModel(448.0, 3, "max", 0)
    fused = _TransformerEngineModel(448.0, 3, "max", 0)
    scales = []
    for amax in amaxes:
        state(torch.tensor([amax, -amax / 2]))
        rolling.record(amax)
        if amax != 0:
            fused.record(amax)
        assert _same_bits(state.amax_history, rolling.history), amax
        assert _same_bits(state.scale.reshape(1), np.array([rolling.scale])), amax
        scales.append((float(state.scale), float(fused.scale)))
    assert scales[3] == (448.0, 7.0)  # 64 has left the history here, not in the fused update
    assert scales[4] == (448.0, 448.0)
    assert state.amax_history.tolist() == [1.0, 0.0, 1.0]
    assert fused.history.tolist() == [1.0, 1.0, 1.0]


def test_eval_mode_and_record_false_leave_the_state_alone():
    state = DelayedScaling(E4M3).scaler()
    state(torch.tensor([2.0]))
    before = {k: v.clone() for k, v in state.state_dict().items()}
    state.eval()
    state(torch.tensor([100.0]))
    state.train()
    state(torch.tensor([100.0]), record=False)
    for k, v in state.state_dict().items():
        assert torch.equal(v, before[k]), k


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
def test_other_dtypes_round_the_float32_result_once_into_their_own(dtype):
    state = DelayedScaling(E4M3).scaler()
    state(torch.tensor([3.0]))
    x = _heavy(1000, 7).to(dtype)
    out = state(x)
    assert out.dtype == dtype
    reference = DelayedScaling(E4M3).scaler()
    reference(torch.tensor([3.0]))
    wide = reference(x.double() if dtype == torch.float64 else x.float())
    assert torch.equal(out, wide.to(dtype))


def test_stochastic_rounding_is_reproducible_by_seed_and_unbiased():
    state = DelayedScaling(E4M3).scaler()
    state(torch.tensor([1.0]))  # scale 448
    x = torch.full((200_000,), 0.3)
    a = state(x, "stochastic", seed=5, record=False)
    assert torch.equal(a, state(x, "stochastic", seed=5, record=False))
    assert not torch.equal(a, state(x, "stochastic", seed=6, record=False))
    # 0.3 * 448 = 134.4 lies between E4M3 values 128 and 144: mean within 5 sigma of 134.4 / 448
    sigma = 16 * math.sqrt(0.4 * 0.6) / math.sqrt(x.numel()) / 448
    assert abs(a.double().mean().item() - float(np.float32(0.3) * np.float32(448.0)) / 448) < (
        5 * sigma
    )


def test_gradient_passes_straight_through_exactly():
    state = DelayedScaling(E4M3).scaler()
    state(torch.tensor([3.0]))
    x = _heavy(64, 3).requires_grad_()
    g = _heavy(64, 4)
    state(x).backward(g)
    assert torch.equal(x.grad, g)


def test_quantizer_module_holds_its_scalers_in_its_state_dict():
    q = Quantizer(forward=(DelayedScaling(E4M3), "nearest"), backward=DelayedScaling(E5M2))
    assert isinstance(q.forward_scaler, DelayedScaler) and isinstance(
        q.backward_scaler, DelayedScaler
    )
    x = _heavy(256, 1).requires_grad_()
    q(x).backward(_heavy(256, 2))
    assert int(q.forward_scaler.calls) == 1 and int(q.backward_scaler.calls) == 1
    fresh = Quantizer(forward=(DelayedScaling(E4M3), "nearest"), backward=DelayedScaling(E5M2))
    fresh.load_state_dict(q.state_dict())
    y = _heavy(256, 5)
    assert torch.equal(fresh(y), q(y))
    q.eval()
    q(y)
    assert int(q.forward_scaler.calls) == 2  # the train-mode call above; eval records nothing


def test_inject_gives_every_quantised_tensor_its_own_scaler_and_remove_takes_them_away():
    model = nn.Sequential(nn.Linear(16, 8), nn.ReLU(), nn.Linear(8, 4))
    setting = LayerQuantization(
        weight=DelayedScaling(E4M3),
        output=DelayedScaling(E4M3),
        error=DelayedScaling(E5M2),
        rounding="nearest",
    )
    inject(model, {nn.Linear: setting, "default": None})
    model(_heavy(48, 0).reshape(3, 16)).sum().backward()
    keys = set(model.state_dict())
    for layer in ("0", "2"):
        assert f"{layer}.parametrizations.weight.0.scaler.scale" in keys
        assert f"{layer}.lpsim_scalers.output.0.amax_history" in keys
        assert f"{layer}.lpsim_scalers.error.0.calls" in keys
    assert float(model[0].lpsim_scalers.output["0"].amax_history[0]) > 0
    assert model[0].lpsim_scalers.output["0"] is not model[2].lpsim_scalers.output["0"]
    remove(model)
    assert set(model.state_dict()) == {"0.weight", "0.bias", "2.weight", "2.bias"}


def test_inject_records_no_amax_and_draws_nothing_so_the_first_pass_uses_scale_one():
    layer = nn.Linear(4, 2)  # training mode: torch's check of a parametrisation would run it
    with torch.no_grad():
        layer.weight.copy_(torch.tensor([[1000.0, 0.3, -2.0, 5.0], [0.1, 0.2, 0.7, -9.0]]))
        layer.bias.copy_(torch.tensor([-1000.0, 3.0]))
    weight, bias = layer.weight.detach().clone(), layer.bias.detach().clone()
    inject(
        layer,
        {
            nn.Linear: LayerQuantization(
                weight=DelayedScaling(E4M3), bias=DelayedScaling(E4M3), rounding="nearest"
            )
        },
    )
    for name in ("weight", "bias"):
        scaler = layer.parametrizations[name][0].scaler
        assert int(scaler.calls) == 0 and float(scaler.scale) == 1.0, name
    element = DelayedScaling(E4M3).saturating_element()
    y = layer(torch.eye(4))
    expected = torch.eye(4) @ lpsim.quantize(weight, element).t() + lpsim.quantize(bias, element)
    assert torch.equal(y, expected)
    assert y[0, 0].item() == 0.0  # weight 1000 and bias -1000 both saturate: 448 - 448
    fresh = nn.Linear(4, 2)  # its initialisation draws
    state = torch.get_rng_state()
    inject(fresh, {nn.Linear: LayerQuantization(weight=E5M2, bias=E5M2)})  # stochastic rules
    assert torch.equal(torch.get_rng_state(), state)


def test_inject_still_refuses_parameters_their_format_cannot_quantise_and_changes_nothing():
    model = nn.Sequential(nn.Linear(4, 2), nn.Linear(2, 2).half())
    setting = LayerQuantization(weight=lpsim.Float(8, 7))  # bfloat16's range: no float16 holds it
    with pytest.raises(
        ValueError, match=r"Linear.weight cannot be quantised.*does not fit a float16"
    ):
        inject(model, {nn.Linear: setting})
    assert not lpsim.nn.injected(model) and not hasattr(model[0], "parametrizations")
    with pytest.raises(IndexError, match="BlockFloat.dim"):
        inject(nn.Linear(4, 2), {nn.Linear: LayerQuantization(bias=lpsim.BlockFloat(8, dim=1))})
    with pytest.raises(TypeError, match="float32, float64, bfloat16 or float16 tensor"):
        layer = nn.Linear(4, 2)
        layer.weight = nn.Parameter(torch.ones(2, 4, dtype=torch.int32), requires_grad=False)
        inject(layer, {nn.Linear: LayerQuantization(weight=DelayedScaling(E4M3))})


def _attention(scale: float) -> nn.MultiheadAttention:
    torch.manual_seed(0)
    attention = nn.MultiheadAttention(8, 2, batch_first=True)
    with torch.no_grad():
        attention.in_proj_weight.mul_(scale)
    return attention


def test_a_weight_is_quantised_once_per_forward_though_multihead_attention_reads_it_three_times():
    attention = _attention(2000.0)  # |w| up to ~1000: saturates at scale 1
    reference = copy.deepcopy(attention)
    inject(
        attention,
        {nn.MultiheadAttention: LayerQuantization(weight=(DelayedScaling(E4M3), "nearest"))},
    )
    scaler = attention.parametrizations.in_proj_weight[0].scaler
    x = torch.randn(2, 3, 8)
    y, _ = attention(x, x, x)
    assert int(scaler.calls) == 1
    with torch.no_grad():  # the first pass uses scale 1
        reference.in_proj_weight.copy_(
            lpsim.quantize(reference.in_proj_weight, DelayedScaling(E4M3).saturating_element())
        )
    assert torch.equal(y, reference(x, x, x)[0])
    attention(x, x, x)[0].sum().backward()
    assert int(scaler.calls) == 2
    layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True)
    inject(
        layer,
        {
            (nn.MultiheadAttention, nn.Linear): LayerQuantization(
                weight=DelayedScaling(E4M3), bias=DelayedScaling(E4M3)
            )
        },
    )
    layer(x).sum().backward()
    counts = {n: int(b) for n, b in layer.named_buffers() if n.endswith("calls")}
    assert len(counts) == 8 and set(counts.values()) == {1}, counts


def test_stochastic_weight_rounding_draws_once_per_forward_and_uses_that_draw():
    attention = _attention(1.0)
    reference = copy.deepcopy(attention)
    inject(attention, {nn.MultiheadAttention: LayerQuantization(weight=E5M2)})  # stochastic
    x = torch.randn(2, 3, 8)
    torch.manual_seed(5)
    y, _ = attention(x, x, x)
    after_forward = torch.get_rng_state()
    torch.manual_seed(5)
    with torch.no_grad():
        reference.in_proj_weight.copy_(lpsim.quantize(reference.in_proj_weight, E5M2, "stochastic"))
    assert torch.equal(torch.get_rng_state(), after_forward)  # one draw
    assert torch.equal(y, reference(x, x, x)[0])
    # each call of a module is a forward of its own: a layer called twice quantises twice
    layer = inject(
        nn.Linear(4, 4), {nn.Linear: LayerQuantization(weight=(DelayedScaling(E4M3), "nearest"))}
    )
    twice = nn.Sequential(layer, layer)
    twice(torch.randn(2, 4))
    assert int(layer.parametrizations.weight[0].scaler.calls) == 2


def test_remove_gives_back_the_class_forward_and_a_copy_runs_its_own():
    layer = nn.Linear(4, 4)
    inject(layer, {nn.Linear: LayerQuantization(weight=(DelayedScaling(E4M3), "nearest"))})
    twin = copy.deepcopy(layer)
    twin(torch.randn(2, 4))
    assert int(twin.parametrizations.weight[0].scaler.calls) == 1
    assert int(layer.parametrizations.weight[0].scaler.calls) == 0
    remove(layer)
    assert "forward" not in vars(layer) and not hasattr(layer, "parametrizations")


class _Add(nn.Module):
    def forward(self, a, b):
        return a + b


class _Pair(nn.Module):
    def forward(self, x):
        return x * 1000.0, x


def test_every_input_and_output_of_a_module_has_its_own_scaler():
    add = inject(_Add(), {_Add: LayerQuantization(input=(DelayedScaling(E4M3), "nearest"))})
    thousand = torch.tensor([1000.0])
    assert add(thousand, thousand.clone()).item() == 896.0  # both saturate to 448 at scale 1
    second = DelayedScaling(E4M3).scaler()
    second(thousand)
    # a keyword argument has a scaler of its own, named after it: fresh, so b saturates again
    assert torch.equal(add(thousand, b=thousand.clone()), second(thousand) + 448.0)
    assert sorted(add.state_dict()) == [
        f"lpsim_scalers.input.{place}.{key}"
        for place in ("0", "1", "b")
        for key in ("amax_history", "calls", "scale", "scale_inverse", "scaled_max")
    ]
    assert (
        int(add.lpsim_scalers.input["0"].calls) == 2
        and int(add.lpsim_scalers.input["b"].calls) == 1
    )
    twin = copy.deepcopy(add)  # its own scalers, not the original's
    twin(thousand, thousand.clone())
    assert int(twin.lpsim_scalers.input["0"].calls) == 3
    assert int(add.lpsim_scalers.input["0"].calls) == 2
    pair = inject(
        _Pair(),
        {
            _Pair: LayerQuantization(
                output=DelayedScaling(E4M3), error=DelayedScaling(E5M2), rounding="nearest"
            )
        },
    )
    x = torch.tensor([0.5, -0.25], requires_grad=True)
    big, small = pair(x)
    (big * 1000.0 + small).sum().backward()
    outputs, errors = pair.lpsim_scalers.output, pair.lpsim_scalers.error
    assert [float(outputs[p].amax_history[0]) for p in "01"] == [500.0, 0.5]
    assert [float(errors[p].amax_history[0]) for p in "01"] == [1000.0, 1.0]


def test_multihead_attention_quantises_query_key_value_and_its_two_outputs_apart():
    attention = nn.MultiheadAttention(4, 1, batch_first=True)
    delayed = (DelayedScaling(E4M3, history_length=1, reduction="most_recent"), "nearest")
    inject(attention, {nn.MultiheadAttention: LayerQuantization(input=delayed, output=delayed)})
    seen = []
    attention.register_forward_pre_hook(lambda m, args: seen.append(args))  # after the quantiser
    x = torch.full((1, 2, 4), 1000.0)
    out, weights = attention(x, x.clone(), x.clone())
    assert all(torch.all(t == 448.0) for t in seen[0])
    inputs, outputs = attention.lpsim_scalers.input, attention.lpsim_scalers.output
    assert all(int(inputs[p].calls) == 1 for p in "012")
    assert float(outputs["1"].amax_history[0]) <= 1.0 < float(outputs["0"].amax_history[0])


def test_self_attention_quantises_its_one_input_once_by_the_first_places_scaler():
    attention = nn.MultiheadAttention(4, 1, batch_first=True)
    delayed = (DelayedScaling(E4M3, history_length=1, reduction="most_recent"), "nearest")
    inject(attention, {nn.MultiheadAttention: LayerQuantization(input=delayed)})
    seen = []
    attention.register_forward_pre_hook(lambda m, args: seen.append(args))  # after the quantiser
    x = torch.full((1, 2, 4), 1000.0)
    attention(x, x, x)
    query, key, value = seen[0]
    assert query is key is value and torch.all(query == 448.0)
    assert list(attention.lpsim_scalers.input._modules) == ["0"]
    assert int(attention.lpsim_scalers.input["0"].calls) == 1
    attention(query=x, key=x, value=x)  # by keyword: the first keyword's place
    assert list(attention.lpsim_scalers.input._modules) == ["0", "query"]


def test_a_state_dict_makes_the_scalers_it_holds_and_loads_one_from_before_they_were_per_tensor():
    def make():
        setting = LayerQuantization(
            input=DelayedScaling(E4M3), output=DelayedScaling(E4M3), rounding="nearest"
        )
        return inject(_Add(), {_Add: setting})

    trained = make()
    for i in range(3):
        trained(_heavy(8, i), _heavy(8, 10 + i) * 100)
    fresh = make()
    assert not fresh.state_dict()  # no tensor quantised yet
    fresh.load_state_dict(trained.state_dict())
    a, b = _heavy(8, 20), _heavy(8, 21)
    assert torch.equal(fresh(a, b), trained(a, b))
    again = make()
    again(a, b)
    again.load_state_dict(make().state_dict())  # strict: back to no scaler at all
    assert not again.state_dict()
    old = {
        f"lpsim_scalers.input.{k}": v
        for k, v in trained.lpsim_scalers.input["0"].state_dict().items()
    }
    old.update(
        {
            f"lpsim_scalers.output.{k}": v
            for k, v in trained.lpsim_scalers.output["0"].state_dict().items()
        }
    )
    earlier = make()
    earlier.load_state_dict(old)
    for role in ("input", "output"):
        got = getattr(earlier.lpsim_scalers, role)["0"].state_dict()
        for key, value in getattr(trained.lpsim_scalers, role)["0"].state_dict().items():
            assert torch.equal(got[key], value), (role, key)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
def test_dtype_conversions_leave_the_scalers_float32(dtype):
    q = Quantizer(forward=(DelayedScaling(E4M3, history_length=4), "nearest"))
    q(torch.tensor([3.0]))
    before = {k: v.clone() for k, v in q.state_dict().items()}
    q.to(dtype)
    for key, value in q.state_dict().items():
        assert value.dtype == before[key].dtype and torch.equal(value, before[key]), key
    q.half().double().bfloat16()
    assert q.forward_scaler.scale.dtype == torch.float32
    x = _heavy(1000, 3).to(dtype)
    reference = DelayedScaling(E4M3, history_length=4).scaler()
    reference(torch.tensor([3.0]))
    assert torch.equal(q(x), reference(x))
    q(torch.tensor([1e5]))  # in a float16 history: inf
    assert float(q.forward_scaler.amax_history[0]) == 1e5
    layer = inject(
        nn.Linear(4, 4),
        {nn.Linear: LayerQuantization(weight=DelayedScaling(E4M3), output=DelayedScaling(E4M3))},
    )
    layer.to(dtype)
    layer(torch.randn(2, 4, dtype=dtype))
    assert {b.dtype for n, b in layer.named_buffers() if not n.endswith("calls")} == {torch.float32}


def test_report_with_an_example_leaves_the_scalers_as_they_were():
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    inject(
        model,
        {nn.Linear: LayerQuantization(weight=DelayedScaling(E4M3), output=DelayedScaling(E4M3))},
        unmatched="ignore",
    )
    before = copy.deepcopy(model.state_dict())
    lpsim.nn.report(model, example=torch.randn(3, 4))
    after = model.state_dict()
    assert sorted(after) == sorted(before)
    assert all(torch.equal(after[k], v) for k, v in before.items())


def test_report_with_an_example_inside_quantize_functions_leaves_its_scalers_as_they_were():
    """The example pass runs the model's softmax, which the active context quantises through a
    DelayedScaler: its history and scale must be those of the run, as without report()."""

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = nn.Linear(4, 4)

        def forward(self, x):
            return torch.softmax(self.linear(x), -1)

    torch.manual_seed(0)
    model = inject(Model(), {nn.Linear: LayerQuantization(output=lpsim.Float(5, 2))})
    functions = lpsim.nn.quantize_functions(
        model, {"softmax": LayerQuantization(input=DelayedScaling(E4M3), rounding="nearest")}
    )
    with functions:
        model(torch.randn(2, 4))
        before = copy.deepcopy(functions.scalers.state_dict())
        lpsim.nn.report(model, example=100 * torch.randn(2, 4))  # another amax
        after = functions.scalers.state_dict()
    assert sorted(after) == sorted(before)
    assert all(torch.equal(after[k], v) for k, v in before.items())


def test_optimlp_keeps_one_scaler_per_parameter_and_tensor_in_its_state_dict():
    def run(steps, opt, model):
        for i in range(steps):
            model(_heavy(24, i).reshape(3, 8)).sum().backward()
            opt.step()
            opt.zero_grad()

    def make():
        torch.manual_seed(0)
        model = nn.Linear(8, 4)
        sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        spec = (DelayedScaling(E4M3, history_length=4), "nearest")
        return model, OptimLP(sgd, grad=spec, momentum=spec)

    model, opt = make()
    run(3, opt, model)
    names = set(opt.scalers[model.weight])
    assert names == {"grad", "momentum.momentum_buffer"}
    assert opt.scalers[model.weight]["grad"] is not opt.scalers[model.bias]["grad"]
    # A copy: torch.optim's state_dict() holds the live buffers, and load_state_dict keeps them
    # when dtype and device match, so an uncopied state_dict would alias the two optimizers.
    saved = copy.deepcopy(opt.state_dict())
    model2, opt2 = make()
    model2.load_state_dict(model.state_dict())
    opt2.load_state_dict(saved)
    for p, p2 in zip(model.parameters(), model2.parameters(), strict=True):
        for name, scaler in opt.scalers[p].items():
            for key, value in scaler.state_dict().items():
                assert torch.equal(opt2.scalers[p2][name].state_dict()[key], value), (name, key)
    run(2, opt, model)
    run(2, opt2, model2)
    assert torch.equal(model.weight, model2.weight) and torch.equal(model.bias, model2.bias)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"element": "e4m3"}, TypeError, "DelayedScaling.element must be a Float or Fixed"),
        ({"history_length": 0}, ValueError, "DelayedScaling.history_length"),
        ({"history_length": 2.0}, TypeError, "DelayedScaling.history_length"),
        ({"reduction": "mean"}, ValueError, r"DelayedScaling.reduction must be one of"),
        ({"margin": -1}, ValueError, r"DelayedScaling.margin must be in \[0.0, 64.0\]"),
        ({"margin": "1"}, TypeError, "DelayedScaling.margin must be a number"),
    ],
)
def test_bad_fields_are_refused_with_their_name(kwargs, error, match):
    arguments = {"element": E4M3, **kwargs}
    element = arguments.pop("element")
    with pytest.raises(error, match=match):
        DelayedScaling(element, **arguments)


def test_stateless_uses_are_refused_with_the_reason():
    scaling = DelayedScaling(E4M3)
    with pytest.raises(TypeError, match="quantizer\\(\\) keeps no state"):
        quantizer(scaling)
    with pytest.raises(TypeError, match="fmt must be a Float, Fixed, P3109, BlockFloat or Scaled"):
        lpsim.quantize(torch.ones(3), scaling)
    with pytest.raises(TypeError, match="scaling must be a DelayedScaling"):
        DelayedScaler(E4M3)
    with pytest.raises(ValueError, match="clamp_grad_zero needs a forward format that clips"):
        Quantizer(forward=scaling, clamp_grad_zero=True)


@pytest.mark.parametrize("reentrant", [False, True], ids=["non_reentrant", "reentrant"])
def test_activation_checkpointing_of_a_delayed_scaled_model_is_refused_not_recomputed(reentrant):
    """The recomputation would record a second amax and quantise with the updated scale: other
    activations and gradients than the forward's. It raises instead."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    inject(model, {nn.Linear: LayerQuantization(input=DelayedScaling(lpsim.Float(4, 3)))})
    x = torch.randn(3, 4, requires_grad=True)
    y = torch.utils.checkpoint.checkpoint(model, x, use_reentrant=reentrant)
    with pytest.raises(RuntimeError, match="activation checkpointing"):
        y.sum().backward()


def test_an_optimizer_step_inside_the_backward_pass_still_scales_its_tensors():
    """The optimizer-in-backward pattern (a step from a post-accumulate-grad hook) is no
    recomputation: OptimLP's delayed-scaled tensors are quantised there as anywhere."""
    w = nn.Parameter(torch.tensor([1.0, -2.0, 3.0]))
    opt = OptimLP(torch.optim.SGD([w], lr=0.5), weight=DelayedScaling(lpsim.Float(4, 3)))
    w.register_post_accumulate_grad_hook(lambda p: opt.step())
    (w * w).sum().backward()
    twin = nn.Parameter(torch.tensor([1.0, -2.0, 3.0]))
    reference = OptimLP(torch.optim.SGD([twin], lr=0.5), weight=DelayedScaling(lpsim.Float(4, 3)))
    (twin * twin).sum().backward()
    reference.step()
    assert torch.equal(w.detach(), twin.detach())


@pytest.mark.parametrize("how", ["group", "default_quantization"])
def test_a_delayed_scaling_replaced_between_steps_rounds_into_its_own_format(how):
    """A weight's DelayedScaling replaced between steps (a group's "quantization", or the
    optimizer's default_quantization) rounds the next step into the new element format, with a
    scaler of its own starting afresh (scale 1 at its first call). Before, the scaler of the old
    DelayedScaling was kept and the weights stayed on the old e4m3 grid."""
    from lpsim.optim import ParameterQuantization

    w = nn.Parameter(torch.tensor([1.3, -0.77, 0.41, 2.9, -3.6]))
    e4m3 = DelayedScaling(lpsim.Float(4, 3, special="fn"), history_length=4)
    opt = OptimLP(torch.optim.SGD([w], lr=0.1), weight=(e4m3, "nearest"))
    for _ in range(2):
        opt.zero_grad()
        (w * w.detach().cos()).sum().backward()
        opt.step()
    new = ParameterQuantization(
        weight=(DelayedScaling(lpsim.Fixed(4, 1), history_length=4), "nearest")
    )
    if how == "group":
        opt.param_groups[0]["quantization"] = new
    else:
        opt.default_quantization = new
    opt.zero_grad()
    (w * w.detach().cos()).sum().backward()
    updated = w.detach().clone().add_(w.grad, alpha=-0.1)  # torch's SGD step, in float32
    opt.step()
    # Fixed(4, 1) with scale 1: the nearest multiple of 1/2 (ties to even) in [-4, 3.5].
    want = (torch.round(updated.double() * 2) / 2).clamp(-4, 3.5).float()
    assert torch.equal(w.detach(), want)


class _Nested(nn.Module):
    """Returns one tensor at two places of a nested output, and another beside it."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x):
        y = self.linear(x)
        return y, (y * 2, y)


@pytest.mark.parametrize("role", ["output", "error"])
def test_a_compiled_module_with_nested_outputs_makes_its_scalers_and_gives_the_eager_bits(role):
    """The first compiled call makes the scalers outside the graph (a graph break inside the
    quantisation of a nested output). That call, and the next, give the eager outputs, gradients
    and scaler states (it raised an internal dynamo error while building the quantising
    function of a DelayedScaler)."""
    scaling = (DelayedScaling(E4M3, history_length=3), "nearest")

    def make():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(3, 4), _Nested())
        return inject(model, {_Nested: LayerQuantization(**{role: scaling})})

    eager, model = make(), make()
    compiled = torch.compile(model, backend="aot_eager")
    for i in range(2):
        x = torch.randn(5, 3, generator=torch.Generator().manual_seed(i)) * 4**i
        want, got = eager(x), compiled(x)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1][0], want[1][0])
        assert got[1][1] is got[0]  # one tensor, quantised once
        (want[0].sum() + 3 * want[1][0].sum()).backward()
        (got[0].sum() + 3 * got[1][0].sum()).backward()
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(eager.parameters(), model.parameters()))
    want, got = eager.state_dict(), model.state_dict()
    assert want.keys() == got.keys() and any(role in k for k in want)
    assert all(torch.equal(got[k], want[k]) for k in want)


def test_exporting_before_the_scalers_exist_is_refused_and_after_one_pass_records_as_eager():
    """torch.export of an injected model whose scalers are not made yet raised nothing, and the
    exported program quantised every call with the trace's scale (1), recording nothing, where
    the model rescales after each call. It is refused now, naming the remedy; after one forward
    pass the exported program's outputs and scaler states follow the eager model's, call by
    call."""
    scaling = (DelayedScaling(E4M3, history_length=2), "nearest")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))
    inject(model, {nn.Linear: LayerQuantization(input=scaling, output=scaling, error=scaling)})
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(1))
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(RuntimeError, match="Run the model once"):
        torch.export.export(model, (x,))
    after = model.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    model(x * 5)
    eager = copy.deepcopy(model)
    exported = torch.export.export(model, (x,)).module()
    for scale in (1.0, 300.0, 0.01):
        assert torch.equal(exported(x * scale), eager(x * scale))
    want, got = eager.state_dict(), exported.state_dict()
    assert any("lpsim_scalers.input" in k for k in want)
    for key in want:
        assert torch.equal(got[key], want[key]), key


@pytest.mark.parametrize("eager_steps", [0, 1], ids=["compiled-from-the-start", "one-eager-step"])
def test_compiled_steps_leave_the_scalers_where_eager_steps_do(eager_steps):
    """After the same steps compiled (aot_eager) and eager, with an eval pass and its recompile
    between them, every amax history, scale and call count is equal, and the eval pass records
    nothing: whether the scalers (the errors' included, which the backward pass updates) are
    made by an eager step or inside the compiled model's first call."""
    scaling = (DelayedScaling(lpsim.Float(4, 3, saturate=True), history_length=4), "nearest")

    def make():
        torch.manual_seed(0)
        config = {
            "0": LayerQuantization(weight=scaling, input=scaling, output=scaling, error=scaling),
            "2": LayerQuantization(error=scaling),
        }
        return inject(nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 3)), config)

    generator = torch.Generator().manual_seed(1)
    batches = [torch.randn(5, 4, generator=generator) * 4**i for i in range(4)]
    eager, model = make(), make()
    compiled = torch.compile(model, backend="aot_eager")
    for i, x in enumerate(batches):
        for owner, run in ((eager, eager), (model, model if i < eager_steps else compiled)):
            (run(x) ** 2).mean().backward()
            if i == 2:
                before = copy.deepcopy(owner.state_dict())
                owner.eval()
                with torch.no_grad():
                    run(x * 100)
                owner.train()
                after = owner.state_dict()
                assert all(torch.equal(before[k], after[k]) for k in before)
    want, got = eager.state_dict(), model.state_dict()
    assert want.keys() == got.keys() and any("error" in k for k in want)
    for key in want:
        assert torch.equal(got[key], want[key]), key
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(eager.parameters(), model.parameters()))


class _Keyed(nn.Module):
    """Returns a dict whose keys the old place names joined: "a.b" and "a_b", "c-1" and item 1
    of "c", "" and "_", "training" and "training_"."""

    def forward(self, x):
        return {
            "a.b": x * 1.0,
            "a_b": x * 2.0,
            "c-1": x * 4.0,
            "c": (x * 8.0, x * 16.0),
            "": x * 32.0,
            "_": x * 64.0,
            "training": x * 128.0,
            "training_": x * 256.0,
        }


def test_every_output_of_a_dict_has_a_scaler_of_its_own():
    """Each tensor a module returns in a dict records its own amax in a scaler of its own, whatever
    its key: keys that the place names once made alike ("a.b" and "a_b") share no history."""
    keyed = inject(
        _Keyed(), {_Keyed: LayerQuantization(output=DelayedScaling(E4M3), rounding="nearest")}
    )
    out = keyed(torch.tensor([0.5, -1.0]))
    scalers = list(keyed.lpsim_scalers.output.children())
    assert len(scalers) == 9
    amaxes = sorted(float(s.amax_history[0]) for s in scalers)
    assert amaxes == [2.0**k for k in range(9)]
    for key, want in [("a.b", 1.0), ("a_b", 2.0), ("c-1", 4.0), ("", 32.0), ("training_", 256.0)]:
        assert float(out[key].abs().max()) == want, key


class _MixedKeys(nn.Module):
    """Returns a dict whose keys 1 and "1", None and "None" have one str()."""

    def forward(self, x):
        return {1: x * 100.0, "1": x, None: x * 4.0, "None": x * 8.0}


def test_dict_keys_of_other_types_with_one_str_have_scalers_of_their_own():
    """Keys 1 and "1" (None and "None") were one place, "1": the two tensors shared one scaler,
    which recorded both amaxes, and the second tensor quantised by the scale of the first's amax:
    1.0 came out as 1.0044643 (E4M3 of 1.0 * 448/100, divided by 448/100), not 1.0."""
    mixed = inject(
        _MixedKeys(),
        {_MixedKeys: LayerQuantization(output=DelayedScaling(E4M3), rounding="nearest")},
    )
    out = mixed(torch.ones(2))
    scalers = list(mixed.lpsim_scalers.output.children())
    assert len(scalers) == 4
    assert sorted(float(s.amax_history[0]) for s in scalers) == [1.0, 4.0, 8.0, 100.0]
    assert all(int(s.calls) == 1 for s in scalers)
    # the first call of each scaler has scale 1: E4M3's own values
    assert {k: v.tolist() for k, v in out.items()} == {
        1: [96.0, 96.0],
        "1": [1.0, 1.0],
        None: [4.0, 4.0],
        "None": [8.0, 8.0],
    }
    assert mixed.lpsim_scalers.output["1"].amax_history[0] == 1.0  # a str key keeps its name


@pytest.mark.parametrize("training", [True, False])
def test_a_delayed_scaler_under_torch_func_raises_clearly_except_under_jvp(training):
    # grad failed in its backward pass with torch's "mutate a captured Tensor", vmap, jacrev and
    # jacfwd with messages about in-place arithmetic or a missing setup_context, naming nothing
    # of lpsim's.
    scaling = DelayedScaling(lpsim.Float(4, 3), history_length=4)
    module = Quantizer(scaling, scaling, "nearest", "nearest").train(training)
    xs = torch.tensor([[0.5, -3.0, 7.0], [1.0, 2.0, -0.25]])
    transforms = [
        lambda: torch.func.grad(lambda x: module(x).sum())(xs[0]),
        lambda: torch.func.jacrev(module)(xs[0]),
        lambda: torch.func.jacfwd(module)(xs[0]),
        lambda: torch.func.vmap(module)(xs),
    ]
    for transform in transforms:
        with pytest.raises(RuntimeError, match=r"^a DelayedScaler writes its state"):
            transform()
    # vjp: its function runs the backward pass outside the transform, as backward() runs it
    module = Quantizer(scaling, scaling, "nearest", "nearest").train(training)
    value, backward = torch.func.vjp(module, xs[0])
    (gradient,) = backward(torch.tensor([0.5, 3.0, -7.0]))
    assert torch.equal(value, torch.tensor([0.5, -3.0, 7.0]))  # on Float(4, 3)'s grid, scale 1
    assert torch.equal(gradient, torch.tensor([0.5, 3.0, -7.0]))
    for scaler in (module.forward_scaler, module.backward_scaler):
        assert int(scaler.calls) == int(training)
        assert scaler.amax_history.tolist() == [7.0 if training else 0.0, 0.0, 0.0, 0.0]
    # jvp: the call quantises and records as backward's forward pass does (scale 1 first)
    module = Quantizer(scaling, scaling, "nearest", "nearest").train(training)
    value, tangent = torch.func.jvp(module, (xs[0],), (torch.ones(3),))
    assert torch.equal(value, torch.tensor([0.5, -3.0, 7.0]))  # on Float(4, 3)'s grid
    assert torch.equal(tangent, torch.ones(3))
    assert int(module.forward_scaler.calls) == int(training)
    if training:
        assert module.forward_scaler.amax_history.tolist() == [7.0, 0.0, 0.0, 0.0]


def test_a_float64_amax_beyond_float32s_range_is_refused_and_changes_no_state():
    # Its float32 history entry would be Inf, which keeps the scale: 1e39 saturated to 448 at every
    # call, for as long as "max" remembered the Inf, while the scale its amax gives, 448 / 1e39, is
    # a float32 number.
    state = DelayedScaling(E4M3, history_length=4).scaler()
    x = torch.tensor([1e39, 1.0, -3e38], dtype=torch.float64)
    with pytest.raises(ValueError, match=r"x's largest finite magnitude, 1e\+39, lies beyond"):
        state(x)
    assert not state.amax_history.any() and int(state.calls) == 0
    assert float(state.scale) == 1.0 and float(state.scale_inverse) == 1.0
    # Not recording, the call quantises with the scale it has; an Inf is still an Inf amax.
    assert state(x, record=False).tolist() == [448.0, 1.0, -448.0]
    state(torch.tensor([math.inf, 2.0], dtype=torch.float64))
    assert math.isinf(float(state.amax_history[0])) and float(state.scale) == 1.0


def test_a_positive_float64_amax_below_float32s_subnormals_gives_the_largest_scale():
    # 448 / 1e-47 overflows float32, so the scale is float32's largest, as for any amax below
    # 448 / 3.4e38; rounded to a float32 zero, the amax kept the scale of the call before (448).
    largest = torch.finfo(torch.float32).max
    state = DelayedScaling(E4M3, history_length=1, reduction="most_recent").scaler()
    state(torch.tensor([1.0], dtype=torch.float64))
    assert float(state.scale) == 448.0
    state(torch.tensor([1e-47, -0.0], dtype=torch.float64))
    assert float(state.scale) == largest
    assert float(state.amax_history[0]) == 2.0**-149
    x = torch.tensor([1e-40], dtype=torch.float64)  # 1e-40 * largest = 0.034: E4M3 holds 0.03515625
    expected = 0.03515625 * float(torch.tensor(1.0) / torch.tensor(largest))
    assert state(x).item() == expected


def _delayed_linear(scaling: DelayedScaling) -> nn.Sequential:
    model = nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 4))
    inject(model, {"1": LayerQuantization(weight=scaling, input=scaling, rounding="nearest")})
    return model


@pytest.mark.parametrize(
    "other",
    [DelayedScaling(E4M3, history_length=4), DelayedScaling(E5M2, history_length=4, margin=2)],
    ids=["another element", "another margin"],
)
def test_a_delayed_scaler_state_of_another_scaling_is_refused_not_loaded(other):
    """A checkpoint of a model whose weight and input E5M2 scalers have recorded (scale 57344 /
    amax) loaded into the same model injected with another element range or margin raises
    torch's RuntimeError naming the key, as a history of another length does, and leaves the
    scalers as they were. (It loaded silently: the next forward multiplied the E4M3 weight by
    57344 / amax and clamped it at amax / 128.) The optimizer's scalers are refused alike."""
    torch.manual_seed(0)
    saved = _delayed_linear(DelayedScaling(E5M2, history_length=4))
    for _ in range(2):
        saved(torch.randn(32, 8))
    model = _delayed_linear(other)
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(RuntimeError, match=r"1\.parametrizations\.weight\.0\.scaler\.scaled_max"):
        model.load_state_dict(saved.state_dict())
    after = model.state_dict()
    for key in [k for k in before if "scaler" in k]:
        assert torch.equal(after[key], before[key]), key

    def optimizer(model, scaling):
        return OptimLP(torch.optim.SGD(model.parameters(), lr=0.1), grad=(scaling, "nearest"))

    saved_opt = optimizer(saved, DelayedScaling(E5M2))
    saved(torch.randn(32, 8)).sum().backward()
    saved_opt.step()
    with pytest.raises(RuntimeError, match="scaled_max"):
        optimizer(model, other).load_state_dict(saved_opt.state_dict())


def test_a_delayed_scaler_state_saved_without_its_scaled_max_loads_as_before():
    """A state_dict saved before a scaler kept its scaled_max (the key taken out) loads, strictly,
    into the scalers of its own scaling and continues as the saved model does."""
    torch.manual_seed(0)
    scaling = DelayedScaling(E4M3, history_length=4)
    saved = _delayed_linear(scaling)
    for _ in range(2):
        saved(torch.randn(32, 8))
    old = {k: v for k, v in saved.state_dict().items() if not k.endswith("scaled_max")}
    model = _delayed_linear(scaling)
    model.load_state_dict(old)
    x = torch.randn(32, 8)
    assert torch.equal(model(x), saved(x))
    after, want = model.state_dict(), saved.state_dict()
    assert after.keys() == want.keys()
    for key, value in want.items():
        assert torch.equal(after[key], value), key


def _nearest_float32(q: Fraction) -> float:
    """q rounded to the nearest float32 (ties to even), from exact arithmetic."""
    guess = np.float32(float(q))
    candidates = [np.nextafter(guess, np.float32(-np.inf)), guess]
    candidates.append(np.nextafter(guess, np.float32(np.inf)))
    finite = [c for c in candidates if np.isfinite(c)]
    best = min(finite, key=lambda c: (abs(Fraction(float(c)) - q), int(c.view(np.int32)) & 1))
    return float(best)


def _nearest_with_significand_bits(y: float, bits: int, largest: float) -> float:
    """y (a normal float64) rounded to ``bits`` significant bits, ties to even, at most
    ``largest`` in magnitude."""
    fraction, exponent = math.frexp(y)
    rounded = math.ldexp(round(math.ldexp(fraction, bits)), exponent - bits)
    return math.copysign(min(abs(rounded), largest), y)


@pytest.mark.parametrize("margin", [0, 1, 8])
def test_an_element_format_wider_than_float32_gets_the_scale_its_amax_gives(margin):
    """Float(8, 24)'s largest value, (2 - 2**-24) * 2**127, exceeds float32's: elem_max * 2**-margin
    rounded to float32 was Inf (margin 0 to 8 here), so every scale was float32's largest, and a
    float64 tensor [100, -3, 0.5] decoded to [1, -1, 0.5] at every call after the first. The scale
    is the quotient rounded once to float32, from exact arithmetic here."""
    element = lpsim.Float(8, 24)
    state = DelayedScaling(element, history_length=2, margin=margin).scaler()
    x = torch.tensor([100.0, -3.0, 0.5], dtype=torch.float64)
    state(x)
    numerator = Fraction(element.max) / 2**margin
    assert float(state.scale) == _nearest_float32(numerator / 100)
    inverse = np.float32(1) / np.float32(float(state.scale))
    assert float(state.scale_inverse) == float(inverse)
    scale = float(state.scale)
    expected = [
        _nearest_with_significand_bits(v * scale, 25, element.max) * float(inverse)
        for v in x.tolist()
    ]
    assert state(x).tolist() == expected
    assert state(x).tolist() == pytest.approx([100.0, -3.0, 0.5], rel=2**-22)


def test_an_element_format_below_float32s_range_gets_the_scale_its_amax_gives():
    """Float(4, 3, bias=200, special="fn") is E4M3 times 2**-193: its largest value, 448 * 2**-193,
    lies below float32's subnormals, so elem_max rounded to float32 was 0, the scale 0 raised to
    2**-128 + 2**-149, and a float64 tensor [1e-30, -3e-31] decoded to zeros. The scale is
    448 * 2**-193 / amax rounded to float32 (3.6e-26 here), and the elements are ml_dtypes' E4M3
    of x * scale * 2**193, times 2**-193."""
    element = lpsim.Float(4, 3, bias=200, special="fn")
    assert element.max == 448 * 2.0**-193
    state = DelayedScaling(element, history_length=2).scaler()
    x = torch.tensor([1e-30, -3e-31, 0.0], dtype=torch.float64)
    state(x)
    amax = float(np.float32(1e-30))  # the float32 history's amax
    assert float(state.scale) == _nearest_float32(Fraction(element.max) / Fraction(amax))
    scale = float(state.scale)
    inverse = float(np.float32(1) / np.float32(scale))
    products = np.array([v * scale * 2.0**193 for v in x.tolist()])
    elements = products.astype(ml_dtypes.float8_e4m3fn).astype(np.float64) * 2.0**-193
    assert state(x).tolist() == (elements * inverse).tolist()
    assert state(x)[0].item() == pytest.approx(1e-30, rel=2**-4)


def test_recording_follows_the_training_mode_not_grad_mode_and_every_call_records():
    """The documented rule, where Transformer Engine decides by grad mode and updates once per
    fp8_autocast: a training-mode call under torch.no_grad records, eval mode with gradients
    records nothing (neither the forward nor the backward scaler), and a module called twice
    records twice, the second call quantising with the scale the first left."""
    q = Quantizer(
        forward=(DelayedScaling(E4M3, history_length=4), "nearest"),
        backward=(DelayedScaling(E5M2, history_length=4), "nearest"),
    )
    with torch.no_grad():
        assert q(torch.tensor([2.0])).item() == 2.0
    assert int(q.forward_scaler.calls) == 1 and float(q.forward_scaler.scale) == 224.0
    q.eval()
    x = torch.tensor([4.0], requires_grad=True)
    q(x).backward(torch.tensor([8.0]))
    assert int(q.forward_scaler.calls) == 1 and int(q.backward_scaler.calls) == 0
    q.train()
    y = torch.tensor([1000.0])
    assert q(y).item() == 2.0  # 1000 * 224 saturates at 448, times 1 / 224
    scale = np.float32(448.0) / np.float32(1000.0)
    assert float(q.forward_scaler.scale) == float(scale)
    assert q(y).item() == float(np.float32(448.0) * (np.float32(1) / scale))
    assert q.forward_scaler.amax_history.tolist() == [1000.0, 1000.0, 2.0, 0.0]


def test_an_infinite_value_is_the_element_formats_largest_in_e4m3_and_stays_infinite_in_e5m2():
    """As documented: E4M3 has no Inf, and +-Inf decodes to +-448 * scale_inverse, as under
    Transformer Engine's satfinite cast; a saturating E5M2 keeps +-Inf, which that cast takes to
    +-57344 (an amax of Inf keeps the scale in both)."""
    decoded_max = float(np.float32(448.0) * (np.float32(1.0) / np.float32(224.0)))
    for element, expected in ((E4M3, decoded_max), (E5M2, math.inf)):
        state = DelayedScaling(element, history_length=1).scaler()
        state(torch.tensor([element.max / 224.0]))  # scale 224
        y = state(torch.tensor([math.inf, -math.inf, 1.0]))
        assert y.tolist() == [expected, -expected, 1.0], element
        assert float(state.scale) == 224.0
