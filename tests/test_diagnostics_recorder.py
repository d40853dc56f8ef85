"""The recorder: its statistics equal a recount of the roundings it saw, it records every
category of an injected model and an OptimLP, its stagnation matches a hand count, detaching
leaves the model exactly as before, and its exports hold the same numbers."""

from __future__ import annotations

import csv
import dataclasses
import json
import math
import sys

import pytest
import torch
from support import assert_same_bits, block_float_bounds_model, scaled_bounds_model
from torch import nn
from torch.nn.utils.parametrizations import weight_norm

import lpsim
from lpsim import P3109, BlockFloat, Fixed, Float, _observation
from lpsim.compat.qtorch import FloatingPoint
from lpsim.compat.qtorch.auto_low import lower
from lpsim.delayed_scaling import DelayedScaling
from lpsim.demo import small_cnn
from lpsim.diagnostics import recorder as recorder_module
from lpsim.diagnostics.recorder import CSV_COLUMNS, Recorder, Stagnation
from lpsim.nn import LayerQuantization, Quantizer, inject
from lpsim.optim import FusedSGD, OptimLP
from lpsim.scaled import Scaled, preset
from lpsim.statistics import RoundingStatistics

pytestmark = pytest.mark.usefixtures("one_thread")

FIXED = Fixed(6, 3)  # [-4, 3.875], spacing 1/8: inputs overflow, small values underflow
FLOAT = Float(3, 2)  # normal down to 0.25, subnormal down to 1/16, largest 14
RAW_FIELDS = tuple(f.name for f in dataclasses.fields(RoundingStatistics))
COUNTS = slice(0, 6)  # elements, nonfinite, overflow, underflow, subnormal, unchanged


def format_bounds(fmt) -> tuple[float, float, float]:
    """(low, high, smallest_normal) of a format with one range."""
    if isinstance(fmt, Fixed):
        return fmt.min, fmt.max, 0.0
    if isinstance(fmt, P3109):
        return fmt.min, fmt.max, fmt.smallest_normal
    if isinstance(fmt, Float):
        return -fmt.max, fmt.max, fmt.smallest_normal
    raise TypeError(f"{fmt!r} has a range per block")


def python_recount(
    x: torch.Tensor, rounded: torch.Tensor, fmt, bounds: tuple | None = None
) -> RoundingStatistics:
    """The statistics of a rounding, counted element by element in Python (within ``bounds``,
    where given)."""
    # a Scaled or BlockFloat format: each element within its block's range
    per_element = None
    if isinstance(fmt, Scaled):
        per_element = scaled_bounds_model(x, fmt)
    elif isinstance(fmt, BlockFloat):
        per_element = block_float_bounds_model(x, fmt)
    elif bounds is None:
        bounds = format_bounds(fmt)
    counts = dict(elements=0, nonfinite=0, overflow=0, underflow=0, subnormal=0, unchanged=0)
    errors, values = [], []
    pairs = zip(x.double().flatten().tolist(), rounded.double().flatten().tolist())
    for k, (a, b) in enumerate(pairs):
        low, high, smallest_normal = bounds if per_element is None else per_element[k]
        counts["elements"] += 1
        if not math.isfinite(a):
            counts["nonfinite"] += 1
            continue
        outside = a < low or a > high
        counts["overflow"] += outside or not math.isfinite(b)
        counts["underflow"] += a != 0 and not outside and b == 0
        counts["subnormal"] += math.isfinite(b) and b != 0 and abs(b) < smallest_normal
        counts["unchanged"] += a == b
        if math.isfinite(b):
            errors.append((b - a) ** 2)
            values.append(a * a)
    return RoundingStatistics(
        **counts, squared_error=math.fsum(errors), squared_value=math.fsum(values)
    )


def assert_same_statistics(got: RoundingStatistics, want: RoundingStatistics, where) -> None:
    assert got.as_tuple()[COUNTS] == want.as_tuple()[COUNTS], where
    assert got.squared_error == pytest.approx(want.squared_error, rel=1e-12, abs=0), where
    assert got.squared_value == pytest.approx(want.squared_value, rel=1e-12, abs=0), where


def assert_same_records(recorder: Recorder, expected: dict) -> dict:
    """The recorder's records, by (step, module, category), checked to be ``expected``'s."""
    got = {(r.step, r.module, r.category): r.statistics for r in recorder.records}
    assert sorted(got) == sorted(expected)
    for key, statistics in expected.items():
        assert_same_statistics(got[key], statistics, key)
    return got


def add_to(totals: dict, key, statistics: RoundingStatistics) -> None:
    totals[key] = totals.get(key, RoundingStatistics()) + statistics


# The recorder's totals equal a Python recount


def recount_model() -> nn.Sequential:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(1, 3, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(3 * 5 * 5, 4)
    )
    config = {
        nn.Conv2d: LayerQuantization(
            weight=FIXED, input=FIXED, output=FIXED, error=FLOAT, rounding="nearest"
        ),
        nn.Linear: LayerQuantization(
            weight=FLOAT, bias=FIXED, output=FLOAT, error=FIXED, rounding="nearest"
        ),
    }
    return inject(model, config)


def capture_roundings(model: nn.Module, formats: dict, captured: list, step: list) -> None:
    """Hooks of the test's own that save every tensor the injected quantisers round, before
    rounding: inputs (a pre-hook that runs before inject's), outputs (a forward hook that runs
    before inject's) and errors (a tensor hook on the rounded output)."""
    for name, fmt in formats.items():
        module = model.get_submodule(name)

        def save_input(m, args, name=name, fmt=fmt["input"]):
            if fmt is not None:
                captured.append((step[0], name, "input", args[0].detach().clone(), fmt))

        def save_output(m, args, output, name=name, fmt=fmt["output"]):
            captured.append((step[0], name, "output", output.detach().clone(), fmt))

        def watch_error(m, args, output, name=name, fmt=fmt["error"]):
            at = step[0]
            output.register_hook(
                lambda g: captured.append((at, name, "error", g.detach().clone(), fmt))
            )

        module.register_forward_pre_hook(save_input, prepend=True)
        module.register_forward_hook(save_output, prepend=True)
        module.register_forward_hook(watch_error)


def test_the_recorders_totals_equal_a_python_recount_of_the_models_roundings():
    model = recount_model()
    formats = {
        "0": {"weight": FIXED, "input": FIXED, "output": FIXED, "error": FLOAT},
        "3": {"weight": FLOAT, "bias": FIXED, "input": None, "output": FLOAT, "error": FIXED},
    }
    captured, step = [], [0]
    capture_roundings(model, formats, captured, step)
    sgd = torch.optim.SGD(model.parameters(), lr=0.05)
    generator = torch.Generator().manual_seed(1)
    with Recorder(model) as recorder:
        for _ in range(2):
            for name, fmt in formats.items():
                module = model.get_submodule(name)
                for kind in ("weight", "bias"):
                    if kind in fmt:
                        value = module.parametrizations[kind].original.detach().clone()
                        captured.append((step[0], name, kind, value, fmt[kind]))
            x = 3 * torch.randn(4, 1, 5, 5, generator=generator)
            sgd.zero_grad()
            (model(x).square().sum() * 4).backward()
            sgd.step()
            recorder.step()
            step[0] += 1
    expected = {}
    for at, name, category, x, fmt in captured:
        rounded = lpsim.quantize(x, fmt, "nearest")
        add_to(expected, (at, name, category), python_recount(x, rounded, fmt))
    got = assert_same_records(recorder, expected)
    total = sum(expected.values(), RoundingStatistics())
    assert total.overflow and total.underflow and total.subnormal  # every count is exercised
    assert_same_statistics(sum(got.values(), RoundingStatistics()), total, "total")


@pytest.mark.parametrize("reentrant", [False, True], ids=["non_reentrant", "reentrant"])
def test_a_checkpointed_forward_is_recorded_once_as_a_python_recount_of_one_forward(reentrant):
    """Activation checkpointing runs the forward again during the backward pass; the recorder
    records the forward once: its totals equal a recount of one forward and backward without
    checkpointing."""
    formats = {
        "0": {"weight": FIXED, "input": FIXED, "output": FIXED, "error": FLOAT},
        "3": {"weight": FLOAT, "bias": FIXED, "input": None, "output": FLOAT, "error": FIXED},
    }
    x = 3 * torch.randn(4, 1, 5, 5, generator=torch.Generator().manual_seed(1))
    plain = recount_model()
    captured = []
    capture_roundings(plain, formats, captured, [0])
    for name, fmt in formats.items():
        module = plain.get_submodule(name)
        for kind in ("weight", "bias"):
            if kind in fmt:
                value = module.parametrizations[kind].original.detach().clone()
                captured.append((0, name, kind, value, fmt[kind]))
    plain(x).square().sum().backward()
    expected = {}
    for at, name, category, value, fmt in captured:
        rounded = lpsim.quantize(value, fmt, "nearest")
        add_to(expected, (at, name, category), python_recount(value, rounded, fmt))

    model = recount_model()
    with Recorder(model) as recorder:
        y = torch.utils.checkpoint.checkpoint(
            model, x.clone().requires_grad_(), use_reentrant=reentrant
        )
        y.square().sum().backward()
    assert_same_records(recorder, expected)
    for a, b in zip(plain.parameters(), model.parameters()):
        assert_same_bits(b.grad, a.grad)


def capture_rounded_pairs(
    model: nn.Module, names, captured: list, step: list, outputs: bool = True
) -> None:
    """Hooks of the test's own that save each rounding of the modules in ``names`` as the pair
    (value before, value the run went on with): inputs and (with ``outputs``) outputs between a
    hook that runs before inject's and one after, errors from tensor hooks on both sides of the
    output's quantiser, weights from the forward hook of their parametrisation."""
    for name in names:
        module, raw = model.get_submodule(name), {}

        def before_input(m, args, raw=raw):
            raw["input"] = args[0].detach().clone()

        def after_input(m, args, name=name, raw=raw):
            captured.append((step[0], name, "input", raw.pop("input"), args[0].detach().clone()))

        def before_output(m, args, output, raw=raw):
            raw["output"] = output

        def after_output(m, args, output, name=name, raw=raw):
            unrounded, at, errors = raw.pop("output"), step[0], {}
            if outputs:
                pair = (unrounded.detach().clone(), output.detach().clone())
                captured.append((at, name, "output", *pair))
            output.register_hook(lambda g: errors.setdefault("before", g.clone()))
            unrounded.register_hook(
                lambda g: captured.append((at, name, "error", errors.pop("before"), g.clone()))
            )

        def weight(m, args, rounded, name=name):
            pair = (args[0].detach().clone(), rounded.detach().clone())
            captured.append((step[0], name, "weight", *pair))

        module.register_forward_pre_hook(before_input, prepend=True)
        module.register_forward_pre_hook(after_input)
        module.register_forward_hook(before_output, prepend=True)
        module.register_forward_hook(after_output)
        module.parametrizations["weight"][0].register_forward_hook(weight)


@pytest.mark.parametrize(
    "fmt",
    [
        preset("mxfp8_e4m3"),
        preset("mxfp4_e2m1"),
        preset("mxint8"),
        preset("nvfp4"),
        preset("fp8_e4m3_tensor"),
        preset("fp8_e5m2_row"),
        P3109(8, 3),
        P3109(8, 4, domain="finite", saturation="SatFinite"),
        P3109(6, 2, signed=False, saturation="SatPropagate"),
        BlockFloat(6, block_size=8),
        BlockFloat(8, dim=0),
        DelayedScaling(Float(4, 3, special="fn")),
    ],
    ids=str,
)
def test_the_recorders_totals_are_those_of_the_stochastic_roundings_that_happened(fmt):
    """Scaled, P3109, BlockFloat and DelayedScaling formats under stochastic rounding, with Inf,
    NaN, huge and tiny inputs: each record is the Python recount of the values before and after
    the rounding the run went on with (the same random words)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 32))
    inject(model, {nn.Linear: LayerQuantization(weight=fmt, input=fmt, output=fmt, error=fmt)})
    captured, step = [], [0]
    linears = [name for name, m in model.named_children() if isinstance(m, nn.Linear)]
    capture_rounded_pairs(model, linears, captured, step)
    sgd = torch.optim.SGD(model.parameters(), lr=0.01)
    with Recorder(model, sgd) as recorder:
        for scale in (3.0, 300.0):
            x = scale * torch.randn(16, 64)
            x[0, :8] = torch.tensor([math.inf, -math.inf, math.nan, 1e30, 1e-30, -1e-30, 0, -0.0])
            sgd.zero_grad()
            (model(x) * torch.linspace(-scale, scale, 32)).sum().backward()
            sgd.step()
            step[0] += 1
    expected = {}
    scales = {}  # a DelayedScaling quantiser's scale, by (module, category)
    for at, name, category, x, rounded in captured:
        bounds = None
        if isinstance(fmt, DelayedScaling):
            bounds = delayed_scaling_bounds(fmt, x, scales.setdefault((name, category), []))
        add_to(expected, (at, name, category), python_recount(x, rounded, fmt, bounds))
    assert_same_records(recorder, expected)
    total = sum(expected.values(), RoundingStatistics())
    assert total.nonfinite and total.unchanged < total.elements
    assert total.overflow > 0


def delayed_scaling_bounds(scaling: DelayedScaling, x: torch.Tensor, amaxes: list) -> tuple:
    """(low, high, smallest_normal) of a DelayedScaling quantiser's call on x, whose earlier calls
    had the float32 amaxes ``amaxes`` (x's is appended), from lpsim.delayed_scaling's documented
    update: scale 1 until a finite positive reduced amax (the largest, NaN ignored) gives
    elem_max / amax (at most float32's max), scale_inverse 1 / scale; the element's limits and
    smallest normal value times scale_inverse in float32, rounded into x's dtype, the limits
    extended to the largest values of x's dtype whose product with the scale in float32 stays
    within the element's limits (which nothing saturated)."""
    one = torch.tensor(1.0)
    scale = one
    history = [a for a in amaxes if not math.isnan(a)]
    if history and math.isfinite(max(history)) and max(history) > 0:
        largest = torch.tensor(torch.finfo(torch.float32).max)
        scale = torch.minimum(torch.tensor(scaling.element.max) / max(history), largest)
    inverse = one / scale
    element = scaling.element
    limits = torch.tensor([-element.max, element.max, element.smallest_normal]) * inverse
    low, high, smallest_normal = limits.to(x.dtype).tolist()
    magnitudes = x.detach().float().abs()
    magnitudes = magnitudes[~magnitudes.isnan()]
    amaxes.append(float(magnitudes.max()) if magnitudes.numel() else 0.0)

    def within(start: float) -> float:
        v, up = torch.tensor(start, dtype=x.dtype), torch.tensor(math.inf, dtype=x.dtype)
        while True:
            step = torch.nextafter(v, up)
            if not math.isfinite(float(step)) or float(step.float() * scale) > element.max:
                return float(v)
            v = step

    return -within(-low), within(high), smallest_normal


class CapturingSGD(torch.optim.SGD):
    """SGD that keeps the parameters and momentum buffers after each of its steps: what OptimLP
    then rounds into the accumulators and the momentum format."""

    def step(self, closure=None):
        loss = super().step(closure)
        self.after_step = {
            p: (p.detach().clone(), self.state[p]["momentum_buffer"].clone())
            for group in self.param_groups
            for p in group["params"]
        }
        return loss


def test_the_recorders_totals_equal_a_python_recount_of_the_optimizers_roundings():
    torch.manual_seed(0)
    model = nn.Linear(6, 4)
    inner = CapturingSGD(model.parameters(), lr=0.1, momentum=0.9)
    grad, momentum, acc, weight = FLOAT, Float(4, 3), Float(6, 9), FIXED
    optimizer = OptimLP(
        inner, weight=weight, grad=grad, momentum=momentum, acc=acc, rounding="nearest"
    )
    names = {id(p): name for name, p in model.named_parameters()}
    expected, stagnation = {}, {}
    with Recorder(model, optimizer) as recorder:
        for step in range(3):
            optimizer.zero_grad()
            (model(torch.randn(8, 6)).square().sum() * 8).backward()
            grads = {p: p.grad.clone() for p in model.parameters()}
            weights = {p: p.detach().clone() for p in model.parameters()}
            # The value each update starts from: the accumulator (the weight before the first).
            starts = {p: optimizer.accumulators.get(p, p).detach().clone() for p in weights}
            optimizer.step()
            for p in model.parameters():
                name = names[id(p)]
                new_acc, new_momentum = inner.after_step[p]
                state = inner.state[p]["momentum_buffer"]
                rounded_acc = optimizer.accumulators[p]
                pairs = (
                    ("grad", grads[p], p.grad, grad),
                    ("momentum", new_momentum, state, momentum),
                    ("accumulator", new_acc, rounded_acc, acc),
                    ("weight", rounded_acc, p.detach(), weight),
                )
                for category, before, after, fmt in pairs:
                    add_to(expected, (step, name, category), python_recount(before, after, fmt))
                updated = new_acc != starts[p]  # the accumulator's rounding
                lost = updated & (rounded_acc == starts[p])
                stagnation[step, name] = Stagnation(p.numel(), int(updated.sum()), int(lost.sum()))
    assert recorder.current_step == 3  # the optimizer's steps moved the recorder on
    assert_same_records(recorder, expected)
    assert {(r.step, r.parameter): r.stagnation for r in recorder.stagnation_records} == stagnation


def test_stagnation_with_an_accumulator_is_that_of_its_rounding():
    # Plain SGD: the update is -lr * grad, and it moves the accumulator, Float(5, 4) (spacing 1/16
    # in [1, 2)); the weight follows it rounded. An update of 0.01 is lost to the accumulator's
    # rounding to nearest, one of 0.1 is not, and zero gradients are no update.
    p = nn.Parameter(torch.full((8,), 1.5))
    optimizer = OptimLP(
        torch.optim.SGD([p], lr=0.01), weight=(Fixed(8, 2), "nearest"), acc=(Float(5, 4), "nearest")
    )
    with Recorder(None, optimizer) as recorder:
        for grad in (
            torch.zeros(8),
            torch.tensor([1.0, -1, 0, 0, 0, 0, 0, 0]),
            torch.full((8,), 10.0),
        ):
            p.grad = grad
            optimizer.step()
    got = {r.step: r.stagnation for r in recorder.stagnation_records}
    assert got == {0: Stagnation(8, 0, 0), 1: Stagnation(8, 2, 2), 2: Stagnation(8, 8, 0)}
    assert torch.equal(optimizer.accumulators[p], torch.full((8,), 1.375))


@pytest.mark.parametrize("kind", ["optim_lp", "fused"])
@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_stagnation_after_a_weight_changed_outside_the_optimizer_starts_from_its_accumulator(
    rounding, kind
):
    """A weight changed between steps (a pruning mask: 1 -> 0.5 for two elements) is taken into
    its accumulator as the step begins, and the update moves that value: accumulators 0.5, 0.5, 1,
    1 moved by 0, -1e-3, -0.5, 0 (lr 1) into Fixed(12, 8) (spacing 1/256): 0.499 rounds back to
    0.5, so 2 updated and 1 lost. (The recorder compared with the accumulator before the change
    and counted 3 updated, the zero update of a pruned element among them, and none lost.) The run
    stays the run without a recorder."""

    def run(recorded: bool):
        torch.manual_seed(0)
        w = nn.Parameter(torch.ones(4))
        if kind == "optim_lp":
            sgd = torch.optim.SGD([w], lr=1.0)
            optimizer = OptimLP(sgd, weight=Fixed(8, 4), acc=Fixed(12, 8), rounding=rounding)
        else:
            optimizer = FusedSGD(
                [w], lr=1.0, weight_format=Fixed(8, 4), acc_format=Fixed(12, 8), rounding=rounding
            )
        with torch.no_grad():
            w[:2] = 0.5
        recorder = Recorder(optimizer=optimizer)
        if recorded:
            recorder.attach()
        w.grad = torch.tensor([0.0, 1e-3, 0.5, 0.0])
        optimizer.step()
        recorder.detach()
        if kind == "optim_lp":
            return recorder.stagnation_records, w.detach(), optimizer.accumulators[w]
        return recorder.stagnation_records, w.detach(), optimizer.state[w]["accumulator"]

    records, weight, accumulator = run(True)
    _, plain_weight, plain_accumulator = run(False)
    assert_same_bits(weight, plain_weight)
    assert_same_bits(accumulator, plain_accumulator)
    if rounding == "nearest":
        assert accumulator.tolist() == [0.5, 0.5, 0.5, 1.0]
        assert records == [(0, "group0.param0", Stagnation(4, 2, 1))]
    else:  # 0.499 rounds to 0.5 or 0.49609375, the other updates are exact
        lost = int(accumulator[1] == 0.5)
        assert records == [(0, "group0.param0", Stagnation(4, 2, lost))]


# What is recorded


def test_an_injected_cnn_and_optim_lp_record_every_category():
    torch.manual_seed(0)
    model = inject(
        small_cnn(),
        {
            nn.Conv2d: LayerQuantization(weight=FLOAT, bias=FLOAT, input=FIXED, output=FIXED),
            nn.ReLU: LayerQuantization(error=FLOAT),
        },
    )
    optimizer = OptimLP(
        torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
        weight=FLOAT,
        grad=FLOAT,
        momentum=FLOAT,
        acc=Float(6, 9),
        parameters=lpsim.nn.quantized_parameters(model),
    )
    with Recorder(model, optimizer) as recorder:
        optimizer.zero_grad()
        loss = nn.functional.cross_entropy(model(torch.rand(4, 1, 8, 8)), torch.arange(4))
        loss.backward()
        optimizer.step()
    categories = {category for _, category in recorder.summary()}
    assert categories == {
        "weight",
        "bias",
        "input",
        "output",
        "error",
        "grad",
        "momentum",
        "accumulator",
    }
    modules = {module for module, category in recorder.summary() if category == "input"}
    assert modules == {"0", "3", "7"}  # the convolutions, by their names in the model
    parameters = {name for (name,) in recorder.stagnation_summary()}
    assert parameters == {"0.weight", "0.bias", "3.weight", "3.bias", "7.weight", "7.bias"}
    text = recorder.table()
    assert "SQNR dB" in text and "stagnation %" in text and "3.weight" in text


def test_the_tensors_weight_norm_computes_a_weight_from_are_recorded_apart():
    """weight_norm's g and v are two parameters ("original0", "original1"); their roundings and
    stagnation are recorded under names of their own, each with that parameter's elements (they
    were added up under one name, "0.weight": 3 + 12 elements for a weight of 12)."""
    torch.manual_seed(0)
    model = nn.Sequential(weight_norm(nn.Linear(4, 3)), nn.ReLU(), nn.Linear(3, 2))
    inject(model, {nn.Linear: LayerQuantization(weight=FLOAT, rounding="nearest")})
    optimizer = OptimLP(
        torch.optim.SGD(model.parameters(), lr=0.1), weight=FLOAT, grad=FLOAT, rounding="nearest"
    )
    with Recorder(model, optimizer) as recorder:
        optimizer.zero_grad()
        model(torch.randn(5, 4)).sum().backward()
        optimizer.step()
    numel = {
        "0.parametrizations.weight.original0": 3,  # g, one norm per output row
        "0.parametrizations.weight.original1": 12,  # v
        "0.bias": 3,
        "2.weight": 6,  # inject's quantiser alone: the name without its indirection
        "2.bias": 2,
    }
    by_category = {"grad": {}, "weight": {}}
    for (name, category), statistics in recorder.summary().items():
        by_category[category][name] = statistics.elements
    # "weight": the optimizer's roundings of the parameters, and inject's of the weights that
    # forward sees, under the modules' names
    assert by_category["grad"] == numel
    assert by_category["weight"] == {**numel, "0": 12, "2": 6}
    assert {name: s.elements for (name,), s in recorder.stagnation_summary().items()} == numel


def test_a_quantizer_module_records_its_output_and_error_under_its_name():
    model = nn.Sequential(nn.Linear(3, 3), Quantizer(FLOAT, FIXED, "nearest", "nearest"))
    x = torch.randn(5, 3)
    with Recorder(model) as recorder:
        y = model(x)
        y.backward(torch.randn(5, 3))
    assert_records_of_a_quantizer_after_a_linear(recorder, model, x)


def assert_records_of_a_quantizer_after_a_linear(recorder, model, x) -> None:
    """model = Sequential(Linear, Quantizer(FLOAT, FIXED, "nearest", "nearest")), run on x and
    its backward: its records are the quantiser's, its output's a Python recount."""
    got = recorder.summary()
    assert set(got) == {("1", "output"), ("1", "error")}
    output = model[0](x).detach()
    want = python_recount(output, lpsim.quantize(output, FLOAT, "nearest"), FLOAT)
    assert_same_statistics(got["1", "output"], want, "output")


def test_a_module_added_while_attached_is_recorded_from_its_first_call():
    """Without an optimizer no step names the model's modules again: a quantiser added to the
    model after attach() went unrecorded for the rest of the run; with one, until its next step."""
    model = nn.Sequential(nn.Linear(3, 3))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(5, 3)
    for attached_optimizer in (None, optimizer):
        del model[1:]
        with Recorder(model, attached_optimizer) as recorder:
            model.append(Quantizer(FLOAT, FIXED, "nearest", "nearest"))
            y = model(x)
            y.backward(torch.randn(5, 3))
        assert_records_of_a_quantizer_after_a_linear(recorder, model, x)


def test_a_module_that_rounded_outside_the_model_is_recorded_once_added_to_it():
    """A quantiser called on its own while the recorder is attached is outside the model (not
    recorded); added to the model afterwards, its roundings there are the model's. (It was found
    to have no name at its first rounding, and kept none for the rest of the run.)"""
    model = nn.Sequential(nn.Linear(3, 3))
    x = torch.randn(5, 3)
    quantizer = Quantizer(FLOAT, FIXED, "nearest", "nearest")
    with Recorder(model) as recorder:
        quantizer(torch.randn(2, 3, requires_grad=True)).sum().backward()
        assert recorder.records == []
        model.append(quantizer)
        model(x).backward(torch.randn(5, 3))
    assert_records_of_a_quantizer_after_a_linear(recorder, model, x)


def test_a_module_replaced_in_the_model_is_no_longer_recorded_under_its_old_name():
    """Modules outside the recorder's model are not recorded: a quantiser taken out of the model
    (another put in its place) and called on its own is no longer the model's "1"."""
    model = nn.Sequential(nn.Linear(3, 3), Quantizer(FLOAT, FIXED, "nearest", "nearest"))
    old = model[1]
    x = torch.randn(5, 3)
    with Recorder(model) as recorder:
        model[1] = Quantizer(FLOAT, FIXED, "nearest", "nearest")
        old(torch.randn(2, 3, requires_grad=True)).sum().backward()
        assert recorder.records == []
        model(x).backward(torch.randn(5, 3))
    assert_records_of_a_quantizer_after_a_linear(recorder, model, x)


def test_the_quantisers_of_qtorch_lower_are_recorded_under_the_lowered_modules():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 3))
    e3m2 = FloatingPoint(exp=3, man=2)  # Float(3, 2) without Inf and NaN, saturating
    fmt = Float(3, 2, special="none", saturate=True)
    lower(model, ["linear"], e3m2, e3m2, "nearest", "nearest")
    x, dy = torch.randn(5, 3), 4 * torch.randn(5, 3)
    with Recorder(model) as recorder:
        model(x).backward(dy)
    got = recorder.summary()
    assert set(got) == {(name, c) for name in ("0", "2") for c in ("output", "error")}
    with torch.no_grad():
        first = model[0].weight @ x.T  # recomputed without the quantisers
        out0 = (first.T + model[0].bias).detach()
        in2 = torch.tanh(lpsim.quantize(out0, fmt, "nearest"))
        out2 = in2 @ model[2].weight.T + model[2].bias
    want = python_recount(out0, lpsim.quantize(out0, fmt, "nearest"), fmt)
    assert_same_statistics(got["0", "output"], want, "0 output")
    want = python_recount(out2, lpsim.quantize(out2, fmt, "nearest"), fmt)
    assert_same_statistics(got["2", "output"], want, "2 output")
    assert_same_statistics(got["2", "error"], python_recount(dy, lpsim.quantize(dy, fmt), fmt), "")


def test_quantize_functions_the_quantizer_function_and_functional_formats_are_not_recorded():
    # As the recorder's docstring says: they round, but no record is made of them.
    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = nn.Linear(3, 3)
            self.rounding = lpsim.nn.quantizer(FLOAT, FLOAT, "nearest", "nearest")

        def forward(self, x):
            h = lpsim.nn.functional.linear(
                x, self.linear.weight, input_format=FLOAT, weight_format=FLOAT, grad_format=FLOAT
            )
            return self.rounding(torch.softmax(h, -1))

    model = Model()
    config = {"softmax": LayerQuantization(output=FLOAT, rounding="nearest")}
    with Recorder(model) as recorder:
        with lpsim.nn.quantize_functions(model, config):
            output = model(torch.randn(2, 3))
        output.sum().backward()
    assert recorder.records == []
    assert torch.equal(output, lpsim.quantize(output.detach(), FLOAT, "nearest"))


def scaled_recipe_model() -> nn.Sequential:
    """Convolutions and Linear layers: the scaled recipes quantise the operands of the inner
    three ("2", "5" and "7"), blocked along the channels (axis -3) and the features (-1)."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(2, 4, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(4, 8, 3, padding=1),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(8 * 4 * 4, 40),
        nn.ReLU(),
        nn.Linear(40, 32),
        nn.ReLU(),
        nn.Linear(32, 5),
    )


@pytest.mark.parametrize("name", ["mxfp8", "mxfp4", "nvfp4"])
def test_a_scaled_recipe_with_a_mac_records_a_python_recount_of_its_operands_roundings(name):
    """lpsim.recipes' MXFP8, MXFP4 (stochastic "rceil" errors) and NVFP4 (stochastic errors) with
    a stochastic float16 MAC in every product: each record is the Python recount of the values
    before and after the rounding the run went on with, each element within its block's range,
    the blocks along the channels of the convolution and the features of the Linear layers as
    Recipe.blocks_along_reduction documents; and the recorded run is bit for bit the run
    without a recorder."""
    mac = lpsim.MAC(accumulator=Float(5, 10), rounding="stochastic")
    recipe = dataclasses.replace(lpsim.recipes.RECIPES[name], mac=mac)
    axes = {"2": -3, "5": -1, "7": -1}

    def train(recorded: bool):
        model = scaled_recipe_model()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        model, optimizer = recipe.apply(model, optimizer)
        captured, step = [], [0]
        if recorded:
            capture_rounded_pairs(model, axes, captured, step, outputs=False)
        recorder = Recorder(model, optimizer).attach() if recorded else None
        torch.manual_seed(1)
        for scale in (1.0, 1e-6):
            optimizer.zero_grad()
            (model(torch.randn(4, 2, 4, 4)).square().sum() * scale).backward()
            optimizer.step()
            step[0] += 1
        if recorder is not None:
            recorder.detach()
        return model, recorder, captured, torch.get_rng_state()

    plain, _, _, plain_generator = train(False)
    model, recorder, captured, generator = train(True)
    specs = {"weight": recipe.weight, "input": recipe.activation, "error": recipe.error}
    expected = {}
    for at, module, category, x, rounded in captured:
        fmt = dataclasses.replace(specs[category][0], axis=axes[module])
        add_to(expected, (at, module, category), python_recount(x, rounded, fmt))
    assert_same_records(recorder, expected)
    total = sum(expected.values(), RoundingStatistics())
    assert total.overflow and total.unchanged < total.elements
    if name != "mxfp8":
        assert total.underflow and total.subnormal
    for (key, a), b in zip(plain.state_dict().items(), model.state_dict().values(), strict=True):
        assert_same_bits(b, a, key)
    assert torch.equal(generator, plain_generator)


def test_the_roundings_inside_a_macs_products_are_not_recorded():
    """As the recorder documents: a layer that rounds only in its MAC (a float16 accumulator with
    two mantissa bits, whose sums differ from torch's) has no records."""
    torch.manual_seed(0)
    mac = lpsim.MAC(accumulator=Float(5, 2))
    model = inject(nn.Linear(64, 8), {nn.Linear: LayerQuantization(mac=mac)})
    x = torch.randn(4, 64)
    with Recorder(model) as recorder:
        output = model(x)
        output.sum().backward()
    assert not torch.equal(output, nn.functional.linear(x, model.weight, model.bias))
    assert recorder.records == []


def test_delayed_scaling_roundings_count_what_the_calls_scale_saturated():
    e4m3 = Float(4, 3, special="fn")
    model = inject(nn.Linear(4, 4), {nn.Linear: LayerQuantization(output=DelayedScaling(e4m3))})
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(0)) * 1000
    with Recorder(model) as recorder:
        model(x).sum().backward()
    (statistics,) = recorder.summary().values()
    # the first call's scale is 1: the outputs beyond E4M3's 448 saturated
    unrounded = nn.functional.linear(x, model.weight, model.bias).detach()
    assert statistics.elements == 12
    assert statistics.overflow == int((unrounded.abs() > 448).sum()) > 0


def test_every_records_only_every_kth_step():
    model = recount_model()
    with Recorder(model, categories="output", every=2) as recorder:
        for _ in range(5):
            model(torch.randn(1, 1, 5, 5))
            recorder.step()
    assert sorted({r.step for r in recorder.records}) == [0, 2, 4]
    assert {r.category for r in recorder.records} == {"output"}


def test_a_step_count_set_while_attached_decides_whether_that_step_is_recorded():
    """current_step set on an attached recorder (a resumed run) records, with every=k, only the
    steps that are multiples of k, as one set before attach() does. The observer stayed the one
    attach() chose for step 0: set to 5 with every=2, step 5's roundings were recorded."""
    model = recount_model()
    for set_before in (True, False):
        recorder = Recorder(model, categories="output", every=2)
        if set_before:
            recorder.current_step = 5
        recorder.attach()
        if not set_before:
            recorder.current_step = 5
        for _ in range(4):
            model(torch.randn(1, 1, 5, 5))
            recorder.step()
        recorder.detach()
        assert sorted({r.step for r in recorder.records}) == [6, 8]


@pytest.mark.parametrize(
    "value, error", [(-1, ValueError), (2.0, TypeError), ("3", TypeError), (True, TypeError)]
)
def test_a_step_count_that_is_not_a_non_negative_int_is_refused(value, error):
    recorder = Recorder(nn.Linear(1, 1))
    with pytest.raises(error, match="current_step"):
        recorder.current_step = value
    assert recorder.current_step == 0


def test_eval_roundings_are_recorded_only_when_asked():
    model = recount_model().eval()
    with torch.no_grad():
        with Recorder(model) as recorder:
            model(torch.randn(1, 1, 5, 5))
        assert recorder.records == []
        with Recorder(model, record_eval=True) as recorder:
            model(torch.randn(1, 1, 5, 5))
    assert {r.category for r in recorder.records} == {"weight", "bias", "input", "output"}


# Stagnation


def tiny_parameter() -> tuple[nn.Parameter, torch.Tensor]:
    """Weights on the Fixed(8, 4) grid (spacing 1/16) and gradients whose updates (lr 1) round
    back to the old weight for two of the five nonzero ones: 0.5 - 0.01 -> 0.5 and
    1.0 - 0.02 -> 1.0; 0.45, 0.7 and -0.35 round to new values; the first update is zero."""
    weight = nn.Parameter(torch.tensor([0.5, 0.5, 0.5, 0.5, -0.25, 1.0]))
    gradient = torch.tensor([0.0, 0.01, 0.05, -0.2, 0.1, 0.02])
    return weight, gradient


@pytest.mark.parametrize(
    "kind, want",
    [
        ("optim_lp", Stagnation(6, 5, 2)),
        ("fused", Stagnation(6, 5, 2)),
        ("torch", Stagnation(6, 5, 0)),
    ],
)
def test_stagnation_matches_a_hand_count_on_a_tiny_example(kind, want):
    weight, gradient = tiny_parameter()
    grid = Fixed(8, 4)
    if kind == "optim_lp":
        optimizer = OptimLP(torch.optim.SGD([weight], lr=1.0), weight=grid, rounding="nearest")
    elif kind == "fused":
        optimizer = FusedSGD([weight], lr=1.0, weight_format=grid, rounding="nearest")
    else:
        optimizer = torch.optim.SGD([weight], lr=1.0)
    with Recorder(optimizer=optimizer) as recorder:
        (weight * gradient).sum().backward()
        optimizer.step()
    (record,) = recorder.stagnation_records
    assert record == (0, "group0.param0", want)
    assert record.stagnation.fraction == want.lost / want.updated


def test_fused_stagnation_with_an_accumulator_is_that_of_the_accumulator():
    """With acc_format the update moves the accumulator and the weight follows it rounded: in the
    tiny example the float32 accumulator keeps every update (0.49 and 0.98 included, which the
    weight's Fixed(8, 4) rounds back to 0.5 and 1.0), so none is lost, as OptimLP with the same
    acc counts; over steps of a coarser accumulator the two, whose runs are the same bit for bit,
    count the same."""
    weight, gradient = tiny_parameter()
    grid = Fixed(8, 4)
    optimizer = FusedSGD(
        [weight], lr=1.0, weight_format=grid, acc_format=Float(8, 23), rounding="nearest"
    )
    with Recorder(optimizer=optimizer) as recorder:
        (weight * gradient).sum().backward()
        optimizer.step()
    assert recorder.stagnation_records == [(0, "group0.param0", Stagnation(6, 5, 0))]
    assert weight.tolist() == [0.5, 0.5, 0.4375, 0.6875, -0.375, 1.0]  # two kept by the weight

    def run(fused: bool) -> tuple[list, torch.Tensor]:
        torch.manual_seed(0)
        weight = nn.Parameter(torch.randn(200))
        acc = Fixed(12, 8)  # updates below 2**-9 are lost
        if fused:
            optimizer = FusedSGD([weight], lr=0.01, weight_format=grid, acc_format=acc)
        else:
            sgd = torch.optim.SGD([weight], lr=0.01)
            optimizer = OptimLP(sgd, weight=grid, acc=acc)
        with Recorder(optimizer=optimizer, categories="stagnation") as recorder:
            for _ in range(4):
                weight.grad = torch.randn(200) * (torch.rand(200) < 0.8)
                optimizer.step()
        return recorder.stagnation_records, weight.detach()

    (fused, fused_weight), (plain, plain_weight) = run(True), run(False)
    assert torch.equal(fused_weight, plain_weight)
    assert fused == plain
    assert sum(r.stagnation.lost for r in plain) > 0


def test_kahan_stagnation_counts_the_updates_the_compensation_keeps_as_kept():
    """lpsim.optim.SGD with kahan=True (Float(5, 2), lr 1, weights 1): y = round(c + u) and the
    weight w + y rounded, the compensation keeping y minus what the weight gained. u = -0.05:
    y = -0.046875, w + y rounds back to 1, c = -0.046875 keeps it (not lost). u = -1e-9: y = -0,
    below Float(5, 2)'s smallest subnormal, w and c stay (lost). u = -0.2: y = -0.1875, w moves to
    0.75 (a tie, to even) and c = 0.0625. u = 0: no update. The weight alone (unchanged for
    two elements) would count 2 lost."""
    weight = nn.Parameter(torch.ones(4))
    optimizer = lpsim.optim.SGD(
        [weight], lr=1.0, weight_format=Float(5, 2), rounding="nearest", kahan=True
    )
    with Recorder(optimizer=optimizer) as recorder:
        weight.grad = torch.tensor([0.0, 0.05, 1e-9, 0.2])
        optimizer.step()
    assert weight.tolist() == [1.0, 1.0, 1.0, 0.75]
    assert optimizer.state[weight]["compensation"].tolist() == [0.0, -0.046875, 0.0, 0.0625]
    assert recorder.stagnation_records == [(0, "group0.param0", Stagnation(4, 3, 1))]


def test_a_sparse_gradient_moves_the_elements_where_its_dense_value_is_nonzero():
    # nn.Embedding(sparse=True) gives sparse gradients, which torch's SGD takes. Row 1 moves by
    # (-1, -1): 1 -> 0 is kept, 2**25 - 1 rounds back to 2**25 in float32 (spacing 4), so one of
    # its two updates is lost. Row 2 is indexed twice with opposite gradients: its dense gradient
    # is zero, no update. (The recorder raised NotImplementedError from the step hook, so the
    # step did not run.)
    embedding = nn.Embedding(4, 2, sparse=True)
    with torch.no_grad():
        embedding.weight.copy_(torch.tensor([[0.5, 0.5], [1.0, 2.0**25], [3.0, 3.0], [0.0, 0.0]]))
    optimizer = torch.optim.SGD(embedding.parameters(), lr=1.0)
    embedding.weight.grad = torch.sparse_coo_tensor(
        torch.tensor([[1, 2, 2]]),
        torch.tensor([[1.0, 1.0], [3.0, 0.0], [-3.0, 0.0]]),
        (4, 2),
        check_invariants=True,
    )
    with Recorder(embedding, optimizer) as recorder:
        optimizer.step()
    assert recorder.stagnation_records == [(0, "weight", Stagnation(8, 2, 1))]
    assert embedding.weight[1].tolist() == [0.0, 2.0**25]


@pytest.mark.parametrize("keyword", [False, True])
def test_with_a_closure_stagnation_counts_the_gradient_the_closure_computes(keyword):
    # step(closure): the gradient is the closure's, computed inside the step. Step 0 moves
    # elements 0 and 1 by -1 (2**25 - 1 rounds back to 2**25 in float32: lost), step 1 element 2.
    # (The recorder read the gradient before the closure ran: nothing at step 0, as there was no
    # gradient yet, and step 0's gradient at step 1, (4, 2, 2).)
    weight = nn.Parameter(torch.tensor([1.0, 2.0**25, 3.0, 4.0]))
    optimizer = torch.optim.SGD([weight], lr=1.0)
    losses = []
    with Recorder(optimizer=optimizer) as recorder:
        for gradient in torch.tensor([[1.0, 1.0, 0.0, 0.0], [0.0, 0.0, 1.0, 0.0]]):

            def closure(gradient=gradient):
                optimizer.zero_grad()
                loss = (weight * gradient).sum()
                loss.backward()
                return loss.detach()

            losses.append(optimizer.step(closure=closure) if keyword else optimizer.step(closure))
    assert recorder.stagnation_records == [
        (0, "group0.param0", Stagnation(4, 2, 1)),
        (1, "group0.param0", Stagnation(4, 1, 0)),
    ]
    assert [float(loss) for loss in losses] == [2.0**25, 3.0]  # the closure's own losses
    assert weight.tolist() == [0.0, 2.0**25, 2.0, 4.0]


# Detaching


def trained_model(steps: int, recorder_options: dict | None):
    """An injected model and OptimLP with stochastic rounding, after ``steps`` steps with the
    same seeds every time, recorded with a Recorder made from ``recorder_options`` (None: no
    recorder); and what the model and optimizer looked like before the recorder was attached."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(1, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.Linear(64, 3)
    )
    rule = "stochastic"
    inject(
        model,
        {
            (nn.Conv2d, nn.Linear): LayerQuantization(
                weight=FIXED, input=FIXED, output=FIXED, error=FLOAT, rounding=rule
            ),
            nn.BatchNorm2d: LayerQuantization(output=Float(5, 2), rounding=rule),
        },
    )
    optimizer = OptimLP(
        torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
        weight=FIXED,
        grad=FLOAT,
        momentum=Float(5, 2),
        rounding=rule,
    )
    before = layout(model, optimizer)
    recorder = (
        Recorder(model, optimizer, **recorder_options) if recorder_options is not None else None
    )
    if recorder is not None:
        recorder.attach()
    for _ in range(steps):
        optimizer.zero_grad()
        model(torch.randn(6, 1, 4, 4)).square().sum().backward()
        optimizer.step()
    if recorder is not None:
        recorder.detach()
    return model, optimizer, before


def layout(model: nn.Module, optimizer) -> dict:
    """Everything of a model and optimizer that attaching could change, but their values."""
    return {
        "modules": [(name, type(m)) for name, m in model.named_modules()],
        "parameters": [(name, id(p)) for name, p in model.named_parameters()],
        "buffers": [(name, id(b)) for name, b in model.named_buffers()],
        "state_dict": sorted(model.state_dict()),
        "hooks": [
            (len(m._forward_pre_hooks), len(m._forward_hooks), len(m._backward_hooks))
            for m in model.modules()
        ],
        "attributes": [sorted(vars(m)) for m in model.modules()],
        "optimizer_hooks": (
            len(optimizer._optimizer_step_pre_hooks),
            len(optimizer._optimizer_step_post_hooks),
        ),
    }


def assert_identical(got: torch.Tensor, want: torch.Tensor, name: str) -> None:
    if got.is_floating_point():
        assert_same_bits(got, want, name)
    else:
        assert got.dtype == want.dtype and torch.equal(got, want), name


def test_detaching_restores_the_model_exactly_and_recording_changes_nothing():
    plain, plain_optimizer, _ = trained_model(3, None)
    recorded, optimizer, before = trained_model(3, {})
    assert _observation.current is None
    assert layout(recorded, optimizer) == before
    for (name, a), (_, b) in zip(plain.state_dict().items(), recorded.state_dict().items()):
        assert_identical(b, a, name)
    for p, q in zip(plain_optimizer.param_groups[0]["params"], optimizer.param_groups[0]["params"]):
        assert_same_bits(
            optimizer.state[q]["momentum_buffer"], plain_optimizer.state[p]["momentum_buffer"]
        )
    x = torch.randn(6, 1, 4, 4)
    for model in (plain, recorded):
        torch.manual_seed(5)
        model.zero_grad()
        model.output = model(x)
        model.output.sum().backward()
    assert_same_bits(recorded.output, plain.output, "output")
    for (name, p), (_, q) in zip(plain.named_parameters(), recorded.named_parameters()):
        assert_same_bits(q.grad, p.grad, name)


def test_a_detached_model_calls_no_observer(monkeypatch):
    model, optimizer, _ = trained_model(1, {"every": 1})

    def refuse(*args, **kwargs):
        raise AssertionError("an observer was called")

    monkeypatch.setattr(recorder_module, "rounding_statistics", refuse)
    monkeypatch.setattr(Recorder, "observe", refuse)
    monkeypatch.setattr(Recorder, "wants", refuse)
    for _ in range(2):
        optimizer.zero_grad()
        model(torch.randn(2, 1, 4, 4)).sum().backward()
        optimizer.step()
    with Recorder(model, optimizer), pytest.raises(AssertionError, match="observer was called"):
        model(torch.randn(2, 1, 4, 4))  # attached, the same call sites do call it


# Exports


@pytest.fixture(scope="module")
def filled_recorder():
    model, optimizer, _ = trained_model(2, {})
    recorder = Recorder(model, optimizer)
    with recorder:
        for _ in range(2):
            optimizer.zero_grad()
            model(torch.randn(6, 1, 4, 4)).square().sum().backward()
            optimizer.step()
    assert recorder.records and recorder.stagnation_records
    return recorder


def same_number(text_or_value, want) -> bool:
    got = float(text_or_value) if isinstance(text_or_value, str) else text_or_value
    return (math.isnan(got) and math.isnan(want)) or got == want


def test_csv_export_parses_back_to_the_same_numbers(filled_recorder, tmp_path):
    path = tmp_path / "roundings.csv"
    filled_recorder.to_csv(path)
    with open(path, newline="") as file:
        rows = list(csv.DictReader(file))
    assert tuple(rows[0]) == CSV_COLUMNS
    records, stagnation = filled_recorder.records, filled_recorder.stagnation_records
    assert len(rows) == len(records) + len(stagnation)
    for row, record in zip(rows, records):
        assert (int(row["step"]), row["module"], row["category"]) == record[:3]
        for field, value in record.statistics.as_dict().items():
            assert same_number(row[field], value), (record[:3], field)
    for row, record in zip(rows[len(records) :], stagnation):
        assert (int(row["step"]), row["module"], row["category"]) == (
            record.step,
            record.parameter,
            "stagnation",
        )
        value = record.stagnation
        assert (int(row["elements"]), int(row["updated"]), int(row["lost"])) == (
            value.elements,
            value.updated,
            value.lost,
        )
        assert same_number(row["stagnation"], value.fraction)


def test_json_export_parses_back_to_the_same_numbers(filled_recorder, tmp_path):
    path = tmp_path / "roundings.json"
    filled_recorder.to_json(path)
    data = json.loads(path.read_text())  # standard JSON: no NaN or Infinity
    assert data["every"] == 1
    for entry, record in zip(data["records"], filled_recorder.records, strict=True):
        assert (entry["step"], entry["module"], entry["category"]) == record[:3]
        statistics = RoundingStatistics(*(entry[f] for f in RAW_FIELDS))
        assert statistics == record.statistics
        sqnr = record.statistics.sqnr_db
        assert entry["sqnr_db"] == (sqnr if math.isfinite(sqnr) else None)
    for entry, record in zip(data["stagnation"], filled_recorder.stagnation_records, strict=True):
        assert entry["parameter"] == record.parameter
        assert Stagnation(entry["elements"], entry["updated"], entry["lost"]) == record.stagnation


def test_summary_adds_the_records_and_the_table_shows_it(filled_recorder):
    by_category = filled_recorder.summary(by="category")
    for (category,), statistics in by_category.items():
        parts = [r.statistics for r in filled_recorder.records if r.category == category]
        assert statistics == sum(parts, RoundingStatistics())
    table = filled_recorder.table(by=("step", "category"))
    header = table.splitlines()[0].split()
    assert header[:4] == ["step", "category", "elements", "overflow"]
    assert f"{by_category['error',].elements}" in filled_recorder.table(by="category")


def test_the_plot_writes_a_png(filled_recorder, tmp_path):
    pytest.importorskip("matplotlib")
    for metric, category in (("underflow", "error"), ("overflow", "input"), ("sqnr_db", None)):
        path = tmp_path / f"{metric}.png"
        filled_recorder.plot(path, metric=metric, category=category)
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(ValueError, match="metric"):
        filled_recorder.plot(tmp_path / "x.png", metric="sqnr")
    with pytest.raises(ValueError, match="category"):
        filled_recorder.plot(tmp_path / "x.png", category="activations")
    with pytest.raises(ValueError, match="nothing recorded"):
        filled_recorder.plot(tmp_path / "x.png", category="accumulator")


class FakeWriter:
    def __init__(self):
        self.scalars = {}

    def add_scalar(self, tag, value, step):
        self.scalars[tag, step] = value


def test_tensorboard_scalars_go_to_any_writer_and_a_missing_package_is_explained(
    filled_recorder, monkeypatch, tmp_path
):
    writer = FakeWriter()
    filled_recorder.to_tensorboard(writer)
    record = next(r for r in filled_recorder.records if r.category == "error")
    tag = f"error/underflow/{record.module}"
    assert writer.scalars[tag, record.step] == 100 * record.statistics.fraction("underflow")
    stagnation = filled_recorder.stagnation_records[0]
    assert (f"stagnation/{stagnation.parameter}", stagnation.step) in writer.scalars
    assert all(math.isfinite(v) for v in writer.scalars.values())
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # as if not installed
    with pytest.raises(ImportError, match="pip install tensorboard"):
        filled_recorder.to_tensorboard(tmp_path / "logs")
    with pytest.raises(TypeError, match="add_scalar"):
        filled_recorder.to_tensorboard(object())


# Arguments


@pytest.mark.parametrize(
    "arguments, error, match",
    [
        (dict(model="model"), TypeError, "model must be an nn.Module"),
        (dict(optimizer=object()), TypeError, "optimizer must be a torch.optim.Optimizer"),
        (dict(), ValueError, "needs a model, an optimizer or both"),
        (dict(model=nn.Linear(1, 1), categories=["weights"]), ValueError, "categories"),
        (dict(model=nn.Linear(1, 1), categories=[]), ValueError, "categories"),
        (dict(model=nn.Linear(1, 1), categories=[1]), TypeError, "categories"),
        (dict(model=nn.Linear(1, 1), every=0), ValueError, "every"),
        (dict(model=nn.Linear(1, 1), every=2.0), TypeError, "every"),
        (dict(model=nn.Linear(1, 1), record_eval="yes"), TypeError, "record_eval"),
    ],
)
def test_bad_arguments_raise_errors_that_name_them(arguments, error, match):
    with pytest.raises(error, match=match):
        Recorder(**arguments)


def test_a_parameter_group_added_while_attached_is_recorded_from_its_first_step():
    """A parameter of the optimizer is recorded (its roundings and stagnation) whenever it was
    added: a group added by add_param_group after attach() is named as attach() names it."""
    first, second = nn.Parameter(torch.full((4,), 1.0)), nn.Parameter(torch.full((4,), 1.0))
    optimizer = OptimLP(torch.optim.SGD([first], lr=0.1), weight=(FIXED, "nearest"))
    with Recorder(None, optimizer) as recorder:
        optimizer.add_param_group({"params": [second]})
        first.grad, second.grad = torch.full((4,), 0.25), torch.tensor([1.0, 0.25, 0.0, 0.25])
        optimizer.step()
    weights = {r.module: r.statistics for r in recorder.records}
    assert sorted(weights) == ["group0.param0", "group1.param0"]
    # 1 - 0.1 * (1, 0.25, 0, 0.25) = (0.9, 0.975, 1, 0.975) rounded to FIXED's eighths: 0.875,
    # 1 (the update lost), 1 (no update: unchanged), 1 (lost)
    assert weights["group1.param0"].unchanged == 1
    assert second.tolist() == [0.875, 1.0, 1.0, 1.0]
    stagnation = {r.parameter: r.stagnation for r in recorder.stagnation_records}
    assert stagnation == {
        "group0.param0": Stagnation(4, 4, 4),
        "group1.param0": Stagnation(4, 3, 2),
    }


def test_the_optimizer_an_optim_lp_wraps_is_refused_naming_the_optim_lp():
    """recipe.apply(model, sgd) wraps sgd in an OptimLP, whose step() runs sgd's step before its
    state and weight roundings: hooks on sgd would end the recorder's step before them (their
    records would land in the next step) and count stagnation on half-updated weights. The
    recorder refuses sgd, at construction and, for an OptimLP made later, at attach()."""
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    early = Recorder(model, sgd)
    model, optimizer = lpsim.recipes.IBM8.apply(model, sgd)
    with pytest.raises(ValueError, match="optimizer: this SGD is wrapped by an OptimLP"):
        Recorder(model, sgd)
    with pytest.raises(ValueError, match="pass the OptimLP"):
        early.attach()
    assert not early.attached and _observation.current is None
    assert not sgd._optimizer_step_pre_hooks and not sgd._optimizer_step_post_hooks
    with Recorder(model, optimizer) as recorder:
        for _ in range(2):
            optimizer.zero_grad()
            model(torch.randn(16, 4)).square().mean().backward()
            optimizer.step()
    steps = {(r.step, r.category) for r in recorder.records if r.module == "2.weight"}
    categories = ("grad", "momentum", "accumulator", "weight")
    assert steps == {(step, category) for step in (0, 1) for category in categories}


def test_bad_keys_and_a_second_recorder_are_refused():
    recorder = Recorder(nn.Linear(1, 1))
    with pytest.raises(ValueError, match="by must name some of"):
        recorder.summary(by=("layer",))
    with pytest.raises(ValueError, match="by names a key twice"):
        recorder.table(by=("module", "module"))
    with recorder:
        with pytest.raises(RuntimeError, match="attached already"):
            recorder.attach()
        with pytest.raises(RuntimeError, match="another Recorder"):
            Recorder(nn.Linear(1, 1)).attach()
    assert not recorder.attached and _observation.current is None


def test_detaching_from_a_compiled_model_restores_its_graphs_and_records_equal_eager():
    """A recorder observing a torch.compile'd model records what it records in eager mode, and
    the model's outputs stay eager's; once detached, the model runs its forward and backward
    graphs again (the recorder's graph breaks are gone), also after attaching again."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    runs = [0]

    def counting(gm, example_inputs):
        run_graph = make_boxed_func(gm.forward)

        def run(args):
            runs[0] += 1
            return run_graph(args)

        run._boxed_call = True
        return run

    def make():
        torch.manual_seed(0)
        spec = (FLOAT, "nearest")
        return inject(
            nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 3)),
            {"0": LayerQuantization(weight=spec, input=spec, output=spec, error=spec)},
        )

    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(1)) * 3
    eager, model = make(), make()
    compiled = torch.compile(
        model, backend=aot_autograd(fw_compiler=counting, bw_compiler=counting)
    )

    def step(run_model):
        runs[0] = 0
        out = run_model(x)
        out.sum().backward()
        return out.detach(), runs[0]

    _, graphs = step(compiled)
    assert graphs == 2  # one forward and one backward graph
    for _ in range(2):
        with Recorder(eager) as expected:
            want, _ = step(eager)
        with Recorder(model) as recorder:
            got, _ = step(compiled)
        assert torch.equal(got, want)
        assert recorder.records == expected.records and len(recorder.records) == 4
        assert step(compiled)[1] == graphs


def test_tables_print_a_share_as_0_or_100_only_where_it_is():
    """One element of 200,000 changed and one error of 200,000 kept: 99.9995% unchanged and
    errors to zero, which two (or one) decimals would print as 100.00 (100.0%), a rounding that
    was exact or flushed everything."""
    n = 200_000
    model = nn.Sequential(Quantizer(FLOAT, FIXED, "nearest", "nearest"))
    x = torch.ones(n)
    x[0] = 1.1  # the one element Float(3, 2) changes
    gradient = torch.full((n,), 0.01)  # below half of Fixed(6, 3)'s spacing: to zero
    gradient[0] = 1.0  # the one error kept
    with Recorder(model) as recorder:
        model(x.requires_grad_()).backward(gradient)
    output, error = recorder.summary()[("0", "output")], recorder.summary()[("0", "error")]
    assert (output.unchanged, error.underflow) == (n - 1, n - 1)
    row = {line.split()[1]: line.split() for line in recorder.table().splitlines()[2:]}
    cells = [row["output"][6], row["error"][4]]  # unchanged %, underflow %
    layer = lpsim.demo.diagnosis({"run": recorder}).splitlines()[2].split(" | ")
    cells.append(layer[1].removesuffix("%"))  # errors to zero
    assert cells == ["99.999"] * 3  # 99.9995 in float64 is 99.99949999...
