"""inject(), remove(), quantized_parameters() and report() on models as users have them: deep
copies of injected models, tied parameters, a failing inject(), weights already parametrised
(weight_norm, orthogonal), the calls torch's own layers accept, and report()'s example pass. Each
test reproduces a way in which these once broke or silently differed from their documentation."""

import collections
import copy
import dataclasses
import io
import re
import warnings

import pytest
import torch
from support import assert_same_bits
from torch import nn
from torch.nn import functional as F
from torch.nn.utils import parametrize
from torch.nn.utils.parametrizations import orthogonal, spectral_norm, weight_norm

import lpsim
from lpsim import Float
from lpsim.delayed_scaling import DelayedScaler, DelayedScaling
from lpsim.diagnostics.recorder import Recorder
from lpsim.diagnostics.shadow import Shadow
from lpsim.nn import LayerQuantization, inject, injected, quantized_parameters, remove, report
from lpsim.nn.functional import Operands

E5M2 = Float(5, 2)
E4M1 = Float(4, 1)
DELAYED = DelayedScaling(Float(4, 3, special="fn"), history_length=4)


def assert_same_state(got: dict, want: dict) -> None:
    assert list(got) == list(want)
    for key in want:
        if want[key].is_floating_point():
            assert_same_bits(got[key], want[key], key)
        else:
            assert got[key].dtype == want[key].dtype and torch.equal(got[key], want[key]), key


def structure(model: nn.Module) -> dict:
    """What inject and remove change: each module's class, its parameters (by identity), its
    submodules and hooks."""
    return {
        name: (
            type(module),
            [(n, id(p)) for n, p in module._parameters.items()],
            list(module._modules),
            list(module._forward_pre_hooks.values()),
            list(module._forward_hooks.values()),
            dict(module.__dict__).get("forward"),
        )
        for name, module in model.named_modules()
    }


# A deep copy of an injected model shares torch's parametrised classes with the original


def test_removing_or_reinjecting_a_deep_copy_leaves_the_original_working():
    model = inject(
        nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2)),
        {nn.Linear: LayerQuantization(weight=E5M2, bias=E5M2, output=E5M2)},
    ).eval()
    originals = [model[0].parametrizations.weight.original, model[2].parametrizations.bias.original]
    x = torch.randn(3, 4)
    before = model(x)
    for change in (remove, lambda m: inject(m, {"0": LayerQuantization(bias=E4M1)})):
        change(copy.deepcopy(model))
        assert_same_bits(model(x), before)
    remove(model)
    assert model[0].weight is originals[0] and model[2].bias is originals[1]
    assert type(model[0]) is nn.Linear and not injected(model)


def test_the_copy_works_after_the_original_is_removed():
    model = inject(nn.Sequential(nn.Linear(4, 4)), {nn.Linear: LayerQuantization(weight=E5M2)})
    model.eval()
    clone = copy.deepcopy(model)
    x = torch.randn(3, 4)
    before = clone(x)
    remove(model)
    assert_same_bits(clone(x), before)
    remove(clone)
    assert type(clone[0]) is nn.Linear


def test_injecting_a_copy_of_a_weight_normed_model_leaves_the_originals_class_alone():
    model = nn.Sequential(weight_norm(nn.Linear(4, 4)))
    x = torch.randn(3, 4)
    before = model(x)
    clone = inject(copy.deepcopy(model), {nn.Linear: LayerQuantization(bias=E5M2)})
    assert not hasattr(type(model[0]), "bias")  # no property for a tensor it does not parametrise
    assert_same_bits(model(x), before)
    remove(clone)
    assert_same_bits(model(x), before)


def test_shadow_gives_its_reference_classes_of_its_own():
    model = nn.Sequential(weight_norm(nn.Linear(4, 4)), nn.ReLU(), nn.Linear(4, 2))
    inject(model, {"2": LayerQuantization(weight=E5M2)})
    shadow = Shadow(model)
    parametrize.remove_parametrizations(shadow.reference[0], "weight")
    x = torch.randn(3, 4)
    assert model(x).shape == (3, 2)  # the model's weight_norm property is still there
    remove(model)


def test_the_report_names_the_optimizers_parameters_as_the_model_does():
    """The optimizer table names a parameter without inject's indirection ("weight" for a model
    that is itself a Linear, not "parametrizations.weight") and each tensor weight_norm computes
    a weight from by its name in the model (not "0.weight0", which names nothing)."""
    model = inject(nn.Linear(3, 2), {nn.Linear: LayerQuantization(weight=E5M2)})
    optimizer = lpsim.optim.OptimLP(torch.optim.SGD(model.parameters(), lr=0.1), grad=E5M2)
    rows = report(model, optimizer).split("optimizer (OptimLP) rounds:\n")[1].splitlines()[2:]
    assert [row.split()[0] for row in rows] == ["bias", "weight"]
    model = nn.Sequential(weight_norm(nn.Linear(4, 3)), nn.Linear(3, 2))
    inject(model, {nn.Linear: LayerQuantization(weight=E5M2)})
    optimizer = lpsim.optim.OptimLP(torch.optim.SGD(model.parameters(), lr=0.1), grad=E5M2)
    rows = report(model, optimizer).split("optimizer (OptimLP) rounds:\n")[1].splitlines()[2:]
    names = [name for name, _ in model.named_parameters()]
    assert names[1:3] == [
        "0.parametrizations.weight.original0",
        "0.parametrizations.weight.original1",
    ]
    assert [row.split()[0] for row in rows] == [*names[:3], "1.bias", "1.weight"]


# Tied parameters


def test_a_tied_parameter_is_listed_and_counted_once():
    model = nn.Sequential(nn.Linear(6, 6), nn.Linear(6, 6))
    model[1].weight = model[0].weight
    inject(model, {nn.Linear: LayerQuantization(weight=E5M2, bias=E5M2)})
    found = quantized_parameters(model)
    assert [id(p) for p in found] == [id(p) for p in model.parameters()]  # each once, in order
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        torch.optim.SGD(found, lr=0.1)
    assert (
        report(model)
        .splitlines()[-1]
        .endswith("48 of 48 parameter elements fake-quantised (100.0%)")
    )
    inject(model, {"0": LayerQuantization(weight=E5M2), "1": LayerQuantization(weight=E5M2)})
    assert len(quantized_parameters(model)) == 1
    assert "36 of 48 parameter elements fake-quantised (75.0%)" in report(model)


# inject() leaves the model as it was when it raises


def _earlier_injection() -> nn.Sequential:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Conv1d(1, 1, 1), nn.Flatten(), nn.Linear(4, 2))
    inject(
        model,
        {
            "0": LayerQuantization(
                weight=(E5M2, "nearest"),
                input=(DELAYED, "nearest"),
                mac=lpsim.MAC(accumulator=Float(8, 7), rounding="nearest"),
            ),
            "1": LayerQuantization(output=(DELAYED, "nearest")),
            "3": LayerQuantization(bias=(E5M2, "nearest")),
        },
    )
    return model


_BAD_OPERANDS = LayerQuantization(weight=E4M1, input=E4M1, input_grad_operands=Operands(error=E4M1))


@pytest.mark.parametrize(
    "config, error",
    [
        # Operands are refused at the Conv1d, after the Linear before it is parametrised
        ({(nn.Linear, nn.Conv1d): _BAD_OPERANDS}, "apply to Linear layers"),
        # an entry deciding nothing, found after the earlier injection is removed
        ({nn.Linear: LayerQuantization(weight=E4M1), "nothing": None}, "decide no module"),
        # a name clash at the last module, after the others are injected
        ({nn.Module: LayerQuantization(weight=E4M1, output=DELAYED)}, "already has an attribute"),
    ],
)
@pytest.mark.parametrize("earlier", [True, False])
def test_inject_that_raises_leaves_the_model_exactly_as_it_was(config, error, earlier):
    def make():
        if earlier:
            model = _earlier_injection()
        else:
            torch.manual_seed(0)
            model = nn.Sequential(
                nn.Linear(4, 4), nn.Conv1d(1, 1, 1), nn.Flatten(), nn.Linear(4, 2)
            )
        model[3].lpsim_scalers = "the user's"  # the last module's attribute clashes with inject's
        return model

    model, twin = make(), make()  # (not a deep copy: its hooks would share the scalers)
    parameters = {n: id(p) for n, p in model.named_parameters()}
    state = copy.deepcopy(model.state_dict())
    shape = structure(model)
    with pytest.raises(ValueError, match=error):
        inject(model, config)
    assert {n: id(p) for n, p in model.named_parameters()} == parameters
    assert_same_state(model.state_dict(), state)
    assert structure(model) == shape
    x = torch.randn(3, 1, 4)
    for mode in ("train", "eval"):
        getattr(model, mode)(), getattr(twin, mode)()
        assert_same_bits(model(x), twin(x), mode)
    assert_same_state(model.state_dict(), twin.state_dict())  # the scalers recorded alike
    remove(model)
    assert [type(m) for m in model.modules()] == [
        nn.Sequential,
        nn.Linear,
        nn.Conv1d,
        nn.Flatten,
        nn.Linear,
    ]
    assert {n: id(p) for n, p in model.named_parameters()} == {
        n.replace(".parametrizations", "").replace(".original", ""): i
        for n, i in parameters.items()
    }


# Weights that already have a parametrisation


@pytest.mark.parametrize("wrap", [weight_norm, orthogonal])
def test_an_already_parametrised_weight_is_quantised_after_its_parametrisation(wrap):
    torch.manual_seed(0)
    model = nn.Sequential(wrap(nn.Linear(4, 4)), nn.ReLU(), nn.Linear(4, 2))
    first = model[0].parametrizations.weight[0]
    originals = dict(model.named_parameters())
    keys = list(model.state_dict())
    x = torch.randn(3, 4)
    before = model(x)
    weight, bias = model[0].weight.detach().clone(), model[0].bias.detach().clone()

    inject(model, {"0": LayerQuantization(weight=(E4M1, "nearest"), bias=(E4M1, "nearest"))})
    assert len(model[0].parametrizations.weight) == 2
    expected = x @ lpsim.quantize(weight, E4M1, "nearest").t() + lpsim.quantize(
        bias, E4M1, "nearest"
    )
    assert_same_bits(model[0](x), expected)
    text = report(model)
    assert re.search(r"^0\s+Linear\s+Float\(exp=4, man=1\) nearest", text, re.M)
    assert "parametrizations" not in text  # the user's parametrisation is no layer
    behind = [p for n, p in originals.items() if n.startswith("0.")]
    assert {id(p) for p in quantized_parameters(model)} == {id(p) for p in behind}

    remove(model)
    assert list(model[0].parametrizations.weight) == [first]
    assert dict(model.named_parameters()) == originals
    assert list(model.state_dict()) == keys
    assert_same_bits(model(x), before)


class _Tripled(nn.Module):
    """A parametrisation: three times the tensor."""

    def forward(self, weight: torch.Tensor) -> torch.Tensor:
        return 3 * weight


def test_a_parametrisation_registered_after_inject_is_refused_not_applied_to_the_rounding():
    """A parametrisation registered on a quantised weight after inject() goes after inject's
    fake-quantiser in torch's list, so forward saw it applied to the rounded weight (3 x a grid
    value: off the format's grid) while report() still listed the weight as quantised. Reading
    the weight now raises, saying to register it before inject(); remove() still takes the
    quantiser off, and injecting again quantises after it."""
    torch.manual_seed(0)
    layer = nn.Linear(4, 4)
    x = torch.randn(3, 4)
    inject(layer, {nn.Linear: LayerQuantization(weight=E4M1, rounding="nearest")})
    parametrize.register_parametrization(layer, "weight", _Tripled())
    with pytest.raises(RuntimeError, match=r"Linear\.weight.*after inject"):
        layer(x)
    with pytest.raises(RuntimeError, match="after inject"):
        layer.weight  # noqa: B018 - a read outside forward too
    remove(layer)
    computed = layer.weight.detach().clone()  # the user's parametrisation alone
    inject(layer, {nn.Linear: LayerQuantization(weight=E4M1, rounding="nearest")})
    assert_same_bits(layer.weight, lpsim.quantize(computed, E4M1, "nearest"))


@pytest.mark.parametrize("wrap", [weight_norm, orthogonal])
def test_backward_operands_take_the_parametrised_weight_before_quantisation(wrap):
    torch.manual_seed(0)
    layer = wrap(nn.Linear(4, 4))
    weight = layer.weight.detach().clone()
    inject(
        layer,
        {
            nn.Linear: LayerQuantization(
                weight=E4M1,
                rounding="nearest",
                input_grad_operands=Operands(weight=E5M2),
            )
        },
    )
    x = torch.randn(3, 4, requires_grad=True)
    layer(x).sum().backward()
    want = torch.ones(3, 4) @ lpsim.quantize(weight, E5M2, "nearest")
    torch.testing.assert_close(x.grad, want)
    assert all(p.grad is not None for p in layer.parameters())
    remove(layer)
    assert len(layer.parametrizations.weight) == 1


def test_backward_operands_take_the_spectral_normed_weight_of_the_calls_one_power_iteration():
    # The backward operands computed the spectral_norm weight again: its power iteration stepped
    # twice per call, and the error's product took another weight than the one forward quantised.
    torch.manual_seed(0)
    layer = spectral_norm(nn.Linear(4, 3))
    plain = copy.deepcopy(layer)
    settings = LayerQuantization(
        weight=E4M1, rounding="nearest", input_grad_operands=Operands(weight=E5M2)
    )
    inject(layer, {nn.Linear: settings})
    for _ in range(3):
        x = torch.randn(2, 4, requires_grad=True)
        layer(x).sum().backward()
        weight = plain.weight.detach()  # the plain layer's one power iteration of this call
        for got, want in zip(layer.buffers(), plain.buffers()):
            assert_same_bits(got, want)
        want = torch.ones(2, 3) @ lpsim.quantize(weight, E5M2, "nearest")
        torch.testing.assert_close(x.grad, want, rtol=0, atol=0)


def test_injecting_leaves_a_spectral_norms_power_iteration_where_it_was():
    torch.manual_seed(0)
    layer = spectral_norm(nn.Linear(4, 3))
    plain = copy.deepcopy(layer)
    inject(layer, {nn.Linear: LayerQuantization(weight=(E4M1, "nearest"))})
    for (name, got), want in zip(layer.named_buffers(), plain.buffers()):
        assert_same_bits(got, want, name)  # _u and _v: no power iteration ran
    x = torch.randn(2, 4)
    got = layer(x)  # the first pass's one power iteration, as in the plain layer
    want = x @ lpsim.quantize(plain.weight, E4M1, "nearest").t() + plain.bias
    assert_same_bits(got, want)
    for (name, got), want in zip(layer.named_buffers(), plain.buffers()):
        assert_same_bits(got, want, name)


@pytest.mark.parametrize(
    "hook, replacement",
    [
        (nn.utils.weight_norm, "torch.nn.utils.parametrizations.weight_norm"),
        (nn.utils.spectral_norm, "torch.nn.utils.parametrizations.spectral_norm"),
    ],
)
def test_a_weight_computed_by_a_forward_pre_hook_is_refused_with_the_parametrisation_to_use(
    hook, replacement
):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # torch deprecates the hook versions
        layer = hook(nn.Linear(4, 3))
    before = structure(layer)
    with pytest.raises(NotImplementedError, match=rf"Linear\.weight .*{re.escape(replacement)}"):
        inject(layer, {nn.Linear: LayerQuantization(weight=E5M2)})
    assert structure(layer) == before
    inject(layer, {nn.Linear: LayerQuantization(bias=(E4M1, "nearest"))})  # its bias is a Parameter
    assert quantized_parameters(layer) == [layer.parametrizations.bias.original]


@pytest.mark.parametrize("kind", ["weight", "bias"])
def test_a_pruned_tensor_is_refused_rather_than_left_in_full_precision(kind):
    """torch.nn.utils.prune replaces the Parameter by weight_orig and a mask, and computes weight
    in a forward pre-hook: weight= once quantised nothing (report: "nothing to quantise"), and the
    layer computed with the pruned weight in full precision."""
    layer = nn.Linear(4, 3)
    nn.utils.prune.l1_unstructured(layer, kind, amount=0.5)
    before = structure(layer)
    with pytest.raises(NotImplementedError, match=rf"Linear\.{kind} .*prune\.remove"):
        inject(layer, {nn.Linear: LayerQuantization(weight=E5M2, bias=E5M2)})
    assert structure(layer) == before
    nn.utils.prune.remove(layer, kind)  # the pruning made permanent: a Parameter again
    inject(layer, {nn.Linear: LayerQuantization(weight=(E4M1, "nearest"))})
    x = torch.randn(2, 4)
    want = nn.functional.linear(
        x, lpsim.quantize(layer.parametrizations.weight.original, E4M1, "nearest"), layer.bias
    )
    assert_same_bits(layer(x), want)


def test_a_lazy_modules_uninitialised_weight_is_refused_naming_it():
    """A lazy module's parameters have no shape before its first pass: inject raised torch's
    "Can't access the shape of an uninitialized parameter", naming neither the module nor what to
    do. It now names the parameter and says to run the model first, after which the weight is
    quantised."""
    model = nn.Sequential(nn.LazyLinear(3))
    before = structure(model)
    with pytest.raises(ValueError, match=r"LazyLinear\.weight is not initialised.*run the model"):
        inject(model, {nn.Linear: LayerQuantization(weight=(E4M1, "nearest"))})
    assert structure(model) == before
    x = torch.randn(2, 4)
    model(x)
    inject(model, {nn.Linear: LayerQuantization(weight=(E4M1, "nearest"))})
    weight = lpsim.quantize(model[0].parametrizations.weight.original, E4M1, "nearest")
    assert_same_bits(model(x), nn.functional.linear(x, weight, model[0].bias))


def test_the_default_entry_leaves_a_users_parametrisation_alone():
    model = nn.Sequential(weight_norm(nn.Linear(4, 4)), nn.ReLU())
    inject(model, {"default": LayerQuantization(output=E5M2)})
    assert [name for name, _, _ in injected(model)] == ["0", "1"]
    remove(model)


# Layers given MACs take what torch's layers take


_MAC = LayerQuantization(mac=lpsim.MAC(accumulator=Float(5, 10), rounding="stochastic"))


@pytest.mark.parametrize(
    "layer, shape",
    [
        (nn.Linear(4, 3), (2, 4)),
        (nn.Linear(4, 3), (4,)),
        (nn.Conv1d(2, 3, 3), (2, 7)),
        (nn.Conv1d(2, 3, 3, padding=1, padding_mode="reflect"), (2, 7)),
        (nn.Conv2d(2, 3, 3), (2, 5, 5)),
        (nn.Conv2d(2, 3, 3, padding=1, padding_mode="circular"), (2, 5, 5)),
    ],
)
def test_layers_with_macs_take_the_keyword_input_and_unbatched_inputs(layer, shape):
    x = torch.randn(shape)
    plain = layer(x)
    inject(layer, {type(layer): _MAC})
    torch.manual_seed(1)
    batched = layer(x.unsqueeze(0)).squeeze(0)
    for call in (lambda: layer(x), lambda: layer(input=x)):
        torch.manual_seed(1)
        assert_same_bits(call(), batched)
    assert batched.shape == plain.shape


def test_the_keyword_input_is_quantised_by_the_input_quantiser():
    layer = nn.Linear(4, 3)
    inject(layer, {nn.Linear: LayerQuantization(input=(E4M1, "nearest"), mac=_MAC.mac)})
    x = torch.randn(2, 4)
    torch.manual_seed(1)
    want = layer(x)
    torch.manual_seed(1)
    assert_same_bits(layer(input=x), want)
    torch.manual_seed(1)
    assert_same_bits(layer(lpsim.quantize(x, E4M1, "nearest")), want)


# report()'s example pass changes nothing


def test_report_with_an_example_changes_no_state_and_draws_nothing():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))
    inject(
        model,
        {
            nn.Linear: LayerQuantization(
                weight=(DELAYED, "stochastic"),
                input=(DELAYED, "nearest"),
                output=(DELAYED, "stochastic"),
            )
        },
    )
    model(torch.randn(8, 4))  # some history in every scaler
    scalers = {
        name: {k: v.clone() for k, v in m.state_dict().items()}
        for name, m in model.named_modules()
        if isinstance(m, DelayedScaler)
    }
    assert len(scalers) == 6  # weight, input and output of each Linear
    state = copy.deepcopy(model.state_dict())
    buffers = [id(b) for b in model.buffers()]
    example = torch.randn(8, 4) * 100
    rng = torch.get_rng_state()
    with Recorder(model) as recorder:
        report(model, example=example)
        assert recorder.records == []
    assert torch.equal(torch.get_rng_state(), rng)
    assert_same_state(model.state_dict(), state)
    assert [id(b) for b in model.buffers()] == buffers
    for name, m in model.named_modules():
        if isinstance(m, DelayedScaler):
            assert_same_state(m.state_dict(), scalers[name])


# Recurrent layers name their weights weight_ih_l0, weight_hh_l0, ... and biases bias_ih_l0, ...


@pytest.mark.parametrize(
    "layer",
    [
        nn.LSTM(3, 4, num_layers=2, bidirectional=True, proj_size=2),
        nn.GRU(3, 4),
        nn.RNN(3, 4, batch_first=True),
    ],
)
def test_a_recurrent_layers_weights_and_biases_are_quantised(layer):
    torch.manual_seed(0)
    originals = dict(layer.named_parameters())
    reference = copy.deepcopy(layer)
    with torch.no_grad():
        for parameter in reference.parameters():
            parameter.copy_(lpsim.quantize(parameter, E4M1, "nearest"))
    x = torch.randn(5, 2, 3)
    before = layer(x)[0]
    inject(layer, {nn.RNNBase: LayerQuantization(weight=E4M1, bias=E4M1, rounding="nearest")})
    assert {id(p) for p in quantized_parameters(layer)} == {id(p) for p in originals.values()}
    got = layer(x)[0]
    assert_same_bits(got, reference(x)[0])
    got.sum().backward()
    assert all(p.grad is not None for p in originals.values())
    remove(layer)
    assert dict(layer.named_parameters()) == originals
    assert_same_bits(layer(x)[0], before)


@pytest.mark.parametrize("cell", [nn.LSTMCell(3, 4), nn.GRUCell(3, 4), nn.RNNCell(3, 4)])
def test_a_recurrent_cells_weights_and_biases_are_quantised(cell):
    # A cell's parameters are weight_ih, weight_hh, bias_ih and bias_hh: before, neither a weight
    # nor a bias setting quantised any of them, silently (report: "nothing to quantise").
    torch.manual_seed(0)
    originals = dict(cell.named_parameters())
    reference = copy.deepcopy(cell)
    with torch.no_grad():
        for parameter in reference.parameters():
            parameter.copy_(lpsim.quantize(parameter, E4M1, "nearest"))
    x = torch.randn(2, 3)

    def states(module):  # an LSTMCell returns (h, c), the others h
        out = module(x)
        return out if isinstance(out, tuple) else (out,)

    before = states(cell)
    inject(cell, {nn.RNNCellBase: LayerQuantization(weight=E4M1, bias=E4M1, rounding="nearest")})
    assert {id(p) for p in quantized_parameters(cell)} == {id(p) for p in originals.values()}
    got = states(cell)
    for g, want in zip(got, states(reference), strict=True):
        assert_same_bits(g, want)
    sum(g.sum() for g in got).backward()
    assert all(p.grad is not None for p in originals.values())
    remove(cell)
    assert dict(cell.named_parameters()) == originals
    for g, want in zip(states(cell), before, strict=True):
        assert_same_bits(g, want)


class _ReturnsTwice(nn.Module):
    """Returns one tensor at two places, as a last hidden state that is also the last of the
    hidden states."""

    def forward(self, x):
        y = x * 3.0
        return {"last": y, "all": (x, y)}


def test_a_tensor_returned_at_several_places_is_one_output_quantised_once():
    """Each place was rounded on its own: a stochastic rule gave the one tensor two different
    values, and its error was the sum of two separately rounded gradients. Now it is quantised
    once, as a hand-placed quantizer on it: one stochastic rounding, every place getting that
    tensor, and its error the sum of the places' gradients, rounded once."""
    torch.manual_seed(0)
    x = torch.randn(64, requires_grad=True)
    g_last, g_all, g_x = (torch.randn(64) * 1e-3 for _ in range(3))
    module = inject(_ReturnsTwice(), {"": LayerQuantization(output=E4M1, error=(E5M2, "nearest"))})
    torch.manual_seed(1)
    got = module(x)
    assert got["last"] is got["all"][1]
    (got["last"] * g_last + got["all"][1] * g_all + got["all"][0] * g_x).sum().backward()

    oracle_x = x.detach().clone().requires_grad_()
    quantise = lpsim.nn.quantizer(forward=E4M1, backward=(E5M2, "nearest"))
    torch.manual_seed(1)
    y = quantise(oracle_x * 3.0)  # the dict's first place
    x_out = quantise(oracle_x)
    (y * (g_last + g_all) + x_out * g_x).sum().backward()
    assert_same_bits(got["last"], y)
    assert_same_bits(got["all"][0], x_out)
    assert_same_bits(x.grad, oracle_x.grad)


# Outputs and inputs held in dict subclasses keep their type


class _Output(collections.OrderedDict):
    """A mapping with attribute access, as HuggingFace's ModelOutput."""

    def __getattr__(self, name):
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None


class _ReturnsMapping(nn.Module):
    def forward(self, inputs):
        return _Output(logits=inputs["x"] * 1.1, mask=inputs["x"] > 0)


def test_dict_subclasses_in_inputs_and_outputs_keep_their_type_and_are_quantised():
    module = inject(
        _ReturnsMapping(),
        {_ReturnsMapping: LayerQuantization(input=E4M1, output=E4M1, rounding="nearest")},
    )
    x = torch.randn(6)
    got = module(collections.OrderedDict(x=x))
    assert type(got) is _Output and list(got) == ["logits", "mask"]
    q = lambda t: lpsim.quantize(t, E4M1, "nearest")  # noqa: E731
    assert_same_bits(got.logits, q(q(x) * 1.1))
    assert torch.equal(got.mask, q(x) > 0)


# Dataclass instances in inputs and outputs are followed like the other containers


@dataclasses.dataclass(frozen=True)
class _Prediction:
    logits: torch.Tensor
    mask: torch.Tensor
    count: int = 3
    scores: tuple = ()


class _ReturnsDataclass(nn.Module):
    def forward(self, batch):
        return _Prediction(batch.logits * 1.1, batch.logits > 0, scores=(batch.logits * 2.0,))


def test_dataclass_inputs_and_outputs_keep_their_type_and_are_quantised_both_ways():
    # The tensors a dataclass holds are the layer's inputs and outputs as a tuple's are: rounded
    # forward, their errors rounded backward. They were passed unrounded, silently.
    module = inject(
        _ReturnsDataclass(),
        {
            _ReturnsDataclass: LayerQuantization(
                input=E4M1, output=E4M1, error=E4M1, rounding="nearest"
            )
        },
    )
    x = torch.randn(6, requires_grad=True)
    got = module(_Prediction(x, x > 0))
    assert type(got) is _Prediction and got.count == 3
    q = lambda t: lpsim.quantize(t, E4M1, "nearest")  # noqa: E731
    assert_same_bits(got.logits, q(q(x.detach()) * 1.1))
    assert_same_bits(got.scores[0], q(q(x.detach()) * 2.0))
    assert torch.equal(got.mask, q(x.detach()) > 0)
    upstream = torch.linspace(-1.3, 2.9, 6)
    got.logits.backward(upstream)
    assert_same_bits(x.grad, q(upstream) * 1.1)  # the error rounded, the input straight-through


# A module shared between two parents has two names


def test_a_shared_module_is_selected_by_either_of_its_names():
    torch.manual_seed(0)
    shared = nn.Linear(3, 3)
    model = nn.Sequential(collections.OrderedDict(first=shared, second=shared))
    x = torch.randn(2, 3)
    q = lambda t: lpsim.quantize(t, E4M1, "nearest")  # noqa: E731
    once = lambda t: q(t) @ q(shared.weight.detach()).t() + shared.bias.detach()  # noqa: E731
    want = once(once(x))
    inject(model, {"second": LayerQuantization(input=E4M1, weight=E4M1, rounding="nearest")})
    assert [name for name, _, _ in injected(model)] == ["first"]
    assert_same_bits(model(x), want)
    with pytest.raises(ValueError, match="'second': matches 1 module.*decided by an earlier entry"):
        inject(model, {"first": None, "second": LayerQuantization(weight=E4M1)})


# A first pass under torch.inference_mode


def test_scalers_first_made_under_inference_mode_train_as_those_made_under_no_grad():
    config = {
        nn.Linear: LayerQuantization(
            input=(DELAYED, "nearest"), output=(DELAYED, "nearest"), error=(DELAYED, "nearest")
        )
    }
    models = []
    for context in (torch.inference_mode, torch.no_grad):
        torch.manual_seed(0)
        model = inject(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2)), config)
        torch.manual_seed(1)
        with context():
            model.eval()(torch.randn(3, 4))
            model.train()(torch.randn(3, 4))
        model(torch.randn(3, 4, requires_grad=True)).sum().backward()
        models.append(model)
    inferred, plain = models
    assert_same_state(inferred.state_dict(), plain.state_dict())
    for got, want in zip(inferred.parameters(), plain.parameters()):
        assert_same_bits(got.grad, want.grad)


# A forward that reads its weight first without gradients


class _PeakNormalised(nn.Linear):
    def forward(self, x):
        with torch.no_grad():
            peak = self.weight.abs().amax()
        return nn.functional.linear(x, self.weight / peak, self.bias)


def test_a_weight_read_first_under_no_grad_still_gets_its_gradient():
    torch.manual_seed(0)
    layer = _PeakNormalised(3, 2)
    reference = copy.deepcopy(layer)
    with torch.no_grad():
        reference.weight.copy_(lpsim.quantize(reference.weight, E4M1, "nearest"))
    inject(layer, {_PeakNormalised: LayerQuantization(weight=(E4M1, "nearest"))})
    x = torch.randn(4, 3)
    got, want = layer(x), reference(x)
    assert_same_bits(got, want)
    got.sum().backward(), want.sum().backward()
    assert_same_bits(layer.parametrizations.weight.original.grad, reference.weight.grad)
    assert_same_bits(layer.bias.grad, reference.bias.grad)
    with torch.no_grad():
        assert not layer(x).requires_grad


def test_a_weight_normed_weight_read_first_under_no_grad_still_gets_its_gradient():
    # The first read's weight_norm value was computed without gradients and the tensor quantised
    # from it kept for the call: g and v got no gradient, silently.
    torch.manual_seed(0)
    layer = weight_norm(_PeakNormalised(3, 2))
    reference = copy.deepcopy(layer)
    inject(layer, {_PeakNormalised: LayerQuantization(weight=(E4M1, "nearest"))})
    x = torch.randn(4, 3)
    got = layer(x)
    w = reference.weight  # the plain layer's weight_norm value, quantised straight-through
    w = w + (lpsim.quantize(w, E4M1, "nearest") - w).detach()
    want = F.linear(x, w / w.detach().abs().max(), reference.bias)
    assert_same_bits(got, want)
    got.sum().backward(), want.sum().backward()
    for name in ("original0", "original1"):
        g = getattr(layer.parametrizations.weight, name).grad
        assert g is not None
        assert_same_bits(g, getattr(reference.parametrizations.weight, name).grad)


def test_a_parametrisation_before_inject_is_computed_once_per_call_as_under_parametrize_cached():
    # torch's MultiheadAttention reads in_proj_weight up to three times in training: spectral_norm
    # stepped its power iteration at each read while the first read's weight was quantised and
    # used, a weight matching neither the plain model's nor its own state.
    torch.manual_seed(0)
    attention = spectral_norm(nn.MultiheadAttention(8, 2), "in_proj_weight")
    reference = copy.deepcopy(attention)
    inject(attention, {nn.MultiheadAttention: LayerQuantization(weight=(E4M1, "nearest"))})

    class RoundStraightThrough(nn.Module):
        def forward(self, w):
            return w + (lpsim.quantize(w, E4M1, "nearest") - w).detach()

    parametrize.register_parametrization(
        reference, "in_proj_weight", RoundStraightThrough(), unsafe=True
    )
    x = torch.randn(4, 2, 8)
    for _ in range(3):
        got = attention(x, x, x)[0]
        with parametrize.cached():
            want = reference(x, x, x)[0]
        assert_same_bits(got, want)
        power = [m.parametrizations.in_proj_weight[0] for m in (attention, reference)]
        assert_same_bits(power[0]._u, power[1]._u)
        assert_same_bits(power[0]._v, power[1]._v)


class _ScaledByItsPeak(nn.Linear):
    """Reads its weight first without gradients, under ``context`` (a number: an inference
    tensor cannot be saved for backward, in a plain layer either)."""

    context = torch.no_grad

    def forward(self, x):
        with self.context():
            peak = float(self.weight.abs().amax())
        return nn.functional.linear(x, self.weight, self.bias) / peak


@pytest.mark.parametrize("context", [torch.no_grad, torch.inference_mode])
@pytest.mark.parametrize("input_grad", [False, True])
def test_a_weight_read_first_under_inference_mode_still_gets_its_gradient(context, input_grad):
    torch.manual_seed(0)
    layer = _ScaledByItsPeak(3, 2)
    layer.context = context
    reference = copy.deepcopy(layer)
    with torch.no_grad():
        reference.weight.copy_(lpsim.quantize(reference.weight, E4M1, "nearest"))
    inject(layer, {_ScaledByItsPeak: LayerQuantization(weight=(E4M1, "nearest"))})
    x = torch.randn(4, 3, requires_grad=input_grad)
    x_reference = x.detach().clone().requires_grad_(input_grad)
    got, want = layer(x), reference(x_reference)
    assert_same_bits(got, want)
    got.sum().backward(), want.sum().backward()
    assert_same_bits(layer.parametrizations.weight.original.grad, reference.weight.grad)
    if input_grad:
        assert_same_bits(x.grad, x_reference.grad)
    with torch.inference_mode():  # a forward wholly in inference mode makes inference tensors
        assert layer(x).is_inference()


# lpsim's own state in the model


def test_the_delayed_scaler_of_a_quantizer_in_the_model_is_never_selected():
    def make():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(4, 4), lpsim.nn.Quantizer(DELAYED, None, "nearest"))

    model, twin = make(), make()
    inject(model, {nn.Linear: None, "default": LayerQuantization(input=(E4M1, "nearest"))})
    assert [name for name, _, _ in injected(model)] == ["1"]
    assert re.search(r"^1\s+Quantizer\s", report(model), re.M)
    x = torch.randn(3, 4)
    for _ in range(2):
        assert_same_bits(model(x), twin[1](lpsim.quantize(twin[0](x), E4M1, "nearest")))
    assert_same_state(model.state_dict(), twin.state_dict())
    inject(model, {nn.Module: LayerQuantization(output=E4M1)})
    assert [name for name, _, _ in injected(model)] == ["", "0", "1"]


# torch.save of a whole model


def test_a_model_with_macs_saved_whole_loads_as_an_independent_equal_model():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.MultiheadAttention(4, 2, batch_first=True))
    inject(model, {(nn.Linear, nn.MultiheadAttention): _MAC}, unmatched="ignore")
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    x = torch.randn(2, 3, 4)
    for a, b in ((model, loaded), (loaded, model)):
        torch.manual_seed(1)
        want = a[1](*(a[0](x),) * 3)[0]
        torch.manual_seed(1)
        assert_same_bits(b[1](*(b[0](x),) * 3)[0], want)
    with torch.no_grad():
        model[0].weight.zero_()
    assert loaded[0](x).abs().sum() > 0  # the copy's forward reads the copy's weight
    remove(loaded)
    assert type(loaded[0]) is nn.Linear and "forward" not in vars(loaded[0])


# Injecting into torch.compile's wrapper


def test_a_name_missing_from_a_compiled_model_is_explained_by_the_wrapper():
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    compiled = torch.compile(model)  # (never called: nothing is compiled)
    with pytest.raises(ValueError, match=r"'0': matches no module.*torch\.compile's wrapper"):
        inject(compiled, {"0": LayerQuantization(weight=E4M1)})
    assert not injected(model)
    with pytest.raises(ValueError, match="'nothing': matches no module of the model$"):
        inject(model, {"1": LayerQuantization(weight=E4M1), "nothing": None})


# A predicate that fails


def test_an_exception_in_a_predicate_names_the_selector_and_the_module():
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())

    def wide(name, module):
        return module.in_features > 3

    with pytest.raises(AttributeError, match="in_features") as raised:
        inject(model, {wide: LayerQuantization(weight=E4M1)})
    assert raised.value.__notes__ == [
        "inject(): raised by the selector wide on the module '' (Sequential)"
    ]
    assert not injected(model)


def test_an_injected_recurrent_layer_copies_and_moves_without_quantising():
    torch.manual_seed(0)
    layer = nn.LSTM(3, 4, num_layers=2)
    inject(layer, {nn.LSTM: LayerQuantization(weight=DELAYED, bias=E4M1, rounding="nearest")})
    x = torch.randn(5, 2, 3)
    layer(x)[0].sum().backward()
    state = copy.deepcopy(layer.state_dict())
    rng = torch.get_rng_state()
    layer.to(torch.float32)
    clone = copy.deepcopy(layer)
    assert torch.equal(torch.get_rng_state(), rng)  # no seed drawn by .to() or deepcopy
    assert_same_state(layer.state_dict(), state)  # no amax recorded
    assert_same_state(clone.state_dict(), state)
    assert_same_bits(clone(x)[0], layer(x)[0])


def test_the_magnitude_and_direction_of_a_weight_normed_recurrent_weight_are_not_its_weights():
    layer = torch.nn.utils.weight_norm(nn.GRU(3, 4), name="weight_ih_l0")  # weight_ih_l0_g, _v
    with pytest.raises(NotImplementedError, match=r"GRU\.weight_ih_l0 is computed by"):
        inject(layer, {nn.GRU: LayerQuantization(weight=E4M1)})  # the hook's weight, refused
    inject(layer, {nn.GRU: LayerQuantization(bias=E4M1)})
    assert not any(name.startswith("weight") for name in layer.parametrizations)


def injected_linear() -> nn.Sequential:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3))
    inject(
        model,
        {nn.Linear: LayerQuantization(weight=Float(3, 2), bias=Float(3, 2), rounding="nearest")},
    )
    return model


def test_functional_call_with_the_models_parameter_names_quantises_the_given_parameters():
    """torch.func.functional_call with the names of model.named_parameters() (the parametrised
    ".original" tensors) quantises the given tensors as the model's own, and its gradients are
    those of the model holding them."""
    model = injected_linear()
    x = torch.randn(2, 4)
    names = [name for name, _ in model.named_parameters()]
    assert names == ["0.parametrizations.weight.original", "0.parametrizations.bias.original"]
    own = {name: p.detach().clone() for name, p in model.named_parameters()}
    given = {name: 1.7 * p for name, p in own.items()}

    def loss(parameters):
        return torch.func.functional_call(model, parameters, (x,)).square().sum()

    grads = torch.func.grad(loss)(given)
    twin = injected_linear()
    with torch.no_grad():
        for name, p in twin.named_parameters():
            p.copy_(given[name])
    assert_same_bits(loss(given).detach(), twin(x).square().sum().detach())
    twin(x).square().sum().backward()
    for name, p in twin.named_parameters():
        assert_same_bits(grads[name], p.grad, name)
    rounded = lpsim.quantize(given["0.parametrizations.weight.original"], Float(3, 2))
    assert_same_bits(twin[0].weight.detach(), rounded)
    for name, p in model.named_parameters():  # the model's own parameters are left alone
        assert_same_bits(p.detach(), own[name], name)


def test_replacing_a_quantised_parameter_by_its_plain_name_is_refused_with_the_name_to_use():
    """functional_call with the plain name ("0.weight") of a parametrised parameter, or assigning
    module.weight, would have to write the new value into the parameter in place, out of the
    gradient's reach; it is refused with an error that names the name to use."""
    model = injected_linear()
    before = [p.detach().clone() for p in model.parameters()]
    message = r"parametrizations\.weight\.original"
    with pytest.raises(NotImplementedError, match=message):
        torch.func.functional_call(model, {"0.weight": torch.ones(3, 4)}, (torch.randn(2, 4),))
    with pytest.raises(NotImplementedError, match=message):
        model[0].weight = torch.ones(3, 4)
    for got, want in zip(model.parameters(), before):
        assert_same_bits(got.detach(), want)


# An Embedding with max_norm renormalises the rows it reads in place


@pytest.mark.parametrize(
    "layer, args",
    [
        (nn.Embedding(6, 4, max_norm=1.0), (torch.tensor([[0, 1], [1, 4]]),)),
        (
            nn.EmbeddingBag(6, 4, max_norm=1.5, norm_type=1.0, mode="mean"),
            (torch.tensor([0, 1, 1, 4, 5]), torch.tensor([0, 2])),
        ),
    ],
)
def test_an_embedding_with_max_norm_renormalises_its_parameter_and_looks_up_quantised_rows(
    layer, args
):
    with torch.no_grad():
        layer.weight.mul_(3)
    plain = copy.deepcopy(layer)
    inject(layer, {type(layer): LayerQuantization(weight=(E4M1, "nearest"))})
    parameter = layer.parametrizations.weight.original
    for _ in range(2):
        got = layer(*args)
        with torch.no_grad():  # the plain layer's renormalisation of its Parameter
            torch.nn.functional.embedding(
                args[0], plain.weight, max_norm=plain.max_norm, norm_type=plain.norm_type
            )
        assert_same_bits(parameter, plain.weight)
        rows = lpsim.quantize(plain.weight, E4M1, "nearest")
        if isinstance(layer, nn.EmbeddingBag):
            want = torch.nn.functional.embedding_bag(args[0], rows, args[1], mode="mean")
        else:
            want = torch.nn.functional.embedding(args[0], rows)
            assert_same_bits(got, lpsim.quantize(got, E4M1, "nearest"))  # rows on the grid
        assert_same_bits(got, want)
    remove(layer)
    assert "forward" not in vars(layer) and layer.max_norm == plain.max_norm


@pytest.mark.parametrize(
    ("layer", "args"),
    [
        (nn.Embedding(6, 4, max_norm=0.5), (torch.tensor([[0, 1], [1, 3]]),)),
        (nn.EmbeddingBag(6, 4, max_norm=0.5), (torch.tensor([0, 1, 1, 3]), torch.tensor([0, 2]))),
    ],
)
def test_a_weight_normed_embedding_with_max_norm_looks_up_renormalised_rows_quantised(layer, args):
    # A weight parametrised before inject (weight_norm) was quantised and then renormalised by
    # torch's forward: the rows looked up were off the format's grid, silently.
    torch.manual_seed(0)
    weight_norm(layer, dim=0)
    plain = copy.deepcopy(layer)
    inject(layer, {type(layer): LayerQuantization(weight=(E4M1, "nearest"))})
    for _ in range(2):
        got = layer(*args)
        rows = plain.weight  # the weight_norm value, renormalised where indexed, as torch does
        with torch.no_grad():
            torch.embedding_renorm_(rows, args[0].reshape(-1), 0.5, 2.0)
        rows = lpsim.quantize(rows, E4M1, "nearest")
        if isinstance(layer, nn.EmbeddingBag):
            want = F.embedding_bag(args[0], rows, args[1], mode="mean")
        else:
            want = F.embedding(args[0], rows)
            assert_same_bits(got, lpsim.quantize(got, E4M1, "nearest"))  # rows on the grid
        assert_same_bits(got, want)
        got.sum().backward()
        want.sum().backward()
        for name in ("original0", "original1"):
            g = getattr(layer.parametrizations.weight, name).grad
            assert_same_bits(g, getattr(plain.parametrizations.weight, name).grad)
    remove(layer)
    assert "forward" not in vars(layer) and layer.max_norm == plain.max_norm


def _wrap_forward(module: nn.Module) -> nn.Module:
    """Give ``module`` an instance forward wrapping its own (as accelerate's hooks do)."""
    inner = module.forward
    module.forward = lambda *args: 2 * inner(*args)
    return module


@pytest.mark.parametrize(
    ("make", "settings", "example"),
    [
        (lambda: nn.Linear(4, 3), _MAC, lambda: torch.randn(2, 4)),
        (
            lambda: nn.Linear(4, 3),
            LayerQuantization(input_grad_operands=Operands(error=E5M2)),
            lambda: torch.randn(2, 4),
        ),
        (
            lambda: nn.Embedding(6, 3, max_norm=1.0),
            LayerQuantization(weight=(E5M2, "nearest")),
            lambda: torch.tensor([1, 2]),
        ),
    ],
)
def test_an_instance_forward_is_never_silently_dropped_or_deleted(make, settings, example):
    """A module with a forward of its own (an instance attribute wrapping the class's, as
    accelerate's hooks set) that inject would replace by its simulated or renormalising forward
    is refused before the model changes: that wrapper once stopped running while injected, and
    remove() deleted it."""
    torch.manual_seed(0)
    module = _wrap_forward(make())
    wrapper = module.forward
    x = example()
    want = module(x)
    with pytest.raises(NotImplementedError, match="forward of its own"):
        inject(module, {type(module): settings})
    assert module.forward is wrapper and not hasattr(module, "_lpsim_injection")
    assert_same_bits(module(x), want)
    # a weight setting wraps the instance forward in a weight scope, and remove() gives it back
    inject(module, {type(module): LayerQuantization(bias=E5M2)}, unmatched="ignore")
    remove(module)
    assert module.forward is wrapper


class _TiedLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, 6)
        self.body = nn.Sequential(nn.Linear(6, 6), nn.LSTM(6, 6))
        self.out = nn.Linear(6, 10, bias=False)
        self.out.weight = self.emb.weight

    def forward(self, i):
        return self.out(self.body[1](self.body[0](self.emb(i)))[0])


@pytest.mark.parametrize("strict", [True, False])
def test_a_checkpoint_saved_without_injection_loads_into_the_injected_model(strict):
    """A float32 checkpoint (plain keys, "out.weight") loads into the injected model: every
    parameter takes the checkpoint's value, a tied one stays tied, and the model computes what
    torch computes with the checkpoint's parameters quantised. strict=False once loaded none of
    the quantised parameters (reporting their keys as missing), and strict=True refused them."""
    torch.manual_seed(0)
    source = _TiedLM()
    checkpoint = source.state_dict()
    torch.manual_seed(1)
    model = _TiedLM()
    inject(model, {(nn.Embedding, nn.Linear, nn.LSTM): LayerQuantization(weight=E5M2, bias=E5M2)})
    result = model.load_state_dict(checkpoint, strict=strict)
    assert not result.missing_keys and not result.unexpected_keys
    for got, want in zip(model.parameters(), source.parameters(), strict=True):
        assert_same_bits(got, want)
    assert model.emb.parametrizations.weight.original is model.out.parametrizations.weight.original
    oracle = copy.deepcopy(source)
    with torch.no_grad():
        for p in oracle.parameters():
            p.copy_(lpsim.quantize(p, E5M2, "nearest"))
    i = torch.tensor([[1, 2, 3]])
    assert_same_bits(model.eval()(i), oracle.eval()(i))
    remove(model)
    assert not model.body[0]._load_state_dict_pre_hooks
    assert_same_state(model.state_dict(), checkpoint)


def _delayed_mlp() -> nn.Module:
    """An MLP whose first layer's weight, input and output DelayedScaling quantises, after two
    training passes (its scalers hold histories)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    plain = copy.deepcopy(model)
    inject(model, {"0": LayerQuantization(weight=DELAYED, input=DELAYED, output=DELAYED)})
    for i in range(2):
        model(torch.randn(3, 4) * 10**i).sum().backward()
    return model, plain


def test_a_strict_float32_checkpoint_loads_with_fresh_delayed_scalers():
    """A float32 checkpoint holds no DelayedScaler state: strict=True once refused it for a
    DelayedScaling weight (its scaler's keys missing). Loaded strictly, every scaler starts as
    inject made it: the weight's with an empty history and scale 1, the input's and output's
    made afresh at their next quantisation, as in a model injected and then loaded."""
    model, plain = _delayed_mlp()
    checkpoint = plain.state_dict()
    result = model.load_state_dict(checkpoint)
    assert not result.missing_keys and not result.unexpected_keys
    fresh = inject(copy.deepcopy(plain), {"0": LayerQuantization(weight=DELAYED)})
    assert_same_state(model.state_dict(), fresh.state_dict())


def test_a_non_strict_load_leaves_the_delayed_scalers_it_does_not_hold_as_they_were():
    """strict=False leaves what a state_dict does not hold as it is (torch's missing keys): the
    input and output scalers were once dropped all the same, silently restarting their histories
    with scale 1, and the weight's scaler kept. Now every scaler keeps its state, and its keys
    are reported missing."""
    model, plain = _delayed_mlp()
    before = {k: v.clone() for k, v in model.state_dict().items() if "scaler" in k}
    result = model.load_state_dict(plain.state_dict(), strict=False)
    assert sorted(result.missing_keys) == sorted(before) and not result.unexpected_keys
    after = model.state_dict()
    assert_same_state({k: after[k] for k in before}, before)


class _Spectrum(nn.Module):
    """A module whose output is complex (an FFT), as in spectral models."""

    def forward(self, x):
        return torch.fft.fft(x)


@pytest.mark.parametrize("role", ["input", "output", "error"])
def test_a_complex_tensor_of_a_quantised_role_is_refused_not_passed_unquantised(role):
    """lpsim's formats round real tensors: a complex input, output or error of a module that a
    config quantises raises, naming the module, the role and the place, instead of going through
    unrounded while report() lists the module as quantised."""
    model = nn.Sequential(nn.Identity(), _Spectrum())
    inject(model, {_Spectrum: LayerQuantization(**{role: lpsim.Float(5, 2)})})
    x = torch.randn(4, dtype=torch.complex64) if role == "input" else torch.randn(4)
    with pytest.raises(TypeError, match=rf"the {role} at '0' of a _Spectrum is a torch.complex64"):
        model(x)
    unquantised = nn.Sequential(nn.Identity(), _Spectrum())
    inject(unquantised, {nn.Identity: LayerQuantization(output=lpsim.Float(5, 2))})
    assert unquantised(torch.randn(4)).dtype == torch.complex64  # a role no config sets


def test_an_attentions_key_and_value_biases_are_quantised_as_its_biases():
    """add_bias_kv's bias_k and bias_v are biases of the attention: bias= rounds them as it rounds
    in_proj_bias, as a hand-made attention with rounded parameters computes (report() listed a
    bias format for them while they stayed in full precision)."""
    torch.manual_seed(5)
    attention = nn.MultiheadAttention(8, 2, add_bias_kv=True, batch_first=True)
    by_hand = copy.deepcopy(attention)
    fmt = Float(4, 3)
    with torch.no_grad():
        for name in ("in_proj_bias", "bias_k", "bias_v"):
            getattr(by_hand, name).copy_(lpsim.quantize(getattr(by_hand, name), fmt, "nearest"))
    inject(attention, {nn.MultiheadAttention: LayerQuantization(bias=(fmt, "nearest"))})
    x = torch.randn(2, 5, 8)
    got, _ = attention(x, x, x, need_weights=False)
    want, _ = by_hand(x, x, x, need_weights=False)
    assert_same_bits(got, want)


class _ResultRead(nn.Module):
    """Linear then an in-place activation, whose result it reads (out = act(out))."""

    def __init__(self, act: nn.Module):
        super().__init__()
        self.lin, self.act = nn.Linear(6, 5), act

    def forward(self, x):
        out = self.lin(x)
        out = self.act(out)
        return out


class _ResultIgnored(_ResultRead):
    """The same, calling the in-place activation for its effect on its input only."""

    def forward(self, x):
        out = self.lin(x)
        self.act(out)
        return out


@pytest.mark.parametrize(
    "settings",
    [
        LayerQuantization(input=E4M1, rounding="nearest"),
        LayerQuantization(output=E4M1, rounding="nearest"),
        LayerQuantization(error=E5M2, rounding="nearest"),
        LayerQuantization(input=E4M1, output=E5M2, error=E4M1, rounding="nearest"),
    ],
    ids=["input", "output", "error", "all"],
)
@pytest.mark.parametrize(
    "act",
    [lambda: nn.ReLU(inplace=True), lambda: nn.LeakyReLU(0.25, inplace=True)],
    ids=["relu", "leaky_relu"],
)
def test_an_injected_in_place_module_leaves_its_result_in_the_tensor_it_was_given(settings, act):
    """torch's in-place modules leave their result in their input, and code may read it there
    instead of the returned tensor; injected, the tensor given holds the quantised result, and
    its value and gradient are those of the code that reads the result."""
    torch.manual_seed(0)
    read, ignored = _ResultRead(act()), _ResultIgnored(act())
    ignored.load_state_dict(read.state_dict())
    for model in (read, ignored):
        inject(model, {type(model.act): settings})
    x = torch.randn(7, 6)
    want, got = read(x), ignored(x)
    assert_same_bits(got, want)
    # the oracle: the activation applied by hand to the quantised input, then quantised
    spec = settings.spec("input")
    y = read.lin(x).detach()
    y = y if spec is None else lpsim.quantize(y, spec.format)
    y = read.act(y.clone())
    spec = settings.spec("output")
    assert_same_bits(want.detach(), y if spec is None else lpsim.quantize(y, spec.format))
    g = torch.randn(7, 5)
    want.backward(g)
    got.backward(g)
    for a, b in zip(read.parameters(), ignored.parameters()):
        assert_same_bits(b.grad, a.grad)


class _Pool(nn.Module):
    """A module of a user's with an ``inplace`` option of its own meaning, whose result has
    another shape than its input."""

    def __init__(self):
        super().__init__()
        self.inplace = True

    def forward(self, x):
        return x.sum(-1, keepdim=True)


@pytest.mark.parametrize("role", ["input", "output", "error"])
def test_an_injected_in_place_module_leaves_a_channels_last_models_gradients_alone(role):
    """A format that holds every float32 number (Float(8, 23)) on an in-place ReLU changes no
    value, so a channels_last model's gradients are those of the plain model, bit for bit. The
    injected in-place module writes its result into the tensor it was given by copy_, whose
    backward gave that tensor's earlier value a zero gradient, contiguous, besides its real one
    through the ReLU: their sum took the zeros' layout, and the BatchNorm before the ReLU summed
    its backward in another order (every gradient upstream differed in the last bits). The
    earlier value now gets its real gradient alone, as under torch's in-place ReLU."""
    torch.manual_seed(0)
    plain = nn.Sequential(
        nn.Conv2d(4, 8, 3), nn.BatchNorm2d(8), nn.ReLU(inplace=True), nn.Conv2d(8, 4, 3)
    ).to(memory_format=torch.channels_last)
    model = inject(copy.deepcopy(plain), {nn.ReLU: LayerQuantization(**{role: Float(8, 23)})})
    x = torch.randn(8, 4, 12, 12).to(memory_format=torch.channels_last).requires_grad_(True)
    x_plain = x.detach().clone().requires_grad_(True)
    got, want = model(x), plain(x_plain)
    assert_same_bits(got, want)
    g = torch.randn_like(want)
    got.backward(g)
    want.backward(g)
    assert_same_bits(x.grad, x_plain.grad, "input")
    for (name, p), q in zip(plain.named_parameters(), model.parameters(), strict=True):
        assert_same_bits(q.grad, p.grad, name)


@pytest.mark.parametrize("module", [nn.ReLU(inplace=False), _Pool()], ids=["relu", "user"])
def test_a_module_that_is_not_working_in_place_leaves_its_input_alone(module):
    """Only torch's in-place modules, while their inplace is True, have their result copied into
    their input: a ReLU(inplace=False), or a module of a user's with an inplace attribute (whose
    result would broadcast into its input), leaves the caller's tensor as it was."""
    inject(module, {type(module): LayerQuantization(output=E4M1, rounding="nearest")})
    x = torch.randn(4, 3)
    before = x.clone()
    y = module(x)
    assert_same_bits(x, before)
    assert y is not x


@pytest.mark.parametrize(
    "settings",
    [dict(input=E4M1), dict(output=E4M1), dict(error=E5M2), dict(input=E4M1, output=E4M1)],
    ids=["input", "output", "error", "both"],
)
def test_an_in_place_module_given_a_new_tensor_by_a_users_pre_hook_leaves_the_callers_alone(
    settings,
):
    """A forward pre-hook the user registered before inject() that hands an in-place module a
    new tensor: torch's op then works in that tensor and leaves the caller's as it was. Injected,
    the caller's tensor once received the result (inject's hook that keeps the tensor given ran
    before the user's hooks); now the hook's tensor holds it, as in torch."""
    handed = []

    def doubled(module, args):
        handed.append(args[0] * 2)
        return (handed[-1],)

    plain, model = nn.ReLU(inplace=True), nn.ReLU(inplace=True)
    for m in (plain, model):
        m.register_forward_pre_hook(doubled)
    inject(model, {nn.ReLU: LayerQuantization(rounding="nearest", **settings)})
    x = torch.randn(5, 4)
    before = x.clone()
    plain_x = x.clone()
    want = plain(plain_x)
    assert_same_bits(plain_x, before)  # the oracle: torch leaves the caller's tensor alone
    got = model(x)
    assert_same_bits(x, before)
    # the value: the activation of the doubled input, each rounding where it is configured
    y = before * 2
    y = lpsim.quantize(y, E4M1) if "input" in settings else y
    y = torch.relu(y)
    y = lpsim.quantize(y, E4M1) if "output" in settings else y
    assert_same_bits(got, y)
    assert_same_bits(handed[-1], y)  # the tensor the module was given holds its result
    assert_same_bits(want, torch.relu(before * 2))


def test_users_hooks_see_what_the_documentation_says_and_remove_keeps_them_in_order():
    """Forward pre-hooks and forward hooks registered before inject() see the unquantised input
    and output, those registered after see the quantised ones; a full backward pre-hook and a
    full backward hook see as grad_output the gradient into the quantised output before the
    error quantiser rounds it (the pre-hook's result is what it rounds), and as grad_input the
    input's gradient computed from the rounded error; remove() leaves the user's hooks, in their
    order."""
    torch.manual_seed(0)
    layer = nn.Linear(4, 3)
    seen = {}

    def keep(name):
        return lambda module, *tensors: seen.__setitem__(name, [t[0].clone() for t in tensors])

    def tripled(module, grad_output):
        seen["backward pre"] = [grad_output[0].clone()]
        return (grad_output[0] * 3,)

    layer.register_forward_pre_hook(keep("pre before"))
    layer.register_forward_hook(lambda m, a, o: seen.__setitem__("hook before", [a[0], o.clone()]))
    layer.register_full_backward_pre_hook(tripled)
    layer.register_full_backward_hook(keep("backward"))
    order = (list(layer._forward_pre_hooks), list(layer._forward_hooks))
    inject(
        layer,
        {nn.Linear: LayerQuantization(input=E4M1, output=E4M1, error=E5M2, rounding="nearest")},
    )
    layer.register_forward_pre_hook(keep("pre after"))
    layer.register_forward_hook(lambda m, a, o: seen.__setitem__("hook after", [a[0], o.clone()]))
    order = (order[0] + [max(layer._forward_pre_hooks)], order[1] + [max(layer._forward_hooks)])
    x = torch.randn(2, 4, requires_grad=True)
    g = torch.randn(2, 3)
    y = layer(x)
    y.backward(g)
    # the oracle: torch's Linear on the input rounded by hand
    weight = layer.weight.detach()
    xq = lpsim.quantize(x.detach(), E4M1)
    out = F.linear(xq, weight, layer.bias.detach())
    error = lpsim.quantize(g * 3, E5M2)
    assert_same_bits(seen["pre before"][0], x.detach())
    assert_same_bits(seen["hook before"][0], xq)
    assert_same_bits(seen["hook before"][1], out)
    assert_same_bits(seen["pre after"][0], xq)
    assert_same_bits(seen["hook after"][1], lpsim.quantize(out, E4M1))
    assert_same_bits(seen["backward pre"][0], g)
    grad_input, grad_output = seen["backward"]
    assert_same_bits(grad_output, g * 3)
    assert_same_bits(grad_input, error @ weight)
    assert_same_bits(x.grad, error @ weight)
    remove(layer)
    assert (list(layer._forward_pre_hooks), list(layer._forward_hooks)) == order
    assert len(layer._backward_hooks) == len(layer._backward_pre_hooks) == 1


def _rounded_in_layout(x: torch.Tensor, fmt) -> torch.Tensor:
    """The oracle's rounding: lpsim.quantize (a contiguous result, straight-through) written into
    a tensor of x's layout, as torch's elementwise ops lay out their results."""
    return torch.empty_like(x).copy_(lpsim.quantize(x, fmt))


@pytest.mark.parametrize("rounded", ["input", "output", "weight"])
def test_quantised_tensors_keep_the_layout_of_the_tensors_they_replace(rounded):
    """A channels_last model (weights and activations) stays channels_last where inject rounds
    its tensors: each quantised input, output and weight has the strides of the tensor it
    replaces, so the modules reading it (the convolution, the BatchNorm after it) compute what
    they compute on the tensor rounded in place. lpsim.quantize gives a contiguous tensor, which
    the injected model once passed on: its results lost the layout, and a BatchNorm reading them
    summed in another order (other bits than the model with the roundings placed by hand)."""
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.Conv2d(8, 4, 1))
    plain = plain.to(memory_format=torch.channels_last)
    model = copy.deepcopy(plain)
    settings = LayerQuantization(rounding="nearest", **{rounded: E4M1})
    inject(model, {nn.Conv2d: settings})
    x = torch.randn(4, 3, 9, 9).to(memory_format=torch.channels_last).requires_grad_(True)
    x_plain = x.detach().clone().requires_grad_(True)
    seen = []  # a pre-hook registered after inject sees what the convolution's forward sees
    model[0].register_forward_pre_hook(lambda m, args: seen.append(args[0].stride()))
    got = model(x)
    assert seen == [x.stride()]
    assert model[0].weight.stride() == plain[0].weight.stride()
    # the oracle: the plain model with the configured roundings placed by hand, in layout
    h = x_plain
    for conv in (plain[0], plain[2]):
        if conv is plain[2]:
            h = plain[1](h)
        inp = _rounded_in_layout(h, E4M1) if rounded == "input" else h
        w = _rounded_in_layout(conv.weight, E4M1) if rounded == "weight" else conv.weight
        h = F.conv2d(inp, w, conv.bias)
        h = _rounded_in_layout(h, E4M1) if rounded == "output" else h
    want = h
    assert got.is_contiguous(memory_format=torch.channels_last)
    assert want.is_contiguous(memory_format=torch.channels_last)
    assert_same_bits(got, want)
    g = torch.randn_like(want)
    got.backward(g)
    want.backward(g)
    assert_same_bits(x.grad, x_plain.grad)
    for name, p in plain.named_parameters():
        q = dict(model.named_parameters()).get(name)
        if q is None:  # a quantised weight: its Parameter is the parametrisation's original
            q = model.get_submodule(name.rsplit(".", 1)[0]).parametrizations.weight.original
        assert_same_bits(q.grad, p.grad, name)


@pytest.mark.parametrize("placed", ["inject", "Quantizer"])
def test_an_error_format_holding_every_float32_leaves_a_channels_last_models_gradients_alone(
    placed,
):
    """An error format that holds every float32 number (Float(8, 23)) changes no value of the
    gradient, so a channels_last model's gradients are those of the plain model, bit for bit.
    lpsim.quantize gives a contiguous tensor, which the error quantisers passed back as the
    gradient: the convolutions' and BatchNorms' backward kernels then read another layout than
    in the plain model and summed in another order (every parameter's gradient and the input's
    differed in the last bits). The rounded error has the layout of the gradient it replaces."""
    torch.manual_seed(0)
    f32 = Float(8, 23)
    plain = nn.Sequential(nn.Conv2d(4, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 4, 3))
    plain = plain.to(memory_format=torch.channels_last)
    if placed == "inject":
        model = inject(copy.deepcopy(plain), {"default": LayerQuantization(error=f32)})
    else:
        quantised = [(layer, lpsim.nn.Quantizer(backward=f32)) for layer in copy.deepcopy(plain)]
        model = nn.Sequential(*[m for pair in quantised for m in pair])
    x = torch.randn(8, 4, 12, 12).to(memory_format=torch.channels_last).requires_grad_(True)
    x_plain = x.detach().clone().requires_grad_(True)
    got, want = model(x), plain(x_plain)
    g = torch.randn_like(want)
    got.backward(g)
    want.backward(g)
    assert_same_bits(x.grad, x_plain.grad, "input")
    assert x.grad.stride() == x_plain.grad.stride()
    got_grads = [p.grad for p in model.parameters()]  # an error format changes no parameter order
    for (name, p), grad in zip(plain.named_parameters(), got_grads, strict=True):
        assert_same_bits(grad, p.grad, name)


@pytest.mark.parametrize("reentrant", [False, True], ids=["non_reentrant", "reentrant"])
@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_checkpointed_injected_modules_give_the_gradients_of_the_run_without_checkpointing(
    reentrant, rounding
):
    """torch.utils.checkpoint recomputes the injected modules' forward in the backward pass
    (with torch's generator restored): the same tensors, so the output, every parameter's
    gradient, the input's gradient and the generator's state afterwards are those of the run
    without checkpointing, bit for bit."""

    def make():
        torch.manual_seed(1)
        model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.Linear(16, 4))
        settings = LayerQuantization(
            weight=E4M1, bias=E4M1, input=E4M1, output=E4M1, error=E5M2, rounding=rounding
        )
        return inject(model, {nn.Linear: settings, nn.ReLU: settings})

    runs = []
    for checkpointed in (False, True):
        model = make()
        torch.manual_seed(5)
        x = torch.randn(3, 8, requires_grad=True)
        if checkpointed:
            h = torch.utils.checkpoint.checkpoint(model[:3], x, use_reentrant=reentrant)
            y = model[3](h)
        else:
            y = model(x)
        y.square().sum().backward()
        grads = [p.grad for p in model.parameters()]
        runs.append((torch.get_rng_state(), y.detach(), x.grad, *grads))
    assert torch.equal(runs[0][0], runs[1][0])
    for got, want in zip(runs[1][1:], runs[0][1:]):
        assert_same_bits(got, want)


def test_an_in_place_module_whose_call_raises_holds_no_tensor_afterwards():
    """An injected in-place module keeps the caller's tensor from its first hook to its last: a
    call that raises in between (a pre-hook or forward failing, an out-of-memory retried by the
    script) leaves no reference to it behind, and the next call leaves its result in its input."""
    import gc
    import weakref

    relu = nn.ReLU(inplace=True)
    inject(relu, {nn.ReLU: LayerQuantization(output=E4M1, rounding="nearest")})

    def fail(module, args):
        raise RuntimeError("failed")

    handle = relu.register_forward_pre_hook(fail)
    given = torch.randn(5)
    alive = weakref.ref(given)
    with pytest.raises(RuntimeError, match="failed"):
        relu(given)
    del given
    gc.collect()
    assert alive() is None
    handle.remove()
    x = torch.randn(6)
    before = x.clone()
    y = relu(x)
    assert y is x
    assert_same_bits(x, lpsim.quantize(torch.relu(before), E4M1, "nearest"))
