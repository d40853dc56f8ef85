"""The operands of the backward products (lpsim.nn.functional.Operands): each quantised afresh
from the unquantised tensor, along the product's reduction axis, after an optional random
Hadamard transform; in lpsim.nn.functional, inject and quantize_functions.

The exact checks run in float64 with torch's products: the operands lie on MXFP4 or small float
grids, so every product and sum is exact in float64 and any order of summation gives the same
bits. The expected gradients are built by hand from the unquantised tensors, transposed so that
the reduction axis is last, transformed and quantised by lpsim.quantize."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from support import assert_same_bits
from torch import nn

import lpsim
import lpsim.nn.functional as LF
from lpsim import Float, RandomHadamard
from lpsim.delayed_scaling import DelayedScaling
from lpsim.nn import LayerQuantization, inject, quantize_functions, remove, report
from lpsim.nn.functional import Operands
from lpsim.scaled import preset

MXFP4 = preset("mxfp4_e2m1")  # blocks of 32 along axis -1
FORWARD = Float(3, 1)  # a coarse forward format, distinct from the backward operands' MXFP4
HADAMARD = RandomHadamard(16, seed=5)


def q(x: torch.Tensor, fmt, rounding: str = "nearest") -> torch.Tensor:
    return lpsim.quantize(x, fmt, rounding)


def leaves(*shapes, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*s, generator=g, dtype=dtype).requires_grad_() for s in shapes]


def transformed(x: torch.Tensor, transform) -> torch.Tensor:
    return x if transform is None else transform.apply(x)


def linear_grads(x, w, grad, **keywords):
    x, w = (t.detach().clone().requires_grad_() for t in (x, w))
    y = LF.linear(x, w, **keywords)
    y.backward(grad)
    return y.detach(), x.grad, w.grad


@pytest.mark.parametrize("transform", [None, HADAMARD], ids=["plain", "hadamard"])
def test_weight_gradient_takes_the_unquantised_input_and_error_along_the_tokens(transform):
    x, w = leaves((2, 32, 64), (48, 64))
    grad = torch.randn(2, 32, 48, dtype=torch.float64)
    _, _, grad_w = linear_grads(
        x,
        w,
        grad,
        input_format=FORWARD,
        weight_grad_operands=Operands(error=MXFP4, input=MXFP4, transform=transform),
    )
    tokens_x = x.detach().reshape(-1, 64).T  # (in, tokens): the tokens last
    tokens_e = grad.reshape(-1, 48).T  # (out, tokens)
    a = q(transformed(tokens_x, transform), MXFP4)
    e = q(transformed(tokens_e, transform), MXFP4)
    assert_same_bits(grad_w, e @ a.T, "weight gradient")


@pytest.mark.parametrize("transform", [None, HADAMARD], ids=["plain", "hadamard"])
def test_input_gradient_takes_the_error_and_the_unquantised_weight_along_the_outputs(transform):
    x, w = leaves((2, 8, 96), (64, 96))
    grad = torch.randn(2, 8, 64, dtype=torch.float64)
    _, grad_x, _ = linear_grads(
        x,
        w,
        grad,
        weight_format=FORWARD,
        input_grad_operands=Operands(error=MXFP4, weight=MXFP4, transform=transform),
    )
    e = q(transformed(grad.reshape(-1, 64), transform), MXFP4)  # (tokens, out)
    wt = q(transformed(w.detach().T, transform), MXFP4)  # (in, out): the outputs last
    assert_same_bits(grad_x, (e @ wt.T).reshape(2, 8, 96), "input gradient")


def test_without_operands_the_backward_products_take_the_forward_operands():
    x, w = leaves((4, 32), (8, 32))
    w = q(w.detach(), FORWARD)  # every operand on a small grid: exact float64 sums
    grad = q(torch.randn(4, 8, dtype=torch.float64), FORWARD)
    _, grad_x, grad_w = linear_grads(
        x, w, grad, input_format=FORWARD, input_grad_operands=Operands(error=MXFP4)
    )
    assert_same_bits(grad_w, grad.T @ q(x.detach(), FORWARD), "weight gradient")
    assert_same_bits(grad_x, q(grad, MXFP4) @ w.detach(), "input gradient")


def test_operands_change_neither_the_forward_result_nor_the_bias_gradient():
    x, w, b = leaves((4, 32), (8, 32), (8,))
    grad = torch.randn(4, 8, dtype=torch.float64)
    ops = dict(
        input_grad_operands=Operands(error=MXFP4, weight=MXFP4),
        weight_grad_operands=Operands(error=MXFP4, input=MXFP4, transform=RandomHadamard(4)),
    )
    y = LF.linear(x, w, b, input_format=FORWARD, **ops)
    y.backward(grad)
    assert_same_bits(y.detach(), LF.linear(x, w, b, input_format=FORWARD).detach(), "result")
    assert_same_bits(b.grad, grad.sum(0), "bias gradient")


def test_a_transform_alone_leaves_the_gradients_unchanged_up_to_rounding():
    x, w = leaves((64, 32), (16, 32))
    grad = torch.randn(64, 16, dtype=torch.float64)
    ops = Operands(transform=RandomHadamard(16, seed=1))
    _, grad_x, grad_w = linear_grads(x, w, grad, input_grad_operands=ops, weight_grad_operands=ops)
    torch.testing.assert_close(grad_w, grad.T @ x.detach(), rtol=1e-13, atol=1e-13)
    torch.testing.assert_close(grad_x, grad @ w.detach(), rtol=1e-13, atol=1e-13)


def test_the_hadamard_transform_reduces_the_weight_gradient_error_on_outlier_inputs():
    # Sparse outliers (2% of the inputs 31x larger) coarsen the MXFP4 block each falls in; the
    # transform spreads them over 16 tokens first. Only the input is quantised, so the error
    # measured is the one the transform acts on (fixed seed: measured 0.164 plain, 0.111 with it).
    g = torch.Generator().manual_seed(3)
    x = torch.randn(512, 64, generator=g)
    x = x * (1 + 30 * (torch.rand(512, 64, generator=g) < 0.02))
    grad = torch.randn(512, 32, generator=g)
    w = torch.randn(32, 64, generator=g)
    exact = grad.double().T @ x.double()

    def error(transform) -> float:
        ops = Operands(input=MXFP4, transform=transform)
        _, _, grad_w = linear_grads(x, w, grad, weight_grad_operands=ops)
        return ((grad_w.double() - exact).norm() / exact.norm()).item()

    plain, hadamard = error(None), error(RandomHadamard(16, seed=0))
    assert hadamard < 0.8 * plain, (plain, hadamard)


def _weight_gradient_bias(scale_rule: str) -> torch.Tensor:
    """|mean - exact| / standard error of 300 weight gradients with stochastic MXFP4 operands."""
    fmt = (replace(MXFP4, scale_rule=scale_rule), "stochastic")
    x, w = leaves((64, 32), (8, 32), dtype=torch.float32)
    grad = torch.randn(64, 8, generator=torch.Generator().manual_seed(1))
    exact = grad.double().T @ x.detach().double()
    ops = Operands(error=fmt, input=fmt, transform=HADAMARD)
    samples = []
    for seed in range(300):
        torch.manual_seed(seed)
        samples.append(linear_grads(x, w, grad, weight_grad_operands=ops)[2].double())
    samples = torch.stack(samples)
    return (samples.mean(0) - exact).abs() / (samples.std(0) / len(samples) ** 0.5)


def test_stochastic_operands_with_round_up_scales_give_an_unbiased_weight_gradient():
    # "rceil": no element of a block exceeds E2M1's largest value, 6, so nothing saturates.
    assert _weight_gradient_bias("rceil").max() < 5.5


def test_stochastic_operands_with_floor_scales_are_biased_by_saturation():
    # OCP's floor scale lets a block's largest elements reach nearly 8 times the scale;
    # stochastic rounding then saturates them at 6, toward zero.
    assert _weight_gradient_bias("floor").max() > 8


def test_stochastic_operands_repeat_under_the_same_seed():
    x, w = leaves((64, 32), (8, 32), dtype=torch.float32)
    grad = torch.randn(64, 8)
    ops = Operands(error=(MXFP4, "stochastic"), input=MXFP4, transform=HADAMARD)
    runs = []
    for _ in range(2):
        torch.manual_seed(11)
        runs.append(linear_grads(x, w, grad, weight_grad_operands=ops)[2])
    assert_same_bits(runs[0], runs[1], "weight gradient")


def test_matmul_operands_follow_the_batched_products():
    a, b = leaves((3, 32, 16), (3, 16, 32))
    grad = torch.randn(3, 32, 32, dtype=torch.float64)
    ops = dict(
        input_grad_operands=Operands(error=MXFP4, weight=MXFP4),
        weight_grad_operands=Operands(error=MXFP4, input=MXFP4, transform=HADAMARD),
    )
    y = LF.bmm(a, b, input_format=FORWARD, **ops)
    y.backward(grad)
    e = q(grad, MXFP4)  # (B, M, N): the reduction N last
    bt = q(b.detach(), MXFP4)  # (B, K, N)
    assert_same_bits(a.grad, e @ bt.transpose(1, 2), "first operand's gradient")
    at = q(HADAMARD.apply(a.detach().transpose(1, 2)), MXFP4)  # (B, K, M)
    et = q(HADAMARD.apply(grad.transpose(1, 2)), MXFP4)  # (B, N, M)
    assert_same_bits(b.grad, at @ et.transpose(1, 2), "second operand's gradient")


def test_operands_that_do_not_fit_are_refused_with_their_names():
    x, w = leaves((4, 32), (8, 32))
    with pytest.raises(ValueError, match="input_grad_operands.input"):
        LF.linear(x, w, input_grad_operands=Operands(input=MXFP4))
    with pytest.raises(ValueError, match="weight_grad_operands.weight"):
        LF.linear(x, w, weight_grad_operands=Operands(weight=MXFP4))
    with pytest.raises(ValueError, match="grad_format and weight_grad_operands.error"):
        LF.linear(x, w, grad_format=MXFP4, weight_grad_operands=Operands(error=MXFP4))
    with pytest.raises(TypeError, match="weight_grad_operands must be"):
        LF.linear(x, w, weight_grad_operands=MXFP4)
    with pytest.raises(TypeError, match="Operands.error: a DelayedScaling"):
        Operands(error=DelayedScaling(Float(4, 3)))
    with pytest.raises(TypeError, match="Operands.input must be None"):
        Operands(input="mxfp4")
    with pytest.raises(TypeError, match="Operands.transform must be"):
        Operands(transform=torch.eye(4))
    with pytest.raises(ValueError, match="its axis must be -1, got 0"):
        Operands(transform=RandomHadamard(4, axis=0))
    y = LF.linear(x, w, weight_grad_operands=Operands(transform=RandomHadamard(16)))
    with pytest.raises(ValueError, match="multiple of RandomHadamard.size, 16"):
        y.sum().backward()  # 4 tokens: the reduction length is not a multiple of 16


def test_a_reduction_the_transform_cannot_group_names_the_product_and_its_length():
    # The transform's own message spoke of "axis -1 of x, 15" where the user's x has 32 columns
    # along its last axis: the length is the product's reduction (the tokens, out_features).
    x, w = torch.randn(3, 5, 32, requires_grad=True), torch.randn(24, 32, requires_grad=True)
    y = LF.linear(x, w, weight_grad_operands=Operands(transform=RandomHadamard(16)))
    with pytest.raises(ValueError, match=r"weight_grad_operands\.transform: .* 15 .*size, 16"):
        y.sum().backward()
    y = LF.linear(x, w, input_grad_operands=Operands(transform=RandomHadamard(16)))
    with pytest.raises(ValueError, match=r"input_grad_operands\.transform: .* 24 .*size, 16"):
        y.sum().backward()
    a, b = torch.randn(2, 16, 8, requires_grad=True), torch.randn(2, 8, 16, requires_grad=True)
    y = LF.matmul(a, b, weight_grad_operands=Operands(transform=RandomHadamard(32)))
    with pytest.raises(ValueError, match=r"weight_grad_operands\.transform: .* 16 .*size, 32"):
        y.sum().backward()


# ---- inject and quantize_functions


def _layer(**fields) -> LayerQuantization:
    """Bare formats are rounded stochastically (LayerQuantization's default rule)."""
    defaults = dict(
        input=(FORWARD, "nearest"),
        weight=(FORWARD, "nearest"),
        input_grad_operands=Operands(error=MXFP4, weight=(MXFP4, "nearest")),
        weight_grad_operands=Operands(error=MXFP4, input=(MXFP4, "nearest"), transform=HADAMARD),
    )
    return LayerQuantization(**{**defaults, **fields})


def _functional_keywords() -> dict:
    settings = _layer()
    return dict(
        input_format=settings.input,
        weight_format=settings.weight,
        input_grad_operands=settings.input_grad_operands,
        weight_grad_operands=settings.weight_grad_operands,
        rounding="stochastic",
    )


def test_an_injected_linear_computes_what_the_functional_linear_computes():
    torch.manual_seed(0)
    layer = nn.Linear(32, 24, bias=False)
    x = torch.randn(2, 16, 32)
    grad = torch.randn(2, 16, 24)
    torch.manual_seed(7)
    want = linear_grads(x, layer.weight, grad, **_functional_keywords())
    inject(layer, {nn.Linear: _layer()})
    torch.manual_seed(7)
    xs = x.clone().requires_grad_()
    y = layer(xs)
    y.backward(grad)
    assert_same_bits(y.detach(), want[0], "result")
    assert_same_bits(xs.grad, want[1], "input gradient")
    assert_same_bits(layer.parametrizations.weight.original.grad, want[2], "weight gradient")
    assert "weight grad operands: error" in report(layer)
    remove(layer)
    assert_same_bits(layer(x), torch.nn.functional.linear(x, layer.weight), "removed")


def test_a_pre_hook_registered_after_inject_sees_the_input_a_linear_with_operands_rounds():
    """A Linear with backward Operands rounds its input in its own forward, not in a pre-hook, so
    a forward pre-hook registered after inject() sees the input unquantised (docs/training.md)
    and what it returns is what the forward rounds: the result is the layer's on the hook's
    tensor."""
    torch.manual_seed(0)
    layer = nn.Linear(32, 8, bias=False)
    x = torch.randn(4, 32)
    inject(layer, {nn.Linear: _layer()})
    seen = []

    def hook(module, args):
        seen.append(args[0].clone())
        return (args[0] * 2,)

    layer.register_forward_pre_hook(hook)
    y = layer(x)
    assert_same_bits(seen[0], x, "the hook's input")
    weight = lpsim.quantize(layer.parametrizations.weight.original, FORWARD, "nearest")
    expected = torch.nn.functional.linear(lpsim.quantize(x * 2, FORWARD, "nearest"), weight)
    assert_same_bits(y.detach(), expected, "result")


def test_an_injected_linear_in_eval_mode_rounds_its_operands_to_nearest():
    layer = nn.Linear(32, 8)
    inject(layer, {nn.Linear: _layer()})
    layer.eval()
    x = torch.randn(16, 32)
    grads = []
    for seed in (1, 2):
        torch.manual_seed(seed)
        xs = x.clone().requires_grad_()
        layer(xs).sum().backward()
        grads.append(xs.grad)
    assert_same_bits(grads[0], grads[1], "input gradient under two seeds")


def test_an_injected_linear_records_a_delayed_input_scale_once_per_forward():
    layer = nn.Linear(32, 8)
    delayed = DelayedScaling(Float(4, 3), history_length=4)
    inject(layer, {nn.Linear: _layer(input=(delayed, "nearest"))})
    for _ in range(3):
        layer(torch.randn(16, 32)).sum().backward()
    scaler = layer.lpsim_scalers.input["0"]
    assert int(scaler.calls) == 3


def test_inject_refuses_operands_on_layers_that_are_not_linear():
    with pytest.raises(ValueError, match="apply to Linear layers.*Conv2d"):
        inject(nn.Sequential(nn.Conv2d(3, 4, 3)), {nn.Conv2d: _layer()})
    with pytest.raises(ValueError, match="error and input_grad_operands.error"):
        LayerQuantization(error=MXFP4, input_grad_operands=Operands(error=MXFP4))


class _Product(nn.Module):
    def forward(self, a, b):
        return a @ b


def test_quantize_functions_forms_the_operands_of_a_matmul_as_the_functional_matmul():
    a, b = leaves((32, 32), (32, 16), dtype=torch.float32)
    grad = torch.randn(32, 16)
    torch.manual_seed(3)
    y = LF.matmul(a, b, **_functional_keywords())
    y.backward(grad)
    want = a.grad.clone(), b.grad.clone()
    a.grad = b.grad = None
    model = _Product()
    torch.manual_seed(3)
    with quantize_functions(model, {"matmul": _layer()}):
        model(a, b).backward(grad)
    assert_same_bits(a.grad, want[0], "first operand's gradient")
    assert_same_bits(b.grad, want[1], "second operand's gradient")


def test_quantize_functions_refuses_operands_on_softmax():
    with pytest.raises(ValueError, match="'softmax' takes the fields input, output, error"):
        quantize_functions(
            _Product(), {"softmax": LayerQuantization(weight_grad_operands=Operands())}
        )


def test_operands_on_a_linear_whose_parent_bypasses_its_forward_are_reported_as_never_run():
    attention = nn.MultiheadAttention(32, 2)
    with pytest.warns(
        UserWarning, match=r"'out_proj' .*: input/output/error and backward operands$"
    ):
        inject(attention, {"out_proj": _layer()})
    with pytest.warns(UserWarning, match="backward operands never run"):
        assert "backward operands never run" in report(attention)


def test_an_injected_model_with_hadamard_operands_trains_under_torch_compile_as_in_eager():
    # Two SGD steps of stochastic, transformed backward operands: aot_eager traces the transform
    # (a custom autograd function) and draws the same seeds as eager.
    def run(compiled: bool):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 16))
        setting = LayerQuantization(
            weight=MXFP4,
            input=MXFP4,
            rounding="nearest",
            weight_grad_operands=Operands(
                error=(MXFP4, "stochastic"), input=(MXFP4, "stochastic"), transform=HADAMARD
            ),
            input_grad_operands=Operands(
                error=(MXFP4, "stochastic"), weight=MXFP4, transform=RandomHadamard(16, seed=4)
            ),
        )
        inject(model, {nn.Linear: setting})
        optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
        net = torch.compile(model, backend="aot_eager") if compiled else model
        generator = torch.Generator().manual_seed(1)
        torch.manual_seed(7)
        losses = []
        for _ in range(2):
            loss = net(torch.randn(4, 8, 32, generator=generator)).square().mean()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.detach())
        return losses, [p.detach() for p in model.parameters()]

    eager, compiled = run(False), run(True)
    for a, b in zip(eager[0] + eager[1], compiled[0] + compiled[1]):
        assert_same_bits(a, b)


@pytest.mark.parametrize(
    "a_shape, b_shape",
    [((3, 8, 16), (1, 16, 8)), ((2, 3, 8, 16), (3, 16, 8)), ((8, 16), (3, 16, 8))],
    ids=["b-broadcast", "b-broadcast-4d", "a-broadcast"],
)
def test_an_operand_broadcast_over_the_batch_is_quantised_once_for_every_matrix(a_shape, b_shape):
    """A stochastic rule rounds the broadcast operand once, as the forward's formats do: every
    matrix of the batch takes the same rounding, that of lpsim.quantize of the tensor given. The
    expected gradients are torch's of a product by that one rounding (the operands on Float(3, 1)'s
    grid: every sum exact in float64)."""
    fmt = (Float(3, 1), "stochastic")
    a, b = leaves(a_shape, b_shape)
    shape = torch.broadcast_shapes(a_shape[:-2], b_shape[:-2]) + (a_shape[-2], b_shape[-1])
    grad = q(torch.randn(shape, dtype=torch.float64), Float(3, 1))

    def torch_grad(first, second, leaf_index):
        tensors = [
            t.detach().clone().requires_grad_(i == leaf_index)
            for i, t in enumerate((first, second))
        ]
        torch.matmul(*tensors).backward(grad)
        return tensors[leaf_index].grad

    torch.manual_seed(5)
    LF.matmul(a, b, input_grad_operands=Operands(weight=fmt)).backward(grad)
    torch.manual_seed(5)
    weight = q(b.detach(), *fmt)  # (..., K, N): the reduction N last, quantised once
    assert_same_bits(a.grad, torch_grad(a, weight, 0), "first operand's gradient")
    torch.manual_seed(6)
    b.grad = None
    LF.matmul(a, b, weight_grad_operands=Operands(input=fmt)).backward(grad)
    torch.manual_seed(6)
    inputs = q(a.detach().transpose(-2, -1), *fmt)  # (..., K, M): the reduction M last
    assert_same_bits(
        b.grad, torch_grad(inputs.transpose(-2, -1), b, 1), "second operand's gradient"
    )


def _sylvester_times_signs(size: int, seed: int) -> torch.Tensor:
    """H diag(s) / sqrt(size) in float64, H built from Python ints (Sylvester), s the signs the
    transform documents: 1 - 2 * randint(2) from a CPU generator seeded with ``seed``."""
    h = [[1]]
    while len(h) < size:
        h = [row + row for row in h] + [row + [-v for v in row] for row in h]
    s = 1 - 2 * torch.randint(2, (size,), generator=torch.Generator().manual_seed(seed))
    return torch.tensor(h, dtype=torch.float64) * s.to(torch.float64) / size**0.5


def test_a_bfloat16_operand_is_quantised_from_its_transform_unrounded():
    # Integer bfloat16 inputs: every transformed value (a sum of 16 of them over 4) is exact in
    # float32 and float64, and many of the input's are not bfloat16 values. Each transformed
    # operand is quantised as computed (E5M2 here, torch's cast the oracle): a rounding into
    # bfloat16 first moved 72.25 onto E5M2's midpoint 72, which ties to 64, not 80.
    size, seed = 16, 3
    g = torch.Generator().manual_seed(0)
    x = torch.randint(-64, 65, (512, 16), generator=g).to(torch.bfloat16)
    grad = torch.randint(-1, 2, (512, 8), generator=g).to(torch.bfloat16)
    w = torch.zeros(8, 16, dtype=torch.bfloat16)
    e5m2 = (Float(5, 2), "nearest")
    ops = Operands(error=e5m2, input=e5m2, transform=RandomHadamard(size, seed=seed))
    _, _, grad_w = linear_grads(x, w, grad, weight_grad_operands=ops)
    r = _sylvester_times_signs(size, seed)

    def operand(t):  # (features, tokens): each group g of 16 tokens replaced by R g, then E5M2
        groups = t.T.double().reshape(t.shape[1], -1, size)
        return (groups @ r.T).reshape(t.shape[1], -1).to(torch.float8_e5m2).double()

    # E5M2 multiples of 1/4, at most 256 (input) and 4 (error), 512 tokens: the products' float32
    # sums are exact (below 2**19, multiples of 1/16), and the gradient is their one rounding
    # into bfloat16.
    expected = (operand(grad) @ operand(x).T).to(torch.bfloat16)
    assert_same_bits(grad_w, expected, "weight gradient")
    fine = Operands(input=Float(5, 10), transform=ops.transform)  # fits float32, not bfloat16
    with pytest.raises(ValueError, match="does not fit a bfloat16 tensor"):
        linear_grads(x, w, grad, weight_grad_operands=fine)
