"""lpsim.compat.qtorch: QPyTorch 0.3's names, signatures and defaults (stochastic rounding,
saturating formats with QPyTorch's ranges), with the documented ties-to-even."""

import inspect
import math

import torch

import lpsim
from lpsim.compat import qtorch as q
from support import assert_same_bits


def test_signatures_are_qtorch_0_3():
    names = lambda f: list(inspect.signature(f).parameters)  # noqa: E731
    assert names(q.float_quantize)[:4] == ["x", "exp", "man", "rounding"]
    assert names(q.fixed_point_quantize)[:6] == ["x", "wl", "fl", "clamp", "symmetric", "rounding"]
    assert names(q.block_quantize)[:4] == ["x", "wl", "dim", "rounding"]
    for f in (q.float_quantize, q.fixed_point_quantize, q.block_quantize):
        assert inspect.signature(f).parameters["rounding"].default == "stochastic"
    assert inspect.signature(q.BlockFloatingPoint).parameters["dim"].default == -1


def test_floating_point_has_qtorch_range_and_saturates():
    fmt = q.FloatingPoint(5, 2).format
    assert fmt.max == 114688.0  # the top exponent code is finite
    x = torch.tensor([1e6, -1e6, math.inf, -math.inf, math.nan, 1e-6])
    y = q.float_quantize(x, 5, 2, "nearest")
    assert y[:4].tolist() == [114688.0, -114688.0, 114688.0, -114688.0]
    assert math.isnan(y[4].item())  # QPyTorch's kernels return +/-max for NaN; lpsim keeps NaN
    assert y[5].item() == 2.0**-16 * round(1e-6 / 2.0**-16)  # subnormals exist


def test_nearest_ties_to_even_as_documented():
    # 1.125 and 1.375 are ties between values of e5m2 (spacing 0.25 above 1).
    y = q.float_quantize(torch.tensor([1.125, 1.375, -1.125]), 5, 2, "nearest")
    assert y.tolist() == [1.0, 1.5, -1.0]
    f = q.fixed_point_quantize(torch.tensor([0.125, 0.375]), 8, 2, rounding="nearest")
    assert f.tolist() == [0.0, 0.5]


def test_default_rounding_is_stochastic_and_seedable():
    x = torch.full((4096,), 1.1)
    torch.manual_seed(0)
    a = q.float_quantize(x, 5, 2)
    assert set(a.unique().tolist()) == {1.0, 1.25}
    assert_same_bits(q.float_quantize(x, 5, 2, seed=3), q.float_quantize(x, 5, 2, seed=3))


def test_block_dim_minus_one_is_the_whole_tensor():
    x = torch.randn(8, 16)
    assert_same_bits(q.block_quantize(x, 6, -1, "nearest"), lpsim.quantize(x, lpsim.BlockFloat(6)))
    assert_same_bits(q.block_quantize(x, 6, 0, "nearest"), lpsim.quantize(x, lpsim.BlockFloat(6, 0)))


def test_fixed_point_matches_lpsim_fixed():
    x = torch.randn(300) * 4
    assert_same_bits(q.fixed_point_quantize(x, 8, 4, clamp=True, symmetric=True, rounding="nearest"),
                     lpsim.quantize(x, lpsim.Fixed(8, 4, symmetric=True)))


def test_number_reprs_and_equality_follow_qtorch():
    assert repr(q.FloatingPoint(8, 7)) == "FloatingPoint (exponent=8, mantissa=7)"
    assert repr(q.FixedPoint(8, 4)) == "FixedPoint (wl=8, fl=4)"
    assert repr(q.BlockFloatingPoint(8)) == "BlockFloatingPoint (wl=8, dim=-1)"
    assert q.FloatingPoint(5, 2) == q.FloatingPoint(5, 2) != q.FloatingPoint(4, 3)


def _qtorch():
    import warnings

    import pytest

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return pytest.importorskip("qtorch"), pytest.importorskip("qtorch.quant"), \
            pytest.importorskip("qtorch.optim"), pytest.importorskip("qtorch.auto_low")


def test_training_names_have_qtorch_signatures():
    qtorch, quant, optim, auto_low = _qtorch()
    pairs = [(q.quantizer, quant.quantizer), (q.Quantizer, quant.Quantizer),
             (q.OptimLP, optim.OptimLP), (q.lower, auto_low.lower),
             (q.sequential_lower, auto_low.sequential_lower),
             (q.float_quantize, quant.float_quantize),
             (q.fixed_point_quantize, quant.fixed_point_quantize),
             (q.block_quantize, quant.block_quantize)]
    for ours, theirs in pairs:
        mine = [p for p in inspect.signature(ours).parameters.values() if p.kind != p.KEYWORD_ONLY]
        names = list(inspect.signature(theirs).parameters)
        assert [p.name for p in mine] == names, ours


def test_lower_quantises_outputs_and_errors_of_the_named_layer_types():
    model = torch.nn.Sequential(torch.nn.Linear(6, 6), torch.nn.ReLU(), torch.nn.Linear(6, 2))
    q.lower(model, ["activation"], q.FixedPoint(8, 6), q.FixedPoint(8, 6), "nearest", "nearest")
    seen = []
    model[2].register_forward_pre_hook(lambda m, args: seen.append(args[0]))
    model(torch.randn(5, 6))
    assert torch.equal(lpsim.quantize(seen[0], lpsim.Fixed(8, 6)), seen[0])
    assert len(lpsim.nn.injected(model)) == 1  # only the ReLU (exact type match)


def test_sequential_lower_wraps_a_copy_and_leaves_the_model_alone():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Sequential(torch.nn.Linear(4, 2)))
    lowered = q.sequential_lower(model, ["linear"], q.FloatingPoint(5, 2))
    assert isinstance(lowered[0], torch.nn.Sequential) and isinstance(lowered[0][1], q.Quantizer)
    assert isinstance(lowered[1][0], torch.nn.Sequential)
    assert isinstance(model[0], torch.nn.Linear)
    x = torch.randn(3, 4)
    out = lowered(x)
    assert torch.equal(lpsim.quantize(out, q.FloatingPoint(5, 2).format), out)


def test_optim_lp_takes_quantisation_functions():
    model = torch.nn.Linear(4, 2)
    weight_quant = q.quantizer(q.FloatingPoint(5, 2), forward_rounding="nearest")
    opt = q.OptimLP(torch.optim.SGD(model.parameters(), lr=0.1), weight_quant=weight_quant,
                    grad_scaling=0.5)
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    w = model.weight.detach()
    assert torch.equal(lpsim.quantize(w, q.FloatingPoint(5, 2).format), w)
