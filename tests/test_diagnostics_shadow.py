"""Shadow mode: the float32 reference of a simulated model, and the per-layer divergence of the
simulated activations and errors from it, without changing the simulated model."""

import collections
import copy
import csv
import dataclasses
import io
import json
import math

import pytest
import torch
from support import assert_same_bits
from torch import nn

import lpsim
from lpsim import Fixed, Float
from lpsim.compat.qtorch import FloatingPoint
from lpsim.compat.qtorch.auto_low import lower
from lpsim.delayed_scaling import DelayedScaling
from lpsim.diagnostics.shadow import Shadow, ShadowReport
from lpsim.nn import LayerQuantization, Quantizer, inject, remove
from lpsim.optim import DynamicLossScaler, OptimLP

pytestmark = pytest.mark.usefixtures("one_thread")

FLOAT32 = Float(8, 23)  # every float32 value, so rounding into it changes nothing
COARSE = (Float(3, 1), "nearest")
FIXED8 = (Fixed(8, 4), "nearest")  # spacing 2^-4: errors below 2^-5 round to zero
E3M1 = FloatingPoint(exp=3, man=1)


def mlp(*, inplace: bool = False) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(4, 16),
        nn.ReLU(inplace=inplace),
        nn.Linear(16, 16),
        nn.ReLU(inplace=inplace),
        nn.Linear(16, 3),
    )


def batch(n: int = 32) -> torch.Tensor:
    return torch.randn(n, 4, generator=torch.Generator().manual_seed(1))


def squared_loss(out: torch.Tensor) -> torch.Tensor:
    return out.square().sum()


def row(report: ShadowReport, name: str, call: int = 1):
    return next(r for r in report.modules if r.module == name and r.call == call)


def test_an_exact_format_everywhere_gives_zero_divergence_everywhere():
    model = inject(
        mlp(),
        {"default": LayerQuantization(weight=FLOAT32, bias=FLOAT32, output=FLOAT32, error=FLOAT32)},
    )
    report = Shadow(model).compare(batch(), squared_loss)
    assert [r.label for r in report.modules] == ["0", "1", "2", "3", "4", "(model)"]
    for r in report.modules:
        assert r.activation_divergence == 0.0 and r.error_divergence == 0.0, r
        assert r.reference_activation_norm > 0 and r.reference_error_norm > 0
    assert report.simulated_loss == report.reference_loss
    assert report.first_divergent(0.0) is None
    assert report.first_divergent(0.0, kind="error") is None


def test_one_coarse_layer_is_where_the_activations_first_diverge():
    model = inject(mlp(), {"2": LayerQuantization(output=COARSE)})
    report = Shadow(model).compare(batch())
    assert row(report, "0").activation_divergence == 0.0
    assert row(report, "1").activation_divergence == 0.0
    assert row(report, "2").activation_divergence > 0.01
    assert report.first_divergent(0.0).module == "2"
    assert all(r.error_divergence is None for r in report.modules)  # no loss, no errors


def test_an_error_format_that_flushes_small_errors_diverges_at_that_layer():
    model = inject(mlp(), {"2": LayerQuantization(error=FIXED8)})
    report = Shadow(model).compare(batch(), lambda out: squared_loss(out) * 1e-4)
    assert all(r.activation_divergence == 0.0 for r in report.modules)
    for name in ("4", "3", "(model)"):  # later in forward, so earlier in backward: exact
        assert next(r for r in report.modules if r.label == name).error_divergence == 0.0
    assert row(report, "2").error_divergence == 1.0  # every error rounded to zero
    assert report.first_divergent(0.5, kind="error").module == "2"
    assert row(report, "1").error_divergence == 1.0  # nothing flows back past it


def test_the_report_equals_a_hand_computation_on_two_linear_layers():
    torch.manual_seed(0)
    first, second = nn.Linear(4, 5), nn.Linear(5, 2)
    model = inject(
        nn.Sequential(first, second),
        {"0": LayerQuantization(output=COARSE, error=FIXED8), "1": None},
    )
    x = batch(8)
    report = Shadow(model).compare(x, squared_loss)

    w0, b0, w1, b1 = (p.detach() for p in (first.weight, first.bias, second.weight, second.bias))
    reference_0 = x @ w0.T + b0
    simulated_0 = lpsim.quantize(reference_0, *COARSE)
    reference_1 = reference_0 @ w1.T + b1
    simulated_1 = simulated_0 @ w1.T + b1
    reference_error_1, simulated_error_1 = 2 * reference_1, 2 * simulated_1  # d(sum y^2)/dy
    reference_error_0 = reference_error_1 @ w1
    simulated_error_0 = lpsim.quantize(simulated_error_1 @ w1, *FIXED8)

    def relative(simulated, reference):
        return float((simulated - reference).double().norm() / reference.double().norm())

    expected = {
        "0": (relative(simulated_0, reference_0), relative(simulated_error_0, reference_error_0)),
        "1": (relative(simulated_1, reference_1), relative(simulated_error_1, reference_error_1)),
    }
    for name, (activation, error) in expected.items():
        r = row(report, name)
        assert r.activation_divergence == pytest.approx(activation, rel=1e-5)
        assert r.error_divergence == pytest.approx(error, rel=1e-5)
    assert row(report, "1").reference_activation_norm == pytest.approx(
        float(reference_1.double().norm()), rel=1e-6
    )
    assert report.reference_loss == pytest.approx(float(reference_1.square().sum()), rel=1e-6)
    assert report.simulated_loss == pytest.approx(float(simulated_1.square().sum()), rel=1e-6)


def scaled_cnn() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(2, 4, 3, padding=1),
        nn.BatchNorm2d(4),
        nn.ReLU(),
        nn.Conv2d(4, 8, 3, padding=1),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(8 * 4 * 4, 32),
        nn.ReLU(),
        nn.Linear(32, 32),
        nn.ReLU(),
        nn.Linear(32, 5),
    )


def divergences_by_hand(model: nn.Module, x: torch.Tensor, loss_fn, names) -> dict:
    """Per module name: (its output after every forward hook, the gradient of the loss with respect
    to its output before the others), from hooks of the test's own: the first forward hook hands
    on a clone of a clone of the output, and the gradient is that of the first clone."""
    ports, outputs, handles = {}, {}, []
    for name in names:
        module = model.get_submodule(name)

        def port(m, args, output, name=name):
            ports[name] = output.clone()
            return ports[name].clone()

        def after(m, args, output, name=name):
            outputs[name] = output.detach().clone()

        handles += [module.register_forward_hook(port, prepend=True)]
        handles += [module.register_forward_hook(after)]
    loss = loss_fn(model(x))
    errors = torch.autograd.grad(loss, [ports[name] for name in names])
    for handle in handles:
        handle.remove()
    return {name: (outputs[name], error) for name, error in zip(names, errors)}


@pytest.mark.parametrize("name", ["mxfp8", "mxfp4", "nvfp4"])
def test_a_scaled_recipe_with_a_mac_diverges_from_torchs_model_on_the_same_weights_by_hand(name):
    """A scaled recipe with a stochastic float16 MAC in every product, after a training step: each
    row's divergences are ||sim - ref|| / ||ref|| of the outputs and errors of the module, ref from
    torch's own model (not injected) holding the simulated model's stored weights and BatchNorm
    statistics, sim from a copy of the simulated model run from the same generator state; and
    compare() leaves the model, its gradients and the generator as they were."""
    mac = lpsim.MAC(accumulator=Float(5, 10), rounding="stochastic")
    recipe = dataclasses.replace(lpsim.recipes.RECIPES[name], mac=mac)
    model = scaled_cnn()
    model, optimizer = recipe.apply(model, torch.optim.SGD(model.parameters(), lr=0.1))
    x = torch.randn(8, 2, 4, 4, generator=torch.Generator().manual_seed(2))
    target = torch.arange(8) % 5
    model(x).square().sum().backward()
    optimizer.step()

    def loss_fn(out):
        return nn.functional.cross_entropy(out, target) * 1024

    before = snapshot(model)
    report = Shadow(model).compare(x, loss_fn)
    assert_unchanged(model, before)

    names = [r.module for r in report.modules if r.module]
    reference = scaled_cnn()
    reference.load_state_dict(remove(copy.deepcopy(model)).state_dict())
    simulated = copy.deepcopy(model)
    torch.set_rng_state(before["rng"])
    simulated_values = divergences_by_hand(simulated, x, loss_fn, names)
    torch.set_rng_state(before["rng"])
    reference_values = divergences_by_hand(reference, x, loss_fn, names)
    torch.set_rng_state(before["rng"])

    def relative(s, r):
        return math.sqrt(float((s.double() - r.double()).square().sum())) / math.sqrt(
            float(r.double().square().sum())
        )

    for r in report.modules:
        if not r.module:
            continue
        (a_sim, e_sim), (a_ref, e_ref) = simulated_values[r.module], reference_values[r.module]
        assert r.activation_divergence == relative(a_sim, a_ref), r.module
        assert r.error_divergence == relative(e_sim, e_ref), r.module
    assert all(r.activation_divergence > 0 for r in report.modules if r.module in ("3", "6"))


def test_zero_reference_norms_give_zero_or_infinite_divergence():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.ReLU())
    with torch.no_grad():
        model[0].bias.fill_(-100.0)  # every ReLU output is zero in both models
    target = model(batch(8)).detach()
    inject(model, {"0": LayerQuantization(output=COARSE), "1": None})
    report = Shadow(model).compare(batch(8), lambda out: (out - target).square().sum())
    assert row(report, "1").activation_divergence == 0.0  # 0 / 0: both zero
    assert row(report, "0").error_divergence == 0.0  # the ReLU passes no error back

    linear = nn.Linear(4, 3)
    target = linear(batch(8)).detach()  # the reference hits the target: its error is zero
    inject(linear, {"": LayerQuantization(output=COARSE)})
    report = Shadow(linear).compare(batch(8), lambda out: (out - target).square().sum())
    assert report.modules[0].reference_error_norm == 0.0
    assert report.modules[0].error_divergence == math.inf
    assert report.first_divergent(1e6, kind="error") is report.modules[0]


def test_quantizer_modules_become_identity_in_the_reference():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), Quantizer(forward=COARSE), nn.Linear(8, 2))
    shadow = Shadow(model)
    assert isinstance(shadow.reference[1], nn.Identity)
    assert isinstance(model[1], Quantizer)
    report = shadow.compare(batch())
    assert row(report, "0").activation_divergence == 0.0
    assert report.first_divergent(0.0).module == "1"


def test_a_quantizer_registered_under_two_names_is_identity_under_both_in_the_reference():
    torch.manual_seed(0)
    shared = Quantizer(forward=COARSE, forward_rounding="nearest")
    first, second = nn.Linear(4, 4), nn.Linear(4, 2)
    model = nn.Sequential(first, shared, nn.Sequential(second, shared))
    x = batch(8)
    report = Shadow(model).compare(x)

    w0, b0, w1, b1 = (p.detach() for p in (first.weight, first.bias, second.weight, second.bias))
    reference = (x @ w0.T + b0) @ w1.T + b1  # the float32 model: no rounding at all
    simulated = lpsim.quantize(lpsim.quantize(x @ w0.T + b0, *COARSE) @ w1.T + b1, *COARSE)
    expected = float((simulated - reference).double().norm() / reference.double().norm())
    assert [r.label for r in report.modules] == ["0", "1", "2.0", "1 #2", "2", "(model)"]
    assert row(report, "1", 2).activation_divergence == pytest.approx(expected, rel=1e-5)
    assert row(report, "").activation_divergence == pytest.approx(expected, rel=1e-5)


def test_the_quantisers_of_qtorch_lower_are_removed_from_the_reference():
    torch.manual_seed(0)
    first, second = nn.Linear(4, 5), nn.Linear(5, 2)
    model = lower(nn.Sequential(first, second), ["linear"], E3M1, E3M1, "nearest", "nearest")
    x = batch(8)
    report = Shadow(model).compare(x, squared_loss)

    w0, b0, w1, b1 = (p.detach() for p in (first.weight, first.bias, second.weight, second.bias))
    e3m1 = Float(3, 1, special="none", saturate=True)  # qtorch's FloatingPoint(exp=3, man=1)
    reference_0 = x @ w0.T + b0
    simulated_0 = lpsim.quantize(reference_0, e3m1, "nearest")
    reference_1 = reference_0 @ w1.T + b1
    simulated_1 = lpsim.quantize(simulated_0 @ w1.T + b1, e3m1, "nearest")

    def relative(simulated, reference):
        return float((simulated - reference).double().norm() / reference.double().norm())

    assert row(report, "0").activation_divergence == pytest.approx(
        relative(simulated_0, reference_0), rel=1e-5
    )
    assert row(report, "1").activation_divergence == pytest.approx(
        relative(simulated_1, reference_1), rel=1e-5
    )
    assert report.reference_loss == pytest.approx(float(reference_1.square().sum()), rel=1e-6)
    assert report.simulated_loss == pytest.approx(float(simulated_1.square().sum()), rel=1e-6)


def test_the_reference_takes_the_stored_weights_at_every_compare():
    model = inject(mlp(), {"2": LayerQuantization(weight=COARSE)})
    stored = model[2].parametrizations.weight.original
    shadow = Shadow(model)
    shadow.compare(batch())
    assert torch.equal(shadow.reference[2].weight, stored)
    assert not torch.equal(shadow.reference[2].weight, model[2].weight)  # not the rounded ones
    assert row(shadow.compare(batch()), "2").activation_divergence > 0
    with torch.no_grad():
        stored.mul_(0.5)  # an optimizer step, say
    shadow.compare(batch())
    assert torch.equal(shadow.reference[2].weight, stored)
    assert [n for n, _ in shadow.reference.named_parameters()] == [
        n for n, _ in mlp().named_parameters()
    ]


def snapshot(model: nn.Module) -> dict:
    return {
        "state": {k: v.clone() for k, v in model.state_dict().items()},
        "parameters": list(model.parameters()),
        "grads": [None if p.grad is None else (p.grad, p.grad.clone()) for p in model.parameters()],
        "training": [m.training for m in model.modules()],
        "rng": torch.get_rng_state(),
    }


def assert_unchanged(model: nn.Module, before: dict) -> None:
    after = snapshot(model)
    assert before["state"].keys() == after["state"].keys()
    for key, value in before["state"].items():
        assert torch.equal(value, after["state"][key]), key
        assert value.dtype == after["state"][key].dtype
    assert all(a is b for a, b in zip(before["parameters"], after["parameters"]))
    for saved, p in zip(before["grads"], model.parameters()):
        if saved is None:
            assert p.grad is None
        else:
            assert p.grad is saved[0] and torch.equal(p.grad, saved[1])
    assert before["training"] == after["training"]
    assert torch.equal(before["rng"], after["rng"])


def stateful_model() -> nn.Module:
    """BatchNorm running statistics, a DelayedScaler's history, dropout and stochastic rounding:
    everything a forward pass changes."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(4, 16),
        nn.BatchNorm1d(16),
        nn.ReLU(),
        nn.Dropout(0.25),
        nn.Linear(16, 16),
        nn.Linear(16, 3),
    )
    delayed = DelayedScaling(Float(4, 3, special="fn", saturate=True))
    return inject(
        model,
        {
            "4": LayerQuantization(weight=delayed, output=delayed),
            "default": LayerQuantization(weight=Float(5, 2), output=Float(5, 2), error=Float(5, 2)),
        },
    )


@pytest.mark.parametrize("mode", ["train", "eval"])
def test_compare_leaves_the_simulated_model_bitwise_unchanged(mode):
    model = stateful_model()
    model.train(mode == "train")
    model(batch())[0].sum().backward()  # some gradients to keep, and a None one
    model[5].bias.grad = None
    before = snapshot(model)
    torch.manual_seed(3)
    expected = model(batch())
    model.load_state_dict(before["state"])
    torch.set_rng_state(before["rng"])

    shadow = Shadow(model)
    assert_unchanged(model, before)
    for dropout in (False, True):
        report = shadow.compare(batch(), squared_loss, dropout=dropout)
        assert_unchanged(model, before)
        assert report.first_divergent(0.0) is not None
    torch.manual_seed(3)
    assert torch.equal(model(batch()), expected)
    remove(model)  # the reference's own copy of the parametrised classes survives this
    shadow.reference(batch())


def test_compare_between_training_steps_changes_no_training_run():
    def train(with_shadow: bool) -> list[torch.Tensor]:
        model = stateful_model()
        optimizer = OptimLP(
            torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
            weight=Fixed(8, 6),
            grad=Fixed(8, 6),
        )
        shadow = Shadow(model) if with_shadow else None
        torch.manual_seed(5)
        for _ in range(3):
            x = torch.randn(16, 4)
            if shadow is not None:
                shadow.compare(x, squared_loss)
            optimizer.zero_grad()
            squared_loss(model(x)).backward()
            optimizer.step()
        return [t.clone() for t in model.state_dict().values()]

    for plain, shadowed in zip(train(False), train(True)):
        assert torch.equal(plain, shadowed)


def test_compare_inside_quantize_functions_leaves_the_sites_of_the_runs_later_calls():
    """A call made outside the model's modules (the loss's softmax) is ranked among such calls
    since the context was entered, and its rank names its DelayedScaler's site. compare()'s
    loss_fn makes such a call too; the training's call after it must keep its site (and so its
    amax history), or comparing in one step only gives that step's loss a fresh history."""
    e4m3 = DelayedScaling(Float(4, 3, special="fn", saturate=True))

    def loss_fn(out):
        return -torch.softmax(out, dim=-1)[:, 0].log().sum()

    def train(compare_at: int | None):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 3))
        functions = lpsim.nn.quantize_functions(
            model, {"softmax": LayerQuantization(input=e4m3, rounding="nearest")}
        )
        shadow = Shadow(model)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        losses = []
        for step in range(3):
            x = torch.randn(8, 4) * (step + 1)
            with functions:
                if step == compare_at:
                    shadow.compare(x * 10, loss_fn)
                loss = loss_fn(model(x))
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            losses.append(loss.detach())
        return losses, list(functions.scalers), [p.detach().clone() for p in model.parameters()]

    plain = train(None)
    compared = train(1)
    assert compared[1] == plain[1] == ["0:<outside>:softmax:0:input"]
    for a, b in zip(plain[0] + plain[2], compared[0] + compared[2], strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("injected", [False, True])
@pytest.mark.parametrize("kind", [nn.Embedding, nn.EmbeddingBag])
def test_compare_leaves_the_rows_an_embedding_with_max_norm_would_renormalise(kind, injected):
    """torch's Embedding and EmbeddingBag with max_norm renormalise the rows they look up in
    place, in their forward (and so does inject's parametrisation of their weight): compare()'s
    passes must not, or comparing on a batch the training never sees changes the run."""
    torch.manual_seed(0)
    embedding = kind(10, 4, max_norm=1.0)
    with torch.no_grad():
        embedding.weight.mul_(3)  # every row's norm is above max_norm
    model = nn.Sequential(embedding, nn.Linear(4, 2))
    if injected:
        model = inject(model, {kind: LayerQuantization(weight=COARSE), nn.Linear: None})
    stored = dict(model.named_parameters())
    before = {name: p.detach().clone() for name, p in stored.items()}
    indices = torch.tensor([[1, 2, 3]])
    Shadow(model).compare(indices, lambda out: out.square().sum())
    for name, p in stored.items():
        assert torch.equal(p, before[name]), name
    # The premise: a forward of the model renormalises those rows.
    model(indices)
    assert not torch.equal(next(model.parameters()), next(iter(before.values())))


class _WritesItsWeights(nn.Module):
    """A forward that writes its own parameters in place: a weight normalised in place under
    no_grad (version counter moves) and a bias written through .data (no counter moves)."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(3, 3)

    def forward(self, x):
        with torch.no_grad():
            self.linear.weight.mul_(0.5)
        self.linear.bias.data.add_(1.0)
        return self.linear(x)


@pytest.mark.parametrize("injected", [False, True])
def test_compare_puts_back_parameters_a_forward_writes_in_place(injected):
    # compare() promises to leave the simulated model as it was. Only Embedding's max_norm rows
    # were put back: a forward that wrote its weight in place (weight 0.5x, bias +1) left it so
    # after compare(), an extra step of the run on a batch the training never saw.
    torch.manual_seed(0)
    model = nn.Sequential(_WritesItsWeights(), nn.Linear(3, 2))
    if injected:
        model = inject(model, {nn.Linear: LayerQuantization(weight=COARSE)})
    stored = dict(model.named_parameters())
    before = {name: p.detach().clone() for name, p in stored.items()}
    Shadow(model).compare(torch.randn(4, 3), lambda out: out.square().sum())
    for name, p in stored.items():
        assert_same_bits(p.detach(), before[name], name)
    model(torch.randn(4, 3))  # the premise: a forward writes them
    assert not torch.equal(stored["0.linear.bias"], before["0.linear.bias"])


@pytest.mark.parametrize("watched", ["model", "quantizer"])
def test_errors_of_compare_that_overflow_make_no_dynamic_loss_scaler_skip_a_step(watched):
    # Errors of 2**20 overflow Float(4, 3) (largest 240). compare() with such a loss is no step of
    # the run: the next step, whose errors are clean, is taken. (The scaler recorded compare()'s
    # overflow and skipped that step, halving its scale.)
    e4m3 = Float(4, 3)
    scaler = DynamicLossScaler(init_scale=1.0)
    torch.manual_seed(0)
    if watched == "model":
        model = inject(mlp(), {nn.Linear: LayerQuantization(error=(e4m3, "nearest"))})
        scaler.watch_model(model)
    else:
        hook = scaler.watch(e4m3)
        quantizer = Quantizer(backward=(e4m3, "nearest"), backward_hooks=[hook])
        model = nn.Sequential(nn.Linear(4, 3), quantizer, nn.Linear(3, 3))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    x = batch()

    def huge_loss(output):
        return output.sum() * 2.0**20

    def one_step(loss_fn):
        optimizer.zero_grad()
        scaler.scale(loss_fn(model(x))).backward()
        scaler.step(optimizer)
        scaler.update()

    Shadow(model).compare(x, huge_loss)
    one_step(squared_loss)
    assert (scaler.skipped_steps, scaler.get_scale()) == (0, 1.0)
    one_step(huge_loss)  # the same errors in a step of the run do overflow
    assert (scaler.skipped_steps, scaler.get_scale()) == (1, 0.5)


def test_dropout_is_identity_by_default_and_its_masks_match_without_stochastic_rounding():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 16), nn.Dropout(0.5), nn.Linear(16, 3))
    inject(model, {nn.Linear: LayerQuantization(output=(FLOAT32, "nearest"))})
    shadow = Shadow(model)
    for dropout in (False, True):
        report = shadow.compare(batch(), squared_loss, dropout=dropout)
        assert all(r.activation_divergence == 0.0 for r in report.modules)
        assert all(r.error_divergence == 0.0 for r in report.modules)
    off = shadow.compare(batch())
    on = shadow.compare(batch(), dropout=True)
    assert row(off, "1").reference_activation_norm != row(on, "1").reference_activation_norm
    assert model[1].training and shadow.reference[1].training


class DropoutInside(nn.Module):
    """A Linear, then a module that applies dropout in its own forward, with its attribute
    ``dropout``: nn.MultiheadAttention to its attention weights, a two-layer nn.LSTM between its
    layers."""

    def __init__(self, kind: str):
        super().__init__()
        self.linear = nn.Linear(8, 8)
        if kind == "attention":
            self.inner = nn.MultiheadAttention(8, 2, dropout=0.5, batch_first=True)
        else:
            self.inner = nn.LSTM(8, 8, num_layers=2, dropout=0.5, batch_first=True)

    def forward(self, x):
        h = self.linear(x)
        if isinstance(self.inner, nn.MultiheadAttention):
            return self.inner(h, h, h, need_weights=False)[0]
        return self.inner(h)[0]


@pytest.mark.parametrize("kind", ["attention", "lstm"])
def test_dropout_inside_attention_and_recurrent_layers_is_off_by_default(kind):
    """An exact format rounded stochastically changes no value but draws random numbers, which the
    reference does not: a dropout left on after it draws other masks in the two passes. By
    default compare() runs without dropout, so the divergence is that of the rounding, 0."""
    torch.manual_seed(0)
    model = DropoutInside(kind)
    inject(model, {"linear": LayerQuantization(output=(FLOAT32, "stochastic"))})
    shadow = Shadow(model)
    x = torch.randn(2, 5, 8)
    report = shadow.compare(x, squared_loss)
    assert all(r.activation_divergence == 0.0 for r in report.modules)
    assert all(r.error_divergence == 0.0 for r in report.modules)
    assert model.inner.dropout == shadow.reference.inner.dropout == 0.5
    assert model.training and shadow.reference.inner.training
    # The premise: with dropout the masks differ.
    report = shadow.compare(x, squared_loss, dropout=True)
    assert row(report, "inner").activation_divergence > 0


class Checkpointed(nn.Module):
    """a, then b = (Linear, Tanh) under activation checkpointing (or not), then c."""

    def __init__(self, checkpoint: bool, reentrant: bool = False):
        super().__init__()
        self.a = nn.Linear(4, 8)
        self.b = nn.Sequential(nn.Linear(8, 8), nn.Tanh())
        self.c = nn.Linear(8, 2)
        self.checkpoint, self.reentrant = checkpoint, reentrant

    def forward(self, x):
        h = self.a(x)
        if self.checkpoint:
            h = torch.utils.checkpoint.checkpoint(self.b, h, use_reentrant=self.reentrant)
        else:
            h = self.b(h)
        return self.c(h)


def test_a_forward_that_checkpointing_recomputes_adds_no_row():
    """The backward pass of a checkpointed segment runs its forward again (b.0, until what it
    saved is recomputed): no second call of b.0, the report is that of the model without
    checkpointing, row for row and bit for bit."""
    config = {nn.Linear: LayerQuantization(output=COARSE, error=COARSE)}
    x = batch()
    reports = []
    for checkpoint in (False, True):
        torch.manual_seed(0)
        model = inject(Checkpointed(checkpoint), config)
        reports.append(Shadow(model).compare(x, squared_loss))
    plain, checkpointed = reports
    assert [r.label for r in checkpointed.modules] == ["a", "b.0", "b.1", "b", "c", "(model)"]
    assert checkpointed == plain
    torch.manual_seed(0)
    model = inject(Checkpointed(True, reentrant=True), config)
    with pytest.raises(RuntimeError, match="use_reentrant=False"):
        Shadow(model).compare(x, squared_loss)


def test_in_place_activations_leave_the_layer_errors_intact():
    model = inject(mlp(inplace=True), {"default": LayerQuantization(output=(FLOAT32, "nearest"))})
    x = batch()
    report = Shadow(model).compare(x, squared_loss)
    assert all(r.error_divergence == 0.0 for r in report.modules)
    plain = remove(copy.deepcopy(model))
    hidden = plain[0](x)
    hidden.retain_grad()
    squared_loss(plain[2:](plain[1](hidden.clone()))).backward()
    assert row(report, "0").reference_error_norm == pytest.approx(
        float(hidden.grad.double().norm()), rel=1e-6
    )


class ScaledInPlace(nn.Module):
    """Writes its input in place (x *= 2, as a forward normalising its batch in place does) and
    passes it to a linear layer."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 3)

    def forward(self, x, y):
        return self.linear(x.mul_(2) + y)


def test_a_forward_writing_its_inputs_in_place_sees_the_batch_in_both_passes():
    # A model without quantisers is its own reference: every divergence is exactly 0, and the
    # batch the caller passed is as it was (the training step after compare() reads it).
    torch.manual_seed(0)
    for model in (nn.Sequential(nn.ELU(inplace=True), nn.Linear(4, 3)), ScaledInPlace()):
        inputs = (batch(8),) if isinstance(model, nn.Sequential) else (batch(8), batch(8))
        saved = [t.clone() for t in inputs]
        report = Shadow(model).compare(inputs, squared_loss)
        assert all(r.activation_divergence == 0.0 for r in report.modules)
        # (no gradient reaches the output of the ELU, which reads the batch only)
        assert [r.error_divergence for r in report.modules][-2:] == [0.0, 0.0]
        assert report.simulated_loss == float(squared_loss(model(*[t.clone() for t in saved])))
        for t, old in zip(inputs, saved, strict=True):
            assert torch.equal(t, old)


class ShortcutBlock(nn.Module):
    """h = linear(x); out = (shortcut(h) + body(h), pair(h)), pair returning (y, 2 * y) for
    y = h + 1: h is read by the shortcut (which returns it), the body and the pair, and the pair's
    second output is computed from its first."""

    class Pair(nn.Module):
        def forward(self, h):
            y = h + 1
            return y, 2 * y

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(3, 3)
        self.shortcut = nn.Identity()
        self.body = nn.Linear(3, 3)
        self.pair = self.Pair()

    def forward(self, x):
        h = self.linear(x)
        return self.shortcut(h) + self.body(h), self.pair(h)


def test_the_error_of_a_module_is_the_gradient_reaching_its_outputs_from_outside():
    # loss = <g0, shortcut(h) + body(h)> + <g1, y> + <g2, 2y>: the gradient flowing into the
    # shortcut's output is g0, into the pair's outputs g1 and g2 (exactly). The shortcut's error
    # was the gradient of h, g0 + body's W^T g0 + g1 + 2 g2; the pair's first, g1 + 2 g2.
    torch.manual_seed(0)
    model = ShortcutBlock()
    g0, g1, g2 = torch.randn(3, 2, 3)

    def loss_fn(output):
        total, (y, twice) = output
        return (total * g0).sum() + (y * g1).sum() + (twice * g2).sum()

    report = Shadow(model).compare(torch.randn(2, 3), loss_fn)

    def norm(*tensors):
        return math.sqrt(sum(float(t.double().square().sum()) for t in tensors))

    assert row(report, "shortcut").reference_error_norm == norm(g0)
    assert row(report, "body").reference_error_norm == norm(g0)
    assert row(report, "pair").reference_error_norm == norm(g1, g2)
    assert all(r.error_divergence == 0.0 for r in report.modules)


def test_a_module_called_twice_has_a_row_per_call():
    torch.manual_seed(0)
    shared = nn.Linear(4, 4)
    model = inject(
        nn.Sequential(shared, nn.ReLU(), shared), {"1": LayerQuantization(output=COARSE)}
    )
    report = Shadow(model).compare(batch())
    assert [r.label for r in report.modules] == ["0", "1", "0 #2", "(model)"]
    assert row(report, "0").activation_divergence == 0.0
    assert row(report, "0", call=2).activation_divergence > 0


def test_the_report_prints_as_a_table_and_serialises_as_json_and_csv():
    model = inject(mlp(), {"2": LayerQuantization(output=COARSE, error=FIXED8)})
    shadow = Shadow(model)
    report = shadow.compare(batch(), squared_loss)
    lines = report.table().splitlines()
    assert lines[0].split() == ["module", "type", "activation", "error", "|activation|", "|error|"]
    assert len(lines) == 2 + len(report.modules) + 1 and lines[-1].startswith("loss: simulated")
    assert lines[-2].split()[:2] == ["(model)", "Sequential"]
    data = json.loads(json.dumps(report.as_dict()))
    assert data["modules"][2]["module"] == "2" and data["reference_loss"] == report.reference_loss
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=list(data["modules"][0]))
    writer.writeheader()
    writer.writerows(report.as_dict()["modules"])
    assert len(out.getvalue().splitlines()) == 1 + len(report.modules)
    forward_only = shadow.compare(batch()).table().splitlines()
    assert forward_only[2].split()[3] == "-" and not forward_only[-1].startswith("loss")


def test_bad_arguments_raise_errors_that_name_them():
    model = mlp()
    with pytest.raises(TypeError, match="model must be an nn.Module"):
        Shadow("model")
    with pytest.raises(TypeError, match="dtype must be a floating-point"):
        Shadow(model, dtype=torch.int32)
    shadow = Shadow(model)
    with pytest.raises(TypeError, match="inputs must be a tensor or a tuple"):
        shadow.compare([batch()])
    with pytest.raises(TypeError, match="loss_fn must be callable"):
        shadow.compare(batch(), loss_fn=3)
    with pytest.raises(TypeError, match="loss_fn must return a floating-point tensor with one"):
        shadow.compare(batch(), loss_fn=lambda out: out)
    with pytest.raises(TypeError, match="dropout must be a bool"):
        shadow.compare(batch(), dropout=1)
    report = shadow.compare(batch())
    for threshold in (-1.0, math.nan, "0.1"):
        with pytest.raises(ValueError, match="threshold must be a non-negative number"):
            report.first_divergent(threshold)
    with pytest.raises(ValueError, match="kind must be 'activation' or 'error'"):
        report.first_divergent(0.1, kind="gradient")
    model[2] = nn.Linear(16, 16, bias=False)
    with pytest.raises(RuntimeError, match="no parameter '2.bias' any more"):
        shadow.compare(batch())


@pytest.mark.parametrize("nested", [False, True])
def test_an_injected_module_registered_under_two_names_is_compared(nested):
    """nn.Sequential(a, shared, relu, shared, b): named_parameters(remove_duplicate=False) lists
    the quantised weight under both names, and the reference takes it under both."""
    torch.manual_seed(0)
    shared = nn.Linear(8, 8)
    block = nn.Sequential(shared) if nested else shared
    model = nn.Sequential(nn.Linear(4, 8), block, nn.ReLU(), block, nn.Linear(8, 3))
    inject(model, {"1.0" if nested else "1": LayerQuantization(weight=COARSE)})
    stored = shared.parametrizations.weight.original
    shadow = Shadow(model)
    report = shadow.compare(batch(5), squared_loss)
    labels = ["0", "1", "2", "1 #2", "4", "(model)"]
    if nested:
        labels = ["0", "1.0", "1", "2", "1.0 #2", "1 #2", "4", "(model)"]
    assert [r.label for r in report.modules] == labels
    assert row(report, "0").activation_divergence == 0.0
    assert row(report, "1").activation_divergence > 0
    assert row(report, "1", call=2).error_divergence is not None
    reference = shadow.reference
    assert reference[1] is reference[3]
    with torch.no_grad():
        stored.mul_(0.5)  # an optimizer step, say
    report = shadow.compare(batch(5), squared_loss)
    assert torch.equal(reference.get_parameter(f"3.{'0.' if nested else ''}weight"), stored)
    plain = remove(copy.deepcopy(model))
    assert torch.equal(reference(batch(5)), plain(batch(5)))


def test_an_attached_recorder_records_none_of_compares_roundings():
    """The records of a run with compare() between its steps (one of them failing) are those of
    the run without, and the recorder observes again after each compare()."""
    from lpsim import _observation  # noqa: PLC0415
    from lpsim.diagnostics import Recorder  # noqa: PLC0415

    def failing_loss(out):
        raise ZeroDivisionError("a loss that fails")

    def run(with_shadow: bool) -> list:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
        inject(model, {"0": LayerQuantization(weight=COARSE, output=COARSE, error=FIXED8)})
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        shadow = Shadow(model)
        x = batch(3)
        with Recorder(model, optimizer) as recorder:
            for step in range(3):
                if with_shadow:
                    if step == 1:
                        with pytest.raises(ZeroDivisionError):
                            shadow.compare(x, failing_loss)
                    else:
                        shadow.compare(x, squared_loss)
                    assert _observation.current is recorder
                optimizer.zero_grad()
                squared_loss(model(x)).backward()
                optimizer.step()
        assert _observation.current is None
        return recorder.records

    plain, shadowed = run(False), run(True)
    assert [r.step for r in plain] == [0] * 3 + [1] * 3 + [2] * 3
    assert shadowed == plain


class ModelOutput(collections.OrderedDict):
    """Like transformers' ModelOutput: a dict whose items are also attributes."""

    def __getattr__(self, name):
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None


Pair = collections.namedtuple("Pair", ["first", "second"])


class Containers(nn.Module):
    """Modules that return a dict subclass, a named tuple and a defaultdict, and a model that
    takes a named tuple; each reads what it receives by attribute or by a missing key."""

    def __init__(self):
        super().__init__()
        self.dict_out = DictOut()
        self.pair_out = PairOut()
        self.default_out = DefaultOut()

    def forward(self, pair):
        hidden = self.dict_out(pair.first).logits + pair.second
        pair = self.pair_out(hidden)
        found = self.default_out(pair.first * pair.second)
        return found["x"] + found["missing"] + hidden


class DictOut(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x):
        return ModelOutput(logits=self.linear(x), count=3)


class PairOut(nn.Module):
    def forward(self, x):
        return Pair(x.relu(), x.sigmoid())


class DefaultOut(nn.Module):
    def forward(self, x):
        found = collections.defaultdict(lambda: torch.zeros(()))
        found["x"] = x
        return found


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_outputs_and_inputs_keep_their_container_types(dtype):
    torch.manual_seed(0)
    model = inject(Containers(), {"dict_out.linear": LayerQuantization(weight=COARSE)})
    inputs = (Pair(batch(5), batch(5).flip(0)),)
    shadow = Shadow(model, dtype=dtype)
    for loss_fn in (None, squared_loss):
        report = shadow.compare(inputs, loss_fn)
        assert row(report, "dict_out.linear").activation_divergence > 0
        assert row(report, "dict_out").activation_divergence > 0
        assert row(report, "").activation_divergence > 0
    assert row(report, "pair_out").error_divergence > 0
    assert row(report, "dict_out").error_divergence > 0


def test_a_compiled_model_is_compared_as_the_model_it_wraps():
    """Shadow of torch.compile's wrapper: the rows, errors included, equal those of the model
    before compiling, under the model's own names, and the reference is the float32 model."""
    torch.manual_seed(1)
    x = torch.randn(8, 4)

    def loss_fn(out):
        return (out * out).mean()

    plain = mlp()
    expected_out = plain(x).detach().double()
    config = {"": LayerQuantization(weight=COARSE, output=COARSE, error=COARSE)}
    eager = Shadow(inject(mlp(), config)).compare(x, loss_fn)
    model = inject(mlp(), config)
    compiled = torch.compile(model, backend="aot_eager")
    shadow = Shadow(compiled)
    assert shadow.model is compiled
    report = shadow.compare(x, loss_fn)
    assert [row.label for row in report.modules] == ["0", "1", "2", "3", "4", "(model)"]
    assert report == eager
    assert all(row.error_divergence is not None for row in report.modules)
    assert report.modules[-1].reference_activation_norm == expected_out.norm().item()
    assert report.reference_loss == loss_fn(expected_out.float()).item()


def test_a_module_compiled_inside_the_model_has_its_eager_errors():
    """A submodule replaced by its torch.compile wrapper runs eagerly in compare(): its row has
    the error divergence of the uncompiled model's, not none."""
    import dataclasses

    torch.manual_seed(1)
    x = torch.randn(8, 4)
    config = {"": LayerQuantization(weight=COARSE, output=COARSE, error=COARSE)}
    eager = Shadow(inject(mlp(), config)).compare(x, squared_loss)
    model = inject(mlp(), config)
    model[2] = torch.compile(model[2], backend="aot_eager")
    report = Shadow(model).compare(x, squared_loss)
    inner = next(row for row in report.modules if row.module == "2._orig_mod")
    want = next(row for row in eager.modules if row.module == "2")
    assert inner.error_divergence is not None
    assert dataclasses.replace(inner, module="2") == want


@pytest.mark.parametrize("injected_into", ["linear inputs", "weights only"])
def test_a_transformer_encoder_with_a_padding_mask_in_eval_is_compared_position_by_position(
    injected_into,
):
    """Forward only in eval mode with a key padding mask, a TransformerEncoder may hand its layers
    nested tensors and pad its result with zeros; inject keeps an encoder whose layers hold hooks
    dense. compare() runs both models dense: every row is measured (no nested tensor to take a
    norm of) and an exact format diverges nowhere, the padded positions included."""
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True)
    model = nn.TransformerEncoder(layer, 2)
    plain = copy.deepcopy(model)
    settings = (
        LayerQuantization(input=FLOAT32)
        if injected_into == "linear inputs"
        else LayerQuantization(weight=FLOAT32)
    )
    inject(model, {nn.Linear: settings}, unmatched="ignore")
    model.eval()
    x = torch.randn(2, 5, 8)
    padding = torch.tensor([[False] * 5, [False, False, False, True, True]])
    report = Shadow(model).compare((x, None, padding))
    assert len(report.modules) == 19
    assert all(r.activation_divergence == 0.0 for r in report.modules)
    expected = plain.train()(x, src_key_padding_mask=padding)  # dropout 0: the dense path
    assert row(report, "").reference_activation_norm == pytest.approx(
        float(expected.double().norm()), rel=1e-6
    )
