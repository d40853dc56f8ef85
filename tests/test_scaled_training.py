"""Scaled formats wherever a format goes: Quantizer, inject, OptimLP and the scaled recipes (MXFP8,
MXFP4, NVFP4) give bit for bit what lpsim.quantize gives for the same tensor, format and rule."""

from __future__ import annotations

from dataclasses import replace

import ml_dtypes
import numpy as np
import pytest
import torch
from torch import nn

import lpsim
from lpsim import Float, demo, recipes
from lpsim.nn import LayerQuantization, Quantizer, inject, injected
from lpsim.optim import OptimLP
from lpsim.scaled import Scaled, preset

MX = preset("mxfp8_e4m3")
NV = preset("nvfp4")


def _heavy(*shape, seed=0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g) * torch.exp2(3 * torch.randn(*shape, generator=g))


@pytest.mark.parametrize("fmt", [MX, NV, replace(MX, axis=0)])
def test_quantizer_rounds_forward_and_backward_as_quantize_does(fmt):
    q = Quantizer(forward=(fmt, "nearest"), backward=(fmt, "nearest"))
    x = _heavy(8, 64).requires_grad_()
    g = _heavy(8, 64, seed=1)
    y = q(x)
    y.backward(g)
    assert torch.equal(y, lpsim.quantize(x.detach(), fmt))
    assert torch.equal(x.grad, lpsim.quantize(g, fmt))


def test_inject_fake_quantises_weights_and_outputs_in_scaled_formats():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 16))
    inject(
        model,
        {nn.Linear: LayerQuantization(weight=MX, output=NV, rounding="nearest"), "default": None},
    )
    assert torch.equal(
        model[0].weight, lpsim.quantize(model[0].parametrizations.weight.original, MX)
    )
    x = _heavy(4, 64)
    hidden = lpsim.quantize(nn.functional.linear(x, model[0].weight, model[0].bias), NV)
    assert torch.equal(model[1](model[0](x)), torch.relu(hidden))


def test_optimlp_rounds_gradients_momentum_and_weights_in_scaled_formats():
    torch.manual_seed(0)
    model = nn.Linear(64, 8)
    reference = nn.Linear(64, 8)
    reference.load_state_dict(model.state_dict())
    opt = OptimLP(
        torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9),
        weight=(MX, "nearest"),
        grad=(NV, "nearest"),
        momentum=(MX, "nearest"),
    )
    plain = torch.optim.SGD(reference.parameters(), lr=0.5, momentum=0.9)
    for step in range(3):
        x = _heavy(4, 64, seed=step)
        for m in (model, reference):
            m(x).square().sum().backward()
        opt.step()
        with torch.no_grad():
            for p in reference.parameters():
                p.grad.copy_(lpsim.quantize(p.grad, NV))
        plain.step()
        with torch.no_grad():
            for p in reference.parameters():
                buffer = plain.state[p]["momentum_buffer"]
                buffer.copy_(lpsim.quantize(buffer, MX))
                p.copy_(lpsim.quantize(p, MX))
        model.zero_grad()
        reference.zero_grad()
        for p, r in zip(model.parameters(), reference.parameters(), strict=True):
            assert torch.equal(p, r), step


@pytest.mark.parametrize("recipe", [recipes.MXFP8, recipes.MXFP4, recipes.NVFP4])
def test_scaled_recipes_quantise_the_operands_of_the_inner_weight_layers_only(recipe):
    torch.manual_seed(0)
    model = demo.small_cnn()
    weights = [p.detach().clone() for p in model.parameters()]
    model, opt = recipe.apply(model, torch.optim.SGD(model.parameters(), lr=0.1))
    first, last = recipes.edge_layers(model)
    done = {name: d for name, _, d in injected(model)}
    assert first not in done and last not in done and done
    for d in done.values():
        assert d["type"] in ("Conv2d", "Linear") and not d["bias"] and d["output"] is None
        # blocks along the reduction axis: the channels of a Conv2d's input (axis -3), the
        # features (last axis) of a Linear's
        axis = -3 if d["type"] == "Conv2d" else -1
        assert d["input"].format.axis == axis and d["error"].format.axis == axis
    x, y = torch.randn(8, 1, 8, 8), torch.randint(10, (8,))
    nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
    # Full-precision master weights: the stored parameters are not on the format's grid, and
    # the step moved them.
    for p in lpsim.nn.quantized_parameters(model):
        assert opt.parameter_settings(p).weight is None
        assert not torch.equal(p, lpsim.quantize(p.detach(), recipe.weight[0]))
    assert any(not torch.equal(a, b) for a, b in zip(weights, model.parameters(), strict=False))


class _AttentionBetweenLinears(nn.Module):
    def __init__(self, width: int = 64):
        super().__init__()
        self.first = nn.Linear(width, width)
        self.attention = nn.MultiheadAttention(width, 4)
        self.last = nn.Linear(width, width)

    def forward(self, x):
        h = self.first(x)
        return self.last(self.attention(h, h, h, need_weights=False)[0])


def test_a_multihead_attention_under_a_scaled_recipe_leaves_its_context_in_full_precision():
    # As Recipe's docstring says: the attention's inputs and its in and out projections' weights
    # are quantised, the out projection's input (the context) is not. torch's own attention with
    # those operands quantised gives the recipe's output bit for bit.
    torch.manual_seed(0)
    model = _AttentionBetweenLinears()
    plain = _AttentionBetweenLinears()
    plain.load_state_dict(model.state_dict())
    recipe = recipes.MXFP8.along(-1)
    model, _ = recipe.apply(model, torch.optim.SGD(model.parameters(), lr=0.1))
    x = _heavy(8, 2, 64)
    fmt, rule = recipe.activation
    with torch.no_grad():
        attention = plain.attention
        h = lpsim.quantize(plain.first(x), fmt, rule)
        context_out = nn.functional.multi_head_attention_forward(
            *(h, h, h, 64, 4),
            lpsim.quantize(attention.in_proj_weight, fmt, rule),
            attention.in_proj_bias,
            *(None, None, False, 0.0),
            lpsim.quantize(attention.out_proj.weight, fmt, rule),
            attention.out_proj.bias,
            training=False,
            need_weights=False,
        )[0]
        assert torch.equal(model(x), plain.last(context_out))


class _ConvThenTokens(nn.Module):
    """A convolution over (batch, channel, length), then Linear layers over (batch, token,
    channel): the convolution reduces over axis 1, the Linear layers over axis -1."""

    def __init__(self, width: int = 32):
        super().__init__()
        self.stem = nn.Conv1d(width, width, 3, padding=1)
        self.conv = nn.Conv1d(width, width, 3, padding=1)
        self.mixer = nn.Linear(width, width)
        self.head = nn.Linear(width, width)

    def forward(self, x):
        h = self.conv(self.stem(x)).transpose(1, 2)
        return self.head(self.mixer(h))


def test_scaled_recipes_block_each_weight_layer_along_its_reduction_axis():
    # A Linear layer's (batch, token, channel) input and weight are blocked along the channels
    # (axis -1), a convolution's along axis 1, in one model, without Recipe.along: bit for bit
    # against lpsim.quantize placed by hand with those axes.
    torch.manual_seed(0)
    model, plain = _ConvThenTokens(), _ConvThenTokens()
    plain.load_state_dict(model.state_dict())
    recipe = recipes.MXFP8
    model, _ = recipe.apply(model, torch.optim.SGD(model.parameters(), lr=0.1))
    fmt, rule = recipe.activation
    assert fmt.axis == 1

    def q(t, axis):
        return lpsim.quantize(t, replace(fmt, axis=axis), rule)

    x = _heavy(2, 32, 40)  # 40 tokens; 32 channels: one block per token
    with torch.no_grad():
        h = plain.stem(x)
        h = nn.functional.conv1d(q(h, 1), q(plain.conv.weight, 1), plain.conv.bias, padding=1)
        h = h.transpose(1, 2)
        h = nn.functional.linear(q(h, -1), q(plain.mixer.weight, -1), plain.mixer.bias)
        assert torch.equal(model(x), plain.head(h))
        # Blocks along the tokens (axis 1 of the Linear's input) give other values.
        wrong = nn.functional.linear(q(h, 1), q(plain.head.weight, -1), plain.head.bias)
        assert not torch.equal(wrong, nn.functional.linear(q(h, -1), plain.head.weight))


def test_scaled_recipes_block_an_unbatched_convolutions_input_along_its_channels():
    # nn.Conv1d takes unbatched (channel, length) inputs: the channels are axis -2 (0 here), not
    # axis 1 (the length).
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Conv1d(32, 32, 3, padding=1) for _ in range(3)))
    plain = nn.Sequential(*(nn.Conv1d(32, 32, 3, padding=1) for _ in range(3)))
    plain.load_state_dict(model.state_dict())
    recipe = recipes.MXFP8
    model, _ = recipe.apply(model, torch.optim.SGD(model.parameters(), lr=0.1))
    fmt, rule = recipe.activation
    x = _heavy(32, 40)
    with torch.no_grad():
        h = lpsim.quantize(plain[0](x), replace(fmt, axis=0), rule)
        w = lpsim.quantize(plain[1].weight, replace(fmt, axis=1), rule)
        h = nn.functional.conv1d(h, w, plain[1].bias, padding=1)
        assert torch.equal(model(x), plain[2](h))


def test_scaled_recipes_quantise_a_linear_layers_errors_along_its_output_features():
    # The error into a Linear layer's (batch, token, out) output is blocked along out (axis -1),
    # the reduction of the input-gradient product: its gradient equals the float product with the
    # error quantised by hand along -1.
    torch.manual_seed(0)
    layers = nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 32), nn.Linear(32, 32))
    plain = nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 32), nn.Linear(32, 32))
    plain.load_state_dict(layers.state_dict())
    recipe = replace(recipes.MXFP8, error=(recipes.MXFP8.error[0], "nearest"))
    model, _ = recipe.apply(layers, torch.optim.SGD(layers.parameters(), lr=0.1))
    fmt, rule = recipe.activation
    efmt, erule = recipe.error
    x = _heavy(2, 40, 32).requires_grad_(True)
    upstream = _heavy(2, 40, 32)
    out = model(x)
    (out * upstream).sum().backward()
    with torch.no_grad():
        h0 = plain[0](x)
        hq = lpsim.quantize(h0, replace(fmt, axis=-1), rule)
        # error into the middle layer's output: upstream times the last layer's weight
        e2 = upstream @ plain[2].weight
        eq = lpsim.quantize(e2, replace(efmt, axis=-1), erule)
        grad_w = eq.reshape(-1, 32).T @ hq.reshape(-1, 32)
        assert torch.equal(model[1].parametrizations.weight.original.grad, grad_w)


@pytest.mark.parametrize("recipe", [recipes.MXFP4])
def test_stochastically_rounded_recipe_errors_are_unbiased_at_the_block_maximum(recipe):
    # Each row one block of 32 (axis 1) whose largest element, 7.5, lies above 6 times a floor
    # scale: a floor-scaled stochastic rounding would saturate it at 6 times the scale.
    fmt, rounding = recipe.error
    assert rounding == "stochastic"
    row = torch.linspace(-1.0, 1.0, 32)
    row[0] = 7.5
    x = row.repeat(4000, 1)
    y = lpsim.quantize(x, fmt, rounding, seed=0).double()
    mean, standard_error = y.mean(0), y.std(0) / len(y) ** 0.5
    assert ((mean - row.double()).abs() <= 5 * standard_error + 1e-12).all()


def test_recipe_along_moves_every_scaled_block_axis():
    moved = recipes.NVFP4.along(-1)
    assert recipes.NVFP4.blocks_along_reduction and not moved.blocks_along_reduction
    for name in ("weight", "activation", "error"):
        assert getattr(moved, name)[0].axis == -1
        assert getattr(moved, name)[0] == replace(getattr(recipes.NVFP4, name)[0], axis=-1)
    assert recipes.IBM8.along(-1) == recipes.IBM8


def test_recipe_placement_is_checked():
    with pytest.raises(
        ValueError, match=r"Recipe.placement must be one of \('outputs', 'operands'\)"
    ):
        recipes.Recipe("x", placement="inputs")


@pytest.mark.parametrize(("name", "rounding"), [("nvfp4", "nearest"), ("mxfp4_e2m1", "stochastic")])
def test_scaled_quantize_runs_under_torch_compile_fullgraph_bit_for_bit(name, rounding):
    fmt = preset(name)

    @torch.compile(fullgraph=True)
    def step(x):
        return lpsim.quantize(x * 2, fmt, rounding, seed=3) + 1

    @torch.compile(fullgraph=True)
    def in_place(x):
        lpsim.quantize_(x, fmt, rounding, seed=3)
        return x

    x = _heavy(4, 64).requires_grad_()
    y = step(x)
    assert torch.equal(y, lpsim.quantize(x.detach() * 2, fmt, rounding, seed=3) + 1)
    y.sum().backward()
    assert torch.equal(x.grad, torch.full_like(x, 2.0))  # straight through, times 2
    z = _heavy(4, 64, seed=1)
    assert torch.equal(in_place(z.clone()), lpsim.quantize(z, fmt, rounding, seed=3))


def test_a_scaled_recipe_placed_on_outputs_blocks_each_bias_along_its_one_axis():
    # Under placement="outputs" the biases are quantised by the weight's format; a convolution's
    # reduction axis (-3 for Conv2d) does not exist in its 1-D bias, which is blocked along its
    # one axis instead.
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Conv2d(32, 32, 3, padding=1) for _ in range(3)))
    biases = [layer.bias.detach().clone() for layer in model]
    recipe = replace(recipes.MXFP8, placement="outputs")
    model, _ = recipe.apply(model, torch.optim.SGD(model.parameters(), lr=0.1))
    fmt, rule = recipe.weight
    assert torch.equal(model[1].bias, lpsim.quantize(biases[1], replace(fmt, axis=-1), rule))
    model(_heavy(2, 32, 4, 4)).sum().backward()


@pytest.mark.parametrize("recipe", [recipes.MXFP8, recipes.MXFP8.along(1)], ids=["mxfp8", "along1"])
def test_a_scaled_recipe_placed_on_outputs_blocks_one_axis_parameters_along_that_axis(recipe):
    # Under placement="outputs" every other layer's weight and bias take the weight's format;
    # a LayerNorm's, a BatchNorm's and a PReLU's are 1-D, without the recipe's axis 1: they are
    # blocked along their one axis (before, the first forward pass raised an IndexError naming no
    # layer), while the outputs keep the recipe's axis.
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(64, 64), nn.LayerNorm(64), nn.BatchNorm1d(64), nn.PReLU(64), nn.Linear(64, 64)
    )
    with torch.no_grad():
        for layer in model[1:4]:
            layer.weight.normal_()
    originals = {i: model[i].weight.detach().clone() for i in (1, 2, 3)}
    recipe = replace(recipe, placement="outputs")
    model, _ = recipe.apply(model, torch.optim.SGD(model.parameters(), lr=0.1))
    fmt, rule = recipe.weight
    for i, weight in originals.items():
        assert torch.equal(model[i].weight, lpsim.quantize(weight, replace(fmt, axis=-1), rule))
    model(_heavy(8, 64)).sum().backward()


@pytest.mark.parametrize(("along", "axis"), [(None, 1), (-1, -1)])
def test_a_scaled_recipe_placed_on_outputs_blocks_other_layers_outputs_along_its_own_axis(
    along, axis
):
    # A (batch, token, channel) activation after a GELU keeps the recipe's axis 1 (the tokens)
    # under placement="outputs", as docs/training.md says; along(-1) moves it to the channels.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 8))
    recipe = replace(recipes.MXFP8, placement="outputs")
    recipe = recipe if along is None else recipe.along(along)
    model, _ = recipe.apply(model, torch.optim.SGD(model.parameters(), lr=0.1))
    seen = {}
    model[2].register_forward_hook(lambda m, args, out: seen.update(x=args[0], out=out))
    model(_heavy(2, 40, 64))
    fmt, rule = recipe.activation
    expected = lpsim.quantize(nn.functional.gelu(seen["x"]), replace(fmt, axis=axis), rule)
    assert torch.equal(seen["out"], expected)


class _Decoder(nn.Module):
    """A convolution, two transposed convolutions and a convolution: the inner transposed
    convolution is a weight layer of the scaled recipes."""

    def __init__(self, width: int = 32):
        super().__init__()
        self.stem = nn.Conv2d(width, width, 3, padding=1)
        self.up = nn.ConvTranspose2d(width, width, 2, stride=2)
        self.head = nn.Conv2d(width, width, 1)

    def forward(self, x):
        return self.head(self.up(self.stem(x)))


@pytest.mark.parametrize("recipe", [recipes.MXFP8, recipes.NVFP4])
def test_scaled_recipes_quantise_an_inner_transposed_convolution_along_its_input_channels(recipe):
    # A transposed convolution multiplies its (batch, in, *spatial) input by its (in, out,
    # *kernel) weight, summing over in: both are blocked along in (axis -3 of the input, -4 of the
    # weight), and the error into its (batch, out, *spatial) output along out (axis -3), the
    # input-gradient product's reduction. Once, the recipes left it in full precision.
    torch.manual_seed(0)
    model, plain = _Decoder(), _Decoder()
    plain.load_state_dict(model.state_dict())
    recipe = replace(recipe, error=(recipe.error[0], "nearest"))
    model, _ = recipe.apply(model, torch.optim.SGD(model.parameters(), lr=0.1))
    (fmt, rule), (efmt, erule) = recipe.activation, recipe.error

    def q(t, f, axis, r):
        return lpsim.quantize(t, replace(f, axis=axis), r)

    x = _heavy(2, 32, 3, 3)
    upstream = _heavy(2, 32, 6, 6, seed=1)
    (model(x) * upstream).sum().backward()
    h = plain.stem(x).detach().requires_grad_()
    weight = plain.up.weight.detach().requires_grad_()
    w = q(weight, fmt, -4, rule)
    y = nn.functional.conv_transpose2d(q(h, fmt, -3, rule), w, plain.up.bias, stride=2)
    assert torch.equal(model.head(model.up(model.stem(x))), plain.head(y))
    error = torch.autograd.grad((plain.head(y) * upstream).sum(), y)[0]
    hq = q(h.detach(), fmt, -3, rule)
    expected = torch.autograd.grad(
        nn.functional.conv_transpose2d(hq, weight, stride=2), weight, q(error, efmt, -3, erule)
    )[0]
    # The straight-through weight gradient: the quantised error times the quantised input.
    assert torch.equal(model.up.parametrizations.weight.original.grad, expected)


@pytest.mark.parametrize("placement", ["operands", "outputs"])
def test_a_scaled_recipe_that_rounds_weights_rounds_each_with_the_blocks_forward_uses(placement):
    # With round_weights the optimizer rounds every parameter the model fake-quantises, with the
    # blocks forward quantises it in (along the layer's reduction axis; a bias along its one
    # axis), so that the stored weights are what forward multiplies. Once, the optimizer rounded
    # them all along the recipe's own axis: a transposed convolution's (in, out, *kernel) weight
    # along out, then forward along in, and a bias along axis 1, which it does not have.
    torch.manual_seed(0)
    model = _Decoder()
    recipe = replace(recipes.MXFP8, round_weights=True, placement=placement)
    model, opt = recipe.apply(model, torch.optim.SGD(model.parameters(), lr=0.1))
    (model(_heavy(2, 32, 3, 3)) * _heavy(2, 32, 6, 6, seed=1)).sum().backward()
    weight = model.up.parametrizations.weight.original
    stepped = weight.detach() - 0.1 * weight.grad
    opt.step()
    fmt, rule = recipe.weight
    assert torch.equal(weight, lpsim.quantize(stepped, replace(fmt, axis=-4), rule))
    assert torch.equal(model.up.weight, weight)  # forward multiplies the stored weight
    if placement == "outputs":
        bias = model.up.parametrizations.bias.original
        assert torch.equal(model.up.bias, bias)
        assert torch.equal(bias, lpsim.quantize(bias.detach(), replace(fmt, axis=-1), rule))


def test_blocks_along_reduction_blocks_an_attentions_out_projection_along_its_inputs():
    # The out projection's (out, in) weight is a Linear weight: with blocks_along_reduction its
    # blocks run along in (axis -1), as the in projection's do, whatever the recipe's own axis.
    # Once, it kept the recipe's axis (0 here: blocks along the output features).
    fmt = replace(preset("mxfp4_e2m1"), axis=0)
    recipe = recipes.Recipe(
        "rows",
        weight=(fmt, "nearest"),
        activation=(fmt, "nearest"),
        placement="operands",
        round_weights=False,
        blocks_along_reduction=True,
    )
    model = _AttentionBetweenLinears()
    attention = model.attention
    with torch.no_grad():  # magnitudes that vary within rows and columns
        attention.in_proj_weight.copy_(_heavy(192, 64, seed=2))
        attention.out_proj.weight.copy_(_heavy(64, 64, seed=3))
    weights = [w.detach().clone() for w in (attention.in_proj_weight, attention.out_proj.weight)]
    model, _ = recipe.apply(model, torch.optim.SGD(model.parameters(), lr=0.1))
    for quantised, weight in zip([attention.in_proj_weight, attention.out_proj.weight], weights):
        expected = lpsim.quantize(weight, replace(fmt, axis=-1), "nearest")
        assert not torch.equal(expected, lpsim.quantize(weight, fmt, "nearest"))
        assert torch.equal(quantised, expected)


def test_a_recipe_that_rounds_weights_in_tiles_rounds_them_in_the_same_tiles():
    # Tiles and whole-tensor blocks have no axis to move: the optimizer rounds by the recipe's
    # weight format as forward quantises by it.
    fmt = replace(preset("fp8_e4m3_128x128"), block=(4, 4))
    recipe = recipes.Recipe("tiles", weight=(fmt, "nearest"), placement="operands")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8))
    model, opt = recipe.apply(model, torch.optim.SGD(model.parameters(), lr=0.1))
    model(_heavy(4, 8)).sum().backward()
    opt.step()
    weight = model[1].parametrizations.weight.original
    assert torch.equal(weight, lpsim.quantize(weight.detach(), fmt, "nearest"))
    assert torch.equal(model[1].weight, weight)


def test_a_scaled_recipe_with_weights_in_tiles_keeps_the_tiles_on_convolutions_and_along():
    # Tiles run along no axis: blocks_along_reduction (a convolution's channels, -3) and along()
    # leave them as they are. Before, both moved the tiles' axis, which Scaled refuses
    # (ValueError: axis must be -1), so the recipe could not be applied to a convolution.
    tiles = (Scaled(lpsim.preset("e4m3fn"), Float(8, 23), (4, 4)), "nearest")
    recipe = replace(recipes.MXFP8, weight=tiles)
    assert recipe.along(0).weight == tiles
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Conv2d(8, 8, 3, padding=1) for _ in range(3)))
    inner = model[1].weight.detach().numpy().astype(np.float32)
    model, _ = recipe.apply(model, torch.optim.SGD(model.parameters(), lr=0.1))
    model(_heavy(1, 8, 4, 4)).sum().backward()
    # Each 3 x 3 kernel is one (4, 4) tile of the last two dimensions: s = amax / 448 in float32,
    # element = x * (1 / s) rounded to nearest E4M3 (ml_dtypes, saturating at 448), value * s.
    amax = np.abs(inner).max(axis=(2, 3), keepdims=True)
    s = amax / np.float32(448)
    elements = np.clip(inner * (np.float32(1) / s), -448, 448).astype(ml_dtypes.float8_e4m3fn)
    expected = torch.from_numpy(elements.astype(np.float32) * s)
    assert torch.equal(model[1].weight.detach(), expected)


def test_weights_that_forward_quantises_in_another_format_keep_the_recipes_in_the_optimizer():
    # Only a weight that forward quantises in the recipe's own format, its blocks along another
    # axis, takes forward's blocks in the optimizer; given layers with other formats leave the
    # optimizer the recipe's weight format as it is.
    recipe = replace(recipes.MXFP8, round_weights=True)
    other = (replace(preset("mxfp4_e2m1"), axis=0), "nearest")
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    layers = {nn.Linear: LayerQuantization(weight=other)}
    model, opt = recipe.apply(model, torch.optim.SGD(model.parameters(), lr=0.1), layers=layers)
    for layer in model:
        setting = opt.parameter_settings(layer.parametrizations.weight.original).weight
        assert (setting.format, setting.rounding.name) == recipe.weight


def test_fp8_tensor_scaling_takes_amax_over_max_where_transformer_engine_takes_its_inverse():
    """fp8_e4m3_tensor (the GPT's fp8-current operands) rounds x * (1 / s), s = amax / 448, and
    decodes with s; Transformer Engine's current scaling rounds x * S, S = 448 / amax, and
    decodes with 1 / S. Elements agree but for a rare few; for many amaxes most nonzero decoded
    values differ by a float32 ulp or two, which docs/formats.md states instead of claiming
    Transformer Engine's arithmetic."""
    from pathlib import Path

    def e4m3(y):  # torch's saturating cast, round to nearest even
        return y.clamp(-448, 448).to(torch.float8_e4m3fn).float()

    x = _heavy(64, 64, seed=7)
    x = x / x.abs().amax() * 10
    x[0, 0] = -11.0  # an amax whose 1 / (448 / amax) is not amax / 448 in float32
    amax = x.abs().amax()
    s = amax / torch.tensor(448.0)
    ours = lpsim.quantize(x, preset("fp8_e4m3_tensor"))
    assert torch.equal(ours, e4m3(x * (1 / s)) * s)
    big = torch.tensor(448.0) / amax
    te = e4m3(x * big) * (1 / big)
    assert torch.equal(e4m3(x * big), e4m3(x * (1 / s)))  # the elements here
    up, down = torch.nextafter(ours, ours + 1), torch.nextafter(ours, ours - 1)
    up, down = torch.nextafter(up, up + 1), torch.nextafter(down, down - 1)
    assert ((down <= te) & (te <= up)).all()  # two float32 steps at most
    assert (te != ours)[ours != 0].float().mean() > 0.5
    text = Path(__file__).parent.parent.joinpath("docs", "formats.md").read_text()
    paragraph = text[text.index("The FP8 presets with float32 scales") :].split("\n\n")[0]
    assert "decode with 1 / S" in paragraph and "units in the last place" in paragraph
    assert "r = 1 / s and multiply, as Transformer Engine" not in " ".join(paragraph.split())


def test_training_docs_recipe_table_gives_each_scaled_recipes_formats_and_rules():
    """docs/training.md's recipe table names each scaled recipe's weight, activation and error
    format (a scaled preset, "(rule)" where its scale rule is not the preset's) and rounding
    rule: what the recipe holds, its blocks along the channels (axis 1)."""
    from pathlib import Path

    text = Path(__file__).parent.parent.joinpath("docs", "training.md").read_text()
    rows = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 8 and cells[0].strip("`") in ("MXFP8", "MXFP4", "NVFP4"):
            rows[cells[0].strip("`")] = cells[1:4]
    assert set(rows) == {"MXFP8", "MXFP4", "NVFP4"}
    for name, cells in rows.items():
        recipe = getattr(recipes, name)
        for cell, (fmt, rule) in zip(cells, (recipe.weight, recipe.activation, recipe.error)):
            words = cell.split()
            expected = replace(preset(words[0]), axis=1)
            if len(words) == 3:
                expected = replace(expected, scale_rule=words[1].strip("()"))
            assert (fmt, rule) == (expected, words[-1]), (name, cell)


def test_round_weights_docs_name_the_formats_whose_second_rounding_moves_stored_weights():
    """With round_weights and an NVFP4 weight the optimizer stores the rounded weights, whose
    amax (and so the tensor scale forward recomputes) the rounding moved: forward multiplies a
    second rounding, different in many elements. MXINT8 likewise, where an element -2 doubles its
    block's scale, and a DelayedScaling, whose optimizer and forward scalers differ. Recipe's
    docstring and docs/training.md say so (the formats whose own values come back unchanged keep
    stored and multiplied weights equal)."""
    from pathlib import Path

    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64)
    )
    recipe = replace(recipes.NVFP4, round_weights=True)
    model, optimizer = recipe.apply(model, torch.optim.SGD(model.parameters(), lr=0.1))
    x = torch.randn(32, 64)
    moved = 0
    for _ in range(3):
        model(x).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        stored = model[2].parametrizations.weight.original
        moved = max(moved, int((model[2].weight != stored).sum()))
    assert moved > 0
    block = torch.tensor([[-1.995] + [0.3] * 31])
    once = lpsim.quantize(block, preset("mxint8"))
    assert once[0, 0] == -2 and lpsim.quantize(once, preset("mxint8"))[0, 1] == 0.3125 != once[0, 1]
    from lpsim.delayed_scaling import DelayedScaling

    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64)
    )
    delayed = (DelayedScaling(lpsim.Float(4, 3, special="fn")), "nearest")
    recipe = recipes.Recipe("delayed", weight=delayed, placement="operands")
    model, optimizer = recipe.apply(model, torch.optim.SGD(model.parameters(), lr=0.1))
    model(torch.randn(32, 64)).square().mean().backward()
    optimizer.step()
    model.eval()  # reading the weight records nothing
    stored = model[2].parametrizations.weight.original
    assert (model[2].weight != stored).any()
    said = " ".join(recipes.Recipe.__doc__.split())
    assert "tensor scale" in said and "MXINT8" in said and "DelayedScaling" in said
    text = " ".join(
        Path(__file__).parent.parent.joinpath("docs", "training.md").read_text().split()
    )
    assert "second rounding of the stored weights" in text
