"""Delayed scaling (lpsim.delayed_scaling): the quantisation against ml_dtypes' float8 casts bit for
bit, the amax history and scale update against a float32 model of Transformer Engine's published
amax_and_scale_update, state in Quantizer, inject and OptimLP, and the errors."""

from __future__ import annotations

import copy
import math

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
        # max ignores NaN and keeps the Inf for the history's length; most_recent sees the NaN
        assert float(state.scale) == 224.0


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
        assert f"{layer}.lpsim_scalers.output.amax_history" in keys
        assert f"{layer}.lpsim_scalers.error.calls" in keys
    assert float(model[0].lpsim_scalers.output.amax_history[0]) > 0
    assert model[0].lpsim_scalers.output is not model[2].lpsim_scalers.output
    remove(model)
    assert set(model.state_dict()) == {"0.weight", "0.bias", "2.weight", "2.bias"}


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
